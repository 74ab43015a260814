"""The exchange's wire: its two methods, the frame headers they carry as typed messages, and its rejections.

`ExchangePush` (a bidirectional stream, one per member, owner and lane): the sender's `Hello`, then one `Chunk`
frame per chunk of the lane (dense; `absent` outside the sender's span, no payload) or the whole payload in
`Piece` frames (sparse); the owner answers with one `Chunk` frame per chunk carrying its mean (dense) or one
`Done` frame (sparse). `ExchangeVote` (unary): a `VoteRequest` carrying the asker's `Vote`, answered with the
answerer's `Vote`.

Each message is a frozen dataclass: `encode()` gives the frame header (1-2 letter msgpack keys, in a fixed
order), `decode(header)` reads it with the field checks of `farloco.protocol.messages` (no coercion; fields
a decoder does not read are ignored) and raises a `Reject` with the exchange's reason code for the field
(`refusing` turns the check's `WireError` into it), its detail naming the field, what was expected and what
came. Checks that need the attempt (does the hello's codec match ours? is this the chunk we expect next?) are
the receiver's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from farloco.protocol.exchange.plan import MAX_LANES
from farloco.protocol.messages import Fields, WireError, check_int, check_str
from farloco.protocol.rpc import Frame, Reject, encode_frame_header

PUSH_METHOD = "ExchangePush"
VOTE_METHOD = "ExchangeVote"
# A stream that simply ends early is what a crashed or cancelled peer looks like: no evidence of bad data.
NOT_BLAME = frozenset({"TRUNCATED"})
MAX_BAD = 1 << 16  # members a vote may name as bad
MAX_STAGE = 7  # exchanges one round may run one after the other (AttemptRef.stage)
MAX_TAG_ITEMS = 4096  # ints a hello's tag may hold (Hello.tag)
MAX_TAG_VALUE = (1 << 20) - 1


@contextmanager
def refusing(reason: str) -> Iterator[None]:
    """Turn a field check's `WireError` into a `Reject` (INVALID_ARGUMENT) with the exchange's `reason` code."""
    try:
        yield
    except WireError as error:
        raise invalid(reason, str(error)) from None


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
    """Which attempt a stream or a vote is for: its id (`plan.attempt_key`), number and stage (`g`, `a`, `st`).

    The stage tells apart the exchanges one round runs one after the other among different members (the row and
    the column of a grouped round, grouped.py): one group per round, stage and attempt number."""

    group: str
    attempt: int
    stage: int = 0

    def encode(self) -> dict[str, Any]:
        header: dict[str, Any] = {"g": self.group, "a": self.attempt}
        if self.stage:
            header["st"] = self.stage
        return header

    @classmethod
    def decode(cls, header: dict[str, Any]) -> AttemptRef:
        fields = Fields.loose(header, "header")
        with refusing("BAD_HEADER"):
            return cls(
                fields.hex("g", exact=64),
                fields.integer("a"),
                fields.integer("st", low=0, high=MAX_STAGE, default=0),
            )


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
    # The caller's note to every member (`Exchange.average(tag=)`): small ints, each member's own; grouped.py
    # sends the indices of the round's members its row lost. Empty: not sent.
    tag: tuple[int, ...] = ()

    def encode(self) -> dict[str, Any]:
        header = {
            **self.ref.encode(),
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
        if self.tag:
            header["tg"] = list(self.tag)
        return header

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Hello:
        ref = AttemptRef.decode(header)
        fields = Fields.loose(header, "hello")
        with refusing("SHAPE_MISMATCH"):
            numel = fields.integer("n")
        with refusing("CHUNK_MISMATCH"):
            chunk_elems, slices = fields.integer("ce"), fields.integer("sl", default=0)
        with refusing("CODEC_MISMATCH"):
            codec, dense, raw = fields.text("c"), fields.flag("d"), fields.flag("r", default=False)
        with refusing("AGGREGATOR_MISMATCH"):
            aggregator = fields.text("ag", default="mean")
        with refusing("BAD_WEIGHT"):
            weight = fields.real("w", finite=True)
            if not weight > 0:
                raise WireError(fields.at("w"), "a finite float > 0", weight)
        with refusing("BAD_HEADER"):
            lanes = fields.integer("L", low=1, high=MAX_LANES if dense else 1, default=1)
            lane = fields.integer("l", default=0)
        with refusing("SIZE_MISMATCH"):
            length = None if fields.raw("len") is None else fields.integer("len")
        with refusing("BAD_HEADER"):
            tag = (
                tuple(
                    fields.items(
                        "tg", lambda v, w: check_int(v, w, high=MAX_TAG_VALUE), max_len=MAX_TAG_ITEMS
                    )
                )
                if fields.has("tg")
                else ()
            )
        return cls(
            ref, numel, chunk_elems, slices, codec, dense, weight, raw, lane, lanes, aggregator, length, tag
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
        fields = Fields.loose(header, "chunk")
        with refusing("CHUNK_ORDER"):
            return cls(fields.integer("k"), fields.flag("x", default=False))


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of a sparse payload: its bytes from `offset` on."""

    offset: int

    def encode(self) -> dict[str, Any]:
        return {"o": self.offset}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Piece:
        with refusing("SIZE_MISMATCH"):
            return cls(Fields.loose(header, "piece").integer("o"))


@dataclass(frozen=True)
class Done:
    """A sparse payload's owner took it whole."""

    def encode(self) -> dict[str, Any]:
        return {"done": True}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Done:
        if header.get("done") is not True:
            raise invalid("BAD_HEADER", f"done.done: expected True, got {header.get('done')!r:.20}")
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
        with refusing("BAD_VOTE"):
            fields = Fields.loose(header.get("v"), "vote")
            bad = fields.items("bad", check_str, max_len=MAX_BAD)
            return cls(fields.flag("ok"), tuple(bad), fields.integer("n"), fields.text("c"))


@dataclass(frozen=True)
class VoteRequest:
    """An `ExchangeVote` call: the attempt it is about, with the asker's own vote."""

    ref: AttemptRef
    vote: Vote

    def encode(self) -> dict[str, Any]:
        return {**self.ref.encode(), **self.vote.encode()}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> VoteRequest:
        return cls(AttemptRef.decode(header), Vote.decode(header))
