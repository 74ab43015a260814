"""The matchmaking rule, sans-IO: what one peer sees of a round (`RoundView`), the round's schedule (opening,
freeze deadline, the leader candidates' windows), `decide` (wait, publish the group, joined, late), and the
straggler wait a peer proposes from the round's own arrival statistics. Pure functions of an injected `now` and
the records seen: the package docstring says why every peer reaches the same group."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from farloco.protocol.matchmaking.records import GroupRecord, ReadyRecord, expected_digest
from farloco.protocol.types import NO_INBOUND, Group, GroupMember


@dataclass(frozen=True)
class RoundView:
    """What one peer sees of round r at `now`.

    `ready`: ready records of the round by peer id; `groups`: group records of the round whose leader's
    ownership was checked; `expected`: peer ids of live members whose record says this round and that are not
    leaving; `ahead`: live members whose record says a later round (they left this round, so its group may
    already exist); `leaving`: peer ids whose member record says 'leaving' (never waited for, never grouped);
    `catching_up`: the members of `expected` that are there because their record says they are fetching the
    swarm's state (`syncing`, at this round or behind): waited for like the others, but one that misses the
    freeze says nothing about how long stragglers need (no `StragglerWait` sample); `left_before_us`: members
    that were past this round already when our ready record was made (a member moves past a round once its
    group froze, and a group holds only members whose ready records came before it froze, so none of those
    groups holds us).
    """

    now: float
    ready: Mapping[str, ReadyRecord]
    groups: Sequence[GroupRecord]
    expected: frozenset[str]
    ahead: frozenset[str] = frozenset()
    leaving: frozenset[str] = frozenset()
    catching_up: frozenset[str] = frozenset()
    left_before_us: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Wait:
    """Nothing to do yet; look again (re-read the DHT) no later than `until`."""

    until: float


@dataclass(frozen=True)
class Publish:
    """We lead: store this group record; once stored, the group is ours."""

    record: GroupRecord


@dataclass(frozen=True)
class Joined:
    """The round's group, with us in it: `record` is the group record it came from (a leader's, or the one
    every member derives alike from a one-hop freeze, `one_hop` then True)."""

    group: Group
    record: GroupRecord | None = None
    one_hop: bool = False


@dataclass(frozen=True)
class Late:
    """We are not in round r's group (`group_formed`), or none formed: raise LateForRound with `reason`."""

    reason: str
    group_formed: bool = False


Decision = Wait | Publish | Joined | Late


@dataclass(frozen=True)
class RoundSchedule:
    """The deadlines of a round, derived from its ready records (equal on every peer that sees them)."""

    opened: float
    freeze_at: float
    candidates: tuple[str, ...]  # eligible peers, by peer id: rank 0 leads, rank k takes over k-th
    leader_timeout: float

    def window(self, rank: int) -> tuple[float, float]:
        """[start, end) during which candidate `rank` may publish a group (rank 0 may also freeze early)."""
        start = self.freeze_at + rank * self.leader_timeout
        return (-math.inf if rank == 0 else start), start + self.leader_timeout / 2

    @property
    def one_hop_until(self) -> float:
        """The last ready_at of a set that freezes in one hop (`one_hop_sets`): half a leader timeout after the
        opening."""
        return self.opened + self.leader_timeout / 2

    @property
    def give_up_at(self) -> float:
        """After this, no candidate may publish any more: peers still without a group are late."""
        return self.freeze_at + len(self.candidates) * self.leader_timeout


