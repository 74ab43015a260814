"""The exchange's wire: its two methods, the frame headers they carry as typed messages, and its rejections.

`ExchangePush` (a bidirectional stream, one per member, owner and lane): the sender's `Hello`, then one `Chunk`
frame per chunk of the lane (dense; `absent` outside the sender's span, no payload) or the whole payload in
`Piece` frames (sparse); the owner answers with one `Chunk` frame per chunk carrying its mean (dense) or one
`Done` frame (sparse). `ExchangeVote` (unary): a `VoteRequest` carrying the asker's `Vote`, answered with the
answerer's `Vote`.

Each message is a frozen dataclass: `encode()` gives the frame header (1-2 letter msgpack keys, in a fixed
order), `decode(header)` checks every field's type and raises a `Reject` naming what is wrong. Checks that need
the attempt (does the hello's codec match ours? is this the chunk we expect next?) are the receiver's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import grpc

from farloco.protocol.exchange.plan import MAX_LANES
from farloco.protocol.rpc import Frame, Reject, encode_frame_header

PUSH_METHOD = "ExchangePush"
VOTE_METHOD = "ExchangeVote"
# A stream that simply ends early is what a crashed or cancelled peer looks like: no evidence of bad data.
NOT_BLAME = frozenset({"TRUNCATED"})


def invalid(reason: str, detail: str) -> Reject:
    return Reject(grpc.StatusCode.INVALID_ARGUMENT, reason, detail)


def precondition(reason: str, detail: str) -> Reject:
    return Reject(grpc.StatusCode.FAILED_PRECONDITION, reason, detail)


def within(where: str, rejection: Reject) -> Reject:
    """`rejection` with `where` (the stream it came on) before its detail: a decoder does not know it."""
    return Reject(rejection.code, rejection.reason, f"{where}: {rejection.detail}")


class Blamed(Reject):
    """Bad data found while reducing a chunk, when the member at fault need not be the one whose chunk came last."""

    def __init__(self, peer: str | None, reason: str, detail: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, reason, detail)
        self.peer = peer


def blame(rejection: Reject, peer: str) -> str | None:
    """Who a rejection of data `peer` sent names as at fault (nobody, for a stream that merely ended early)."""
    return None if rejection.reason in NOT_BLAME else peer


def wire_size(frame: Frame) -> int:
    """Bytes `frame` takes on the wire: length prefix, msgpack header, payload."""
    return len(encode_frame_header(frame)) + len(frame.payload)


@dataclass(frozen=True)
class AttemptRef:
    """Which attempt a stream or a vote is for: its id (`plan.attempt_key`) and number (`g`, `a`)."""

    group: str
    attempt: int

    @classmethod
    def decode(cls, header: dict[str, Any]) -> AttemptRef:
        key, attempt_no = header.get("g"), header.get("a")
        if not isinstance(key, str) or len(key) != 64 or not isinstance(attempt_no, int):
            raise invalid("BAD_HEADER", f"expected a 64-char group id and an attempt number, got {key!r:.80}")
        return cls(key, attempt_no)


@dataclass(frozen=True)
class Hello:
    """The first frame of a push: what the sender's attempt is (the owner checks it against its own) and which of
    its lanes this stream is. `length`: a sparse payload's size in bytes (None for dense codecs)."""

    ref: AttemptRef
    numel: int
    chunk_elems: int
    slices: int
    codec: str
    dense: bool
    weight: float
    raw: bool
    lane: int
    lanes: int
    aggregator: str
    length: int | None = None

    def encode(self) -> dict[str, Any]:
        header = {
            "g": self.ref.group,
            "a": self.ref.attempt,
            "n": self.numel,
            "ce": self.chunk_elems,
            "sl": self.slices,
            "c": self.codec,
            "d": self.dense,
            "w": self.weight,
            "r": self.raw,
            "l": self.lane,
            "L": self.lanes,
            "ag": self.aggregator,
        }
        if self.length is not None:
            header["len"] = self.length
        return header

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Hello:
        ref = AttemptRef.decode(header)
        numel = header.get("n")
        if not isinstance(numel, int):
            raise invalid("SHAPE_MISMATCH", f"expected an int numel, got {numel!r:.20}")
        chunk_elems, slices = header.get("ce"), header.get("sl", 0)
        if not isinstance(chunk_elems, int) or not isinstance(slices, int):
            raise invalid(
                "CHUNK_MISMATCH",
                f"expected int chunk elements and slices, got {chunk_elems!r:.20} at {slices!r:.20}",
            )
        codec, dense, raw = header.get("c"), header.get("d"), header.get("r", False)
        if not isinstance(codec, str) or not isinstance(dense, bool) or not isinstance(raw, bool):
            raise invalid("CODEC_MISMATCH", f"expected a codec name and its flags, got {codec!r:.40}")
        aggregator = header.get("ag", "mean")
        if not isinstance(aggregator, str):
            raise invalid("AGGREGATOR_MISMATCH", f"expected an aggregator name, got {aggregator!r:.40}")
        weight = header.get("w")
        if not isinstance(weight, float) or not (math.isfinite(weight) and weight > 0):
            raise invalid("BAD_WEIGHT", f"expected a finite weight > 0, got {weight!r}")
        lanes, lane = header.get("L", 1), header.get("l", 0)
        if (
            not isinstance(lanes, int)
            or not isinstance(lane, int)
            or not 1 <= lanes <= MAX_LANES
            or (not dense and lanes != 1)
        ):
            raise invalid(
                "BAD_HEADER", f"expected lanes in 1..{MAX_LANES} (1 for a sparse codec), got {lanes!r:.20}"
            )
        length = header.get("len")
        if length is not None and not (isinstance(length, int) and length >= 0):
            raise invalid("SIZE_MISMATCH", f"expected a payload length >= 0, got {length!r:.20}")
        return cls(
            ref, numel, chunk_elems, slices, codec, dense, weight, raw, lane, lanes, aggregator, length
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    """A dense chunk frame's header, either way: chunk `index` of the part (a member's contribution, or the
    owner's mean), or `absent`: outside the span, no payload."""

    index: int
    absent: bool = False

    def encode(self) -> dict[str, Any]:
        return {"k": self.index, "x": True} if self.absent else {"k": self.index}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Chunk:
        index = header.get("k")
        if not isinstance(index, int):
            raise invalid("CHUNK_ORDER", f"expected a chunk index, got {index!r:.20}")
        return cls(index, header.get("x", False) is True)


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of a sparse payload: its bytes from `offset` on."""

    offset: int

    def encode(self) -> dict[str, Any]:
        return {"o": self.offset}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Piece:
        offset = header.get("o")
        if not isinstance(offset, int):
            raise invalid("SIZE_MISMATCH", f"expected a payload offset, got {offset!r:.20}")
        return cls(offset)


@dataclass(frozen=True)
class Done:
    """A sparse payload's owner took it whole."""

    def encode(self) -> dict[str, Any]:
        return {"done": True}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Done:
        if header.get("done") is not True:
            raise invalid("BAD_HEADER", "expected a done frame")
        return cls()


@dataclass(frozen=True)
class Vote:
    """A member's outcome of an attempt: whether it holds the whole result, the members that sent it malformed
    data, and its tensor's size and codec (so the survivors agree, by majority, on who brought a mismatched
    tensor)."""

    ok: bool
    bad: tuple[str, ...]
    numel: int
    codec: str

    def encode(self) -> dict[str, Any]:
        return {"v": {"ok": self.ok, "bad": list(self.bad), "n": self.numel, "c": self.codec}}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Vote:
        vote = header.get("v")
        if (
            not isinstance(vote, dict)
            or not isinstance(ok := vote.get("ok"), bool)
            or not isinstance(numel := vote.get("n"), int)
            or not isinstance(codec := vote.get("c"), str)
            or not isinstance(bad := vote.get("bad"), list)
            or not all(isinstance(p, str) for p in bad)
        ):
            raise invalid("BAD_VOTE", f"expected a vote, got {vote!r:.200}")
        return cls(ok, tuple(bad), numel, codec)


@dataclass(frozen=True)
class VoteRequest:
    """An `ExchangeVote` call: the attempt it is about, with the asker's own vote."""

    ref: AttemptRef
    vote: Vote

    def encode(self) -> dict[str, Any]:
        return {"g": self.ref.group, "a": self.ref.attempt, **self.vote.encode()}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> VoteRequest:
        key = header.get("g")
        if not isinstance(key, str):
            raise invalid("BAD_HEADER", f"expected a group id string, got {key!r:.80}")
        return cls(AttemptRef.decode(header), Vote.decode(header))
