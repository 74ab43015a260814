"""A single real node end to end: status/metrics/health endpoints and JSON logs while it trains, checkpoints
(outer state and the ranks' sharded inner state) are written and resumed from after a SIGKILL, drain, SIGTERM
and `leave --now` leave gracefully, trainer restarts are counted, and `farloco report` / `farloco export` work
on what the run left behind. Then node/logs.py on its own."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from safetensors.torch import load_file

from farloco.node.checkpoint import read_metadata
from farloco.node.config import load_config
from farloco.node.daemon.control import ControlClient, ControlError
from farloco.node.tools.demo import read_events, stop_process
from farloco.node.training.flops import module_flops_per_token
from farloco.node.training.models import meta_spec
from farloco.node.training.trainer import learning_rate

pytestmark = [pytest.mark.multiprocess, pytest.mark.dht, pytest.mark.timeout(300)]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "farloco.node.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},  # a wide terminal: rich squeezes the tables' headers otherwise
    )


def _start(
    run_dir: Path, log_path: Path, *extra: str, stderr_path: Path | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "farloco.node.tools.cli", "join", "--run-dir", str(run_dir), "--host", "127.0.0.1",
         "--set", "run.inner_steps=4", *extra],
        stdout=open(log_path, "wb"),
        stderr=open(stderr_path, "wb") if stderr_path else subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def _wait_status(run_dir: Path, node: subprocess.Popen[bytes], predicate, timeout: float = 180) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.poll() is not None:
            pytest.fail(f"node exited with {node.returncode}")
        try:
            status = ControlClient(run_dir).status()
        except ControlError:
            status = {}
        if status and predicate(status):
            return status
        time.sleep(0.3)
    pytest.fail(f"timed out waiting on {run_dir}")


def _metric(run_dir: Path, name: str) -> list[str]:
    with urllib.request.urlopen(ControlClient(run_dir).status()["metrics_url"], timeout=10) as response:
        return [line for line in response.read().decode().splitlines() if line.startswith(f"farloco_{name}")]


# Two ranks (FSDP2 shards of 2 ranks on 2 cores) take ~3 minutes on a loaded CI machine, so one rank runs by
# default; the 2-rank run is the same test under `-m slow`, and it leaves with `leave --now` instead of drain.
@pytest.mark.parametrize("num_ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_node_lifecycle_sigkill_resume_with_inner_state_drain_report_export(
    tmp_path: Path, num_ranks: int
) -> None:
    run_dir = tmp_path / "node"
    extra = ("--set", "checkpoint.every_rounds=2", "--set", "checkpoint.keep=2", "--set",
             f"node.num_ranks={num_ranks}", "--log-format", "json",
             # a cosine schedule over 48 inner steps (12 rounds), checked step by step across the restart
             "--set", "run.lr_schedule=cosine", "--set", "run.total_inner_steps=48", "--set", "run.warmup_steps=2",
             "--set", "run.min_lr_ratio=0.1",
             # per-inner-step figures every 2 steps, MFU against a stated peak (no datasheet peak on CPU)
             "--set", "node.log_every_steps=2", "--set", "node.peak_tflops=0.05")  # fmt: skip
    node = _start(run_dir, tmp_path / "first.log", *extra, stderr_path=tmp_path / "first.err")
    try:
        status = _wait_status(run_dir, node, lambda s: s["round_id"] >= 3 and s["last_checkpoint"])
        for key in ("peer_id", "state", "round_id", "inner_step", "loss", "num_peers", "outer_hash",
                    "bytes_sent", "bytes_received", "multiaddrs", "metrics_url", "last_checkpoint",
                    "trainer_restarts", "trainer_last_exit", "tokens_per_second", "sync"):  # fmt: skip
            assert key in status, key
        assert status["state"] in ("training", "exchanging")
        assert status["trainer_restarts"] == 0 and status["tokens_per_second"] > 0 and status["sync"] is None
        assert status["num_peers"] == 1 and status["multiaddrs"]

        shown = cli("status", "--run-dir", str(run_dir), "--json")
        assert shown.returncode == 0 and json.loads(shown.stdout)["peer_id"] == status["peer_id"]
        table = cli("status", "--run-dir", str(run_dir))
        assert (
            table.returncode == 0 and "trainer_restarts" in table.stdout and "last_checkpoint" in table.stdout
        )
        peers = cli("peers", "--run-dir", str(run_dir))
        assert peers.returncode == 0 and "1 peers" in peers.stdout
        both = cli("status", "--run-dir", str(run_dir), "--swarm")  # the node's table, then the swarm's
        assert both.returncode == 0 and "inner_lr" in both.stdout and "1 peers" in both.stdout, both.stdout
        listed_too = json.loads(cli("status", "--run-dir", str(run_dir), "--json", "--swarm").stdout)
        assert [m["peer_id"] for m in listed_too["peers"]] == [status["peer_id"]]
        listed = json.loads(cli("peers", "--run-dir", str(run_dir), "--json").stdout)
        assert [m["peer_id"] for m in listed] == [status["peer_id"]] and listed[0]["self"]
        # Alone from the start: every round it closed, it contributed to (and nobody was left out).
        assert status["group_share"] == 1.0 and status["left_out"] == {} and listed[0]["share"] == 1.0
        assert "share" in peers.stdout and "100%" in peers.stdout

        with urllib.request.urlopen(status["metrics_url"], timeout=10) as response:
            metrics = response.read().decode()
        for name in ("round_id", "rounds_committed_total", "tokens_per_second", "inner_step_seconds",
                     "trainer_restarts_total", "loss", "peers", "swarm_peers", "swarm_tokens_per_second",
                     "round_contributors"):  # fmt: skip
            assert f"\nfarloco_{name} " in metrics, name
        # The swarm as this node sees it: itself, one series per member labelled by its peer id's prefix.
        assert f'\nfarloco_swarm_peer_round{{peer="{status["peer_id"][:16]}"}} ' in metrics, metrics
        base = status["metrics_url"].removesuffix("/metrics")
        with urllib.request.urlopen(base + "/healthz", timeout=10) as response:
            assert response.status == 200
        # control calls need the token from the run directory
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/status", timeout=10)
        assert refused.value.code == 401
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=30)
    finally:
        stop_process(node)

    events = read_events(run_dir)
    logged = {e["round_id"]: e["inner"] for e in events if e["event"] == "checkpoint"}
    checkpoints = sorted((run_dir / "checkpoints").glob("round-????????"))
    assert 1 <= len(checkpoints) <= 2  # checkpoint.keep
    newest = int(checkpoints[-1].name.removeprefix("round-"))
    # A committed round's (the node trained on while the test looked at it: however many rounds that took).
    committed = max(e["round_id"] for e in events if e["event"] == "round")
    assert newest >= 2 and newest <= committed and newest % 2 == 0, (newest, committed)
    # Read from the checkpoint itself: the SIGKILL may land between its rename and its "checkpoint" event.
    saved = read_metadata(checkpoints[-1])
    if newest in logged:
        assert logged[newest]["result"] == "ok"
        assert logged[newest]["optimizer_step"] == int(saved["optimizer_step"])
    assert int(saved["optimizer_step"]) > 0
    assert len(list((checkpoints[-1] / "inner").glob("*.distcp"))) == num_ranks  # a file of shards per rank

    node = _start(run_dir, tmp_path / "second.log", *extra, stderr_path=tmp_path / "second.err")
    try:
        again = _wait_status(run_dir, node, lambda s: s["round_id"] >= newest + 1)
        assert again["peer_id"] == status["peer_id"], (
            "the identity key in the run directory keeps the peer id"
        )
        if num_ranks == 1:
            left = cli("drain", "--run-dir", str(run_dir), "--timeout", "120")
        else:
            left = cli("leave", "--now", "--run-dir", str(run_dir), "--timeout", "120")
        assert left.returncode == 0, left.stderr
        assert node.wait(timeout=60) == 0, (tmp_path / "second.err").read_text()[-3000:]
    finally:
        stop_process(node)

    events = read_events(run_dir)
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed and resumed[-1]["round_id"] == newest
    [loaded] = [e for e in events if e["event"] == "inner_resumed"]
    assert loaded["result"] == "ok" and loaded["path"] == str(checkpoints[-1] / "inner")
    # the AdamW step count and first moments of the saved checkpoint, not those of a fresh optimizer (0, 0.0)
    assert loaded["optimizer_step"] == int(saved["optimizer_step"])
    assert loaded["optimizer_fingerprint"] == pytest.approx(float(saved["optimizer_fingerprint"]), rel=1e-9)
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "stopped" and "failed" not in kinds and events[-1]["error"] is None
    # The data position survives the SIGKILL: a batch is a pure function of (slot, step), every round
    # r trains steps [(r-1)H, rH); the checkpoint records the slot and the next step, the resumed node reclaims
    # the slot and goes on from the checkpoint's step, not from the start of its slice. The only rounds trained
    # twice are those the SIGKILL lost (committed after the newest checkpoint): the model lost them too.
    inner_steps = 4
    joined = [e for e in events if e["event"] == "joined"]
    assert len(joined) == 2 and joined[0]["slot"] == joined[1]["slot"] == resumed[-1]["data_slot"]
    assert resumed[-1]["data_step"] == newest * inner_steps
    split = kinds.index("resumed")
    rounds = [e for e in events if e["event"] == "round"]
    assert all(e["inner_step"] == e["round_id"] * inner_steps for e in rounds), rounds
    # The rate the ranks applied at each round's last step is the schedule's at the swarm's step, before and after
    # the restart (the resumed node goes on from the checkpoint's round, not from the schedule's start).
    run_config = load_config(run_dir / "config.toml")
    assert run_config.run.lr_schedule == "cosine"
    for e in rounds:
        assert e["inner_lr"] == pytest.approx(learning_rate(run_config, e["inner_step"] - 1), rel=1e-9), e
    assert len({round(e["inner_lr"], 12) for e in rounds if e["inner_step"] < 48}) >= 4  # it moved
    # node.log_every_steps = 2: a steps event per 2 inner steps of the swarm's count, before and after the restart,
    # each with the ranks' loss, tokens/s and MFU (the tokens/s against node.peak_tflops and the model's FLOPs).
    steps = [e for e in events if e["event"] == "steps"]
    assert steps and all(e["inner_step"] % 2 == 0 for e in steps), steps
    before_steps = kinds[:split].count("steps")
    for part in (steps[:before_steps], steps[before_steps:]):  # each process's intervals only move forward
        assert part and all(a["inner_step"] < b["inner_step"] for a, b in itertools.pairwise(part)), part
    assert all(math.isfinite(e["loss"]) and e["tokens_per_second"] > 0 for e in steps), steps
    # MFU = tokens/s x the model's FLOPs per token / the ranks' peak (node.peak_tflops = 0.05, 1 rank)
    per_token = module_flops_per_token(meta_spec(run_config.run.model).module, run_config.run.seq_len)
    for e in steps:
        assert e["mfu"] == pytest.approx(e["tokens_per_second"] * per_token / 0.05e12, rel=1e-9), e
    assert steps[before_steps]["inner_step"] > newest * inner_steps  # the resumed node's count goes on
    before = {e["round_id"] for e in events[:split] if e["event"] == "round"}
    after = {e["round_id"] for e in events[split:] if e["event"] == "round"}
    assert min(after) == newest + 1 and before & after == set(range(newest + 1, committed + 1))
    if num_ranks == 1:  # drain finished the round it was in: its last committed round is where it stopped
        assert "withdrew" not in kinds[kinds.index("inner_resumed") :]
        assert [e for e in events if e["event"] == "round"][-1]["round_id"] == events[-1]["round_id"]

    # --log-format json: every stderr line is a JSON object; the daemon log file holds the same kind of lines
    for err in ("first.err", "second.err"):
        records = [json.loads(line) for line in (tmp_path / err).read_text().splitlines() if line.strip()]
        assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records), err
    daemon = [json.loads(line) for line in (run_dir / "logs" / "daemon.jsonl").read_text().splitlines()]
    assert any(r["logger"].startswith("farloco") for r in daemon)

    report = cli("report", "--run-dir", str(run_dir), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr
    pngs = sorted((tmp_path / "report").glob("*.png"))
    assert len(pngs) == 4 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)

    export = cli("export", "--run-dir", str(run_dir), "--out", str(tmp_path / "hf"))
    assert export.returncode == 0, export.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.embed_tokens.weight" in tensors
    assert sum(t.numel() for t in tensors.values()) == status["num_params"]


def test_crashed_trainer_rank_is_restarted_and_counted_then_sigterm_leaves(tmp_path: Path) -> None:
    run_dir = tmp_path / "node"
    node = _start(run_dir, tmp_path / "node.log", "--set", "node.max_restarts=2")
    try:
        status = _wait_status(run_dir, node, lambda s: s["round_id"] >= 2 and all(s["trainer_pids"]))
        crashed = status["trainer_pids"][0]
        os.kill(crashed, signal.SIGKILL)
        later = _wait_status(run_dir, node, lambda s: s["round_id"] >= status["round_id"] + 2)
        assert later["trainer_pids"][0] not in (0, crashed)
        assert later["state"] in ("training", "exchanging") and later["error"] is None
        assert later["trainer_restarts"] == 1
        assert later["trainer_last_exit"] == f"local rank 0 (pid {crashed}) killed by SIGKILL"
        assert _metric(run_dir, "trainer_restarts_total") == ["farloco_trainer_restarts_total 1.0"]
        [exit_code] = _metric(run_dir, "trainer_last_exit_code")
        assert float(exit_code.rsplit(" ", 1)[1]) == -9 and "killed by SIGKILL" in exit_code
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=60) == 0
    finally:
        stop_process(node)
    events = read_events(run_dir)
    failed = [e for e in events if e["event"] == "trainer_failed"]
    assert len(failed) == 1 and failed[0]["restarting"] and "SIGKILL" in failed[0]["reason"]
    assert events[-1]["event"] == "stopped" and events[-1]["error"] is None


@pytest.mark.slow  # ~30 s; the restart itself is checked by the default-run test above
def test_repeated_trainer_crashes_make_the_node_leave_with_a_reason(tmp_path: Path) -> None:
    run_dir = tmp_path / "node"
    node = _start(run_dir, tmp_path / "node.log", "--set", "node.max_restarts=0")
    try:
        status = _wait_status(run_dir, node, lambda s: s["round_id"] >= 1 and all(s["trainer_pids"]))
        os.kill(status["trainer_pids"][0], signal.SIGKILL)
        assert node.wait(timeout=120) != 0
    finally:
        stop_process(node)
    output = (tmp_path / "node.log").read_text()
    assert "trainer ranks exited" in output
    events = read_events(run_dir)
    assert events[-1]["event"] in ("failed", "stopped")
    assert any(e["event"] == "failed" and "trainer ranks exited" in e["error"] for e in events)
    assert any(e["event"] == "trainer_failed" and not e["restarting"] for e in events)


# ---- node/logs.py without a node ---------------------------------------------------------------------------------
def test_json_log_lines_carry_extra_fields_and_tracebacks() -> None:
    from farloco.node.logs import JsonFormatter

    record = logging.LogRecord("farloco.agent", logging.WARNING, __file__, 1, "round %d late", (7,), None)
    record.peer = "QmX"
    entry = json.loads(JsonFormatter().format(record))
    assert (
        entry["level"] == "WARNING" and entry["logger"] == "farloco.agent" and entry["msg"] == "round 7 late"
    )
    assert entry["peer"] == "QmX" and entry["ts"].endswith("Z") and "exc" not in entry
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "ValueError: boom" in json.loads(JsonFormatter().format(failed))["exc"]


def test_setup_logging_json_routes_farloco_hivemind_and_torch_records(tmp_path: Path) -> None:
    script = (
        "import logging, warnings\n"
        "from pathlib import Path\n"
        "from farloco.node.logs import setup_logging\n"
        f"setup_logging('json', run_dir=Path({str(tmp_path)!r}))\n"
        "logging.getLogger('farloco.agent').info('hello', extra={'round_id': 3})\n"
        "from hivemind.utils.logging import get_logger\n"
        "get_logger('hivemind.dht').warning('dht says')\n"
        # p2pd's error on every normal stop of its control socket is dropped; its other errors pass
        "p2pd = get_logger('hivemind.p2p.p2p_daemon')\n"
        "p2pd.error('error accepting connection: accept unix /tmp/p.sock: use of closed network connection')\n"
        "p2pd.error('failed to dial a peer')\n"
        "logging.getLogger('torch.distributed.elastic.agent').warning('torch says')\n"
        "warnings.warn('careful')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every stderr line is JSON
    by_msg = {entry["msg"]: entry for entry in lines}
    assert by_msg["hello"]["round_id"] == 3 and by_msg["hello"]["logger"] == "farloco.agent"
    assert by_msg["dht says"]["level"] == "WARNING" and "torch says" in by_msg
    assert "failed to dial a peer" in by_msg and not any("closed network connection" in m for m in by_msg)
    assert any("careful" in msg for msg in by_msg)
    written = [json.loads(line) for line in (tmp_path / "logs" / "daemon.jsonl").read_text().splitlines()]
    assert [e["msg"] for e in written] == [e["msg"] for e in lines]


def test_sync_progress_logs_every_interval_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    from farloco.node.logs import SyncProgress

    now = [100.0]
    progress = SyncProgress("state sync (join)", bar=False, interval=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="farloco.logs"):
        progress.update(0, 40 * 2**20)
        now[0] += 4.9
        progress.update(10 * 2**20, 40 * 2**20)
        now[0] += 0.2
        progress.update(20 * 2**20, 40 * 2**20)
    assert [r.getMessage() for r in caplog.records] == ["state sync (join): 20.0 MiB of 40.0 MiB (50%)"]
    assert caplog.records[0].bytes_done == 20 * 2**20  # type: ignore[attr-defined]
    snapshot = progress.snapshot()
    assert snapshot["bytes_done"] == 20 * 2**20 and snapshot["fraction"] == 0.5
    assert snapshot["seconds"] == pytest.approx(5.1)
    progress.close()


def test_launcher_failures_are_read_from_the_launchers_own_log_record() -> None:
    from torch.distributed.elastic.multiprocessing import api as launcher_api

    from farloco.node.logs import LauncherFailures

    seen: list[str] = []
    failures = LauncherFailures(max_restarts=1, on_failure=seen.append)
    failures.install()
    try:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").warning("unrelated")
        # the launcher's own logger and message, as SubprocessContext._poll logs a failed group
        for exitcode, pid in ((-9, 101), (1, 102)):
            launcher_api.logger.error(
                "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", exitcode, 0, pid, "python"
            )
    finally:
        failures.uninstall()
    assert seen == ["local rank 0 (pid 101) killed by SIGKILL", "local rank 0 (pid 102) exited with code 1"]
    assert failures.failures == 2 and failures.restarts == 1 and failures.last_exit_code == 1


def test_drain_with_the_delayed_outer_update_exchanges_the_ranks_last_sequence(tmp_path: Path) -> None:
    """run.outer_update=delayed: `farloco drain` lets the ranks end their sequence, waits for the round in
    flight, exchanges that last sequence with the ranks waiting (nothing trains after it) and leaves with exit 0:
    the last event before the stop is a committed round, no sequence is dropped (withdrew) on the way."""
    run_dir = tmp_path / "node"
    node = _start(run_dir, tmp_path / "node.log", "--set", 'run.outer_update="delayed"')
    try:
        status = _wait_status(run_dir, node, lambda s: s["round_id"] >= 2)
        left = cli("drain", "--run-dir", str(run_dir), "--timeout", "120")
        assert left.returncode == 0, left.stderr
        assert node.wait(timeout=60) == 0
    finally:
        stop_process(node)
    events = read_events(run_dir)
    assert events[-1]["event"] == "stopped" and not events[-1].get("error"), events[-4:]
    before_stop = [e["event"] for e in events[:-1] if e["event"] in ("round", "withdrew", "finished")]
    assert before_stop[-1] == "round" and "withdrew" not in before_stop, before_stop
    rounds = [e for e in events if e["event"] == "round"]
    assert rounds[-1]["round_id"] > status["round_id"]  # the drained sequence was committed after the request
    # Every inner step the ranks took went into a committed round: the last round carries the last sequence.
    assert rounds[-1]["inner_step"] == events[-1]["inner_step"] > 0, (rounds[-1], events[-1])
    assert all(e["trained_from"] for e in rounds)


def _hold_run_dir(run_dir: Path) -> subprocess.Popen[str]:
    """A process that claims `run_dir` as `farloco join` does, says so, and holds it until its stdin closes."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom pathlib import Path\nfrom farloco.node.tools.cli import _lock_run_dir\n"
            "_lock_run_dir(Path(sys.argv[1]))\nprint('locked', flush=True)\nsys.stdin.read()",
            str(run_dir),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_node_on_a_run_directory_in_use_is_refused_naming_the_first(tmp_path: Path) -> None:
    """`farloco join` on a run directory another live node holds exits at once, naming that node's pid, and
    writes nothing there; the claim goes with its holder however it ends (SIGKILL included)."""
    run_dir = tmp_path / "node"
    holder = _hold_run_dir(run_dir)
    try:
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "farloco.node.tools.cli", "join", "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1, second.stderr
        assert f"in use by another farloco node (pid {holder.pid})" in second.stderr, second.stderr
        assert time.monotonic() - started < 30
        assert sorted(p.name for p in run_dir.iterdir()) == ["node.lock"]  # no logs, identity, hand-off
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # SIGKILLed, the holder let go: the next one takes the directory at once.
    again = _hold_run_dir(run_dir)
    assert again.stdin is not None
    again.stdin.close()
    assert again.wait(timeout=30) == 0


def test_the_slot_a_node_asks_for_is_its_checkpoints_else_node_data_slot(tmp_path: Path) -> None:
    """`Checkpoints.saved_slot`, the slot a joining node's first claim asks for: a resumed node keeps its checkpoint's slot;
    one without a checkpoint of the run asks for node.data_slot (-1: any, the lowest free one)."""
    import torch

    from farloco.node.checkpoint import checkpoints_dir, save_checkpoint
    from farloco.node.config import load_config
    from farloco.node.daemon.agent import Agent

    assert Agent(load_config(None, []), tmp_path / "any").checkpoints.saved_slot() == -1
    agent = Agent(load_config(None, ["node.data_slot=5"]), tmp_path / "asked")
    assert agent.checkpoints.saved_slot() == 5
    meta = {"run_hash": agent.state.run_hash, "inner_step": "0", "data_slot": "2"}
    save_checkpoint(checkpoints_dir(agent.state.run_dir), 3, {"theta": torch.zeros(4)}, meta)
    assert agent.checkpoints.saved_slot() == 2  # the checkpoint's slot: its data position goes on there
