"""Smoke runs of the benchmark scripts BENCHMARKS.md and benchmarks/gpu_checks.sh run: each one end to end at a
tiny size, as a user types it, so a script that broke (benchmarks/exchange.py did, for a day of commits: its
1-value barrier hit an exchange bug) is found here and not on a GPU machine's scarce device time or by a reader
of BENCHMARKS.md. The figures are not checked: they mean nothing at these sizes. What is: the script exits 0,
every configuration it was asked for has its row, and where the script checks a result (the exchange's mean
against the exact one) that check ran. The scripts that need network namespaces, many minutes or a GPU
(wan.py, islands.py, chaos.py, restart.py) have runs of their own elsewhere or none here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT


def run_script(
    name: str, *args: str, timeout: float = 240.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_exchange_benchmark_runs_farloco_and_gloo_and_checks_their_means() -> None:
    proc = run_script(
        "exchange.py", "--impl", "farloco", "--impl", "gloo", "--peers", "2", "--mib", "1",
        "--codec", "fp32", "--codec", "int8", "--codec-threads", "0", "--codec-threads", "2",
    )  # fmt: skip
    rows = json_lines(proc.stdout)
    assert {(r["impl"], r["codec"]) for r in rows} == {
        ("farloco", "fp32"),
        ("farloco", "int8"),
        ("farloco 2 codec threads", "fp32"),
        ("farloco 2 codec threads", "int8"),
        ("gloo", "fp32"),
    }
    for row in rows:
        assert row["peers"] == 2 and row["mib"] == 1 and row["seconds_median"] > 0
        # The script compared every peer's mean with the exact one (it stops on a wrong one); int8's is lossy.
        assert "wrong_result" not in row and row["max_err"] < (0.1 if row["codec"] == "int8" else 1e-5)


@pytest.mark.parametrize(("strategy", "codec"), [("diloco", "int8"), ("sparseloco", "topk")])
def test_round_overhead_benchmark_measures_every_phase(strategy: str, codec: str) -> None:
    proc = run_script(
        "round_overhead.py", "--params", "1e6", "--rounds", "2", "--strategy", strategy, "--codec", codec
    )
    (row,) = json_lines(proc.stdout)
    assert row["params"] == 1_000_000 and row["strategy"] == strategy and row["codec"] == codec
    assert row["contribution"].startswith("on demand")
    phases = row["ns_per_param"]
    assert {"contribution", "encode", "decode+sum", "stage", "step", "hash", "publish"} <= set(phases)
    assert row["round_ns_per_param"] > 0 and all(phases[p] > 0 for p in ("encode", "decode+sum", "stage"))


def test_outer_step_and_digest_benchmarks_print_their_tables() -> None:
    table = run_script("outer_step.py", "--params", "1e6", "--threads", "1", "2", "--repeats", "1").stdout
    rows = [
        line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ") and "---" not in line
    ]
    passes = ["contribution", "outer step", "demo sign step"]
    assert rows[1:] == [[f" {name} ", f" {threads} "] for threads in (1, 2) for name in passes]
    table = run_script("digest.py", "--gib", "0.01", "--threads", "1", "2", "--repeats", "1").stdout
    assert sum(line.startswith("| tree hash") for line in table.splitlines()) == 2


def test_handoff_and_node_throughput_benchmarks_run_a_real_node(tmp_path: Path) -> None:
    """What gpu_checks.sh runs on the GPU machine, on this one's CPU: the hand-off's store and load, and a real
    node (agent, DHT, one trainer rank) for a few rounds beside a bare training loop."""
    out = tmp_path / "handoff.json"
    run_script("handoff.py", "--presets", "tiny", "--repeats", "1", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["preset"] == "tiny" for r in rows)
    out = tmp_path / "throughput.json"
    run_script(
        "node_throughput.py",
        "--presets",
        "tiny",
        "--rounds",
        "3",
        "--inner-steps",
        "2",
        "--bare-steps",
        "2",
        "--json",
        str(out),
    )
    (result,) = json.loads(out.read_text())["results"]
    assert result["preset"] == "tiny" and result["bare_tokens_per_second"] > 0
    assert result["daemon_tokens_per_second"] > 0
    assert len(result["rounds"]) >= 2  # the per-round table's rows (the first round is skipped)


def test_swarm_scale_and_node_memory_benchmarks_run_real_nodes(tmp_path: Path) -> None:
    """Two whole nodes through the chaos harness with their figures, and one node's tree sampled for memory."""
    proc = run_script(
        "swarm_scale.py", "--nodes", "2", "--rounds", "3", "--no-faults", "--out", str(tmp_path / "scale")
    )
    (row,) = json_lines(proc.stdout)
    assert row["nodes"] == 2 and row["rounds"] >= 3 and not row["problems"], row
    assert row["all_live_share"] == 1.0 and not row["forks"] and not row["never_in"]
    assert row["freeze_ms_p50"] is not None and row["one_hop_share"] is not None
    proc = run_script(
        "node_memory.py", "--preset", "tiny", "--rounds", "3", "--inner-steps", "2", "--sides", "farloco"
    )
    (side,) = [r for r in json_lines(proc.stdout) if r.get("side") == "farloco"]
    assert side["peak_pss"] > 0 and side["peak_rss"] >= side["peak_pss"] and side["processes"]


def test_protocol_scale_benchmark_runs_several_peers_per_process() -> None:
    """4 protocol stacks in 2 processes (its DHT nodes in the workers' loops, reached across processes): every
    size asked for has its row, with the DHT calls each peer made."""
    proc = run_script(
        "protocol_scale.py", "--peers", "4", "--per-process", "2", "--work", "0.3", "--seconds", "4",
        "--group-size", "2", "--codec", "int8", "--numel", "4096",
        timeout=180,
    )  # fmt: skip
    [row] = json_lines(proc.stdout)
    assert row["peers"] == 4 and row["per_process"] == 2 and row["rounds"] >= 1
    assert row["dht_calls_per_peer_s"].get("store near members", 0) > 0  # the agent's way of storing records
    # The exchange in rows of 2: every group's members hold the same mean, near the exact one (int8).
    assert row["group_size"] == 2 and row["codec"] == "int8"
    done, total = (int(v) for v in row["groups_alike"].split("/"))
    assert total >= 1 and done == total
    assert row["err_max"] is not None and row["err_max"] < 0.05


def test_matchmaking_and_fanout_benchmarks_break_the_freeze_down() -> None:
    """2 farloco peers for a few rounds (with the ready-record ablation, so that path runs too), then one gRPC, one
    link and one TCP fan-out to 2 receivers: each row has what BENCHMARKS.md quotes."""
    proc = run_script(
        "matchmaking.py", "--impl", "farloco", "--peers", "2", "--work", "0.1", "--rounds", "30",
        "--no-ready-dht-copy", timeout=180, env={"BENCH_MAX_SECONDS": "4"},
    )  # fmt: skip
    [row] = json_lines(proc.stdout)
    assert row["impl"] == "farloco" and row["peers"] == 2 and row["rounds"] >= 1
    assert row["match_p50_ms"] is not None and row["push_last_p50_ms"] is not None
    assert 0.0 <= row["one_hop_share"] <= 1.0 and row["filed_to_known_p50_ms"] is not None
    rows = json_lines(run_script("fanout.py", "--receivers", "2", "--calls", "3", "--gaps", "0").stdout)
    assert {r["transport"] for r in rows} == {"grpc", "link", "tcp"}
    for r in rows:
        assert r["receivers"] == 2 and 0 < r["first_ms"]["p50"] <= r["last_ms"]["p50"] <= r["all_ms"]["p90"]
