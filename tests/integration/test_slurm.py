"""deploy/slurm/farloco.sbatch run as written on a real Slurm cluster (tests/slurm_cluster.py: munge, slurmctld and
two emulated `slurmd -N` nodes on 127.0.0.1, so the two farloco nodes share a host and must not collide).

One test walks the life of a run: a job too short for the graceful leave is refused with the reason; a job trains
with both nodes in one group and agreeing hashes, and `scancel --signal=TERM` ends it in <= 10 s with exit 0,
each node's last event `stopped` without error and no rank restarted; a second job with the same run root resumes
from the first one's checkpoints and leaves by itself before its time limit. `farloco join` pointed at a
bootstrap that is not there exits with one line naming the address it tried.

Needs Debian's Slurm packages and root; skips with the reason otherwise (`.ci/run` installs them).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT
from helpers.slurm_cluster import SlurmCluster, unavailable

from farloco.node.tools.demo import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess, pytest.mark.dht, pytest.mark.timeout(300)]

SBATCH = ROOT / "deploy" / "slurm" / "farloco.sbatch"
LEAVE_BOUND = 10.0  # scancel --signal=TERM -> job gone, at tiny size: the bound this test holds the sbatch to


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    why = unavailable()
    if why:
        pytest.skip(why)
    with SlurmCluster(tmp_path / "slurm") as running:
        yield running


def free_block(size: int) -> int:
    """A base port with `size` consecutive ports free on 127.0.0.1."""
    for _ in range(200):
        base = random.randrange(20000, 40000)
        sockets = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {size} consecutive free ports")


def run_config(path: Path) -> Path:
    """deploy/configs/tiny-cpu.toml with short rounds, a checkpoint every 2 rounds and a 10 s leave bound."""
    text = (ROOT / "deploy" / "configs" / "tiny-cpu.toml").read_text()
    text = text.replace("inner_steps = 20", "inner_steps = 4").replace("every_rounds = 5", "every_rounds = 2")
    text = text.replace("[timeouts]\n", "[timeouts]\nleave_timeout = 10.0\n")
    path.write_text(text)
    return path


def job_env(config: Path, run_root: Path, base: int) -> dict[str, str]:
    """The sbatch's environment: the config, the run root, ports from `base` up, and this venv's farloco."""
    return {
        "FARLOCO_CONFIG": str(config),
        "FARLOCO_RUN_ROOT": str(run_root),
        "FARLOCO_BOOTSTRAP_PORT": str(base),
        "FARLOCO_PORT_BASE": str(base + 1),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }


def committed(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e["event"] == "round"]


def wait_for(what: str, ready: Any, cluster: SlurmCluster, job: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        state = cluster.job(job).get("JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job {job} is {state} while waiting for {what}:\n{cluster.logs()}")
        time.sleep(0.3)
    pytest.fail(f"not within {timeout:.0f} s: {what}")


def together(run_dirs: list[Path], after: int) -> list[int]:
    """Round ids above `after` that every node committed in one group of all of them, with one hash."""
    by_node = [{e["round_id"]: e for e in committed(d)} for d in run_dirs]
    common = set.intersection(*(set(rounds) for rounds in by_node))
    return sorted(
        r
        for r in common
        if r > after
        and len({rounds[r]["outer_hash"] for rounds in by_node}) == 1
        and all(len(rounds[r]["contributors"]) == len(run_dirs) for rounds in by_node)
    )


def assert_left_cleanly(run_dirs: list[Path], output: str) -> None:
    for run_dir in run_dirs:
        events = read_events(run_dir)
        last = events[-1]
        assert last["event"] == "stopped" and not last.get("error"), (run_dir.name, events[-5:])
        failed = [e for e in events if e["event"] == "trainer_failed"]
        assert not failed, f"{run_dir.name}: a rank failed (restarted during the leave?): {failed}"
    assert "Killed" not in output and '"level": "ERROR"' not in output, output[-3000:]


@pytest.mark.timeout(450)  # two jobs, the second with a 120 s limit
def test_the_sbatch_runs_leaves_and_resumes_on_a_real_slurm_cluster(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_root = tmp_path / "run"
    config = run_config(tmp_path / "tiny.toml")
    env = job_env(config, run_root, free_block(7))
    # The script's GPU and CPU requests are for a GPU cluster: this one has 2 CPUs per node and no GPUs.
    fit = ["--nodes=2", "--cpus-per-task=1", "--gpus-per-node=0", f"--output={tmp_path}/job-%j.out"]
    run_dirs = [run_root / "n1", run_root / "n2"]

    def output(job: str) -> str:
        path = tmp_path / f"job-{job}.out"
        return path.read_text() if path.exists() else ""

    # 1. Too short for the graceful leave (30 s default in the margin's slack + leave_timeout): refused, saying so.
    short = cluster.sbatch(*fit, "--time=1", str(SBATCH), env=env, cwd=ROOT)
    fields = cluster.wait_job(short, 30)
    assert fields["JobState"] == "FAILED", fields
    assert "refusing to start" in output(short) and "leave_timeout=10.0" in output(short), output(short)
    assert not run_dirs[0].exists(), "a refused job must not start any node"

    # 2. A job that trains: both nodes in one group, one hash; then scancel --signal=TERM.
    first = cluster.sbatch(*fit, "--time=10", str(SBATCH), env=env, cwd=ROOT)
    wait_for("4 rounds of both nodes together", lambda: len(together(run_dirs, -1)) >= 4, cluster, first)
    started = time.monotonic()
    cluster.run("scancel", "--signal=TERM", first)
    fields = cluster.wait_job(first, 60)
    took = time.monotonic() - started
    print(f"scancel --signal=TERM -> job {fields['JobState']} in {took:.1f} s")  # pytest -s shows it
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, output(first))
    assert took <= LEAVE_BOUND, (
        f"the job took {took:.1f} s to leave (bound {LEAVE_BOUND} s):\n{output(first)}"
    )
    assert_left_cleanly(run_dirs, output(first))
    last_round = max(e["round_id"] for e in committed(run_dirs[0]))
    checkpointed = {
        d: max(e["round_id"] for e in read_events(d) if e["event"] == "checkpoint") for d in run_dirs
    }

    # 3. The next job resumes from those checkpoints, trains on together, and leaves before its time limit
    # by itself (a 120 s limit, a margin of 10 + 1 + 20 s, three times the leave's bound: it asks the nodes to
    # leave ~85 s in). With a 30 s slack (leave ~16 s in) a loaded machine took 13 of those 16 s to start the
    # nodes and their ranks, and the leave came before their first round together; with a 60 s limit the script
    # itself refused to start on a machine busy with two other processes (its start and its `farloco config`
    # calls took more than the 19 s a 60 s job leaves above the margin and FARLOCO_MIN_TRAIN).
    second = cluster.sbatch(
        *fit,
        "--time=2",
        str(SBATCH),
        env={**env, "FARLOCO_LEAVE_SLACK": "20", "FARLOCO_MIN_TRAIN": "10"},
        cwd=ROOT,
    )
    fields = cluster.wait_job(second, 150)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, output(second))
    assert "asking every node to leave" in output(second), output(second)
    for run_dir in run_dirs:  # each node from its newest checkpoint of the first job
        resumed = [e for e in read_events(run_dir) if e["event"] == "resumed"]
        assert resumed and resumed[-1]["round_id"] == checkpointed[run_dir], (run_dir.name, resumed)
    after = together(run_dirs, last_round)
    assert after, f"no round after {last_round} with both nodes and one hash in the second job"
    assert_left_cleanly(run_dirs, output(second))


def test_a_node_that_cannot_reach_the_bootstrap_says_where_it_looked(tmp_path: Path) -> None:
    bootstrap = f"/ip4/127.0.0.1/tcp/{free_block(1)}/p2p/QmXDUvdV8QV1N7tWhxGtiJ2yvQ6WqKWBSJwZfPq3XrCeU2"
    result = subprocess.run(
        [sys.executable, "-m", "farloco.node.tools.cli", "join", "--config", str(run_config(tmp_path / "c.toml")),
         "--run-dir", str(tmp_path / "node"), "--host", "127.0.0.1", "--port", "0", "--dht-port", "0",
         "--initial-peer", bootstrap, "--log-format", "text"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and bootstrap in errors[0] and "could not reach" in errors[0], result.stderr[
        -2000:
    ]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_the_sbatch_makes_one_island_of_its_nodes(cluster: SlurmCluster, tmp_path: Path) -> None:
    """FARLOCO_ISLAND: the job's two nodes form one island (its rendezvous on the first node's NodeAddr) and go
    through their rounds together: rank 0 and 1, each with half of the slices; hashes agree; the leave is clean."""
    run_root = tmp_path / "run"
    config = run_config(tmp_path / "tiny.toml")
    config.write_text(config.read_text().replace("[run]\n", "[run]\nisland_slices = 8\n"))
    base = free_block(8)
    env = {**job_env(config, run_root, base), "FARLOCO_ISLAND": "slurm", "FARLOCO_ISLAND_PORT": str(base + 7)}
    fit = ["--nodes=2", "--cpus-per-task=1", "--gpus-per-node=0", f"--output={tmp_path}/job-%j.out"]
    run_dirs = [run_root / "n1", run_root / "n2"]
    job = cluster.sbatch(*fit, "--time=10", str(SBATCH), env=env, cwd=ROOT)

    def island_rounds() -> list[int]:
        by_node = [{e["round_id"]: e for e in committed(d)} for d in run_dirs]
        return [
            r
            for r in together(run_dirs, -1)
            if sorted(tuple((by_node[i][r]["island"] or {}).get("span", ())) for i in range(2))
            == [(0, 4), (4, 8)]
        ]

    wait_for("3 rounds of the island together", lambda: len(island_rounds()) >= 3, cluster, job, timeout=180)
    cluster.run("scancel", "--signal=TERM", job)
    fields = cluster.wait_job(job, 60)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, out)
    assert f"island slurm: rendezvous at 127.0.0.1:{base + 7}" in out, out
    assert_left_cleanly(run_dirs, out)
