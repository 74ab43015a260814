"""Peak host memory of one training node's whole process tree: farloco's against torchft's DiLoCo, on the same
model, batch and machine, in the same run.

    python benchmarks/node_memory.py --markdown                           # 125m, int8, 3 rounds of 2 inner steps
    python benchmarks/node_memory.py --preset tiny --rounds 3 --inner-steps 2 --markdown    # a quick check
    python benchmarks/node_memory.py --sides farloco --codec fp32 --json memory.json

Both sides train on CPU (farloco's node.device = cpu; torchft over gloo), one after the other, never together:

- **farloco**: a real node (`farloco bootstrap` + `farloco join` on 127.0.0.1, alone, so its group is itself,
  started as benchmarks/node_throughput.py starts it): 1 rank of `--threads` threads, run.strategy diloco,
  run.outer_update sync, run.codec `--codec`, `--rounds` rounds of `--inner-steps` inner steps of `--batch-size`
  x `--seq-len` tokens of the bundled corpus, held-out evaluation and checkpoints off. Its tree: the
  `farloco join` process (the agent) and all its descendants (the trainer rank, the DHT child the agent forks,
  its libp2p daemon p2pd, ...). The bootstrap DHT node is a process tree of its own, reported apart.
- **torchft** (torchft 0.2.0, `pip install torchft==0.2.0`; skipped with a message when it is not importable):
  a lighthouse (`torchft._torchft.LighthouseServer`, min_replicas 1, in a process of its own, reported apart)
  and one replica process: `torchft.Manager` (synchronous quorum, its own TCPStore) over a
  `torchft.process_group.ProcessGroupGloo`, and `torchft.local_sgd.DiLoCo` (sync_every = `--inner-steps`) around
  the same model (farloco's own `build_spec(preset, seed=0)`), the same inner step (farloco's `train_step`:
  its loss, grad clip 1.0, AdamW betas 0.9/0.95 with farloco's run.inner_lr and weight decay) on random tokens of
  the same batch, and SGD lr 0.7 momentum 0.9 Nesterov as the outer optimizer; it trains until `--rounds` outer
  steps are committed. torchft sends float32 pseudo-gradients: its quantized all-reduce needs triton (CUDA), and
  without it `should_quantize` falls back to float32 silently, so its codec column reads fp32 whatever `--codec`.
  Its tree: the replica process and its descendants.

The sampler: a thread of this process, every `--interval` seconds (0.2) while a side runs, lists the tree
(the root's descendants by psutil, plus every process of the root's session: each root is started as a session
leader, so a child that outlived its parent is still counted) and reads each member's /proc/PID/smaps_rollup
(psutil's `memory_full_info()`). Per sample it sums RSS and PSS over the tree; the table gives the largest sums
seen. RSS counts a page shared by several processes (the shared-memory hand-off between farloco's agent and its
ranks, the pages of the same libraries) once in every process that maps it, so a tree's RSS overstates what it
holds; PSS splits each shared page between the processes that map it, so the tree's PSS counts it once (a page
also mapped outside the tree, a library the bootstrap maps too, counts in part): PSS is the fair figure, RSS the
one `top` shows. The samples span the side's whole life, start-up and shutdown included. Per process it also keeps the peak RSS and PSS it was seen with, and
its own kernel high-water mark (VmHWM of /proc/PID/status, the exact peak RSS, which a 0.2 s sampler can miss):
the table's last column lists the biggest processes by peak PSS. A peak shorter than the interval is missed by
the sums; the JSON has the VmHWMs and their sum (an upper bound of the tree's peak RSS) to show how much, and
the tree's timeline (each sample's time, summed PSS and PSS per process role) with what each process held at
the tree's peak (`at_peak`). `--feedback-fp32` keeps farloco's error-feedback residual in float32
(`strategy_options.feedback_bf16 = false`; bfloat16 by default).

Bytes per parameter = peak tree PSS / the model's parameter count (float32 theta alone is 4). Everything a process
holds counts, the Python interpreter and torch's libraries included (a few hundred MB per process that imports
torch), which is why a node of several processes pays a fixed cost on a small model: `tiny` measures that fixed
cost, `125m` and up what scales with the model. Each side prints one JSON line (stdout; `--json` writes them all);
`--markdown` prints the table with the load average before the run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from node_throughput import _toml, node_overrides  # benchmarks/ is on sys.path when this file is run

from farloco.node.tools.demo import run_lone_node, stop_process

GB = 1e9


# ---- the sampler -------------------------------------------------------------------------------------------------
def _vm_hwm(pid: int) -> int:
    """VmHWM of /proc/PID/status (the kernel's peak RSS of that process), in bytes; 0 if unreadable."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def process_role(
    process: psutil.Process, root_pid: int, root_role: str, root_cmdline: list[str]
) -> str | None:
    """What a process of a node's tree is, from its name and command line (None once it is exiting: its command
    line reads empty then)."""
    if process.pid == root_pid:
        return root_role
    cmdline = process.cmdline()
    if not cmdline:
        return None
    text = " ".join(cmdline)
    if process.name() == "p2pd" or (cmdline and os.path.basename(cmdline[0]) == "p2pd"):
        return "p2pd"
    if "farloco.node.training.trainer" in text:
        return "rank"
    if "tokenize_worker" in text:
        return "tokenizer"
    if cmdline == root_cmdline:
        return f"{root_role} fork (DHT)" if "farloco.node.tools.cli" in text else f"{root_role} fork"
    if "resource_tracker" in text:
        return "resource tracker"
    return str(process.name())


