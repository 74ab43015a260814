"""A trainer rank: the inner loop of one node, launched and supervised by the agent via torch's elastic launcher.

Each rank joins the node-local process group (gloo on CPU, NCCL on CUDA), builds the model from the run seed,
splits it over the node's (dp_shard x tp) mesh (farloco.node.training.parallel: tensor parallelism, activation
checkpointing, compile, FSDP2 with bf16 mixed precision), and loops:

    wait for the agent to publish a sequence -> load theta_outer rows (unless told to keep local weights)
    -> evaluate theta_outer on held-out batches -> the sequence's inner steps on this rank's data share
       (AdamW; for DeMo one plain SGD step of lr 1, see `plain_gradient_step`)
    -> write this rank's rows of the parameters into the hand-off -> mark the sequence done

The ranks of one tp group see the same batches (the data is split over the dp dimension only). On CUDA the
rows go to and from the hand-off through pinned host buffers on a side stream (`HostStaging`).

The inner optimizer state stays local across rounds, as in DiLoCo. Between sequences the ranks save it (with the
model shards) into a checkpoint's inner/ folder, or load it back on resume, when the agent asks through the
hand-off (`serve_inner_request`). A rank group restarted by the launcher starts with fresh AdamW state from the
theta the agent last published. Run as `python -m farloco.node.training.trainer --handoff ... --run-dir ...`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from farloco.node.checkpoint import load_inner_state, optimizer_fingerprint, save_inner_state
from farloco.node.config import Config, load_config
from farloco.node.handoff import (
    COMMAND_STOP,
    INNER_FAILED,
    INNER_FRESH,
    INNER_OK,
    INNER_SAVE,
    Handoff,
    layout_of,
)
from farloco.node.schedule import inner_learning_rate
from farloco.node.training.data import BatchSampler, eval_batches, open_dataset
from farloco.node.training.flops import device_peak_flops
from farloco.node.training.models import ModelSpec, as_spec, build_spec
from farloco.node.training.muon import build_inner_optimizer
from farloco.node.training.parallel import (
    ShardView,
    clip_grad_norm,
    compute_dtype,
    node_mesh,
    parallelize,
    ranks_use_cuda,
)

log = logging.getLogger("farloco.trainer")

POLL_SECONDS = 0.002
# Steps of a compiled model that compile it (the first forward/backward and a recompile or two).
COMPILE_WARMUP_STEPS = 3


def resolve_device(config: Config) -> torch.device:
    if ranks_use_cuda(config):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@contextmanager
def process_group(backend: str) -> Iterator[None]:
    dist.init_process_group(backend=backend)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()  # a peer may be gone: no barrier
        raise
    # Every rank finishes its last collective before any tears the group down: a rank that destroyed its gloo
    # pairs under another's last op made that one abort ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def plain_gradient_step(config: Config) -> bool:
    """DeMo's gradient is theta_outer - theta_local after one plain SGD step of lr 1 (farloco.optim DeMo): its
    ranks run exactly that instead of AdamW; the strategy's own sign-SGD step is the real update."""
    return config.run.strategy == "demo"


def learning_rate(config: Config, step: int) -> float:
    """The inner rate of swarm step `step`: run.lr_schedule (node/schedule.py); demo's plain step 1."""
    if plain_gradient_step(config):
        return 1.0
    return inner_learning_rate(config.run, step)


