"""Matchmaking over unreliable links, sans-IO: the pure `decide` rule driven by a discrete-event simulation of what
the DHTMatchmaker driver does (push the ready record to every member, the leader pushes the group, a member that
learns it from someone relays it once, the DHT holds copies of both as the fallback), with the faults of a real
network: pushes lost, duplicated, delayed and so reordered; leaders that die after sending the group to some
members only; members that become ready just after the freeze; peers that crash and restart with the same peer id
and no memory; and clocks skewed within the stated bound (propagation + skew <= leader_timeout / 2).

Asserted every round: at most one group; every member of it that stays alive ends the round holding it; and no
live member is left out whose ready record reached the leader (by link, or by the DHT after its bounded delay)
before the leader froze the group.
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest

from farloco.protocol.matchmaking import (
    GroupRecord,
    Joined,
    Late,
    Publish,
    ReadyRecord,
    RoundView,
    decide,
    expected_digest,
)
from farloco.protocol.types import Group, GroupMember

M, L = 1.0, 0.4  # match_timeout, leader_timeout
COPY_DELAY = L / 16  # as the driver: a record's DHT copy waits this behind the pushes (at once if one failed)
DHT_DELAY = 0.095  # a DHT copy, once stored, reaches every reader within this (global time)
LINK_DELAY = 0.08  # a push that is not lost arrives within this
MEMBER_TTL = 1.5  # a dead peer's member record still says its round this long
SKEW = 0.03  # each peer's clock is off by at most this; COPY_DELAY + DHT_DELAY + 2 * SKEW < L / 2


def member(peer_id: str) -> GroupMember:
    return GroupMember(peer_id, f"10.0.0.{int(peer_id[1:])}:7000")


@dataclass
class Peer:
    name: str
    skew: float
    round_id: int = -1
    incarnation: int = 0  # a restart gets a new one: what the old process had received is gone
    dead: bool = False
    ready: dict[int, dict[str, ReadyRecord]] = field(default_factory=lambda: defaultdict(dict))
    groups: dict[int, dict[str, GroupRecord]] = field(default_factory=lambda: defaultdict(dict))
    relayed: set[int] = field(default_factory=set)

    def now(self, global_now: float) -> float:
        return global_now + self.skew


@dataclass
class Sim:
    rng: random.Random
    loss: float
    duplication: float
    peers: dict[str, Peer]
    events: list[tuple[float, int, str, str, tuple[Any, ...]]] = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)  # type: ignore[type-arg]
    # DHT copies: key -> writer -> (written at, value); each reader sees one after its own delay
    dht: dict[Any, dict[str, tuple[float, Any]]] = field(default_factory=lambda: defaultdict(dict))
    dht_delay: dict[tuple[Any, str, str], float] = field(default_factory=dict)
    pushes: int = 0
    lost: int = 0
    duplicated: int = 0

    def at(self, when: float, peer: str, kind: str, *args: Any) -> None:
        heapq.heappush(self.events, (when, next(self.seq), peer, kind, args))

    def store(self, key: Any, writer: str, value: Any, now: float) -> None:
        self.dht[key][writer] = (now, value)

    def read(self, key: Any, reader: str, now: float) -> dict[str, Any]:
        seen = {}
        for writer, (written, value) in self.dht.get(key, {}).items():
            delay = (
                0.0
                if writer == reader
                else self.dht_delay.setdefault((key, writer, reader), self.rng.uniform(0, DHT_DELAY))
            )
            if written + delay <= now:
                seen[writer] = value
        return seen

    def store_later(self, key: Any, peer: Peer, value: Any, now: float) -> None:
        """A DHT copy the way the driver makes it: COPY_DELAY after `now`, if its process is still alive then."""
        self.at(now + COPY_DELAY, peer.name, "store", key, value, peer.incarnation)

    def push(self, src: str, dst: str, kind: str, record: Any, now: float) -> bool:
        """One unary push: lost (the sender sees a failure and, as the driver, does not retry: False), or
        delivered after a random delay, sometimes twice (a retried frame the network duplicated)."""
        self.pushes += 1
        if self.rng.random() < self.loss:
            self.lost += 1
            return False
        copies = 2 if self.rng.random() < self.duplication else 1
        self.duplicated += copies - 1
        for _ in range(copies):
            self.at(
                now + self.rng.uniform(0, LINK_DELAY),
                dst,
                "deliver",
                kind,
                record,
                self.peers[dst].incarnation,
            )
        return True


@pytest.mark.parametrize("one_hop", [False, True], ids=["leader", "one-hop"])
@pytest.mark.parametrize(
    ("seed", "loss", "leader_death", "spread"),
    [
        (20261125, 0.15, 0.05, 0.6),
        (1, 0.15, 0.05, 0.6),
        (2, 0.15, 0.05, 0.6),
        (3, 0.35, 0.3, 0.6),
        (4, 0.35, 0.3, 0.6),
        (5, 0.15, 0.05, 0.1),
    ],
)
def test_one_group_per_round_and_nobody_ready_in_time_left_out_over_lossy_links(
    seed: int, loss: float, leader_death: float, spread: float, one_hop: bool
) -> None:
    """`one_hop`: ready records declare the members their peer expects (as the driver does), so rounds whose
    members all agree and are ready within L/2 of each other freeze in one hop; without, every group goes through
    a leader. `spread`: how far apart the peers' local work ends (the straggler p4 aside)."""
    rng = random.Random(seed)
    names = [f"p{i}" for i in range(5)]
    sim = Sim(rng, loss=loss, duplication=0.1, peers={n: Peer(n, rng.uniform(-SKEW, SKEW)) for n in names})
    num_rounds = 400
    outcomes: dict[int, dict[str, Any]] = defaultdict(dict)
    ready_written: dict[tuple[str, int], float] = {}  # global time each peer's ready record went out
    published: dict[int, list[tuple[float, Group]]] = defaultdict(list)  # round -> (global time, group) each
    died_in: dict[int, set[str]] = defaultdict(set)
    died_at: dict[str, float] = {}  # the last death of each peer (global time)
    partial_sends = 0
    just_after_freeze = 0
    one_hop_groups = 0

    def swarm_round(now: float) -> int:
        return max((p.round_id for p in sim.peers.values() if not p.dead), default=0)

    def start(peer: Peer, round_id: int, now: float) -> None:
        if round_id >= num_rounds:
            return
        peer.round_id = round_id
        sim.store(("members", round_id), peer.name, True, now)  # its record says this round
        work = rng.uniform(0.3, 0.3 + spread)
        if peer.name == "p4" and rng.random() < 0.3:
            work = rng.uniform(0.9, 1.6)  # a straggler: sometimes ready just after the freeze
        if rng.random() < 0.04:
            sim.at(now + work + rng.uniform(-0.2, M + 2 * L), peer.name, "crash", round_id)
        sim.at(now + work, peer.name, "ready", round_id)

    def view_of(peer: Peer, round_id: int, now: float) -> RoundView:
        ready = {**{r.peer_id: r for r in sim.read(("ready", round_id), peer.name, now).values()}}
        ready.update(peer.ready[round_id])
        groups = list(sim.read(("group", round_id), peer.name, now).values())
        groups += [g for g in peer.groups[round_id].values() if g.leader in ready]
        expected = frozenset(
            name for name in sim.read(("members", round_id), peer.name, now) if record_lives(name, now)
        )
        ahead = frozenset(
            name
            for r in range(round_id + 1, round_id + 3)
            for name in sim.read(("members", r), peer.name, now)
            if record_lives(name, now)
        )
        return RoundView(
            now=peer.now(now), ready=ready, groups=groups, expected=expected | {peer.name}, ahead=ahead
        )

    def finish(peer: Peer, round_id: int, now: float, outcome: Any) -> None:
        outcomes[round_id][peer.name] = outcome
        nxt = round_id + 1 if outcome != "late" else max(round_id + 1, swarm_round(now))
        start(peer, nxt, now)

    def step(peer: Peer, round_id: int, now: float) -> None:
        """The driver's loop body: decide on what this peer has seen, act on it."""
        if peer.dead or peer.round_id != round_id or peer.name in outcomes[round_id]:
            return
        mine = peer.ready[round_id].get(peer.name)
        if mine is None:
            return
        view = view_of(peer, round_id, now)
        decision = decide(round_id, member(peer.name), view, match_timeout=M, leader_timeout=L)
        if isinstance(decision, Joined) and decision.one_hop:
            assert decision.record is not None
            nonlocal one_hop_groups
            if not published[round_id] or decision.group not in {g for _, g in published[round_id]}:
                one_hop_groups += 1
                published[round_id].append((now, decision.group))
            if peer.name in [m.peer_id for m in decision.group.members[:2]]:
                # as the driver: its two lowest peer ids push it to the others COPY_DELAY later (when they derived
                # it themselves) and keep a DHT copy for peers the records missed
                if not any(g.group == decision.group for g in view.groups):
                    for m in decision.group.members:
                        if m.peer_id not in (peer.name, decision.record.leader):
                            sim.at(
                                now + COPY_DELAY,
                                peer.name,
                                "relay",
                                m.peer_id,
                                decision.record,
                                peer.incarnation,
                            )
                sim.store_later(("group", round_id), peer, decision.record, now)
            finish(peer, round_id, now, decision.group)
        elif isinstance(decision, Joined):
            chosen = min(view.groups, key=lambda g: g.leader)
            if chosen.leader != peer.name and round_id not in peer.relayed:
                # Relay it once to the other members, and keep a DHT copy under our own key: if the leader died
                # after reaching only us and our relays are lost, the next candidate still sees the group in
                # the DHT before its window opens, instead of freezing a second one.
                peer.relayed.add(round_id)
                for m in chosen.group.members:
                    if m.peer_id not in (peer.name, chosen.leader):
                        sim.push(peer.name, m.peer_id, "group", chosen, now)
                sim.store_later(("group", round_id), peer, chosen, now)
            finish(peer, round_id, now, decision.group)
        elif isinstance(decision, Publish):
            nonlocal partial_sends
            record = decision.record
            others = [m.peer_id for m in record.group.members if m.peer_id != peer.name]
            dies = rng.random() < leader_death and others
            reach = others[: rng.randrange(len(others))] if dies else others
            for other in reach:
                sim.push(peer.name, other, "group", record, now)
            published[round_id].append((now, record.group))
            if dies:  # the leader dies after sending to some members only, before its DHT copy
                partial_sends += 1
                crash(peer, round_id, now)
                return
            sim.store(("group", round_id), peer.name, record, now)
            peer.groups[round_id][peer.name] = record
            finish(peer, round_id, now, record.group)
        elif isinstance(decision, Late):
            finish(peer, round_id, now, "late")
        else:
            # wake at the deadline, or at the next poll of the DHT (pushes wake it on arrival); a nanosecond past
            # the deadline, or `now + skew` rounds to just before it and the peer waits at the same instant forever
            sim.at(
                min(now + rng.uniform(0.02, 0.06), decision.until - peer.skew + 1e-9),
                peer.name,
                "poll",
                round_id,
            )

    def record_lives(name: str, now: float) -> bool:
        """Nobody knows a peer died until its member record expires, MEMBER_TTL after its last heartbeat."""
        return now < died_at.get(name, float("inf")) + MEMBER_TTL

    def crash(peer: Peer, round_id: int, now: float) -> None:
        peer.dead = True
        died_at[peer.name] = now
        died_in[round_id].add(peer.name)
        outcomes[round_id].setdefault(peer.name, "dead")
        sim.at(now + rng.uniform(0.2, 1.0), peer.name, "restart", round_id)

    for peer in sim.peers.values():
        start(peer, 0, 0.0)
    while sim.events:
        now, _, name, kind, args = heapq.heappop(sim.events)
        peer = sim.peers[name]
        if kind == "restart":
            # Same peer id, new process: nothing it had received survives; it joins the swarm's round.
            sim.peers[name] = peer = Peer(name, peer.skew, incarnation=peer.incarnation + 1)
            died_at.pop(name, None)  # its new record is live
            start(peer, max(args[0] + 1, swarm_round(now)), now)
            continue
        if peer.dead:
            continue
        if kind == "crash":
            (round_id,) = args
            if peer.round_id == round_id and name not in outcomes[round_id]:
                crash(peer, round_id, now)
            continue
        if kind == "ready":
            (round_id,) = args
            if peer.round_id != round_id:
                continue
            declared = ""
            if one_hop:
                expected = view_of(peer, round_id, now).expected | {name}
                declared = expected_digest(expected) if len(expected) >= 2 else ""
            record = ReadyRecord(name, member(name).address, round_id, peer.now(now), expected=declared)
            peer.ready[round_id][name] = record
            ready_written[name, round_id] = now
            if published[round_id] and published[round_id][0][0] < now:
                just_after_freeze += 1
            delivered = [
                sim.push(name, other, "ready", record, now)
                for other in sim.peers
                if other != name and not sim.peers[other].dead
            ]
            if all(delivered):
                sim.store_later(("ready", round_id), peer, record, now)
            else:  # a push failed: the copy goes at once, for the peer it missed
                sim.store(("ready", round_id), name, record, now)
            step(peer, round_id, now)
        elif kind == "store":
            key, value, incarnation = args
            if incarnation == peer.incarnation:
                sim.store(key, name, value, now)
        elif kind == "relay":
            dst, record, incarnation = args
            if incarnation == peer.incarnation:
                sim.push(name, dst, "group", record, now)
        elif kind == "deliver":
            what, record, incarnation = args
            if incarnation != peer.incarnation:
                continue  # addressed to the process that crashed
            round_id = record.round_id if what == "ready" else record.group.round_id
            if what == "ready":
                peer.ready[round_id][record.peer_id] = record
            else:
                peer.groups[round_id][record.leader] = record
            step(peer, round_id, now)
        else:  # poll
            step(peer, args[0], now)

    # ---- what must hold -----------------------------------------------------------------------------------
    assert sorted(outcomes) == list(range(num_rounds))
    sizes, left_behind = [], 0
    for round_id, by_peer in outcomes.items():
        groups = {o for o in by_peer.values() if isinstance(o, Group)}
        assert len(groups) <= 1, f"round {round_id}: two groups: {by_peer}"
        if not groups:
            continue  # nobody alive holds a group (e.g. its leader died before reaching anyone): all late
        (group,) = groups
        frozen_at = min(t for t, g in published[round_id] if g == group)
        names_in = {m.peer_id for m in group.members}
        sizes.append(len(names_in))
        for name in names_in:  # every member that stayed alive ends the round with the group
            if name not in died_in[round_id]:
                assert by_peer.get(name) == group, (
                    f"round {round_id}: member {name} ended with {by_peer.get(name)}"
                )
        for name in sim.peers:  # nobody whose ready record reached the leader in time is left out
            written = ready_written.get((name, round_id))
            reached = None if written is None else written + COPY_DELAY + DHT_DELAY  # every peer, by the DHT
            if reached is not None and reached <= frozen_at and name not in died_in[round_id]:
                assert name in names_in, (
                    f"round {round_id}: {name} ready at {written:.3f}, frozen {frozen_at:.3f}"
                )
            elif written is not None and name not in names_in and name not in died_in[round_id]:
                left_behind += 1
    print(
        f"pushes={sim.pushes} lost={sim.lost} duplicated={sim.duplicated} partial_sends={partial_sends} "
        f"just_after_freeze={just_after_freeze} left_behind={left_behind} mean size={statistics.mean(sizes):.2f} "
        f"one_hop_groups={one_hop_groups}"
    )
    # The scenario exercised what it claims to.
    assert sim.lost > 200 and sim.duplicated > 100 and just_after_freeze >= 10
    assert partial_sends >= (1 if one_hop else 5)  # leaders only lead the rounds one hop did not settle
    if not one_hop:
        assert one_hop_groups == 0
    else:  # rounds ready within L/2 of their opening freeze in one hop; the rest through a leader
        assert one_hop_groups >= (num_rounds // 3 if spread < L / 2 else 5)
    assert statistics.mean(sizes) >= 3.5
