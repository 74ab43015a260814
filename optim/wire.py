"""The codec interface and the self-describing byte layout every farloco codec writes.

This file owns `CodecError`, the `Codec` base class, the fixed 32-byte payload header (pack, parse, validate),
and the small helpers codecs use to view payload sections as tensors without copying.

Payload layout (all little-endian)::

    offset size field
    0      4    magic  b"FLOC"
    4      1    format version (1)
    5      1    codec id (see CODEC_IDS)
    6      1    value_bits (topk: 16 or 2; 0 for every other codec)
    7      1    flags: bit 0 = no CRC (see below); the other bits must be 0
    8      8    numel (u64)
    16     4    block (int8/int4: block size; topk/dct-topk: chunk; else 0)
    20     4    k (topk/dct-topk: kept values per chunk; else 0)
    24     4    CRC-32 of bytes 0..23 followed by the whole body (0 with the no-CRC flag)
    28     4    reserved, must be 0
    32     ...  body: raw sections, widest element type first, so every section is naturally aligned

The CRC makes a flipped or truncated byte a `CodecError` instead of a silently wrong tensor: the transport has
its own checksums, but a codec payload also sits in checkpoints and test fixtures, and "never garbage" must hold
wherever the bytes come from. Only a caller whose transport guarantees integrity end to end (farloco.protocol's
exchange: TCP or TLS, the same guard its raw fp32 chunks have) may leave it out, with `encode(...,
checksum=False)`, and such a payload decodes only with `decode(..., checksum=False)`: a plain `decode` refuses
it, so bytes without a CRC cannot end up in a checkpoint or a fixture unnoticed. The CRC costs about 0.16 ms per
MiB each way (zlib), as much as the int8 kernels themselves.
"""

from __future__ import annotations

import abc
import math
import struct
import sys
import warnings
import zlib
from dataclasses import dataclass

import torch

from farloco.optim.ranges import CHUNK, run_ranges

MAGIC = b"FLOC"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBBBQIII4x")
HEADER_BYTES = HEADER.size  # 32
_CRC_OFFSET = 24
FLAG_NO_CRC = 1

# Stable wire ids: never renumber, only append.
CODEC_IDS: dict[str, int] = {
    "fp32": 1,
    "fp16": 2,
    "bf16": 3,
    "int8": 4,
    "int4": 5,
    "topk": 6,
    "dct-topk": 7,
}
_CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("farloco.optim codecs write raw little-endian buffers and need a little-endian host")


class CodecError(ValueError):
    """Bad input to `Codec.encode` (non-finite values, wrong dtype/shape) or malformed bytes to `decode`."""


@dataclass(frozen=True)
class Header:
    """The parsed fixed header of one payload."""

    codec_id: int
    value_bits: int
    flags: int
    numel: int
    block: int
    k: int