def run_rank(args: argparse.Namespace) -> None:
    config = load_config(Path(args.config))
    device = resolve_device(config)
    if device.type == "cpu":
        torch.set_num_threads(config.node.threads_per_rank)
    else:
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    handoff = Handoff.attach(Path(args.handoff))
    with process_group(backend):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if world_size != handoff.world_size:
            raise RuntimeError(f"hand-off made for {handoff.world_size} ranks, launched with {world_size}")
        spec = build_spec(config.run.model, seed=config.run.seed)
        model = spec.module
        layout = layout_of(model)
        model.to(device)
        mesh = node_mesh(device, world_size, rank, config.node.tp)
        parallelize(spec, config, device, mesh)
        params = dict(model.named_parameters())
        views = [ShardView(params[slot.name], slot) for slot in layout]
        optimizer: torch.optim.Optimizer
        if plain_gradient_step(config):
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        else:
            optimizer = build_inner_optimizer(
                model,
                config.run.inner_optimizer,
                lr=config.run.inner_lr,
                weight_decay=config.run.inner_weight_decay,
                fused=device.type == "cuda",
                is_matrix=spec.is_muon_matrix,
            )
        dataset = open_dataset(Path(args.dataset))
        # The data is split over the data-parallel ranks; the tp ranks of one group share their batches.
        per_rank_batch = config.run.batch_size // mesh.dp_size
        if per_rank_batch < 1:
            raise ValueError(
                f"run.batch_size {config.run.batch_size} is smaller than the {mesh.dp_size} dp ranks"
            )
        sampler = BatchSampler(
            dataset,
            "train",
            config.run.seq_len,
            per_rank_batch,
            slot=args.slot,
            num_slots=config.run.data_slots,
            rank=mesh.dp_rank,
            world_size=mesh.dp_size,
            seed=config.run.seed,
        )
        held_out = (
            eval_batches(dataset, config.run.seq_len, per_rank_batch, config.node.eval_batches)
            if config.node.eval_batches
            else []
        )
        # Each dp rank evaluates its own share of the held-out batches; the mean is all-reduced.
        held_out = held_out[mesh.dp_rank :: mesh.dp_size] or held_out[:1]
        precision = "bf16" if compute_dtype(config, device) == torch.bfloat16 else "fp32"
        handoff.mark_peak_flops(rank, device_peak_flops(device, precision, config.node.peak_tflops))
        # On CPU in the synchronous loop the weights live in the hand-off's local region itself (the agent reads
        # them only while we wait for the next theta): one copy of them on the host instead of two.
        shared = handoff.local if device.type == "cpu" and config.run.outer_update == "sync" else None
        staging = HostStaging(views, device, region=handoff.mapped, shared=shared)
        try:
            loop(handoff, spec, staging, optimizer, sampler, held_out, config, rank, device, args.agent_pid)
        finally:
            staging.close()


def evaluate(
    spec: ModelSpec, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> float:
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model = spec.module
    model.eval()
    with torch.no_grad():
        for inputs, targets in batches:
            loss = spec.compute_loss(inputs.to(device), targets.to(device))
            total[0] += loss.double()
            total[1] += 1
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] else math.nan


