"""What the exchange takes (`TensorCodec`, `RobustRule`) and what `Exchange.average` gives back (`AverageResult`)
or raises (`ExchangeAborted`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class TensorCodec(Protocol):
    """What farloco.optim codecs look like (structural typing: protocol never imports optim).

    A codec may also carry `lossless = True` (decode(encode(x)) is x, bit for bit, e.g. plain fp32); the
    exchange then skips the decode(encode(.)) round trips that would only copy.

    A dense codec may further carry `raw_float32 = True`: its payload says nothing but the finite float32
    values themselves (farloco.optim's fp32). The exchange then never calls encode/decode: it sends each chunk
    as raw little-endian float32 bytes straight from the tensor, sums straight from the received buffers and
    checks finiteness itself (one pass over each reduced chunk and each received mean). There is no per-chunk
    CRC on that path: gRPC over TCP (and TLS, when configured) already guards the bytes in flight, and the
    codec's own CRC stays on every payload that is stored or crosses other paths.

    Optional and used when present: `encode_decoded(tensor) -> (bytes, tensor)`, equal to
    `(encode(t), decode(encode(t)))` but cheaper (farloco.optim codecs have it). A codec that says
    `optional_checksum = True` (farloco.optim's) takes `checksum=False` and `out=` in `encode`, `encode_decoded`
    and `decode`: chunks then travel without the codec's CRC (the transport guards them, as it guards raw fp32
    chunks) and decoded values are written straight into the result instead of a fresh tensor and a copy.
    """

    name: str
    dense: bool

    def encode(self, tensor: torch.Tensor) -> bytes: ...

    def decode(self, data: bytes | memoryview) -> torch.Tensor: ...


class RobustRule(Protocol):
    """A robust aggregation rule (farloco.optim's `Aggregator`): replaces the weighted mean where a minority of
    members may send wrong-but-valid data. Called by a dense chunk's owner on every member's decoded copy of the
    chunk (sparse codecs: by every member on every decoded payload), in member (sorted peer id) order; must be
    deterministic. Its `name` travels in every hello: members of one group must use the same rule."""

    name: str

    def __call__(self, decoded: Sequence[torch.Tensor]) -> torch.Tensor: ...


@dataclass(frozen=True)
class OnDemand:
    """A contribution the exchange computes chunk by chunk when it needs one, instead of a tensor held whole.

    `fill(a, b, out)` writes values [a, b) of the contribution into `out` (a contiguous float32 tensor of b - a
    values) and returns it; it must give the same values every time it is asked, from any thread (the exchange
    calls it from its codec threads, and again for a retry), until `average` returns. A node whose contribution
    is a pure function of buffers that stay put during the exchange (its weights and its optimizer state) passes
    one, and no vector of the model's size is written for the contribution, nor for what the swarm saw of it.
    Dense codecs, and sparse ones that encode piece by piece and parse (codec.py's `payload_terms`: each chunk's
    top values are chosen within the chunk)."""

    numel: int
    fill: Callable[[int, int, torch.Tensor], torch.Tensor]

    def chunk(self, a: int, b: int) -> torch.Tensor:
        """Values [a, b) in a fresh tensor."""
        return self.fill(a, b, torch.empty(b - a, dtype=torch.float32))


@dataclass
class AverageResult:
    """The outcome of one successful exchange."""

    averaged: torch.Tensor  # fp32 mean over `contributors`, bit-identical on every member that returns
    # What this node's own contribution became on the wire (for error feedback). For a lossless codec it is
    # the (flattened) input tensor itself, not a copy. None for an `OnDemand` contribution with a lossy codec:
    # `encoded_in` then says how to make it again (nothing of the model's size is kept for it).
    transmitted: torch.Tensor | None
    contributors: tuple[str, ...]  # peer ids whose contribution is in the mean (sorted)
    # Bytes of farloco frames (headers and payloads) this member sent and received over every attempt,
    # failed ones included; the transport's own framing (HTTP/2, TCP/IP, a data-plane preamble) is not counted.
    bytes_sent: int
    bytes_received: int
    seconds: float
    # What a dense fp32 all-reduce of the same work would have sent from this member: 4 bytes per value sent
    # (dense codecs: the chunks pushed and the means returned; sparse codecs: the ring all-reduce's
    # 2(k-1)/k * 4 bytes per value of each attempt, pro rata of the payload sent). Raw fp32 sends 4 bytes per
    # value plus frame headers, so bytes_sent >= fp32_bytes for it: its compression ratio never exceeds 1.
    fp32_bytes: int = 0
    # The ranges our contribution went through the codec in, in the attempt that gave the mean (dense codecs, in
    # order, within our span): for a lossy codec, `transmitted[a:b]` is decode(encode(contribution[a:b])) for
    # each, so a caller that kept no `transmitted` (OnDemand) rebuilds it range by range, bit for bit.
    encoded_in: tuple[tuple[int, int], ...] = ()
    # An `OnDemand` contribution with a sparse codec: our payload as it went on the wire (without the codec's
    # CRC where the codec leaves it out: parse it with checksum=False); decoding it gives `transmitted`.
    payload: bytes = b""
    # With `average(keep_mean=True)` and a coded (not raw float32) dense codec: the mean's chunks as they travelled,
    # (start, end, bytes) in order over our span; decoding each gives `averaged[start:end]` bit for bit.
    mean_chunks: tuple[tuple[int, int, bytes], ...] = ()
    # The weights of the contributors summed (math.fsum), alike on every member that knows them all; None on a
    # member that does not (it owns no part, behind NAT).
    total_weight: float | None = None
    # How the mean was made: "flat" (Exchange), "rows" (grouped.py's rows and columns) or "rows, then flat" (a
    # grouped round that failed and fell back to the flat exchange among the group)
    path: str = "flat"
    # The tags of `average(tag=)` as they came in the members' hellos (and ours), by peer id, those not empty;
    # alike on every member that knows every hello (as total_weight). grouped.py: a row's losses, told to its
    # column.
    tags: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # grouped.py: the group's members whose contribution is in some ranges of the mean and not in others (a row
    # lost the carrier of a slice: that slice's mean is its other rows'); see "A member lost" there.
    partial: tuple[str, ...] = ()
    # The ranges of our contribution (in order) that are in no range of the mean: we are partial, and these
    # slices' means lack us. Nothing of them was transmitted: error feedback keeps them whole (OuterStrategy).
    withheld: tuple[tuple[int, int], ...] = ()
    # The group's members none of whose hellos reached us in any attempt (they never started the exchange, or
    # died before): grouped.py goes on without a column's carrier only if it is one (see "A member lost").
    silent: tuple[str, ...] = ()


class ExchangeAborted(Exception):
    """The round cannot produce a mean that is consistent across the survivors.

    Carries the bytes the failed attempts moved anyway (same meaning as AverageResult's fields)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"exchange aborted, reason={reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.bytes_sent = 0
        self.bytes_received = 0
        self.fp32_bytes = 0
