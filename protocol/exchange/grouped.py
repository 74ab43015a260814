"""The exchange in bounded groups: a round's mean through rows and columns, so that a member talks to a few
times G others instead of N - 1 and its bytes stay flat in N.

Layout (`layout`, sans-IO). The group's members, in an order drawn from the round id (sha256 of the round and
the peer id: who sits where rotates), are cut into R = ceil(N / G) rows of balanced sizes (they differ by one at
most, each at most G = `group_size`). P, the smallest row's size, cuts the flat tensor into P balanced slices;
the member at position i of every row carries slice i (in a row of P + 1 the last member carries none), and the
members carrying slice i form column i: R members, one per row.

A round, three stages:
1. row (`Exchange.average`, stage 0): each row averages its members' whole contributions, weighted; every member
   of the row holds the row's mean (bit for bit alike) and the row's total weight.
2. column (stage 1): column i averages slice i of its rows' means, each weighted by its row's total weight: the
   group's weighted mean of slice i, alike on every member of the column, with the coded chunks it was decoded
   from (`keep_mean`; raw float32: the values themselves).
3. gather (`ExchangeSlice`): each member takes every other slice's chunks from the member of its row carrying
   it (should that one fail, from the next member of that column) and decodes them. Every member decodes the
   same bytes for every slice: the mean is bit-identical on every member of the group, one theta hash a round.

The mean is the group's weighted mean. A lossy codec codes each contribution once (row), each row's mean once
(column; once more per level of nesting) and nothing more (the slices travel as the column coded them): one
coding more than the flat exchange, so the error bound is the codec's for a mean of means. fp32 sums in another
order than the flat exchange (rows, then columns): within a few ulps of it.

A member lost. A member that crashes (or is excluded by its row's votes) inside the round does not fail it, at
any depth: its row's flat exchange goes on without it (its votes drop the lost member, as in any flat round), and
its row's carriers tell their columns whom the row lost (the tag of their hellos, `Exchange.average(tag=)`). A
column goes on without a carrier its votes dropped where that carrier never reached it (none of its hellos came,
`AverageResult.silent`: lost in its row stage) or no process listens at its address any more (a connection there
is refused: it crashed, and serves nothing): that slice is then the weighted mean of the other rows (the lost
carrier's row-mates are in every other slice's mean: `AverageResult.partial`; each of them gets that slice's range
in `AverageResult.withheld`, which its error feedback keeps whole for the next round). A dropped carrier that
still runs (or does not answer: frozen, cut off) may have ended the column otherwise (its votes late, the flat
exchange's split), and a mean without its row could then differ from the one it serves: that column fails as
below. Losses are told as the round's members (indices in the round's group order), by range of the tensor
(`Ranges`): one level down a column's member brings its whole row one level up, and its contribution lacks what
that row lost (the tag of its hellos in the nested row), so a nested column's slice may lack different members
in each of its own slices. Each carrier serves its slice with the members its mean lacks (in the header of a
chunk, where that changes: the rows its column went on without, and what the rows in it lost), so every member
that commits holds the same bits and names the same contributors: those in some range's mean. A member that
gathers skips the row-mates its row lost and, should a slice's carrier not hold it (SLICE_UNKNOWN: its row or
its column went on without it), asks the next member of that column. A lost member's row took longer (its flat
exchange waited out the silence, then retried): the stages end at the same times on every member (the rows at
ROW_SHARE of the timeout from the round's start, the columns at ROW_SHARE + COLUMN_SHARE; one level down, the
same shares of the time from the rows' end to the columns' end), and each flat stage's data phase ends no
sooner than its share of the stage from the stage's start (`Exchange.average(data_by=)`), so the carriers of
quick rows wait for the slow ones.

A failed round. Otherwise (a column that aborted or dropped a carrier that had reached it and still runs; this
member left out of its row or, one level down, of a row or a column there) the round does not commit in rows, or
not here. A row whose exchange aborts keeps its carriers out of the columns; a carrier whose column failed (or
whose nested column did, where nobody can hold its slice) answers requests for its slice with SLICE_FAILED. A
member that learns any of these (ROW_FAILED, COLUMN_FAILED, SLICE_FAILED) averages with the flat exchange among
the whole group instead, in the time left (stage FALLBACK_STAGE; not with less than FALLBACK_MIN_SHARE of the
timeout): its votes and retries drop the members lost, as in any flat round, so a member lost inside the round
costs the round's time, not the round. A member left out of its row falls back too, since a member left out
of a fallback would close the round alone and, a round ahead of the others, could start a lineage of its own
(seen with 16 nodes); where the others committed in rows its fallback finds nobody and raises once they have
moved on; and a fallback among a minority cannot commit (the flat exchange drops silent members only while the
rest is a strict majority). A member that only failed to reach a slice's carriers (GATHER_FAILED: others may
have it) raises `ExchangeAborted`; it holds none of the round's mean, so no two members that commit differ.

Nesting. A column of more than G members (R > G: a group of more than G^2) is itself averaged in rows and
columns, one level down (its rows at stage 2, its columns at stage 3, and so on, up to MAX_DEPTH), so nobody
ever averages with more than G others at once.

Cost per member and round (a contribution of V values, the flat exchange's in brackets): about 2(G - 1) distinct
peers per level, ceil(log_G N) - 1 levels [N - 1]; bytes sent about 2V (row) + 2V/P (column, and less each level
down) + V (its slice to its row) [2V]: a half more bytes, for peers and handshakes that grow with log N instead
of N.

Used when the group has more than `group_size` members and the round allows it (`GroupedExchange.applies`: a
dense codec, no robust rule — a rule over row means is not the rule over contributions —, no span, every member
dialable); otherwise the flat exchange does the round as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import torch

from farloco.protocol.exchange.api import AverageResult, ExchangeAborted, OnDemand, RobustRule, TensorCodec
from farloco.protocol.exchange.codec import all_finite, decode, raw_bytes, raw_view
from farloco.protocol.exchange.exchange import DATA_PHASE_SHARE
from farloco.protocol.exchange.plan import max_chunk_payload
from farloco.protocol.exchange.wire import MAX_STAGE, invalid, precondition, refusing, wire_size
from farloco.protocol.messages import Fields, check_int
from farloco.protocol.rpc import CallContext, Frame, Reject, RpcClient, RpcError, RpcServer, knock
from farloco.protocol.types import Group, GroupMember

log = logging.getLogger("farloco.protocol.exchange")

SLICE_METHOD = "ExchangeSlice"
# By range [start, end) of a tensor, in order: the round's members (indices in the round's group order) whose
# contribution is not in the mean there.
Ranges = tuple[tuple[int, int, tuple[int, ...]], ...]
# Levels of rows and columns at most: a column longer than G is itself averaged in rows and columns, one level
# down (stages 2d and 2d + 1 at depth d, within AttemptRef's MAX_STAGE).
MAX_DEPTH = (MAX_STAGE - 1) // 2 - 1
# The flat exchange a grouped round falls back to among the whole group (see "A failed round" above).
FALLBACK_STAGE = MAX_STAGE
# Failures that prove no member can hold every slice of the round (see "A failed round"): a row that did not
# finish with all its members (its carriers stay out of the columns), a column that did not, a carrier saying its
# column failed. GATHER_FAILED (slices unreachable) proves nothing: others may have them.
ROW_FAILED = "ROW_FAILED"
COLUMN_FAILED = "COLUMN_FAILED"
SLICE_FAILED = "SLICE_FAILED"
GATHER_FAILED = "GATHER_FAILED"
# A carrier that holds no slice, while others of its column may (its row went on without it, its column without
# it, a nested gather failed): ask the next carrier.
SLICE_UNKNOWN = "SLICE_UNKNOWN"
# The least share of `average(timeout=)` left for the fallback to start.
FALLBACK_MIN_SHARE = 0.15
MIN_GROUP_SIZE = 2
MAX_GROUP_SIZE = 4096
# Shares of `average(timeout=)` for the row and the column; the gather has the rest.
ROW_SHARE = 0.45
COLUMN_SHARE = 0.3
# How long a slice request waits for this member to start the round and hold the slice.
SLICE_WAIT_SECONDS = 60.0
# Rounds whose slices are kept to answer late requests (the current and the one before), and placeholders
# (requests that came before this member started their round) at most.
ROUNDS_KEPT = 2
MAX_PLACEHOLDERS = 8
# How long a column waits for a dropped carrier's address to refuse a connection (`_all_refuse`).
KNOCK_SECONDS = 2.0
# Values per frame of a raw float32 slice.
RAW_FRAME_ELEMS = 1 << 18


@dataclass(frozen=True)
class Layout:
    """Rows and columns of one round's group (see the module docstring)."""

    rows: tuple[tuple[GroupMember, ...], ...]
    slices: int  # P: the smallest row's size

    def row_of(self, peer_id: str) -> tuple[int, int]:
        """(row, position) of `peer_id`; ValueError if it is not a member."""
        for r, row in enumerate(self.rows):
            for i, member in enumerate(row):
                if member.peer_id == peer_id:
                    return r, i
        raise ValueError(f"peer {peer_id} is not in this layout")

    def column(self, i: int) -> tuple[GroupMember, ...]:
        """The members carrying slice i, one per row, in row order."""
        return tuple(row[i] for row in self.rows)

    def bounds(self, numel: int, i: int) -> tuple[int, int]:
        """Slice i of a `numel`-value tensor: P balanced contiguous slices (plan.py's cut of parts)."""
        base, extra = divmod(numel, self.slices)
        start = i * base + min(i, extra)
        return start, start + base + (1 if i < extra else 0)

    def peers_of(self, peer_id: str) -> set[str]:
        """The distinct members `peer_id` exchanges with in a round: its row, its column, and the carriers of
        the other slices in its row (all in its row)."""
        r, i = self.row_of(peer_id)
        others = {m.peer_id for m in self.rows[r]}
        if i < self.slices:
            others |= {m.peer_id for m in self.column(i)}
        return others - {peer_id}


