"""Dense codecs: fp32, fp16, bf16 casts and blockwise absmax int8 / int4 quantization.

Dense means every value is sent, so a mean can be reduced part-wise (reduce-scatter + all-gather): the owner of a
part decodes its peers' slices, averages in fp32 and re-encodes.

Documented round-trip error bounds (x a finite input value, x' its decoded value):
- fp32: exact.
- fp16: |x - x'| <= 2^-11 |x| for |x| >= 2^-14, <= 2^-25 below (subnormals); |x| > 65504 is a CodecError
  (fp16 has no room for it, and a silent inf/saturation would poison the average).
- bf16: |x - x'| <= 2^-8 |x| for normal values; a value that rounds past the bf16 range is a CodecError.
- int8 (blockwise absmax, block B): scale = max|block| / 127 in fp32, q = round(x / scale) in [-127, 127];
  |x - x'| <= scale / 2 (+ fp32 rounding of one product, and an absolute 2^-126 floor for blocks whose scale
  falls into the subnormal range).
- int4: the same with 7 levels each side: scale = max|block| / 7, |x - x'| <= scale / 2 (+ the same slack).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

from farloco.optim.ranges import run_ranges
from farloco.optim.wire import (
    Codec,
    CodecError,
    Header,
    all_finite,
    ceil_div,
    nonfinite_error,
    positive_int_option,
    section,
    wire_ratio,
)


def _load_kernels() -> ModuleType | None:
    """The optional C kernels (optim/_kernels.c), or None where they were not built or FARLOCO_NO_KERNELS=1."""
    if os.environ.get("FARLOCO_NO_KERNELS", "") not in ("", "0"):
        return None
    try:
        from farloco.optim import _kernels  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _kernels  # type: ignore[no-any-return]


# One-pass quantization: the same bytes and values as the torch path below (tests/unit/test_kernels.py).
KERNELS = _load_kernels()


def _quantize(x: Any, block: int, levels: float, scales: Any, codes: Any) -> int:
    """KERNELS.quantize over contiguous runs of whole blocks (`farloco.optim.ranges`): the same bytes as one
    call. -1, or the first block holding a NaN/Inf."""
    numel, kernels = len(codes), KERNELS
    assert kernels is not None

    def run(first: int, last: int) -> int:
        low, high = first * block, min(last * block, numel)
        bad = kernels.quantize(x[low:high], block, levels, scales[first:last], codes[low:high], None)
        return int(bad) if bad < 0 else first + int(bad)

    found = [bad for bad in run_ranges(run, ceil_div(numel, block), 4 * numel) if bad >= 0]
    return min(found, default=-1)


def _dequantize(scales: Any, codes: Any, block: int, out: Any) -> int:
    """KERNELS.dequantize likewise (`scales` and `codes` may be raw bytes): -1, or the first block holding the
    code -128."""
    numel, kernels = len(codes), KERNELS
    assert kernels is not None
    scale_bytes = memoryview(scales).cast("B")

    def run(first: int, last: int) -> int:
        low, high = first * block, min(last * block, numel)
        bad = kernels.dequantize(scale_bytes[4 * first : 4 * last], codes[low:high], block, out[low:high])
        return int(bad) if bad < 0 else first + int(bad)

    found = [bad for bad in run_ranges(run, ceil_div(numel, block), 5 * numel) if bad >= 0]
    return min(found, default=-1)


class _CastCodec(Codec):
    """Sends the values cast to a float type; no header parameters."""

    dense = True
    wire_dtype: torch.dtype

    def estimated_ratio(self, numel: int) -> float:
        return wire_ratio(self.name, numel, self._body_bytes(numel, 0, 0, 0))

    def _header_params(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def _check_header(self, header: Header) -> None:
        if header.value_bits or header.block or header.k:
            raise CodecError(
                f"{self.name} header: expected value_bits=block=k=0, "
                f"got {header.value_bits}, {header.block}, {header.k}"
            )

    def _body_bytes(self, numel: int, value_bits: int, block: int, k: int) -> int:
        return numel * torch.empty((), dtype=self.wire_dtype).element_size()

    def _encode_sections(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        # fp32 is sent as the input's own memory; the one copy happens when the payload bytes are joined.
        out = tensor if self.wire_dtype == torch.float32 else tensor.to(self.wire_dtype)
        # One check on the wire values catches NaN/Inf input and values that overflowed the narrower type.
        if not all_finite(out):
            if not all_finite(tensor):
                raise nonfinite_error(f"{self.name} encode input", tensor)
            limit = torch.finfo(self.wire_dtype).max
            raise CodecError(
                f"{self.name} encode input range: expected |x| <= {limit:g} after rounding, "
                f"got max |x| = {float(tensor.abs().max()):g}"
            )
        return [out]

    def _decoded_from_sections(
        self, sections: list[torch.Tensor], numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        # The wire values were checked finite by _encode_sections; this is _decode_body's conversion.
        values = sections[0]
        if out is not None:
            return out.copy_(values)
        return values.clone() if self.wire_dtype == torch.float32 else values.to(torch.float32)

    def _decode_body(self, header: Header, body: memoryview) -> torch.Tensor:
        return self._decode_body_into(header, body, torch.empty(header.numel, dtype=torch.float32))

    def _decode_body_into(self, header: Header, body: memoryview, out: torch.Tensor) -> torch.Tensor:
        # Converted straight into `out` (a float32 copy for fp32: the bytes are immutable and shared), with no
        # float32 temporary of the payload's size beside it.
        values, _ = section(body, 0, header.numel, self.wire_dtype)
        out.copy_(values)
        if not all_finite(out):
            raise nonfinite_error(f"{self.name} payload values", out)
        return out


class Fp32Codec(_CastCodec):
    """Lossless: the raw float32 values."""

    name = "fp32"
    lossless = True
    # Tells farloco.protocol's exchange that the payload carries nothing but finite float32 values, so it may
    # send raw chunks without encode/decode (and their CRC and copies); see protocol.exchange.TensorCodec.
    raw_float32 = True
    wire_dtype = torch.float32


class Fp16Codec(_CastCodec):
    """IEEE half precision (round to nearest even); |x| > 65504 is refused."""

    name = "fp16"
    wire_dtype = torch.float16


class Bf16Codec(_CastCodec):
    """bfloat16: fp32's range with 8 bits of mantissa."""

    name = "bf16"
    wire_dtype = torch.bfloat16


