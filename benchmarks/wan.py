"""Time to loss over a slow link: plain DDP against farloco's strategies, every node in its own network namespace.

    python benchmarks/wan.py                                   # tiny, 4 hosts, 100 Mbit/s, 50 ms RTT
    python benchmarks/wan.py --preset small --rate 1gbit --rtt-ms 100 --variants ddp diloco-int8

Needs root (node/tools/netns.py: 4 namespaces on a shaped hub, the userspace netem relay for the delay). For each
variant the same 4 hosts, the same model (run.model = the preset, seed 0), the same data (host i trains data slot
i-1 of the builtin corpus), the same per-node batch, learning rate, warm-up and AdamW:

- **ddp**: torch DDP over gloo through the links (rank i on host i, the rendezvous on host 1), `--ddp-steps`
  steps; rank 0 evaluates the held-out batches the nodes evaluate (node.eval_batches) every `--eval-every` steps.
  Its loss after the last step is the **target**.
- **farloco variants** (`farloco bootstrap` on host 1, one `farloco join` per host, 1 rank each): diloco with the
  int8 codec, streaming-diloco, diloco-int8 with run.outer_update = delayed, demo and sparseloco (each with its
  demo defaults otherwise), until a round's held-out loss reaches the target or `--max-steps` inner steps.

Every host is a machine of `--cpus-per-host` cores (a CPU cgroup with a CFS quota; default: this machine's
cores less 0.2 for the relay, shared out, at most 1): hosts that share the cores cannot borrow each other's idle
time, so a rank that waits on its link leaves its share unused, as on separate machines. Without the cap, 4 hosts
on 2 cores let DDP's mostly-waiting ranks lend their cores to nobody while farloco's always-busy ranks fight
over them (measured: a farloco inner step took 3.5x its time alone).

Per variant: the wall time to the target (from when every rank/node is up: DDP's first step, the last node's
`joined`), the inner steps it took, each node's **compute utilization** (DDP: the local step time measured
without communication x steps / wall; farloco: 1 - the ranks' idle time / wall, from the round events) and the
bytes each host sent (its uplink's tx counter: every protocol's real traffic, DHT and gRPC included). Results go to
a JSON file, a markdown table (pasted into BENCHMARKS.md) and a PNG of held-out loss against wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HOSTS = 4
VARIANTS: dict[str, list[str]] = {
    "diloco-int8": ['run.strategy="diloco"', 'run.codec="int8"'],
    "streaming-diloco": ['run.strategy="streaming-diloco"', 'run.codec="int8"'],
    "delayed": [
        'run.strategy="diloco"',
        'run.codec="int8"',
        'run.outer_update="delayed"',
        "run.outer_momentum=0.5",
    ],
    "demo": ['run.strategy="demo"'],
    "sparseloco": ['run.strategy="sparseloco"'],
}


def base_overrides(args: argparse.Namespace, variant: str = "ddp") -> list[str]:
    # DeMo's round is one inner step (its demo default): every other variant syncs every --inner-steps.
    steps = [] if variant == "demo" else [f"run.inner_steps={args.inner_steps}"]
    return [
        f'run.model="{args.preset}"',
        f"run.data_slots={HOSTS}",
        *steps,
        f"run.batch_size={args.batch_size}",
        f"run.seq_len={args.seq_len}",
        "run.seed=0",
        "node.eval_batches=4",
        "checkpoint.every_rounds=0",
        # The config's defaults, not the loopback demo's twice-as-eager heartbeat (its DHT traffic and CPU).
        "timeouts.heartbeat_interval=1.0",
        "timeouts.member_ttl=8.0",
        # TLS 1.3 beyond loopback is the default; --encryption off measures what it costs.
        *(["network.encryption=off", "auth.insecure_no_secret=true"] if args.encryption == "off" else []),
        *(
            [
                f"timeouts.match_timeout={args.match_timeout}",
                f"timeouts.match_timeout_min={min(2.0, args.match_timeout)}",
            ]
            if args.match_timeout
            else []
        ),
    ]


# -- DDP --------------------------------------------------------------------------------------------------------


def ddp_rank(args: argparse.Namespace) -> None:
    """One DDP rank (run inside host rank+1): the benchmark's baseline."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from farloco.node.config import load_config
    from farloco.node.training.data import BatchSampler, eval_batches, open_dataset
    from farloco.node.training.models import build_spec
    from farloco.node.training.muon import build_inner_optimizer
    from farloco.node.training.trainer import learning_rate, train_step

    torch.set_num_threads(1)
    config = load_config(Path(args.config))
    run = config.run
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:29512",
        rank=args.rank,
        world_size=HOSTS,
        timeout=_timedelta(600),
    )
    spec = build_spec(run.model, seed=run.seed)
    # The rotary tables are buffers that never change: no broadcast of them before every forward.
    model = DistributedDataParallel(spec.module, broadcast_buffers=False)
    # Rank 0 evaluates the plain module: a forward through DDP is a collective the other ranks are not in.
    plain = dataclasses.replace(spec)
    spec.module = model
    optimizer = build_inner_optimizer(
        model, "adamw", lr=run.inner_lr, weight_decay=run.inner_weight_decay, fused=False
    )
    dataset = open_dataset(Path(args.dataset))
    sampler = BatchSampler(
        dataset, "train", run.seq_len, run.batch_size, slot=args.rank, num_slots=run.data_slots, rank=0,
        world_size=1, seed=run.seed,
    )  # fmt: skip
    held_out = eval_batches(dataset, run.seq_len, run.batch_size, config.node.eval_batches)
    # The local step time, without communication (no_sync), on a throw-away copy of the optimizer's effect:
    # measured on the real model before training, then the weights are put back.
    saved = {k: v.clone() for k, v in model.module.state_dict().items()}
    local = []
    with model.no_sync():
        for step in range(3):
            inputs, targets = sampler.batch(10_000 + step)
            started = time.perf_counter()
            loss = spec.compute_loss(inputs, targets)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            local.append(time.perf_counter() - started)
    model.module.load_state_dict(saved)
    optimizer = build_inner_optimizer(
        model, "adamw", lr=run.inner_lr, weight_decay=run.inner_weight_decay, fused=False
    )
    dist.barrier()
    started = time.time()
    out = open(args.out, "w") if args.rank == 0 else None  # noqa: SIM115

    def evaluate(step: int) -> None:
        if out is None:
            return
        model.eval()
        with torch.no_grad():
            value = sum(float(plain.compute_loss(i, t)) for i, t in held_out) / len(held_out)
        model.train()
        out.write(json.dumps({"step": step, "time": time.time() - started, "eval_loss": value}) + "\n")
        out.flush()

    evaluate(0)
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        inputs, targets = sampler.batch(step)
        train_step(spec, optimizer, inputs, targets, config)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1)
    wall = time.time() - started
    if out is not None:
        local_step = sorted(local)[1]
        out.write(json.dumps({"done": True, "wall": wall, "local_step": local_step}) + "\n")
        out.close()
    dist.barrier()
    dist.destroy_process_group()


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def tx_bytes(wan: Any, i: int) -> int:
    """Bytes host i sent on its uplink (its namespace's /proc/net/dev)."""
    text = subprocess.run(
        [*wan.prefix_command(i), "cat", "/proc/net/dev"], capture_output=True, text=True, timeout=30
    ).stdout
    for line in text.splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == f"{wan.prefix}v{i}":
            return int(fields.split()[8])
    raise RuntimeError(f"no uplink of host {i} in /proc/net/dev")