class TreeSampler:
    """Samples, every `interval` seconds in a thread, the memory of the process tree whose root `find_root()`
    returns (None until it exists): the peaks of its summed RSS and PSS, and each member's own peaks."""

    def __init__(self, find_root: Callable[[], psutil.Process | None], role: str, interval: float) -> None:
        self.find_root = find_root
        self.role = role
        self.interval = interval
        self.root: psutil.Process | None = None
        self.root_cmdline: list[str] = []
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_rss_at = 0.0
        self.peak_pss_at = 0.0
        self.samples = 0
        # (seconds, summed PSS, {role: PSS}) per sample: when the tree peaked, and what each process held then
        self.timeline: list[tuple[float, int, dict[str, int]]] = []
        self.processes: dict[int, dict[str, Any]] = {}
        self._known: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sampler-{role}", daemon=True)
        self._started = 0.0

    def __enter__(self) -> TreeSampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _members(self) -> list[psutil.Process]:
        if self.root is None:
            self.root = self.find_root()
            if self.root is None:
                return []
            with contextlib.suppress(psutil.Error):
                self.root_cmdline = self.root.cmdline()
        found = {}
        with contextlib.suppress(psutil.Error):
            if self.root.is_running():
                found[self.root.pid] = self.root
                for child in self.root.children(recursive=True):
                    found[child.pid] = child
        # The root leads its own session (start_new_session): its children that outlived their parent are there.
        for pid in psutil.pids():
            if pid not in found:
                with contextlib.suppress(OSError):
                    if os.getsid(pid) == self.root.pid:
                        found[pid] = self._known.get(pid) or psutil.Process(pid)
        self._known = found  # one psutil.Process per pid: it notices a reused pid
        return list(found.values())

    def sample(self) -> None:
        rss = pss = 0
        by_role: dict[str, int] = {}
        elapsed = time.monotonic() - self._started
        for process in self._members():
            try:
                info = process.memory_full_info()
                role = process_role(process, self.root.pid if self.root else -1, self.role, self.root_cmdline)
                ppid = process.ppid()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            rss += info.rss
            pss += info.pss
            name = role or process.name()
            by_role[name] = by_role.get(name, 0) + info.pss
            entry = self.processes.setdefault(
                process.pid,
                {
                    "pid": process.pid,
                    "ppid": ppid,
                    "role": role or process.name(),
                    "peak_rss": 0,
                    "peak_pss": 0,
                    "vm_hwm": 0,
                    "first_seen": round(elapsed, 1),
                },
            )
            if role is not None:  # a spawned child reads as its parent until it execs
                entry["role"] = role
            entry["last_seen"] = round(elapsed, 1)
            entry["peak_rss"] = max(entry["peak_rss"], info.rss)
            entry["peak_pss"] = max(entry["peak_pss"], info.pss)
            entry["vm_hwm"] = max(entry["vm_hwm"], _vm_hwm(process.pid))
        self.samples += 1
        self.timeline.append((round(elapsed, 2), pss, by_role))
        if rss > self.peak_rss:
            self.peak_rss, self.peak_rss_at = rss, elapsed
        if pss > self.peak_pss:
            self.peak_pss, self.peak_pss_at = pss, elapsed

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            with contextlib.suppress(psutil.Error):
                self.sample()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def summary(self) -> dict[str, Any]:
        processes = sorted(self.processes.values(), key=lambda p: p["peak_pss"], reverse=True)
        return {
            "peak_pss": self.peak_pss,
            "peak_rss": self.peak_rss,
            "peak_pss_at_seconds": round(self.peak_pss_at, 1),
            "peak_rss_at_seconds": round(self.peak_rss_at, 1),
            "sum_vm_hwm": sum(p["vm_hwm"] for p in processes),
            "samples": self.samples,
            "processes": processes,
            # what each process held at the tree's peak
            "at_peak": next(
                (roles for at, _, roles in self.timeline if at == round(self.peak_pss_at, 2)), {}
            ),
            "timeline": self.timeline,
        }