def schedule(view: RoundView, *, match_timeout: float, leader_timeout: float) -> RoundSchedule:
    """Deadlines and candidate ranking of the round `view` describes (it must hold a ready record).

    The straggler wait is the one proposed by the record that opened the round (earliest ready_at, then lowest
    peer id), capped at `match_timeout`; a record proposing none (0) waits `match_timeout`. Every peer that
    sees the opening record computes the same freeze deadline, whatever its own estimate."""
    if not view.ready:
        raise ValueError("a round schedule needs at least one ready record (our own), got none")
    opener = min(view.ready.values(), key=lambda record: (record.ready_at, record.peer_id))
    opened = opener.ready_at
    wait = min(opener.wait, match_timeout) if opener.wait > 0 else match_timeout
    # Never below leader_timeout: the agreement argument needs every record that is in time for the candidate
    # cutoff (leader_timeout/2 before the freeze) to reach every peer before the freeze. A 2 s wait with a 5 s
    # leader_timeout left the opener its only candidate, and peers that had not seen the opener's record yet
    # each led a group of their own (8 peers on 2 cores, 0.1 s rounds: 21 of 81 rounds with two groups).
    wait = max(wait, min(leader_timeout, match_timeout))
    cutoff = opened + max(wait - leader_timeout / 2, 0.0)
    candidates = tuple(
        sorted(
            peer_id
            for peer_id, record in view.ready.items()
            # A member behind NAT cannot lead: nobody could push it a ready record.
            if record.ready_at <= cutoff and peer_id not in view.leaving and record.address != NO_INBOUND
        )
    )
    return RoundSchedule(opened, opened + wait, candidates, leader_timeout)


def one_hop_sets(ready: Mapping[str, ReadyRecord], plan: RoundSchedule) -> list[frozenset[str]]:
    """The sets of peers that froze in one hop: every peer of the set declared the same expected set, that set
    is exactly them (its digest matches), and the last of them was ready by `plan.one_hop_until`.

    A function of the ready records alone, so every peer that holds them all reaches the same set, member or
    not; sets are disjoint (a record declares one digest, and a set always holds its declarer)."""
    declared: dict[str, list[str]] = defaultdict(list)
    for peer_id, record in ready.items():
        if record.expected:
            declared[record.expected].append(peer_id)
    sets = []
    for digest, peers in declared.items():
        if (
            len(peers) >= 2  # a declared set is never of one peer alone (the driver declares none then)
            and str(len(peers)) == digest.split(":", 1)[0]
            and expected_digest(peers) == digest
            and max(ready[p].ready_at for p in peers) <= plan.one_hop_until
        ):
            sets.append(frozenset(peers))
    return sets


def _one_hop_record(round_id: int, peers: frozenset[str], ready: Mapping[str, ReadyRecord]) -> GroupRecord:
    """The group record of a one-hop freeze, equal on every peer: its lowest peer id as the leader, frozen at its
    last ready_at."""
    members = [
        GroupMember(ready[p].peer_id, ready[p].address, ready[p].outer_hash, ready[p].updates) for p in peers
    ]
    return GroupRecord(min(peers), Group.make(round_id, members), max(ready[p].ready_at for p in peers))


