"""protocol/isolation.py: when a node that had peers and finds itself alone is isolated (sans-IO, hand-set times)."""

from __future__ import annotations

from farloco.protocol.isolation import IsolationWatch
from farloco.protocol.membership import Departure, Membership


def test_a_first_node_alone_is_not_isolated() -> None:
    watch = IsolationWatch()
    assert watch.observe(0.0, [], []) == "alone"
    assert watch.isolated_for(100.0) == 0.0 and watch.episodes == 0


def test_peers_that_vanish_without_leaving_isolate_the_node_until_one_is_back() -> None:
    watch = IsolationWatch()
    assert watch.observe(0.0, ["b", "c"], []) == "connected"
    assert watch.observe(5.0, ["c"], []) == "connected"  # one of two gone: still a swarm
    assert watch.observe(9.0, [], []) == "isolated"
    assert watch.vanished == ("b", "c") and watch.isolated_since == 9.0
    assert watch.observe(20.0, [], []) == "isolated"
    assert watch.isolated_for(20.0) == 11.0 and watch.episodes == 1  # one episode, not one per read
    assert watch.observe(21.0, ["b"], []) == "connected"
    assert watch.vanished == () and watch.isolated_for(22.0) == 0.0
    assert watch.observe(30.0, [], []) == "isolated" and watch.episodes == 2


def test_peers_that_left_with_a_tombstone_leave_the_node_alone_not_isolated() -> None:
    watch = IsolationWatch()
    watch.observe(0.0, ["b", "c"], [])
    assert watch.observe(3.0, [], ["b", "c"]) == "alone"
    # One left properly, one vanished: isolated from the one that vanished only.
    watch = IsolationWatch()
    watch.observe(0.0, ["b", "c"], [])
    assert watch.observe(3.0, [], ["b"]) == "isolated" and watch.vanished == ("c",)
    # A tombstone read later (the DHT was slow to show it) clears the isolation.
    assert watch.observe(4.0, [], ["c"]) == "alone"


def test_going_on_alone_forgets_the_vanished_peers_and_a_returning_peer_counts_again() -> None:
    watch = IsolationWatch()
    watch.observe(0.0, ["b"], [])
    assert watch.observe(10.0, [], []) == "isolated"
    watch.forget()
    assert watch.verdict == "alone" and watch.observe(50.0, [], []) == "alone"
    assert watch.observe(60.0, ["b"], []) == "connected"
    assert watch.observe(70.0, [], []) == "isolated"


def test_the_member_table_reports_departures_while_their_tombstones_live() -> None:
    table = Membership("h1", {}, ttl=10.0)
    table.observe(b"b", Departure("b", 100.0))
    assert table.departed(105.0) == {"b"}
    assert table.departed(110.0) == set()