def child_running(word: str) -> Callable[[], psutil.Process | None]:
    """A `find_root` for TreeSampler: this process's child whose command line holds `word` as an argument."""

    def find() -> psutil.Process | None:
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                if word in child.cmdline():
                    return child
        return None

    return find


# ---- farloco -----------------------------------------------------------------------------------------------------
def run_farloco(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_dir = work / "farloco"
    run_dir.mkdir(parents=True)
    sections = node_overrides(args)
    sections["run"].update(
        name="node-memory",
        model=args.preset,
        max_rounds=args.rounds,
        strategy="diloco",
        codec=args.codec,
        outer_update="sync",
    )
    if args.feedback_fp32:
        sections["run"]["strategy_options"] = {"feedback_bf16": False}
    sections["node"]["device"] = "cpu"
    sections["checkpoint"] = {"every_rounds": 0}
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml(value)}" for key, value in values.items())
    config = run_dir / "node.toml"
    config.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    with (
        TreeSampler(child_running("join"), "agent", args.interval) as node,
        TreeSampler(child_running("bootstrap"), "bootstrap", args.interval) as bootstrap,
    ):
        events, _ = run_lone_node(
            run_dir,
            config,
            1,
            what=f"farloco {args.preset}, {args.rounds} rounds",
            max_seconds=args.max_seconds,
            on_poll=lambda rounds, elapsed: print(
                f"  farloco: round {len(rounds)}/{args.rounds} ({elapsed:.0f} s)", file=sys.stderr, flush=True
            ),
        )
    return {
        **node.summary(),
        "codec": args.codec,
        "rounds_committed": len(events),
        "wall_seconds": round(time.monotonic() - started, 1),
        "apart": {"bootstrap": bootstrap.summary()},
    }


# ---- torchft -----------------------------------------------------------------------------------------------------
def torchft_lighthouse(args: argparse.Namespace) -> int:
    """`--torchft-lighthouse`: a torchft lighthouse until SIGTERM (or until the benchmark that started it is gone);
    its address goes to `--addr-file`."""
    from torchft._torchft import LighthouseServer

    from farloco.node.fsutil import write_atomic

    parent = os.getppid()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    write_atomic(Path(args.addr_file), lighthouse.address() + "\n")
    try:
        while os.getppid() == parent:
            time.sleep(1.0)
    finally:
        lighthouse.shutdown()
    return 0


