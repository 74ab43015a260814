"""Two farloco nodes on one machine, one GPU: seconds per round, tokens/s, the ranks' idle share, bytes and hashes.

    python benchmarks/gpu_swarm.py --preset tiny --rounds 4 --inner-steps 5 --json gs.json      # CPU (a test)
    python benchmarks/gpu_swarm.py --preset 125m --rounds 10 --rate 1gbit --rtt-ms 50 \\
        --json gpu-swarm.json --work /tmp/gs                                                    # one GPU

Two `farloco join` nodes of 1 rank each (on a GPU both nodes' ranks share it, cuda:0, NCCL inside each node) train
`--rounds` rounds of the same run: `--preset` (125m on CUDA, else tiny), run.strategy diloco, run.codec int8,
run.outer_update delayed, H = `--inner-steps`, batch `--batch-size` x `--seq-len` per node (8 x 2048 on CUDA,
4 x 128 on CPU), node.precision bf16 and node.compile on CUDA (fp32, no compile on CPU), no held-out evaluation,
no checkpoints; the demo's timeouts otherwise (farloco.node.tools.demo.demo_config). Two scenarios, same settings:

- **loopback**: a `farloco bootstrap` and both nodes on 127.0.0.1 (network.encryption auto: no TLS there);
- **wan**: each node in a network namespace of its own (node/tools/netns.py, as benchmarks/wan.py makes them:
  2 hosts on a hub, `--rate` both ways on every uplink, `--rtt-ms` round trip through the netem relay), the
  bootstrap on host 1, TLS 1.3 between the hosts. Needs root and a TUN device; where namespaces cannot be made
  the reason is printed (and kept in the JSON) and only loopback runs.

Per scenario, from the nodes' round events (logs/agent.jsonl): **seconds per round**, the median of the wall time
between commits over rounds 2..N-1 (the first includes start-up and compile; in the last, with the delayed update,
the ranks wait for the exchange), as benchmarks/node_throughput.py leaves them out; **tokens/s over whole rounds**,
both nodes' tokens over the same rounds; each node's **GPU idle share**, the ranks' idle time over the wall time of
those rounds (`ranks_idle_seconds`, counted when a wait ends, at the next hand-off: the wait for commit k is in
event k+1's count); **bytes sent per round per node**: on the wan, each host's uplink tx counter (every byte it
sent: DHT, gRPC, TLS, the exchange) before and after, over the rounds it committed; on loopback, what the node's
round events count (`bytes_sent`: the outer updates' payload, also given for the wan); and whether **every round's
outer hash** (`outer_hash`: the digest of theta_outer the round committed) agreed between the nodes.

Results: a markdown table on stdout, per-round rows on stderr, `--json` with both scenarios' figures, every round's
row, the settings, the torch version and the device. The exit status is nonzero where hashes disagree or a node
failed (the tails of its logs are printed); every process started is stopped and every namespace removed at the
end, also on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from node_throughput import _toml, node_overrides
from wan import tx_bytes

from farloco.node.tools.demo import (
    PeerProcess,
    demo_config,
    read_events,
    start_bootstrap,
    start_peer,
    stop_process,
)

NODES = 2
STOP_SECONDS = 5.0
"""How long a node that is still running when a scenario ends gets to leave before SIGKILL: short, so that an
interrupt's clean-up ends well within the 10 s a `timeout -k 10` leaves before it kills this process."""


class NodeFailed(RuntimeError):
    """A node exited nonzero, or the scenario ran past --max-seconds."""


class ScenarioInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during a scenario: what it measured until then rides along."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("interrupted")
        self.result = result


def node_config(args: argparse.Namespace) -> str:
    """The nodes' TOML: the demo's config with node_throughput's node settings and this benchmark's run."""
    sections = node_overrides(
        argparse.Namespace(**vars(args), ranks=1, threads=1, activation_checkpointing=False, micro_batches=1)
    )
    sections["run"].update(
        name="gpu-swarm", model=args.preset, strategy="diloco", codec="int8", outer_update="delayed", seed=0
    )
    sections["checkpoint"] = {"every_rounds": 0}
    overrides = [
        f"{s}.{key}={_toml(value)}" for s, values in sections.items() for key, value in values.items()
    ]
    return str(demo_config(args.rounds, overrides))