def decide(
    round_id: int, me: GroupMember, view: RoundView, *, match_timeout: float, leader_timeout: float
) -> Decision:
    """The matchmaking rule (module docstring) for peer `me` in round `round_id`, given what it sees."""
    if not match_timeout > 0 or not leader_timeout > 0:
        raise ValueError(
            f"match_timeout and leader_timeout must be > 0, got {match_timeout} and {leader_timeout}"
        )
    if me.peer_id not in view.ready:
        raise ValueError(
            f"peer {me.peer_id} must see its own ready record for round {round_id} before deciding"
        )
    plan = schedule(view, match_timeout=match_timeout, leader_timeout=leader_timeout)
    # The one-hop freeze needs every record in time for it to reach every peer before any candidate may
    # publish: at least `leader_timeout` from the opening, so `match_timeout` must not be shorter.
    one_hop = bool(view.ready[me.peer_id].expected) and match_timeout >= leader_timeout
    if one_hop:
        sets = one_hop_sets(view.ready, plan)
        for peers in sets:
            if me.peer_id in peers:
                record = _one_hop_record(round_id, peers, view.ready)
                return Joined(record.group, record, one_hop=True)
        if sets:
            peers = min(sets, key=min)
            return Late(
                f"round {round_id} froze in one hop with {len(peers)} members "
                f"({', '.join(sorted(peers))}), not including us",
                group_formed=True,
            )
    groups = [record for record in view.groups if record.group.round_id == round_id]
    if groups:
        chosen = min(groups, key=lambda record: record.leader)
        if me.peer_id in {m.peer_id for m in chosen.group.members}:
            return Joined(chosen.group, chosen)
        return Late(
            f"round {round_id} was frozen by {chosen.leader} with {len(chosen.group.members)} members "
            f"({', '.join(m.peer_id for m in chosen.group.members)}), not including us",
            group_formed=True,
        )

    # Every other member we know of had left this round before we were ready for it (a node that joined the
    # round while fetching the state it started from, and found it over once its first inner steps were done):
    # no group of it can hold us, so we are late now rather than at give_up_at.
    others = (view.expected | view.ready.keys() | view.ahead) - {me.peer_id}
    if view.left_before_us and not others - view.left_before_us:
        return Late(
            f"round {round_id}: every other member had left it before we were ready: "
            f"{len(view.left_before_us)} member(s) are past it ({', '.join(sorted(view.left_before_us))})",
            group_formed=True,
        )
    now = view.now
    if me.peer_id in plan.candidates:
        rank = plan.candidates.index(me.peer_id)
        start, end = plan.window(rank)
        if one_hop and rank == 0 and now < plan.opened + leader_timeout:
            # A one-hop freeze of other peers may still be under way: its records reach us by then (never past
            # the freeze deadline: with match_timeout >= leader_timeout the wait is at least leader_timeout).
            return Wait(plan.opened + leader_timeout)
        if rank == 0 and now < plan.freeze_at:
            # A member already past this round means a group may exist that we cannot see yet: no early
            # freeze then, the deadline (or that group's record) settles it.
            everyone_ready = (
                me.peer_id in view.expected and view.expected <= view.ready.keys() and not view.ahead
            )
            if not everyone_ready:
                return Wait(plan.freeze_at)
        if start <= now < end:
            skipped = set(plan.candidates[:rank])
            members = [
                GroupMember(record.peer_id, record.address, record.outer_hash, record.updates)
                for record in view.ready.values()
                if record.peer_id not in skipped and record.peer_id not in view.leaving
            ]
            return Publish(GroupRecord(me.peer_id, Group.make(round_id, members), now))
        if now < start:
            return Wait(start)
    if now >= plan.give_up_at:
        reason = (
            f"no group was published for round {round_id} by any of its {len(plan.candidates)} leader "
            f"candidates ({', '.join(plan.candidates)}) before {plan.give_up_at:.3f}"
        )
        if view.ahead:
            # Members past this round left it: its group formed without us and its record is gone (a DHT copy
            # outlives a round by little), or nobody's theta changed; either way their state is the one to take.
            return Late(
                f"{reason}, and {len(view.ahead)} member(s) are past it ({', '.join(sorted(view.ahead))})",
                group_formed=True,
            )
        return Late(reason)
    return Wait(plan.give_up_at)


@dataclass
class StragglerWait:
    """The straggler wait a peer proposes in its ready records, from the round's own arrival statistics.

    Each formed group gives one sample: how long after the round opened its last member was ready (the ready
    spread), or, when a member we expected was not ready in time, the wait that round used (a censored sample:
    the straggler needed more). The proposal is `factor` times the `quantile` of the last `window` samples,
    bounded below by `floor` (`timeouts.match_timeout_min`) and above by `ceiling` (`timeouts.match_timeout`);
    until `min_samples` rounds are seen it is the ceiling. So fast rounds are not held for a timeout sized for
    slow links, a member that is merely slow raises the wait within a round or two (each censored sample at
    least doubles it, up to the ceiling), and a dead member costs at most the wait (or its record's expiry).
    """

    floor: float
    ceiling: float
    window: int = 32
    min_samples: int = 5
    quantile: float = 0.9
    factor: float = 2.0
    samples: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.ceiling:
            raise ValueError(
                f"need 0 < match_timeout_min <= match_timeout, got {self.floor} and {self.ceiling}"
            )

    def observe(self, spread: float) -> None:
        self.samples.append(max(0.0, float(spread)))
        del self.samples[: -self.window]

    def wait(self) -> float:
        if len(self.samples) < self.min_samples:
            return self.ceiling
        ordered = sorted(self.samples)
        q = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
        return min(self.ceiling, max(self.floor, self.factor * q))


def spread_sample(group: Group, view: RoundView, plan: RoundSchedule) -> float:
    """One `StragglerWait` sample from a formed group and the view it was decided on (see there)."""
    members = {m.peer_id for m in group.members}
    if (
        view.expected - view.catching_up - members
    ):  # someone we waited for missed the freeze: too short a wait
        return plan.freeze_at - plan.opened
    times = [view.ready[p].ready_at for p in members if p in view.ready]
    return max(times, default=plan.opened) - plan.opened
