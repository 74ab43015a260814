"""The ranks' side of the hand-off, per round, beside plain copies of the same bytes and the inner step it sits
between (BENCHMARKS.md, "The hand-off on a GPU").

    python benchmarks/handoff.py --presets tiny small                     # CPU, 1 rank
    python benchmarks/handoff.py --presets 1b --precision bf16 --batch-size 8 --seq-len 2048   # one GPU

Once per round a rank stores its shards into the agent's shared-memory vector (after its last inner step) and
loads the new theta from it (before its first). Each preset's model is built and split exactly as the trainer
does (`build_spec`, `parallelize` on a 1-rank group: NCCL on CUDA, gloo on CPU; `ShardView`, `HostStaging` on a
real `Handoff` file), and timed `--repeats` times after one warm-up:

- **store**: `HostStaging.store(handoff.local)`: device to host on the side stream, into the shared vector the
  agent reads;
- **load**: `HostStaging.load(handoff.theta)` and a device synchronize (the copies done, not only queued);
- **stall**: (load + one inner step) - (one inner step), both synchronized: what the load costs the training
  stream, which waits for the side stream's copies on the device, not on the host;
- yardsticks in the same process: a device-to-host copy of the same bytes into a pinned buffer, the copy back,
  and a host memcpy of the same bytes (the part of store and load that is host memory to host memory);
- **per round**: (store + stall) as a share of a round of `--inner-steps` inner steps.

Each for both paths a rank may take: `staged` (every shard through the pinned staging buffer, then a host copy
into the shared vector) and, on CUDA, `registered` (the hand-off page-locked once, each shard that is one run of
the flat vector copied by DMA straight to and from it: what the trainer does).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from farloco.node.config import build_config
from farloco.node.handoff import Handoff, layout_of
from farloco.node.training.model import model_config
from farloco.node.training.models import build_spec
from farloco.node.training.muon import build_inner_optimizer
from farloco.node.training.parallel import ShardView, node_mesh, parallelize
from farloco.node.training.trainer import HostStaging, train_step


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _timed(fn: Any, cuda: bool, repeats: int) -> float:
    """Median seconds of `fn()` (synchronized), after one warm-up call."""
    fn()
    _sync(cuda)
    times = []
    for _ in range(repeats):
        _sync(cuda)
        started = time.perf_counter()
        fn()
        _sync(cuda)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copy_yardsticks(views: list[ShardView], handoff: Handoff, cuda: bool, repeats: int) -> dict[str, float]:
    """Plain copies of the same bytes: device to a pinned host buffer and back, pinned buffer to the hand-off."""
    flat = torch.cat([view.local.detach().reshape(-1) for view in views])
    host = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=cuda)
    yardsticks = {"memcpy_host": _timed(lambda: handoff.local.copy_(host), False, repeats)}
    if cuda:
        yardsticks["memcpy_d2h"] = _timed(lambda: host.copy_(flat, non_blocking=True), cuda, repeats)
        yardsticks["memcpy_h2d"] = _timed(lambda: flat.copy_(host, non_blocking=True), cuda, repeats)
    return yardsticks


def measure(preset: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """One row per path: `registered` (the hand-off page-locked, row shards copied by DMA straight to and
    from it; on CUDA only) and `staged` (every shard through the pinned staging buffer)."""
    cuda = device.type == "cuda"
    config = build_config(
        {
            "run": {"model": preset, "batch_size": args.batch_size, "seq_len": args.seq_len},
            "node": {"precision": args.precision, "compile": args.compile},
        }
    )
    spec = build_spec(preset, seed=0)
    model = spec.module
    layout = layout_of(model)
    numel = sum(slot.numel for slot in layout)
    model.to(device)
    parallelize(spec, config, device, node_mesh(device, 1, 0, 1))
    params = dict(model.named_parameters())
    views = [ShardView(params[slot.name], slot) for slot in layout]
    handoff = Handoff.create(numel, 1)
    stagings: list[tuple[str, HostStaging, float]] = []
    try:
        handoff.theta.normal_()
        optimizer = build_inner_optimizer(model, "adamw", lr=1e-4, weight_decay=0.1, fused=cuda)
        vocab = model_config(preset).vocab_size
        tokens = torch.randint(
            0, vocab, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(0)
        )
        inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        for _ in range(3 if args.compile else 1):  # compile's warm-up steps
            train_step(spec, optimizer, inputs, targets, config)

        def step() -> None:
            train_step(spec, optimizer, inputs, targets, config)

        step_seconds = _timed(step, cuda, args.repeats)
        yardsticks = copy_yardsticks(views, handoff, cuda, args.repeats)
        stagings.append(("staged", HostStaging(views, device), 0.0))
        if cuda:
            started = time.perf_counter()
            registered = HostStaging(views, device, region=handoff.mapped)
            stagings.append(("registered", registered, time.perf_counter() - started))
        rows = []
        for path, staging, setup_seconds in stagings:

            def load_then_step(staging: HostStaging = staging) -> None:
                staging.load(handoff.theta)
                train_step(spec, optimizer, inputs, targets, config)

            row: dict[str, Any] = {
                "preset": preset,
                "params": numel,
                "bytes": 4 * numel,
                "path": path,
                "registered": staging.region is not None,
                "setup_seconds": setup_seconds,
                "direct_shards": sum(run is not None for run in staging.direct),
                "step": step_seconds,
                **yardsticks,
            }
            row["store"] = _timed(lambda staging=staging: staging.store(handoff.local), cuda, args.repeats)
            row["load"] = _timed(lambda staging=staging: staging.load(handoff.theta), cuda, args.repeats)
            row["load_then_step"] = _timed(load_then_step, cuda, args.repeats)
            row["stall"] = max(0.0, row["load_then_step"] - step_seconds)
            row["round_share"] = (row["store"] + row["stall"]) / (args.inner_steps * step_seconds)
            rows.append(row)
        return rows
    finally:
        for _, staging, _ in stagings:
            staging.close()
        handoff.close()


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, where: str) -> str:
    lines = [
        f"{where}; 1 rank, precision {args.precision}, compile {args.compile}, batch {args.batch_size} x "
        f"{args.seq_len} tokens; median of {args.repeats} after a warm-up; per round = (store + stall) / "
        f"({args.inner_steps} inner steps).",
        "",
        "| preset | params | path | store | load | stall (load before a step) | D2H memcpy | H2D memcpy "
        "| host memcpy | inner step | per round |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def cell(key: str, r: dict[str, Any] = r) -> str:
            if key not in r:
                return "-"
            return f"{1e3 * r[key]:.1f} ms ({r['bytes'] / 1e9 / r[key]:.1f} GB/s)" if r[key] > 0 else "0"

        path = r["path"]
        if path == "registered":
            path = (
                f"registered ({r['direct_shards']} shards direct, page-locking took {r['setup_seconds']:.2f} s)"
                if r["registered"]
                else "registered: refused, staged"
            )
        lines.append(
            f"| {r['preset']} | {r['params'] / 1e6:.1f}M | {path} | {cell('store')} | {cell('load')} | "
            f"{1e3 * r['stall']:.1f} ms | {cell('memcpy_d2h')} | {cell('memcpy_h2d')} | {cell('memcpy_host')} | "
            f"{1e3 * r['step']:.1f} ms | {100 * r['round_share']:.2f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--inner-steps", type=int, default=100, help="H, for the share of a round")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    where = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    rows = []
    try:
        for preset in args.presets:
            measured = measure(preset, args, device)
            rows.extend(measured)
            for row in measured:
                print(json.dumps(row), file=sys.stderr, flush=True)
            if args.json is not None:  # after each preset: a run cut short keeps what it measured
                args.json.write_text(
                    json.dumps({"where": where, "args": vars(args) | {"json": None}, "rows": rows})
                )
            if cuda:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    print(f"Command: `python benchmarks/handoff.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print(markdown(rows, args, where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
