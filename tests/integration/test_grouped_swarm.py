"""The exchange in rows and columns (`run.exchange_group_size`) in a swarm of real `farloco join` nodes."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from farloco.node.tools.demo import demo_config, read_events, start_bootstrap, start_peer, stop_process


@pytest.mark.multiprocess
@pytest.mark.dht
def test_four_nodes_in_rows_of_two_commit_every_round_with_one_hash(tmp_path: Path) -> None:
    """4 real nodes with run.exchange_group_size = 2: every round's mean goes through 2 rows of 2, 2 columns and
    the gather (round events: exchange = "rows"), every round commits with all four and one hash, and the
    held-out loss falls."""
    config = tmp_path / "swarm.toml"
    config.write_text(demo_config(4, ["run.inner_steps=8", 'run.codec="int8"', "run.exchange_group_size=2"]))
    bootstrap, maddr = start_bootstrap(tmp_path)
    peers = []
    try:
        for name in ("a", "b", "c", "d"):
            peers.append(start_peer(name, tmp_path, config, maddr, 1))
        deadline = time.monotonic() + 400
        while any(p.process.poll() is None for p in peers):
            assert time.monotonic() < deadline, "4 nodes did not finish 4 rounds in 400 s"
            time.sleep(0.5)
        assert all(p.process.returncode == 0 for p in peers), [p.log_path.read_text()[-2000:] for p in peers]
    finally:
        stop_process(*(p.process for p in peers), bootstrap)
    rounds = [{e["round_id"]: e for e in read_events(p.run_dir) if e["event"] == "round"} for p in peers]
    for round_id in range(1, 5):
        assert len({r[round_id]["outer_hash"] for r in rounds}) == 1, round_id
        assert all(len(r[round_id]["contributors"]) == 4 for r in rounds), round_id
        assert all(r[round_id]["exchange"] == "rows" for r in rounds), [
            r[round_id]["exchange"] for r in rounds
        ]
    losses = [rounds[0][r]["eval_loss"] for r in range(1, 5)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1, losses
