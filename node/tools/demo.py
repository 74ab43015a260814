"""`farloco demo`: a whole swarm on this machine — a bootstrap DHT node and N peers on 127.0.0.1.

Each peer is a real `farloco join` process (agent + trainer ranks); the demo only starts them, shows their
progress, and at the end reads their event logs to print what happened: the loss per round, the bytes each peer
sent against what plain data-parallel training would have sent, and whether every peer's theta_outer hash agreed.

Any strategy x codec runs (`--strategy`, `--codec`). A strategy may bring demo defaults for what the user left
unset (`STRATEGY_DEMO_DEFAULTS`): DeMo, whose gradient is one inner step, syncs every step with its DCT top-k
codec and trains more, shorter rounds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from farloco.node.config import (
    PRESETS,
    SECRET_ENV,
    ConfigError,
    build_config,
    is_loopback,
    parse_override,
    to_toml,
)
from farloco.node.fsutil import write_atomic

DEMO_TIMEOUT_SECONDS = 900.0
DEFAULT_ROUNDS = 6
DEMO_RUN_NAME = "farloco-demo"
"""run.name of every config made here (`demo_config`): the bootstrap started here checks its member records."""
# [run] values a strategy's demo uses unless the overrides set them. Only the demo applies these: a config file
# means what it says (run.codec defaults to fp32 everywhere, and [run] is hashed as written).
STRATEGY_DEMO_DEFAULTS: dict[str, dict[str, Any]] = {
    # DeMo is meant for its DCT top-k codec (Peng et al. 2024); its round is one plain SGD step.
    "demo": {"codec": "dct-topk", "inner_steps": 1},
}
# One DeMo round is one inner step: it needs more rounds than DiLoCo's 20-step rounds for the loss to move.
STRATEGY_DEMO_ROUNDS: dict[str, int] = {"demo": 30}


@dataclass
class PeerProcess:
    name: str
    run_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "logs" / "agent.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    # A node still running may be midway through writing its last line (a long event leaves its buffer in more
    # than one write): only whole lines are events yet.
    lines = text.split("\n")[:-1]
    return [json.loads(line) for line in (line.strip() for line in lines) if line]


def demo_strategy(overrides: Sequence[str]) -> str:
    """The strategy the demo will run with these overrides (the preset's when they name none)."""
    return build_config(PRESETS["tiny"], list(overrides)).run.strategy


def demo_rounds(overrides: Sequence[str]) -> int:
    """Rounds the demo trains when --rounds is not given: more for strategies with one-step rounds."""
    return STRATEGY_DEMO_ROUNDS.get(demo_strategy(overrides), DEFAULT_ROUNDS)


def demo_config(rounds: int, overrides: list[str]) -> str:
    """The demo peers' TOML: the tiny preset, local timeouts, the strategy's demo defaults, then `overrides`."""
    base = {section: dict(values) for section, values in PRESETS["tiny"].items()}
    base["run"]["name"] = DEMO_RUN_NAME
    given = {(section, key) for section, key, _ in map(parse_override, overrides)}
    for key, value in STRATEGY_DEMO_DEFAULTS.get(demo_strategy(overrides), {}).items():
        if ("run", key) not in given:
            base["run"][key] = value
    base["run"]["max_rounds"] = rounds
    # Every peer is on this machine: a dead one drops out fast (member_ttl); a live straggler is waited for
    # up to match_timeout, which must cover how unevenly the peers share the cores.
    base["timeouts"] = {
        "heartbeat_interval": 0.5,
        "member_ttl": 5.0,
        "match_timeout": 20.0,
        "leader_timeout": 2.0,
        # A peer that vanished here crashed (loopback does not partition): wait for it briefly, then go on.
        "isolation_timeout": 15.0,
    }
    config = build_config(base, overrides)
    return to_toml(config)


def start_bootstrap(
    work_dir: Path,
    *,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    timeout: float = 60.0,
    runs: Sequence[str] = (DEMO_RUN_NAME,),
) -> tuple[subprocess.Popen[bytes], str]:
    """Start `farloco bootstrap` on `host`, checking the member records of `runs` (its --run; the demo's run by
    default, which every config made here uses); returns the process and its first multiaddr. One that has not
    written its multiaddrs within `timeout` seconds, or exited, is stopped (its whole session) and raises with
    its log's tail.

    `prefix` runs it through another command that execs it (`ip netns exec NS`: a host of a namespace WAN)."""
    maddr_file = work_dir / "bootstrap.maddr"
    log = open(work_dir / "bootstrap.log", "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        [
            *prefix,
            sys.executable,
            "-m",
            "farloco.node.tools.cli",
            "bootstrap",
            "--host",
            host,
            "--maddr-file",
            str(maddr_file),
            *(arg for name in runs for arg in ("--run", name)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while not maddr_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_process(process, timeout=5.0)
            log.close()
            tail = (work_dir / "bootstrap.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"bootstrap DHT node failed to start; see {work_dir / 'bootstrap.log'}, which ends:\n{tail}"
            )
        time.sleep(0.1)
    return process, maddr_file.read_text().split()[0]


def start_peer(
    name: str,
    work_dir: Path,
    config_path: Path,
    maddr: str,
    ranks: int,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    *,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> PeerProcess:
    """Start one `farloco join` process with its own run directory under `work_dir` (on `host`; `prefix` as
    for `start_bootstrap`)."""
    run_dir = work_dir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "stdout.log"
    # Appended to: a node started again in the same run directory keeps what its earlier life printed (a crash's
    # traceback is what one reads after it).
    log = open(log_path, "ab")  # noqa: SIM115 - closed with the process
    command = [
        *prefix,
        sys.executable, "-m", "farloco.node.tools.cli", "join",
        "--config", str(config_path),
        "--run-dir", str(run_dir),
        "--initial-peer", maddr,
        "--host", host,
        "--set", f"node.num_ranks={ranks}",
        *extra,
    ]  # fmt: skip
    env = dict(env or {})
    if not is_loopback(host) and SECRET_ENV not in env and SECRET_ENV not in os.environ:
        # Beyond loopback a node needs a run secret (auth): the peers started in one work_dir share one.
        env[SECRET_ENV] = swarm_secret(work_dir)
    # Own session: stop_process can then reach the node's DHT child and trainer ranks too.
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **env} if env else None,
    )
    return PeerProcess(name, run_dir, process, log_path)


def swarm_secret(work_dir: Path) -> str:
    """The run secret of the peers started in `work_dir` (made once, 32 random bytes in hex, mode 0600)."""
    import secrets

    path = work_dir / "run-secret"
    if not path.exists():
        write_atomic(path, secrets.token_hex(32) + "\n", mode=0o600)
    return path.read_text().strip()


def stop_process(*processes: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM (a graceful leave for a node) to every process at once, then SIGKILL to those still there after
    `timeout` seconds, and to each one's whole session. All at once: nodes that leave one after the other each
    wait for the ones still training, and a lone survivor trains on until its own stop."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        # Children that outlived their parent (the DHT process, trainer ranks) share its session id.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def run_lone_node(
    work: Path,
    config: Path,
    ranks: int,
    *,
    what: str,
    max_seconds: float,
    on_poll: Callable[[list[dict[str, Any]], float], None] | None = None,
) -> tuple[list[dict[str, Any]], Path]:
    """One node alone on 127.0.0.1 (its own bootstrap) until it exits after run.max_rounds (the benchmarks' way
    to measure a node): its round events (at least 3) and its run directory. `on_poll(rounds, elapsed)` is called
    every few seconds; an exit code other than 0 or a node past `max_seconds` raises with the log's tail."""
    bootstrap, maddr = start_bootstrap(work)
    peer = None
    started = time.monotonic()
    try:
        peer = start_peer("node", work, config, maddr, ranks)
        while peer.process.poll() is None:
            elapsed = time.monotonic() - started
            if elapsed > max_seconds:
                raise RuntimeError(f"{what}: the node did not finish in {max_seconds} s")
            if on_poll is not None:
                on_poll([e for e in read_events(peer.run_dir) if e["event"] == "round"], elapsed)
            time.sleep(2)
        if peer.process.returncode != 0:
            tail = peer.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what}: the node exited with {peer.process.returncode}:\n{tail}")
    finally:
        stop_process(*([peer.process] if peer is not None else []), bootstrap)
    events = [e for e in read_events(peer.run_dir) if e["event"] == "round"]
    if len(events) < 3:
        raise RuntimeError(f"{what}: expected at least 3 round events, got {len(events)}")
    return events, peer.run_dir


def run_demo(
    *,
    num_peers: int = 3,
    rounds: int | None = None,
    overrides: list[str] | None = None,
    first_ranks: int = 1,
    work_dir: Path | None = None,
    console: Console | None = None,
) -> int:
    """Run the demo; returns the exit code (0: trained, loss fell, hashes agreed). `rounds` None: the
    strategy's demo default (`demo_rounds`)."""
    console = console or Console()
    try:
        rounds = demo_rounds(overrides or []) if rounds is None else rounds
        if num_peers < 1 or rounds < 1:
            console.print(f"[red]--peers and --rounds must be >= 1 (got {num_peers}, {rounds})")
            return 2
        config_text = demo_config(rounds, overrides or [])
        _check_outer(config_text)
    except ConfigError as exc:
        console.print(f"[red]bad config: {exc}")
        return 2
    temporary = work_dir is None
    root = Path(tempfile.mkdtemp(prefix="farloco-demo-")) if work_dir is None else Path(work_dir)
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "demo.toml"
    config_path.write_text(config_text)
    run = build_config(tomllib.loads(config_text)).run
    console.print(
        f"[bold]farloco demo[/]: {num_peers} peers, {rounds} rounds of {run.inner_steps} inner steps, "
        f"strategy {run.strategy}, codec {run.codec}, run directories in {root}"
    )
    bootstrap: subprocess.Popen[bytes] | None = None
    peers: list[PeerProcess] = []
    started = time.monotonic()
    try:
        bootstrap, maddr = start_bootstrap(root)
        console.print(f"bootstrap DHT node: {maddr}")
        for i in range(num_peers):
            peers.append(start_peer(f"peer-{i}", root, config_path, maddr, first_ranks if i == 0 else 1))
        ok = _watch(peers, rounds, console)
    finally:
        stop_process(*(peer.process for peer in peers))
        if bootstrap is not None:
            stop_process(bootstrap)
    elapsed = time.monotonic() - started
    code = _report(peers, rounds, elapsed, console) if ok else 1
    if code != 0:
        for peer in peers:
            console.print(f"[yellow]--- last lines of {peer.log_path}")
            console.print(
                "\n".join(peer.log_path.read_text(errors="replace").splitlines()[-15:]), markup=False
            )
    if temporary and code == 0:
        shutil.rmtree(root, ignore_errors=True)
    elif code != 0:
        console.print(f"run directories kept in {root}")
    return code


def _check_outer(config_text: str) -> None:
    """Refuse a strategy/codec the daemon would refuse, before starting any process (ConfigError)."""
    from farloco.node.daemon.agent import build_outer
    from farloco.node.training.model import num_parameters
    from farloco.node.training.models import meta_spec

    config = build_config(tomllib.loads(config_text))
    build_outer(config, num_parameters(meta_spec(config.run.model).module))


def _watch(peers: list[PeerProcess], rounds: int, console: Console) -> bool:
    """Show a progress bar per peer until every peer exits; False if one failed or time ran out."""
    deadline = time.monotonic() + DEMO_TIMEOUT_SECONDS
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        tasks = {p.name: progress.add_task(p.name, total=rounds, info="starting") for p in peers}
        while True:
            running = 0
            for peer in peers:
                events = read_events(peer.run_dir)
                done = [e for e in events if e["event"] == "round"]
                info = "starting"
                if done:
                    last = done[-1]
                    info = f"loss {last['train_loss']:.3f}  sent {last['bytes_sent'] / 1e6:.2f} MB"
                if peer.process.poll() is None:
                    running += 1
                else:
                    info = (
                        "exited"
                        if peer.process.returncode == 0
                        else f"[red]failed ({peer.process.returncode})"
                    )
                progress.update(tasks[peer.name], completed=len(done), info=info)
            failed = [p for p in peers if p.process.poll() not in (None, 0)]
            if failed:
                return False
            if running == 0:
                return True
            if time.monotonic() > deadline:
                console.print(f"[red]demo did not finish within {DEMO_TIMEOUT_SECONDS:.0f}s")
                return False
            time.sleep(0.3)


def _report(peers: list[PeerProcess], rounds: int, elapsed: float, console: Console) -> int:
    per_peer = {p.name: [e for e in read_events(p.run_dir) if e["event"] == "round"] for p in peers}
    problems: list[str] = []
    notes: list[str] = []
    # Eval loss of the weights the ranks start the round from: theta_outer, or for streaming-diloco theta_outer's
    # freshly synced fragment merged into the local weights.
    table = Table(title="loss per round (held-out loss of the weights each round starts from)")
    table.add_column("round", justify="right")
    table.add_column("eval loss", justify="right")
    for peer in peers:
        table.add_column(f"{peer.name} train", justify="right")
    table.add_column("peers", justify="right")
    table.add_column("hashes agree")
    eval_losses: list[float] = []
    for round_id in range(1, rounds + 1):
        row_events = {
            name: next((e for e in ev if e["round_id"] == round_id), None) for name, ev in per_peer.items()
        }
        present = [e for e in row_events.values() if e is not None]
        if not present:
            problems.append(f"no peer committed round {round_id}")
            continue
        hashes = {e["outer_hash"] for e in present}
        agree = len(hashes) == 1
        if not agree:
            problems.append(f"round {round_id}: theta hashes disagree ({len(hashes)} distinct)")
        eval_loss = min((e["eval_loss"] for e in present if not math.isnan(e["eval_loss"])), default=math.nan)
        eval_losses.append(eval_loss)
        table.add_row(
            str(round_id - 1),
            f"{eval_loss:.4f}",
            *[f"{e['train_loss']:.4f}" if e else "-" for e in row_events.values()],
            str(len(present)),
            "[green]yes" if agree else "[red]NO",
        )
    console.print(table)
    bytes_table = Table(title="bytes sent per peer")
    for column in ("peer", "rounds", "sent", "DDP would send", "ratio", "outer hash (last)"):
        bytes_table.add_column(column, justify="right")
    for name, events in per_peer.items():
        sent = sum(e["bytes_sent"] for e in events)
        ddp = sum(e["ddp_bytes"] for e in events)
        bytes_table.add_row(
            name,
            str(len(events)),
            f"{sent / 1e6:.2f} MB",
            f"{ddp / 1e6:.2f} MB",
            f"{ddp / sent:.0f}x fewer" if sent else "-",
            events[-1]["outer_hash"][:16] if events else "-",
        )
        if len(events) < rounds:
            # Not a failure by itself: a peer that missed a round (late, or the DHT refused a record) takes the
            # swarm's state at the next boundary. What must hold is that it ends on the same model.
            notes.append(f"{name} committed {len(events)} of {rounds} rounds and caught up by state sync")
    console.print(bytes_table)
    if any(not events for events in per_peer.values()):
        problems.append("a peer committed no round at all")
    for note in notes:
        console.print(f"[yellow]note: {note}")
    finite = [x for x in eval_losses if not math.isnan(x)]
    if len(finite) >= 2 and not finite[-1] < finite[0]:
        problems.append(f"eval loss did not fall: {finite[0]:.4f} -> {finite[-1]:.4f}")
    if problems:
        for problem in problems:
            console.print(f"[red]problem: {problem}")
        return 1
    console.print(f"[green]done in {elapsed:.0f}s: loss fell, every peer holds the same theta_outer.")
    return 0