def run_ddp(wan: Any, work: Path, config: Path, dataset: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = work / "ddp.jsonl"
    before = [tx_bytes(wan, i) for i in range(1, HOSTS + 1)]
    ranks = []
    for rank in range(HOSTS):
        command = [
            *wan.prefix_command(rank + 1), sys.executable, __file__, "ddp-rank", "--rank", str(rank),
            "--master", wan.address(1), "--config", str(config), "--dataset", str(dataset),
            "--steps", str(args.ddp_steps), "--eval-every", str(args.eval_every), "--out", str(out),
        ]  # fmt: skip
        # gloo advertises the address its host name resolves to (loopback here): name the uplink instead.
        env = {**os.environ, "GLOO_SOCKET_IFNAME": f"{wan.prefix}v{rank + 1}"}
        with open(work / f"ddp-{rank}.log", "wb") as log:
            ranks.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        for rank in ranks:
            if rank.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"a DDP rank failed: {(work / 'ddp-0.log').read_text()[-3000:]}")
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    sent = [tx_bytes(wan, i) - b for i, b in zip(range(1, HOSTS + 1), before, strict=True)]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    done = lines[-1]
    curve = [(e["time"], e["step"], e["eval_loss"]) for e in lines if "eval_loss" in e]
    return {
        "variant": "ddp",
        "curve": curve,
        "target": curve[-1][2],
        "seconds_to_target": curve[-1][0],
        "steps_to_target": curve[-1][1],
        "utilization": min(1.0, done["local_step"] * args.ddp_steps / done["wall"]),
        "bytes_per_node": sum(sent) / HOSTS,
    }