class Interrupts:
    """SIGINT and SIGTERM raise KeyboardInterrupt once (the clean-up that follows is not interrupted again); one
    that comes while the processes of a scenario are being stopped waits until they are."""

    def __init__(self) -> None:
        self.fired = False
        self.pending = False
        self.holding = 0

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        if self.fired:
            return
        if self.holding:
            self.pending = True
            return
        self.fired = True
        raise KeyboardInterrupt(f"signal {signum}")

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
        if not self.holding and self.pending and not self.fired:
            self.fired = True
            raise KeyboardInterrupt("signal")


INTERRUPTS = Interrupts()


def log_tails(work: Path, peers: Sequence[PeerProcess], chars: int = 3000) -> str:
    """The last `chars` characters of each node's logs (its output, where the agent logs too, and the trainer
    ranks' files) and of the bootstrap's."""
    paths = []
    for peer in peers:
        trainer = sorted(p for p in (peer.run_dir / "logs" / "trainer").rglob("*") if p.is_file())
        paths += [peer.log_path, *trainer[-4:]]
    parts = []
    for path in [*paths, work / "bootstrap.log"]:
        text = path.read_text(errors="replace")[-chars:].strip() if path.is_file() else ""
        if text:
            parts.append(f"--- {path}, its end:\n{text}")
    return "\n".join(parts)


def stop_strays(work: Path, peers: Sequence[PeerProcess]) -> list[str]:
    """SIGKILL what still runs with this scenario's folder on its command line once the nodes are stopped (a
    trainer rank runs in a session of its own: a node stopped while it starts its ranks can leave one behind),
    and remove the nodes' hand-off files from /dev/shm. Returns the processes stopped ("pid command")."""
    mine = f"{work}{os.sep}".encode()
    stopped = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if mine in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
                command = cmdline.replace(b"\0", b" ").decode(errors="replace")
                stopped.append(f"{entry} {command[:120]}")
    for peer in peers:
        for path in Path("/dev/shm").glob(f"farloco-handoff-{peer.process.pid}-*"):
            with contextlib.suppress(OSError):
                path.unlink()
    return stopped


