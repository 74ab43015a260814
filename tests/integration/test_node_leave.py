"""Real nodes leaving and surviving: leaving is bounded in every state (also while the DHT does not answer), a
SIGKILLed agent orphans no rank, refused DHT stores at join are ridden out, and a refusal that outlasts
timeouts.dht_retry ends the node with a message that names the DHT key."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from farloco.node.daemon.control import ControlClient, ControlError
from farloco.node.tools.demo import read_events, start_bootstrap, stop_process

pytestmark = [pytest.mark.multiprocess, pytest.mark.dht, pytest.mark.timeout(300)]

LEAVE_TIMEOUT = 10.0
# Beyond leave_timeout: the interpreter's own exit (torch and grpc tear-down) on a loaded 2-core machine.
EXIT_SLACK = 8.0


def start_node(
    run_dir: Path, *extra: str, env: dict[str, str] | None = None, initial_peer: str | None = None
) -> subprocess.Popen[bytes]:
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "farloco.node.tools.cli", "join", "--run-dir", str(run_dir), "--host", "127.0.0.1",
        "--log-format", "json", "--set", f"timeouts.leave_timeout={LEAVE_TIMEOUT}", *extra,
    ]  # fmt: skip
    if initial_peer:
        command += ["--initial-peer", initial_peer]
    return subprocess.Popen(
        command,
        stdout=open(run_dir / "stdout.log", "wb"),
        stderr=open(run_dir / "stderr.log", "wb"),
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def wait_status(run_dir: Path, node: subprocess.Popen[bytes], predicate, timeout: float = 150) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.poll() is not None:
            pytest.fail(f"node exited with {node.returncode}: {(run_dir / 'stderr.log').read_text()[-3000:]}")
        try:
            status = ControlClient(run_dir).status()
        except (ControlError, OSError, ValueError):
            status = {}
        if status and predicate(status):
            return status
        time.sleep(0.2)
    pytest.fail(f"timed out waiting on {run_dir}: last status {status}")


def leave_and_time(node: subprocess.Popen[bytes], how: signal.Signals) -> float:
    started = time.monotonic()
    node.send_signal(how)
    try:
        node.wait(timeout=LEAVE_TIMEOUT + 60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the node did not leave within {LEAVE_TIMEOUT + 60} s of {how.name}")
    return time.monotonic() - started


def assert_gone(processes: list[psutil.Process], seconds: float) -> None:
    """Every one of `processes` has exited (or is a zombie) within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    assert not alive, [(p.pid, " ".join(p.cmdline())[:120]) for p in alive]


def test_sigkill_of_the_agent_orphans_no_rank_and_no_dht_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "node"
    node = start_node(run_dir, "--set", "node.num_ranks=2", "--set", "run.inner_steps=200")
    try:
        # Every rank has reported its pid (0 until its first step is marked: rank 0 may mark before rank 1 does).
        status = wait_status(
            run_dir,
            node,
            lambda s: s["state"] == "training" and s["inner_step"] > 0 and all(s["trainer_pids"]),
        )
        tree = [p for p in psutil.Process(node.pid).children(recursive=True) if p.is_running()]
        ranks = set(status["trainer_pids"])
        assert len(ranks) == 2 and ranks <= {p.pid for p in tree}, (ranks, tree)
        os.kill(node.pid, signal.SIGKILL)  # the agent alone: its children get no chance to be told
        node.wait(timeout=30)
        assert_gone(tree, 30)
    finally:
        stop_process(node)
    # The launcher's warning about orphans (it runs on a thread and cannot trap signals) is not shown.
    output = (run_dir / "stderr.log").read_text() + (run_dir / "stdout.log").read_text()
    assert "Failed to register signal handlers" not in output


def _is_rank(process: psutil.Process) -> bool:
    """Whether `process` is a trainer rank; a child that has just exited (a zombie not yet reaped, or gone) is
    not: the node's short-lived helpers come and go while we look."""
    try:
        return "farloco.node.training.trainer" in " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return False


def test_ranks_still_starting_when_the_agent_is_sigkilled_end_too(tmp_path: Path) -> None:
    """The agent SIGKILLed right after it launched its ranks, while they still import torch: by the time they
    look for their parent they were re-parented already, and must not take the new parent for the agent."""
    run_dir = tmp_path / "node"
    node = start_node(run_dir, "--set", "node.num_ranks=2")
    try:
        deadline = time.monotonic() + 120
        ranks: list[psutil.Process] = []
        while time.monotonic() < deadline and len(ranks) < 2:
            ranks = [p for p in psutil.Process(node.pid).children(recursive=True) if _is_rank(p)]
            time.sleep(0.05)
        assert len(ranks) == 2, "the agent did not launch its ranks"
        os.kill(node.pid, signal.SIGKILL)
        node.wait(timeout=30)
        assert_gone(ranks, 90)  # they import torch and set up their group first, on a loaded machine
    finally:
        stop_process(node)
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()


def test_refused_dht_stores_at_join_are_ridden_out(tmp_path: Path) -> None:
    """The first 8 stores (member record, slot claim, ...) are refused by a real DHT: the node retries, joins
    and trains; the warnings say what it waited for."""
    run_dir = tmp_path / "node"
    node = start_node(run_dir, "--set", "run.inner_steps=4", env={"FARLOCO_FAULTS": "dht-refuse-stores=8"})
    try:
        wait_status(run_dir, node, lambda s: s["rounds_committed"] >= 2)
    finally:
        assert leave_and_time(node, signal.SIGTERM) < LEAVE_TIMEOUT + EXIT_SLACK
    assert node.returncode == 0
    log = (run_dir / "stderr.log").read_text()
    assert "the DHT refused our member record under farloco/" in log and "retrying for up to" in log