class Codec(abc.ABC):
    """Turns a 1-D float32 CPU tensor into self-describing bytes and back.

    Subclasses set `name`, `dense` and `lossless`, and implement `_encode_sections`/`_decode_body`; this base class
    checks inputs, writes and checks the header and the CRC, so every codec refuses bad input the same way.
    """

    name: str
    dense: bool  # a mean can be reduced part-wise (reduce-scatter + all-gather)
    lossless: bool = False  # decode(encode(x)) == x bit for bit; error feedback is pointless then
    # encode / encode_decoded / decode take `checksum=False` and `out=` (farloco.protocol's exchange asks).
    optional_checksum: bool = True

    def encode(self, tensor: torch.Tensor, *, checksum: bool = True) -> bytes:
        """Encode a 1-D float32 CPU tensor (any length >= 0). Raises CodecError on NaN/Inf or bad dtype/ndim.
        `checksum=False` leaves the CRC out (see the module docstring: only for an integrity-checked transport)."""
        return self._encode_parts(tensor, checksum)[0]

    def encode_decoded(
        self, tensor: torch.Tensor, *, checksum: bool = True, out: torch.Tensor | None = None
    ) -> tuple[bytes, torch.Tensor]:
        """`(encode(tensor), decode(encode(tensor)))`, bit for bit, in one go.

        Codecs that can rebuild the decoded values from what encoding just computed (casts, int8) skip parsing
        and checking their own fresh bytes again; the exchange uses this for every value it both sends and
        keeps (its own contribution, the means it owns). `out` (a contiguous float32 tensor of the same length)
        receives the decoded values and is returned. Raises what `encode` raises.
        """
        data, sections, numel = self._encode_parts(tensor, checksum)
        if out is not None:
            _check_out(out, numel)  # before any codec writes into it
        decoded = self._decoded_from_sections(sections, numel, out) if numel else None
        if decoded is None:
            decoded = self.decode(data, checksum=checksum)
        if out is not None and decoded is not out:
            out.copy_(decoded)
            return data, out
        return data, decoded

    def _decoded_from_sections(
        self, sections: list[torch.Tensor], numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """What `decode` returns for a payload of these freshly encoded sections (in `out` if the codec can write
        there), or None to decode the bytes."""
        return None

    def _encode_parts(
        self, tensor: torch.Tensor, checksum: bool = True
    ) -> tuple[bytes, list[torch.Tensor], int]:
        check_input(tensor)
        tensor = tensor.detach().contiguous()  # a Parameter is encoded by value; autograd has no say here
        raw = self._encode_sections(tensor)
        return self._pack(raw, tensor.numel(), checksum), raw, tensor.numel()

    def _pack(self, raw: list[torch.Tensor], numel: int, checksum: bool) -> bytes:
        """The payload of body sections `raw` for `numel` values: the header, the CRC unless left out, the body."""
        value_bits, block, k = self._header_params()
        sections = [s.contiguous().view(torch.uint8) for s in raw if s.numel()]
        expected = self._body_bytes(numel, value_bits, block, k)
        if sum(s.numel() for s in sections) != expected:  # pragma: no cover - a codec bug, not bad input
            raise AssertionError(
                f"{self.name} wrote {sum(s.numel() for s in sections)} body bytes, not {expected}"
            )
        flags = 0 if checksum else FLAG_NO_CRC
        header = bytearray(
            HEADER.pack(MAGIC, FORMAT_VERSION, CODEC_IDS[self.name], value_bits, flags, numel, block, k, 0)
        )
        views = [s.numpy().data for s in sections]
        if checksum:
            crc = zlib.crc32(memoryview(header)[:_CRC_OFFSET])
            for view in views:
                crc = zlib.crc32(view, crc)
            struct.pack_into("<I", header, _CRC_OFFSET, crc)
        # One copy from the section tensors into the immutable result: no zero-filled staging buffer.
        return b"".join([header, *views])

    def decode(
        self, data: bytes | memoryview, *, checksum: bool = True, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decode bytes from `encode` into a new 1-D float32 tensor (or into `out`, a contiguous float32 tensor
        of the payload's length, which is returned); same bytes -> bit-identical tensor.

        Everything is validated (magic, version, codec id, lengths vs numel, CRC, then codec-specific ranges)
        before any numel-sized buffer is allocated. `checksum=False` accepts a payload written without a CRC
        (and skips the check of one that has it): only for bytes that came over an integrity-checked transport.
        """
        header, body = self._checked(data, checksum)
        if out is not None:
            _check_out(out, header.numel)
            return self._decode_body_into(header, body, out)
        return self._decode_body(header, body)

    def _checked(self, data: bytes | memoryview, checksum: bool) -> tuple[Header, memoryview]:
        """The header and body of a payload for this codec, checked as `decode` describes (not the body's
        values: the codec's own decoder checks those)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CodecError(f"payload: expected bytes or memoryview, got {type(data).__name__}")
        try:
            view = memoryview(data).cast("B")
        except TypeError as exc:  # e.g. a strided or multi-dimensional memoryview
            raise CodecError(f"payload: expected a contiguous byte buffer, got {exc}") from None
        header = parse_header(view)
        if header.codec_id != CODEC_IDS[self.name]:
            raise CodecError(
                f"payload codec: expected {self.name!r} (id {CODEC_IDS[self.name]}), "
                f"got {_CODEC_NAMES.get(header.codec_id, 'unknown')!r} (id {header.codec_id})"
            )
        self._check_header(header)
        expected = self._body_bytes(header.numel, header.value_bits, header.block, header.k)
        got = len(view) - HEADER_BYTES
        if got != expected:
            raise CodecError(
                f"{self.name} payload body for numel={header.numel}: expected {expected} bytes, got {got}"
            )
        if header.flags & FLAG_NO_CRC:
            if checksum:
                raise CodecError(
                    "payload CRC-32: expected one, got a payload written without it (encode(checksum=False) is "
                    "only for an integrity-checked transport; decode(checksum=False) accepts it there)"
                )
        elif checksum:
            check_crc(view)
        return header, view[HEADER_BYTES:]

    def _decode_body_into(self, header: Header, body: memoryview, out: torch.Tensor) -> torch.Tensor:
        """`_decode_body` written into `out`; codecs that can decode in place override this."""
        return out.copy_(self._decode_body(header, body))

    @abc.abstractmethod
    def estimated_ratio(self, numel: int) -> float:
        """Wire bytes / (4 * numel) for a tensor of `numel` values (header included)."""

    @abc.abstractmethod
    def _header_params(self) -> tuple[int, int, int]:
        """(value_bits, block, k) this instance writes into the header."""

    @abc.abstractmethod
    def _check_header(self, header: Header) -> None:
        """Refuse header parameters this codec cannot decode (e.g. block size 0)."""

    @abc.abstractmethod
    def _body_bytes(self, numel: int, value_bits: int, block: int, k: int) -> int:
        """Exact body length for these header parameters."""

    @abc.abstractmethod
    def _encode_sections(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The body of a checked, contiguous input as tensors whose raw bytes, in order, are the body."""

    @abc.abstractmethod
    def _decode_body(self, header: Header, body: memoryview) -> torch.Tensor:
        """Decode a body whose length and CRC were already checked."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_input(tensor: object) -> None:
    """Refuse anything but a 1-D float32 CPU tensor; finiteness is checked by each codec where it is cheapest."""
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"encode input: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32:
        raise CodecError(f"encode input dtype: expected torch.float32, got {tensor.dtype}")
    if tensor.ndim != 1:
        raise CodecError(f"encode input shape: expected a 1-D tensor, got shape {list(tensor.shape)}")
    if tensor.device.type != "cpu":
        raise CodecError(f"encode input device: expected cpu, got {tensor.device}")


def all_finite(tensor: torch.Tensor) -> bool:
    """True if no NaN/Inf. For float32, a NaN/Inf makes the sum non-finite, and a vectorised sum is ~8x
    cheaper than aminmax (0.02 vs 0.17 ms per MiB, itself far cheaper than isfinite()); only a non-finite sum
    (NaN/Inf, or finite values that overflowed) and other dtypes pay for min and max, which are finite iff
    every value is (NaN propagates through both)."""
    numel = tensor.numel()
    if numel == 0:
        return True
    if tensor.ndim == 1 and tensor.is_contiguous() and numel > CHUNK:  # over the runner's ranges (ranges.py)
        return all(
            run_ranges(lambda a, b: _all_finite(tensor[a * CHUNK : b * CHUNK]), -(-numel // CHUNK), 4 * numel)
        )
    return _all_finite(tensor)


def _all_finite(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 0:
        return True
    # Only float32 takes the sum: a half-type sum overflows easily and costs more than aminmax (measured).
    if tensor.dtype == torch.float32 and math.isfinite(float(tensor.sum())):
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def nonfinite_error(what: str, tensor: torch.Tensor) -> CodecError:
    """A CodecError that says how many non-finite values came and where the first one is."""
    bad = ~torch.isfinite(tensor)
    count = int(bad.sum())
    first = int(bad.nonzero()[0, 0]) if count else -1
    return CodecError(
        f"{what}: expected only finite values, got {count} NaN/Inf (first at index {first}, "
        f"value {float(tensor[first]) if count else 'n/a'})"
    )


def parse_header(view: memoryview) -> Header:
    if len(view) < HEADER_BYTES:
        raise CodecError(f"payload: expected at least {HEADER_BYTES} header bytes, got {len(view)}")
    magic, version, codec_id, value_bits, flags, numel, block, k, _crc = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"payload magic: expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"payload format version: expected {FORMAT_VERSION}, got {version}")
    if flags & ~FLAG_NO_CRC or bytes(view[28:HEADER_BYTES]) != b"\0\0\0\0":
        raise CodecError(
            f"payload header: expected flags in {{0, {FLAG_NO_CRC}}} and reserved bytes zero, got flags {flags}"
        )
    return Header(codec_id=codec_id, value_bits=value_bits, flags=flags, numel=numel, block=block, k=k)


def _check_out(out: torch.Tensor, numel: int) -> None:
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != torch.float32
        or out.device.type != "cpu"
        or not out.is_contiguous()
        or out.numel() != numel
    ):
        raise CodecError(
            f"out: expected a contiguous float32 CPU tensor of {numel} values, got "
            + (
                f"{out.dtype} on {out.device}, {out.numel()} values"
                if isinstance(out, torch.Tensor)
                else repr(out)
            )
        )


def check_crc(view: memoryview) -> None:
    (stored,) = struct.unpack_from("<I", view, _CRC_OFFSET)
    actual = zlib.crc32(view[HEADER_BYTES:], zlib.crc32(view[:_CRC_OFFSET]))
    if stored != actual:
        raise CodecError(f"payload CRC-32: expected {stored:#010x} (stored), got {actual:#010x} (computed)")


def section(body: memoryview, offset: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A tensor view of `count` elements of `dtype` at `offset` of a payload body, and the offset after it.

    The payload is usually immutable bytes. Torch warns once per process that it cannot mark a tensor
    read-only; decoders only ever read these views, so the warning is silenced rather than paying a copy.
    """
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if count == 0:
        return torch.empty(0, dtype=dtype), offset + nbytes
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(body, dtype=dtype, count=count, offset=offset)
    return tensor, offset + nbytes


def positive_int_option(codec: str, option: str, value: object, *, maximum: int = 2**32 - 1) -> int:
    """Validate an integer codec option (bools are refused: True is not a block size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CodecError(f"{codec} option {option}: expected an int, got {type(value).__name__} {value!r}")
    if not 1 <= value <= maximum:
        raise CodecError(f"{codec} option {option}: expected 1 <= {option} <= {maximum}, got {value}")
    return value


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def wire_ratio(codec: str, numel: int, body_bytes: int) -> float:
    """Wire bytes (header + body) / (4 * numel); numel must be >= 1 (a ratio over zero bytes means nothing)."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise CodecError(f"{codec} estimated_ratio numel: expected an int >= 1, got {numel!r}")
    return (HEADER_BYTES + body_bytes) / (4 * numel)