def layout(group: Group, group_size: int) -> Layout:
    """Round `group.round_id`'s rows of at most `group_size` (see the module docstring); every member derives
    the same from the same group."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < MIN_GROUP_SIZE:
        raise ValueError(f"group_size: expected an int >= {MIN_GROUP_SIZE}, got {group_size!r}")
    order = sorted(
        group.members,
        key=lambda m: (
            hashlib.sha256(f"farloco-rows/{group.round_id}/{m.peer_id}".encode()).digest(),
            m.peer_id,
        ),
    )
    count = len(order)
    rows_n = -(-count // group_size)
    base, extra = divmod(count, rows_n)
    rows: list[tuple[GroupMember, ...]] = []
    start = 0
    for r in range(rows_n):
        size = base + (1 if r < extra else 0)
        rows.append(tuple(order[start : start + size]))
        start += size
    return Layout(tuple(rows), base)


@dataclass(frozen=True)
class SliceRequest:
    """An `ExchangeSlice` call: slice `index` of the `use`-th grouped average (from 0) of the round whose group (the
    whole group) is `group` (a group may average more than one tensor in a round)."""

    group: str
    index: int
    use: int = 0

    def encode(self) -> dict[str, Any]:
        return {"g": self.group, "s": self.index, "u": self.use}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> SliceRequest:
        fields = Fields.loose(header, "slice request")
        with refusing("BAD_HEADER"):
            return cls(
                fields.hex("g", exact=64),
                fields.integer("s", low=0, high=MAX_GROUP_SIZE),
                fields.integer("u", low=0, high=1 << 20, default=0),
            )


@dataclass
class _Round:
    """What this member serves of one round: who may ask, and the slice it carries once the column gave it."""

    round_id: int
    started: asyncio.Event = field(default_factory=asyncio.Event)
    members: frozenset[str] = frozenset()
    carried: int = -1  # the slice we carry (-1: none)
    over: bool = False  # forgotten (an old round): requests are refused
    # Why a slice is not served once `chunks` is None: SLICE_FAILED (our row or column failed: nobody has it) or
    # SLICE_UNKNOWN (another carrier may have it: see there)
    failure: str = SLICE_FAILED
    # The round's members (indices in the round's group order) whose contribution is not in the slice's mean, by
    # range of the slice (see "A member lost"); sent with the chunks where it changes.
    lost: Ranges = ()
    # What this member served of the slice before its own average returned (counted in its AverageResult)
    served_bytes: int = 0
    served_values: int = 0
    # The slice's chunks, (start, end, bytes) in the whole tensor's coordinates; None: the column failed here.
    chunks: asyncio.Future[list[tuple[int, int, bytes]] | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class GroupedExchange:
    """An exchange (`Exchange`, or a wrapper of one) that averages groups of more than `group_size` members in
    rows and columns (see the module docstring) and smaller ones as before. Registers `ExchangeSlice` on
    `server`; everything else is the inner exchange's."""

    def __init__(
        self, inner: Any, server: RpcServer, client: RpcClient, peer_id: str, group_size: int
    ) -> None:
        if (
            isinstance(group_size, bool)
            or not isinstance(group_size, int)
            or not MIN_GROUP_SIZE <= group_size <= MAX_GROUP_SIZE
        ):
            raise ValueError(
                f"group_size: expected an int in {MIN_GROUP_SIZE}..{MAX_GROUP_SIZE}, got {group_size!r}"
            )
        self.inner = inner
        self.client = client
        self.peer_id = peer_id
        self.group_size = group_size
        self._rounds: dict[tuple[str, int], _Round] = {}  # (group id, use) -> what we serve of it
        self._uses: dict[str, tuple[int, int]] = {}  # group id -> (round, grouped averages of it started)
        self._newest = -1
        server.add_stream(SLICE_METHOD, self._on_slice)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def applies(
        self, group: Group, codec: TensorCodec, rule: RobustRule | None, span: tuple[int, int] | None
    ) -> bool:
        """Whether this round goes through rows and columns (else the inner, flat exchange does it)."""
        return (
            len(group.members) > self.group_size
            and bool(codec.dense)
            and rule is None
            and span is None
            and all(m.dialable for m in group.members)
        )

    def advance(self, round_id: int) -> None:
        self.inner.advance(round_id)
        self._forget(round_id)

    async def average(
        self,
        group: Group,
        tensor: torch.Tensor | OnDemand,
        codec: TensorCodec,
        *,
        timeout: float,
        weight: float = 1.0,
        out: torch.Tensor | None = None,
        transmitted_out: torch.Tensor | None = None,
        rule: RobustRule | None = None,
        span: tuple[int, int] | None = None,
    ) -> AverageResult:
        """`Exchange.average`, in rows and columns where `applies` says so (and the tensor has a value for every
        slice: a tiny one, a barrier, goes flat)."""
        numel = tensor.numel if isinstance(tensor, OnDemand) else tensor.numel()

        async def flat(timeout: float, **kwargs: Any) -> AverageResult:
            result: AverageResult = await self.inner.average(
                group, tensor, codec, timeout=timeout, weight=weight, out=out, transmitted_out=transmitted_out,
                **kwargs,
            )  # fmt: skip
            return result

        if not self.applies(group, codec, rule, span) or numel < self.group_size:
            return await flat(timeout, rule=rule, span=span)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        ids = tuple(m.peer_id for m in group.members)
        call = self._begin(
            group,
            codec,
            loop.time(),
            deadline,
            0,
            False,
            ids,
            {p: frozenset({k}) for k, p in enumerate(ids)},
            (),
        )
        try:
            result, _ = await self._run(call, tensor, weight, out, transmitted_out)
            return result
        except ExchangeAborted as exc:
            proven = exc.reason in (ROW_FAILED, COLUMN_FAILED, SLICE_FAILED)
            left = deadline - loop.time()
            if not proven or left < FALLBACK_MIN_SHARE * timeout:
                raise
            log.warning("%s; the flat exchange among the group instead (%.1f s left)", exc, left)
            try:
                result = await flat(left, stage=FALLBACK_STAGE)
            except ExchangeAborted as failed:
                failed.bytes_sent += exc.bytes_sent
                failed.bytes_received += exc.bytes_received
                failed.fp32_bytes += exc.fp32_bytes
                raise
            return replace(
                result,
                bytes_sent=result.bytes_sent + exc.bytes_sent,
                bytes_received=result.bytes_received + exc.bytes_received,
                fp32_bytes=result.fp32_bytes + exc.fp32_bytes,
                seconds=timeout - (deadline - loop.time()),
                path="rows, then flat",
            )

    def _begin(
        self,
        group: Group,
        codec: TensorCodec,
        begun: float,
        deadline: float,
        depth: int,
        keep: bool,
        root: tuple[str, ...],
        cover: dict[str, frozenset[int]],
        lost_in: tuple[int, ...],
    ) -> _Call:
        """One grouped average at `depth` (0: the round's group; d + 1: a column of depth d with more than G
        members, itself in rows and columns), set up: from `begun` to `deadline` (loop times alike on every
        member: one level down, from the time every row one level up ended to the time its columns end); `keep`,
        the result carries the mean's coded chunks; `root`, the round's members (whose indices every loss is told
        in); `cover`, the round's members each of `group`'s members brings (its own at depth 0, its row's one
        level down); `lost_in`, those our contribution lacks (what our row lost)."""
        plan = layout(group, self.group_size)
        r, i = plan.row_of(self.peer_id)
        use = self._uses.get(group.group_id, (group.round_id, 0))[1]
        self._uses[group.group_id] = (group.round_id, use + 1)
        state = self._round((group.group_id, use), group.round_id)
        state.members = frozenset(m.peer_id for m in group.members)
        state.carried = i if i < plan.slices else -1
        state.started.set()
        self._forget(group.round_id)
        return _Call(
            group, codec, begun, deadline, depth, keep, plan, r, i, state, use, _Spent(), time.monotonic(), root,
            cover, lost_in,
        )  # fmt: skip

    async def _run(
        self,
        call: _Call,
        tensor: torch.Tensor | OnDemand,
        weight: float,
        out: torch.Tensor | None,
        transmitted_out: torch.Tensor | None,
    ) -> tuple[AverageResult, Ranges]:
        """Run `call`: its result, and by range of the tensor the round's members the mean lacks there."""
        state, spent = call.state, call.spent
        try:
            return await self._stages(call, tensor, weight, out, transmitted_out)
        except ExchangeAborted as exc:
            exc.bytes_sent += spent.sent
            exc.bytes_received += spent.received
            exc.fp32_bytes += spent.fp32
            if exc.reason == GATHER_FAILED:
                state.failure = SLICE_UNKNOWN  # our column may have done well elsewhere: ask another carrier
            raise
        finally:
            if not state.chunks.done():
                state.chunks.set_result(None)

    async def _stages(
        self,
        call: _Call,
        tensor: torch.Tensor | OnDemand,
        weight: float,
        out: torch.Tensor | None,
        transmitted_out: torch.Tensor | None,
    ) -> tuple[AverageResult, Ranges]:
        group, plan, r, i, state, codec, deadline, spent = (
            call.group, call.plan, call.r, call.i, call.state, call.codec, call.deadline, call.spent,
        )  # fmt: skip
        depth, keep, cover = call.depth, call.keep, call.cover
        loop = asyncio.get_running_loop()
        # The stages end at the same times on every member, however late it came (see "A member lost").
        started = call.begun
        timeout = deadline - started
        row = Group.make(group.round_id, list(plan.rows[r]))
        where = f"round {group.round_id} depth {depth} row {r} of {len(plan.rows)}"
        try:
            row_result: AverageResult = await self.inner.average(
                row,
                tensor,
                codec,
                timeout=max(0.001, started + timeout * ROW_SHARE - loop.time()),
                weight=weight,
                out=out,
                transmitted_out=transmitted_out,
                stage=2 * depth,
                data_by=started + timeout * ROW_SHARE * DATA_PHASE_SHARE,
                **({"tag": call.lost_in} if call.lost_in else {}),
            )
        except ExchangeAborted as exc:
            state.failure = SLICE_UNKNOWN  # the rest of our row may have gone on without us
            raise _again(exc, ROW_FAILED, f"{where}: {exc}") from None
        spent.add(row_result)
        if row_result.total_weight is None:
            raise ExchangeAborted(ROW_FAILED, f"{where}: the row's weight is unknown here")
        missing = sorted({m.peer_id for m in row.members} - set(row_result.contributors))
        # Not in the row's mean: the members it went on without (what each brings), and what the contributions in
        # it lacked (their tags; one level down, a contribution is a row's mean one level up).
        row_lost = tuple(sorted(set().union(*(cover[p] for p in missing), *row_result.tags.values())))
        if missing:
            log.info("%s: the row went on without %s", where, missing)
        mean = row_result.averaged.view(-1)
        numel = mean.numel()
        raw = bool(getattr(codec, "raw_float32", False))
        chunks: list[tuple[int, int, bytes]] = []
        if i < plan.slices:
            lo, hi = plan.bounds(numel, i)
            column = Group.make(group.round_id, list(plan.column(i)))
            # What each carrier of the column brings: its row's members, whatever they bring.
            brings = {
                c.peer_id: frozenset().union(
                    *(cover[m.peer_id] for m in plan.rows[plan.row_of(c.peer_id)[0]])
                )
                for c in column.members
            }
            part = mean[lo:hi]
            column_out = torch.empty(hi - lo, dtype=torch.float32)
            contribution = OnDemand(hi - lo, lambda a, b, into: into.copy_(part[a:b]))
            # The column ends by the same time on every row, however long its row took: a row that waited out a
            # silent member (its data phase, then the votes) joins its columns late, and the carriers of the rows
            # that were quick still wait for it.
            budget = max(0.001, started + (ROW_SHARE + COLUMN_SHARE) * timeout - loop.time())
            column_where = f"round {group.round_id} depth {depth} column {i}"
            if len(column.members) > self.group_size and depth < MAX_DEPTH and hi - lo >= self.group_size:
                # A column longer than G: in rows and columns itself, one level down.
                # Its stages start when every row here ended (or gave up) and end when our columns would.
                nested = self._begin(
                    column, codec, started + ROW_SHARE * timeout, loop.time() + budget, depth + 1, not raw,
                    call.root, brings, row_lost,
                )  # fmt: skip
                try:
                    column_result, inner_lost = await self._run(
                        nested, contribution, row_result.total_weight, column_out, None
                    )
                except ExchangeAborted as exc:
                    # Where the column may hold the slice without us (we were left out of a row or a column
                    # down there, or only failed to gather), another carrier may serve it; anything else
                    # proves nobody does.
                    if nested.state.failure == SLICE_UNKNOWN:
                        state.failure = SLICE_UNKNOWN
                    reason = GATHER_FAILED if exc.reason == GATHER_FAILED else COLUMN_FAILED
                    raise _again(exc, reason, f"{column_where}: {exc}") from None
                spent.add(column_result)
                slice_lost = tuple((lo + a, lo + b, lost) for a, b, lost in inner_lost)
            else:
                try:
                    column_result = await self.inner.average(
                        column,
                        contribution,
                        codec,
                        timeout=budget,
                        weight=row_result.total_weight,
                        out=column_out,
                        stage=2 * depth + 1,
                        keep_mean=True,
                        data_by=started + timeout * (ROW_SHARE + COLUMN_SHARE * DATA_PHASE_SHARE),
                        **({"tag": row_lost} if row_lost else {}),
                    )
                except ExchangeAborted as exc:
                    # Our own exclusion proves nothing of the column's other members: it may go on without us.
                    if exc.reason == "EXCLUDED":
                        state.failure = SLICE_UNKNOWN
                    raise _again(exc, COLUMN_FAILED, f"{column_where}: {exc}") from None
                spent.add(column_result)
                absent = sorted({m.peer_id for m in column.members} - set(column_result.contributors))
                heard = [
                    m for m in column.members if m.peer_id in absent and m.peer_id not in column_result.silent
                ]
                if absent and not await _all_refuse(heard, deadline):
                    # A carrier we heard from that still runs may have ended the column otherwise (its votes
                    # late: the flat exchange's split), so its slice's mean could differ from ours: not without
                    # it, then.
                    raise ExchangeAborted(
                        COLUMN_FAILED,
                        f"{column_where}: averaged without {absent}, so the round cannot commit",
                    )
                if absent:
                    log.info("%s: the column went on without %s", column_where, absent)
                # Not in the slice's mean: the rows whose carrier the column went on without, whole, and what
                # the rows in it lost (their carriers' tags).
                lost = set().union(*(brings[c] for c in absent), *column_result.tags.values())
                slice_lost = ((lo, hi, tuple(sorted(lost))),)
            part.copy_(column_out)
            if raw:
                # Frames cut where the members the mean lacks change, so that each frame says its own.
                chunks = [
                    (
                        a,
                        min(a + RAW_FRAME_ELEMS, end),
                        bytes(raw_bytes(mean[a : min(a + RAW_FRAME_ELEMS, end)])),
                    )
                    for start, end, _ in slice_lost
                    for a in range(start, end, RAW_FRAME_ELEMS)
                ]
            else:
                chunks = [(lo + a, lo + b, data) for a, b, data in column_result.mean_chunks]
            del column_out
            state.lost = slice_lost
            state.chunks.set_result(chunks)
        kept: list[tuple[int, int, bytes]] | None = list(chunks) if keep and not raw else None
        lost_by_slice = await self._gather(call, mean, raw, kept, skip=set(missing))
        if i < plan.slices:
            lost_by_slice[i] = state.lost
        ranges = tuple(item for j in range(plan.slices) for item in lost_by_slice[j])
        # In the mean: every member of the round that is in some range's (a member a slice lost is in the
        # others'; everyone is everywhere unless a row or a column went on without some).
        everywhere = set.intersection(*(set(lost) for _, _, lost in ranges))
        somewhere = set().union(*(lost for _, _, lost in ranges))
        ids = call.root
        me = ids.index(self.inner.peer_id)
        withheld = merged((a, b) for a, b, lost in ranges if me in lost) if me not in everywhere else ()
        # What we served of our slice so far (late requests after this are not counted).
        spent.sent += state.served_bytes
        spent.fp32 += 4 * state.served_values
        result = AverageResult(
            averaged=row_result.averaged,
            transmitted=row_result.transmitted,
            contributors=tuple(sorted(p for k, p in enumerate(ids) if k not in everywhere)),
            bytes_sent=spent.sent,
            bytes_received=spent.received,
            seconds=time.monotonic() - call.started,
            fp32_bytes=spent.fp32,
            encoded_in=row_result.encoded_in,
            mean_chunks=() if kept is None else tuple(sorted(kept)),
            total_weight=None,
            path="rows",
            partial=tuple(sorted(ids[k] for k in somewhere - everywhere)),
            withheld=withheld,
        )
        return result, ranges

    async def _gather(
        self,
        call: _Call,
        mean: torch.Tensor,
        raw: bool,
        kept: list[tuple[int, int, bytes]] | None,
        skip: set[str],
    ) -> dict[int, Ranges]:
        """Every slice but ours, from its carrier in our row or, failing that, another member of its column (and
        into `kept`, their coded chunks), never from a member in `skip` (our row went on without it); returns, by
        slice, the round's members not in its mean, by range (`_Round.lost`)."""
        plan, r, i = call.plan, call.r, call.i
        lost: dict[int, Ranges] = {}

        async def one(j: int) -> None:
            lo, hi = plan.bounds(mean.numel(), j)
            carriers = [plan.rows[(r + k) % len(plan.rows)][j] for k in range(len(plan.rows))]
            errors: list[str] = []
            failed = False
            for carrier in carriers:
                if carrier.peer_id == self.peer_id or carrier.peer_id in skip:
                    continue
                try:
                    lost[j] = await self._pull(call, carrier, j, lo, hi, mean, raw, kept)
                    return
                except (RpcError, Reject) as exc:
                    reason = exc.reason
                    errors.append(f"{carrier.peer_id}: {reason}")
                    if reason == SLICE_FAILED:
                        failed = True
                        break  # the column failed: every carrier of the slice will say the same
            raise ExchangeAborted(
                SLICE_FAILED if failed else GATHER_FAILED,
                f"round {call.group.round_id}: slice {j} from nobody ({'; '.join(errors)})",
            )

        tasks = [asyncio.create_task(one(j)) for j in range(plan.slices) if j != i]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return lost

    async def _pull(
        self,
        call: _Call,
        carrier: GroupMember,
        j: int,
        lo: int,
        hi: int,
        mean: torch.Tensor,
        raw: bool,
        kept: list[tuple[int, int, bytes]] | None,
    ) -> Ranges:
        """Slice j from `carrier` into `mean[lo:hi]`; returns the round's members its mean lacks, by range (a chunk
        says where that changes: from the slice's start, nobody)."""
        group, codec, spent = call.group, call.codec, call.spent
        loop = asyncio.get_running_loop()
        fast = getattr(codec, "optional_checksum", False) is True

        ask = Frame(SliceRequest(group.group_id, j, call.use).encode())

        async def request() -> AsyncIterator[Frame]:
            yield ask

        spent.sent += wire_size(ask)
        at = lo
        lost: tuple[int, ...] = ()
        ranges: list[tuple[int, int, tuple[int, ...]]] = []
        size = len(call.root)
        taken: list[tuple[int, int, bytes]] = []
        answers = self.client.stream(
            carrier.address,
            SLICE_METHOD,
            request(),
            round_id=group.round_id,
            timeout=max(0.001, call.deadline - loop.time()),
            bulk=True,
        )
        async for frame in answers:
            fields = Fields.loose(frame.header, "slice chunk")
            with refusing("BAD_HEADER"):
                a, b = fields.integer("a"), fields.integer("b")
                if fields.has("x"):
                    lost = tuple(
                        sorted(
                            set(fields.items("x", lambda v, w: check_int(v, w, high=size - 1), max_len=size))
                        )
                    )
            what = f"slice {j} chunk [{a}, {b}) from {carrier.peer_id}"
            if a != at or not a < b <= hi:
                raise invalid("CHUNK_ORDER", f"{what}: expected a chunk from {at} up to {hi}")
            if len(frame.payload) > max_chunk_payload(b - a):
                raise invalid("SIZE_MISMATCH", f"{what}: {len(frame.payload)} bytes for {b - a} values")
            spent.received += wire_size(frame)
            if ranges and ranges[-1][2] == lost and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], b, lost)
            else:
                ranges.append((a, b, lost))
            target = mean[a:b]
            if raw:
                target.copy_(raw_view(frame.payload, b - a, what))
                if not all_finite(target):
                    raise invalid("BAD_PAYLOAD", f"{what}: expected only finite float32 values")
            else:
                payload = frame.payload
                await asyncio.to_thread(decode, codec, payload, b - a, what, fast, target)
                if kept is not None:
                    taken.append((a, b, bytes(payload)))
            at = b
        if at != hi:
            raise invalid("TRUNCATED", f"slice {j} from {carrier.peer_id}: ended at {at}, expected {hi}")
        if kept is not None:
            kept.extend(taken)
        return tuple(ranges)

    async def _on_slice(self, ctx: CallContext, requests: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
        first = await anext(requests, None)
        if first is None:
            raise invalid("BAD_HEADER", "slice request: expected a request frame, got none")
        request = SliceRequest.decode(first.header)
        key = (request.group, request.use)
        state = self._rounds.get(key)
        if state is None:
            if ctx.round_id < self._newest - 1 or len(self._rounds) >= ROUNDS_KEPT + MAX_PLACEHOLDERS:
                raise Reject(
                    grpc.StatusCode.ABORTED,
                    "ATTEMPT_OVER",
                    f"round {ctx.round_id}: this node is at round {self._newest} without group {request.group[:12]}",
                )
            state = self._round(key, ctx.round_id)
        try:
            await asyncio.wait_for(state.started.wait(), SLICE_WAIT_SECONDS)
        except TimeoutError:
            raise precondition(
                "UNKNOWN_GROUP", f"group {request.group[:12]} was never started here"
            ) from None
        if state.over:
            raise Reject(
                grpc.StatusCode.ABORTED,
                "ATTEMPT_OVER",
                f"round {state.round_id}: this node moved on to round {self._newest}",
            )
        if ctx.round_id != state.round_id:
            raise precondition("STALE_ROUND", f"expected round {state.round_id}, got {ctx.round_id}")
        if ctx.sender not in state.members:
            raise Reject(
                grpc.StatusCode.PERMISSION_DENIED,
                "NOT_A_MEMBER",
                f"{ctx.sender} is not a member of group {request.group[:12]}",
            )
        if request.index != state.carried:
            raise precondition(
                "NOT_CARRIED", f"round {state.round_id}: we carry slice {state.carried}, not {request.index}"
            )
        try:
            chunks = await asyncio.wait_for(asyncio.shield(state.chunks), SLICE_WAIT_SECONDS)
        except TimeoutError:
            raise precondition(
                "SLICE_NOT_READY", f"round {state.round_id}: slice {request.index} not ready"
            ) from None
        if chunks is None:
            raise Reject(
                grpc.StatusCode.ABORTED,
                state.failure,
                f"round {state.round_id}: slice {request.index} failed here",
            )
        said: tuple[int, ...] = ()  # the members the mean lacks, as our frames said so far
        for a, b, data in chunks:
            lost = lost_at(state.lost, a, b)
            frame = Frame({"a": a, "b": b, "x": list(lost)} if lost != said else {"a": a, "b": b}, data)
            said = lost
            state.served_bytes += wire_size(frame)
            state.served_values += b - a
            yield frame

    def _round(self, key: tuple[str, int], round_id: int) -> _Round:
        state = self._rounds.get(key)
        if state is None:
            state = self._rounds[key] = _Round(round_id)
        return state

    def _forget(self, round_id: int) -> None:
        """Rounds older than the one before `round_id` are over: their slices and placeholders go."""
        self._newest = max(self._newest, round_id)
        for key, state in list(self._rounds.items()):
            if state.round_id < self._newest - (ROUNDS_KEPT - 1):
                state.over = True
                state.started.set()  # a waiting request is refused
                if not state.chunks.done():
                    state.chunks.set_result(None)
                del self._rounds[key]
        for group_id, (round_id, _) in list(self._uses.items()):
            if round_id < self._newest - (ROUNDS_KEPT - 1):
                del self._uses[group_id]


def lost_at(ranges: Ranges, a: int, b: int) -> tuple[int, ...]:
    """The members a slice's mean lacks over chunk [a, b): the range holding it (a chunk never straddles two)."""
    for start, end, lost in ranges:
        if start <= a < end:
            if b > end:
                raise RuntimeError(f"chunk [{a}, {b}) straddles the end {end} of a range of the slice")
            return lost
    raise RuntimeError(f"chunk [{a}, {b}) is outside the slice's ranges")


def merged(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Ordered ranges, the adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


async def _all_refuse(members: Sequence[GroupMember], deadline: float) -> bool:
    """Whether every one of `members` refuses a connection at its address: no process listens there, so it
    serves nothing (a frozen process, or a partition, times out instead: not a refusal)."""

    timeout = min(KNOCK_SECONDS, deadline - asyncio.get_running_loop().time())
    verdicts = await asyncio.gather(*(knock(m.address, timeout) for m in members))
    return all(verdict == "refused" for verdict in verdicts)


def _again(exc: ExchangeAborted, reason: str, detail: str) -> ExchangeAborted:
    """`exc` as a stage of a grouped round sees it: another reason and detail, the same bytes."""
    again = ExchangeAborted(reason, detail)
    again.bytes_sent, again.bytes_received, again.fp32_bytes = (
        exc.bytes_sent,
        exc.bytes_received,
        exc.fp32_bytes,
    )
    return again


@dataclass(frozen=True)
class _Call:
    """One grouped average on this member: what it averages with, where it sits, and what it spent."""

    group: Group
    codec: TensorCodec
    begun: float  # loop time the stages are timed from, alike on every member
    deadline: float
    depth: int  # 0: the round's group; d + 1: a column of depth d in rows and columns itself
    keep: bool  # the result carries the mean's coded chunks
    plan: Layout
    r: int  # our row
    i: int  # our position in it: the slice we carry, if < plan.slices
    state: _Round
    use: int
    spent: _Spent
    started: float
    root: tuple[str, ...]  # the round's members, in the round's group order: losses are told as their indices
    cover: dict[str, frozenset[int]]  # by member of `group`: the round's members its contribution brings
    lost_in: tuple[int, ...]  # the round's members our contribution lacks


@dataclass
class _Spent:
    """Bytes the stages of one grouped round moved (as AverageResult counts them)."""

    sent: int = 0
    received: int = 0
    fp32: int = 0

    def add(self, result: AverageResult) -> None:
        self.sent += result.bytes_sent
        self.received += result.bytes_received
        self.fp32 += result.fp32_bytes
