"""The chaos scenarios' fast half, in the default suite: real `farloco join` processes on 127.0.0.1, faults from
their fault plans (node/faults) and from outside, and the invariants and expected outcomes of
the chaos runner (benchmarks/chaos_runner.py) checked after each. `benchmarks/chaos.py` runs every scenario of
benchmarks/chaos_scenarios.py (RELIABILITY.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.scripts import BENCHMARKS

sys.path.insert(
    0, str(BENCHMARKS)
)  # the chaos runner and its scenarios are benchmark modules, not the package's
from chaos_runner import Fault, Scenario, run, steps_accounted, verdict
from chaos_scenarios import SCENARIOS

# Five faults one after the other in one swarm of 3 (each a few rounds after the last, so their figures do not
# mix): what would be five swarm start-ups costs one.
TIMELINE = Scenario(
    "timeline",
    "3 nodes, 17 rounds: a corrupted payload, dropped connections, a member frozen mid-exchange, a SIGKILL during "
    "inner steps, a CLI leave",
    (
        Fault("corrupted payload", 1, 2, plan="corrupt@exchange:2", checks=("refused", "left_out", "back")),
        Fault("dropped connections", 2, 4, plan="drop@exchange+0.02:4", checks=("fired",)),
        # given up by the two others (a majority) once its record expired and it answered no ping, long before
        # the data deadline; thawed, it resyncs
        Fault(
            "member frozen mid-exchange",
            1,
            6,
            plan="hang=10@exchange:6",
            checks=("left_out", "given_up_early", "back"),
        ),
        Fault(
            "SIGKILL during inner steps",
            2,
            10,
            plan="crash@train:10",
            restart_after=1.0,
            checks=("left_out", "back"),
        ),
        Fault("CLI leave", 1, 13, signal="leave", checks=("left_out", "exit_0")),
    ),
    # Rounds after the leave: `farloco leave` is a Python process that takes seconds to start on a loaded machine,
    # and a leave that lands in the last round leaves no round to go on without the node (a stress run saw it).
    rounds=17,
    timeout=360,
)


def test_inner_steps_are_accounted_from_the_round_and_late_work_events() -> None:
    """The chaos table's 'inner steps in an update': a committed round's weight reached an update (its
    merged_weight was trained in the round before, counted there); a round that went on without the node trained
    its `own`, kept or dropped."""
    events = {
        "p0": [{"event": "round", "weight": 1.0, "merged_weight": 0.0}] * 3,
        "p1": [
            {"event": "round", "weight": 1.0, "merged_weight": 0.0},
            {"event": "late_work", "own": 0.75, "kept": 0.75, "dropped": 0.0},  # merged next round
            {"event": "round", "weight": 1.75, "merged_weight": 0.75},
            {"event": "late_work", "own": 1.0, "kept": 0.0, "dropped": 1.0},  # discarded
            {"event": "round", "weight": 0.5},  # a partial contribution, from before merged_weight existed
        ],
    }
    trained, reached = steps_accounted(events)
    assert (trained, reached) == (3.0 + 1.0 + 0.75 + 1.0 + 1.0 + 0.5, 3.0 + 1.0 + 1.75 + 0.5)


@pytest.mark.multiprocess
@pytest.mark.dht
def test_a_timeline_of_faults_costs_rounds_never_a_fork(tmp_path: Path) -> None:
    outcome = run(TIMELINE, tmp_path)
    problems = verdict(TIMELINE, outcome)
    assert not problems, (problems, outcome.to_json())
    corrupted, dropped, frozen, killed, left = outcome.faults
    # every receiver refused node 1's 0xFF chunks by reason; the round went on without it and it came back
    assert set(outcome.rejected) & {"NON_FINITE", "BAD_INDICES", "BAD_PAYLOAD", "MALFORMED"}, outcome.rejected
    assert corrupted.detection_s is not None and corrupted.rejoin_s is not None
    assert frozen.detection_s is not None and frozen.rejoin_s is not None
    assert killed.detection_s is not None and killed.rejoin_s is not None
    assert dropped.at is not None and left.detection_s is not None
    assert outcome.exit_codes["p2"][0] != 0 and outcome.exit_codes["p1"] == [0]
    # every round committed but the one the dropped connections cost (its members abort it alike, at once)
    assert outcome.rounds >= TIMELINE.rounds - 1 and dropped.rounds_aborted <= 1


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.dht
@pytest.mark.parametrize(
    "name",
    [
        # each scenario within its own bound (the runner stops it there) and a margin to start and stop the
        # swarm, not the suite's default 300 s: the partition's 60 rounds need more on a busy 2-core machine
        pytest.param(n, marks=pytest.mark.timeout(max(300, int(SCENARIOS[n].timeout) + 120)))
        for n in SCENARIOS
        if n not in ("healthy", "long-run")
    ],
)
def test_each_scenario_holds(tmp_path: Path, name: str) -> None:
    """Every scenario of the table, each in a swarm of its own (`-m slow`; benchmarks/chaos.py measures them).
    The partition and half-open scenarios run on a namespace WAN: they need root and iproute2."""
    scenario = SCENARIOS[name]
    if scenario.wan:
        from farloco.node.tools.netns import unavailable

        reason = unavailable()
        if reason is not None:
            pytest.skip(reason)
    outcome = run(scenario, tmp_path)
    assert not verdict(scenario, outcome), (verdict(scenario, outcome), outcome.to_json())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.dht
@pytest.mark.timeout(2700)
def test_500_rounds_at_4_peers_never_deadlock_nor_lose_a_node(tmp_path: Path) -> None:
    """The sans-IO 500 rounds are tests/unit/test_matchmaking.py's; this is the real one, real processes on a
    real DHT. Every round 1..500 committed once, by all four, with one hash; no round took anything like a
    timeout (a deadlock resolved by a deadline would show as a gap of match_timeout, 20 s)."""
    scenario = SCENARIOS["long-run"]
    outcome = run(scenario, tmp_path)
    assert not verdict(scenario, outcome), (verdict(scenario, outcome), outcome.to_json())
    assert outcome.rounds == scenario.rounds
    for name, log in outcome.events.items():
        rounds = [e for e in log if e["event"] == "round"]
        assert [e["round_id"] for e in rounds] == list(range(1, scenario.rounds + 1)), name
        short = [e["round_id"] for e in rounds if len(e["contributors"]) < scenario.peers]
        assert not short, f"{name}: rounds without every node: {short}"
    print("round-time distribution (s):", outcome.round_gaps_s)
    assert outcome.round_gaps_s["max"] < 15.0, outcome.round_gaps_s