def run_nodes(
    work: Path, config: Path, args: argparse.Namespace, wan: Any | None, peers: list[PeerProcess]
) -> tuple[list[int] | None, float]:
    """The bootstrap and both nodes (on 127.0.0.1, or on hosts 1 and 2 of `wan`) until both exit; the nodes are
    appended to `peers`. Returns each host's uplink tx bytes over the run (None on loopback) and the wall time."""

    def host(i: int) -> str:
        return str(wan.address(i)) if wan is not None else "127.0.0.1"

    def prefix(i: int) -> Sequence[str]:
        return wan.prefix_command(i) if wan is not None else ()

    before = [tx_bytes(wan, i) for i in range(1, NODES + 1)] if wan is not None else None
    started = time.monotonic()
    bootstrap = None
    try:
        # Not interrupted half-way: a process started is one the clean-up below knows of.
        with INTERRUPTS.held():
            bootstrap, maddr = start_bootstrap(work, host=host(1), prefix=prefix(1))
        for i in range(1, NODES + 1):
            with INTERRUPTS.held():
                peers.append(start_peer(f"node{i}", work, config, maddr, 1, host=host(i), prefix=prefix(i)))
        shown: list[int] = []
        while any(p.process.poll() is None for p in peers):
            failed = [p for p in peers if p.process.poll() not in (None, 0)]
            if failed:
                codes = ", ".join(f"{p.name} exited with {p.process.returncode}" for p in failed)
                raise NodeFailed(codes)
            if time.monotonic() - started > args.max_seconds:
                raise NodeFailed(f"the nodes did not finish in {args.max_seconds:g} s")
            done = [sum(1 for e in read_events(p.run_dir) if e["event"] == "round") for p in peers]
            if done != shown:
                print(
                    f"  {time.monotonic() - started:6.1f} s: rounds committed {done}",
                    file=sys.stderr,
                    flush=True,
                )
                shown = done
            time.sleep(0.5)
        failed = [p for p in peers if p.process.returncode != 0]
        if failed:
            codes = ", ".join(f"{p.name} exited with {p.process.returncode}" for p in failed)
            raise NodeFailed(codes)
        wall = time.monotonic() - started
        sent = None
        if wan is not None and before is not None:
            sent = [tx_bytes(wan, i) - b for i, b in zip(range(1, NODES + 1), before, strict=True)]
    finally:
        with INTERRUPTS.held():
            stop_process(*(p.process for p in peers), timeout=STOP_SECONDS)
            if bootstrap is not None:
                stop_process(bootstrap, timeout=1.0)
            stray = stop_strays(work, peers)
            if stray:
                print(
                    f"  stopped {len(stray)} process(es) the nodes left: {stray}", file=sys.stderr, flush=True
                )
    return sent, wall


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(peers: list[PeerProcess], sent: list[int] | None, args: argparse.Namespace) -> dict[str, Any]:
    """The scenario's figures from the nodes' round events (and the uplinks' tx bytes)."""
    rounds = [
        sorted((e for e in read_events(p.run_dir) if e["event"] == "round"), key=lambda e: e["round_id"])
        for p in peers
    ]
    tokens_per_step = args.batch_size * args.seq_len
    intervals: list[float] = []
    node_tokens_per_second: list[float | None] = []
    idle_share: list[float | None] = []
    for done in rounds:
        # Commits 1..N-1: the intervals of rounds 2..N-1 (the first round and the last left out).
        window = done[:-1]
        gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(window)]
        intervals.extend(gaps)
        wall = window[-1]["time"] - window[0]["time"] if len(window) >= 2 else 0.0
        if wall > 0:
            # The ranks' wait is counted when it ends, at the hand-off of their next sequence, which comes just
            # after a commit's event is written: the wait for commit k shows in event k+1's counter. Rounds
            # 2..N-1's waits are thus those between events 2 and N (the first round's start-up wait left out).
            idle = done[-1]["ranks_idle_seconds"] - done[1]["ranks_idle_seconds"]
            # The inner steps the node's contributions carried over those rounds (H each, unless cut short).
            steps = window[-1].get("inner_step", 0) - window[0].get("inner_step", 0)
            node_tokens_per_second.append((steps or len(gaps) * args.inner_steps) * tokens_per_step / wall)
            idle_share.append(max(0.0, idle / wall))
        else:
            node_tokens_per_second.append(None)
            idle_share.append(None)
    hashes: dict[int, dict[str, str]] = {}
    for peer, done in zip(peers, rounds, strict=True):
        for e in done:
            hashes.setdefault(e["round_id"], {})[peer.name] = e["outer_hash"]
    common = sorted(r for r, held in hashes.items() if len(held) == NODES)
    forked = sorted(r for r, held in hashes.items() if len(set(held.values())) > 1)
    first = min((e["time"] for done in rounds for e in done), default=0.0)
    rows = []
    for round_id in sorted(hashes):
        row: dict[str, Any] = {"round_id": round_id, "hashes_agree": round_id not in forked}
        for peer, done in zip(peers, rounds, strict=True):
            at = next((k for k, e in enumerate(done) if e["round_id"] == round_id), None)
            if at is None:
                row[peer.name] = None
                continue
            e, prev = done[at], done[at - 1] if at else None
            after = done[at + 1] if at + 1 < len(done) else None
            row[peer.name] = {
                "time": e["time"] - first,
                "interval": e["time"] - prev["time"] if prev else None,
                # the ranks' wait for this commit: counted by the next event (see above); None for the last
                "ranks_idle": after["ranks_idle_seconds"] - e["ranks_idle_seconds"] if after else None,
                "agent_seconds": e.get("seconds"),
                "phases": e.get("phases", {}),
                "bytes_sent": e.get("bytes_sent"),
                "group_size": len(e.get("group", [])),
                "inner_step": e.get("inner_step"),
                "outer_hash": e["outer_hash"],
            }
        rows.append(row)
    steady = [t for t in node_tokens_per_second if t is not None]
    reported = [sum(e.get("bytes_sent", 0) for e in done) / len(done) if done else None for done in rounds]
    return {
        "rounds_committed": [len(done) for done in rounds],
        "seconds_per_round": _median(intervals),
        "intervals": intervals,
        "tokens_per_second": sum(steady) if len(steady) == NODES else None,
        "node_tokens_per_second": node_tokens_per_second,
        "idle_share": idle_share,
        "bytes_per_round": (
            [s / len(done) if done else None for s, done in zip(sent, rounds, strict=True)]
            if sent is not None
            else reported
        ),
        "bytes_measured": "uplink tx" if sent is not None else "node events (outer updates' payload)",
        "uplink_tx_bytes": sent,
        "node_bytes_sent_per_round": reported,
        "rounds_in_both": common,
        "forked_rounds": forked,
        "hashes_agree": not forked if common else None,  # None: no round that both nodes committed
        "rows": rows,
    }


