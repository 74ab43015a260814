"""Convergence of farloco's outer strategies against DDP (upper bound) and lone workers (lower bound).

This file owns the convergence benchmark: k = 4 workers simulated in one process, each a copy of the `tiny`
built-in model with its own AdamW and its own disjoint `BatchSampler` slot of the bundled pydoc corpus (batch 8,
seq_len 128). Outer rounds use the real `farloco.optim` objects the way the agent does: every worker has its own
strategy (its own error-feedback state) and its own copy of theta_outer; per round each worker makes its
contribution and encodes it, everyone decodes every payload, `mean_of` averages in worker order, and each worker
proposes/applies/commits and merges. Dense codecs go through the codec twice like in `protocol/exchange/` (the
part owner re-encodes the mean); sparse ones are all-gathered.

Bytes sent per worker are the real payload sizes in the daemon's exchange pattern: dense codecs reduce-scatter +
all-gather (2(k-1)/k of the payload), sparse codecs all-gather (the payload to each of the k-1 peers). DDP sends a
ring all-reduce of fp32 gradients every step (2(k-1)/k * 4 bytes * num_params), like `ddp_bytes_per_round`.

Streaming DiLoCo follows the daemon's round loop (node/daemon/agent.py): a round every H/P inner steps, round r syncing
fragment r mod P (so each fragment every H steps, staggered by H/P); the contribution is taken at the sync point,
and the mean lands `tau` inner steps later (tau < H/P: the strategy object holds one round in flight), where the
outer step is applied and merged with alpha into the local weights the workers have trained on meanwhile. Its
theta_outer is evaluated with the rounds that have landed; there is no extra round at the last step.

References, in the same run: DDP (one model, the 4 workers' batches together = gradient all-reduce every step)
and lone workers (the 4 workers with no communication; reported as the mean over slots, with the range).

Hyper-parameters: the inner AdamW is the trainer's default for everyone and was not tuned (lr 3e-3 constant
after 20 warm-up steps, or with --schedule cosine decayed to 3e-4 at the last step; betas 0.9/0.95, wd 0.1,
clip 1), nor were DiLoCo's outer lr 0.5 / momentum 0.9 (the
reference's), SparseLoCo's top-64 of 4096 with 2-bit values, beta 0.95, lr 1 (paper's) or Streaming DiLoCo's
alpha 0.5 (paper's) and tau 1 (the daemon's default). DeMo alone was tuned, by the small sweep of
`sweep_configs()` (--sweep): k 12 of 1024-value DCT chunks (about the paper's density while >= 30x under DDP),
beta 0.999 (paper), sign-SGD lr 1e-3 (3e-3, the inner lr, closed 37% of the gap). DeMo runs as optim.strategies models it: every step each worker
takes the loss gradient at theta_outer as its pseudo-gradient (one SGD step with lr 1), no AdamW.

    .venv/bin/python benchmarks/convergence.py                 # default configs, 600 steps per worker
    .venv/bin/python benchmarks/convergence.py --long          # 2400 steps, figures at 600 and at 2400
    .venv/bin/python benchmarks/convergence.py --corpus stdlib --long --schedule cosine   # what BENCHMARKS.md runs
    .venv/bin/python benchmarks/convergence.py --quick         # a few steps of every code path (smoke run)
    .venv/bin/python benchmarks/convergence.py --sweep         # the tuning sweeps (DeMo: 600 steps; DiLoCo outer lr: with --long)
    .venv/bin/python benchmarks/convergence.py --only diloco-h10-int8 --steps 300
"""

from __future__ import annotations

import argparse
import bisect
import copy
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from farloco.node.training.data import BatchSampler, TokenDataset, builtin_dataset, eval_batches, open_dataset
from farloco.node.training.model import Transformer, build_model, lm_loss, model_config, num_parameters
from farloco.node.training.muon import build_inner_optimizer
from farloco.optim import Codec, OuterStrategy, get_codec, make_strategy, mean_of

