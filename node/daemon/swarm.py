"""The node among its peers: its member record and heartbeat, joining (slot, state sync), isolation, catching
up with the swarm and healing forks by the announced hashes.

Rules:
- Our record says where we stand (state, round, theta hash) and is stored at each heartbeat and after each round;
  stores are serialized (the DHT keeps only the entry with the latest expiration).
- A joiner takes the state of the swarm's newest round from the members of that round, checked against the
  hashes the swarm vouches for (a donor serving anything else is refused before a byte), or resumes its own
  checkpoint when that holds the very same state.
- A group that disagrees on theta heals before it contributes: the hash held by the most members wins, then the
  theta with more outer steps, then the side holding the lowest peer id; every member decides on the same claims
  (the group record's).
- Isolated (peers vanished without leaving), a node commits nothing alone until timeouts.isolation_timeout, and
  then only with run.min_peers = 1.
- Whenever the round id moves (a sync, a round closed without an update) the exchange is told at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from farloco.node.config import diff_run, run_section
from farloco.node.daemon.checkpoints import Checkpoints
from farloco.node.daemon.core import AgentError, Network, NodeState, Status, dht_now, log, version
from farloco.node.daemon.dhtnode import daemon_alive
from farloco.node.daemon.knownpeers import KnownPeers
from farloco.node.daemon.outer import theta_hash
from farloco.node.daemon.outerstate import OuterState
from farloco.node.daemon.ranks import Ranks
from farloco.node.daemon.rules import healing_winner
from farloco.node.logs import SyncProgress
from farloco.util.tasks import cancel_and_wait


class SwarmGone(Exception):
    """`catch_up(join=True)`: every member that was ahead of us is gone, none is left to fetch from."""


class Swarm:
    """The node among its peers (see the module docstring)."""

    def __init__(
        self,
        state: NodeState,
        outer: OuterState,
        ranks: Ranks,
        checkpoints: Checkpoints,
        net: Network,
        known_peers: KnownPeers,
    ) -> None:
        self.state = state
        self.outer = outer
        self.ranks = ranks
        self.checkpoints = checkpoints
        # The [run] section our record carries and records are checked against: computed once (with
        # run.init_from it holds the weights' digest, and the heartbeat publishes it every beat).
        self.run_config = run_section(state.config)
        self.net = net
        self.config = state.config
        self.membership = net.membership
        self.matchmaker = net.matchmaker
        self.known_peers = known_peers  # the members last seen live: for a restart without the bootstrap
        self._peer_maddrs: dict[str, tuple[str, ...]] = {}  # last multiaddrs of the peers seen live
        # Our record's stores, one at a time: the DHT keeps only the entry with the latest expiration.
        self.publish_lock = asyncio.Lock()
        self.heartbeat_task: asyncio.Task[None] | None = None
        self.record_task: asyncio.Task[None] | None = None  # a member-record store after a round, in flight
        # While a joining node writes its round buffers' pages once (`join`).
        self._prefault_task: asyncio.Task[tuple[None, bool]] | None = None

    def live_ids(self) -> list[str]:
        return [m.peer_id for m in self.membership.core.live(dht_now())]

    def left_out(self, reason: str) -> None:
        """We are not among this round's contributors: say why (event, metric, our share)."""
        self.state.left_out(reason, self.live_ids(), self.outer.round_id)

    def publish_soon(self) -> None:
        """Move our record on in the background (after a round: the round's path holds no DHT store; the next
        round's MatchAt tells the members at once, the heartbeat retries a store that fails)."""
        if self.record_task is None or self.record_task.done():
            self.record_task = asyncio.create_task(self.publish(), name="farloco-record")

    def record(self) -> Any:
        from farloco.protocol.membership import MemberRecord

        return MemberRecord(
            peer_id=self.state.peer_id,
            address=self.state.grpc_address,
            state=self.state.status.value,
            round_id=self.outer.round_id,
            inner_step=int(max((r.inner_step for r in self.ranks.reports()), default=0)),
            slot=self.state.slot,
            run_hash=self.state.run_hash,
            run_config=self.run_config,
            outer_hash=self.outer.outer_hash,
            loss=0.0 if math.isnan(self.state.train_loss) else float(self.state.train_loss),
            heartbeat=0.0,
            maddrs=tuple(self.state.multiaddrs),
            version=version(),
            tokens_per_second=self.ranks.tokens_per_second() or 0.0,
        )

    async def publish(self, retry_seconds: float = 0.0) -> None:
        """Publish our member record now (one try by default: the next heartbeat is the retry). Serialised:
        the DHT keeps only the entry with the latest expiration, so two overlapping stores of ours would refuse
        one another."""
        from farloco.protocol.membership import MembershipError

        async with self.publish_lock:
            try:
                await self.membership.publish(self.record(), retry_seconds=retry_seconds)
            except MembershipError as exc:  # survivable: the record lives for several heartbeats
                log.warning("publishing our member record failed: %s", exc)

    async def refresh_peers(self) -> list[Any]:
        members = await self.membership.members()
        view = [
            {
                "peer_id": m.peer_id,
                "address": m.address,
                "state": m.state,
                "round_id": m.round_id,
                "inner_step": m.inner_step,
                "slot": m.slot,
                "loss": m.loss,
                "tokens_per_second": m.tokens_per_second,
                "outer_hash": m.outer_hash,
                "heartbeat_age": max(0.0, dht_now() - m.heartbeat),
                "share": self.state.shares.share(m.peer_id),
                "self": m.peer_id == self.state.peer_id,
            }
            for m in members
        ]
        others = [m for m in members if m.peer_id != self.state.peer_id]
        for m in others:
            self._peer_maddrs[m.peer_id] = tuple(m.maddrs)
        was = self.state.isolation.verdict
        verdict = self.state.isolation.observe(
            dht_now(), [m.peer_id for m in others], self.membership.departed()
        )
        self._peer_maddrs = {p: a for p, a in self._peer_maddrs.items() if p in self.state.isolation.known}
        self.known_peers.remember({m.peer_id: m.maddrs for m in others})
        if verdict == "isolated" and was != "isolated":
            log.warning(
                "isolated: the peers %s vanished without leaving (crashed, or the network between us is down); "
                "no round is committed alone while it lasts",
                ", ".join(self.state.isolation.vanished),
            )
        with self.state.lock:
            self.state.peers_view = view
        return list(members)

    async def heartbeat_loop(self) -> None:
        """Store our record every `timeouts.heartbeat` (heartbeat_interval, or member_ttl/4); read the member
        table (the status view, the isolation verdict) at the pacer's interval, a quarter of `member_ttl`
        (`table_read_interval`): a read carries every member's record, a store one. The round reads the table
        itself when it meets a member it does not know."""
        from farloco.protocol.membership import HeartbeatPacer

        timeouts = self.config.timeouts
        pacer = HeartbeatPacer(timeouts.heartbeat, timeouts.member_ttl)
        while True:
            await asyncio.sleep(timeouts.heartbeat)
            try:
                await self.publish()
                if pacer.read_due(time.monotonic()):
                    await self.refresh_peers()
            except Exception as exc:  # the DHT may hiccup; the next beat retries
                log.warning("heartbeat failed: %s", exc)

    async def join(self) -> None:
        """Refuse a mismatched run, claim a data slot, and fetch the swarm's state if it is already training.
        Meanwhile the outer thread writes every page of the round's buffers once (`OuterRound.prefault`): the
        first round does not pay their page faults, and it starts only once that is done."""
        try:
            await self._join_swarm()
        finally:
            if self._prefault_task is not None:
                await self._prefault_task
                self._prefault_task = None

    async def _join_swarm(self) -> None:
        from farloco.protocol.membership import MembershipError

        self.state.status = Status.SYNCING
        members = await self.refresh_peers()
        mismatched = self.membership.mismatched()
        if mismatched:
            record, _keys = mismatched[0]
            differences = diff_run(self.run_config, dict(record.run_config))
            raise AgentError(
                f"refusing to join: peer {record.peer_id} trains run {self.config.run.name!r} with another "
                f"config (run_hash {record.run_hash[:12]} vs ours {self.state.run_hash[:12]}): "
                + "; ".join(differences)
            )
        try:
            # Our first record must get out (the slot claim and every later lookup need it): a refused store is
            # retried for timeouts.dht_retry, and only then does the node give up, saying what to check.
            # A restarted node asks for the slot its checkpoint trained, before the ranks start: the claim keeps it
            # while no other member holds it (two nodes never end up on one slot).
            self.state.slot = await asyncio.to_thread(self.checkpoints.saved_slot)
            async with self.publish_lock:
                await self.membership.publish(self.record())
                self.state.slot = await self.membership.claim_slot(
                    self.state.peer_id, self.config.run.data_slots
                )
        except MembershipError as exc:
            raise AgentError(f"joining: {exc}") from exc
        # The ranks start now (they know their data slot) and wait for the first round's theta: their start-up
        # (a Python process each, torch, the model, the data) overlaps the state fetch below, so a joiner is
        # ready for the round it fetched.
        self.ranks.start(self.state.slot)
        self._prefault_task = asyncio.create_task(
            self.outer.on_thread(self.outer.round.prefault, self.config.run.outer_update != "sync"),
            name="farloco-prefault",
        )
        # Heartbeats from now on: during a long state fetch our record must stay live and say `syncing`, which
        # is what makes the others wait for us (protocol/matchmaking/, catching up).
        self.heartbeat_task = asyncio.create_task(self.heartbeat_loop(), name="farloco-heartbeat")
        others = [m for m in members if m.peer_id != self.state.peer_id and m.round_id > 0]
        if others:
            # The swarm is mid-round: take the state its current round started from and join that round. Our
            # record says `syncing`, so the round's members wait for us (up to match_timeout); if it still freezes
            # without us, we are late and take the next round's state the same way (never the next round boundary:
            # the swarm would wait for the syncing node while the node waits for the swarm to finish the round).
            target = max(m.round_id for m in others)
            # A restarted node whose own checkpoint holds the very state the swarm's newest members publish (the
            # whole swarm restarted from the same round, ours a moment after the others) resumes it from disk,
            # with its inner state and data position, instead of fetching the same theta over the network.
            held = {m.outer_hash for m in others if m.round_id == target and m.outer_hash}
            own = await asyncio.to_thread(self.checkpoints.holding, target, held)
            if own is not None:
                await self._resume(own)
            else:
                self.state.events.write("catching_up", round_id=target)
                try:
                    caught = await self.catch_up(
                        target, "join", wait=self.config.timeouts.sync_timeout, join=True
                    )
                except SwarmGone:
                    # The members we saw were the records of a swarm that stopped (SIGKILLed within member_ttl
                    # of our start, say): they expired with nobody behind them, so we are the first one back.
                    log.warning(
                        "the members of round %d we saw at start are gone: resuming on our own", target
                    )
                    others, caught = [], True
                if not caught:
                    raise AgentError(
                        f"joining: no member reached round {target} within timeouts.sync_timeout"
                    )
        if not others:
            await self._resume(None)
            self.outer.outer_hash = await asyncio.to_thread(theta_hash, self.outer.theta)
        self.state.status = Status.TRAINING
        await self.publish()
        self.state.events.write(
            "joined", round_id=self.outer.round_id, slot=self.state.slot, num_peers=len(members)
        )

    def vouched(self, members: list[Any]) -> dict[int, set[str]]:
        """Round id -> the theta hash the swarm vouches for in that round: what the other live members publish
        (their signed records, what they announced over the links), and where they disagree the healing rule's
        winner (the hash held by the most members, then by the lowest peer id; `_check_hashes`). What a donor's
        state must hash to before we fetch it (a poisoned donor is refused, not installed)."""
        holders: dict[int, dict[str, set[str]]] = {}
        others = [m for m in members if m.peer_id != self.state.peer_id]
        for m in others:
            if m.outer_hash:
                holders.setdefault(int(m.round_id), {}).setdefault(m.outer_hash, set()).add(m.peer_id)
        live = {m.peer_id for m in others}
        for round_id in {self.matchmaker.round_of(m, dht_now()) for m in others}:
            for peer_id, outer_hash in self.matchmaker.announced_hashes(round_id).items():
                if peer_id in live:
                    holders.setdefault(round_id, {}).setdefault(outer_hash, set()).add(peer_id)
        return {
            round_id: {min(by_hash, key=lambda h: (-len(by_hash[h]), min(by_hash[h])))}
            for round_id, by_hash in holders.items()
        }

    def _state_refused(self, donor: str, reason: str, detail: str) -> None:
        self.state.refused_states[reason] = self.state.refused_states.get(reason, 0) + 1
        self.state.events.write("state_refused", donor=donor, reason=reason, detail=detail)

    async def sync_from(
        self, donors: list[str], why: str, vouched: dict[int, set[str]] | None = None
    ) -> None:
        """Fetch the swarm's state from `donors`, checked against `vouched` (round -> the theta hash the swarm
        vouches for: a donor serving anything else is refused before a byte is fetched). Members behind NAT
        serve nothing (nobody can dial them): they are left out."""
        from farloco.protocol.statesync import StateSyncError, fetch_state
        from farloco.protocol.types import NO_INBOUND

        if donors and all(d == NO_INBOUND for d in donors):
            raise StateSyncError(
                f"the {len(donors)} members holding that state are behind NAT: none can serve it"
            )
        donors = [d for d in donors if d != NO_INBOUND]
        self.state.status = Status.SYNCING
        started = time.monotonic()
        self.state.sync_progress = SyncProgress(f"state sync ({why})")
        try:
            meta, tensors = await fetch_state(
                self.net.client,
                donors,
                timeout=self.config.timeouts.sync_timeout,
                expect_run_hash=self.state.run_hash,
                vouched=vouched,
                on_refused=self._state_refused,
                on_progress=self.state.sync_progress.update,
                layout=self.outer.state_layout(),
                check=self.outer.state_problem,
            )
        finally:
            self.state.sync_progress.close()
            self.state.sync_progress = None
        await self.outer.install(meta, tensors)
        self.net.exchange.advance(self.outer.round_id)
        self.state.counters.resyncs += 1
        self.state.events.write(
            "synced", why=why, round_id=self.outer.round_id, donors=donors, seconds=time.monotonic() - started
        )
        log.info("synced state of round %d from %s (%s)", self.outer.round_id, donors, why)

    async def isolated_now(self) -> bool:
        """Read the members again: are we isolated (peers vanished without leaving, protocol/isolation.py)?"""
        await self.refresh_peers()
        return self.state.isolation.verdict == "isolated"

    async def ride_out_isolation(self) -> bool | None:
        """The isolation policy (protocol/isolation.py), before a round's matchmaking. None: go on with the
        round (connected again at this round, alone because the others left, or alone past
        timeouts.isolation_timeout with run.min_peers = 1); a bool: the round is over (the swarm moved on and we
        took its state, or we are leaving), the value as `_round`'s."""
        watch = self.state.isolation
        if watch.verdict != "isolated":
            return None
        timeouts = self.config.timeouts
        limit = timeouts.isolation_timeout
        self.state.status = Status.ISOLATED
        self.state.events.write(
            "isolated", round_id=self.outer.round_id, vanished=list(watch.vanished), timeout=limit
        )
        log.warning(
            "round %d waits: isolated from %s; reaching the swarm through the initial peers and their last "
            "addresses for up to %.0f s (timeouts.isolation_timeout)",
            self.outer.round_id,
            ", ".join(watch.vanished),
            limit,
        )
        started = time.monotonic()
        while True:
            if self.state.leave_mode is not None:
                self.outer.strategy.rollback()
                return False
            await self._reach_swarm()
            members = await self.refresh_peers()
            if watch.verdict != "isolated":
                others = [m for m in members if m.peer_id != self.state.peer_id]
                seconds = time.monotonic() - started
                self.state.events.write(
                    "rejoined",
                    round_id=self.outer.round_id,
                    peers=[m.peer_id for m in others],
                    seconds=seconds,
                )
                log.warning("rejoined the swarm after %.1f s: %d peers live", seconds, len(others))
                self.state.status = Status.EXCHANGING
                newest = max((m.round_id for m in others), default=self.outer.round_id)
                if newest > self.outer.round_id:  # the swarm went on without us: take its state
                    self.outer.strategy.rollback()
                    return await self.catch_up(newest, "rejoined after isolation")
                return None  # same round (or the others are behind and catch up to us): match with them
            waited = time.monotonic() - started
            if waited >= limit:
                if self.config.run.min_peers > 1:
                    raise AgentError(
                        f"isolated for {waited:.0f} s (timeouts.isolation_timeout={limit:g}): the peers "
                        f"{', '.join(watch.vanished)} vanished without leaving and none came back, and "
                        f"run.min_peers={self.config.run.min_peers} forbids training alone; check the network "
                        f"to the initial peers {list(self.config.network.initial_peers)}"
                    )
                self.state.events.write(
                    "continuing_alone", round_id=self.outer.round_id, vanished=list(watch.vanished)
                )
                log.warning(
                    "still isolated after %.0f s: going on alone (run.min_peers=1); peers that come back "
                    "are matched with again",
                    waited,
                )
                watch.forget()
                self.state.status = Status.EXCHANGING
                return None
            await asyncio.sleep(min(max(2 * timeouts.heartbeat, 1.0), max(limit - waited, 0.0)))

    async def _reach_swarm(self) -> None:
        """Dial the initial peers and the vanished peers' last addresses from the DHT node (bounded)."""
        from functools import partial

        from farloco.node.daemon.dhtnode import reach_peers
        from farloco.protocol import dhtcall

        maddrs = [*self.config.network.initial_peers]
        for peer in self.state.isolation.vanished:
            maddrs += [f"{m}/p2p/{peer}" if "/p2p/" not in m else m for m in self._peer_maddrs.get(peer, ())]
        if not maddrs:
            return
        try:
            answered = await dhtcall.run_in_dht(self.net.dht, partial(reach_peers, maddrs=tuple(maddrs)))
        except Exception as exc:  # unreachable is what we expect while isolated; the next pass tries again
            log.info("reaching the swarm: %s", exc or type(exc).__name__)
        else:
            log.info("reaching the swarm: %d of the peers dialled answered", answered)

    async def catch_up(
        self, target_round: int, why: str, *, wait: float | None = None, join: bool = False
    ) -> bool:
        """Fetch the swarm's state once some member has reached `target_round` (bounded wait).

        Returns whether the ranks must reload theta (False when nobody got there and we move on alone). With
        `join`, raises `SwarmGone` as soon as no other live member has trained a round: the records that made us
        wait were those of a swarm that has stopped, and the caller resumes from its own checkpoint."""
        from farloco.protocol.statesync import StateSyncError

        timeouts = self.config.timeouts
        wait = wait if wait is not None else timeouts.exchange_timeout + timeouts.match_timeout
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self.state.leave_mode is None:
            members = await self.refresh_peers()
            # A member's round: the newer of its record and what it announced over our links (MatchAt), so a
            # member record a heartbeat behind does not hold us a round longer than the swarm's own word.
            now = dht_now()
            rounds = {
                m.peer_id: self.matchmaker.round_of(m, now)
                for m in members
                if m.peer_id != self.state.peer_id
            }
            ahead = [m for m in members if rounds.get(m.peer_id, -1) >= target_round]
            if join and not ahead and not any(r > 0 for r in rounds.values()):
                raise SwarmGone(target_round)
            if ahead:
                newest = max(rounds[m.peer_id] for m in ahead)
                if await self.matchmaker.frozen_without(newest, self.state.peer_id):
                    # Round `newest` froze its group without us: with the state it started from we could only be
                    # late for it, train it for nothing and fetch again. Take the next round's state instead,
                    # once a member is there (16 nodes at load 50: a restarted node fetched two such rounds in a
                    # row and was in no round before the run ended).
                    log.info(
                        "round %d's group froze without us: waiting for round %d's state", newest, newest + 1
                    )
                    self.state.events.write("catch_up_skipped", round_id=newest, why=why)
                    target_round = newest + 1
                    await asyncio.sleep(0.2)
                    continue
                try:
                    await self.sync_from(
                        [m.address for m in ahead if rounds[m.peer_id] == newest], why, self.vouched(members)
                    )
                except StateSyncError as exc:
                    # Every donor we asked failed (the only one of the newest round died mid-transfer, say):
                    # read the members again, so the next pass asks the survivors.
                    log.warning("state sync failed (%s); looking for other donors", exc)
                    self.state.events.write("sync_failed", why=why, round_id=newest, error=str(exc))
                    await asyncio.sleep(0.5)
                    continue
                return True
            await asyncio.sleep(0.2)
        log.warning(
            "no peer reached round %d in time; moving on from round %d", target_round, self.outer.round_id
        )
        return self.advance_without_update("nobody reached the next round")

    async def check_hashes(self, group: Any) -> bool:
        """Compare our theta hash for this round with every member of our group's: the hash each declared in its
        ready record, which the leader copied into the group record, so every member decides on the same claims.
        Returns whether we resynced.

        Healing rule (every member computes the same from the same group record): the hash held by the most
        members wins; between sides of equal size, the theta with more outer steps applied (each member declares
        its count with its hash: a member that closed the round before without an update loses a 1:1 tie), then
        the side holding the lowest peer id. Every member of a losing side fetches the winning side's state before
        it contributes, so after this round the group holds one theta; a tie is healed too (two halves of a
        partition that each committed rounds alone become one). The claims are the group record's, never the
        member table or the announcements, which members see differently (a member thawed after a freeze sees the
        others' records expired). Members outside our group are not counted: their group decides for them, and
        both groups meet in a later round's group."""
        from farloco.protocol.statesync import StateSyncError

        if self.outer.round_id == 0:
            return False
        members = self.membership.core.live(dht_now())
        claims: dict[str, str] = group.hashes()
        declared = claims.get(self.state.peer_id)
        if declared is not None and declared != self.outer.outer_hash:
            # The others decide on what we declared: contributing from another theta would fork the round.
            raise StateSyncError(
                f"our ready record declared theta {declared[:12]} for round {self.outer.round_id}, "
                f"we hold {self.outer.outer_hash[:12]}"
            )
        claims[self.state.peer_id] = self.outer.outer_hash
        updates = group.updates()
        updates.setdefault(self.state.peer_id, self.outer.strategy.num_rounds)
        holders: dict[str, set[str]] = {}
        for peer_id, outer_hash in claims.items():
            holders.setdefault(outer_hash, set()).add(peer_id)
        if len(holders) <= 1:
            return False
        self.state.counters.hash_mismatches += 1
        winner = healing_winner(claims, updates)
        summary = {h[:12]: sorted(ids) for h, ids in holders.items()}
        applied = {h[:12]: max(updates.get(p, 0) for p in ids) for h, ids in holders.items()}
        self.state.events.write(
            "hash_mismatch",
            round_id=self.outer.round_id,
            ours=self.outer.outer_hash,
            winner=winner,
            votes=summary,
            steps=applied,
        )
        log.error(
            "round %d: theta_outer hashes disagree within the group: %s (outer steps applied: %s)",
            self.outer.round_id,
            summary,
            applied,
        )
        mine = version()
        others = {m.peer_id: m.version for m in members if m.peer_id in claims and m.version != mine}
        if others:
            # A release that changed theta's digest (0.2.0: the sha256 tree hash) disagrees on every hash.
            log.error(
                "round %d: peers of the group run other farloco versions than this node's %s: %s; releases "
                "whose theta digest differs never agree on a hash: upgrade every node of a run together "
                "(deploy/OPERATORS.md, Upgrade)",
                self.outer.round_id,
                mine,
                others,
            )
        if winner == self.outer.outer_hash:
            return False
        log.warning(
            "round %d: taking the state of %s (healing rule: larger side, then more outer steps, then lowest "
            "peer id)",
            self.outer.round_id,
            sorted(holders[winner]),
        )
        addresses = {m.peer_id: m.address for m in group.members}
        donors = [addresses[p] for p in sorted(holders[winner])]
        for attempt in range(3):  # a link that just healed may fail the first call (a connection that died)
            try:
                vouched = {**self.vouched(members), self.outer.round_id: {winner}}
                await self.sync_from(donors, "hash mismatch", vouched)
                return True
            except StateSyncError as exc:
                if attempt == 2:
                    raise
                log.warning("fetching the winning side's state failed (%s); trying again", exc)
                await asyncio.sleep(1.0)
        return True

    async def while_dht_daemon_lives(self, work: Awaitable[Any]) -> Any:
        """`work` (a DHT call), cut short with TimeoutError as soon as the DHT's p2pd is gone: a signal sent to
        the whole node (Slurm, systemd) ends p2pd as it starts our leave, and a DHT call would then wait out its
        whole bound for nothing."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                await asyncio.wait({task}, timeout=0.1)  # first: the work has started when we may cancel it
                if task.done():
                    return task.result()
                if not daemon_alive(self.net.dht):
                    raise TimeoutError(
                        "the DHT's daemon (p2pd) is gone: a signal to the whole node ends it too"
                    )
        finally:
            await cancel_and_wait(task, timeout=1.0)

    def advance_without_update(self, reason: str) -> bool:
        """Close round r without an outer step: theta_outer stays as it is (so every peer that closes r this way
        still agrees), and the ranks keep their weights so the missed work rolls into the next delta. Round ids
        only ever move forward, so no round's matchmaking records are ever reused."""
        self.outer.advance()
        self.net.exchange.advance(self.outer.round_id)
        log.info("round %d closed without an update (%s)", self.outer.round_id - 1, reason)
        return False

    async def _resume(self, path: Path | None) -> None:
        """Resume from our checkpoint `path` (None: the newest loadable one, if any); the exchange moves with
        the round id."""
        await self.checkpoints.resume(path)
        self.net.exchange.advance(self.outer.round_id)
