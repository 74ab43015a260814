"""Tokens/s and MFU of one node's inner loop in the daemon, beside a bare FSDP2 loop of the same model and batch.

    python benchmarks/node_throughput.py                                  # CPU: tiny and small, 1 rank, fp32
    python benchmarks/node_throughput.py --presets 125m 350m 1b --batch-size 8 --seq-len 2048 \\
        --precision bf16 --compile                                        # one GPU

For each preset, in the same run:

- **bare**: a training loop with nothing around it: the model split exactly as the daemon's ranks split it
  (farloco.node.training.parallel: FSDP2 per block and root, node.precision, activation checkpointing, compile),
  the daemon's inner step (`train_step`: micro-batches, clipping, AdamW), random tokens already on the device;
  no agent, no hand-off, no data loader. Launched as `--ranks` processes (gloo on CPU, NCCL on CUDA).
- **daemon**: a real node (`farloco bootstrap` + `farloco join` on 127.0.0.1, alone, so its group is itself)
  training `--rounds` rounds of `--inner-steps` steps on the bundled corpus. Its ranks time each inner step
  (`inner_step_seconds` of the round events; compile's warm-up steps left out), the first round is skipped;
  the table also gives the node's tokens/s over whole rounds (hand-off, held-out evaluation off, the agent's
  round: what the ranks lose to everything that is not an inner step, with run.outer_update as given): the wall
  time between commits from the first round's on, without the last round where the update is delayed or eager
  (that one is exchanged while the ranks wait). A per-round table (stderr, and `rounds` in the JSON) says where
  each round's time went: the ranks' inner steps and waits, the agent's round and its phases.

MFU = model FLOPs per token x tokens/s / peak FLOP/s. Model FLOPs per token, from the config, as PaLM and
torchtitan count them: 6 x (the matmul parameters: per block 2 d^2 + 2 d kv + 3 d ffn, and the head's d V) +
12 x n_layers x d x seq_len (attention scores and values, forward and backward, no causal halving);
activation checkpointing's recomputation is not model FLOPs. Peak: the GPU's dense bf16 (or tf32 for fp32) rate
from its name (H100/H200: 989 / 495 TFLOP/s), or `--peak-tflops`; on CPU the measured rate of a 2048 x 2048 fp32
matmul on the threads a rank uses (so CPU "MFU" says how close to the CPU's own matmul speed the loop runs).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from farloco.node.tools.demo import run_lone_node
from farloco.node.training.flops import GPU_PEAK_TFLOPS, flops_per_token
from farloco.node.training.model import model_config


def peak_flops(args: argparse.Namespace) -> tuple[float, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"{args.peak_tflops} TFLOP/s (given)"
    precision = "bf16" if args.precision in ("bf16", "auto") and torch.cuda.is_available() else args.precision
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, peaks in GPU_PEAK_TFLOPS.items():
            if key in name:
                rate = peaks["bf16" if precision == "bf16" else "fp32"]
                return rate * 1e12, f"{name}: {rate} TFLOP/s dense {precision}"
        raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops")
    torch.set_num_threads(args.threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    rate = 2 * 2048**3 / best
    return rate, f"CPU, {args.threads} thread(s): measured fp32 matmul {rate / 1e9:.1f} GFLOP/s"


def node_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {
        "run": {"batch_size": args.batch_size, "seq_len": args.seq_len, "inner_steps": args.inner_steps},
        "node": {
            "num_ranks": args.ranks,
            "threads_per_rank": args.threads,
            "precision": args.precision,
            "compile": args.compile,
            "activation_checkpointing": args.activation_checkpointing,
            "micro_batches": args.micro_batches,
            "eval_batches": 0,
            "log_every_steps": args.log_every_steps,
        },
    }


# ---- bare loop ---------------------------------------------------------------------------------------------------
def _bare_rank(rank: int, world: int, port: int, preset: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from farloco.node.config import build_config
    from farloco.node.training.model import build_model
    from farloco.node.training.muon import build_inner_optimizer
    from farloco.node.training.parallel import node_mesh, parallelize
    from farloco.node.training.trainer import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    config = build_config({**node_overrides(args), "run": {**node_overrides(args)["run"], "model": preset}})
    model = build_model(model_config(preset), seed=0).to(device)
    parallelize(model, config, device, node_mesh(device, world, rank, config.node.tp))
    optimizer = build_inner_optimizer(model, "adamw", lr=1e-4, weight_decay=0.1, fused=cuda)
    per_rank = args.batch_size // world
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(
        0, model_config(preset).vocab_size, (per_rank, args.seq_len + 1), generator=generator
    )
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    warmup = 3 if args.compile else 1
    times = []
    for step in range(warmup + args.bare_steps):
        started = time.perf_counter()
        loss = train_step(model, optimizer, inputs, targets, config)
        float(loss)  # the daemon's ranks read the loss back too (mark_progress after each step syncs)
        if step >= warmup:
            times.append(time.perf_counter() - started)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_seconds": sum(times) / len(times)}))
    dist.barrier()
    dist.destroy_process_group()


def run_bare(preset: str, args: argparse.Namespace, work: Path) -> float:
    import torch.multiprocessing as mp

    out = work / f"bare-{preset}.json"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_bare_rank, args=(args.ranks, port, preset, args, str(out)), nprocs=args.ranks)
    return float(json.loads(out.read_text())["step_seconds"])


# ---- the daemon --------------------------------------------------------------------------------------------------
def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{key} = {_toml(item)}" for key, item in value.items()) + "}"
    return str(value)


def run_daemon(preset: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    run_dir = work / f"daemon-{preset}"
    run_dir.mkdir(parents=True)
    sections = node_overrides(args)
    sections["run"].update(
        name="node-throughput",
        model=preset,
        max_rounds=args.rounds,
        codec="int8",
        outer_update=args.outer_update,
    )
    sections["checkpoint"] = {"every_rounds": 0}
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml(value)}" for key, value in values.items())
    config = run_dir / "node.toml"
    config.write_text("\n".join(lines) + "\n")
    events, _ = run_lone_node(
        run_dir, config, args.ranks, what=f"{preset}, {args.rounds} rounds", max_seconds=args.max_seconds
    )
    timed = [e["inner_step_seconds"] for e in events[1:] if e.get("inner_step_seconds")]
    # The wall time between commits, from the first round's on. With a delayed or eager update the last round is
    # exchanged while the ranks wait (nothing trains after run.max_rounds): it is left out where another remains.
    intervals = [b["time"] - a["time"] for a, b in itertools.pairwise(events)]
    steady = intervals[:-1] if args.outer_update != "sync" and len(intervals) >= 2 else intervals
    tokens = len(steady) * args.inner_steps * args.batch_size * args.seq_len
    rounds = []
    idle_before = events[0].get("ranks_idle_seconds") or 0.0
    for event, interval in zip(events[1:], intervals, strict=True):
        idle = event.get("ranks_idle_seconds") or 0.0
        rounds.append(
            {
                "round_id": event["round_id"],
                "interval": interval,
                "agent_seconds": event.get("seconds"),
                "phases": event.get("phases", {}),
                "ranks_idle": idle - idle_before,
                "inner_steps_seconds": (event.get("inner_step_seconds") or 0.0) * args.inner_steps,
            }
        )
        idle_before = idle
    return {
        "step_seconds": sum(timed) / len(timed),
        "round_tokens_per_second": tokens / sum(steady),
        "rounds": rounds,
    }


def rounds_table(preset: str, rounds: list[dict[str, Any]]) -> str:
    """Where each round's wall time went: the agent's round (its phases) and the ranks' steps and waits."""
    phases = sorted({name for r in rounds for name in r["phases"]})
    lines = [
        f"{preset}: per round (seconds; the agent's round runs while the ranks train on, except the last)",
        "",
        "| round | between commits | inner steps | ranks idle | agent's round | " + " | ".join(phases) + " |",
        "|---|---|---|---|---|" + "---|" * len(phases),
    ]
    for r in rounds:
        lines.append(
            f"| {r['round_id']} | {r['interval']:.2f} | {r['inner_steps_seconds']:.2f} | {r['ranks_idle']:.2f} | "
            f"{r['agent_seconds'] or 0:.2f} | "
            + " | ".join(f"{r['phases'].get(name, 0.0):.2f}" for name in phases)
            + " |"
        )
    return "\n".join(lines)