NUM_WORKERS = 4
BATCH_SIZE = 8
SEQ_LEN = 128
EVAL_BATCH_SIZE = 16
DEFAULT_STEPS = 600
LONG_FACTOR = 4

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Setup:
    """What every config of one run shares: the inner optimizer, the data and the evaluation."""

    steps: int = DEFAULT_STEPS
    """Inner steps per worker (DDP: optimizer steps, each on all workers' batches)."""
    report_steps: tuple[int, ...] = (DEFAULT_STEPS,)
    """Steps at which the table's figures are taken (the last one is `steps`)."""
    inner_lr: float = 3e-3
    """Peak AdamW learning rate of every worker, of DDP and of the lone workers."""
    warmup_steps: int = 20
    """Linear warm-up of the inner lr, as the trainer does."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant (so the figures at 600 steps of a --long run are the ones a 600-step run gives),
    or a cosine decay to `min_lr_ratio` of the peak at the last step, as the DiLoCo papers train. The same
    schedule drives every config: AdamW's lr for DDP, the lone and the inner workers, and DeMo's sign-SGD lr."""
    min_lr_ratio: float = 0.1
    """The cosine schedule's last lr, as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW weight decay (betas 0.9/0.95 as in farloco.node.training.trainer)."""
    grad_clip: float = 1.0
    """Gradient-norm clip of every AdamW step (the trainer's default)."""
    num_eval_batches: int = 4
    """Fixed held-out batches of 16 x 128 tokens evaluated at the report steps."""
    seed: int = 0
    """Model init and sampler seed."""

    def __post_init__(self) -> None:
        if self.steps < 1 or not self.report_steps or self.report_steps[-1] != self.steps:
            raise ValueError(
                f"Setup: expected steps >= 1 ending report_steps, got {self.steps} {self.report_steps}"
            )
        if self.schedule not in ("constant", "cosine") or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                "Setup: expected schedule constant|cosine and 0 <= min_lr_ratio <= 1, "
                f"got {self.schedule!r} {self.min_lr_ratio}"
            )

    def lr_factor(self, step: int) -> float:
        """The schedule at 0-based `step`, as a fraction of the peak lr."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.steps - 1 - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def learning_rate(self, step: int) -> float:
        return self.inner_lr * self.lr_factor(step)

    def describe(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "inner_lr": self.inner_lr,
            "warmup_steps": self.warmup_steps,
            "schedule": self.schedule,
            "min_lr_ratio": self.min_lr_ratio,
        }


@dataclass(frozen=True)
class RunConfig:
    """One line of the table: a reference or a strategy with its codec and hyper-parameters."""

    name: str
    kind: Literal["ddp", "lone", "outer"]
    strategy: str = ""
    codec: str = ""
    codec_options: dict[str, int] = field(default_factory=dict)
    hparams: dict[str, float | int | bool] = field(default_factory=dict)
    sync_every: int = 1
    """Inner steps per outer round (H; for streaming-diloco H/P, since one round syncs one of P fragments)."""
    tau: int = 0
    """Overlap: a round's exchange starts at its sync point and its result lands `tau` inner steps later, on
    the then-current local weights (streaming-diloco; 0 = the round blocks)."""
    outer_update: Literal["sync", "delayed", "eager"] = "sync"
    """`run.outer_update` of the daemon (diloco, sparseloco): sync blocks at every round; delayed starts the next
    inner phase at once from theta_outer, which takes each round's mean one round late; eager does the same
    and previews the worker's own fresh contribution in its start point."""
    inner_optimizer: Literal["adamw", "muon"] = "adamw"
    """`run.inner_optimizer` of every worker: AdamW, or Muon for the blocks' matrices and AdamW for the rest
    (MuLoCo, arXiv 2505.23725); the same lr either way (Muon's step is scaled to AdamW's RMS)."""
    late_every: int = 0
    """The last worker is late for every `late_every`-th round (0: never): the others commit it without it, and
    it takes their state (theta_outer and the strategy's state, as a state sync does) before its next round."""
    late_work: Literal["merge", "discard"] = "merge"
    """`run.late_work` of the daemon: the late worker's steps of the missed round merged into its next
    contribution, weighted by their steps (node/daemon/latework.py), or dropped."""
    note: str = ""

    def __post_init__(self) -> None:
        # The strategy object holds one round in flight (its fragment schedule keys on applied rounds), so the
        # next round may not start before the previous one landed.
        if self.sync_every < 1 or not 0 <= self.tau < self.sync_every:
            raise ValueError(
                f"RunConfig {self.name}: expected sync_every >= 1 and 0 <= tau < sync_every, "
                f"got sync_every={self.sync_every}, tau={self.tau}"
            )
        if self.outer_update != "sync" and (self.tau or self.strategy not in ("diloco", "sparseloco")):
            raise ValueError(
                f"RunConfig {self.name}: outer_update={self.outer_update} expects diloco or sparseloco with "
                f"tau 0, got {self.strategy} tau={self.tau}"
            )

        if self.late_every and (
            self.late_every < 2 or self.tau or self.outer_update != "sync" or self.strategy != "diloco"
        ):
            raise ValueError(
                f"RunConfig {self.name}: late_every expects >= 2 with diloco, sync and tau 0, got "
                f"late_every={self.late_every} {self.strategy} {self.outer_update} tau={self.tau}"
            )

    def make_codec(self) -> Codec:
        return get_codec(self.codec, **self.codec_options)


def demo_config(
    k: int, chunk: int, lr: float, beta: float, weight_decay: float = 0.0, name: str = ""
) -> RunConfig:
    """A DeMo line: dct-topk k of `chunk` values, sign-SGD lr, momentum beta, decoupled weight decay."""
    name = name or f"demo-top{k}of{chunk}-lr{lr:g}-b{beta:g}-wd{weight_decay:g}"
    return RunConfig(
        name,
        "outer",
        "demo",
        "dct-topk",
        codec_options={"k": k, "chunk": chunk},
        hparams={"lr": lr, "beta": beta, "weight_decay": weight_decay},
        sync_every=1,
        note="sign-SGD outer step every step",
    )


def streaming_config(num_fragments: int, tau: int, alpha: float, h: int = 10) -> RunConfig:
    """A Streaming DiLoCo line at H = h: one of P fragments synced every h/P steps, each every h steps."""
    if h % num_fragments:
        raise ValueError(f"streaming_config: expected H divisible by P, got H={h}, P={num_fragments}")
    return RunConfig(
        f"streaming-diloco-h{h}-p{num_fragments}-tau{tau}-a{alpha:g}-int8",
        "outer",
        "streaming-diloco",
        "int8",
        hparams={"lr": 0.5, "momentum": 0.9, "num_fragments": num_fragments, "alpha": alpha},
        sync_every=h // num_fragments,
        tau=tau,
        note=f"{num_fragments} fragments, one every {h // num_fragments} steps, lands {tau} steps later",
    )