def test_a_refusal_that_outlasts_dht_retry_ends_the_node_naming_the_key(tmp_path: Path) -> None:
    run_dir = tmp_path / "node"
    started = time.monotonic()
    node = start_node(
        run_dir,
        "--set",
        "timeouts.dht_retry=4",
        "--set",
        "run.name=refused",
        env={"FARLOCO_FAULTS": "dht-refuse-stores-for=3600"},
    )
    try:
        node.wait(timeout=120)
    finally:
        stop_process(node)
    assert node.returncode == 1 and time.monotonic() - started < 90
    failed = [e for e in read_events(run_dir) if e["event"] == "failed"]
    assert failed, read_events(run_dir)
    error = failed[0]["error"]
    assert "joining: the DHT refused our member record under farloco/refused/members" in error, error
    assert "attempts" in error and "initial_peers" in error, error


@pytest.mark.parametrize(
    ("state", "faults", "how"),
    [
        ("joining, the DHT silent", "dht-silent-after=0", signal.SIGINT),
        ("training, the DHT silent", "dht-silent-after=12", signal.SIGTERM),
    ],
)
def test_leaving_is_bounded_while_the_dht_does_not_answer(
    tmp_path: Path, state: str, faults: str, how: signal.Signals
) -> None:
    run_dir = tmp_path / "node"
    node = start_node(run_dir, "--set", "run.inner_steps=400", env={"FARLOCO_FAULTS": faults})
    try:
        if state.startswith("joining"):
            wait_status(run_dir, node, lambda s: s["state"] in ("starting", "syncing"), timeout=60)
            time.sleep(2.0)  # well inside its first DHT read, which will never answer
        else:
            wait_status(run_dir, node, lambda s: s["state"] == "training" and s["inner_step"] > 0)
            time.sleep(max(0.0, 13.0 - (time.monotonic() - node_started(run_dir))))
        took = leave_and_time(node, how)
    finally:
        stop_process(node)
    assert node.returncode == 0, (run_dir / "stderr.log").read_text()[-2000:]
    assert took < LEAVE_TIMEOUT + EXIT_SLACK, f"{state}: left in {took:.1f} s"
    assert any(e["event"] == "stopped" for e in read_events(run_dir))


def node_started(run_dir: Path) -> float:
    """time.monotonic() at which the node's process wrote its 'started' event (approximately)."""
    started = next(e["time"] for e in read_events(run_dir) if e["event"] == "started")
    return time.monotonic() - (time.time() - started)


def test_leaving_mid_exchange_is_bounded_by_leave_timeout(tmp_path: Path) -> None:
    """Node a waits in its exchange for b, which stopped (SIGSTOP) while training and whose record stays live
    for a minute: `farloco leave` and SIGTERM still end a within timeouts.leave_timeout."""
    bootstrap, maddr = start_bootstrap(tmp_path)
    slow = (
        "--set",
        "timeouts.member_ttl=60",
        "--set",
        "timeouts.match_timeout=60",
        "--set",
        "run.inner_steps=6",
    )
    a = start_node(tmp_path / "a", *slow, initial_peer=maddr)
    b = start_node(tmp_path / "b", *slow, initial_peer=maddr)
    try:
        wait_status(tmp_path / "a", a, lambda s: s["rounds_committed"] >= 1 and s["num_peers"] == 2)
        wait_status(tmp_path / "b", b, lambda s: s["state"] == "training")
        for process in [*psutil.Process(b.pid).children(recursive=True), psutil.Process(b.pid)]:
            process.suspend()
        wait_status(tmp_path / "a", a, lambda s: s["state"] == "exchanging", timeout=60)
        time.sleep(1.0)
        started = time.monotonic()
        left = subprocess.run(
            [sys.executable, "-m", "farloco.node.tools.cli", "leave", "--run-dir", str(tmp_path / "a")],
            capture_output=True,
            text=True,
            timeout=LEAVE_TIMEOUT + 60,
        )
        a.wait(timeout=LEAVE_TIMEOUT + 60)
        took = time.monotonic() - started
    finally:
        for process in [*psutil.Process(b.pid).children(recursive=True), psutil.Process(b.pid)]:
            if process.is_running():
                process.resume()
        stop_process(a, b)
        stop_process(bootstrap)
    assert left.returncode == 0, left.stdout + left.stderr
    assert a.returncode == 0 and took < LEAVE_TIMEOUT + EXIT_SLACK, took
    events = read_events(tmp_path / "a")
    assert any(e["event"] == "withdrew" and e.get("bounded") for e in events), [e["event"] for e in events]
    print(json.dumps({"left_in_seconds": round(took, 1)}))


def test_a_sigterm_while_the_node_starts_is_a_leave_not_a_death(tmp_path: Path) -> None:
    """SIGTERM while `farloco join` is still importing torch, building the model or starting the DHT (before the
    agent's own signal handlers exist: Slurm's time-limit leave hit a node there on a loaded host) leaves
    cleanly: exit 0, no traceback, no process left behind."""
    run_dir = tmp_path / "node"
    node = start_node(run_dir)
    logs = run_dir / "logs" / "daemon.jsonl"  # written once the join command set up logging
    deadline = time.monotonic() + 60
    while not logs.exists() and node.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.poll() is None, (run_dir / "stderr.log").read_text()[-3000:]
    started = time.monotonic()
    os.kill(node.pid, signal.SIGTERM)
    try:
        code = node.wait(timeout=LEAVE_TIMEOUT + EXIT_SLACK + 30)
    finally:
        stop_process(node)
    stderr = (run_dir / "stderr.log").read_text()
    assert code == 0, (code, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert time.monotonic() - started < LEAVE_TIMEOUT + EXIT_SLACK + 30