def loop(
    handoff: Handoff,
    spec: ModelSpec,
    staging: HostStaging,
    optimizer: torch.optim.Optimizer,
    sampler: BatchSampler,
    held_out: list[tuple[torch.Tensor, torch.Tensor]],
    config: Config,
    rank: int,
    device: torch.device,
    agent_pid: int = 0,
) -> None:
    done_seq = handoff.report(rank).done_seq
    # A restarted rank group redoes an inner-state request that any rank had not finished: they all must meet
    # in its collectives.
    inner_done = min(handoff.report(r).inner_done for r in range(handoff.world_size))
    # The agent that launched us: given by it, since a rank still importing torch when the agent was SIGKILLed
    # was already re-parented when it got here, and took its new parent (init) for the agent, forever.
    parent = agent_pid or os.getppid()
    loaded_once = False
    tokens = 0
    pid = os.getpid()
    steps_taken = 0
    # The first steps of a compiled model compile it: they stay out of the step time (and so of tokens/s).
    warmup_steps = COMPILE_WARMUP_STEPS if config.node.compile else 0
    step_fn = inner_step_function()
    intervals = IntervalLog(handoff, rank, config.node.log_every_steps)
    interval_from = 0  # the global step the interval being gathered continues from
    while True:
        while (
            handoff.publish_seq <= done_seq
            and handoff.command != COMMAND_STOP
            and handoff.inner_seq <= inner_done
        ):
            if os.getppid() != parent:
                # The agent died (SIGKILL leaves no chance to stop us): don't linger as an orphan.
                return
            time.sleep(POLL_SECONDS)
        if handoff.inner_seq > inner_done:
            # Served between sequences, and before STOP, so the state saved is the one at a round boundary.
            inner_done = serve_inner_request(handoff, spec.module, optimizer, rank, device)
            continue
        if handoff.command == COMMAND_STOP:
            return
        seq = handoff.publish_seq
        reload, _round_id, step_base, inner_steps = handoff.work()
        if reload or not loaded_once:
            staging.load(handoff.theta)
            loaded_once = True
        if held_out and reload:
            loss = evaluate(spec, held_out, device)
            handoff.mark_eval(rank, seq, loss)
        losses: list[torch.Tensor] = []
        timed = 0.0
        timed_steps = 0
        ran = 0
        lr = learning_rate(config, step_base)
        for i in range(inner_steps):
            step = step_base + i
            if step != interval_from:  # the count jumped (a resync, a resumed node): no interval across it
                intervals.losses, intervals.seconds, intervals.tokens = [], 0.0, 0
            started = time.perf_counter()
            lr = learning_rate(config, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, targets = sampler.batch(step)
            losses.append(step_fn(spec, optimizer, inputs.to(device), targets.to(device), config))
            tokens += inputs.numel()
            handoff.mark_progress(rank, inner_step=step + 1, tokens=tokens, pid=pid, now_ns=time.time_ns())
            stop, cut = step_signals(handoff, parent, device, seq)
            if stop:
                return
            ran += 1
            steps_taken += 1
            took = time.perf_counter() - started
            if steps_taken > warmup_steps:
                timed += took
                timed_steps += 1
            intervals.step(step + 1, losses[-1], took, inputs.numel())
            interval_from = step + 1
            if cut:
                break  # a partial contribution: the agent's round is ready without the steps we have left
        train_loss = float(torch.stack(losses).mean()) if losses else math.nan
        staging.store(handoff.local)
        # Every rank's rows must be in place before any rank reports done: the agent reads the whole vector.
        dist.barrier()
        handoff.mark_done(
            rank,
            seq,
            train_loss=train_loss,
            step_seconds=timed / max(timed_steps, 1),
            steps=ran,
            inner_lr=lr,
        )
        done_seq = seq


class IntervalLog:
    """node.log_every_steps: after every inner step whose global count is a multiple of `every`, this rank's
    mean loss, step time and tokens over the interval's steps go to its hand-off block (`mark_interval`), for
    the agent's 'steps' event. Costs no device sync of its own: it reads the losses after `step_signals`, which
    has already waited for the step (its flags come back to the host), so they are computed values by then."""

    def __init__(self, handoff: Handoff, rank: int, every: int) -> None:
        self.handoff, self.rank, self.every = handoff, rank, every
        self.losses: list[torch.Tensor] = []
        self.seconds = 0.0
        self.tokens = 0

    def step(self, done: int, loss: torch.Tensor, seconds: float, tokens: int) -> None:
        """Inner step `done - 1` (global) took `seconds` over `tokens` tokens; `done` steps are behind us."""
        if not self.every:
            return
        self.losses.append(loss)
        self.seconds += seconds
        self.tokens += tokens
        if done % self.every:
            return
        mean = float(torch.stack(self.losses).mean())
        self.handoff.mark_interval(self.rank, step=done, loss=mean, seconds=self.seconds, tokens=self.tokens)
        self.losses, self.seconds, self.tokens = [], 0.0, 0


def train_step(
    model_or_spec: ModelSpec | torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: Config,
) -> torch.Tensor:
    """One inner step over the rank's batch, in node.micro_batches micro-batches (gradients accumulate
    unreduced until the last one); returns the batch's mean loss (a detached tensor, no device sync)."""
    spec = as_spec(model_or_spec)
    model = spec.module
    micro = config.node.micro_batches
    total = torch.zeros((), device=inputs.device)
    for index, (micro_inputs, micro_targets) in enumerate(
        zip(inputs.chunk(micro), targets.chunk(micro), strict=True)
    ):
        # FSDP2's gradient sync; a plain module (one float32 rank: parallel.shards) has none to hold back.
        if micro > 1 and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(index == micro - 1)  # type: ignore[operator]
        loss = spec.compute_loss(micro_inputs, micro_targets)
        (loss / micro).backward()  # type: ignore[no-untyped-call]
        total += loss.detach() / micro
    if config.run.grad_clip > 0:
        clip_grad_norm(list(model.parameters()), config.run.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


class HostStaging:
    """Moves this rank's shards between the device and the hand-off's flat vectors.

    On CPU each shard is copied in place. On CUDA the copies run on a side stream: host-to-device copies are
    queued asynchronously and the training stream waits for them on the device, not on the host; device-to-host
    copies wait only for the last optimizer step. Given the hand-off's mapping (`region`), it is page-locked once
    (cudaHostRegister), so a shard that is one run of the flat vector (FSDP's row shards, 1-D shards) is copied
    by DMA straight between the device and the shared vector; the others (TP's column shards) go through one
    pinned staging buffer, and all of them do where the registration is refused."""

    def __init__(
        self,
        views: list[ShardView],
        device: torch.device,
        region: torch.Tensor | None = None,
        shared: torch.Tensor | None = None,
    ) -> None:
        self.views = views
        self.cuda = device.type == "cuda"
        self.region: torch.Tensor | None = None
        self.spans: list[tuple[int, int] | None] = []
        self.direct: list[tuple[int, int] | None] = []
        self.shared: torch.Tensor | None = None
        if not self.cuda:
            if shared is not None:
                self.shared = share_weights(views, shared)
            return
        if region is not None and region.numel() and register_host_memory(region):
            self.region = region
        begin = 0
        for view in views:
            run = view.flat_range() if self.region is not None else None
            self.direct.append(run)
            if view.numel and run is None:
                self.spans.append((begin, begin + view.numel))
                begin += view.numel
            else:
                self.spans.append(None)
        self.buffer = torch.empty(begin, dtype=torch.float32, pin_memory=begin > 0)
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def _registered(self, flat: torch.Tensor) -> bool:
        if self.region is None:
            return False
        low = self.region.data_ptr()
        high = low + self.region.numel() * self.region.element_size()
        return low <= flat.data_ptr() and flat.data_ptr() + flat.numel() * flat.element_size() <= high

    def load(self, flat: torch.Tensor) -> None:
        if not self.cuda:
            if self.shared is not None and flat.data_ptr() == self.shared.data_ptr():
                return  # the weights are there already
            for view in self.views:
                view.load(flat)
            return
        direct = self._registered(flat)
        self.stream.synchronize()  # the buffer's last copies are done before it is refilled
        staged = self._stage_spans(direct)
        for view, span in staged:
            self.buffer[span[0] : span[1]].view(view.local.shape).copy_(view.host_piece(flat))
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(self.stream):
            for view, run in zip(self.views, self.direct, strict=True):
                if direct and run is not None:
                    view.local.copy_(flat[run[0] : run[1]].view(view.local.shape), non_blocking=True)
            for view, span in staged:
                view.local.copy_(self.buffer[span[0] : span[1]].view(view.local.shape), non_blocking=True)
        torch.cuda.current_stream().wait_stream(self.stream)

    def store(self, flat: torch.Tensor) -> None:
        if not self.cuda:
            if self.shared is not None and flat.data_ptr() == self.shared.data_ptr():
                return  # the weights live there
            for view in self.views:
                view.store(flat)
            return
        direct = self._registered(flat)
        staged = self._stage_spans(direct)
        self.stream.wait_stream(torch.cuda.current_stream())  # after the last optimizer step
        with torch.cuda.stream(self.stream):
            for view, run in zip(self.views, self.direct, strict=True):
                if direct and run is not None:
                    flat[run[0] : run[1]].copy_(view.local.detach().reshape(-1), non_blocking=True)
            for view, span in staged:
                self.buffer[span[0] : span[1]].copy_(view.local.detach().reshape(-1), non_blocking=True)
        self.stream.synchronize()
        for view, span in staged:
            view.store_from(flat, self.buffer[span[0] : span[1]])

    def _stage_spans(self, direct: bool) -> list[tuple[ShardView, tuple[int, int]]]:
        """The shards that go through the staging buffer, with their span in it: every non-empty one where
        `flat` is not the registered hand-off (the buffer then grows to hold them all, once)."""
        if direct:
            return [
                (view, span) for view, span in zip(self.views, self.spans, strict=True) if span is not None
            ]
        spans, begin = [], 0
        for view in self.views:
            if view.numel:
                spans.append((view, (begin, begin + view.numel)))
                begin += view.numel
        if self.buffer.numel() < begin:
            self.buffer = torch.empty(begin, dtype=torch.float32, pin_memory=True)
        return spans

    def close(self) -> None:
        """Unregister the hand-off's pages (before the mapping goes)."""
        if self.region is not None:
            region, self.region = self.region, None
            try:  # after a failed step the device may be gone: that error, not this one, is the rank's
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaHostUnregister(region.data_ptr())  # type: ignore[no-untyped-call]
            except RuntimeError as exc:
                log.warning("hand-off: unregistering its pages failed: %s", exc)


def share_weights(views: list[ShardView], flat: torch.Tensor) -> torch.Tensor | None:
    """Make each parameter's storage its place in `flat` (the hand-off's local region), so the rank trains in it
    and `store` has nothing to copy; `flat` if done, None (nothing changed) where some parameter is not one whole
    run of it (a sharded or split one: FSDP over several ranks, tp). The values are not copied over: the rank
    loads theta before its first step, and until then `flat` may still hold what the agent reads."""
    runs = []
    for view in views:
        run = None if isinstance(view.param, DTensor) else view.flat_range()
        if run is None or run[1] - run[0] != view.param.numel():
            return None
        runs.append(run)
    for view, (begin, end) in zip(views, runs, strict=True):
        view.param.data = flat[begin:end].view(view.param.shape)
        view.local = view.param.data
    return flat


def register_host_memory(region: torch.Tensor) -> bool:
    """Page-lock `region` (host memory mapped from the hand-off) for the current CUDA device; False where the
    driver refuses it (the caller then stages the copies through a pinned buffer)."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    error = cudart.cudaHostRegister(region.data_ptr(), region.numel() * region.element_size(), 0)
    if error != cudart.cudaError.success:
        log.warning(
            "hand-off: cudaHostRegister refused (%s); copies go through a pinned staging buffer", error
        )
        return False
    return True


def serve_inner_request(
    handoff: Handoff,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    device: torch.device,
) -> int:
    """Save or load this node's sharded model/optimizer state where the agent asked (collective: every rank
    serves the same request at the same point); report the outcome and the optimizer's step and fingerprint."""
    seq = handoff.inner_seq
    op, directory = handoff.inner_request()
    if op == INNER_SAVE:
        result = INNER_OK if save_inner_state(directory, model, optimizer) else INNER_FAILED
    else:
        result = INNER_OK if load_inner_state(directory, model, optimizer) else INNER_FRESH
    step, fingerprint = optimizer_fingerprint(optimizer, device)
    handoff.mark_inner_done(rank, seq, result=result, optimizer_step=step, optimizer_fingerprint=fingerprint)
    return seq


def inner_step_function() -> Callable[..., torch.Tensor]:
    """`train_step`, or, when the node's fault plan (FARLOCO_FAULTS) asks for `slow-steps=S`, the same step taking
    S seconds longer (node/faults/wrappers.py `slowed`: a straggler on purpose). The agent checked the plan
    before starting the ranks."""
    from farloco.node.faults.plan import parse_faults

    seconds = parse_faults(os.environ.get("FARLOCO_FAULTS", "")).slow_steps
    if not seconds:
        return train_step
    from farloco.node.faults.wrappers import slowed

    return slowed(train_step, seconds)


def step_signals(handoff: Handoff, parent: int, device: torch.device, seq: int) -> tuple[bool, bool]:
    """After each inner step: (stop, cut). Stop: the agent says so or died. Cut: the agent asks to end sequence
    `seq` here (`Handoff.cut`). All ranks agree on both in one collective, so none is left in a collective and
    a cut sequence ends after the same step on every rank, whichever rank saw the request first."""
    flags = torch.tensor(
        [
            1 if handoff.command == COMMAND_STOP or os.getppid() != parent else 0,
            1 if handoff.cut_seq == seq else 0,
        ],
        device=device,
    )
    if dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    stop, cut = flags.tolist()
    return bool(stop), bool(cut)


# How long a rank given SIGTERM waits for the agent's STOP before it dies of the signal after all.
SIGTERM_GRACE = 10.0


def defer_sigterm(handoff_path: Path, grace: float = SIGTERM_GRACE) -> None:
    """A SIGTERM that reaches the rank and its agent together (Slurm's `scancel --signal=TERM` and systemd's
    control-group stop signal every process of the node) is the agent's to act on: it leaves gracefully and
    stops the ranks through the hand-off, and a rank killed by that signal meanwhile would be a failed rank the
    launcher restarts. So the rank notes the signal and keeps going; if no STOP comes within `grace` seconds (the
    launcher itself stopping the rank group for a restart, or an agent that is gone), it dies of the signal as
    it would have."""
    import signal
    import threading

    def expire() -> None:
        try:
            stopping = Handoff.attach(handoff_path).command == COMMAND_STOP
        except (OSError, ValueError):
            stopping = False
        if not stopping:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def on_term(signum: int, frame: object) -> None:
        timer = threading.Timer(grace, expire)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_term)


