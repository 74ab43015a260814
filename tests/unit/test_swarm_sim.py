"""benchmarks/swarm_sim.py: the real matchmaking rule (`decide`) over a simulated WAN with churn, small enough for
the fast tier. What the benchmark's table rests on: one group per round (the simulation raises on a split), every
live peer in (almost) every round, one-hop freezes when nobody churns, and messages per peer that grow with N in
the flat protocol (every ready record to every member)."""

from __future__ import annotations

import math

import pytest
from helpers.scripts import BENCHMARKS, load_script

sim = load_script(BENCHMARKS / "swarm_sim.py", "swarm_sim")


def test_without_churn_every_round_holds_every_peer_and_freezes_in_one_hop() -> None:
    result = sim.simulate(sim.Settings(peers=12, rounds=15, churn=0.0, loss=0.0, fail=0.0, seed=3))
    assert result["rounds"] == 15 and result["formed"] == 15 and result["split"] == 0
    assert result["all_live"] == 1.0 and result["one_hop"] == 1.0 and result["crashes"] == 0
    # one hop: the freeze costs the slowest pair's one-way latency, well under a second at a 60 ms median RTT
    assert 0 < result["freeze_p50_ms"] < 500


def test_the_leader_path_alone_also_agrees_and_sends_more() -> None:
    settings = dict(peers=12, rounds=15, churn=0.0, loss=0.0, fail=0.0, seed=3)
    leader = sim.simulate(sim.Settings(**settings, one_hop=False))
    one_hop = sim.simulate(sim.Settings(**settings))
    assert leader["one_hop"] == 0.0 and leader["all_live"] == 1.0
    # the leader's group push and every member's relay are gone from one-hop rounds
    assert one_hop["msgs_per_peer_round"] < leader["msgs_per_peer_round"]


def test_churn_and_loss_cost_rounds_never_a_split_and_flat_messages_grow_with_n() -> None:
    small = sim.simulate(sim.Settings(peers=8, rounds=20, churn=0.03, loss=0.02, fail=0.01, seed=5))
    large = sim.simulate(sim.Settings(peers=32, rounds=20, churn=0.03, loss=0.02, fail=0.01, seed=5))
    for result in (small, large):
        assert result["split"] == 0 and result["formed"] >= 18
        assert result["all_live"] >= 0.8, result
        assert not math.isnan(result["freeze_p99_ms"])
    assert large["crashes"] > 0  # the churn happened
    # the flat protocol: every peer messages every other peer each round
    ratio = large["msgs_per_peer_round"] / small["msgs_per_peer_round"]
    assert 2.5 < ratio < 5.0, ratio


def test_the_command_line_prints_one_row_per_swarm_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        sim.main(["--peers", "4", "6", "--rounds", "3", "--churn", "0", "--leader-only", "--markdown"]) == 0
    )
    table = capsys.readouterr().out
    assert "leader only" in table and "churn 0%" in table
    rows = [line for line in table.splitlines() if line.startswith("| 4 |") or line.startswith("| 6 |")]
    assert len(rows) == 2 and all("| 0% |" in row for row in rows)  # no one-hop group without declarations
