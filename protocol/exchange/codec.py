"""Calls into the codec with their results checked, and the raw float32 path's views and finiteness checks.

A refusal of a peer's data becomes a `Reject` (wire.py); a refusal of our own contribution is the codec's error
(`own_chunk_error`), which the caller raises to its own caller.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from farloco.protocol.exchange.api import TensorCodec
from farloco.protocol.exchange.wire import invalid


def decode(
    codec: TensorCodec,
    data: bytes | memoryview,
    numel: int,
    what: str,
    fast: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """codec.decode with the result checked: any decoding error or size mismatch becomes a Reject. `fast`: the
    codec takes checksum=False and out= (see TensorCodec); `out` receives the values (and is returned)."""
    try:
        # With out=, a payload of another length is refused by the codec before it writes ("out: expected").
        tensor = codec.decode(data, checksum=False, out=out) if fast else codec.decode(data)  # type: ignore[call-arg]
    except Exception as exc:  # codecs raise their own error types (CodecError is a ValueError)
        reason = "SIZE_MISMATCH" if "out: expected" in str(exc) else "BAD_PAYLOAD"
        raise invalid(reason, f"{what}: {type(exc).__name__}: {exc}") from None
    if tensor.dtype != torch.float32 or tensor.numel() != numel:
        raise invalid(
            "SIZE_MISMATCH", f"{what}: expected {numel} float32 values, got {tensor.numel()} {tensor.dtype}"
        )
    if out is not None and tensor is not out:
        return out.copy_(tensor.reshape(-1))
    return tensor.reshape(-1)


def payload_terms(codec: TensorCodec) -> bool:
    """Whether a sparse codec's payloads can be kept parsed and summed range by range (farloco.optim's topk and
    dct-topk: `parse(data) -> payload` with `payload.decode_into(a, b, out)` over ranges of whole `payload.unit`s,
    and `encode_on_demand(numel, fill)`), instead of each decoded into a vector of the whole length."""
    return callable(getattr(codec, "parse", None)) and callable(getattr(codec, "encode_on_demand", None))


def take_payload(codec: TensorCodec, data: bytes | memoryview, numel: int, what: str, fast: bool) -> Any:
    """A member's whole sparse payload, checked: parsed (`payload_terms`: decoded later, range by range, into
    the mean), or else decoded. A refusal becomes a Reject, as in `decode`."""
    if not payload_terms(codec):
        return decode(codec, data, numel, what, fast)
    parse = codec.parse  # type: ignore[attr-defined]
    try:
        payload = parse(data, checksum=False) if fast else parse(data)
    except Exception as exc:  # codecs raise their own error types (CodecError is a ValueError)
        raise invalid("BAD_PAYLOAD", f"{what}: {type(exc).__name__}: {exc}") from None
    if payload.numel != numel:
        raise invalid("SIZE_MISMATCH", f"{what}: expected {numel} float32 values, got {payload.numel}")
    # Every member of a run codes with the same options (the run's hash covers them). A payload cut in other
    # chunks would make the mean's pieces (whole chunks of every payload) as long as their common multiple.
    chunk = getattr(codec, "chunk", None)
    if isinstance(chunk, int) and payload.unit != chunk:
        raise invalid("BAD_PAYLOAD", f"{what}: expected chunks of {chunk} values, got {payload.unit}")
    return payload


def encode(codec: TensorCodec, tensor: torch.Tensor, fast: bool) -> bytes:
    return codec.encode(tensor, checksum=False) if fast else codec.encode(tensor)  # type: ignore[call-arg]


def encode_decoded(
    codec: TensorCodec, tensor: torch.Tensor, fast: bool = False, out: torch.Tensor | None = None
) -> tuple[bytes, torch.Tensor]:
    """(codec.encode(tensor), codec.decode of those bytes), in one go when the codec offers it (farloco.optim
    codecs' `encode_decoded` rebuilds the decoded values without parsing and checking its own bytes again).
    `out` receives the decoded values (and is returned); `fast` as in `decode`."""
    both = getattr(codec, "encode_decoded", None)
    if both is not None:
        data, decoded = both(tensor, checksum=False, out=out) if fast else both(tensor)
    else:
        data = codec.encode(tensor)
        decoded = codec.decode(data)
    if out is not None and decoded is not out:
        out.copy_(decoded)
        return data, out
    return data, decoded


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous float32 CPU tensor, without a copy (little-endian host: checked in Exchange._start)."""
    return tensor.numpy().data.cast("B")


def raw_view(data: bytes | memoryview, numel: int, what: str) -> torch.Tensor:
    """A float32 tensor viewing a raw chunk in place; refuses a chunk of the wrong size."""
    if len(data) != 4 * numel:
        raise invalid("SIZE_MISMATCH", f"{what}: expected {4 * numel} bytes of float32, got {len(data)}")
    if numel == 0:
        return torch.empty(0, dtype=torch.float32)
    if isinstance(data, memoryview) and not data.readonly:
        return torch.frombuffer(data, dtype=torch.float32, count=numel)  # the data plane's own buffer
    # gRPC's message bytes are immutable and only ever read here; torch warns that it cannot mark the tensor
    # read-only, so the warning is silenced rather than paying a copy.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.float32, count=numel)


def all_finite(tensor: torch.Tensor) -> bool:
    # A NaN or Inf makes the sum NaN or Inf, and a vectorised sum is ~8x cheaper than aminmax (measured:
    # 0.02 vs 0.17 ms per MiB). A non-finite sum of finite values (overflow) is told apart by min and max,
    # which are finite iff every value is (NaN propagates through both).
    if tensor.numel() == 0 or math.isfinite(float(tensor.sum())):
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def own_chunk_error(codec: TensorCodec, chunk: torch.Tensor, offset: int) -> Exception | None:
    """None if our own raw chunk (starting at flat index `offset`) is finite, else why it cannot be sent: the
    codec's own error when it refuses it (it names what and where), else one naming the count and first index."""
    if all_finite(chunk):
        return None
    try:
        codec.encode(chunk)
    except Exception as exc:  # the codec's error type (CodecError is a ValueError)
        return exc
    bad = ~torch.isfinite(chunk)
    return ValueError(
        f"tensor to average: expected only finite values, got {int(bad.sum())} NaN/Inf in elements "
        f"{offset}..{offset + chunk.numel() - 1} (first at index {offset + int(bad.nonzero()[0, 0])})"
    )