def default_configs() -> list[RunConfig]:
    """The default set: both references, then every strategy with the codecs it is meant for."""
    int8 = {"lr": 0.5, "momentum": 0.9}
    return [
        RunConfig("ddp", "ddp", note="fp32 ring all-reduce of grads every step"),
        RunConfig("lone", "lone", note="4 workers, no communication (mean over slots)"),
        RunConfig("diloco-h10-int8", "outer", "diloco", "int8", hparams=int8, sync_every=10),
        RunConfig("diloco-h10-fp32", "outer", "diloco", "fp32", hparams=int8, sync_every=10),
        RunConfig("diloco-h10-int4", "outer", "diloco", "int4", hparams=int8, sync_every=10),
        RunConfig("diloco-h50-int8", "outer", "diloco", "int8", hparams=int8, sync_every=50),
        streaming_config(num_fragments=5, tau=1, alpha=0.5),
        streaming_config(num_fragments=2, tau=4, alpha=0.5),
        RunConfig(
            "sparseloco-h10-top64of4096-2bit",
            "outer",
            "sparseloco",
            "topk",
            codec_options={"k": 64, "chunk": 4096, "value_bits": 2},
            hparams={"lr": 1.0, "beta": 0.95},
            sync_every=10,
        ),
        # Tuned (sweep_configs): sign-SGD wants ~1/3 of AdamW's lr, as Lion does; 3e-3 closed 37% of the gap.
        demo_config(k=12, chunk=1024, lr=1e-3, beta=0.999),
        *overlapped_configs(),
        *late_configs(),
        *muon_configs(),
    ]


def muon_configs() -> list[RunConfig]:
    """MuLoCo (arXiv 2505.23725): DiLoCo with Muon as the inner optimizer, whose pseudo-gradients keep their
    quality at few bits; int8 beside the AdamW row above, and int4."""
    return [
        RunConfig(
            f"diloco-h10-{codec}-muon",
            "outer",
            "diloco",
            codec,
            hparams={"lr": 0.5, "momentum": 0.9},
            sync_every=10,
            inner_optimizer="muon",
            note="inner Muon (blocks' matrices) + AdamW (the rest)",
        )
        for codec in ("int8", "int4")
    ]


def overlapped_configs() -> list[RunConfig]:
    """diloco H=10 int8 and sparseloco H=10 with the one-round-delayed and the eager outer update (Kale et al.
    2025, arXiv 2502.12996): what it costs in loss that the workers never wait for the exchange."""
    sparse = {"k": 64, "chunk": 4096, "value_bits": 2}
    rows = []
    for update in ("delayed", "eager"):
        note = "next phase starts at once; the mean lands a round late" + (
            ", own fresh update previewed" if update == "eager" else ""
        )
        rows.append(
            RunConfig(
                f"diloco-h10-int8-{update}",
                "outer",
                "diloco",
                "int8",
                hparams={"lr": 0.5, "momentum": 0.9},
                sync_every=10,
                outer_update=update,
                note=note,
            )
        )
        rows.append(
            RunConfig(
                f"sparseloco-h10-top64of4096-2bit-{update}",
                "outer",
                "sparseloco",
                "topk",
                codec_options=sparse,
                hparams={"lr": 1.0, "beta": 0.95},
                sync_every=10,
                outer_update=update,
                note=note,
            )
        )
    return rows


def late_configs() -> list[RunConfig]:
    """diloco H=10 int8 with one of the four workers late for every other round: its steps of the missed round
    merged into its next contribution (run.late_work = merge) or thrown away (discard), beside the synchronous
    row where nobody is late."""
    return [
        RunConfig(
            f"diloco-h10-int8-late2-{mode}",
            "outer",
            "diloco",
            "int8",
            hparams={"lr": 0.5, "momentum": 0.9},
            sync_every=10,
            late_every=2,
            late_work=mode,  # type: ignore[arg-type]
            note=f"worker 4 late every other round, its steps {'merged' if mode == 'merge' else 'dropped'}",
        )
        for mode in ("merge", "discard")
    ]


def sweep_configs() -> list[RunConfig]:
    """Tuning sweeps around the defaults (BENCHMARKS.md gives what each measured).

    DiLoCo's outer lr at --long (the default 0.5 is the reference's, set at 600 steps). DeMo's codec and lr at
    600 steps: bytes cap the codec, >= 30x under DDP means a payload of <= 67.8 KB per step, i.e. k <= 16 of
    1024 (4 bytes per kept coefficient + 4 per chunk), k <= 7 of 512 or k <= 4 of 256 (1-byte indices)."""
    outer_lrs = [
        RunConfig(
            f"diloco-h10-int8-olr{lr:g}",
            "outer",
            "diloco",
            "int8",
            hparams={"lr": lr, "momentum": 0.9},
            sync_every=10,
            note=f"outer lr {lr:g}",
        )
        for lr in (0.3, 0.4, 0.7, 1.0)
    ]
    # The delayed and eager updates apply every mean one round late: with DiLoCo's outer momentum that is a stale
    # heavy-ball step, which wants a lower outer lr or momentum than the synchronous one.
    delayed = [
        RunConfig(
            f"diloco-h10-int8-{update}-olr{lr:g}-m{momentum:g}",
            "outer",
            "diloco",
            "int8",
            hparams={"lr": lr, "momentum": momentum},
            sync_every=10,
            outer_update=update,
            note=f"outer lr {lr:g}, momentum {momentum:g}",
        )
        for update in ("delayed", "eager")
        for lr, momentum in ((0.25, 0.9), (0.5, 0.5), (0.7, 0.0), (1.0, 0.0))
    ]
    # The error feedback's residual in float32 instead of bfloat16 (DiLoCo's `feedback_bf16`, on by default).
    feedback_fp32 = [
        RunConfig(
            f"diloco-h10-{codec}-feedback-fp32",
            "outer",
            "diloco",
            codec,
            hparams={"lr": 0.5, "momentum": 0.9, "feedback_bf16": False},
            sync_every=10,
            note="the error-feedback residual in float32",
        )
        for codec in ("int8", "int4")
    ]
    return [
        *outer_lrs,
        *delayed,
        *feedback_fp32,
        demo_config(k=12, chunk=1024, lr=3e-3, beta=0.999, name="demo-top12of1024"),  # the untuned start
        demo_config(k=12, chunk=1024, lr=3e-3, beta=0.99),
        demo_config(k=12, chunk=1024, lr=3e-4, beta=0.999),
        demo_config(k=12, chunk=1024, lr=1e-3, beta=0.99),
        demo_config(k=12, chunk=1024, lr=1e-3, beta=0.999, weight_decay=0.1),
        demo_config(k=16, chunk=1024, lr=1e-3, beta=0.999),
        demo_config(k=4, chunk=256, lr=1e-3, beta=0.999),
    ]