# -- farloco ----------------------------------------------------------------------------------------------------


def start_swarm(wan: Any, work: Path, config: Path, processes: list[Any]) -> list[Any]:
    """`farloco bootstrap` on host 1 and one `farloco join` (1 rank) per host; every process started is appended
    to `processes` (for the caller to stop); returns the peers."""
    from farloco.node.tools.demo import start_bootstrap, start_peer

    bootstrap, maddr = start_bootstrap(work, host=wan.address(1), prefix=wan.prefix_command(1))
    processes.append(bootstrap)
    peers = []
    for i in range(1, HOSTS + 1):
        peers.append(
            start_peer(f"h{i}", work, config, maddr, 1, host=wan.address(i), prefix=wan.prefix_command(i))
        )
        processes.append(peers[-1].process)
    return peers


def run_farloco(
    wan: Any, work: Path, variant: str, target: float, args: argparse.Namespace
) -> dict[str, Any]:
    from farloco.node.tools.demo import demo_config, read_events, stop_process

    overrides = base_overrides(args, variant) + VARIANTS[variant]
    probe_rounds = 1
    text = demo_config(probe_rounds, overrides)
    inner = next(int(line.split("=")[1]) for line in text.splitlines() if line.startswith("inner_steps"))
    rounds = math.ceil(args.max_steps / inner)
    work.mkdir(parents=True)
    config = work / "node.toml"
    config.write_text(demo_config(rounds, overrides))
    before = [tx_bytes(wan, i) for i in range(1, HOSTS + 1)]
    processes: list[Any] = []
    try:
        peers = start_swarm(wan, work, config, processes)
        deadline = time.monotonic() + args.timeout
        reached = None
        while any(p.process.poll() is None for p in peers) and time.monotonic() < deadline:
            time.sleep(1.0)
            events = read_events(peers[0].run_dir)
            reached = next((e for e in events if e["event"] == "round" and e["eval_loss"] <= target), None)
            if reached is not None:
                break
        sent = [tx_bytes(wan, i) - b for i, b in zip(range(1, HOSTS + 1), before, strict=True)]
    finally:
        stop_process(*processes)
    starts = [next(e["time"] for e in read_events(p.run_dir) if e["event"] == "joined") for p in peers]
    start = max(starts)
    rounds_of = [[e for e in read_events(p.run_dir) if e["event"] == "round"] for p in peers]
    # A round event's eval_loss is that of the theta the round started from, which the previous round committed:
    # each loss is placed at the commit that made its theta (the first at the start, 0 steps).
    made = [(0.0, 0)] + [(e["time"] - start, e["inner_step"]) for e in rounds_of[0]]
    curve = [(t, steps, e["eval_loss"]) for (t, steps), e in zip(made, rounds_of[0], strict=False)]
    hit = next((point for point in curve if point[2] <= target), None)
    utilization = []
    for done in rounds_of:
        if len(done) >= 2:
            wall = done[-1]["time"] - done[0]["time"]
            idle = done[-1]["ranks_idle_seconds"] - done[0]["ranks_idle_seconds"]
            utilization.append(max(0.0, 1.0 - idle / wall))
    return {
        "variant": variant,
        "curve": curve,
        "seconds_to_target": hit[0] if hit else None,
        "steps_to_target": hit[1] if hit else None,
        "utilization": sum(utilization) / len(utilization) if utilization else None,
        "bytes_per_node": sum(sent) / HOSTS,
    }