def torchft_replica(args: argparse.Namespace) -> int:
    """`--torchft-replica`: one torchft DiLoCo replica of world size 1 (rank 0 runs its ManagerServer), training
    farloco's model with farloco's inner step until `--rounds` outer steps are committed; its figures, as JSON, to
    `--result`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    from farloco.node.config import build_config
    from farloco.node.training.model import model_config
    from farloco.node.training.models import build_spec
    from farloco.node.training.muon import build_inner_optimizer
    from farloco.node.training.trainer import train_step

    torch.set_num_threads(args.threads)
    parent = os.getppid()
    config = build_config(
        {
            "run": {
                "model": args.preset,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "inner_steps": args.inner_steps,
            }
        }
    )
    run = config.run
    spec = build_spec(args.preset, seed=run.seed)
    model = spec.module
    inner = build_inner_optimizer(
        model, "adamw", lr=run.inner_lr, weight_decay=run.inner_weight_decay, fused=False
    )
    outer = torch.optim.SGD(model.parameters(), lr=run.outer_lr, momentum=run.outer_momentum, nesterov=True)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    store = dist.TCPStore(  # type: ignore[attr-defined]
        host_name="localhost", port=0, is_master=True, wait_for_workers=False
    )
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,  # DiLoCo needs it
        replica_id="node-memory",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse_addr,
        hostname="localhost",
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=60),
    )
    vocab = model_config(args.preset).vocab_size
    generator = torch.Generator().manual_seed(0)
    steps, losses = 0, []
    started = time.monotonic()
    try:
        with DiLoCo(
            manager,
            [model],
            inner,
            outer,
            sync_every=args.inner_steps,
            backup_device=torch.device("cpu"),
            pin_memory=False,
        ):
            while manager.current_step() < args.rounds:
                if os.getppid() != parent:
                    raise SystemExit("the benchmark that started this replica is gone")
                if steps >= 3 * args.rounds * args.inner_steps:
                    raise RuntimeError(f"{steps} inner steps and only {manager.current_step()} commits")
                tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=generator)
                losses.append(float(train_step(spec, inner, tokens[:, :-1], tokens[:, 1:], config)))
                steps += 1
    finally:
        manager.shutdown(wait=False)
    Path(args.result).write_text(
        json.dumps(
            {
                "inner_steps_run": steps,
                "commits": manager.current_step(),
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "train_seconds": round(time.monotonic() - started, 1),
            }
        )
    )
    return 0


def torchft_available() -> str | None:
    """torchft's version, or None (with a message) when it cannot be imported."""
    try:
        torchft = importlib.import_module("torchft")
        importlib.import_module("torchft.local_sgd")
    except Exception as exc:  # not installed, or a wheel that does not match this torch
        print(
            f"torchft is not importable ({type(exc).__name__}: {exc}): the torchft side is skipped "
            "(pip install torchft==0.2.0)",
            file=sys.stderr,
            flush=True,
        )
        return None
    with contextlib.suppress(Exception):
        return str(importlib.metadata.version("torchft"))
    return str(getattr(torchft, "__version__", "?"))


def _own_command(*extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *extra]


def run_torchft(args: argparse.Namespace, work: Path, version: str) -> dict[str, Any]:
    folder = work / "torchft"
    folder.mkdir(parents=True)
    addr_file, result = folder / "lighthouse.addr", folder / "replica.json"
    processes: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()

    def start(name: str, command: list[str]) -> subprocess.Popen[bytes]:
        with open(folder / f"{name}.log", "wb") as log:
            # Own session: the sampler finds the orphans there, stop_process kills the whole session.
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        processes.append(process)
        return process

    def fail(name: str, what: str) -> RuntimeError:
        tail = (folder / f"{name}.log").read_text(errors="replace")[-3000:]
        return RuntimeError(f"torchft: {what}; {folder / f'{name}.log'} ends:\n{tail}")

    try:
        with TreeSampler(child_running("--torchft-lighthouse"), "lighthouse", args.interval) as lighthouse:
            beacon = start("lighthouse", _own_command("--torchft-lighthouse", "--addr-file", str(addr_file)))
            deadline = time.monotonic() + 120.0
            while not addr_file.exists():
                if beacon.poll() is not None or time.monotonic() > deadline:
                    raise fail("lighthouse", "the lighthouse did not start")
                time.sleep(0.1)
            common = [
                "--preset", args.preset, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps),
                "--threads", str(args.threads),
            ]  # fmt: skip
            with TreeSampler(child_running("--torchft-replica"), "replica", args.interval) as replica:
                worker = start(
                    "replica",
                    _own_command(
                        "--torchft-replica",
                        "--lighthouse-addr",
                        addr_file.read_text().strip(),
                        "--result",
                        str(result),
                        *common,
                    ),
                )
                try:
                    code = worker.wait(timeout=args.max_seconds)
                except subprocess.TimeoutExpired:
                    raise fail("replica", f"the replica did not finish in {args.max_seconds} s") from None
                if code != 0:
                    raise fail("replica", f"the replica exited with {code}")
    finally:
        stop_process(*processes, timeout=10.0)
    return {
        **replica.summary(),
        "codec": "fp32",
        "torchft": version,
        **json.loads(result.read_text()),
        "wall_seconds": round(time.monotonic() - started, 1),
        "apart": {"lighthouse": lighthouse.summary()},
    }


# ---- report ------------------------------------------------------------------------------------------------------
def _biggest(processes: list[dict[str, Any]], count: int = 4) -> str:
    return ", ".join(f"{p['role']} {p['peak_pss'] / GB:.2f}" for p in processes[:count])