def run_scenario(
    name: str, work: Path, config: Path, args: argparse.Namespace, wan: Any | None
) -> dict[str, Any]:
    """One scenario; a failed or interrupted one keeps what its nodes logged (an interrupt is raised again)."""
    work.mkdir(parents=True, exist_ok=True)
    link = f"{args.rate}, {args.rtt_ms:g} ms RTT (netns)" if wan is not None else "127.0.0.1"
    result: dict[str, Any] = {"scenario": name, "link": link, "work": str(work)}
    print(f"{name} ({link}): {NODES} nodes, {args.rounds} rounds", file=sys.stderr, flush=True)
    peers: list[PeerProcess] = []
    try:
        sent, wall = run_nodes(work, config, args, wan, peers)
    except (NodeFailed, KeyboardInterrupt) as exc:
        failed = isinstance(exc, NodeFailed)
        if failed:  # the tails once the processes are stopped: what they wrote on the way out too
            print(f"{name}: {exc}\n{log_tails(work, peers)}", file=sys.stderr, flush=True)
        result.update(status="failed" if failed else "interrupted", error=str(exc) or "interrupted")
        if len(peers) == NODES:
            result.update(measure(peers, None, args))
        if not failed:
            raise ScenarioInterrupted(result) from exc
        return result
    result.update(status="ok", wall_seconds=wall, **measure(peers, sent, args))
    print(rounds_table(result, [p.name for p in peers]), file=sys.stderr, flush=True)
    return result