class _BlockQuantCodec(Codec):
    """Blockwise absmax quantization to `levels` steps each side of zero.

    Body: fp32 scales (one per block, last block may be short), then the codes (int8: one byte per value;
    int4: two values per byte, low nibble first, code = q + 8 so a byte never holds the invalid -8).
    """

    dense = True
    levels: int
    bits: int

    def __init__(self, block_size: int) -> None:
        self.block_size = positive_int_option(self.name, "block_size", block_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"

    def estimated_ratio(self, numel: int) -> float:
        return wire_ratio(self.name, numel, self._body_bytes(numel, 0, self.block_size, 0))

    def _header_params(self) -> tuple[int, int, int]:
        return 0, self.block_size, 0

    def _check_header(self, header: Header) -> None:
        if header.block < 1 or header.value_bits or header.k:
            raise CodecError(
                f"{self.name} header: expected block >= 1 and value_bits=k=0, "
                f"got block={header.block}, value_bits={header.value_bits}, k={header.k}"
            )

    def _code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else ceil_div(numel, 2)

    def _body_bytes(self, numel: int, value_bits: int, block: int, k: int) -> int:
        return 4 * ceil_div(numel, block) + self._code_bytes(numel)

    def _scales(self, tensor: torch.Tensor, block: int) -> torch.Tensor:
        """Per-block absmax / levels; a NaN/Inf anywhere shows up as a non-finite scale."""
        numel = tensor.numel()
        num_full = numel // block
        lows, highs = [], []
        # amin and amax as two passes: torch's per-row aminmax is ~8x slower than both together (measured on
        # a 1 MiB chunk, 128-value blocks: 1.15 vs 0.14 ms); the values are the same.
        if num_full:
            rows = tensor[: num_full * block].view(num_full, block)
            lows.append(rows.amin(dim=1))
            highs.append(rows.amax(dim=1))
        if numel % block:
            tail = tensor[num_full * block :].view(1, -1)
            lows.append(tail.amin(dim=1))
            highs.append(tail.amax(dim=1))
        if not lows:
            return torch.empty(0)
        # max(-min, max) is the absmax; NaN propagates through aminmax, so the check below sees it.
        # abs_: an all-zero block gives max(-0.0, 0.0), which may be -0.0; its scale is +0.0 (as the C kernel's).
        absmax = torch.maximum(torch.cat(lows).neg_(), torch.cat(highs)).abs_()
        if not all_finite(absmax):
            raise nonfinite_error(f"{self.name} encode input", tensor)
        return absmax.div_(self.levels)

    def _quantize(self, tensor: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
        """Codes q = round(x / scale) in [-levels, levels], as float32 (one temporary of numel values)."""
        numel = tensor.numel()
        # An all-zero block has scale 0: divide by 1 instead so its codes are 0, not NaN.
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.empty(numel, dtype=torch.float32)
        num_full = numel // block
        if num_full:
            head = slice(0, num_full * block)
            torch.div(
                tensor[head].view(num_full, block), safe[:num_full, None], out=q[head].view(num_full, block)
            )
        if numel % block:
            torch.div(tensor[num_full * block :], safe[num_full], out=q[num_full * block :])
        return q.round_().clamp_(-self.levels, self.levels)

    def _dequantize(self, q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
        numel = q.numel()
        # Codes to float32 first (exact), then scale in place: the same single rounding per value as a mixed
        # int8 * float32 multiply, at half its cost (measured: 0.16 vs 0.33 ms per MiB).
        out = q.to(torch.float32, copy=True)
        num_full = numel // block
        if num_full:
            out[: num_full * block].view(num_full, block).mul_(scales[:num_full, None])
        if numel % block:
            out[num_full * block :].mul_(scales[num_full])
        return out

    def _check_scales(self, scales: torch.Tensor) -> None:
        bad = ~(torch.isfinite(scales) & (scales >= 0))  # scales are few: the plain check is cheap here
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise CodecError(
                f"{self.name} payload scale {first}: expected a finite value >= 0, got {float(scales[first])}"
            )


class Int8Codec(_BlockQuantCodec):
    """Blockwise absmax int8 with fp32 scales (fp16 scales would underflow on tiny pseudo-gradients)."""

    name = "int8"
    levels = 127
    bits = 8

    def __init__(self, block_size: int = 128) -> None:
        super().__init__(block_size)

    def _encode_sections(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if KERNELS is not None:
            numel, block = tensor.numel(), self.block_size
            scales = torch.empty(ceil_div(numel, block), dtype=torch.float32)
            codes = torch.empty(numel, dtype=torch.int8)
            bad = _quantize(tensor.numpy(), block, float(self.levels), scales.numpy(), codes.numpy())
            if bad >= 0:
                raise nonfinite_error(f"{self.name} encode input", tensor)
            return [scales, codes]
        scales = self._scales(tensor, self.block_size)
        return [scales, self._quantize(tensor, scales, self.block_size).to(torch.int8)]

    def _decoded_from_sections(
        self, sections: list[torch.Tensor], numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        # The codes are in [-127, 127] and the scales finite by construction: _decode_body's dequantization.
        scales, codes = sections
        if KERNELS is not None:
            out = torch.empty(numel, dtype=torch.float32) if out is None else out
            _dequantize(scales.numpy(), codes.numpy(), self.block_size, out.numpy())
            return out
        decoded = self._dequantize(codes, scales, self.block_size)
        return decoded if out is None else out.copy_(decoded)

    def _decode_body(self, header: Header, body: memoryview) -> torch.Tensor:
        return self._decode_body_into(header, body, None)

    def _decode_body_into(self, header: Header, body: memoryview, out: torch.Tensor | None) -> torch.Tensor:
        scales, offset = section(body, 0, ceil_div(header.numel, header.block), torch.float32)
        self._check_scales(scales)
        if KERNELS is not None:
            out = torch.empty(header.numel, dtype=torch.float32) if out is None else out
            bad = _dequantize(body[:offset], body[offset:], header.block, out.numpy())
            if bad >= 0:
                raise CodecError(
                    f"int8 payload codes: expected values in [-127, 127], got -128 in block {bad}"
                )
            return out
        codes, _ = section(body, offset, header.numel, torch.int8)
        if codes.numel() and int(codes.min()) == -128:
            raise CodecError("int8 payload codes: expected values in [-127, 127], got -128")
        decoded = self._dequantize(codes, scales, header.block)
        return decoded if out is None else out.copy_(decoded)


# Values an int4 decode converts at a time (rounded to whole blocks, an even count): its temporaries' bound.
INT4_DECODE_SPAN = 1 << 17


class Int4Codec(_BlockQuantCodec):
    """Blockwise absmax 4-bit (codes -7..7), two values per byte."""

    name = "int4"
    levels = 7
    bits = 4

    def __init__(self, block_size: int = 64) -> None:
        super().__init__(block_size)

    def _encode_sections(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        numel = tensor.numel()
        scales = self._scales(tensor, self.block_size)
        num_bytes = ceil_div(numel, 2)
        nibbles = torch.full((2 * num_bytes,), 8, dtype=torch.uint8)  # an odd tail pads with code 8 (= 0)
        nibbles[:numel] = self._quantize(tensor, scales, self.block_size).add_(8)
        pairs = nibbles.view(num_bytes, 2)
        return [scales, pairs[:, 0] | (pairs[:, 1] << 4)]

    def _decode_body(self, header: Header, body: memoryview) -> torch.Tensor:
        return self._decode_body_into(header, body, torch.empty(header.numel, dtype=torch.float32))

    def _decode_body_into(self, header: Header, body: memoryview, out: torch.Tensor) -> torch.Tensor:
        numel, block = header.numel, header.block
        scales, offset = section(body, 0, ceil_div(numel, block), torch.float32)
        self._check_scales(scales)
        packed, _ = section(body, offset, ceil_div(numel, 2), torch.uint8)
        # Piece by piece (whole blocks, an even count of values), so that the nibbles, codes and their float32
        # values are temporaries of a piece, not of the payload: the same values, each scaled by its own block.
        span = max(2 * block, block * (INT4_DECODE_SPAN // block)) // (2 * block) * (2 * block)
        for start in range(0, numel, span):
            stop = min(start + span, numel)
            pairs = packed[start // 2 : ceil_div(stop, 2)]
            nibbles = torch.stack((pairs & 15, pairs >> 4), dim=1).view(-1)
            if bool((nibbles[: stop - start] == 0).any()):
                raise CodecError("int4 payload codes: expected nibbles in 1..15 (q + 8, q in [-7, 7]), got 0")
            if stop == numel and numel % 2 and int(nibbles[-1]) != 8:
                raise CodecError(f"int4 payload padding nibble: expected 8, got {int(nibbles[-1])}")
            q = nibbles[: stop - start].to(torch.int8).sub_(8)
            out[start:stop].copy_(self._dequantize(q, scales[start // block : ceil_div(stop, block)], block))
        return out