def watch_agent(agent_pid: int, every: float = 1.0) -> threading.Thread:
    """End this rank at once when the agent that launched it is gone (it is no longer our parent), wherever the
    rank is: a rank still importing torch or joining its process group when the agent was SIGKILLed otherwise
    waits out the rendezvous store's connect timeout (many minutes) before noticing, an orphan meanwhile. The
    inner loop's own check ends it cleanly between steps; this covers the rest."""

    def watch() -> None:
        while os.getppid() == agent_pid:
            time.sleep(every)
        sys.stderr.write(f"farloco trainer rank: the agent (pid {agent_pid}) is gone; exiting\n")
        sys.stderr.flush()
        os._exit(1)

    thread = threading.Thread(target=watch, name="farloco-agent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="farloco trainer rank (started by the agent, not by hand)")
    parser.add_argument("--handoff", required=True, help="path of the agent's shared-memory hand-off file")
    parser.add_argument("--config", required=True, help="the node's resolved config (TOML)")
    parser.add_argument("--dataset", required=True, help="prepared dataset directory")
    parser.add_argument("--slot", type=int, required=True, help="this node's data slot")
    parser.add_argument(
        "--agent-pid",
        type=int,
        default=0,
        help="the agent's pid: the rank ends when it is no longer its parent",
    )
    args = parser.parse_args(argv)
    defer_sigterm(Path(args.handoff))
    if args.agent_pid:
        watch_agent(args.agent_pid)
    run_rank(args)
    # Stopped by the agent (or orphaned): the process group is torn down and the hand-off is the agent's, so
    # nothing is left to clean up. Skip the interpreter's teardown of torch, which took seconds of a leave's
    # budget on a loaded machine (a rank still tearing down was SIGKILLed as one stuck in a step).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