def rounds_table(result: dict[str, Any], names: Sequence[str]) -> str:
    lines = [
        f"{result['scenario']}: per round (seconds: its commit since the first; since the commit before; the ranks' "
        "wait for it; MB sent by the node's count)",
        "",
        "| round | " + " | ".join(f"{n}: commit, interval, idle, MB" for n in names) + " | hash |",
        "|---|" + "---|" * len(names) + "---|",
    ]
    for row in result["rows"]:
        cells = []
        for n in names:
            c = row[n]
            if c is None:
                cells.append("-")
                continue
            interval = f"{c['interval']:.2f}" if c["interval"] is not None else "-"
            mb = f"{c['bytes_sent'] / 1e6:.2f}" if c["bytes_sent"] is not None else "-"
            idle = f"{c['ranks_idle']:.2f}" if c["ranks_idle"] is not None else "-"
            cells.append(f"{c['time']:.2f}, {interval}, {idle}, {mb}")
        held = {row[n]["outer_hash"][:12] for n in names if row[n] is not None}
        mark = ", ".join(sorted(held)) + ("" if row["hashes_agree"] else " DISAGREE")
        lines.append(f"| {row['round_id']} | " + " | ".join(cells) + f" | {mark} |")
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def markdown(results: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = [
        f"{settings['preset']}, 2 nodes x 1 rank on one machine ({settings['device']}), diloco int8, outer update "
        f"delayed, H = {settings['inner_steps']}, batch {settings['batch_size']} x {settings['seq_len']} per node, "
        f"precision {settings['precision']}, compile {settings['compile']}; torch {settings['torch']}. Rounds 2..N-1 "
        "(first and last left out); tokens/s of both nodes together.",
        "",
        "| scenario | link | rounds | s/round (median) | tokens/s whole rounds | GPU idle share (node 1 / node 2) "
        "| MB sent per round per node | hashes agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "rows" not in r:  # skipped, or failed before both nodes started
            lines.append(
                f"| {r['scenario']} | {r['link']} | - | - | - | - | - | {r['status']}: {r['error']} |"
            )
            continue
        idle = " / ".join(_fmt(s, ".1%") for s in r["idle_share"])
        sent = " / ".join(_fmt(b / 1e6 if b is not None else None, ".2f") for b in r["bytes_per_round"])
        how = "uplink tx" if r["uplink_tx_bytes"] is not None else "outer updates, node's count"
        agree = {True: "yes", False: "NO", None: "-"}[r["hashes_agree"]]
        if r["status"] != "ok":
            agree += f" ({r['status']}: {r['error']})"
        lines.append(
            f"| {r['scenario']} | {r['link']} | {' / '.join(map(str, r['rounds_committed']))} | "
            f"{_fmt(r['seconds_per_round'], '.2f')} | {_fmt(r['tokens_per_second'], '.0f')} | {idle} | "
            f"{sent} ({how}) | {agree} |"
        )
    return "\n".join(lines)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="125m" if cuda else "tiny")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8 if cuda else 4)
    parser.add_argument("--seq-len", type=int, default=2048 if cuda else 128)
    parser.add_argument("--precision", default="bf16" if cuda else "fp32", choices=("fp32", "bf16"))
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=cuda,
        help="node.compile (default: on CUDA)",
    )
    parser.add_argument("--rate", default="1gbit", help="wan: each uplink's rate, both ways (tc tbf)")
    parser.add_argument("--rtt-ms", type=float, default=50.0, help="wan: round-trip time (half each way)")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=["loopback", "wan"],
        choices=("loopback", "wan"),
        help="which to run",
    )
    parser.add_argument("--max-seconds", type=float, default=900.0, help="bound on each scenario's nodes")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the results here (after each scenario)"
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="the nodes' run folders (default: a temporary one, kept on failure)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (the first and the last round are left out)")

    from farloco.node.tools.netns import NamespaceWAN, relay_unavailable

    INTERRUPTS.install()  # SIGTERM unwinds as Ctrl-C does: the processes stopped, the namespaces removed
    work = (args.work or Path(tempfile.mkdtemp(prefix="farloco-gpu-swarm-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    config = work / "node.toml"
    config.write_text(node_config(args))
    settings = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "strategy": "diloco",
        "codec": "int8",
        "outer_update": "delayed",
        "ranks_per_node": 1,
        "eval_batches": 0,
        "checkpoint_every_rounds": 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "device": device_name(),
        "python": platform.python_version(),
    }
    results: list[dict[str, Any]] = []
    notes: list[str] = []

    def save() -> None:
        if args.json is not None:
            payload = {"settings": settings, "notes": notes, "results": results}
            args.json.write_text(json.dumps(payload, indent=1))

    code = 0
    try:
        for name in args.scenarios:
            if name == "loopback":
                results.append(run_scenario(name, work / name, config, args, None))
            else:
                with INTERRUPTS.held():  # its probe namespace is made and removed at once
                    reason = relay_unavailable()
                if reason is not None:
                    print(f"wan: not run: {reason}", file=sys.stderr, flush=True)
                    notes.append(f"wan not run: {reason}")
                    results.append({"scenario": "wan", "link": "-", "status": "skipped", "error": reason})
                    save()
                    continue
                # The netem relay delays each direction: half the round trip each way (benchmarks/wan.py).
                with NamespaceWAN(NODES, args.rate, delay_ms=args.rtt_ms / 2) as wan:
                    results.append(run_scenario(name, work / name, config, args, wan))
            save()
            if results[-1]["status"] == "failed":
                break
    except KeyboardInterrupt as exc:
        if isinstance(exc, ScenarioInterrupted):
            results.append(exc.result)
        print(
            "interrupted: the processes are stopped and the namespaces removed", file=sys.stderr, flush=True
        )
        notes.append("interrupted")
        code = 130
    save()
    print(markdown(results, settings))
    ran = [r for r in results if r["status"] != "skipped"]
    if code == 0 and (any(r["status"] != "ok" or not r["hashes_agree"] for r in ran) or not ran):
        code = 1
    if code == 0 and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    elif code != 0:
        print(f"run folders kept in {work}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
