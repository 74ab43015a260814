"""Round matchmaking: the sans-IO rule with hand-set times, a 500-round simulation, and a real 3-peer DHT."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
import statistics
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from helpers.dht import CONFIG, dht_nodes, dht_swarm, rec  # noqa: F401  (dht_nodes, dht_swarm: fixtures)

from farloco.protocol.matchmaking import (
    GroupRecord,
    Joined,
    Late,
    LateForRound,
    Publish,
    ReadyRecord,
    RoundView,
    StragglerWait,
    Wait,
    decide,
    expected_digest,
    one_hop_sets,
    parse_groups,
    parse_ready,
    schedule,
    spread_sample,
)
from farloco.protocol.membership import MemberRecord, Membership
from farloco.protocol.types import Group, GroupMember

M, L = 1.0, 0.4  # match_timeout, leader_timeout


def member(peer_id: str) -> GroupMember:
    return GroupMember(peer_id, f"127.0.0.1:{1000 + int(peer_id[1:])}")


def ready(peer_id: str, at: float, round_id: int = 7) -> ReadyRecord:
    return ReadyRecord(peer_id, member(peer_id).address, round_id, at)


def view(
    now: float, ready_at: dict[str, float], expected: set[str], groups: list[GroupRecord] = ()
) -> RoundView:  # type: ignore[assignment]
    return RoundView(
        now=now,
        ready={p: ready(p, t) for p, t in ready_at.items()},
        groups=list(groups),
        expected=frozenset(expected),
    )


def run(peer_id: str, v: RoundView) -> Any:
    return decide(7, member(peer_id), v, match_timeout=M, leader_timeout=L)


# ------------------------------------------------------------------------------ the adaptive straggler wait


def test_the_opening_record_sets_the_freeze_for_everyone_capped_at_match_timeout() -> None:
    records = {
        "p1": ReadyRecord("p1", "a:1", 7, 10.0, wait=0.5),
        "p2": ReadyRecord("p2", "a:2", 7, 10.1, wait=0.9),
    }
    plan = schedule(RoundView(10.2, records, [], frozenset()), match_timeout=M, leader_timeout=L)
    assert plan.freeze_at == pytest.approx(10.5)  # p1 opened the round: its 0.5 s, not p2's 0.9 s
    # Never below leader_timeout: records in time for the candidate cutoff must reach everyone by the freeze.
    records["p1"] = ReadyRecord("p1", "a:1", 7, 10.0, wait=0.1)
    plan = schedule(RoundView(10.2, records, [], frozenset()), match_timeout=M, leader_timeout=L)
    assert plan.freeze_at == pytest.approx(10.0 + L)
    # A peer that has not seen p1's record yet would open at p2 and freeze later; it cannot act before it
    # sees p1's (pushed at once), which is the leader_timeout/2 propagation bound of the module docstring.
    records["p1"] = ReadyRecord("p1", "a:1", 7, 10.0, wait=50.0)
    plan = schedule(RoundView(10.2, records, [], frozenset()), match_timeout=M, leader_timeout=L)
    assert plan.freeze_at == pytest.approx(10.0 + M)  # never past match_timeout
    records["p1"] = ReadyRecord("p1", "a:1", 7, 10.0)  # no proposal: match_timeout
    assert (
        schedule(RoundView(10.2, records, [], frozenset()), match_timeout=M, leader_timeout=L).freeze_at
        == 11.0
    )


def test_a_straggler_within_the_adaptive_wait_is_grouped_and_one_past_it_is_late() -> None:
    wait = 0.5
    records = {
        p: ReadyRecord(p, member(p).address, 7, t, wait=wait) for p, t in {"p1": 0.0, "p2": 0.1}.items()
    }
    everyone = frozenset({"p1", "p2", "p3"})
    assert isinstance(
        decide(7, member("p1"), RoundView(0.3, records, [], everyone), match_timeout=M, leader_timeout=L),
        Wait,
    )
    late_straggler = decide(
        7, member("p1"), RoundView(0.5, records, [], everyone), match_timeout=M, leader_timeout=L
    )
    assert isinstance(late_straggler, Publish)
    assert [m.peer_id for m in late_straggler.record.group.members] == ["p1", "p2"]
    records["p3"] = ReadyRecord("p3", member("p3").address, 7, 0.45, wait=wait)
    in_time = decide(
        7, member("p1"), RoundView(0.46, records, [], everyone), match_timeout=M, leader_timeout=L
    )
    assert isinstance(in_time, Publish) and len(in_time.record.group.members) == 3  # early freeze: all ready


def test_the_wait_follows_recent_spreads_and_a_missed_member_raises_it_at_once() -> None:
    wait = StragglerWait(floor=0.5, ceiling=30.0)
    assert wait.wait() == 30.0  # too few rounds seen: the configured match_timeout
    for spread in [0.1, 0.2, 0.15, 0.1, 0.05]:
        wait.observe(spread)
    assert wait.wait() == 0.5  # fast, even rounds: the floor, not 30 s
    for spread in [2.0, 2.5, 3.0, 2.0, 2.2, 2.4, 2.8, 2.1, 2.6, 3.0]:  # one peer is now ~3 s slower
        wait.observe(spread)
    assert 5.0 <= wait.wait() <= 6.0  # about twice the 90th percentile: the slow member is waited for
    for _ in range(40):
        wait.observe(20.0)
    assert wait.wait() == 30.0  # capped
    with pytest.raises(ValueError, match="match_timeout_min <= match_timeout"):
        StragglerWait(floor=40.0, ceiling=30.0)


def test_a_spread_sample_is_the_last_member_ready_or_the_wait_when_someone_expected_missed_it() -> None:
    records = {
        p: ReadyRecord(p, member(p).address, 7, t, wait=1.0) for p, t in {"p1": 5.0, "p2": 5.4}.items()
    }
    group = Group.make(7, [member("p1"), member("p2")])
    full = RoundView(5.5, records, [], frozenset({"p1", "p2"}))
    assert spread_sample(group, full, schedule(full, match_timeout=M, leader_timeout=L)) == pytest.approx(0.4)
    missed = RoundView(6.0, records, [], frozenset({"p1", "p2", "p3"}))
    assert spread_sample(group, missed, schedule(missed, match_timeout=M, leader_timeout=L)) == pytest.approx(
        1.0
    )
    # p3 was waited for because it fetches the swarm's state: its absence says nothing about stragglers
    syncing = RoundView(6.0, records, [], frozenset({"p1", "p2", "p3"}), catching_up=frozenset({"p3"}))
    assert spread_sample(
        group, syncing, schedule(syncing, match_timeout=M, leader_timeout=L)
    ) == pytest.approx(0.4)


def test_ready_records_refuse_a_bad_wait() -> None:
    wire = ReadyRecord("p1", "a:1", 7, 1.0, wait=2.0).to_wire()
    assert ReadyRecord.from_wire(wire).wait == 2.0
    for bad in (-1.0, float("nan"), 1e9, 3):
        with pytest.raises(ValueError, match=r"ready record.wait: expected a float in \[0, 86400\]"):
            ReadyRecord.from_wire(dict(wire, wait=bad))


def test_ready_records_carry_a_theta_hash_and_its_outer_steps_and_refuse_bad_ones() -> None:
    wire = ReadyRecord("p1", "a:1", 7, 1.0, outer_hash="ab" * 32, updates=6).to_wire()
    parsed = ReadyRecord.from_wire(wire)
    assert parsed.outer_hash == "ab" * 32 and parsed.updates == 6
    for bad in ("XYZ", "a" * 129, 5, None):
        with pytest.raises(ValueError, match=r"ready record.outer_hash: expected a lowercase hex str"):
            ReadyRecord.from_wire(dict(wire, outer_hash=bad))
    for bad in (-1, 1.5, True, "6", None, 1 << 60):
        with pytest.raises(ValueError, match=r"ready record.updates: expected an int in \[0, "):
            ReadyRecord.from_wire(dict(wire, updates=bad))
    # a record of 0.1, without updates
    with pytest.raises(ValueError, match=r"ready record: expected fields .*missing \['updates'\]"):
        ReadyRecord.from_wire({k: v for k, v in wire.items() if k != "updates"})


def test_the_group_record_carries_each_members_declared_hash() -> None:
    """The leader copies every member's declared theta hash into the group: the hash check of every member then
    decides on the same claims (a partial view of the others' hashes once forked a round)."""
    hashes = {"p1": "aa", "p2": "bb", "p3": "aa"}
    steps = {"p1": 5, "p2": 4, "p3": 5}
    records = {
        p: ReadyRecord(p, member(p).address, 7, t, outer_hash=hashes[p], updates=steps[p])
        for p, t in {"p1": 10.0, "p2": 10.01, "p3": 10.02}.items()
    }
    seen = RoundView(now=10.03, ready=records, groups=[], expected=frozenset(records))
    decision = decide(7, member("p1"), seen, match_timeout=M, leader_timeout=L)
    assert isinstance(decision, Publish)
    assert decision.record.group.hashes() == hashes and decision.record.group.updates() == steps
    parsed = GroupRecord.from_wire(decision.record.to_wire())
    assert parsed == decision.record and parsed.group.hashes() == hashes and parsed.group.updates() == steps
    # the same members with other hashes, or other steps, are another group (so no two members can act on
    # different claims)
    other = Group.make(7, [GroupMember(p, member(p).address, "cc", steps[p]) for p in hashes])
    assert other.group_id != decision.record.group.group_id
    fewer = Group.make(7, [GroupMember(p, member(p).address, hashes[p], 4) for p in hashes])
    assert fewer.group_id != decision.record.group.group_id
    # a member entry without its hash or steps, or with a bad one, is refused
    wire = decision.record.to_wire()
    for entry in (["p1", "a:1"], ["p1", "a:1", "aa"], ["p1", "a:1", "not hex", 5]):
        with pytest.raises(ValueError, match="outer_hash"):
            GroupRecord.from_wire({**wire, "members": [entry]})
    with pytest.raises(ValueError, match=r"group record.members\[0\].updates: expected an int in \[0, "):
        GroupRecord.from_wire({**wire, "members": [["p1", "a:1", "aa", -1]]})


# --------------------------------------------------------------------------------------------- the rule


def test_all_ready_leader_publishes_at_once_and_followers_join_its_group() -> None:
    everyone = {"p1": 10.0, "p2": 10.01, "p3": 10.02}
    decision = run("p1", view(10.03, everyone, set(everyone)))
    assert isinstance(decision, Publish)
    assert [m.peer_id for m in decision.record.group.members] == ["p1", "p2", "p3"]
    assert decision.record.group == Group.make(7, [member(p) for p in everyone])
    # a follower's next deadline is its own takeover window; it joins as soon as the record is visible
    assert run("p2", view(10.03, everyone, set(everyone))) == Wait(10.0 + M + L)
    joined = run("p3", view(10.05, everyone, set(everyone), [decision.record]))
    assert joined == Joined(decision.record.group, decision.record)


def test_leader_waits_for_expected_member_then_freezes_without_it_and_it_is_late() -> None:
    seen = {"p1": 10.0, "p2": 10.2}
    assert run("p1", view(10.5, seen, {"p1", "p2", "p3"})) == Wait(10.0 + M)
    decision = run("p1", view(11.0, seen, {"p1", "p2", "p3"}))
    assert isinstance(decision, Publish)
    assert [m.peer_id for m in decision.record.group.members] == ["p1", "p2"]
    late = run("p3", view(11.3, {**seen, "p3": 11.25}, {"p1", "p2", "p3"}, [decision.record]))
    assert isinstance(late, Late) and "not including us" in late.reason


def test_early_freeze_needs_our_own_member_record_in_the_round() -> None:
    # An empty or stale member table must not let a leader freeze alone.
    assert run("p1", view(10.1, {"p1": 10.0}, set())) == Wait(10.0 + M)


def test_no_early_freeze_while_a_member_is_already_past_the_round() -> None:
    # p0's record says round 8: it finished round 7 in a group we cannot see yet, so we must not freeze alone.
    everyone = {"p1": 10.0, "p2": 10.0}
    v = RoundView(
        10.1, {p: ready(p, t) for p, t in everyone.items()}, [], frozenset(everyone), frozenset({"p0"})
    )
    assert run("p1", v) == Wait(10.0 + M)


def test_dead_leader_is_replaced_by_next_candidate_after_leader_timeout() -> None:
    seen = {"p1": 10.0, "p2": 10.1, "p3": 10.2}
    expected = {"p1", "p2", "p3", "p4"}  # p4 never comes, so nobody freezes early
    freeze = 10.0 + M
    assert run("p2", view(freeze + L / 2, seen, expected)) == Wait(freeze + L)
    takeover = run("p2", view(freeze + L + 0.01, seen, expected))
    assert isinstance(takeover, Publish)
    assert [m.peer_id for m in takeover.record.group.members] == ["p2", "p3"]  # the silent leader is dropped
    assert run("p3", view(freeze + L + 0.01, seen, expected)) == Wait(freeze + 2 * L)
    # the old leader, waking up after its window, does not publish a competing group
    assert isinstance(run("p1", view(freeze + L / 2 + 0.01, seen, expected)), Wait)
    assert run("p1", view(freeze + L + 0.1, seen, expected, [takeover.record])) == Late(
        "round 7 was frozen by p2 with 2 members (p2, p3), not including us", group_formed=True
    )


def test_group_from_lower_leader_wins() -> None:
    seen = {"p1": 10.0, "p2": 10.0, "p3": 10.0}
    low = GroupRecord("p1", Group.make(7, [member("p1"), member("p3")]), 11.0)
    high = GroupRecord("p2", Group.make(7, [member("p2"), member("p3")]), 11.4)
    assert run("p3", view(11.5, seen, set(seen), [high, low])) == Joined(low.group, low)
    assert isinstance(run("p2", view(11.5, seen, set(seen), [high, low])), Late)


def test_late_comers_are_not_candidates_and_give_up_when_no_group_forms() -> None:
    seen = {"p1": 10.0, "p9": 10.0 + M - L / 4}  # p9 arrived after the eligibility cutoff
    expected = {"p1", "p9", "p5"}
    assert run("p9", view(10.0 + M + 0.1, seen, expected)) == Wait(10.0 + M + L)
    gave_up = run("p9", view(10.0 + M + L, seen, expected))
    assert isinstance(gave_up, Late) and "no group was published" in gave_up.reason
    assert not gave_up.group_formed  # nobody's theta changed: everyone moves on with the same one


def test_a_peer_that_finds_no_group_while_others_are_past_the_round_takes_their_state() -> None:
    """Back from a stall longer than the group record lives: no record of the round's group any more, but
    members whose record says a later round left it, so a group formed without us (or none did and their theta
    is ours): late with group_formed, which takes their state, never an advance on our own theta."""
    seen = {"p1": 10.0, "p9": 10.0 + M - L / 4}
    stale = replace(view(10.0 + M + L, seen, {"p9"}), ahead=frozenset({"p1", "p5"}))
    gave_up = run("p9", stale)
    assert isinstance(gave_up, Late) and gave_up.group_formed
    assert "2 member(s) are past it (p1, p5)" in gave_up.reason


def test_a_peer_ready_after_every_other_member_left_the_round_is_late_at_once() -> None:
    """A node that joined round 7 while fetching the state it started from, and was ready for it only after
    every other member had moved past it (their records or announcements said round 8 when its ready record was
    made): no group of round 7 can hold it, so it is late at once (taking the swarm's state), not a match timeout
    later (the round opened, as it sees it, with its own ready record: the others' are not read here)."""
    seen = {"p9": 30.0}
    past = frozenset({"p1", "p2"})
    assert isinstance(run("p9", replace(view(30.01, seen, {"p9"}), ahead=past)), Wait)  # without it: the wait
    joiner = replace(view(30.01, seen, {"p9"}), ahead=past, left_before_us=past)
    late = run("p9", joiner)
    assert isinstance(late, Late) and late.group_formed
    assert (
        "every other member had left it before we were ready: 2 member(s) are past it (p1, p2)" in late.reason
    )
    # A member that was still in the round when we were ready may group with us: we wait as before.
    assert isinstance(run("p9", replace(joiner, expected=frozenset({"p9", "p3"}))), Wait)
    # Members that left only after we were ready may have frozen a group holding us: its record settles it.
    assert isinstance(run("p9", replace(joiner, left_before_us=frozenset({"p1"}))), Wait)


# ------------------------------------------------------------------------------------------- the one-hop freeze


def declaring(ready_at: dict[str, float], declared: dict[str, set[str]]) -> dict[str, ReadyRecord]:
    """Ready records where peer p declares the expected set `declared[p]` (none where absent)."""
    return {
        p: ReadyRecord(
            p, member(p).address, 7, t, expected=expected_digest(declared[p]) if p in declared else ""
        )
        for p, t in ready_at.items()
    }


def test_a_set_that_all_declared_itself_is_the_group_on_every_peer_and_the_others_are_late() -> None:
    everyone = {"p1", "p2", "p3"}
    at = {"p1": 10.0, "p2": 10.05, "p3": 10.1, "p4": 10.12}  # p4 joined after the others declared
    records = declaring(at, {"p1": everyone, "p2": everyone, "p3": everyone, "p4": everyone | {"p4"}})
    v = RoundView(10.11, records, [], frozenset(everyone | {"p4"}))
    decisions = {p: run(p, v) for p in everyone}
    # no leader in between: each member derives the same group record (leader: its lowest id) from the records
    assert all(isinstance(d, Joined) and d.one_hop for d in decisions.values())
    assert len({d.record for d in decisions.values()}) == 1
    record = decisions["p2"].record
    assert record.leader == "p1" and record.frozen_at == 10.1
    assert [m.peer_id for m in record.group.members] == ["p1", "p2", "p3"]
    assert GroupRecord.from_wire(record.to_wire()) == record  # the DHT copy each member keeps decodes
    late = run("p4", v)
    assert late == Late(
        "round 7 froze in one hop with 3 members (p1, p2, p3), not including us", group_formed=True
    )
    # a set that is not complete yet: the members wait (p3's record still in flight)
    partial = {p: r for p, r in records.items() if p != "p3"}
    assert isinstance(run("p1", RoundView(10.11, partial, [], frozenset(everyone))), Wait)


def test_a_set_whose_last_member_was_ready_past_half_a_leader_timeout_goes_through_the_leader() -> None:
    everyone = {"p1", "p2", "p3"}
    at = {"p1": 10.0, "p2": 10.05, "p3": 10.0 + L / 2 + 0.01}
    records = declaring(at, {p: everyone for p in everyone})
    plan = schedule(RoundView(10.3, records, [], frozenset(everyone)), match_timeout=M, leader_timeout=L)
    assert one_hop_sets(records, plan) == []
    # everyone expected is ready, but the leader freezes only from opening + leader_timeout: a one-hop set of
    # others would have reached it by then
    assert run("p1", RoundView(10.3, records, [], frozenset(everyone))) == Wait(10.0 + L)
    led = run("p1", RoundView(10.0 + L, records, [], frozenset(everyone)))
    assert isinstance(led, Publish) and len(led.record.group.members) == 3


def test_peers_that_declare_different_sets_or_themselves_alone_never_freeze_in_one_hop() -> None:
    at = {"p1": 10.0, "p2": 10.01, "p3": 10.02}
    # p3 did not see p1 yet: no set is complete, so the leader decides (at opening + leader_timeout)
    records = declaring(at, {"p1": {"p1", "p2", "p3"}, "p2": {"p1", "p2", "p3"}, "p3": {"p2", "p3"}})
    v = RoundView(10.05, records, [], frozenset(at))
    assert one_hop_sets(records, schedule(v, match_timeout=M, leader_timeout=L)) == []
    assert run("p2", v) == Wait(10.0 + M + L) and run("p1", v) == Wait(10.0 + L)
    # a record declaring a set of its peer alone (the driver never does) makes nobody else late
    alone = declaring(at, {"p1": {"p1"}, "p2": {"p1", "p2", "p3"}, "p3": {"p1", "p2", "p3"}})
    v = RoundView(10.05, alone, [], frozenset(at))
    assert one_hop_sets(alone, schedule(v, match_timeout=M, leader_timeout=L)) == []
    # with a match_timeout shorter than the leader timeout no record reaches every peer in time for it
    records = declaring(at, {p: set(at) for p in at})
    v = RoundView(10.05, records, [], frozenset(at))
    short = decide(7, member("p1"), v, match_timeout=L / 2, leader_timeout=L)
    assert isinstance(short, Publish) and short.record.leader == "p1"


def test_ready_records_declare_their_expected_set_or_none() -> None:
    digest = expected_digest({"p2", "p1", "p3"})
    assert digest == expected_digest(["p3", "p1", "p2"]) and digest.startswith("3:")
    wire = ReadyRecord("p1", "a:1", 7, 1.0, expected=digest).to_wire()
    assert ReadyRecord.from_wire(wire).expected == digest
    # a record without one (a peer that expects nobody else) decodes with ""
    bare = ReadyRecord("p1", "a:1", 7, 1.0).to_wire()
    assert "expected" not in bare and ReadyRecord.from_wire(bare).expected == ""
    for bad in ("3:" + "g" * 32, "0:" + "a" * 32, "5000:" + "a" * 32, "3:" + "a" * 31, 3, None):
        with pytest.raises(ValueError, match=r"ready record.expected: expected "):
            ReadyRecord.from_wire(dict(wire, expected=bad))
    with pytest.raises(ValueError, match="1 to 4096 peers, got 0"):
        expected_digest([])


def test_decide_refuses_a_view_without_our_ready_record() -> None:
    with pytest.raises(ValueError, match="own ready record"):
        run("p2", view(10.0, {"p1": 10.0}, {"p1"}))


# --------------------------------------------------------------------------------------------- records


def test_group_record_round_trips_and_rejects_a_forged_group_id() -> None:
    record = GroupRecord("p1", Group.make(3, [member("p2"), member("p1")]), 5.0)
    assert GroupRecord.from_wire(record.to_wire()) == record
    forged = {**record.to_wire(), "group_id": "00" * 32}
    with pytest.raises(ValueError, match="group_id: expected the group id of its round and members"):
        GroupRecord.from_wire(forged)
    with pytest.raises(ValueError, match="leader: expected one of its members, got 'p7'"):
        GroupRecord.from_wire({**record.to_wire(), "leader": "p7"})
    with pytest.raises(ValueError, match="fields"):
        GroupRecord.from_wire({"leader": "p1"})


def test_ready_records_with_disputed_owner_and_groups_from_non_owners_are_ignored() -> None:
    raw = {
        b"k1": ready("p1", 1.0).to_wire(),
        b"k2": ready("p2", 1.0).to_wire(),
        b"k3": ready("p2", 1.1).to_wire(),
    }
    raw[b"bad"] = {"peer_id": 5}
    records, owners = parse_ready(raw, 7)
    assert set(records) == {"p1"} and owners == {"p1": b"k1"}
    group = GroupRecord("p1", Group.make(7, [member("p1")]), 2.0)
    assert parse_groups({b"k1": group.to_wire()}, 7, owners) == [group]
    assert parse_groups({b"k9": group.to_wire()}, 7, owners) == []  # stored by someone else than p1's key
    # A member other than the leader may keep a copy under its own key; a non-member may not.
    records, owners = parse_ready({b"k1": ready("p1", 1.0).to_wire(), b"k2": ready("p2", 1.0).to_wire()}, 7)
    pair = GroupRecord("p1", Group.make(7, [member("p1"), member("p2")]), 2.0)
    assert parse_groups({b"k2": pair.to_wire()}, 7, owners) == [pair]
    assert parse_groups({b"k2": group.to_wire()}, 7, owners) == []  # p2 is not in p1's group of one


# --------------------------------------------------------------------------------------------- simulation


@dataclass
class SimDHT:
    """Writes reach each reader after its own random delay (at most `max_delay`); a writer sees its own at once."""

    rng: random.Random
    max_delay: float
    writes: dict[Any, dict[str, list[tuple[float, Any, dict[str, float]]]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )

    def write(self, key: Any, writer: str, value: Any, now: float) -> None:
        self.writes[key][writer].append((now, value, {}))

    def read(self, key: Any, reader: str, now: float) -> dict[str, Any]:
        seen = {}
        for writer, history in self.writes.get(key, {}).items():
            for written_at, value, delays in reversed(history):
                if writer != reader and reader not in delays:
                    delays[reader] = self.rng.uniform(0, self.max_delay)
                if written_at + (0.0 if writer == reader else delays[reader]) <= now:
                    seen[writer] = value
                    break
        return seen


def record_of(peer_id: str, round_id: int, now: float) -> MemberRecord:
    return MemberRecord(
        peer_id=peer_id, address=member(peer_id).address, state="training", round_id=round_id, inner_step=0,
        slot=0, run_hash="h", run_config={}, outer_hash="", loss=0.0, heartbeat=now, maddrs=(), version="t",
    )  # fmt: skip


def test_simulated_swarm_agrees_on_every_group_for_500_rounds() -> None:
    """4 peers, random work times, message delays up to 0.15 s (< leader_timeout/2), random deaths of
    leaders and others, and one slow peer that is often late. Every round must end for every live peer, and
    all peers that end a round with a group hold the same group."""
    rng = random.Random(20251122)
    dht = SimDHT(rng, max_delay=0.15)
    peers = ["p0", "p1", "p2", "p3"]
    slow_peer = "p2"
    num_rounds = 500
    events: list[tuple[float, int, str, str, int]] = []  # (time, seq, peer, kind, round)
    seq = itertools.count()
    death_at: dict[tuple[str, int], float] = {}
    ready_at: dict[tuple[str, int], float] = {}
    outcomes: dict[int, dict[str, Any]] = defaultdict(dict)
    ends: list[float] = []

    def start_round(peer: str, round_id: int, now: float) -> None:
        if round_id >= num_rounds:
            return
        dht.write("members", peer, record_of(peer, round_id, now), now)
        # local work of the round; it starts when the member record moves to the round (>= 2x max delay)
        work = rng.uniform(0.35, 2.6 if peer == slow_peer else 0.9)
        ready_at[peer, round_id] = now + work
        # the lowest peer id leads most rounds, so it dies most often; others die now and then too
        if rng.random() < (0.25 if peer == "p0" else 0.06):
            death_at[peer, round_id] = now + work + rng.uniform(-0.2, M + 2 * L)
        heapq.heappush(events, (now + work, next(seq), peer, "ready", round_id))

    def swarm_round(peer: str, now: float) -> int:
        return max((r.round_id for r in dht.read("members", peer, now).values()), default=0)

    def finish(peer: str, round_id: int, now: float, outcome: Any) -> None:
        outcomes[round_id][peer] = outcome
        ends.append(now - ready_at[peer, round_id])
        # a late peer catches up with the swarm (as the agent does after a resync) instead of trailing it
        start_round(
            peer, round_id + 1 if outcome != "late" else max(round_id + 1, swarm_round(peer, now)), now
        )

    for peer in peers:
        start_round(peer, 0, 0.0)
    steps = 0
    while events:
        now, _, peer, kind, round_id = heapq.heappop(events)
        dead_at = death_at.get((peer, round_id))
        if dead_at is not None and now >= dead_at:
            outcomes[round_id][peer] = "dead"
            # a crashed peer restarts and joins the next round after a short outage
            heapq.heappush(
                events, (dead_at + rng.uniform(0.2, 1.0), next(seq), peer, "restart", round_id + 1)
            )
            death_at.pop((peer, round_id))
            continue
        if kind == "restart":
            start_round(peer, max(round_id, swarm_round(peer, now)), now)
            continue
        if kind == "ready":
            dht.write(("ready", round_id), peer, ready(peer, now, round_id), now)
        steps += 1
        table = Membership("h", {}, ttl=30.0)
        for writer, record in dht.read("members", peer, now).items():
            table.observe(writer.encode(), record)
        records = dht.read(("ready", round_id), peer, now)
        v = RoundView(
            now=now,
            ready={r.peer_id: r for r in records.values()},
            groups=list(dht.read(("group", round_id), peer, now).values()),
            expected=frozenset(r.peer_id for r in table.in_round(round_id, now)),
            ahead=frozenset(r.peer_id for r in table.live(now) if r.round_id > round_id),
        )
        decision = decide(round_id, member(peer), v, match_timeout=M, leader_timeout=L)
        if isinstance(decision, Publish):
            dht.write(("group", round_id), peer, decision.record, now)
            finish(peer, round_id, now, decision.record.group)
        elif isinstance(decision, Joined):
            finish(peer, round_id, now, decision.group)
        elif isinstance(decision, Late):
            finish(peer, round_id, now, "late")
        else:
            poll = rng.uniform(0.02, 0.08)
            heapq.heappush(events, (min(now + poll, decision.until), next(seq), peer, "poll", round_id))

    assert sorted(outcomes) == list(range(num_rounds))
    sizes, takeovers, lates, deaths = [], 0, 0, 0
    for round_id, by_peer in outcomes.items():
        groups = {o for o in by_peer.values() if isinstance(o, Group)}
        assert len(groups) <= 1, f"round {round_id}: peers disagree: {by_peer}"
        for peer, outcome in by_peer.items():
            if isinstance(outcome, Group):
                assert peer in {m.peer_id for m in outcome.members}
        if groups:
            (group,) = groups
            sizes.append(len(group.members))
            # everyone in the group was ready for the round; no live member of it was left without the group
            assert all((m.peer_id, round_id) in ready_at for m in group.members)
            for m in group.members:
                assert by_peer.get(m.peer_id) in (group, "dead"), f"round {round_id}: {m.peer_id} {by_peer}"
            ready_this_round = [p for p in peers if (p, round_id) in ready_at]
            takeovers += min(m.peer_id for m in group.members) != min(ready_this_round)
        lates += sum(o == "late" for o in by_peer.values())
        deaths += sum(o == "dead" for o in by_peer.values())
    # no deadlock: every peer that stayed alive ended its round within the last takeover window
    assert max(ends) <= M + 4 * L + 0.2
    # the scenario exercised what it claims to, and most rounds still gathered most of the swarm
    print(f"takeovers={takeovers} lates={lates} deaths={deaths} mean size={statistics.mean(sizes):.2f}")
    assert takeovers >= 10 and lates >= 50 and deaths >= 50, (takeovers, lates, deaths)
    assert statistics.mean(sizes) >= 2.5, statistics.mean(sizes)
    assert steps > 0


# --------------------------------------------------------------------------------------------- real DHT


@pytest.mark.dht
def test_a_dht_that_never_answers_ends_matchmaking_with_an_error(
    dht_swarm: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hivemind future that never resolves: a read or a store gives MatchmakingError (the agent catches up
    from the others) after DHT_CALL_TIMEOUT real seconds, instead of holding the round forever."""
    import concurrent.futures

    import farloco.protocol.dhtcall as dhtcall_module
    from farloco.protocol.matchmaking import DHTMatchmaker, MatchmakingError

    (peer,) = dht_swarm(1)
    monkeypatch.setattr(dhtcall_module, "DHT_CALL_TIMEOUT", 0.3)

    async def main() -> None:
        maker = DHTMatchmaker(peer.dht, "mm", peer.membership, poll_interval=0.1)
        await peer.membership.publish(peer.record(7))
        stored: concurrent.futures.Future[bool] = concurrent.futures.Future()
        stored.set_result(True)
        with monkeypatch.context() as patch:
            patch.setattr(peer.dht, "get", lambda *args, **kwargs: concurrent.futures.Future())
            # Only the reads hang: a real store under a 0.3 s bound could itself time out on a loaded machine
            # (then the error is the store's, which the second half checks).
            patch.setattr(peer.dht, "store", lambda *args, **kwargs: stored)
            started = time.perf_counter()
            with pytest.raises(MatchmakingError, match="did not answer a read"):
                await asyncio.wait_for(
                    maker.form_group(7, peer.me, match_timeout=5.0, leader_timeout=2.0), 10
                )
            assert time.perf_counter() - started < 3.0
        with monkeypatch.context() as patch:
            patch.setattr(peer.dht, "store", lambda *args, **kwargs: concurrent.futures.Future())
            with pytest.raises(MatchmakingError, match="refused our ready record for round 8"):
                await asyncio.wait_for(
                    maker.form_group(8, peer.me, match_timeout=5.0, leader_timeout=2.0), 15
                )

    asyncio.run(main())


@pytest.mark.dht
def test_three_peers_form_groups_on_a_real_dht(dht_swarm: Any) -> None:  # noqa: F811
    """3 DHT peers on 127.0.0.1, all ready at once, a few rounds; then a round where one peer is late."""
    from farloco.protocol.matchmaking import DHTMatchmaker

    peers = dht_swarm(3)

    async def main() -> list[float]:
        makers = [DHTMatchmaker(p.dht, "mm", p.membership, poll_interval=0.1) for p in peers]
        durations = []
        for round_id in range(4):
            for p in peers:
                await p.membership.publish(p.record(round_id))
            started = time.perf_counter()
            groups = await asyncio.gather(
                *(
                    mk.form_group(round_id, p.me, match_timeout=5.0, leader_timeout=2.0)
                    for mk, p in zip(makers, peers, strict=True)
                )
            )
            durations.append(time.perf_counter() - started)
            assert len({g.group_id for g in groups}) == 1
            assert [m.peer_id for m in groups[0].members] == sorted(p.me.peer_id for p in peers)

        # round 4: the third peer arrives after the freeze and is told it is late
        for p in peers:
            await p.membership.publish(p.record(4))
        on_time = asyncio.gather(
            *(
                mk.form_group(4, p.me, match_timeout=1.0, leader_timeout=1.0)
                for mk, p in zip(makers[:2], peers[:2], strict=True)
            )
        )
        await asyncio.sleep(1.6)  # past the freeze (1.0 s after the first ready record)
        with pytest.raises(LateForRound):
            await makers[2].form_group(4, peers[2].me, match_timeout=1.0, leader_timeout=1.0)
        two = await on_time
        assert len({g.group_id for g in two}) == 1 and len(two[0].members) == 2
        # What a node catching up asks before fetching a round's state: round 4 froze without the third peer
        # (it may read that from any peer's DHT), with the first two; round 5 has no group yet.
        left_out, member = peers[2].me.peer_id, peers[0].me.peer_id
        assert await makers[2].frozen_without(4, left_out)
        assert await makers[1].frozen_without(4, left_out)
        assert not await makers[0].frozen_without(4, member)
        assert not await makers[2].frozen_without(5, left_out)
        return durations

    durations = asyncio.run(main())
    print(f"group formation with 3 ready peers: {[f'{d * 1e3:.0f} ms' for d in durations]}")
    assert statistics.median(durations) < 1.0


@pytest.mark.dht
def test_a_member_fetching_the_swarms_state_is_waited_for_with_the_whole_match_timeout(
    dht_swarm: Any,  # noqa: F811
) -> None:
    """A member whose record says `syncing` at an older round is catching up to the swarm: the ready peers do
    not freeze early without it, they propose the whole match_timeout (not their adaptive wait), and once it
    is ready in time it is in the group; its absence is no straggler sample."""
    from farloco.protocol.matchmaking import DHTMatchmaker

    a, b, c = dht_swarm(3)

    async def main() -> None:
        makers = [DHTMatchmaker(p.dht, "mm", p.membership, poll_interval=0.1) for p in (a, b, c)]
        for mk in makers[:2]:
            mk.straggler = StragglerWait(0.5, 3.0)
            for _ in range(5):
                mk.straggler.observe(0.05)  # fast, even rounds: the adaptive wait is its floor, 0.5 s
        await c.membership.publish(c.record(17, state="syncing"))
        for p in (a, b):
            await p.membership.publish(p.record(20))
        for p in (a, b, c):
            await p.membership.refresh()
        started = time.perf_counter()
        kwargs = {"match_timeout": 3.0, "leader_timeout": 0.5, "match_timeout_min": 0.5}
        pair = asyncio.gather(
            *(mk.form_group(20, p.me, **kwargs) for mk, p in zip(makers[:2], (a, b), strict=True))
        )
        await asyncio.sleep(1.5)  # c's transfer ends, it installs round 20 and does its first inner steps
        await c.membership.publish(c.record(20))
        group = await makers[2].form_group(20, c.me, **kwargs)
        elapsed = time.perf_counter() - started
        assert sorted(m.peer_id for m in group.members) == sorted(p.me.peer_id for p in (a, b, c))
        assert {g.group_id for g in await pair} == {group.group_id}
        assert elapsed < 3.0, elapsed  # frozen early once c was ready, not at the deadline
        assert all(mk.last_wait == 3.0 for mk in makers[:2])  # what a and b proposed: the whole match_timeout
        assert all(mk.straggler is not None and max(mk.straggler.samples) < 2.0 for mk in makers[:2])

    asyncio.run(main())


@contextlib.asynccontextmanager
async def linked(peers: Sequence[Any]) -> AsyncIterator[tuple[list[Any], list[GroupMember]]]:
    """The peers' matchmakers with gRPC links (a server and a client each, on 127.0.0.1) and each one's group
    member at its server's address; every link closed after."""
    from farloco.protocol.auth import Authenticator
    from farloco.protocol.matchmaking import DHTMatchmaker
    from farloco.protocol.rpc import RpcClient, RpcServer

    links = []
    for p in peers:
        auth = Authenticator("mm:h1", b"secret", p.me.peer_id)
        links.append((RpcServer(auth, host="127.0.0.1"), RpcClient(auth)))
    makers = [
        DHTMatchmaker(p.dht, "mm", p.membership, poll_interval=0.1, server=server, client=client)
        for p, (server, client) in zip(peers, links, strict=True)
    ]
    try:
        addresses = [await server.start() for server, _ in links]
        yield makers, [GroupMember(p.me.peer_id, a) for p, a in zip(peers, addresses, strict=True)]
    finally:
        for mk in makers:
            await mk.close()
        for server, client in links:
            await client.close()
            await server.stop(0)


@pytest.mark.dht
def test_linked_peers_form_their_group_while_their_dht_reads_hang(
    dht_swarm: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two members with gRPC links whose DHT reads never answer (a stalled DHT process): every member they expect
    is ready over the links and declared the same set, so both freeze in one hop, without waiting for a DHT read
    that never comes."""
    import concurrent.futures

    a, b = dht_swarm(2)

    async def main() -> None:
        async with linked((a, b)) as (makers, mes):
            for p, me in zip((a, b), mes, strict=True):
                await p.membership.publish(rec(me.peer_id, round_id=30, address=me.address))
            for p in (a, b):
                await p.membership.refresh()
                monkeypatch.setattr(p.dht, "get", lambda *args, **kwargs: concurrent.futures.Future())
            started = time.perf_counter()
            groups = await asyncio.gather(
                *(
                    mk.form_group(30, me, match_timeout=5.0, leader_timeout=2.0)
                    for mk, me in zip(makers, mes, strict=True)
                )
            )
            elapsed = time.perf_counter() - started
        assert len({g.group_id for g in groups}) == 1
        assert sorted(m.peer_id for m in groups[0].members) == sorted(me.peer_id for me in mes)
        assert elapsed < 2.0, elapsed  # early: the freeze deadline is 5 s away
        assert [mk.counters["one_hop"] for mk in makers] == [1, 1]
        # What the round event reports: in one hop, known within the round's time of the last ready record.
        assert all(mk.last_one_hop for mk in makers)
        freezes = [mk.last_freeze_seconds for mk in makers]
        assert all(f is not None and 0.0 <= f <= elapsed for f in freezes), (freezes, elapsed)

    asyncio.run(main())


@pytest.mark.dht
def test_a_ready_records_dht_copy_waits_behind_the_pushes_unless_a_push_fails(
    dht_swarm: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The DHT copy of a linked peer's ready record goes `copy_delay` after the record, so its store is not on the
    cores the round's pushes need while it freezes: two members freeze in one hop first, each copy then stored.
    When a push fails (a third member whose address refuses), the copy goes at once, for the member it missed."""
    import socket

    a, b, c = dht_swarm(3)
    delay = 0.6  # at most leader_timeout / 16 = 0.625 here

    async def main() -> None:
        async with linked((a, b)) as (makers, mes):
            stored: dict[int, list[float]] = {0: [], 1: []}
            for i, mk in enumerate(makers):
                mk.copy_delay_max = delay
                real = mk._store_ready

                async def timed(key: str, mine: Any, expiration: float, i: int = i, real: Any = real) -> bool:
                    stored[i].append(time.perf_counter())
                    return bool(await real(key, mine, expiration))

                monkeypatch.setattr(mk, "_store_ready", timed)
            for p, me in zip((a, b), mes, strict=True):
                await p.membership.publish(rec(me.peer_id, round_id=50, address=me.address))
            # c's record of an earlier test names a server long gone: a push to it would fail (part two)
            await c.membership.publish(rec(c.me.peer_id, round_id=50, state="leaving"))
            for p in (a, b):
                await p.membership.refresh()
            started = time.perf_counter()
            groups = await asyncio.gather(
                *(
                    mk.form_group(50, me, match_timeout=20.0, leader_timeout=10.0)
                    for mk, me in zip(makers, mes, strict=True)
                )
            )
            known = time.perf_counter()
            assert len({g.group_id for g in groups}) == 1 and len(groups[0].members) == 2
            assert stored == {0: [], 1: []}, "a copy was stored before the round froze"
            assert known - started < delay
            await asyncio.sleep(delay + 1.0)
            assert all(len(times) == 1 and times[0] - started >= delay for times in stored.values()), stored

            # A member whose address refuses: our push to it fails, and our copy goes at once.
            with socket.socket() as closed:
                closed.bind(("127.0.0.1", 0))
                refusing = f"127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
                await a.membership.publish(rec(mes[0].peer_id, round_id=51, address=mes[0].address))
                await c.membership.publish(rec(c.me.peer_id, round_id=51, address=refusing))
                await a.membership.refresh()
                assert c.me.peer_id in {r.peer_id for r in a.membership.core.live(a.membership.clock.now())}
                started = time.perf_counter()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        makers[0].form_group(51, mes[0], match_timeout=20.0, leader_timeout=10.0), delay
                    )
            assert len(stored[0]) == 2 and stored[0][1] - started < delay / 2, (stored[0], started)
            assert makers[0].counters["pushes_failed"] >= 1

    asyncio.run(main())


@pytest.mark.dht
def test_a_ready_record_the_links_missed_is_read_near_the_round_key_without_a_walk(
    dht_swarm: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Linked peers whose membership stores near its key store their round records near the round's keys too,
    and a pushed-to peer's polls read those replicas (`dhtcall.get_near`) instead of walking the DHT: with every
    push from b lost and a's walks never answering (its `dht.get` hangs), a still reads b's ready record, and
    both freeze the same group in one hop."""
    import concurrent.futures

    a, b = dht_swarm(2, replan_every=8.0)

    async def lost(*args: Any, **kwargs: Any) -> bool:
        return False

    async def main() -> None:
        async with linked((a, b)) as (makers, mes):
            for p, me in zip((a, b), mes, strict=True):
                await p.membership.publish(rec(me.peer_id, round_id=40, address=me.address))
            for p in (a, b):
                await p.membership.refresh()
            monkeypatch.setattr(makers[1], "_push", lost)
            monkeypatch.setattr(a.dht, "get", lambda *args, **kwargs: concurrent.futures.Future())
            groups = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        mk.form_group(40, me, match_timeout=5.0, leader_timeout=2.0)
                        for mk, me in zip(makers, mes, strict=True)
                    )
                ),
                15,
            )
        assert len({g.group_id for g in groups}) == 1
        assert sorted(m.peer_id for m in groups[0].members) == sorted(me.peer_id for me in mes)
        assert [mk.counters["one_hop"] for mk in makers] == [1, 1]

    asyncio.run(main())


@pytest.mark.dht
def test_records_of_a_foreign_dht_node_are_ignored_and_counted(dht_nodes: Any) -> None:  # noqa: F811
    """A real DHT node with its own signing key but without the run secret writes a member record of our
    run_hash, a ready record and a group record naming itself leader: the members never see it, and
    form their group without it (early, not at the freeze deadline), and count what they ignored."""
    from hivemind.utils.timed_storage import get_dht_time

    from farloco.protocol.auth import Authenticator
    from farloco.protocol.matchmaking import DHTMatchmaker, round_key
    from farloco.protocol.membership import DHTMembership, members_key

    (dht_a, key_a), (dht_b, key_b), (dht_x, key_x) = dht_nodes
    peers = []
    for dht, key in ((dht_a, key_a), (dht_b, key_b)):
        peer_id = str(dht.peer_id)
        auth = Authenticator("foreign:h1", b"run secret", peer_id)
        membership = DHTMembership(dht, "foreign", "h1", CONFIG, public_key=key, auth=auth)
        peers.append((membership, GroupMember(peer_id, f"127.0.0.1:{7100 + len(peers)}")))
    (mem_a, me_a), (mem_b, me_b) = peers
    fake_id = str(dht_x.peer_id)
    wrong = Authenticator("foreign:h1", b"guessed secret", fake_id)

    async def main() -> list[Group]:
        for membership, me in peers:
            await membership.publish(rec(me.peer_id, round_id=0, address=me.address))
        expiration = get_dht_time() + 60
        writes = [
            (members_key("foreign"), rec(fake_id, heartbeat=get_dht_time(), proof=wrong.member_proof(fake_id, key_x)).to_wire()),
            (round_key("foreign", 0), ReadyRecord(fake_id, "127.0.0.1:9", 0, get_dht_time()).to_wire()),
            (
                f"{round_key('foreign', 0)}/group",
                GroupRecord(fake_id, Group.make(0, [GroupMember(fake_id, "127.0.0.1:9"), me_a]), get_dht_time()).to_wire(),
            ),
        ]  # fmt: skip
        for key, value in writes:
            # the foreign node's own validators sign these: the DHT accepts them, only farloco can refuse them
            # (retried as the daemon's stores are: on a loaded machine no replica may answer the first try)
            for attempt in range(6):
                if await dht_x.store(key, value, expiration, subkey=key_x, return_future=True):
                    break
                await asyncio.sleep(0.25 * 2**attempt)
            else:
                raise AssertionError(f"no DHT node accepted the forged entry under {key} in 6 tries")
        makers = [DHTMatchmaker(m.dht, "foreign", m, poll_interval=0.1) for m, _ in peers]
        started = time.perf_counter()
        groups = await asyncio.gather(
            *(mk.form_group(0, me, match_timeout=20.0, leader_timeout=2.0) for mk, (_, me) in zip(makers, peers, strict=True))
        )  # fmt: skip
        # every member was ready and the fake one is not expected: the leader froze early, not after 20 s
        assert time.perf_counter() - started < 10.0
        assert sorted(r.peer_id for r in await mem_b.members()) == sorted([me_a.peer_id, me_b.peer_id])
        return list(groups)

    groups = asyncio.run(main())
    assert len({g.group_id for g in groups}) == 1
    assert [m.peer_id for m in groups[0].members] == sorted([me_a.peer_id, me_b.peer_id])
    for membership in (mem_a, mem_b):
        assert membership.core.ignored["BAD_MEMBER_PROOF"] == 1, membership.core.ignored
        # its ready record (and, for whoever read it, its group record) came from a key that owns no member
        assert membership.core.ignored["NOT_A_MEMBER"] >= 1, membership.core.ignored


KNOCK_SECRET = b"0123456789abcdef0123"


async def knocking_maker() -> tuple[Any, Any, Any]:
    """(clock, matchmaker of p0 with a real client, p1's started server: a running node that answers a knock's
    authenticated call), on a fake clock, for the knock tests."""
    from farloco.protocol.auth import Authenticator
    from farloco.protocol.matchmaking import DHTMatchmaker
    from farloco.protocol.membership import DHTMembership
    from farloco.protocol.rpc import RpcClient, RpcServer
    from farloco.util.clock import FakeClock

    clock = FakeClock(1000.0)
    auth = Authenticator("mm:h", KNOCK_SECRET, "p0")
    membership = DHTMembership(None, "mm", "h", {}, clock=clock, public_key=b"p0")
    maker = DHTMatchmaker(None, "mm", membership, clock=clock, server=RpcServer(auth), client=RpcClient(auth))
    alive = RpcServer(Authenticator("mm:h", KNOCK_SECRET, "p1"))
    await alive.start()
    return clock, maker, alive


def test_a_vanished_member_that_answers_is_knocked_at_less_and_less_often() -> None:
    """A member of the last group whose record lapsed but which answers the knock (alive: records lapse under
    load) is knocked at again after 2, 4, 8, 8 ... seconds (KNOCK_BACKOFF_STEPS), not every second: on an overloaded
    swarm every member would knock at every other each second. Once it stops answering (it crashed) the next
    knock says so, and a member whose record is back starts afresh."""
    from farloco.protocol.matchmaking.driver import KNOCK_BACKOFF_STEPS, KNOCK_EVERY

    async def main() -> None:
        clock, maker, alive = await knocking_maker()
        maker._last_group = (4, {"p0": "127.0.0.1:1", "p1": alive.address})
        knocks: list[float] = []
        try:
            started = clock.now()
            for _ in range(8 * 2**KNOCK_BACKOFF_STEPS):  # 4 * cap seconds in steps of KNOCK_EVERY / 2
                maker._knock_vanished(5, [], clock.now(), "p0")
                if maker._background:
                    knocks.append(clock.now() - started)
                while maker._background:
                    await asyncio.sleep(0.01)
                assert maker._knocked["p1"][1] == "", "an answering member is waited for"
                clock.advance(KNOCK_EVERY / 2)
            gaps = [b - a for a, b in itertools.pairwise(knocks)]
            cap = KNOCK_EVERY * 2**KNOCK_BACKOFF_STEPS
            expected = [KNOCK_EVERY * 2**k for k in range(1, KNOCK_BACKOFF_STEPS)]
            assert gaps[: len(expected)] == expected and set(gaps[len(expected) :]) == {cap}, gaps
            assert len(gaps) > len(expected) + 1, gaps
            await alive.stop(0)  # it crashes: the next knock finds its address refusing connections
            clock.advance(cap)
            maker._knock_vanished(5, [], clock.now(), "p0")
            while maker._background:
                await asyncio.sleep(0.01)
            assert maker._knocked["p1"][1:] == ("refused", 0)
            # its record back, then gone again: knocked at once, at the first interval
            maker._knock_vanished(5, [record_of("p1", 5, clock.now())], clock.now(), "p0")
            assert "p1" not in maker._knocked
        finally:
            await maker.close()
            await alive.stop(0)

    asyncio.run(main())


def test_a_vanished_member_that_refuses_connections_or_answers_no_call_is_not_waited_for() -> None:
    """A member of the last group whose record expired is still expected (DHT reads lag under load) unless its
    address refuses connections (no process there: it crashed) or it answers no authenticated call (a frozen
    process: its kernel still accepts the connect; or a dead host, or a partition) while the rest of the group is
    a strict majority; a member that answers stays expected, and so do silent ones when the rest is no majority
    (a partition's sides must not both stop waiting). A member whose record is back is expected again."""
    import socket

    async def main() -> None:
        clock, maker, alive = await knocking_maker()  # p1 (alive): a running node, answers the knock's call
        alive_address = alive.address

        accepted: list[asyncio.StreamWriter] = []

        async def frozen_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)
            await reader.read()  # accepts, never answers: what a SIGSTOPped node's kernel does
            writer.close()

        frozen = [await asyncio.start_server(frozen_handler, "127.0.0.1", 0) for _ in range(2)]
        with socket.socket() as closed:  # a port nothing listens on (bound, then released)
            closed.bind(("127.0.0.1", 0))
            dead = closed.getsockname()[1]
        members = {
            "p0": "127.0.0.1:1",
            "p1": alive_address,
            "p2": f"127.0.0.1:{dead}",
            "p3": f"127.0.0.1:{frozen[0].sockets[0].getsockname()[1]}",
        }

        async def knock(group: dict[str, str], live: list[Any]) -> frozenset[str]:
            maker._last_group = (4, group)
            maker._knock_vanished(5, live, clock.now(), "p0")
            while maker._background:
                await asyncio.sleep(0.05)
            return maker._from_last_group(5, live, clock.now(), "p0")

        try:
            maker._last_group = (4, members)
            assert maker._from_last_group(5, [], clock.now(), "p0") == {"p1", "p2", "p3"}
            # p2 crashed, p3 frozen: p0 and p1 are 2 of the 3 not known dead, a majority: only p1 is waited for
            assert await knock(members, []) == {"p1"}
            assert maker._knocked["p2"][1] == "refused" and maker._knocked["p3"][1] == "silent"
            # two frozen of five, one crashed: p0 and p1 are 2 of 4, no majority: the silent ones stay expected
            maker._knocked.clear()
            wider = {**members, "p4": f"127.0.0.1:{frozen[1].sockets[0].getsockname()[1]}"}
            assert await knock(wider, []) == {"p1", "p3", "p4"}
            # p2 back (a record again): p0, p1 and p2 are 3 of 5, a majority: the two silent ones are given up
            back = record_of("p2", 5, clock.now())
            assert maker._from_last_group(5, [back], clock.now(), "p0") == {"p1", "p2"}
            maker._knock_vanished(5, [back], clock.now(), "p0")
            assert "p2" not in maker._knocked, (
                "a member whose record is back is knocked afresh if it vanishes again"
            )
            while maker._background:
                await asyncio.sleep(0.05)
        finally:
            await maker.close()
            await alive.stop(0)
            for writer in accepted:
                writer.close()
            for server in frozen:
                server.close()
                await server.wait_closed()

    asyncio.run(main())


def test_a_member_whose_record_we_lack_is_expected_on_its_own_fresh_announcement() -> None:
    """A member that told us over the links it works on round r is waited for in r though its member record is
    missing from our table (expired in our view under load): the leader's early freeze waits for its ready
    record, and a straggler sees that the others wait for it. Not after the member ttl, not another round's, not
    after a departure tombstone, never ourselves."""
    from farloco.protocol.matchmaking import DHTMatchmaker
    from farloco.protocol.membership import Departure, DHTMembership
    from farloco.util.clock import FakeClock

    clock = FakeClock(1000.0)
    membership = DHTMembership(None, "mm", "h", {}, clock=clock, public_key=b"p0")
    maker = DHTMatchmaker(None, "mm", membership, clock=clock)
    now = clock.now()
    live = [rec("p1", heartbeat=now, round_id=5, run_hash="h")]
    assert maker._expected(5, live, now, "p0") == {"p1"}
    maker.announce(5, "p2")  # what a MatchAt from p2 records (our own announcement goes the same way)
    maker.announce(5, "p0")
    maker.announce(6, "p3")
    assert maker._expected(5, live, now, "p0") == {"p1", "p2"}
    assert maker._expected(6, live, now, "p0") == {"p3"}
    later = now + membership.core.ttl + 0.1
    assert maker._expected(5, [], later, "p0") == frozenset()  # p1's record and p2's word both expired
    membership.core.observe(b"k2", Departure("p2", now + 0.5))
    assert maker._expected(5, live, now + 1.0, "p0") == {"p1"}  # p2 left since
