"""Worker of tests/integration/test_parallel_ranks.py: the trainer's layouts against a plain single-process
model, on real gloo ranks.

Run as `python tests/parallel_check.py WORLD TP [cpu|cuda] [RUN_MODEL [CHECK,...]]` (it spawns WORLD ranks: gloo on
cpu, NCCL on cuda). Each rank builds the built-in tiny model (or RUN_MODEL: an HF config.json or an entry point),
splits it as the trainer does (farloco.node.training.parallel: TP x FSDP2) and checks, against a plain unsharded
copy that every rank also builds:

- ShardView round trip: a random flat vector loaded into the shards and stored back is the same vector;
- one training step per setting (plain SGD, which shows the gradient's scale, unclipped and clipped; AdamW fp32;
  Muon; 2 micro-batches with activation checkpointing; bf16) gives the parameters the plain model gets from the
  same full batch (the dp ranks split it), within float tolerance.

On cuda it also checks the pinned, side-stream hand-off copies (`HostStaging`) and a compiled bf16 step.

Rank 0 prints one JSON line per check: {"check": ..., "max_abs_diff": ..., "loss": ..., "plain_loss": ...}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from farloco.node.config import build_config
from farloco.node.handoff import flatten, layout_of
from farloco.node.training.models import build_spec
from farloco.node.training.muon import build_inner_optimizer
from farloco.node.training.parallel import ShardView, node_mesh, parallelize
from farloco.node.training.trainer import HostStaging, train_step

SEQ_LEN = 32
BATCH = 4


def gathered_flat(views: list[ShardView], numel: int, device: torch.device) -> torch.Tensor:
    """The node's whole flat vector: each rank writes its shards, a MAX all-reduce merges (replicas agree)."""
    flat = torch.full((numel,), -torch.inf)
    # On CUDA the flat vector is page-locked as the trainer's hand-off is: row shards go straight into it.
    staging = HostStaging(views, device, region=flat if device.type == "cuda" else None)
    staging.store(flat)
    staging.close()
    flat = flat.to(device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return flat


def make_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    # Plain SGD (DeMo's rank step) shows a gradient's scale, which Adam's first step normalises away.
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1.0)
    return build_inner_optimizer(model, name, lr=1e-3, weight_decay=0.1, fused=False)


RUN_MODEL = "tiny"


def one_step(world: int, tp: int, rank: int, device: torch.device, **node: object) -> dict[str, object]:
    optimizer_name = str(node.pop("inner_optimizer", "adamw"))
    grad_clip = float(node.pop("grad_clip", 1.0))  # type: ignore[arg-type]
    config = build_config(
        {
            "run": {
                "batch_size": BATCH,
                "seq_len": SEQ_LEN,
                "inner_optimizer": "adamw" if optimizer_name == "sgd" else optimizer_name,
                "grad_clip": grad_clip,
            },
            "node": {"num_ranks": world, "tp": tp, **node},
        }
    )
    mesh = node_mesh(device, world, rank, tp)
    spec = build_spec(RUN_MODEL, seed=0)
    model = spec.module.to(device)
    layout = layout_of(model)
    plain = build_spec(RUN_MODEL, seed=0).module.to(device)
    parallelize(spec, config, device, mesh)
    params = dict(model.named_parameters())
    views = [ShardView(params[slot.name], slot) for slot in layout]
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (BATCH, SEQ_LEN + 1), generator=generator)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    share = BATCH // mesh.dp_size
    mine = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
    optimizer = make_optimizer(model, optimizer_name)
    loss = train_step(spec, optimizer, inputs[mine], targets[mine], config)
    dist.all_reduce(loss)
    plain_config = dataclasses.replace(
        config, node=dataclasses.replace(config.node, num_ranks=1, tp=1, micro_batches=1, precision="fp32")
    )
    plain_optimizer = make_optimizer(plain, optimizer_name)
    plain_loss = train_step(plain, plain_optimizer, inputs, targets, plain_config)
    numel = sum(slot.numel for slot in layout)
    diff = (gathered_flat(views, numel, device) - flatten(plain, layout).to(device)).abs().max()
    return {"max_abs_diff": float(diff), "loss": float(loss) / world, "plain_loss": float(plain_loss)}


def round_trip(world: int, tp: int, rank: int, device: torch.device) -> dict[str, object]:
    config = build_config(
        {"run": {"batch_size": BATCH, "seq_len": SEQ_LEN}, "node": {"num_ranks": world, "tp": tp}}
    )
    spec = build_spec(RUN_MODEL, seed=0)
    model = spec.module.to(device)
    layout = layout_of(model)
    parallelize(spec, config, device, node_mesh(device, world, rank, tp))
    params = dict(model.named_parameters())
    views = [ShardView(params[slot.name], slot) for slot in layout]
    numel = sum(slot.numel for slot in layout)
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    staging = HostStaging(views, device, region=flat if device.type == "cuda" else None)
    registered = staging.region is not None
    staging.load(flat)
    staging.close()
    back = gathered_flat(views, numel, device).cpu()
    kinds = sorted({str(getattr(view.param, "placements", "plain")) for view in views})
    # A shard that claims to be one run of the flat vector (copied straight by DMA on CUDA) is exactly that run.
    runs = [(view, view.flat_range()) for view in views]
    wrong_runs = [
        view.slot.name
        for view, run in runs
        if run is not None
        and not torch.equal(flat[run[0] : run[1]].view(view.local.shape), view.host_piece(flat))
    ]
    return {
        "max_abs_diff": float((back - flat).abs().max()),
        "placements": kinds,
        "direct_shards": sum(run is not None for _, run in runs),
        "staged_shards": sum(run is None and view.numel > 0 for view, run in runs),
        "registered": registered,
        "wrong_runs": wrong_runs,
    }


def worker(rank: int, world: int, tp: int, port: int, kind: str, run_model: str, only: list[str]) -> None:
    global RUN_MODEL
    RUN_MODEL = run_model
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    checks = {
        "round_trip": lambda: round_trip(world, tp, rank, device),
        "sgd": lambda: one_step(
            world, tp, rank, device, inner_optimizer="sgd", grad_clip=0.0, precision="fp32"
        ),
        "sgd_clipped": lambda: one_step(
            world, tp, rank, device, inner_optimizer="sgd", grad_clip=0.05, precision="fp32"
        ),
        "adamw": lambda: one_step(world, tp, rank, device, precision="fp32"),
        "muon": lambda: one_step(world, tp, rank, device, inner_optimizer="muon", precision="fp32"),
        "micro_batches_and_checkpointing": lambda: one_step(
            world,
            tp,
            rank,
            device,
            micro_batches=2 if BATCH // (world // tp) % 2 == 0 else 1,
            activation_checkpointing=True,
            precision="fp32",
        ),
        "bf16": lambda: one_step(world, tp, rank, device, precision="bf16"),
    }
    if kind == "cuda":
        checks["compiled_bf16"] = lambda: one_step(world, tp, rank, device, precision="bf16", compile=True)
    for name, check in checks.items():
        if only and name not in only:
            continue
        result = check()
        if rank == 0:
            print(json.dumps({"check": name, **result}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


if __name__ == "__main__":
    world_size, tp_degree = int(sys.argv[1]), int(sys.argv[2])
    kind = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    run_model = sys.argv[4] if len(sys.argv) > 4 else "tiny"
    only = sys.argv[5].split(",") if len(sys.argv) > 5 else []
    mp.spawn(worker, args=(world_size, tp_degree, free_port(), kind, run_model, only), nprocs=world_size)
