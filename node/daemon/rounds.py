"""The outer rounds: the synchronous loop and the overlapped one (run.outer_update delayed/eager), and one
round (`_round`): hand-off, matchmaking, hash check, exchange, commit. What the round does after each phase
is decided by node/daemon/rules.py (a pure function of the round's facts); this module does the I/O.

Rules:
- One round, one screen (`_round`): each phase (match, heal, exchange) records its facts, and `decide` says go
  on, commit, or how the round closes (abort, catch up, advance without an update).
- A round commits only with an agreed group, one theta among its members (healed if need be) and a complete
  exchange; otherwise theta_outer stays as it is and the round id still moves on.
- The ranks wait for the agent only in sync mode; with run.outer_update delayed/eager the round is exchanged
  while they train on, one round behind.
- `leave --now` abandons the round in flight; a graceful leave lets it end within its grace.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from farloco.node.daemon.checkpoints import Checkpoints
from farloco.node.daemon.core import (
    Network,
    NodeState,
    Prepared,
    Status,
    ddp_bytes_per_round,
    dht_now,
    log,
    overlap_steps,
)
from farloco.node.daemon.latework import LateWork
from farloco.node.daemon.outer import Transmitted
from farloco.node.daemon.outerstate import OuterState
from farloco.node.daemon.ranks import Ranks
from farloco.node.daemon.rules import Action, Decision, RoundFacts, decide
from farloco.node.daemon.swarm import Swarm
from farloco.protocol import shares
from farloco.protocol.exchange import OnDemand
from farloco.protocol.shares import left_out_reason
from farloco.util.tasks import cancel_and_wait, wait_for


@dataclass(frozen=True)
class Averaged:
    """What the exchange of a round gave: what the swarm saw of our contribution, the mean, who is in it, bytes."""

    transmitted: Transmitted
    mean: torch.Tensor
    contributors: tuple[str, ...]
    sent: int
    received: int
    fp32_bytes: int
    path: str = "flat"  # AverageResult.path: flat, rows, or rows then flat ("alone": a group of one)
    partial: tuple[str, ...] = ()  # AverageResult.partial: in some slices' mean only (a row lost a carrier)
    withheld: tuple[tuple[int, int], ...] = ()  # AverageResult.withheld: our ranges in no mean


class RoundRunner:
    """The round loops and one round (see the module docstring). `phase_hook(phase, round_id)` is awaited as
    each phase of a round begins (node/faults/plan.py PHASES: the fault injector's), when given."""

    def __init__(
        self,
        state: NodeState,
        outer: OuterState,
        ranks: Ranks,
        checkpoints: Checkpoints,
        swarm: Swarm,
        net: Network,
        phase_hook: Callable[[str, int], Awaitable[None]] | None = None,
    ) -> None:
        self.state = state
        self.outer = outer
        self.ranks = ranks
        self.checkpoints = checkpoints
        self.swarm = swarm
        self.net = net
        self.config = state.config
        self.matchmaker = net.matchmaker
        self.island = net.island
        self._phase_hook = phase_hook
        self._overlap_steps = overlap_steps(state.config)
        self._overlap_seq: int | None = None  # the hand-off sequence the ranks train during an exchange
        self._phases: dict[str, float] = {}  # the current round's phase times (`_round`)
        self._island_round: Any = (
            None  # the IslandRound of the round in progress, None when we exchange alone
        )
        # The work of a round we were late for, merged into the next one (run.late_work; the synchronous loop).
        run = state.config.run
        self.late_work: LateWork | None = (
            LateWork(outer.num_params)
            if run.late_work == "merge"
            and run.outer_update == "sync"
            and not outer.strategy.keeps_local_progress
            else None
        )

    async def run(self) -> None:
        """The rounds, until the run ends or the node leaves."""
        if self.config.run.outer_update == "sync":
            await self._round_loop()
        else:
            await self._overlapped_loop()

    async def _wait_contribution(self, seq: int) -> bool:
        """`Ranks.wait` for sequence `seq`, which carries this round's contribution: cut short once every other
        member of the round waits for us (node.partial_contributions)."""
        round_id = self.outer.round_id
        return await self.ranks.wait(
            seq,
            round_id=round_id,
            others_wait=lambda: self.matchmaker.waiting_for(round_id, self.state.peer_id),
        )

    async def _enter_phase(self, phase: str, round_id: int | None = None) -> None:
        """A phase of round `round_id` (default: the current one) begins."""
        if self._phase_hook is not None:
            await self._phase_hook(phase, self.outer.round_id if round_id is None else round_id)

    async def _round_loop(self) -> None:
        run = self.config.run
        # What the ranks load at their next sequence: theta_outer, the merged local weights after a committed
        # round (streaming-diloco keeps the other fragments' local progress), or None: keep their weights.
        load: torch.Tensor | None = self.outer.theta
        # Inner steps of this round the ranks already ran while the last exchange was in flight.
        steps_done = 0
        while True:
            if run.max_rounds and self.outer.round_id >= run.max_rounds:
                self.state.events.write("finished", round_id=self.outer.round_id)
                return
            if self.state.leave_mode is not None:
                return
            # The members wait for us in this round from now on (our record says so a heartbeat later).
            self.matchmaker.announce(self.outer.round_id, self.state.peer_id, self.outer.outer_hash)
            seq = self.ranks.publish(
                load,
                round_id=self.outer.round_id,
                step_base=self.outer.round_id * run.inner_steps + steps_done,
                inner_steps=run.inner_steps - steps_done,
            )
            self.state.status = Status.TRAINING
            await self._enter_phase("train")
            if not await self._wait_contribution(seq):
                self.state.events.write("withdrew", round_id=self.outer.round_id)
                return
            self._overlap_seq = None
            reload = await self._unless_leaving_now(self._round(seq))
            if reload is None:
                self.state.events.write("withdrew", round_id=self.outer.round_id, mode="now")
                return
            steps_done = 0
            if self._overlap_seq is not None:
                # The merge must land on the weights the ranks reached after their tau overlapped steps.
                if not await self.ranks.wait(self._overlap_seq):
                    self.state.events.write("withdrew", round_id=self.outer.round_id)
                    return
                steps_done = self._overlap_steps
            if reload and self.outer.merge_pending:
                load = self.outer.round.merged(self.ranks.handoff.local, self.ranks.handoff.theta)
            elif reload:  # state sync: start the round afresh from the swarm's theta_outer
                load, steps_done = self.outer.theta, 0
            else:
                load = None
            self.outer.merge_pending = False
            if self.state.leave_mode == "drain":
                return

    async def _overlapped_loop(self) -> None:
        """run.outer_update = delayed | eager (Kale et al. 2025): the ranks never wait for the exchange.

        When the ranks end sequence s, the round in flight (s-1) is awaited, usually long done, committing its
        mean on theta_outer; the contribution of sequence s is measured from where the ranks started it (the
        hand-off's theta); the ranks start sequence s+1 at once from theta_outer (delayed), or from theta_outer
        with this node's fresh contribution previewed in place of its stale one (eager,
        `OuterRound.eager_start`); and round s is exchanged while they train. theta_outer, the hashes, the
        commits, state sync and catch-up are those of the synchronous loop: every peer holds the same
        theta_outer, one round behind what its ranks train on. The ranks wait only when a round takes longer than
        their inner steps, and after the last round (run.max_rounds)."""
        run = self.config.run
        pending: asyncio.Task[bool] | None = None
        ours_applied = False  # eager: the round just applied holds the contribution we previewed last
        # The members wait for us in a round from its announcement: here for the first, then as soon as the
        # round before it closed (`_round_in_flight`), while our ranks already work on it.
        self.matchmaker.announce(self.outer.round_id, self.state.peer_id, self.outer.outer_hash)
        started_from = self.outer.outer_hash
        # Where the ranks' current sequence started, kept by us: the hand-off's theta gets the next start at the
        # hand-off, before the contribution of the sequence just ended is made (off the ranks' path).
        reference = self.outer.round.reference(self.outer.theta)
        seq = self.ranks.publish(
            self.outer.theta,
            round_id=self.outer.round_id,
            step_base=self.outer.round_id * run.inner_steps,
            inner_steps=run.inner_steps,
        )
        self.state.status = Status.TRAINING
        await self._enter_phase("train")
        try:
            while True:
                ranks_done = await self.ranks.wait(seq)
                if pending is not None:
                    committed = self.state.counters.rounds_committed
                    # A graceful leave lets the round in flight end (bounded by the leave's grace).
                    outcome = await self._unless_leaving_now(pending)
                    pending = None
                    if outcome is None:
                        self.state.events.write("withdrew", round_id=self.outer.round_id, mode="now")
                        return
                    ours_applied = self.state.counters.rounds_committed > committed
                if not ranks_done:
                    self.state.events.write("withdrew", round_id=self.outer.round_id)
                    return
                if run.max_rounds and self.outer.round_id >= run.max_rounds:
                    self.state.events.write("finished", round_id=self.outer.round_id)
                    return
                if self.state.leave_mode in ("graceful", "now"):
                    return
                # Nothing trains after the last round, or after a drain's: it is exchanged while the ranks wait.
                last = self.state.leave_mode == "drain" or (
                    bool(run.max_rounds) and self.outer.round_id + 1 >= run.max_rounds
                )
                trained_from, started_from = started_from, self.outer.outer_hash
                self.ranks.read_reports(seq)  # before the next sequence's first eval overwrites them
                # The ranks' weights stay put in the hand-off until their next sequence ends: read in place.
                prepared: Prepared | None = None
                if last:
                    prepared = self._prepare_round(seq, copy=False, reference=reference, reports=False)
                    prepared.trained_from = trained_from
                    outcome = await self._unless_leaving_now(self._round(seq, prepared))
                    if outcome is None:
                        self.state.events.write("withdrew", round_id=self.outer.round_id, mode="now")
                        return
                    if self.state.leave_mode is not None:
                        return  # drained: the ranks' last sequence went into the swarm
                    continue
                start = self.outer.theta
                if run.outer_update == "eager":
                    # The preview needs this round's contribution: made before the ranks go on.
                    prepared = self._prepare_round(seq, copy=False, reference=reference, reports=False)
                    assert isinstance(prepared.contribution, torch.Tensor), "on demand is for the sync loop"
                    group = self.state.counters.last_contributors or len(self.swarm.live_ids()) + 1
                    self.outer.round.eager_start(
                        self.ranks.handoff.theta, prepared.contribution, group, ours_applied=ours_applied
                    )
                    start = self.ranks.handoff.theta
                round_seq = seq
                seq = self.ranks.publish(
                    start,
                    round_id=self.outer.round_id + 1,
                    step_base=(self.outer.round_id + 1) * run.inner_steps,
                    inner_steps=run.inner_steps,
                )
                # The ranks train on from here; the rest of the hand-off is off their path.
                if prepared is None:
                    # Off the event loop: the contribution takes seconds at 10B while the ranks train on.
                    made, cancelled = await self.outer.on_thread(
                        functools.partial(
                            self._prepare_round, round_seq, copy=False, reference=reference, reports=False
                        )
                    )
                    if cancelled:
                        raise asyncio.CancelledError
                    prepared = made
                prepared.trained_from = trained_from
                reference.copy_(self.ranks.handoff.theta)  # the start of the sequence just published
                pending = asyncio.create_task(
                    self._round_in_flight(round_seq, prepared), name="farloco-round"
                )
                await self._enter_phase("train", self.outer.round_id + 1)
        finally:
            if pending is not None:
                await cancel_and_wait(pending)

    async def _round_in_flight(self, seq: int, prepared: Prepared) -> bool:
        """`_round` while the ranks train on: once it closed (committed, aborted, caught up), the next round's
        work is already under way, so it is announced at once, and the node's status says it trains."""
        try:
            return await self._round(seq, prepared)
        finally:
            if self.state.status in (Status.EXCHANGING, Status.SYNCING, Status.ISOLATED):
                self.state.status = Status.TRAINING
            if self.state.leave_mode is None:
                self.matchmaker.announce(self.outer.round_id, self.state.peer_id, self.outer.outer_hash)

    async def _unless_leaving_now(self, work: Awaitable[bool]) -> bool | None:
        """Run one round's exchange; `leave --now` abandons it (None): the others drop us from the exchange."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                if self.state.leave_mode == "now":
                    await cancel_and_wait(task)
                    return None
                await asyncio.wait({task}, timeout=0.05)
            return task.result()
        finally:
            if not task.done():  # we were cancelled ourselves (a bounded leave): the round goes with us
                await cancel_and_wait(task)

    def _prepare_round(
        self, seq: int, *, copy: bool, reference: torch.Tensor | None = None, reports: bool = True
    ) -> Prepared:
        """Read sequence `seq`'s reports (unless read already) and the ranks' weights (a copy when they train
        on meanwhile and would overwrite them) and make the round's contribution, measured from `reference`
        (default: theta_outer)."""
        started = time.monotonic()
        if reports:
            self.ranks.read_reports(seq)
        theta_local = self.outer.round.read_local(self.ranks.handoff.local, copy=copy)
        weight, merged_weight = self.ranks.seq_weight, 0.0
        if self.late_work is not None and reference is None:
            theta_local, merged_weight = self._merge_late_work(theta_local, weight)
            weight += merged_weight
        contribution = self.outer.contribution(theta_local, reference)
        return Prepared(
            theta_local,
            contribution,
            fixed_reference=reference is not None,
            inner_step=self.ranks.seq_inner_step,
            weight=weight,
            merged_weight=merged_weight,
            seconds=time.monotonic() - started,
        )

    def _merge_late_work(self, theta_local: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
        """The weights this round's contribution is made from, with the work kept from the round we were late
        for merged in, and the weight that work adds (0.0, and `theta_local` itself, when there is none)."""
        assert self.late_work is not None
        round_id, trained_for = self.outer.round_id, self.late_work.round_id
        local, merged, dropped = self.late_work.merge(round_id, self.outer.theta, theta_local, weight)
        if dropped:  # a catch-up skipped rounds: the work is more than one round old
            self.state.events.write(
                "late_work", round_id=round_id, own=0.0, kept=0.0, dropped=dropped, trained_for=trained_for
            )
        return (theta_local, 0.0) if local is None else (local, merged)

    async def _round(self, seq: int, prepared: Prepared | None = None) -> bool:
        """Exchange and apply round `self.outer.round_id` (its contribution `prepared` already, when the ranks train on
        meanwhile). Returns whether the ranks must reload theta.

        One phase per step; after each, node/daemon/rules.py `decide` says go on or how the round closes."""
        started = time.monotonic()
        prepared = self._hand_off(seq, prepared)
        self.state.status = Status.EXCHANGING
        isolated = await self.swarm.ride_out_isolation()
        if isolated is not None:
            self.swarm.left_out(shares.ISOLATED)
            return isolated
        facts = RoundFacts(
            self.outer.round_id, self.config.run.min_peers, fixed_reference=prepared.fixed_reference
        )
        # Where the round's time went (the round event's `phases`): the contribution (made before the round
        # began where the ranks train on), forming the group (waiting for the others included), the hash check,
        # the exchange, the commit (the outer step and theta's digest).
        phase_started = time.monotonic()
        await self._enter_phase("match")
        group, facts = await self._match(facts)
        group, facts, over = await self._solo_while_isolated(group, facts)
        if over is not None:
            self.swarm.left_out(shares.ISOLATED)
            return over
        self._phases = {"prepare": prepared.seconds, "match": time.monotonic() - phase_started}
        if (decision := decide(facts)).action is not Action.GO_ON:
            return await self._close(decision, prepared, island_out=True)
        phase_started = time.monotonic()
        await self._enter_phase("heal")
        facts = await self._heal(group, facts)
        self._phases["heal"] = time.monotonic() - phase_started
        if (decision := decide(facts)).action is not Action.GO_ON:
            return await self._close(decision, prepared, island_out=True)
        if decision.redo_contribution:
            # We held a theta the group disagrees with and took the winning side's: redo our pseudo-gradient.
            prepared.contribution = self.outer.contribution(prepared.theta_local)
        phase_started = time.monotonic()
        await self._enter_phase("exchange")
        averaged, facts = await self._average(group, prepared.contribution, facts, prepared.weight)
        self._phases["exchange"] = time.monotonic() - phase_started
        if (decision := decide(facts)).action is not Action.COMMIT:
            return await self._close(decision, prepared)
        assert averaged is not None
        await self._commit(group, prepared, averaged, started)
        await self._enter_phase("commit", self.outer.round_id - 1)
        return True

    def _hand_off(self, seq: int, prepared: Prepared | None) -> Prepared:
        """The round's input from the ranks (unless `prepared` already) and, for streaming-diloco, the tau inner
        steps they run while we exchange."""
        run = self.config.run
        overlap = (
            prepared is None
            and bool(self._overlap_steps)
            and not (run.max_rounds and self.outer.round_id + 1 >= run.max_rounds)
        )
        if prepared is None:
            # While the ranks wait for us their weights stay put and are read in place; when they train on
            # during the exchange (overlap) we read a copy, taken before they can overwrite it.
            prepared = self._prepare_round(seq, copy=overlap)
        if overlap:
            # streaming-diloco: the ranks run the next round's first tau inner steps while we exchange (their
            # reports and weights for this round were read above, before they can overwrite them).
            self._overlap_seq = self.ranks.publish(
                None,
                round_id=self.outer.round_id + 1,
                step_base=(self.outer.round_id + 1) * run.inner_steps,
                inner_steps=self._overlap_steps,
            )
        return prepared

    async def _match(self, facts: RoundFacts) -> tuple[Any, RoundFacts]:
        """Form the round's group (protocol/matchmaking/): (the group or None, the facts with the outcome).
        No member-record store here: our record moved to this round when its work started (what the early
        freeze needs); the next heartbeat says 'exchanging'. The round's agreement goes over the links."""
        from farloco.protocol.matchmaking import LateForRound, MatchmakingError
        from farloco.protocol.types import GroupMember

        timeouts = self.config.timeouts
        try:
            group = await self.matchmaker.form_group(
                self.outer.round_id,
                GroupMember(
                    self.state.peer_id,
                    self.state.grpc_address,
                    self.outer.outer_hash,
                    self.outer.strategy.num_rounds,
                ),
                match_timeout=timeouts.match_timeout,
                leader_timeout=timeouts.leader_timeout,
                match_timeout_min=timeouts.match_timeout_min,
            )
        except MatchmakingError as exc:
            self.state.events.write("matchmaking_failed", round_id=self.outer.round_id, error=str(exc))
            return None, replace(facts, matchmaking="failed")
        except LateForRound as exc:
            self.state.counters.rounds_late += 1
            self.state.events.write(
                "late", round_id=self.outer.round_id, reason=exc.reason, group_formed=exc.group_formed
            )
            return None, replace(facts, matchmaking="late", group_formed=exc.group_formed)
        return group, replace(facts, matchmaking="grouped", group_size=len(group.members))

    async def _solo_while_isolated(
        self, group: Any, facts: RoundFacts
    ) -> tuple[Any, RoundFacts, bool | None]:
        """A group of us alone, formed while our peers vanished (the check before matching still saw them):
        committing it would be a round alone while isolated, a fork if they went on without us. The isolation
        policy applies here as before a round (`Swarm.ride_out_isolation`): a bool when the round is over (the
        swarm moved on and we took its state: `_round`'s value), else (group, facts, None) to go on."""
        if group is None or len(group.members) != 1 or not await self.swarm.isolated_now():
            return group, facts, None
        self.state.events.write(
            "solo_group_isolated", round_id=self.outer.round_id, vanished=list(self.state.isolation.vanished)
        )
        isolated = await self.swarm.ride_out_isolation()
        if isolated is not None:
            return group, facts, isolated  # the swarm went on without us: we took its state
        # Back at our round or behind it (a restarted peer): our group record is in the DHT, so they take the
        # next round's state from us (late for this one); or alone past timeouts.isolation_timeout, which
        # run.min_peers = 1 allows. Either way the group of one stands.
        return group, facts, None

    async def _heal(self, group: Any, facts: RoundFacts) -> RoundFacts:
        """Compare theta hashes with the group and take the winning side's state on a fork (`_check_hashes`)."""
        from farloco.protocol.statesync import StateSyncError

        try:
            resynced = await self.swarm.check_hashes(group)
        except StateSyncError as exc:
            return replace(facts, fork="unhealed", fork_error=str(exc))
        return replace(facts, fork="healed" if resynced else "none")

    async def _average(
        self, group: Any, contribution: torch.Tensor | OnDemand, facts: RoundFacts, weight: float = 1.0
    ) -> tuple[Averaged | None, RoundFacts]:
        """The group's mean of contributions (protocol/exchange/; a group of one encodes nothing), counting
        every byte that crossed the wire, aborted attempts included. With an island (node/daemon/island.py) that
        goes through the round together: the island's reduce-scatter first, our slice of the island's mean
        across the swarm, then the island's all-gather of every slice's result."""
        from farloco.node.daemon.island import IslandError
        from farloco.protocol.exchange import ExchangeAborted

        island_round = await self._island_reduce(group, contribution, weight)
        self._island_round = island_round
        result = None
        try:
            if len(group.members) == 1 and island_round is None:
                transmitted: Transmitted
                transmitted, mean = self.outer.round.alone(contribution)
                averaged = Averaged(transmitted, mean, (self.state.peer_id,), 0, 0, 0, "alone")
            elif isinstance(contribution, OnDemand):
                # Made chunk by chunk as the exchange sends it; the mean lands in a buffer kept across rounds,
                # and of what the swarm saw only the ranges it was encoded in are kept (OuterRound.commit).
                exchange_started = time.monotonic()
                result = await self.net.exchange.average(
                    group,
                    contribution,
                    self.outer.codec,
                    timeout=self.config.timeouts.exchange_timeout,
                    out=self.outer.round.mean_buffer(contribution.numel),
                    rule=self.outer.aggregator,
                    weight=weight,
                )
                self.state.metrics.exchange_duration.observe(time.monotonic() - exchange_started)
                sent: Transmitted = result.transmitted
                if sent is None:  # made again at commit: from the payload we sent, or the ranges encoded
                    sent = result.payload or result.encoded_in
                averaged = Averaged(
                    sent,
                    result.averaged,
                    tuple(result.contributors),
                    result.bytes_sent,
                    result.bytes_received,
                    result.fp32_bytes,
                    result.path,
                    tuple(result.partial),
                    tuple(result.withheld),
                )
            else:
                # The mean and what the swarm saw of our contribution land in buffers kept across rounds.
                mean_out, sent_out = self.outer.round.exchange_buffers(contribution.numel())
                exchange_started = time.monotonic()
                result = await self.net.exchange.average(
                    group,
                    contribution if island_round is None else island_round.mean,
                    self.outer.codec,
                    timeout=self.config.timeouts.exchange_timeout,
                    out=mean_out,
                    transmitted_out=sent_out,
                    rule=self.outer.aggregator,
                    weight=weight if island_round is None else island_round.weight,
                    span=None if island_round is None else island_round.span,
                )
                self.state.metrics.exchange_duration.observe(time.monotonic() - exchange_started)
                transmitted = result.transmitted
                if island_round is not None:
                    assert self.island is not None and result.transmitted is not None
                    await asyncio.wrap_future(
                        self.island.submit_gather(
                            True, result.averaged, result.transmitted, mean_out, sent_out
                        )
                    )
                    transmitted = sent_out
                averaged = Averaged(
                    transmitted,
                    result.averaged,
                    tuple(result.contributors),
                    result.bytes_sent,
                    result.bytes_received,
                    result.fp32_bytes,
                    result.path,
                    tuple(result.partial),
                    tuple(result.withheld),
                )
        except ExchangeAborted as exc:
            # What crossed the wire before the abort counts too (and its fp32 equivalent).
            self.state.count_bytes(exc.bytes_sent, exc.bytes_received, exc.fp32_bytes)
            if island_round is not None:
                self._island_withdraw()
            return None, replace(facts, exchange="aborted", exchange_error=str(exc))
        except IslandError as exc:
            assert result is not None
            self.state.count_bytes(result.bytes_sent, result.bytes_received, result.fp32_bytes)
            name = self.island.name if self.island is not None else "?"
            return None, replace(facts, exchange="aborted", exchange_error=f"island {name}: {exc}")
        except BaseException:
            if island_round is not None and result is None:
                self._island_withdraw()  # cancelled mid-exchange (leave --now): release the island's gather
            raise
        # compression_ratio = fp32 baseline / bytes sent, both from the exchange's own count of every attempt: a
        # dense fp32 all-reduce of the values this member actually sent (a fragment, for streaming).
        self.state.count_bytes(averaged.sent, averaged.received, averaged.fp32_bytes)
        return averaged, replace(facts, exchange="done", contributors=len(averaged.contributors))

    async def _island_reduce(self, group: Any, contribution: torch.Tensor | OnDemand, weight: float) -> Any:
        """Our island's weighted mean on our span (an IslandRound), or None: we exchange alone this round (no
        island, an island of one, a node of it missing, the island re-forming)."""
        if self.island is None:
            return None
        assert isinstance(contribution, torch.Tensor), "a node of an island makes its contribution whole"
        future = self.island.submit_reduce(self.outer.round_id, group.group_id, contribution, weight)
        try:
            island_round = await wait_for(
                asyncio.shield(asyncio.wrap_future(future)), timeout=self.island.wait + 1.0
            )
        except TimeoutError:
            # Not taken up in time (the island's thread is re-forming the group): alone, unless it just began.
            island_round = None if future.cancel() else await asyncio.wrap_future(future)
        except BaseException:
            future.add_done_callback(self._island_release)
            raise
        return island_round

    def _island_release(self, future: Any) -> None:
        """A reduce whose round was cancelled meanwhile: if the island went ahead, release its gather."""
        if not future.cancelled() and future.exception() is None and future.result() is not None:
            self._island_withdraw()

    def _island_withdraw(self) -> None:
        """Our exchange of an island round gave no mean: tell the island's gather (every node of it then sits
        the round out). Not awaited: the gather's outcome is known already."""
        assert self.island is not None
        empty = torch.empty(0)
        future = self.island.submit_gather(False, empty, empty, empty, empty)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # its IslandError is expected

    async def _commit(self, group: Any, prepared: Prepared, averaged: Averaged, started: float) -> None:
        """The round committed: the outer step, round r+1, a checkpoint when due, the round event, the record."""
        run = self.config.run
        contributors = averaged.contributors
        self._account_round(group, contributors)
        self.state.counters.last_contributors = len(contributors)
        fragment = getattr(self.outer.strategy, "current_fragment", None)
        synced = fragment() if fragment is not None else slice(0, self.outer.num_params)
        phase_started = time.monotonic()
        outer_lr = self.outer.outer_lr  # the rate this commit applies (run.outer_lr_schedule)
        try:  # seen through once begun, even if the round is cancelled meanwhile (a leave): theta moved
            await self.outer.commit(
                prepared.contribution, averaged.transmitted, averaged.mean, averaged.withheld
            )
        finally:
            self.net.exchange.advance(self.outer.round_id)
        if self.late_work is not None:
            self.late_work.round_closed()  # merged work, if any, is in this commit (the event's merged_weight)
        self._phases["commit"] = time.monotonic() - phase_started
        every = self.config.checkpoint.every_rounds
        last = bool(run.max_rounds) and self.outer.round_id == run.max_rounds  # the run's result: always kept
        if every and (self.outer.round_id % every == 0 or last):
            await self.checkpoints.save()
        ddp = ddp_bytes_per_round(self.outer.num_params, run.inner_steps, len(contributors))
        self.state.counters.ddp_bytes += ddp
        self.state.counters.rounds_committed += 1
        self.state.counters.last_round_seconds = time.monotonic() - started
        self.state.metrics.round_duration.observe(self.state.counters.last_round_seconds)
        self.state.events.write(
            "round",
            round_id=self.outer.round_id,
            group_id=group.group_id,
            group=[m.peer_id for m in group.members],
            contributors=list(contributors),
            train_loss=self.state.train_loss,
            eval_loss=self.state.eval_loss,
            inner_lr=self.state.inner_lr,
            outer_lr=outer_lr,
            outer_hash=self.outer.outer_hash,
            bytes_sent=averaged.sent,
            bytes_received=averaged.received,
            ddp_bytes=ddp,
            synced=[synced.start, synced.stop],
            overlap_steps=self._overlap_steps if self._overlap_seq is not None else 0,
            fp32_bytes=averaged.fp32_bytes,
            exchange=averaged.path,  # flat, rows (run.exchange_group_size), rows then flat, alone
            partial=list(averaged.partial),  # rows: contributors missing from some slices (a carrier lost)
            # rows: values of our contribution in no slice's mean (the error feedback carries them whole)
            withheld=sum(b - a for a, b in averaged.withheld),
            seconds=self.state.counters.last_round_seconds,
            phases=self._phases,
            # matchmaking: frozen in one hop, and the last member's ready record -> the group known here
            one_hop=getattr(self.matchmaker, "last_one_hop", False),
            freeze_ms=_ms(getattr(self.matchmaker, "last_freeze_seconds", None)),
            ranks_idle_seconds=self.state.counters.ranks_idle_seconds,
            inner_step_seconds=self.state.inner_step_seconds,
            trained_from=prepared.trained_from,
            inner_step=prepared.inner_step,
            weight=prepared.weight,
            merged_weight=prepared.merged_weight,  # of `weight`, the late round's work merged in
            # With an island: whether it went through this round together (our rank, its size, our slices).
            island=(
                None
                if self.island is None
                else {"name": self.island.name, "alone": True}
                if self._island_round is None
                else {
                    "name": self.island.name,
                    "rank": self._island_round.rank,
                    "size": self._island_round.size,
                    "span": list(self._island_round.span),
                }
            ),
        )
        # Our record moves to the next round in the background: the round's path holds no DHT store (the next
        # round's MatchAt tells the members at once; the heartbeat retries a store that fails).
        self.swarm.publish_soon()

    def _account_round(self, group: Any, contributors: tuple[str, ...]) -> None:
        """A committed round: record who took part; as its leader, name each live member left out and why."""
        now = dht_now()
        live = {m.peer_id: m for m in self.net.membership.core.live(now)}
        self.state.shares.record([*live, self.state.peer_id], contributors)
        if self.matchmaker.last_leader != self.state.peer_id:
            return
        in_group = {m.peer_id for m in group.members}
        for peer_id, record in sorted(live.items()):
            if peer_id in contributors or peer_id == self.state.peer_id:
                continue
            reason = left_out_reason(
                record.state,
                self.matchmaker.round_of(record, now),
                self.outer.round_id,
                in_group=peer_id in in_group,
            )
            self.state.shares.peers_left_out[reason] += 1
            self.state.events.write(
                "left_out", round_id=self.outer.round_id, peer=peer_id, reason=reason, by="leader"
            )
            log.info("round %d: %s left out (%s)", self.outer.round_id, peer_id, reason)

    async def _close(self, decision: Decision, prepared: Prepared, island_out: bool = False) -> bool:
        """Enact a round's decision other than committing (node/daemon/rules.py); returns `_round`'s value.
        `island_out`: the round closes before its exchange, which the nodes of our island learn at once."""
        if island_out and self.island is not None:
            self.island.post_out(self.outer.round_id)
        if decision.left_out is not None:
            self.swarm.left_out(decision.left_out)
        await self._late_work_closed(decision, prepared)
        if decision.action is Action.ABORT:
            return self._abort(decision.reason, decision.num_peers)
        self.outer.round.rollback()  # the residual is not eaten
        if decision.action is Action.CATCH_UP:
            assert decision.target_round is not None
            return await self.swarm.catch_up(decision.target_round, decision.reason)
        if decision.action is Action.ADVANCE:
            return self.swarm.advance_without_update(decision.reason)
        raise AssertionError(f"_close: {decision.action} is not a way to close a round")

    async def _late_work_closed(self, decision: Decision, prepared: Prepared) -> None:
        """The round closed without us in its update. If the swarm went on (we catch up), our steps of it are kept
        for the next round (theta_outer is still the one they started from; the ranks wait, their weights in the
        hand-off), or dropped (run.late_work = discard, the overlapped loops); otherwise work merged into this
        round is dropped. The `late_work` event says which: `own` (this round's steps, as a share of a round),
        `kept`, and `dropped` (any steps given up now, of this round or of the one merged into it)."""
        round_id, late = self.outer.round_id, self.late_work
        own = prepared.weight - prepared.merged_weight
        if decision.action is Action.CATCH_UP:
            if late is None:
                self.state.events.write("late_work", round_id=round_id, own=own, kept=0.0, dropped=own)
                return
            dropped, cancelled = await self.outer.on_thread(
                late.keep, round_id, self.outer.theta, self.ranks.handoff.local, own
            )
            self.state.events.write("late_work", round_id=round_id, own=own, kept=own, dropped=dropped)
            if cancelled:
                raise asyncio.CancelledError
        elif late is not None and (dropped := late.round_closed()):
            self.state.events.write("late_work", round_id=round_id, own=0.0, kept=0.0, dropped=dropped)

    def _abort(self, reason: str, num_peers: int) -> bool:
        self.state.counters.rounds_aborted += 1
        self.state.events.write("aborted", round_id=self.outer.round_id, reason=reason, num_peers=num_peers)
        log.warning("round %d aborted: %s", self.outer.round_id, reason)
        self.outer.round.rollback()  # the residual is not eaten
        return self.swarm.advance_without_update(reason)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)