# ------------------------------------------------------------------------------------------- model helpers


def flat_parameters(model: Transformer) -> torch.Tensor:
    """A copy of the parameters in the canonical flat order (named_parameters), as the agent's theta."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load_flat(model: Transformer, flat: torch.Tensor) -> None:
    # Copy rather than alias (vector_to_parameters aliases): the strategy keeps writing into its flat vectors.
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def flat_gradient(model: Transformer) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@torch.no_grad()
def evaluate(model: Transformer, batches: Sequence[Batch]) -> float:
    model.eval()
    total = sum(float(lm_loss(model(x), y)) for x, y in batches)
    model.train()
    return total / len(batches)


class Learner:
    """One model with its inner optimizer (the trainer's: AdamW or Muon), stepping on whatever batch it is given."""

    def __init__(self, model: Transformer, setup: Setup, inner_optimizer: str = "adamw") -> None:
        self.model = model
        self.setup = setup
        self.optimizer = build_inner_optimizer(
            model, inner_optimizer, lr=setup.inner_lr, weight_decay=setup.weight_decay, fused=False
        )

    def step(self, step: int, batch: Batch) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = self.setup.learning_rate(step)
        loss = lm_loss(self.model(batch[0]), batch[1])
        loss.backward()  # type: ignore[no-untyped-call]
        if self.setup.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.setup.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


# ------------------------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    config: RunConfig
    eval_loss: dict[int, float]
    """Eval loss at each report step (lone: mean over the workers)."""
    bytes_per_worker: dict[int, int]
    """Bytes one worker had sent by each report step."""
    worker_losses: dict[int, list[float]] = field(default_factory=dict)
    """Lone workers: each slot's eval loss at each report step."""
    peak_bytes_per_sync: int = 0
    """Largest number of bytes one worker sends in one sync (the burst the link must carry)."""
    curve: list[tuple[int, float]] = field(default_factory=list)
    """DDP: (step, eval loss) on a log grid, to read off DDP's loss at a given number of bytes."""
    seconds: float = 0.0


def ddp_bytes_per_step(num_params: int) -> int:
    return int(2 * (NUM_WORKERS - 1) / NUM_WORKERS * 4 * num_params)


def exchange_bytes(codec: Codec, payload_bytes: int) -> int:
    """Bytes one worker sends for one payload in the daemon's exchange pattern."""
    if codec.dense:
        return round(2 * (NUM_WORKERS - 1) / NUM_WORKERS * payload_bytes)
    return (NUM_WORKERS - 1) * payload_bytes


def ddp_curve_steps(steps: int) -> list[int]:
    """A log grid (DDP's loss at a few bytes is read early) plus every 25 steps."""
    grid = {0, steps}
    value = 1.0
    while value < steps:
        grid.add(int(value))
        value *= 1.25
    grid.update(range(25, steps, 25))
    return sorted(grid)


def slot_samplers(dataset: TokenDataset, seed: int, workers: int) -> list[BatchSampler]:
    """One sampler per simulated worker, each on its own disjoint data slot (as each node has its own)."""
    return [
        BatchSampler(
            dataset, "train", SEQ_LEN, BATCH_SIZE, slot=w, num_slots=workers, rank=0, world_size=1, seed=seed
        )
        for w in range(workers)
    ]


class Bench:
    """The shared pieces of one run: dataset, samplers, eval batches, the initial model."""

    def __init__(self, setup: Setup, dataset: TokenDataset, log: Callable[[str], None]) -> None:
        self.setup = setup
        self.log = log
        self.samplers = slot_samplers(dataset, setup.seed, NUM_WORKERS)
        self.held_out = eval_batches(dataset, SEQ_LEN, EVAL_BATCH_SIZE, setup.num_eval_batches)
        self.initial = build_model(model_config("tiny", max_seq_len=SEQ_LEN), seed=setup.seed)
        self.num_params = num_parameters(self.initial)
        self._started = time.perf_counter()

    def fresh_model(self) -> Transformer:
        return copy.deepcopy(self.initial)

    def run(self, config: RunConfig, on_report: Callable[[RunResult], None] | None = None) -> RunResult:
        """Run one config; `on_report` sees the result so far after each report step (to save partial runs)."""
        self._started = time.perf_counter()
        self._on_report = on_report
        result = RunResult(config, {}, {})
        if config.kind == "ddp":
            self._run_ddp(result)
        elif config.kind == "lone":
            self._run_lone(result)
        else:
            self._run_outer(result)
        return result

    def _tick(self, config: RunConfig, step: int) -> None:
        if step % 100 == 0 and step:
            self.log(
                f"  {config.name} step {step}/{self.setup.steps} ({time.perf_counter() - self._started:.0f} s)"
            )

    def _reported(self, result: RunResult, step: int) -> None:
        result.seconds = time.perf_counter() - self._started
        self.log(f"  {result.config.name} step {step}/{self.setup.steps} eval {result.eval_loss[step]:.4f}")
        if self._on_report is not None:
            self._on_report(result)

    def _run_ddp(self, result: RunResult) -> None:
        learner = Learner(self.fresh_model(), self.setup)
        per_step = ddp_bytes_per_step(self.num_params)
        result.peak_bytes_per_sync = per_step
        wanted = set(ddp_curve_steps(self.setup.steps)) | set(self.setup.report_steps)
        for step in range(self.setup.steps + 1):
            if step in wanted:
                loss = evaluate(learner.model, self.held_out)
                result.curve.append((step, loss))
                if step in self.setup.report_steps:
                    result.eval_loss[step], result.bytes_per_worker[step] = loss, step * per_step
                    self._reported(result, step)
            if step == self.setup.steps:
                break
            # DDP's mean gradient over 4 equal batches is the gradient of the mean loss over their union.
            batches = [sampler.batch(step) for sampler in self.samplers]
            union = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
            learner.step(step, union)
            self._tick(result.config, step + 1)

    def _run_lone(self, result: RunResult) -> None:
        learners = [
            Learner(self.fresh_model(), self.setup, result.config.inner_optimizer) for _ in range(NUM_WORKERS)
        ]
        for step in range(1, self.setup.steps + 1):
            for learner, sampler in zip(learners, self.samplers, strict=True):
                learner.step(step - 1, sampler.batch(step - 1))
            self._tick(result.config, step)
            if step in self.setup.report_steps:
                slots = [evaluate(learner.model, self.held_out) for learner in learners]
                result.worker_losses[step] = slots
                result.eval_loss[step] = sum(slots) / NUM_WORKERS
                result.bytes_per_worker[step] = 0
                self._reported(result, step)

    def _run_outer(self, result: RunResult) -> None:
        if result.config.outer_update != "sync":
            self._run_overlapped(result)
            return
        config = result.config
        strategies: list[OuterStrategy] = [
            make_strategy(config.strategy, self.num_params, config.make_codec(), **config.hparams)
            for _ in range(NUM_WORKERS)
        ]
        theta0 = flat_parameters(self.initial)
        # Every worker keeps its own theta_outer, as every node does; they must stay bit-identical.
        thetas = [theta0.clone() for _ in range(NUM_WORKERS)]
        sign_sgd = config.strategy == "demo"
        # Streaming DiLoCo keeps its staggered schedule to the end (no extra round at the last step, so the
        # figures at 600 steps of a --long run are those of a 600-step run); the others sync at the last step.
        streaming = config.strategy == "streaming-diloco"
        learners = [
            Learner(self.fresh_model(), self.setup, config.inner_optimizer) for _ in range(NUM_WORKERS)
        ]
        sent = 0
        rounds_done = 0
        kept: list[tuple[torch.Tensor, float] | None] = [None] * NUM_WORKERS  # late work: (d, its weight)
        in_flight: tuple[int, Exchanged] | None = None  # (step it lands at, the exchanged round)
        for step in range(1, self.setup.steps + 1):
            if sign_sgd:
                # DeMo's sign-SGD step is its only lr: the shared schedule scales it as it scales AdamW's.
                for s in strategies:
                    s.hparams["lr"] = float(config.hparams["lr"]) * self.setup.lr_factor(step - 1)
            locals_: list[torch.Tensor | None] = [None] * NUM_WORKERS
            for w, (learner, sampler) in enumerate(zip(learners, self.samplers, strict=True)):
                if sign_sgd:
                    # DeMo as optim.strategies models it: one plain SGD step with lr 1 on the loss gradient,
                    # so theta_outer - theta_local is that gradient (no AdamW, no clipping).
                    inputs, targets = sampler.batch(step - 1)
                    lm_loss(learner.model(inputs), targets).backward()  # type: ignore[no-untyped-call]
                    locals_[w] = thetas[w] - flat_gradient(learner.model)
                    learner.model.zero_grad(set_to_none=True)
                else:
                    learner.step(step - 1, sampler.batch(step - 1))
            if in_flight is not None and in_flight[0] == step:
                # The overlapped exchange lands now: outer step, then merge into the weights the ranks have
                # trained on for tau more steps since the sync point.
                self._land(strategies, thetas, learners, in_flight[1], None)
                in_flight = None
            if config.late_every and step % config.sync_every == 0:
                rounds_done += 1
                late = NUM_WORKERS - 1 if rounds_done % config.late_every == 0 else None
                round_bytes = self._round_with_late(config, strategies, thetas, learners, late, kept)
                sent += round_bytes
                result.peak_bytes_per_sync = max(result.peak_bytes_per_sync, round_bytes)
            elif step % config.sync_every == 0 or (step == self.setup.steps and not streaming):
                exchanged = self._exchange(strategies, thetas, learners, locals_)
                sent += exchanged.bytes_sent
                result.peak_bytes_per_sync = max(result.peak_bytes_per_sync, exchanged.bytes_sent)
                if config.tau == 0:
                    self._land(strategies, thetas, learners, exchanged, locals_)
                else:
                    in_flight = (step + config.tau, exchanged)
            self._tick(config, step)
            if step in self.setup.report_steps:
                if any(not torch.equal(thetas[0], theta) for theta in thetas[1:]):
                    raise RuntimeError(f"{config.name}: the workers' theta_outer diverged at step {step}")
                model = self.fresh_model()
                load_flat(model, thetas[0])
                result.eval_loss[step], result.bytes_per_worker[step] = evaluate(model, self.held_out), sent
                self._reported(result, step)

    def _run_overlapped(self, result: RunResult) -> None:
        """The daemon's `run.outer_update = delayed | eager` (node/daemon/rounds.py `RoundRunner._overlapped_loop`): at a sync point
        each worker's contribution is measured from the weights its inner phase started from, the round in
        flight (the previous one) lands on theta_outer, and the next inner phase starts at once from theta_outer
        (delayed) or from theta_outer plus the worker's preview of its own fresh contribution (eager:
        `OuterStrategy.eager_preview`); the exchange of this round runs during that phase. theta_outer stays
        bit-identical on every worker. Reported losses are theta_outer's with the round in flight landed (what
        the swarm holds once it commits, as a run that stops there would)."""
        config = result.config
        strategies = [
            make_strategy(config.strategy, self.num_params, config.make_codec(), **config.hparams)
            for _ in range(NUM_WORKERS)
        ]
        theta0 = flat_parameters(self.initial)
        thetas = [theta0.clone() for _ in range(NUM_WORKERS)]
        starts = [theta0.clone() for _ in range(NUM_WORKERS)]  # where each worker's inner phase began
        previews = [torch.zeros_like(theta0) for _ in range(NUM_WORKERS)]  # eager: own last transmitted
        learners = [
            Learner(self.fresh_model(), self.setup, config.inner_optimizer) for _ in range(NUM_WORKERS)
        ]
        sent = 0
        pending: Exchanged | None = None
        for step in range(1, self.setup.steps + 1):
            for learner, sampler in zip(learners, self.samplers, strict=True):
                learner.step(step - 1, sampler.batch(step - 1))
            if step % config.sync_every == 0 or step == self.setup.steps:
                if pending is not None:
                    land_shared(strategies, thetas, pending)
                exchanged = self._exchange(strategies, starts, learners, [None] * NUM_WORKERS)
                sent += exchanged.bytes_sent
                result.peak_bytes_per_sync = max(result.peak_bytes_per_sync, exchanged.bytes_sent)
                for w, (s, learner) in enumerate(zip(strategies, learners, strict=True)):
                    starts[w] = thetas[w].clone()
                    if config.outer_update == "eager":
                        s.eager_preview(starts[w], exchanged.transmitted[w], previews[w], NUM_WORKERS)
                        previews[w] = exchanged.transmitted[w].clone()
                    load_flat(learner.model, starts[w])
                pending = exchanged
            self._tick(config, step)
            if step in self.setup.report_steps:
                if any(not torch.equal(thetas[0], theta) for theta in thetas[1:]):
                    raise RuntimeError(f"{config.name}: the workers' theta_outer diverged at step {step}")
                landed = thetas[0].clone()
                if pending is not None:  # on a copy of one worker's strategy: the run goes on unchanged
                    land_shared([copy.deepcopy(strategies[0])], [landed], pending, workers=[0])
                model = self.fresh_model()
                load_flat(model, landed)
                result.eval_loss[step], result.bytes_per_worker[step] = evaluate(model, self.held_out), sent
                self._reported(result, step)

    def _exchange(
        self,
        strategies: list[OuterStrategy],
        thetas: list[torch.Tensor],
        learners: list[Learner],
        locals_: list[torch.Tensor | None],
    ) -> Exchanged:
        """The sync point of one round for all workers: contributions from the current local weights, encoded,
        decoded by everyone and averaged as the exchange does. No strategy state changes here."""
        theta_locals = [
            flat_parameters(learner.model) if given is None else given
            for learner, given in zip(learners, locals_, strict=True)
        ]
        contributions = [
            s.make_contribution(theta, local)
            for s, theta, local in zip(strategies, thetas, theta_locals, strict=True)
        ]
        codec = strategies[0].codec
        payloads = [s.codec.encode(c) for s, c in zip(strategies, contributions, strict=True)]
        transmitted = [codec.decode(p) for p in payloads]
        averaged = mean_of(transmitted)
        if codec.dense and not codec.lossless:
            # The part owner re-encodes the mean for the all-gather phase; everyone uses the decoded bytes.
            averaged = codec.decode(codec.encode(averaged))
        sent = max(exchange_bytes(codec, len(p)) for p in payloads)
        return Exchanged(contributions, transmitted, averaged, sent)

    def _round_with_late(
        self,
        config: RunConfig,
        strategies: list[OuterStrategy],
        thetas: list[torch.Tensor],
        learners: list[Learner],
        late: int | None,
        kept: list[tuple[torch.Tensor, float] | None],
    ) -> int:
        """One synchronous round in which worker `late` (if any) is late, as the daemon runs it: the others
        exchange and commit without it (a weighted mean: a worker that merged late work weighs 1 + its weight);
        the late worker keeps its pseudo-gradient (merge), takes worker 0's state, and its next round's
        contribution is made from theta - (s d_own + (1 - s) d_late), s = 1 / (1 + w_late). Returns the bytes
        one worker sent."""
        members = [w for w in range(NUM_WORKERS) if w != late]
        locals_ = [flat_parameters(learner.model) for learner in learners]
        weights = dict.fromkeys(members, 1.0)
        for w in members:
            if kept[w] is not None:
                d_late, w_late = kept[w]  # type: ignore[misc]
                s = 1.0 / (1.0 + w_late)
                locals_[w] = thetas[w] - (s * (thetas[w] - locals_[w]) + (1.0 - s) * d_late)
                weights[w] = 1.0 + w_late
                kept[w] = None
        contributions = {w: strategies[w].make_contribution(thetas[w], locals_[w]) for w in members}
        codec = strategies[0].codec
        payloads = {w: strategies[w].codec.encode(c) for w, c in contributions.items()}
        transmitted = {w: codec.decode(p) for w, p in payloads.items()}
        total = sum(weights.values())
        averaged = sum(transmitted[w] * (weights[w] / total) for w in members)
        assert isinstance(averaged, torch.Tensor)
        if codec.dense and not codec.lossless:
            averaged = codec.decode(codec.encode(averaged))
        for w in members:
            strategies[w].propose(contributions[w], transmitted[w])
            strategies[w].apply(thetas[w], averaged)
            strategies[w].commit()
            strategies[w].merge_into_local(thetas[w], locals_[w])
            load_flat(learners[w].model, locals_[w])
        if late is not None:
            if config.late_work == "merge":
                kept[late] = (thetas[late] - locals_[late], 1.0)
            thetas[late].copy_(thetas[0])  # the state sync: theta_outer and the strategy's state
            strategies[late].load_state_dict(strategies[0].state_dict())
            load_flat(learners[late].model, thetas[late])
        return max(exchange_bytes(codec, len(p)) for p in payloads.values())

    def _land(
        self,
        strategies: list[OuterStrategy],
        thetas: list[torch.Tensor],
        learners: list[Learner],
        exchanged: Exchanged,
        locals_: list[torch.Tensor | None] | None,
    ) -> None:
        """The round commits on every worker: error feedback, outer step, and the merge into the local weights
        (the ranks' current ones, or DeMo's given theta_outer - gradient, which the merge replaces)."""
        for w, (s, theta, learner) in enumerate(zip(strategies, thetas, learners, strict=True)):
            given = None if locals_ is None else locals_[w]
            local = flat_parameters(learner.model) if given is None else given
            s.propose(exchanged.contributions[w], exchanged.transmitted[w])
            s.apply(theta, exchanged.averaged)
            s.commit()
            s.merge_into_local(theta, local)
            load_flat(learner.model, local)


def land_shared(
    strategies: list[OuterStrategy],
    thetas: list[torch.Tensor],
    exchanged: Exchanged,
    workers: Sequence[int] | None = None,
) -> None:
    """A round in flight commits on theta_outer only (the ranks' weights are left alone: delayed/eager)."""
    for s, theta, w in zip(strategies, thetas, workers or range(len(strategies)), strict=True):
        s.propose(exchanged.contributions[w], exchanged.transmitted[w])
        s.apply(theta, exchanged.averaged)
        s.commit()


@dataclass
class Exchanged:
    """One round between its sync point and the moment it lands: what every worker sent and the mean."""

    contributions: list[torch.Tensor]
    transmitted: list[torch.Tensor]
    averaged: torch.Tensor
    bytes_sent: int
    """Bytes one worker sent for it (the largest payload's, in the exchange pattern)."""


# ------------------------------------------------------------------------------------------- report


def ddp_loss_at_bytes(ddp: RunResult, num_bytes: int, per_step: int) -> tuple[float, float]:
    """(DDP steps, DDP eval loss) when DDP had sent `num_bytes`: linear in steps between grid points."""
    step = num_bytes / per_step
    steps = [s for s, _ in ddp.curve]
    i = bisect.bisect_right(steps, step)
    if i >= len(steps):
        return step, ddp.curve[-1][1]
    (s0, l0), (s1, l1) = ddp.curve[i - 1], ddp.curve[i]
    return step, l0 + (l1 - l0) * (step - s0) / (s1 - s0)


def table(results: Sequence[RunResult], step: int, num_params: int) -> str:
    """The markdown table of the figures at `step`."""
    # The references: with DDP run at several inner lrs, the best one at this step (the strongest reference).
    ddps = [r for r in results if r.config.kind == "ddp" and step in r.eval_loss]
    ddp = min(ddps, key=lambda r: r.eval_loss[step], default=None)
    lone = next((r for r in results if r.config.kind == "lone"), None)
    per_step = ddp_bytes_per_step(num_params)
    ddp_bytes = step * per_step
    lines = [
        f"| config (at {step} steps/worker) | eval loss | vs DDP | gap closed | MB sent/worker | DDP bytes / these "
        "| peak KB/sync | DDP loss at equal bytes | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if step not in r.eval_loss:
            continue
        loss = r.eval_loss[step]
        closed = "n/a"
        versus = "-"
        if ddp is not None and r is not ddp and step in ddp.eval_loss:
            versus = f"{100 * (loss / ddp.eval_loss[step] - 1):+.1f}%"
        if ddp is not None and lone is not None and step in ddp.eval_loss and step in lone.eval_loss:
            gap = lone.eval_loss[step] - ddp.eval_loss[step]
            closed = f"{100 * (lone.eval_loss[step] - loss) / gap:.0f}%"
        sent = r.bytes_per_worker[step]
        ratio = "-" if sent == 0 else f"{ddp_bytes / sent:.0f}x"
        at_bytes = "-"
        if ddp is not None and r.config.kind == "outer":
            # DDP at its best at that many bytes (with DDP run at several inner lrs, the lowest of them).
            ddp_step, ddp_loss = min((ddp_loss_at_bytes(d, sent, per_step) for d in ddps), key=lambda x: x[1])
            at_bytes = f"{ddp_loss:.3f} (step {ddp_step:.1f})"
        note = r.config.note
        if r.config.kind == "lone":
            note = f"slots {', '.join(f'{x:.3f}' for x in r.worker_losses[step])}"
        peak = "-" if r.peak_bytes_per_sync == 0 else f"{r.peak_bytes_per_sync / 1e3:.1f}"
        lines.append(
            f"| {r.config.name} | {loss:.3f} | {versus} | {closed} | {sent / 1e6:.2f} | {ratio} | {peak} | {at_bytes} "
            f"| {note} |"
        )
    return "\n".join(lines)


def describe(config: RunConfig) -> dict[str, Any]:
    return {
        "name": config.name,
        "kind": config.kind,
        "note": config.note,
        "strategy": config.strategy,
        "codec": config.codec,
        "codec_options": config.codec_options,
        "hparams": config.hparams,
        "sync_every": config.sync_every,
        "tau": config.tau,
        "outer_update": config.outer_update,
        "inner_optimizer": config.inner_optimizer,
    }


def write_json(path: Path, command: str, setup: Setup, results: Sequence[RunResult]) -> None:
    rows = [
        {
            "config": describe(r.config),
            "eval_loss": r.eval_loss,
            "bytes_per_worker": r.bytes_per_worker,
            "worker_losses": r.worker_losses,
            "peak_bytes_per_sync": r.peak_bytes_per_sync,
            "seconds": r.seconds,
            "curve": r.curve,
        }
        for r in results
    ]
    path.write_text(json.dumps({"command": command, "setup": setup.describe(), "results": rows}, indent=1))


def read_schedule(path: Path) -> str:
    """The lr schedule a --json file was run with (files from before --schedule existed ran constant)."""
    data = json.loads(path.read_text())
    return str(data.get("setup", {}).get("schedule", "constant")) if isinstance(data, dict) else "constant"


def read_json(path: Path) -> list[RunResult]:
    """Results written by --json (e.g. by runs of different --only sets), to print one table from."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "results" not in data:
        raise ValueError(f"{path}: expected a --json output of this script, got {type(data).__name__}")

    def by_step(values: dict[str, Any]) -> dict[int, Any]:
        return {int(step): value for step, value in values.items()}

    # A run at another inner lr than the default is labelled so, so a merged table can show both (e.g. each
    # strategy at its own best inner lr beside DDP at its own).
    inner_lr = float(data.get("setup", {}).get("inner_lr", Setup.inner_lr))
    results = []
    for row in data["results"]:
        config = RunConfig(**row["config"])
        if inner_lr != Setup.inner_lr:
            config = replace(config, name=f"{config.name}@ilr{inner_lr:g}")
        results.append(
            RunResult(
                config,
                by_step(row["eval_loss"]),
                by_step(row["bytes_per_worker"]),
                by_step(row["worker_losses"]),
                row["peak_bytes_per_sync"],
                [(int(step), loss) for step, loss in row["curve"]],
                row["seconds"],
            )
        )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"inner steps per worker (default {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--long", action="store_true", help=f"{LONG_FACTOR}x the steps; figures at 1x and {LONG_FACTOR}x"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 steps, 1 eval batch")
    parser.add_argument(
        "--report-every",
        type=int,
        default=0,
        metavar="N",
        help="also take the figures every N steps (a table each; the JSON is saved at each, to watch long runs)",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="run the tuning sweeps (sweep_configs) instead of the defaults"
    )
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="run only these configs (repeatable)"
    )
    parser.add_argument(
        "--merge", type=Path, nargs="+", default=None, metavar="JSON", help="print the tables of --json files"
    )
    parser.add_argument("--inner-lr", type=float, default=Setup.inner_lr)
    parser.add_argument(
        "--schedule",
        choices=["constant", "cosine"],
        default="constant",
        help="lr after warm-up, for every config alike: constant (default; a --long run's figures at 1x are a "
        "1x run's), or cosine decay to 10%% of the peak at the last step (as the DiLoCo papers train)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--corpus",
        choices=["pydoc", "stdlib"],
        default="pydoc",
        help="pydoc: the bundled corpus (default); stdlib: CPython's library sources, ~11 MB, for --long "
        "runs that should not overfit (see benchmarks/stdlib_corpus.py)",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "farloco-bench-data")
    # One thread: on a shared 2-core machine two OpenMP threads per process were 4x slower under load.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    base = args.steps if args.steps is not None else (20 if args.quick else DEFAULT_STEPS)
    if base < 1:
        parser.error(f"--steps: expected >= 1, got {base}")
    steps = base * LONG_FACTOR if args.long else base
    report_steps = (base, steps) if args.long else (steps,)
    if args.report_every < 0:
        parser.error(f"--report-every: expected >= 0, got {args.report_every}")
    if args.report_every:
        report_steps = tuple(sorted({*report_steps, *range(args.report_every, steps, args.report_every)}))
    setup = Setup(
        steps=steps,
        report_steps=report_steps,
        inner_lr=args.inner_lr,
        schedule=args.schedule,
        num_eval_batches=1 if args.quick else Setup.num_eval_batches,
    )
    configs = default_configs()
    every = configs + sweep_configs()
    known = [c.name for c in every]
    unknown = sorted(set(args.only) - set(known))
    if unknown:
        parser.error(f"--only: expected some of {known}, got {unknown}")
    if args.sweep:
        configs = sweep_configs()
    if args.only:
        configs = [c for c in every if c.name in args.only]

    if args.merge:
        schedules = {path: read_schedule(path) for path in args.merge}
        if len(set(schedules.values())) > 1:
            parser.error(f"--merge: expected runs of one lr schedule, got {schedules}")
        order = {c.name: i for i, c in enumerate(every)}
        merged = sorted(
            (r for path in args.merge for r in read_json(path)),
            key=lambda r: order.get(r.config.name, len(order)),
        )
        num_params = num_parameters(build_model(model_config("tiny", max_seq_len=SEQ_LEN), seed=0))
        for step in sorted({step for r in merged for step in r.eval_loss}):
            print(table(merged, step, num_params) + "\n")
        return 0
    torch.set_num_threads(args.threads)
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join([".venv/bin/python", "benchmarks/convergence.py", *given])

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.corpus == "stdlib":
        from stdlib_corpus import stdlib_dataset  # benchmarks/ is on sys.path when this file is run

        dataset_dir = stdlib_dataset(args.cache_dir)
    else:
        dataset_dir = builtin_dataset(args.cache_dir)
    bench = Bench(setup, open_dataset(dataset_dir), log)
    log(f"tiny model: {bench.num_params} parameters; {NUM_WORKERS} workers x batch {BATCH_SIZE} x {SEQ_LEN}")
    results: list[RunResult] = []

    def save(partial: RunResult) -> None:
        # After every report step, so a long run interrupted keeps what it measured (its 600-step figures).
        if args.json is not None:
            write_json(args.json, command, setup, [*results, partial])

    for config in configs:
        log(f"{config.name} ...")
        results.append(bench.run(config, save))
        log(f"  {config.name} took {results[-1].seconds:.0f} s")

    print(f"Command: `{command}`\n")
    for step in report_steps:
        print(table(results, step, bench.num_params))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
