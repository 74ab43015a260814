"""`Exchange`: the public face of the exchange (`average`, `advance`, `close`, the server's two methods), and the
attempts loop of one `average` with its deadlines.

Deadlines. `average(timeout=)` is one budget for every attempt of the round. Each attempt's data phase may use
DATA_PHASE_SHARE of the time left when it starts, its vote VOTE_PHASE_SHARE more; the rest is for a re-attempt
among the survivors. A data phase that does not complete in time fails the attempt (DEADLINE), which then votes;
once the budget is spent, a failed attempt raises `ExchangeAborted` (DEADLINE) instead of retrying.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections.abc import Callable

import torch

from farloco.protocol.exchange.api import AverageResult, ExchangeAborted, OnDemand, RobustRule, TensorCodec
from farloco.protocol.exchange.attempt import Attempt, Attempts
from farloco.protocol.exchange.codec import payload_terms
from farloco.protocol.exchange.codecpool import MAX_CODEC_THREADS, CodecPool
from farloco.protocol.exchange.gone import GoneWatch
from farloco.protocol.exchange.owner import Owner
from farloco.protocol.exchange.plan import MAX_LANES, MAX_SLICES, Plan, attempt_key, lanes_for, slice_bounds
from farloco.protocol.exchange.push import Pusher
from farloco.protocol.exchange.reduce import reduce_alone
from farloco.protocol.exchange.vote import Voter
from farloco.protocol.exchange.vote import excluded as vote_excluded
from farloco.protocol.exchange.wire import MAX_STAGE, MAX_TAG_ITEMS, MAX_TAG_VALUE, PUSH_METHOD, VOTE_METHOD
from farloco.protocol.rpc import RpcClient, RpcServer
from farloco.protocol.types import Group, GroupMember
from farloco.util.tasks import cancel_and_wait

log = logging.getLogger("farloco.protocol.exchange")

# Share of the time left that one attempt's data phase may use; the rest is for votes and a re-attempt.
DATA_PHASE_SHARE = 0.6
VOTE_PHASE_SHARE = 0.15


class Exchange:
    """Averages tensors across a group of peers; registers `ExchangePush` and `ExchangeVote` on `server`.

    One `average()` per group at a time. `chunk_bytes` is the fp32 size of one chunk (all members must use the
    same value); `max_payload_bytes` caps the fp32 size of a tensor and the size of any incoming payload.
    `slices` (all members alike, 0 or at least 2): chunks are also cut at the boundaries of that many equal
    slices, so `average(span=)` can take a range of them (see Spans in plan.py).
    `codec_threads`: threads for the codec's work (see codecpool.py; the agent's `network.codec_threads`); 0 does
    it on the event loop. The threads start on first use; `close()` ends them.
    """

    def __init__(
        self,
        server: RpcServer,
        client: RpcClient,
        peer_id: str,
        *,
        chunk_bytes: int = 1 << 20,
        max_payload_bytes: int = 4 << 30,
        streams_per_peer: int = 1,
        slices: int = 0,
        gone: Callable[[str], bool] | None = None,
        codec_threads: int = 0,
    ) -> None:
        if slices == 1 or not 0 <= slices <= MAX_SLICES:
            raise ValueError(f"slices must be 0 or in 2..{MAX_SLICES}, got {slices}")
        if isinstance(codec_threads, bool) or not isinstance(codec_threads, int):
            raise ValueError(f"codec_threads must be an int, got {codec_threads!r}")
        if not 0 <= codec_threads <= MAX_CODEC_THREADS:
            raise ValueError(f"codec_threads must be in 0..{MAX_CODEC_THREADS}, got {codec_threads}")
        if chunk_bytes < 1024 or chunk_bytes * 2 + 8192 > min(
            server.max_message_bytes, client.max_message_bytes
        ):
            raise ValueError(
                f"chunk_bytes must be >= 1024 and leave room in max_message_bytes "
                f"(server {server.max_message_bytes}, client {client.max_message_bytes}); got {chunk_bytes}"
            )
        if not 1 <= streams_per_peer <= MAX_LANES:
            raise ValueError(f"streams_per_peer must be in 1..{MAX_LANES}, got {streams_per_peer}")
        self.peer_id = peer_id
        self.lanes = streams_per_peer
        self.slices = slices
        self.chunk_elems = chunk_bytes // 4
        self.max_payload_bytes = max_payload_bytes
        self.attempts = Attempts(peer_id)
        self._pool = CodecPool(codec_threads)
        # Whether a peer is known gone (its membership record expired; see gone.py). None: never.
        self._watch = GoneWatch(client, gone)
        self._pusher = Pusher(client, self._pool, streams_per_peer, self.chunk_elems)
        self._owner = Owner(self.attempts, self._pool, max_payload_bytes)
        self._voter = Voter(client, self.attempts, self._watch)
        server.add_stream(PUSH_METHOD, self._owner.on_push)
        server.add_unary(VOTE_METHOD, self._voter.on_vote)

    def close(self) -> None:
        """End the codec threads (after the exchanges: a job still running is seen through)."""
        self._pool.close()

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
        stage: int = 0,
        keep_mean: bool = False,
        tag: tuple[int, ...] = (),
        data_by: float | None = None,
    ) -> AverageResult:
        """Weighted mean of `tensor` over the group (see the package docstring). Raises ExchangeAborted if no
        consistent mean can be produced before `timeout` seconds, ValueError on bad arguments.

        `out`, a contiguous float32 CPU tensor of the same size, receives the mean (and is `averaged`): a caller
        that exchanges every round reuses it instead of paying fresh pages for a new result each time (zeroing
        and faulting in 64 MiB costs about as much as summing it). Its content is undefined if this raises.
        `transmitted_out`, likewise, receives `transmitted` for lossy codecs (lossless ones share the input).
        `rule`: a robust aggregation rule instead of the weighted mean (see RobustRule); the group must agree.
        `span` = (g0, g1): contribute to slices g0 .. g1 - 1 only (see Spans in plan.py; dense codecs, an Exchange
        made with `slices`); the mean (and `transmitted`) is then defined on that range only, and `contributors`
        names every member of the final attempt, whatever its span.
        `tensor` may be an `OnDemand`: the contribution is then made chunk by chunk as each is sent or reduced
        (a sparse codec: encoded piece by piece, `payload_terms`), and with a lossy codec nothing is kept of
        `transmitted` (None in the result; pass no `transmitted_out`): `encoded_in` (dense) or `payload`
        (sparse) says how to rebuild it.
        `tag`: small ints our hello carries to every member (wire.py Hello.tag); the result's `tags` has every
        member's that was not empty.
        `data_by`: a loop time, alike on every member, before which the first attempt's data phase does not end
        (instead of DATA_PHASE_SHARE of the time left from our own start): for an exchange members enter at
        different times (a stage of grouped.py), so that the early ones wait for the late ones; ignored where
        it is not before the deadline."""
        if isinstance(tensor, OnDemand):
            if not codec.dense and not payload_terms(codec):
                raise ValueError(
                    f"an OnDemand contribution needs a dense codec or a sparse one that encodes on demand and "
                    f"parses, got {codec.name!r}"
                )
            if transmitted_out is not None:
                raise ValueError(
                    "transmitted_out: expected None with an OnDemand contribution (encoded_in or payload says it)"
                )
            numel = tensor.numel
        else:
            if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
                raise ValueError(f"expected a float32 CPU tensor, got {tensor.dtype} on {tensor.device}")
            numel = tensor.numel()
        if numel * 4 > self.max_payload_bytes:
            raise ValueError(
                f"tensor of {numel * 4} bytes exceeds max_payload_bytes={self.max_payload_bytes}"
            )
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be finite and > 0, got {weight}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= MAX_STAGE:
            raise ValueError(f"stage: expected an int in 0..{MAX_STAGE}, got {stage!r}")
        if keep_mean and not codec.dense:
            raise ValueError(f"keep_mean: expected a dense codec, got {codec.name!r}")
        tag = tuple(tag)
        if len(tag) > MAX_TAG_ITEMS or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TAG_VALUE for v in tag
        ):
            raise ValueError(
                f"tag: expected at most {MAX_TAG_ITEMS} ints in 0..{MAX_TAG_VALUE}, got {len(tag)} items "
                f"({tag[:4]!r}...)"
            )
        if span is not None:
            if not self.slices:
                raise ValueError("span: this Exchange was made without slices")
            if not codec.dense:
                raise ValueError(
                    f"span: expected a dense codec, got {codec.name!r} (sparse payloads are whole)"
                )
            g0, g1 = span
            if not 0 <= g0 < g1 <= self.slices:
                raise ValueError(f"span: expected 0 <= g0 < g1 <= {self.slices}, got {span}")
        bounds = (0, numel) if span is None else slice_bounds(numel, self.slices, span)
        for name, buffer in (("out", out), ("transmitted_out", transmitted_out)):
            if buffer is None:
                continue
            if (
                buffer.dtype != torch.float32
                or buffer.device.type != "cpu"
                or not buffer.is_contiguous()
                or buffer.numel() != numel
            ):
                raise ValueError(
                    f"{name}: expected a contiguous float32 CPU tensor of {numel} values, got "
                    f"{buffer.dtype} on {buffer.device} with {buffer.numel()} values "
                    f"(contiguous={buffer.is_contiguous()})"
                )
            others = [] if isinstance(tensor, OnDemand) else [tensor]
            if name == "transmitted_out" and out is not None:
                others.append(out)
            if any(_overlaps(buffer, other) for other in others):
                raise ValueError(f"{name}: expected memory apart from the input and from out, got an overlap")
        group.index_of(self.peer_id)  # ValueError naming the members if we are not one
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        deadline = started_at + timeout
        # Contiguous, so chunks can be sent as views of the tensor's own memory.
        flat: torch.Tensor | OnDemand
        if isinstance(tensor, OnDemand):
            flat, shape = tensor, torch.Size([numel])
        else:
            flat, shape = tensor.detach().reshape(-1).contiguous(), tensor.shape
        members = group.members
        heard: set[str] = set()  # members whose hello reached us in some attempt (AverageResult.silent)
        bytes_sent = bytes_received = 0
        fp32_sent = 0.0
        attempt_no = 0
        while True:
            stranded = [m.peer_id for m in members if not m.dialable]
            if len(members) > 1 and stranded and (not codec.dense or len(stranded) == len(members)):
                # Behind NAT (types.NO_INBOUND): a sparse payload goes to every member, and an owner is dialled.
                why = (
                    "a sparse codec sends to every member" if not codec.dense else "no member can be dialled"
                )
                raise ExchangeAborted(
                    "NO_INBOUND",
                    f"round {group.round_id}: {stranded} accept no inbound connection, and {why}",
                )
            attempt = self.attempts.open(attempt_key(group, attempt_no, [m.peer_id for m in members]))
            self._start(
                attempt,
                group.round_id,
                attempt_no,
                members,
                flat,
                codec,
                weight,
                out,
                transmitted_out,
                rule,
                bounds,
                stage,
                keep_mean,
                tag,
            )
            remaining = deadline - loop.time()
            data_deadline = loop.time() + remaining * DATA_PHASE_SHARE
            if attempt_no == 0 and data_by is not None and data_by < deadline:
                data_deadline = max(data_deadline, data_by)
            # The votes take the same share of what the data phase left as they do of a whole attempt.
            vote_deadline = data_deadline + (deadline - data_deadline) * VOTE_PHASE_SHARE / (
                1 - DATA_PHASE_SHARE
            )
            try:
                await self._data_phase(attempt, data_deadline)
                votes = await self._voter.vote_phase(attempt, vote_deadline)
            finally:
                self.attempts.retire(attempt)
            heard.update(members[j].peer_id for j in attempt.weights)
            bytes_sent += attempt.bytes_sent
            bytes_received += attempt.bytes_received
            fp32_sent += attempt.fp32_sent
            if attempt.local_error is not None:
                raise attempt.local_error
            alive = [m for m in members if m.peer_id in votes]
            if all(votes[m.peer_id].ok for m in alive):
                return AverageResult(
                    averaged=attempt.result.reshape(shape),
                    transmitted=None if attempt.transmitted is None else attempt.transmitted.reshape(shape),
                    contributors=tuple(sorted(attempt.member_ids)),
                    bytes_sent=bytes_sent,
                    bytes_received=bytes_received,
                    seconds=loop.time() - started_at,
                    fp32_bytes=round(fp32_sent),
                    encoded_in=attempt.encoded_in(),
                    payload=attempt.payload if attempt.source is not None and not attempt.dense else b"",
                    mean_chunks=()
                    if attempt.mean_chunks is None
                    else tuple((a, b, data) for a, (b, data) in sorted(attempt.mean_chunks.items())),
                    total_weight=attempt.total_weight(),
                    tags={members[j].peer_id: t for j, t in sorted(attempt.tags.items())},
                    silent=tuple(sorted(m.peer_id for m in group.members if m.peer_id not in heard)),
                )
            excluded = vote_excluded(alive, votes)
            survivors = tuple(m for m in alive if m.peer_id not in excluded)
            detail = (
                f"round {group.round_id} attempt {attempt_no} of {len(members)} members failed "
                f"({attempt.failure or 'a peer failed'}); answered: {[m.peer_id for m in alive]}, "
                f"excluded: {sorted(excluded)}"
            )
            aborted: ExchangeAborted | None = None
            if self.peer_id in excluded:
                aborted = ExchangeAborted("EXCLUDED", detail)
            elif len(survivors) == len(members):
                # Nobody to drop: the same members again would meet whatever failed them again, and a member
                # that a thaw left behind in an attempt the others already closed would wait out its data phase
                # in a retry they never start. (A failure nobody is to blame for, a reset link, is worth a retry
                # once the votes can say so alike everywhere: not built yet.)
                aborted = ExchangeAborted(
                    "NO_PROGRESS", detail + "; nobody to drop, so a retry would fail alike"
                )
            elif loop.time() >= deadline:
                aborted = ExchangeAborted("DEADLINE", detail + f"; no time left of {timeout}s")
            if aborted is not None:
                aborted.bytes_sent, aborted.bytes_received = bytes_sent, bytes_received
                aborted.fp32_bytes = round(fp32_sent)
                raise aborted
            log.warning("%s; retrying among %s", detail, [m.peer_id for m in survivors])
            members = survivors
            attempt_no += 1

    def _start(
        self,
        attempt: Attempt,
        round_id: int,
        attempt_no: int,
        members: tuple[GroupMember, ...],
        flat: torch.Tensor | OnDemand,
        codec: TensorCodec,
        weight: float,
        out: torch.Tensor | None = None,
        transmitted_out: torch.Tensor | None = None,
        rule: RobustRule | None = None,
        bounds: tuple[int, int] | None = None,
        stage: int = 0,
        keep_mean: bool = False,
        tag: tuple[int, ...] = (),
    ) -> None:
        attempt.round_id = round_id
        attempt.stage = stage
        attempt.rule = rule
        attempt.attempt_no = attempt_no
        attempt.members = members
        attempt.me = [m.peer_id for m in members].index(self.peer_id)
        attempt.dense = bool(codec.dense)
        attempt.codec = codec
        attempt.raw = (
            attempt.dense and getattr(codec, "raw_float32", False) is True and sys.byteorder == "little"
        )
        attempt.lossless = attempt.raw or getattr(codec, "lossless", False) is True
        attempt.fast = getattr(codec, "optional_checksum", False) is True
        attempt.weight = weight
        attempt.mean_chunks = {} if keep_mean and attempt.dense and not attempt.raw else None
        numel = flat.numel if isinstance(flat, OnDemand) else flat.numel()
        attempt.lo, attempt.hi = (0, numel) if bounds is None else bounds
        if isinstance(flat, OnDemand):
            attempt.source, attempt.flat = flat, torch.empty(0)
        else:
            attempt.source, attempt.flat = None, flat
        dialable = tuple(m.dialable for m in members)
        attempt.plan = Plan(
            numel,
            len(members),
            self.chunk_elems,
            self.slices if attempt.dense else 0,
            owners=None if all(dialable) or len(members) == 1 else dialable,
        )
        attempt.result = torch.empty(numel, dtype=torch.float32) if out is None else out.view(-1)
        # Lossless: what goes on the wire is our tensor itself. Not a copy (a 64 MiB clone per round cost ~10%
        # of an exchange): `transmitted` then shares the caller's input memory, which AverageResult says.
        # OnDemand: nothing is kept (lossless: it would be the contribution; lossy: `encoded_in` rebuilds it).
        if attempt.source is not None:
            attempt.transmitted = None
        elif attempt.lossless:
            attempt.transmitted = attempt.flat
        elif transmitted_out is not None:
            attempt.transmitted = transmitted_out.view(-1)
        else:
            attempt.transmitted = torch.empty(numel, dtype=torch.float32)
        attempt.weights = {attempt.me: weight}
        attempt.tag = tag
        attempt.tags = {attempt.me: tag} if tag else {}
        attempt.status = asyncio.get_running_loop().create_future()
        # Dense: every lane of every other member's part, plus our own part once it is reduced. Sparse: every
        # other payload.
        if attempt.dense:
            attempt.parts_missing = 1 + sum(
                lanes_for(self.lanes, len(attempt.plan.chunks(j)))
                for j in range(len(members))
                if j != attempt.me and members[j].dialable
            )
        else:
            # Ours counts too: it may be encoded off the loop, and the others' payloads may come first.
            attempt.parts_missing = len(members)
        attempt.outboxes = {}
        attempt.started.set()
        self.attempts.started(attempt)

    def advance(self, round_id: int) -> None:
        """This node works on round `round_id` now (it committed the round before, closed it without an update,
        took the swarm's state, or starts an attempt of it): streams and votes of an earlier round's group are
        refused at once (ATTEMPT_OVER), those already waiting included. A member thawed after the others grouped
        it closes that round and moves on (alone, if everyone else is behind it); its old group would otherwise
        wait for it until its data deadline and then for its vote (a 53 s round in the chaos runner's churn)."""
        self.attempts.advance(round_id)

    async def _data_phase(self, attempt: Attempt, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        attempt.data_deadline = deadline
        # Silence is counted from here (or from a stream that came first).
        for j in range(len(attempt.members)):
            attempt.heard.setdefault(j, loop.time())
        try:
            if not attempt.dense:
                await self._owner.own_sparse(attempt)
            elif len(attempt.members) == 1:
                await self._pool.run(attempt.jobs, reduce_alone, attempt)
                attempt.part_done()
            elif not attempt.plan.chunks(attempt.me):
                attempt.part_done()
        except Exception as exc:
            attempt.fail_locally(exc)
            return
        pushes = {
            (j, lane): asyncio.create_task(self._pusher.push(attempt, j, lane, deadline))
            for j in range(len(attempt.members))
            if j != attempt.me and attempt.members[j].dialable  # behind NAT: it pushes to us, never we to it
            for lane in range(lanes_for(self.lanes, len(attempt.plan.chunks(j))) if attempt.dense else 1)
        }
        try:
            try:
                await self._watch.wait_for_data(attempt, deadline)
            except TimeoutError:
                attempt.fail("DEADLINE: data phase did not complete in time", evidence=False)
            if not attempt.ok:
                # The vote goes out after what the others are still sending was checked (EVIDENCE_GRACE_SECONDS).
                # Our own pushes go on meanwhile, so every owner sees our data and can vouch for it or name us.
                await attempt.gather_evidence(pushes=pushes)
                for task in pushes.values():
                    task.cancel()
            # A push finishing late cannot change the outcome; its errors were already recorded in `attempt`.
            await asyncio.gather(*pushes.values(), return_exceptions=True)
        finally:
            # Cancelled ourselves (leave --now, a shutdown): no push may outlive the exchange.
            for task in pushes.values():
                if not task.done():
                    await cancel_and_wait(task)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + 4 * b.numel() and b_start < a_start + 4 * a.numel()
