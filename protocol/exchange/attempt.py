"""One attempt of an exchange on this node (`Attempt`), and the attempts this node knows of (`Attempts`).

A round is a sequence of *attempts*. An attempt succeeds locally when this member holds every part of the mean
(dense: every lane of every other member's part, and our own part once reduced; sparse: every payload). It fails
at the first error (first reason wins): a peer's bad data, a broken stream, the data phase's deadline, our own
tensor that cannot be encoded. A failed attempt keeps checking, without reducing, what the others still send for
a short grace (EVIDENCE_GRACE_SECONDS), so that its vote can name a member that sent it bad data; then it votes
(vote.py). An attempt's id is the group id for the first and one per (members, attempt number) after that
(`plan.attempt_key`), so a peer's stream always names the attempt it belongs to. A peer's stream may come before
this node starts that attempt: it then waits for it (JOIN_WAIT_SECONDS) in a placeholder, which is refused once
this node starts the same round and attempt under another id, or moves on to a later round.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from farloco.protocol.exchange.api import OnDemand, RobustRule
from farloco.protocol.exchange.codecpool import Jobs
from farloco.protocol.exchange.plan import Plan, lanes_for
from farloco.protocol.exchange.wire import AttemptRef, Hello, Vote, precondition
from farloco.protocol.rpc import CallContext, Frame, Reject
from farloco.protocol.types import GroupMember
from farloco.util.tasks import wait_for

log = logging.getLogger("farloco.protocol.exchange")

# How long an incoming stream waits for this node to start the matching attempt locally.
JOIN_WAIT_SECONDS = 60.0
# Votes of finished attempts kept to answer late vote calls.
DECIDED_MEMORY = 256
# After an attempt fails, how long this member keeps checking (not reducing) what the others are still sending
# before it votes, so that its vote can name a member that sent it bad data even when another member's abort
# reached it first: the accusation then has a majority and the retry goes on without that member. Its own
# pushes keep going meanwhile, for the same reason. Bounded by the data phase's deadline; it ends early once
# every member's stream was seen and read to its end and every push of ours ended. Not after a deadline, our own
# bad input or a group mismatch. A crashed member's stream never ends, so a crash costs up to this much more.
EVIDENCE_GRACE_SECONDS = 1.0


@dataclass
class Attempt:
    """State of one attempt of one exchange on this node. Created by `average()` or, if a peer's stream
    arrives first, as a placeholder that waits for the local side to start."""

    key: str  # the attempt's id (`attempt_key`: the group id for the first, then per members and number)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # local success or failure
    waiters: int = 0
    superseded_by: str | None = None  # a placeholder whose (round, attempt) started under another group id
    moved_on: int | None = None  # a placeholder of a round this node left for round `moved_on`
    expect_round: int = -1  # what a placeholder's first waiter claimed, to detect group mismatches
    expect_attempt: int = -1
    expect_stage: int = 0
    # Filled by Exchange._start():
    round_id: int = 0
    attempt_no: int = 0
    stage: int = 0  # see AttemptRef.stage
    members: tuple[GroupMember, ...] = ()
    me: int = 0
    dense: bool = True
    codec: Any = None  # the TensorCodec
    lossless: bool = False
    raw: bool = False  # raw float32 chunks, no codec calls (see TensorCodec.raw_float32)
    weight: float = 1.0
    tag: tuple[int, ...] = ()  # our hello's tag (Hello.tag)
    lo: int = 0  # our span: the element range we contribute to and take the mean of (see Spans in plan.py)
    hi: int = 0
    flat: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    source: OnDemand | None = None  # our contribution made chunk by chunk (then `flat` is empty); see own()
    plan: Plan = field(default_factory=lambda: Plan(0, 1, 1))
    result: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    # What the others decode of our contribution; None for an OnDemand contribution with a lossy codec (the
    # caller rebuilds it from `encoded_in()`).
    transmitted: torch.Tensor | None = field(default_factory=lambda: torch.empty(0))
    fast: bool = False  # the codec takes checksum=False and out= (TensorCodec.optional_checksum)
    rule: RobustRule | None = None  # None: the weighted mean
    # Progress:
    parts_missing: int = 0  # dense: parts (or sparse: payloads) this node still lacks
    ok: bool = False
    failure: str = ""
    bad: set[str] = field(default_factory=set)
    local_error: BaseException | None = None
    streams_from: set[tuple[int, int]] = field(default_factory=set)  # (member index, lane) streams seen
    lanes_of: dict[int, int] = field(default_factory=dict)  # member index -> lanes of its streams to us
    weights: dict[int, float] = field(default_factory=dict)
    tags: dict[int, tuple[int, ...]] = field(default_factory=dict)  # member index -> its hello's tag, if any
    # chunk -> member index -> its contribution: a tensor, a decode's job (codecpool.py), or None (absent)
    pending: dict[int, dict[int, Any]] = field(default_factory=dict)
    chunks_reduced: int = 0
    payload: bytes = b""  # sparse: our encoded payload, sent to every member
    # sparse: member index -> its term of the mean (a decoded tensor, or a parsed payload: reduce.sparse_sum),
    # until it is summed; the terms summed (members 0 .. summed - 1), the payloads checked, and the lock that
    # keeps the sums in member order (owner.py `_sparse_part_done`)
    decoded: dict[int, Any] = field(default_factory=dict)
    summed: int = 0
    terms_in: int = 0
    summing: asyncio.Lock = field(default_factory=asyncio.Lock)
    # (member index, lane) -> what goes back on that stream; made when the stream arrives
    outboxes: dict[tuple[int, int], asyncio.Queue[Frame | Reject]] = field(default_factory=dict)
    status: asyncio.Future[Vote] | None = None  # our vote, once cast
    # Votes members sent us with their own vote calls, by peer id: how we learn the vote of a member behind NAT
    # (we cannot call it), and what we relay to the other members behind NAT. `voted` is set on each arrival.
    votes_in: dict[str, Vote] = field(default_factory=dict)
    voted: asyncio.Event = field(default_factory=asyncio.Event)
    consumers: set[asyncio.Task[None]] = field(default_factory=set)  # tasks reading the members' streams
    reducers: set[asyncio.Task[None]] = field(default_factory=set)  # an owner's chunks being reduced
    jobs: Jobs = field(default_factory=Jobs)  # codec jobs of the attempt not yet ended (codecpool.py)
    grace_until: float = 0.0  # see EVIDENCE_GRACE_SECONDS; set by fail()
    heard: dict[int, float] = field(default_factory=dict)  # member index -> loop time of its last frame to us
    gone: set[str] = field(default_factory=set)  # members given up as gone (gone.py)
    # member index -> (when sent, the ping: answered or not) of the last ping to a silent, gone member
    pings: dict[int, tuple[float, asyncio.Task[bool]]] = field(default_factory=dict)
    data_deadline: float = math.inf
    bytes_sent: int = 0
    bytes_received: int = 0
    fp32_sent: float = 0.0  # see AverageResult.fp32_bytes
    # Dense coded chunks of the mean as they came on the wire (`average(keep_mean=True)`): start -> (end, bytes)
    mean_chunks: dict[int, tuple[int, bytes]] | None = None

    @property
    def member_ids(self) -> list[str]:
        return [m.peer_id for m in self.members]

    @property
    def aggregator(self) -> str:
        """The name of what reduces a chunk: the robust rule's, or "mean" (every member of a group alike)."""
        return self.rule.name if self.rule is not None else "mean"

    def own(self, a: int, b: int) -> torch.Tensor:
        """Our contribution's values [a, b): a view of the tensor given, or made now (OnDemand: a fresh tensor)."""
        return self.flat[a:b] if self.source is None else self.source.chunk(a, b)

    def total_weight(self) -> float | None:
        """The weights of every member of the attempt summed (they came in the hellos of the streams to us), or
        None where some never reached us (we own no part: behind NAT)."""
        if len(self.weights) != len(self.members):
            return None
        return math.fsum(self.weights.values())

    def encoded_in(self) -> tuple[tuple[int, int], ...]:
        """The ranges our contribution goes through the codec in (dense codecs): every part's chunks inside our
        span, in order (AverageResult.encoded_in)."""
        if not self.dense:
            return ()
        return tuple(
            chunk for j in range(self.plan.num_parts) for chunk in self.plan.chunks(j) if self.covers(*chunk)
        )

    def covers(self, a: int, b: int) -> bool:
        """Whether chunk [a, b) is inside our span (chunks never straddle a span's boundary)."""
        return self.lo <= a and b <= self.hi

    def fail(self, reason: str, bad_peer: str | None = None, *, evidence: bool = True) -> None:
        """Mark the attempt failed (first reason wins) and tell every peer streaming to us. With `evidence`,
        what the others still send is checked before voting (EVIDENCE_GRACE_SECONDS); not after a deadline, our
        own bad input, a cancellation or a mismatched group, where it would only delay the vote."""
        if bad_peer is not None:
            self.bad.add(bad_peer)
        if self.finished.is_set():
            return
        self.failure = reason
        if evidence:
            now = asyncio.get_running_loop().time()
            self.grace_until = min(now + EVIDENCE_GRACE_SECONDS, self.data_deadline)
        log.info("exchange attempt %s/%d failed: %s", self.key[:12], self.attempt_no, reason)
        for outbox in self.outboxes.values():
            outbox.put_nowait(self.failed())
        self.finished.set()

    def failed(self) -> Reject:
        return Reject(grpc.StatusCode.ABORTED, "ATTEMPT_FAILED", self.failure)

    def outbox(self, sender: int, lane: int) -> asyncio.Queue[Frame | Reject]:
        """A new stream's outbox (already holding the failure if the attempt failed before it came)."""
        outbox: asyncio.Queue[Frame | Reject] = asyncio.Queue()
        if self.checking:
            outbox.put_nowait(self.failed())
        self.outboxes[(sender, lane)] = outbox
        return outbox

    def lane_of(self, sender: int, k: int) -> int:
        """The lane of `sender`'s stream that carries chunk k of our part."""
        return k % lanes_for(self.lanes_of[sender], len(self.plan.chunks(self.me)))

    def all_streams_seen(self) -> bool:
        """Every other member's every lane arrived (a sender's lane count is known from its first stream)."""
        chunks = len(self.plan.chunks(self.me)) if self.dense else 1
        if not self.members[self.me].dialable:
            return True  # nobody can push to a member behind NAT
        return all(
            j in self.lanes_of
            and sum(1 for sender, _ in self.streams_from if sender == j)
            == lanes_for(self.lanes_of[j], chunks)
            for j in range(len(self.members))
            if j != self.me
        )

    @property
    def checking(self) -> bool:
        """Failed: incoming chunks are still checked (evidence for the vote) but not reduced."""
        return self.finished.is_set() and not self.ok

    async def gather_evidence(
        self,
        consumer: asyncio.Task[None] | None = None,
        pushes: dict[tuple[int, int], asyncio.Task[None]] | None = None,
    ) -> None:
        """Until the grace after a failure ends: wait for `consumer` (one stream) or, without it, for every other
        member's stream to arrive and be read to its end and for each of our `pushes` to end (its peer took every
        chunk, or refused it)."""
        loop = asyncio.get_running_loop()
        while loop.time() < self.grace_until:
            if consumer is not None:
                if consumer.done():
                    return
            elif (
                self.all_streams_seen()
                and all(c.done() for c in self.consumers)
                and all(task.done() for task in (pushes or {}).values())
            ):
                return
            await asyncio.sleep(min(0.01, max(0.0, self.grace_until - loop.time())))

    def part_done(self) -> None:
        self.parts_missing -= 1
        if self.parts_missing == 0 and not self.finished.is_set():
            self.ok = True
            self.finished.set()

    def hello(self, lane: int, lanes: int) -> Hello:
        """The first frame of our stream on lane `lane` of `lanes` to an owner: what this attempt is."""
        return Hello(
            AttemptRef(self.key, self.attempt_no, self.stage),
            self.plan.numel,
            self.plan.chunk_elems,
            self.plan.slices,
            self.codec.name,
            self.dense,
            self.weight,
            self.raw,
            lane,
            lanes,
            self.aggregator,
            tag=self.tag,
        )

    def vote(self) -> Vote:
        return Vote(self.ok, tuple(sorted(self.bad)), self.plan.numel, str(self.codec.name))

    def fail_locally(self, exc: Exception) -> None:
        """Our own tensor cannot be encoded (e.g. NaN): exclude ourselves so the others go on without us, and
        raise the codec's error to our caller once the votes are out."""
        self.local_error = exc
        self.bad.add(self.member_ids[self.me])
        self.fail(f"LOCAL_ENCODE_FAILED: {type(exc).__name__}: {exc}", evidence=False)


