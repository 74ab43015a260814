"""Sparse codecs: chunk top-k (SparseLoCo) and chunked DCT top-k (DeMo), plus the fixed DCT-II tables.

Both split the flat vector into chunks of `chunk` values (the last chunk may be shorter) and keep `k` entries
per chunk (min(k, len) for a short last chunk). Sparse payloads cannot be reduced part-wise, so the exchange
all-gathers them (`dense = False`).

Indices are chunk-local, sorted strictly ascending within a chunk: the decoder checks that, which rules out
duplicate indices (a scatter with duplicates would be order-dependent, i.e. not deterministic) and out-of-range
ones in one cheap pass. Index width: uint8 if chunk <= 256, uint16 if chunk <= 65536, else int32.

topk values: fp16 (value_bits=16; |v| > 65504 is a CodecError), or 2 bits (value_bits=2) — a sign bit and one
magnitude bit choosing between two fp32 levels per chunk, lo = m + (M-m)/4 and hi = m + 3(M-m)/4 where m, M are
the smallest and largest kept magnitudes of the chunk, each value the nearer of the two; so
|v - v'| <= (M - m) / 4 for every kept value, up to the levels' float32 rounding (one ulp, 2^-149 among
subnormal magnitudes).

dct-topk: orthonormal DCT-II of each chunk, keep the k largest coefficients by magnitude, send them as int16
codes with one fp32 scale per chunk (scale = max|kept| / 32767). Decoding is exact integer arithmetic: the DCT
table is integers on a 2^-28 grid (computed with integer arithmetic only, so no libm ulp can change it), and
code * table products summed over a chunk stay below 2^53 (|code| < 2^15, |entry| <= 2^28 sqrt(2/N), at most
N <= 1024 terms), so float64 computes them exactly whatever the summation order or BLAS — the decoded tensor is
then two multiplications and one float32 rounding away, bit-identical on every machine. The encoder uses the
same table (times 2^-28) for the forward transform; its float32 matmul need not be reproducible, since only
its output bytes travel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from farloco.optim.ranges import run_ranges
from farloco.optim.wire import (
    Codec,
    CodecError,
    Header,
    all_finite,
    ceil_div,
    check_input,
    nonfinite_error,
    positive_int_option,
    section,
    wire_ratio,
)

DCT_GRID_BITS = 28  # decoder table = round(D * 2^28); see the exactness argument in the module docstring
DCT_MAX_CHUNK = 1024  # keeps the decoder's gathered table rows, and the encoder's dense matmul, affordable
_INT16_LEVELS = 32767


def _index_dtype(chunk: int) -> torch.dtype:
    if chunk <= 256:
        return torch.uint8
    if chunk <= 65536:
        return torch.uint16
    return torch.int32


def _chunk_layout(numel: int, chunk: int, k: int) -> tuple[int, int, int]:
    """(full chunks, tail length, kept values in total)."""
    num_full, tail = divmod(numel, chunk)
    return num_full, tail, num_full * k + min(k, tail)


class _ChunkedSparseCodec(Codec):
    """Shared option checks and the sorted chunk-local index section of topk and dct-topk."""

    dense = False
    max_chunk: int

    def __init__(self, k: int, chunk: int) -> None:
        self.chunk = positive_int_option(self.name, "chunk", chunk, maximum=self.max_chunk)
        self.k = positive_int_option(self.name, "k", k, maximum=self.chunk)

    def _check_chunk_k(self, header: Header) -> None:
        if not 1 <= header.block <= self.max_chunk or not 1 <= header.k <= header.block:
            raise CodecError(
                f"{self.name} header: expected 1 <= k <= chunk <= {self.max_chunk}, "
                f"got k={header.k}, chunk={header.block}"
            )

    def _select(self, rows: torch.Tensor, k: int, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of `scores` per row, returned as (ascending indices, the matching entries of `rows`)."""
        _, idx = scores.topk(k, dim=1, sorted=False)
        idx, _ = idx.sort(dim=1)
        return idx, rows.gather(1, idx)

    # ---- pieces: an encode made piece by piece, a payload decoded range by range ---------------------------------
    def encode_on_demand(
        self, numel: int, fill: Callable[[int, int, torch.Tensor], torch.Tensor], *, checksum: bool = True
    ) -> bytes:
        """`encode` of a vector of `numel` values that is never held whole: `fill(a, b, out)` writes values [a, b)
        into `out` (b - a float32 values) and returns it, from any thread, for pieces of whole chunks in any
        order. Every chunk is encoded on its own, so the bytes are those of `encode` on the whole vector (dct-topk:
        up to its encoder's float32 matmul, which need not be reproducible: only its output bytes travel)."""
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise CodecError(f"{self.name} encode_on_demand numel: expected an int >= 0, got {numel!r}")
        span = self._piece_values()
        pieces = ceil_div(numel, span)

        def encode_pieces(first: int, last: int) -> list[list[torch.Tensor]]:
            scratch = torch.empty(min(span, numel))
            encoded = []
            for piece in range(first, last):
                a, b = piece * span, min((piece + 1) * span, numel)
                values = fill(a, b, scratch[: b - a])
                check_input(values)
                if values.numel() != b - a:
                    raise CodecError(
                        f"{self.name} encode_on_demand piece [{a}, {b}): expected {b - a} values, "
                        f"got {values.numel()}"
                    )
                encoded.append(self._encode_unpacked(values.contiguous()))
            return encoded

        parts = [piece for run in run_ranges(encode_pieces, pieces, 8 * numel) for piece in run]
        if not parts:
            parts = [self._encode_unpacked(torch.empty(0))]
        sections = self._finish([_cat([piece[i] for piece in parts]) for i in range(len(parts[0]))])
        return self._pack(sections, numel, checksum)

    def parse(self, data: bytes | memoryview, *, checksum: bool = True) -> SparsePayload:
        """A payload checked whole as `decode` checks it (header, CRC, every section's values), decoded later
        range by range (`SparsePayload.decode_into`) instead of into a vector of the whole length."""
        header, body = self._checked(data, checksum)
        return SparsePayload(self, header, self._parse_body(header, body))

    def _piece_values(self) -> int:
        """Values per piece of an encode made on demand or a range decode: whole chunks, about 1 MiB."""
        return max(1, PIECE_VALUES // self.chunk) * self.chunk

    def _decode_body(self, header: Header, body: memoryview) -> torch.Tensor:
        return self._decode_body_into(header, body, torch.empty(header.numel, dtype=torch.float32))

    def _decode_body_into(self, header: Header, body: memoryview, out: torch.Tensor) -> torch.Tensor:
        payload = SparsePayload(self, header, self._parse_body(header, body))
        span = max(1, PIECE_VALUES // header.block) * header.block
        for a in range(0, header.numel, span):  # in pieces: a piece's temporaries, not the payload's
            b = min(a + span, header.numel)
            payload.decode_into(a, b, out[a:b])
        return out

    def _encode_sections(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._finish(self._encode_unpacked(tensor))

    def _encode_unpacked(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The body's sections for a run of whole chunks (the last may be short), before `_finish`: sections of
        consecutive runs concatenate into the sections of the runs together."""
        raise NotImplementedError

    def _finish(self, sections: list[torch.Tensor]) -> list[torch.Tensor]:
        """The body's sections from `_encode_unpacked`'s (topk packs its 2-bit codes here)."""
        return sections

    def _parse_body(self, header: Header, body: memoryview) -> dict[str, torch.Tensor]:
        """The body's sections as views, every value checked; what `_decode_rows` reads."""
        raise NotImplementedError

    def _decode_rows(self, payload: SparsePayload, first: int, last: int, out: torch.Tensor) -> None:
        """Chunks [first, last) of the payload decoded into `out` (their values, in order)."""
        raise NotImplementedError

    def _indices(self, body: memoryview, offset: int, header: Header) -> tuple[torch.Tensor, int]:
        """The index section (a view, in the payload's own width), checked: strictly ascending per chunk and
        inside the chunk; checked in pieces, so nothing of the section's length is widened at once."""
        num_full, tail, count = _chunk_layout(header.numel, header.block, header.k)
        raw, offset = section(body, offset, count, _index_dtype(header.block))
        k = header.k
        rows_per_piece = max(1, PIECE_VALUES // k)
        for first in range(0, num_full, rows_per_piece):
            last = min(first + rows_per_piece, num_full)
            self._check_index_rows(
                raw[first * k : last * k].to(torch.int64).view(last - first, k), header.block
            )
        if tail:
            self._check_index_rows(raw[num_full * k :].to(torch.int64).view(1, -1), tail)
        return raw, offset

    def _check_index_rows(self, rows: torch.Tensor, length: int) -> None:
        if rows.numel() == 0:
            return
        if not bool((rows[:, 1:] > rows[:, :-1]).all()):
            raise CodecError(f"{self.name} payload indices: expected strictly ascending within each chunk")
        if int(rows[:, 0].min()) < 0:  # only int32 indices (chunk > 65536) can be negative
            raise CodecError(f"{self.name} payload index: expected >= 0, got {int(rows[:, 0].min())}")
        top = int(rows[:, -1].max())
        if top >= length:
            raise CodecError(f"{self.name} payload index: expected < {length} (chunk length), got {top}")


# Values per piece of an encode made on demand and of a range decode (whole chunks): 1 MiB of float32.
PIECE_VALUES = 1 << 18


class SparsePayload:
    """A topk or dct-topk payload whose every section was checked (`parse`), decoded range by range.

    It holds views of the payload's bytes (k values of every chunk: a small share of the vector), so a node that
    keeps every member's payload of a round and sums them range by range (the exchange's sparse mean, in member
    order) holds no decoded vector of the model's size per member; a range decodes to the same bits as that
    range of `decode`."""

    def __init__(self, codec: _ChunkedSparseCodec, header: Header, sections: dict[str, torch.Tensor]) -> None:
        self.codec = codec
        self.header = header
        self.sections = sections
        self.numel = header.numel
        self.unit = header.block  # a range starts at a multiple of it and ends at one or at `numel`

    def decode_into(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """Values [a, b) of the decoded payload into `out` (b - a contiguous float32 values), returned."""
        numel, unit = self.numel, self.unit
        if not (0 <= a <= b <= numel and a % unit == 0 and (b % unit == 0 or b == numel)):
            raise CodecError(
                f"{self.codec.name} decode range: expected whole chunks of {unit} inside [0, {numel}], "
                f"got [{a}, {b})"
            )
        if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != b - a:
            raise CodecError(
                f"{self.codec.name} decode range out: expected {b - a} contiguous float32 values, "
                f"got {out.numel()} {out.dtype}"
            )
        if b > a:
            self.codec._decode_rows(self, a // unit, ceil_div(b, unit), out)
        return out

    def rows(self, first: int, last: int) -> tuple[int, int, bool]:
        """For chunks [first, last): (full chunks among them, their first value's index, whether the short
        last chunk is one of them)."""
        num_full, tail, _ = _chunk_layout(self.numel, self.header.block, self.header.k)
        full = max(0, min(last, num_full) - first)
        return full, first * self.header.k, bool(tail) and last > num_full


class TopKCodec(_ChunkedSparseCodec):
    """Chunk top-k by magnitude; values as fp16 or SparseLoCo-style 2 bits."""

    name = "topk"
    max_chunk = 2**31 - 1

    def __init__(self, k: int = 64, chunk: int = 4096, value_bits: int = 16) -> None:
        super().__init__(k, chunk)
        if value_bits not in (16, 2):
            raise CodecError(f"topk option value_bits: expected 16 or 2, got {value_bits!r}")
        self.value_bits = value_bits

    def __repr__(self) -> str:
        return f"TopKCodec(k={self.k}, chunk={self.chunk}, value_bits={self.value_bits})"

    def estimated_ratio(self, numel: int) -> float:
        return wire_ratio(self.name, numel, self._body_bytes(numel, self.value_bits, self.chunk, self.k))

    def _header_params(self) -> tuple[int, int, int]:
        return self.value_bits, self.chunk, self.k

    def _check_header(self, header: Header) -> None:
        self._check_chunk_k(header)
        if header.value_bits not in (16, 2):
            raise CodecError(f"topk header value_bits: expected 16 or 2, got {header.value_bits}")

    def _body_bytes(self, numel: int, value_bits: int, block: int, k: int) -> int:
        num_full, tail, count = _chunk_layout(numel, block, k)
        index_bytes = count * torch.empty((), dtype=_index_dtype(block)).element_size()
        if value_bits == 16:
            return index_bytes + 2 * count
        num_chunks = num_full + (1 if tail else 0)
        return 8 * num_chunks + index_bytes + ceil_div(count, 4)

    def _encode_unpacked(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if not all_finite(tensor):
            raise nonfinite_error("topk encode input", tensor)
        numel, chunk, k = tensor.numel(), self.chunk, self.k
        num_full, tail, _ = _chunk_layout(numel, chunk, k)
        parts = []
        if num_full:
            rows = tensor[: num_full * chunk].view(num_full, chunk)
            parts.append(self._select(rows, k, rows.abs()))
        if tail:
            rows = tensor[num_full * chunk :].view(1, tail)
            parts.append(self._select(rows, min(k, tail), rows.abs()))
        indices = _cat([idx.view(-1) for idx, _ in parts]).to(_index_dtype(chunk))
        values = _cat([v.view(-1) for _, v in parts])
        if self.value_bits == 16:
            half = values.to(torch.float16)
            if not all_finite(half):
                raise CodecError(
                    f"topk encode input range: expected kept |x| <= 65504 for fp16 values, "
                    f"got max |x| = {float(values.abs().max()):g}"
                )
            return [indices, half]
        # 2-bit codes: bit 1 = sign, bit 0 = high magnitude level (packed four to a byte by `_finish`).
        levels = [_two_level_magnitudes(v) for _, v in parts]
        # Each value takes the nearer level: the midpoint in float64, exact (in float32 the midpoint of two
        # subnormal levels rounds, and a zero went to the high level, off by the chunk's whole range).
        high = _cat(
            [
                (v.abs().double() >= lv.double().mean(dim=1, keepdim=True)).view(-1)
                for lv, (_, v) in zip(levels, parts, strict=True)
            ]
        )
        codes = (values < 0).to(torch.uint8) * 2 + high.to(torch.uint8)
        return [_cat([lv.view(-1) for lv in levels]), indices, codes]

    def _finish(self, sections: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.value_bits == 16:
            return sections
        levels, indices, unpacked = sections
        # Four codes per byte, the first in the low bits.
        count = unpacked.numel()
        codes = torch.zeros(4 * ceil_div(count, 4), dtype=torch.uint8)
        codes[:count] = unpacked
        quads = codes.view(-1, 4)
        packed = (quads[:, 0] | (quads[:, 1] << 2)) | ((quads[:, 2] << 4) | (quads[:, 3] << 6))
        return [levels, indices, packed]

    def _parse_body(self, header: Header, body: memoryview) -> dict[str, torch.Tensor]:
        num_full, tail, count = _chunk_layout(header.numel, header.block, header.k)
        offset = 0
        sections: dict[str, torch.Tensor] = {}
        if header.value_bits == 2:
            num_chunks = num_full + (1 if tail else 0)
            flat_levels, offset = section(body, 0, 2 * num_chunks, torch.float32)
            levels = flat_levels.view(num_chunks, 2)
            ok = torch.isfinite(levels).all(dim=1) & (levels[:, 0] >= 0) & (levels[:, 1] >= levels[:, 0])
            if not bool(ok.all()):
                bad = int((~ok).nonzero()[0, 0])
                raise CodecError(
                    f"topk payload levels of chunk {bad}: expected finite 0 <= lo <= hi, "
                    f"got {levels[bad].tolist()}"
                )
            sections["levels"] = levels
        sections["indices"], offset = self._indices(body, offset, header)
        if header.value_bits == 16:
            values, _ = section(body, offset, count, torch.float16)
            for a in range(0, count, PIECE_VALUES):
                piece = values[a : a + PIECE_VALUES].to(torch.float32)
                if not all_finite(piece):
                    raise nonfinite_error("topk payload values", piece)
            sections["values"] = values
        else:
            packed, _ = section(body, offset, ceil_div(count, 4), torch.uint8)
            if count % 4 and int(packed[-1]) >> (2 * (count % 4)):
                raise CodecError("topk payload padding codes: expected 0, got non-zero")
            sections["packed"] = packed
        return sections

    def _decode_rows(self, payload: SparsePayload, first: int, last: int, out: torch.Tensor) -> None:
        header, sections = payload.header, payload.sections
        chunk, k = header.block, header.k
        full, v0, short = payload.rows(first, last)
        count = _chunk_layout(header.numel, chunk, k)[2]

        def values(a: int, b: int, chunk_of_value: torch.Tensor) -> torch.Tensor:
            if header.value_bits == 16:
                return sections["values"][a:b].to(torch.float32)
            packed = sections["packed"][a // 4 : ceil_div(b, 4)]
            codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).view(-1)
            codes = codes[a % 4 : a % 4 + b - a]
            magnitude = sections["levels"][chunk_of_value, (codes & 1).to(torch.int64)]
            return torch.where((codes & 2) > 0, -magnitude, magnitude)

        indices = sections["indices"]
        if full:
            v1 = v0 + full * k
            rows = out[: full * chunk].view(full, chunk).zero_()
            chunk_of_value = torch.arange(first, first + full, dtype=torch.int64).repeat_interleave(k)
            taken = values(v0, v1, chunk_of_value).view(full, k)
            rows.scatter_(1, indices[v0:v1].to(torch.int64).view(full, k), taken)
        if short:
            a = v0 + full * k
            rest = out[full * chunk :].zero_()
            chunk_of_value = torch.full((count - a,), first + full, dtype=torch.int64)
            rest.scatter_(0, indices[a:count].to(torch.int64), values(a, count, chunk_of_value))


class DctTopKCodec(_ChunkedSparseCodec):
    """DeMo's chunked orthonormal DCT-II, top-k coefficients per chunk, int16 codes with a per-chunk scale."""

    name = "dct-topk"
    max_chunk = DCT_MAX_CHUNK

    def __init__(self, k: int = 4, chunk: int = 128) -> None:
        super().__init__(k, chunk)

    def __repr__(self) -> str:
        return f"DctTopKCodec(k={self.k}, chunk={self.chunk})"

    def estimated_ratio(self, numel: int) -> float:
        return wire_ratio(self.name, numel, self._body_bytes(numel, 0, self.chunk, self.k))

    def _header_params(self) -> tuple[int, int, int]:
        return 0, self.chunk, self.k

    def _check_header(self, header: Header) -> None:
        self._check_chunk_k(header)
        if header.value_bits:
            raise CodecError(f"dct-topk header value_bits: expected 0, got {header.value_bits}")

    def _body_bytes(self, numel: int, value_bits: int, block: int, k: int) -> int:
        num_full, tail, count = _chunk_layout(numel, block, k)
        num_chunks = num_full + (1 if tail else 0)
        index_bytes = count * torch.empty((), dtype=_index_dtype(block)).element_size()
        return 4 * num_chunks + 2 * count + index_bytes

    def _encode_unpacked(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if not all_finite(tensor):
            raise nonfinite_error("dct-topk encode input", tensor)
        numel, chunk, k = tensor.numel(), self.chunk, self.k
        num_full = numel // chunk
        parts = []
        for rows in (
            tensor[: num_full * chunk].view(num_full, chunk),
            tensor[num_full * chunk :].view(1, -1),
        ):
            if rows.numel() == 0:
                continue
            # The encoder's matmul need not be bit-reproducible across machines: only its output bytes travel.
            coefficients = rows @ dct_matrix(rows.shape[1]).T
            if not all_finite(coefficients):
                raise CodecError(
                    f"dct-topk encode input range: expected DCT coefficients within float32, "
                    f"got overflow (max |x| = {float(rows.abs().max()):g})"
                )
            parts.append(self._select(coefficients, min(k, rows.shape[1]), coefficients.abs()))
        scales, codes = [], []
        for _, values in parts:
            part_scales = values.abs().amax(dim=1, keepdim=True) / _INT16_LEVELS
            safe = torch.where(part_scales > 0, part_scales, torch.ones_like(part_scales))  # all-zero chunk
            codes.append((values / safe).round_().clamp_(-_INT16_LEVELS, _INT16_LEVELS).view(-1))
            scales.append(part_scales.view(-1))
        indices = _cat([idx.view(-1) for idx, _ in parts]).to(_index_dtype(chunk))
        return [_cat(scales), _cat(codes).to(torch.int16), indices]

    def _parse_body(self, header: Header, body: memoryview) -> dict[str, torch.Tensor]:
        num_full, tail, count = _chunk_layout(header.numel, header.block, header.k)
        num_chunks = num_full + (1 if tail else 0)
        scales, offset = section(body, 0, num_chunks, torch.float32)
        ok = torch.isfinite(scales) & (scales >= 0)
        if not bool(ok.all()):
            bad = int((~ok).nonzero()[0, 0])
            raise CodecError(
                f"dct-topk payload scale {bad}: expected a finite value >= 0, got {float(scales[bad])}"
            )
        codes, offset = section(body, offset, count, torch.int16)
        if bool((codes == -32768).any()):
            raise CodecError("dct-topk payload codes: expected values in [-32767, 32767], got -32768")
        indices, _ = self._indices(body, offset, header)
        return {"scales": scales, "codes": codes, "indices": indices}

    def _decode_rows(self, payload: SparsePayload, first: int, last: int, out: torch.Tensor) -> None:
        header, sections = payload.header, payload.sections
        chunk, k = header.block, header.k
        full, v0, short = payload.rows(first, last)
        codes, indices, scales = sections["codes"], sections["indices"], sections["scales"]
        if full:
            v1 = v0 + full * k
            _inverse_dct_rows(
                codes[v0:v1].view(full, k),
                indices[v0:v1].to(torch.int64).view(full, k),
                scales[first : first + full],
                out[: full * chunk].view(full, chunk),
            )
        if short:
            a = v0 + full * k
            rest = out[full * chunk :]
            _inverse_dct_rows(
                codes[a:].view(1, -1),
                indices[a:].to(torch.int64).view(1, -1),
                scales[first + full :],
                rest.view(1, -1),
            )


def _two_level_magnitudes(values: torch.Tensor) -> torch.Tensor:
    """Per row of kept values: the two fp32 magnitude levels (lo, hi) of the 2-bit code."""
    magnitudes = values.abs()
    low, high = magnitudes.amin(dim=1), magnitudes.amax(dim=1)
    quarter = (high - low) / 4
    return torch.stack((low + quarter, high - quarter), dim=1)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.empty(0)


# Values handled per decoder block: bounds the float64 temporaries (~32 MiB) without many Python iterations.
_DECODE_ELEMENTS_PER_BLOCK = 1 << 22


def _inverse_dct_rows(
    codes: torch.Tensor,
    idx: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    dense: bool | None = None,
) -> None:
    """out[r] = float32(scale[r] * 2^-28 * sum_s codes[r, s] * table[idx[r, s], :]), exactly (see module doc).

    Because every sum is exact, the method is free: a dense float64 matmul of the scattered codes (BLAS does
    length MACs per value, efficiently) or a gather of the k table rows each value needs (k MACs per value,
    less efficiently). `dense=None` picks by cost; both give the same bits.
    """
    num_rows, k = codes.shape
    length = out.shape[1]
    table = _dct_integer_table(length)
    if dense is None:
        dense = length <= 32 * k
    per_row = length if dense else k * length
    rows_per_block = max(1, _DECODE_ELEMENTS_PER_BLOCK // per_row)
    for start in range(0, num_rows, rows_per_block):
        stop = min(start + rows_per_block, num_rows)
        block_codes = codes[start:stop].to(torch.float64)
        if dense:
            scattered = torch.zeros(stop - start, length, dtype=torch.float64)
            scattered.scatter_(1, idx[start:stop], block_codes)
            sums = scattered @ table
        else:
            sums = torch.bmm(block_codes.unsqueeze(1), table[idx[start:stop]]).squeeze(1)
        sums.mul_(scales[start:stop, None].to(torch.float64)).mul_(2.0**-DCT_GRID_BITS)
        out[start:stop] = sums


@functools.lru_cache(maxsize=8)
def dct_matrix(length: int) -> torch.Tensor:
    """Orthonormal DCT-II matrix D (float32, length x length): coefficients = D @ x, x = D.T @ coefficients.

    It is the decoder's integer table times 2^-28, so encoder and decoder use the very same transform."""
    return (_dct_integer_table(length) * 2.0**-DCT_GRID_BITS).to(torch.float32)


@functools.lru_cache(maxsize=8)
def _dct_integer_table(length: int) -> torch.Tensor:
    """round(D * 2^28) as float64 integers, computed with integer arithmetic only.

    A table built with libm's cos could differ by an ulp between machines, and an entry near a half-integer
    would then round differently: the decoder would no longer be bit-identical everywhere. Fixed-point integer
    arithmetic (pi by Machin's formula, cos by its Taylor series, square roots by isqrt) gives every machine
    the same integers.
    """
    # cos(pi * (2n + 1) * u / (2N)) only takes the values cos(pi * m / (2N)) for m = (2n + 1) * u mod 4N.
    one = 1 << _FIXED_BITS
    cosines = [_fixed_cos_pi_fraction(m, 2 * length) for m in range(4 * length)]
    shift = 2 * _FIXED_BITS - DCT_GRID_BITS
    rows = []
    for numerator in (1, 2):  # row 0 is scaled by sqrt(1/N), the other rows by sqrt(2/N)
        norm = math.isqrt(numerator * one * one // length)
        # round half up on the 2^-28 grid: floor(v + 1/2), exact for negative v too
        rows.append([(c * norm + (1 << (shift - 1))) >> shift for c in cosines])
    values = torch.tensor(rows, dtype=torch.int64)  # (2, 4N), |entries| <= 2^28
    u = torch.arange(length, dtype=torch.int64)[:, None]
    n = torch.arange(length, dtype=torch.int64)[None, :]
    return values[(u > 0).to(torch.int64), ((2 * n + 1) * u) % (4 * length)].to(torch.float64)


_FIXED_BITS = 96  # fixed-point precision of the table computation; far beyond the 2^-28 grid


@functools.lru_cache(maxsize=1)
def _fixed_pi() -> int:
    """pi * 2^_FIXED_BITS, by Machin's formula pi = 16 atan(1/5) - 4 atan(1/239), with guard bits."""
    guard = 16
    one = 1 << (_FIXED_BITS + guard)

    def atan_inverse(x: int) -> int:
        term = one // x
        total, n, sign = term, 1, 1
        while term:
            term //= x * x
            n += 2
            sign = -sign
            total += sign * (term // n)
        return total

    return (16 * atan_inverse(5) - 4 * atan_inverse(239)) >> guard


def _fixed_cos_pi_fraction(m: int, d: int) -> int:
    """cos(pi * m / d) * 2^_FIXED_BITS, in integers; the angle is first folded into [0, pi/2]."""
    m %= 2 * d
    if m > d:
        m = 2 * d - m  # cos is even and 2pi-periodic
    sign = 1
    if 2 * m > d:
        m, sign = d - m, -1  # cos(pi - a) = -cos(a)
    one = 1 << _FIXED_BITS
    angle = _fixed_pi() * m // d
    angle_squared = angle * angle >> _FIXED_BITS
    total = term = one
    k = 1
    while term:
        term = -(term * angle_squared >> _FIXED_BITS) // ((2 * k - 1) * (2 * k))
        total += term
        k += 1
    return sign * total