# -- stragglers -------------------------------------------------------------------------------------------------

SCENARIOS = ("even", "slow-link", "half-compute", "half-compute-full")
"""half-compute: the straggler contributes what it has when the others wait (node.partial_contributions, the
default); half-compute-full: the same host with partial contributions off (the others wait for all its steps)."""


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate.removesuffix(unit)) * scale
    raise ValueError(f"expected a rate like 100mbit, got {rate!r}")


def run_straggler(wan: Any, work: Path, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    """diloco-int8 for `--rounds` rounds with host 4 the straggler of `scenario`: a 10x slower link, or half the
    cores of the others. What the swarm pays: the fast nodes' round period and its phases, how often the
    straggler made it into a round, how long a round waited, whether anyone forked."""
    from farloco.node.tools.demo import demo_config, read_events, stop_process

    work.mkdir(parents=True)
    config = work / "node.toml"
    extra = ["node.partial_contributions=false"] if scenario == "half-compute-full" else []
    config.write_text(demo_config(args.rounds, base_overrides(args) + VARIANTS["diloco-int8"] + extra))
    straggler = HOSTS
    if scenario == "slow-link":
        wan.set_rate(straggler, f"{_rate_bits(args.rate) / 10 / 1e3:g}kbit")
    elif scenario.startswith("half-compute"):
        wan.set_cpus(straggler, args.cpus_per_host / 2)
    processes: list[Any] = []
    try:
        peers = start_swarm(wan, work, config, processes)
        deadline = time.monotonic() + args.timeout
        while any(p.process.poll() is None for p in peers[:-1]) and time.monotonic() < deadline:
            time.sleep(1.0)
    finally:
        stop_process(*processes)
        wan.set_rate(straggler, args.rate)
        if args.cpus_per_host:
            wan.set_cpus(straggler, args.cpus_per_host)
    events = [read_events(p.run_dir) for p in peers]
    rounds = [[e for e in ev if e["event"] == "round"] for ev in events]
    slow_id = next(e["peer_id"] for e in events[-1] if e["event"] == "started")
    fast = rounds[: HOSTS - 1]
    # From the second round on (the first includes joining): the wall time between commits, and its phases.
    periods = [b["time"] - a["time"] for r in fast for a, b in itertools.pairwise(r[1:])]
    phases = [e["phases"] for r in fast for e in r[2:] if "phases" in e]
    with_straggler = [slow_id in e["contributors"] for e in fast[0][1:]]
    hashes: dict[int, set[str]] = {}
    for r in rounds:
        for e in r:
            hashes.setdefault(e["round_id"], set()).add(e["outer_hash"])
    return {
        "scenario": scenario,
        "rounds": len(fast[0]),
        "period_median": _median(periods),
        "period_max": max(periods) if periods else None,
        "match_share": sum(p["match"] for p in phases) / max(1e-9, sum(periods)),
        "match_max": max((p["match"] for p in phases), default=None),
        "exchange_share": sum(p["exchange"] for p in phases) / max(1e-9, sum(periods)),
        "straggler_share": sum(with_straggler) / max(1, len(with_straggler)),
        "straggler_rounds": len(rounds[-1]),
        "straggler_synced": sum(1 for e in events[-1] if e["event"] in ("synced", "catching_up")),
        "straggler_left_out": sum(1 for e in events[-1] if e["event"] in ("late", "left_out")),
        # its contributions' weight in the mean (its share of the round's steps; < 1 when it cut them short)
        "straggler_weight": _median([e.get("weight", 1.0) for e in rounds[-1][1:]]),
        "straggler_cuts": sum(1 for e in events[-1] if e["event"] == "cut_short"),
        "forked_rounds": sorted(r for r, h in hashes.items() if len(h) > 1),
        "step_seconds_fast": _median([e["inner_step_seconds"] for r in fast for e in r[1:]]),
        "step_seconds_straggler": _median([e["inner_step_seconds"] for e in rounds[-1][1:]]),
    }


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def straggler_markdown(results: list[dict[str, Any]], args: argparse.Namespace, num_params: int) -> str:
    even = results[0]
    rows = [
        f"{args.preset} ({num_params / 1e6:.2f}M params), diloco-int8, H={args.inner_steps}, {HOSTS} hosts x 1 rank "
        f"in network namespaces, {args.rate} links with {args.rtt_ms:g} ms RTT, {args.cpus_per_host:g} cores per "
        f"host; host {HOSTS} is the straggler: a {_rate_bits(args.rate) / 10 / 1e6:g} Mbit/s link (slow-link) or "
        f"{args.cpus_per_host / 2:g} cores (half-compute); {args.rounds} rounds; timeouts.match_timeout = {args.match_timeout or 20:g} s",
        "",
        "| scenario | round period (median / max) | vs even | matchmaking share (max wait) | exchange share "
        "| rounds with the straggler | straggler: resyncs, rounds left out | straggler: rounds cut short, median "
        "weight | forked rounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cost = f"{r['period_median'] / even['period_median']:.2f}x" if r["period_median"] else "-"
        rows.append(
            f"| {r['scenario']} | {r['period_median']:.1f} s / {r['period_max']:.1f} s | {cost} | "
            f"{r['match_share']:.1%} ({r['match_max']:.1f} s) | {r['exchange_share']:.1%} | "
            f"{r['straggler_share']:.0%} | {r['straggler_synced']}, {r['straggler_left_out']} | "
            f"{r['straggler_cuts']}, {r['straggler_weight'] if r['straggler_weight'] is not None else 1.0:.2f} | "
            f"{len(r['forked_rounds'])} |"
        )
    return "\n".join(rows)


# -- report -----------------------------------------------------------------------------------------------------


def markdown(results: list[dict[str, Any]], args: argparse.Namespace, num_params: int) -> str:
    ddp = results[0]
    rows = [
        f"{args.preset} ({num_params / 1e6:.2f}M params), {HOSTS} hosts x 1 rank in network namespaces, "
        f"{args.rate} links with {args.rtt_ms:g} ms RTT (tbf + the netem relay), "
        + (
            f"{args.cpus_per_host:g} cores per host (CPU cgroup), "
            if args.cpus_per_host
            else "cores shared, "
        )
        + f"batch {args.batch_size} x "
        f"{args.seq_len} per node; target = DDP's held-out loss after {args.ddp_steps} steps: "
        f"**{ddp['target']:.3f}**",
        "",
        "| variant | time to target | speed-up (DDP's time / its time) | inner steps | compute utilization | MB sent per node |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        seconds = r["seconds_to_target"]
        took = f"{seconds:.1f} s" if seconds else "not reached"
        speedup = f"{ddp['seconds_to_target'] / seconds:.2f}x" if seconds else "-"
        if r is ddp:
            speedup = "1 (baseline)"
        used = f"{r['utilization']:.1%}" if r["utilization"] is not None else "-"
        rows.append(
            f"| {r['variant']} | {took} | {speedup} | {r['steps_to_target'] or '-'} | {used} | "
            f"{r['bytes_per_node'] / 1e6:.1f} |"
        )
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for r in results:
        xs = [t for t, _, loss in r["curve"] if math.isfinite(loss)]
        ys = [loss for _, _, loss in r["curve"] if math.isfinite(loss)]
        axes.plot(xs, ys, label=r["variant"], marker="." if r["variant"] != "ddp" else None)
    axes.axhline(results[0]["target"], color="gray", linestyle="--", linewidth=0.8, label="target")
    axes.set_xlabel("wall time (s)")
    axes.set_ylabel("held-out loss")
    axes.set_title(title)
    axes.legend()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("ddp-rank")
    for name in ("--config", "--dataset", "--out", "--master"):
        rank.add_argument(name, required=True)
    rank.add_argument("--rank", type=int, required=True)
    rank.add_argument("--steps", type=int, required=True)
    rank.add_argument("--eval-every", type=int, required=True)
    sub.add_parser("stragglers", help="one slow host (10x slower link, half the cores): what the swarm pays")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--rtt-ms", type=float, default=50.0)
    parser.add_argument("--variants", nargs="+", default=["ddp", *VARIANTS])
    parser.add_argument("--ddp-steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=600, help="inner steps a farloco variant may take")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=12, help="stragglers: rounds per scenario")
    parser.add_argument(
        "--match-timeout",
        type=float,
        default=0.0,
        help="timeouts.match_timeout of the nodes (0: the demo's 20 s)",
    )
    parser.add_argument(
        "--ddp-json",
        type=Path,
        default=None,
        help="take the DDP row from this earlier run's JSON (same settings)",
    )
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), help="stragglers: which")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--cpus-per-host",
        type=float,
        default=min(1.0, ((os.cpu_count() or 1) - 0.2) / HOSTS),
        help="cores each host may use (a CPU cgroup per host); 0: no cap",
    )
    parser.add_argument(
        "--encryption",
        choices=["auto", "off"],
        default="auto",
        help="the nodes' network.encryption: auto (TLS 1.3 between the namespaces, the default) or off",
    )
    parser.add_argument("--out", type=Path, default=Path("wan-results"))
    args = parser.parse_args(argv)
    if args.command == "ddp-rank":
        ddp_rank(args)
        return 0
    from farloco.node.config import build_config
    from farloco.node.tools.demo import demo_config
    from farloco.node.tools.netns import NamespaceWAN, relay_unavailable
    from farloco.node.training.data import builtin_dataset
    from farloco.node.training.model import num_parameters
    from farloco.node.training.models import meta_spec

    reason = relay_unavailable()
    if reason is not None:
        print(f"benchmarks/wan.py: {reason}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl+C: the WAN's context manager removes its namespaces and stops the processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="farloco-wan-bench-"))
    dataset = builtin_dataset(work / "data")
    ddp_config = work / "ddp.toml"
    ddp_config.write_text(demo_config(1, [*base_overrides(args), *VARIANTS["diloco-int8"]]))
    num_params = num_parameters(meta_spec(build_config({"run": {"model": args.preset}}).run.model).module)
    results: list[dict[str, Any]] = []
    cpus = args.cpus_per_host or None
    if args.command == "stragglers":
        found = []
        with NamespaceWAN(HOSTS, args.rate, delay_ms=args.rtt_ms / 2, cpus=cpus) as wan:
            for scenario in args.scenarios:
                found.append(run_straggler(wan, work / scenario, scenario, args))
                print(json.dumps(found[-1]), flush=True)
        stem = f"stragglers-{args.preset}-{args.rate}-{args.rtt_ms:g}ms" + (
            f"-match{args.match_timeout:g}s" if args.match_timeout else ""
        )
        (args.out / f"{stem}.json").write_text(json.dumps(found, indent=1))
        table = straggler_markdown(found, args, num_params)
        (args.out / f"{stem}.md").write_text(table + "\n")
        print(table)
        return 0
    with NamespaceWAN(HOSTS, args.rate, delay_ms=args.rtt_ms / 2, cpus=cpus) as wan:
        if args.ddp_json is not None:
            # The DDP row of an earlier run with the same settings (its JSON): the baseline without its minutes.
            ddp = next(r for r in json.loads(args.ddp_json.read_text()) if r["variant"] == "ddp")
        else:
            ddp = run_ddp(wan, work, ddp_config, dataset, args)
        results.append(ddp)
        print(f"ddp: target {ddp['target']:.3f} in {ddp['seconds_to_target']:.1f} s", flush=True)
        for variant in args.variants:
            if variant == "ddp":
                continue
            result = run_farloco(wan, work / variant, variant, ddp["target"], args)
            results.append(result)
            print(
                f"{variant}: {result['seconds_to_target']} s, utilization {result['utilization']}", flush=True
            )
    stem = f"wan-{args.preset}-{args.rate}-{args.rtt_ms:g}ms" + (
        f"-b{args.batch_size}" if args.batch_size != 8 else ""
    )
    if args.ddp_json is not None:
        stem += "-" + "-".join(v for v in args.variants if v != "ddp")
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(
        results,
        args.out / f"{stem}.png",
        f"{args.preset}, {HOSTS} hosts, {args.rate}, {args.rtt_ms:g} ms RTT",
    )
    table = markdown(results, args, num_params)
    (args.out / f"{stem}.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