def markdown(results: list[dict[str, Any]], args: argparse.Namespace, peak: str) -> str:
    lines = [
        f"{args.ranks} rank(s), batch {args.batch_size} x {args.seq_len} tokens, precision {args.precision}, "
        f"compile {args.compile}, activation checkpointing {args.activation_checkpointing}, micro-batches "
        f"{args.micro_batches}; daemon: H = {args.inner_steps}, {args.rounds} rounds (first skipped), "
        f"outer_update {args.outer_update}; peak {peak}.",
        "",
        "| preset | params | bare tokens/s | daemon tokens/s (inner steps) | daemon / bare | bare MFU | daemon MFU "
        "| daemon tokens/s over whole rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['preset']} | {r['params'] / 1e6:.1f}M | {r['bare_tokens_per_second']:.0f} | "
            f"{r['daemon_tokens_per_second']:.0f} | {r['ratio']:.3f} | {100 * r['bare_mfu']:.1f}% | "
            f"{100 * r['daemon_mfu']:.1f}% | {r['round_tokens_per_second']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--outer-update", default="delayed", choices=("sync", "delayed", "eager"))
    parser.add_argument(
        "--bare-steps", type=int, default=10, help="0: no bare loop (the daemon alone; its columns read nan)"
    )
    parser.add_argument("--peak-tflops", type=float, default=0.0)
    parser.add_argument(
        "--log-every-steps",
        type=int,
        default=0,
        help="node.log_every_steps of the daemon (per-inner-step figures; compare its inner steps with 0)",
    )
    parser.add_argument("--max-seconds", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--work", type=Path, default=None, help="keep the runs' folders here (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    peak, peak_text = peak_flops(args)
    results = []
    with contextlib.ExitStack() as stack:
        tmp = (
            str(args.work)
            if args.work
            else stack.enter_context(tempfile.TemporaryDirectory(prefix="farloco-throughput-"))
        )
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for preset in args.presets:
            model = model_config(preset)
            from farloco.node.training.model import build_model, num_parameters

            params = num_parameters(build_model(model, seed=0))
            flops = flops_per_token(model, args.seq_len)
            tokens = args.batch_size * args.seq_len
            bare = tokens / run_bare(preset, args, Path(tmp)) if args.bare_steps else float("nan")
            print(f"{preset}: bare {bare:.0f} tokens/s", file=sys.stderr)
            daemon = run_daemon(preset, args, Path(tmp))
            inner = tokens / daemon["step_seconds"]
            print(f"{preset}: daemon {inner:.0f} tokens/s", file=sys.stderr)
            results.append(
                {
                    "preset": preset,
                    "params": params,
                    "flops_per_token": flops,
                    "bare_tokens_per_second": bare,
                    "daemon_tokens_per_second": inner,
                    "ratio": inner / bare,
                    "bare_mfu": bare * flops / peak,
                    "daemon_mfu": inner * flops / peak,
                    "round_tokens_per_second": daemon["round_tokens_per_second"],
                    "rounds": daemon["rounds"],
                }
            )
            print(rounds_table(preset, daemon["rounds"]), file=sys.stderr, flush=True)
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
            if args.json is not None:  # after each preset: a run cut short keeps what it measured
                args.json.write_text(
                    json.dumps(
                        {
                            "args": {k: str(v) for k, v in vars(args).items()},
                            "peak": peak_text,
                            "results": results,
                        }
                    )
                )
    print(
        f"Command: `python benchmarks/node_throughput.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
    )
    print(markdown(results, args, peak_text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