def markdown(
    results: list[dict[str, Any]], args: argparse.Namespace, loadavg: tuple[float, ...], skipped: list[str]
) -> str:
    lines = [
        f"Load average before: {' '.join(f'{x:.2f}' for x in loadavg)} (1, 5, 15 min) on {os.cpu_count()} CPUs. "
        f"CPU, 1 rank / replica of {args.threads} thread(s), batch {args.batch_size} x {args.seq_len} tokens, "
        f"{args.rounds} rounds of {args.inner_steps} inner steps; sampled every {args.interval} s; GB = 10^9 bytes.",
        "",
        "| side | preset | parameters | codec | peak tree PSS (GB) | peak tree RSS (GB) | PSS bytes / parameter "
        "| biggest processes (peak PSS, GB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['side']} | {r['preset']} | {r['params'] / 1e6:.1f}M | {r['codec']} | {r['peak_pss'] / GB:.2f} | "
            f"{r['peak_rss'] / GB:.2f} | {r['pss_bytes_per_param']:.1f} | {_biggest(r['processes'])} |"
        )
    lines.append("")
    for r in results:
        for name, apart in r["apart"].items():
            lines.append(
                f"- {r['side']}'s {name} (a process tree of its own, not in the figures above): peak PSS "
                f"{apart['peak_pss'] / GB:.2f} GB, RSS {apart['peak_rss'] / GB:.2f} GB."
            )
    lines.extend(f"- {side}: skipped (not importable here)." for side in skipped)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="125m", help="model preset (node/training/model.py)")
    parser.add_argument("--codec", default="int8", help="farloco's run.codec (torchft sends fp32 on CPU)")
    parser.add_argument("--rounds", type=int, default=3, help="outer rounds (farloco needs at least 3)")
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the rank and of the replica")
    parser.add_argument("--sides", nargs="+", default=["farloco", "torchft"], choices=("farloco", "torchft"))
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="per side")
    parser.add_argument(
        "--feedback-fp32",
        action="store_true",
        help="farloco's error-feedback residual in float32 (strategy_options feedback_bf16 = false)",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--work", type=Path, default=None, help="keep the runs' folders here")
    # The processes this file starts for the torchft side.
    parser.add_argument("--torchft-replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torchft-lighthouse", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse-addr", default="", help=argparse.SUPPRESS)
    parser.add_argument("--addr-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    # What node_throughput.node_overrides reads: one rank, fp32, nothing else around the inner step.
    parser.set_defaults(
        ranks=1,
        precision="fp32",
        compile=False,
        activation_checkpointing=False,
        micro_batches=1,
        log_every_steps=0,
    )
    args = parser.parse_args(argv)
    if args.torchft_lighthouse:
        return torchft_lighthouse(args)
    if args.torchft_replica:
        return torchft_replica(args)
    if args.rounds < 3:
        parser.error("--rounds: at least 3 (a lone farloco node is measured over at least 3 round events)")

    from farloco.node.training.model import num_parameters
    from farloco.node.training.models import meta_spec

    # A SIGTERM (timeout, a CI runner) unwinds like Ctrl-C: the `finally`s stop every process started here.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    params = num_parameters(meta_spec(args.preset).module)
    loadavg = os.getloadavg()
    print(f"load average before: {loadavg}", file=sys.stderr, flush=True)
    version = torchft_available() if "torchft" in args.sides else None
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    with contextlib.ExitStack() as stack:
        tmp = (
            str(args.work)
            if args.work
            else stack.enter_context(tempfile.TemporaryDirectory(prefix="farloco-memory-"))
        )
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for side in args.sides:
            if side == "torchft" and version is None:
                skipped.append(side)
                continue
            before = os.getloadavg()
            print(f"{side}: {args.preset}, load average {before[0]:.2f}", file=sys.stderr, flush=True)
            figures = (
                run_farloco(args, Path(tmp))
                if side == "farloco"
                else run_torchft(args, Path(tmp), version or "?")
            )
            results.append(
                {
                    "side": side,
                    "preset": args.preset,
                    "params": params,
                    "batch_size": args.batch_size,
                    "seq_len": args.seq_len,
                    "rounds": args.rounds,
                    "inner_steps": args.inner_steps,
                    "loadavg_before": before,
                    **figures,
                    "pss_bytes_per_param": figures["peak_pss"] / params,
                    "rss_bytes_per_param": figures["peak_rss"] / params,
                }
            )
            print(json.dumps(results[-1]), flush=True)
            if args.json is not None:  # after each side: a run cut short keeps what it measured
                args.json.write_text(
                    json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results})
                )
    if args.markdown:
        print(
            f"\nCommand: `python benchmarks/node_memory.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
        )
        print(markdown(results, args, loadavg, skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
