"""A straggler's partial contribution (node.partial_contributions): a node with less compute ends its inner steps
early when the round's other members all wait for it, and joins the round weighted by the steps it ran."""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from farloco.node.config import ConfigError, build_config
from farloco.node.tools.demo import demo_config, read_events, start_bootstrap, start_peer, stop_process

INNER_STEPS = 8
SLOW_STEP = 1.0  # extra seconds per inner step of the straggler: a full round of its own takes >= 8 s


def run_three(
    tmp_path: Path, rounds: int, overrides: list[str], faults: str, *, ranks: int = 1
) -> list[list[dict[str, Any]]]:
    """Nodes a, b and c (c with FARLOCO_FAULTS=`faults` and `ranks` ranks) train `rounds` rounds to the end, on
    the demo's config with `overrides`: each node's events, in that order."""
    config = tmp_path / "swarm.toml"
    config.write_text(demo_config(rounds, overrides))
    bootstrap, maddr = start_bootstrap(tmp_path)
    peers = []
    try:
        for name in ("a", "b", "c"):
            env = {"FARLOCO_FAULTS": faults} if name == "c" else None
            peers.append(start_peer(name, tmp_path, config, maddr, ranks if name == "c" else 1, env=env))
        deadline = time.monotonic() + 300
        while any(p.process.poll() is None for p in peers):
            assert time.monotonic() < deadline, f"3 nodes did not finish {rounds} rounds in 300 s"
            time.sleep(0.5)
        assert all(p.process.returncode == 0 for p in peers), [p.log_path.read_text()[-2000:] for p in peers]
    finally:
        stop_process(*(p.process for p in peers), bootstrap)
    return [read_events(p.run_dir) for p in peers]


def test_partial_min_fraction_is_checked() -> None:
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(
            ConfigError, match=rf"node\.partial_min_fraction: expected a number in \(0, 1\], got {bad}"
        ):
            build_config({"node": {"partial_min_fraction": bad}})
    assert build_config({}).node.partial_contributions is True


@pytest.mark.multiprocess
@pytest.mark.dht
def test_a_slow_node_contributes_part_of_each_round_instead_of_stalling_the_swarm(tmp_path: Path) -> None:
    """3 real nodes; one (2 ranks) takes 1 s more per inner step (FARLOCO_FAULTS=slow-steps=1). The two others
    finish their 8 steps first and wait for it; it cuts its sequence short, and every round commits with all
    three, the straggler's contribution weighted by its share of the steps. Without the cut no round could close
    before the straggler's 8 x 1 s of sleep; with it, the rounds come well within three quarters of that (it runs
    a quarter of the steps, plus the one under way when asked). Every node holds the same theta after every
    round."""
    rounds = 4
    # The straggler runs 2 ranks: they must agree on the step the cut lands after (else one would wait in a
    # collective the other never enters).
    overrides = [f"run.inner_steps={INNER_STEPS}", "node.eval_batches=0"]
    events = run_three(tmp_path, rounds, overrides, f"slow-steps={SLOW_STEP}", ranks=2)
    by_round = [{e["round_id"]: e for e in log if e["event"] == "round"} for log in events]
    assert all(sorted(r) == list(range(1, rounds + 1)) for r in by_round), [sorted(r) for r in by_round]
    for round_id in range(1, rounds + 1):
        assert len({r[round_id]["outer_hash"] for r in by_round}) == 1, round_id
        assert len(by_round[0][round_id]["contributors"]) == 3, by_round[0][round_id]
    # The fast nodes never cut (nobody waited for them), the straggler did, with a share of at least a quarter
    # and below one; the fast nodes contributed in full.
    assert not [e for log in events[:2] for e in log if e["event"] == "cut_short"]
    cuts = [e for e in events[2] if e["event"] == "cut_short"]
    assert len(cuts) >= rounds - 1, cuts
    assert all(INNER_STEPS / 4 <= e["at_step"] < e["of"] == INNER_STEPS for e in cuts), cuts
    weights = [by_round[2][r]["weight"] for r in range(1, rounds + 1)]
    assert sum(w < 1 for w in weights) >= rounds - 1, weights
    assert all(0.25 <= w <= 1 and (w * INNER_STEPS).is_integer() for w in weights), weights
    assert all(by_round[i][r]["weight"] == 1.0 for i in (0, 1) for r in range(1, rounds + 1))
    # The swarm's pace is the fast nodes' plus the straggler's quarter, not the straggler's full sequence.
    times = [by_round[0][r]["time"] for r in range(1, rounds + 1)]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert statistics.median(gaps) < 0.75 * INNER_STEPS * SLOW_STEP, gaps


@pytest.mark.multiprocess
@pytest.mark.dht
def test_a_node_late_for_a_round_brings_its_steps_into_the_next_one(tmp_path: Path) -> None:
    """3 real nodes; node c's agent stalls 5 s as matchmaking starts in round 2 (FARLOCO_FAULTS
    delay=5@match:2; the round whose commit is round event 3), past the others' straggler wait (match_timeout
    3 s), so that round commits without it while it is still in it, and back about 2 s after that commit: well
    within the next round's training (80 steps, 6 s and more). It takes the swarm's state after that round,
    keeps its pseudo-gradient of it (run.late_work = merge), and its next round carries it: that round's
    contribution weighs its own share of the steps (cut short if the others wait for it) plus the late ones';
    every node holds the same theta after every round, and nothing it trained is dropped."""
    rounds = 5
    overrides = [
        # 80 steps, 0.08-0.2 s each here: the next round trains 6 s or more, and the late node is back ~2 s into
        # it. (With 40 steps at 0.09 s the others' next round committed 0.1 s before the node was back from its
        # 6 s stall, and it was late for two rounds: a loaded full suite's failure.)
        "run.inner_steps=80",
        "node.eval_batches=0",
        "timeouts.match_timeout=3",
        "timeouts.match_timeout_min=1",
    ]
    events = run_three(tmp_path, rounds, overrides, "delay=5@match:2")
    by_round = [{e["round_id"]: e for e in log if e["event"] == "round"} for log in events]
    assert sorted(by_round[0]) == sorted(by_round[1]) == list(range(1, rounds + 1)), by_round[:2]
    assert sorted(by_round[2]) == [1, 2, 4, 5], sorted(by_round[2])
    for round_id, event in by_round[2].items():
        assert event["outer_hash"] == by_round[0][round_id]["outer_hash"], round_id
    assert sorted(by_round[0][3]["contributors"]) == sorted(by_round[1][3]["contributors"])
    assert len(by_round[0][3]["contributors"]) == 2
    late = [e for e in events[2] if e["event"] == "late_work"]
    # Its share of round 2 (below 1 when the others' wait had it cut its steps short before the stall), kept
    # whole, and merged whole into its next round, whose own steps add to it.
    assert [(e["round_id"], e["kept"] == e["own"] > 0, e["dropped"]) for e in late] == [(2, True, 0.0)], late
    merged = by_round[2][4]["merged_weight"]
    assert merged == late[0]["own"] and merged < by_round[2][4]["weight"] <= merged + 1.0, by_round[2][4]
    assert len(by_round[0][4]["contributors"]) == 3, by_round[0][4]
    assert all(by_round[2][r]["merged_weight"] == 0.0 for r in by_round[2] if r != 4)
    assert all(e["merged_weight"] == 0.0 for log in by_round[:2] for e in log.values())