class Attempts:
    """The attempts of this node's exchanges, running or waited for by a peer's stream, and the votes of the
    finished ones (to answer late vote calls)."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self._attempts: dict[str, Attempt] = {}
        self._newest_round = -1  # the newest round this node works on (`advance`)
        self._decided: OrderedDict[str, tuple[Vote, dict[str, Vote]]] = OrderedDict()

    def values(self) -> list[Attempt]:
        return list(self._attempts.values())

    def open(self, key: str) -> Attempt:
        """Attempt `key` for the local side to start: the placeholder a peer's stream made, or a new one."""
        if key in self._attempts and self._attempts[key].started.is_set():
            raise RuntimeError(f"an exchange for group {key[:12]} is already running on {self.peer_id}")
        attempt = self._attempts.get(key) or Attempt(key)
        self._attempts[key] = attempt
        # The same group may average again (e.g. several tensors in one round): a new exchange.
        self._decided.pop(key, None)
        return attempt

    def started(self, attempt: Attempt) -> None:
        """`attempt` started locally: its round is this node's now, and streams that arrived early under another
        group id for its round and attempt are refused now."""
        self.advance(attempt.round_id)
        for other in self.values():
            if other is attempt or other.started.is_set():
                continue
            if (other.expect_round, other.expect_stage, other.expect_attempt) == (
                attempt.round_id,
                attempt.stage,
                attempt.attempt_no,
            ):
                other.superseded_by = attempt.key
                other.started.set()

    def advance(self, round_id: int) -> None:
        """This node works on round `round_id` now (it committed the round before, closed it without an update,
        took the swarm's state, or starts an attempt of it): streams and votes of an earlier round's group are
        refused at once (ATTEMPT_OVER), those already waiting included. A member thawed after the others grouped
        it closes that round and moves on (alone, if everyone else is behind it); its old group would otherwise
        wait for it until its data deadline and then for its vote (a 53 s round in the chaos runner's churn)."""
        if round_id <= self._newest_round:
            return
        self._newest_round = round_id
        for other in self.values():
            if not other.started.is_set() and 0 <= other.expect_round < round_id:
                other.moved_on = round_id
                other.started.set()

    def decided(self, key: str) -> tuple[Vote, dict[str, Vote]] | None:
        """Our vote in finished attempt `key` and the votes members sent us in it, if still remembered."""
        return self._decided.get(key)

    def remember(self, key: str, vote: Vote, votes_in: dict[str, Vote] | None = None) -> None:
        self._decided[key] = (vote, votes_in if votes_in is not None else {})  # later arrivals too
        while len(self._decided) > DECIDED_MEMORY:
            self._decided.popitem(last=False)

    def retire(self, attempt: Attempt) -> None:
        """The local side is done with `attempt`: its tasks end, its codec jobs are waited for (before its buffers
        go back to the caller, or to the next attempt, which writes the same `out`), its vote stays to answer."""
        for _, ping in attempt.pings.values():
            ping.cancel()
        for reducer in attempt.reducers:
            reducer.cancel()
        attempt.jobs.wait()
        if not attempt.finished.is_set():
            attempt.fail("abandoned", evidence=False)
        if attempt.status is not None and not attempt.status.done():
            vote = attempt.vote()
            attempt.status.set_result(vote)
            self.remember(attempt.key, vote, attempt.votes_in)
        if self._attempts.get(attempt.key) is attempt:
            del self._attempts[attempt.key]

    async def find(self, ctx: CallContext, ref: AttemptRef) -> Attempt:
        """The started local attempt `ref`, waiting for the local side to start it if the peer came first."""
        key = ref.group
        attempt = self._attempts.get(key)
        if attempt is None:
            if key in self._decided:
                raise Reject(
                    grpc.StatusCode.ABORTED, "ATTEMPT_OVER", f"group {key[:12]} already finished here"
                )
            if ctx.round_id < self._newest_round:
                raise Reject(
                    grpc.StatusCode.ABORTED,
                    "ATTEMPT_OVER",
                    f"round {ctx.round_id}: this node moved on to round {self._newest_round} without group {key[:12]}",
                )
            for other in self._attempts.values():
                # One group per round, stage and attempt: a started one under another id means the sender
                # disagrees.
                if other.started.is_set() and (other.round_id, other.stage, other.attempt_no) == (
                    ctx.round_id,
                    ref.stage,
                    ref.attempt,
                ):
                    raise precondition(
                        "GROUP_MISMATCH",
                        f"round {ctx.round_id}: expected group {other.key[:12]}, got {key[:12]} from {ctx.sender}",
                    )
            attempt = Attempt(
                key, expect_round=ctx.round_id, expect_attempt=ref.attempt, expect_stage=ref.stage
            )
            self._attempts[key] = attempt
        attempt.waiters += 1
        try:
            await wait_for(attempt.started.wait(), timeout=JOIN_WAIT_SECONDS)
        except TimeoutError:
            raise precondition("UNKNOWN_GROUP", f"group {key[:12]} was never started here") from None
        finally:
            attempt.waiters -= 1
            unused = (
                not attempt.started.is_set()
                or attempt.superseded_by is not None
                or attempt.moved_on is not None
            )
            if unused and attempt.waiters == 0 and self._attempts.get(key) is attempt:
                del self._attempts[key]
        if attempt.moved_on is not None:
            raise Reject(
                grpc.StatusCode.ABORTED,
                "ATTEMPT_OVER",
                f"round {ctx.round_id}: this node moved on to round {attempt.moved_on} without group {key[:12]}",
            )
        if attempt.superseded_by is not None:
            raise precondition(
                "GROUP_MISMATCH",
                f"round {ctx.round_id}: expected group {attempt.superseded_by[:12]}, got {key[:12]} from {ctx.sender}",
            )
        if ctx.round_id != attempt.round_id:
            raise precondition("STALE_ROUND", f"expected round {attempt.round_id}, got {ctx.round_id}")
        if ctx.sender not in attempt.member_ids or ctx.sender == self.peer_id:
            raise Reject(
                grpc.StatusCode.PERMISSION_DENIED,
                "NOT_A_MEMBER",
                f"{ctx.sender} is not another member of group {key[:12]}: members are {attempt.member_ids}",
            )
        return attempt
