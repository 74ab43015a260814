"""The node's outer state as the agent holds it: theta_outer at round `round_id` with its digest `outer_hash`,
the strategy and codec that step it (node/daemon/outer.py `OuterRound`: the arithmetic and its buffers), the one
thread its long passes run on, the lock every change or copy of it takes, and the copies donors serve.

Rules:
- theta_outer changes only on the outer thread under `lock`: a commit (`commit`) or an install (`install`); the
  copies donors serve and checkpoints write (`snapshot`) are made there too, so none sees another half-way.
- `round_id` only moves forward: a commit, a round closed without an update (`advance`), an install of a newer
  state. Whoever moves it tells the exchange (the swarm and the round runner, which hold it).
- A long pass, once begun, is seen through even if its caller is cancelled (a leave): theta moved, so round_id
  must.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from farloco.node.config import Config, diff_run, run_section
from farloco.node.daemon.core import AgentError, build_outer
from farloco.node.daemon.outer import OuterError, OuterRound, Transmitted, theta_hash
from farloco.node.handoff import flatten, layout_of
from farloco.node.schedule import outer_lr_factor
from farloco.node.training.model import num_parameters
from farloco.node.training.models import build_spec
from farloco.node.training.parallel import check_node_layout, ranks_use_cuda
from farloco.optim.strategies import StrategyError
from farloco.protocol.exchange import OnDemand
from farloco.util.memory import exclude_from_fork

if TYPE_CHECKING:
    from farloco.node.faults.injector import FaultInjector

_T = TypeVar("_T")

Snapshot = tuple[dict[str, Any], dict[str, torch.Tensor]]


class OuterState:
    """theta_outer at `round_id` (see the module docstring), built from the run's model and seed."""

    def __init__(self, config: Config, run_hash: str, injector: FaultInjector | None = None) -> None:
        self.config = config
        self.run_hash = run_hash
        check_node_layout(
            config
        )  # tp against the model's heads and widths: a config error, before anything starts
        model = build_spec(config.run.model, seed=config.run.seed, init_from=config.run.init_from).module
        self.layout = layout_of(model)
        self.num_params = num_parameters(model)
        theta = flatten(model, self.layout)
        if theta.numel() != self.num_params:
            raise AgentError(f"flat layout has {theta.numel()} values, the model {self.num_params}")
        del model
        # Built before anything listens, so a bad strategy or codec is a config error, not a half-started node.
        self.codec, self.strategy = build_outer(config, self.num_params)
        from farloco.optim import Aggregator

        # run.aggregator: None keeps the exchange's own weighted mean
        self.aggregator = Aggregator(config.run.aggregator) if config.run.aggregator != "mean" else None
        self.round: OuterRound = OuterRound(theta, self.strategy, self.codec)
        # The contribution made chunk by chunk as the exchange sends it (no vector of the model's size for it):
        # where its inputs stay put until the commit (the synchronous loop: the ranks wait, or we read a copy) and
        # it goes to the exchange as it is (no island reducing it first). Sparse codecs too: each chunk's top
        # values are chosen within the chunk, so the payload is encoded piece by piece.
        self.round.on_demand = (
            config.run.outer_update == "sync"
            and (bool(self.codec.dense) or callable(getattr(self.codec, "encode_on_demand", None)))
            and not config.node.island
        )
        # Ranks that train in host memory peak while the agent waits for them: the mean is then allocated for
        # each round and freed with it (off that peak). GPU ranks' host memory peaks in the round itself, and the
        # buffer is kept across rounds there (no page faults in a round the GPUs wait for).
        self.round.mean_per_round = self.round.on_demand and not ranks_use_cuda(config)
        # The DHT node is forked after this: theta and the strategy's state stay out of it (util/memory.py), or
        # their first writes (the first commit, the first contribution) pay a copy-on-write fault per page.
        exclude_from_fork(theta, *self.strategy.live_buffers().values())
        if injector is not None:  # corrupt-theta@R: theta nudged inside the commits the plan names
            self.round = injector.wrap_outer(self.round, lambda: self.round_id)
        lr = self.strategy.hparams.get("lr")
        self._base_outer_lr = float(lr) if isinstance(lr, (int, float)) else None
        self.round_id = 0
        self.outer_hash = ""
        # An outer step was applied since the ranks last loaded: merge it into their weights (streaming-diloco).
        self.merge_pending = False
        # Held while the outer state is changed (a commit, an install) or copied (the served snapshot) on the
        # outer thread: none of them ever sees another half-way through.
        self.lock = asyncio.Lock()
        self._executor: ThreadPoolExecutor | None = None
        # The state donors serve, built when a joiner first asks for a round (None: not built for this state).
        self._snapshot: Snapshot | None = None

    @property
    def round_id(self) -> int:
        """The round this outer state works on (its theta is round_id - 1's result)."""
        return self._round_id

    @round_id.setter
    def round_id(self, value: int) -> None:
        # run.outer_lr_schedule: the strategy's rate for the outer step that commits this round, set whenever the
        # round moves (a commit, a round closed without a step, an installed state), so every member that
        # commits round r applies the same rate.
        self._round_id = value
        if self._base_outer_lr is not None and self.config.run.outer_lr_schedule != "constant":
            factor = outer_lr_factor(self.config.run, value)
            self.strategy.hparams["lr"] = self._base_outer_lr * factor

    @property
    def outer_lr(self) -> float | None:
        """The outer rate the next commit applies (None: the strategy has none, e.g. its lr is inside its
        options' own schedule)."""
        lr = self.strategy.hparams.get("lr")
        return float(lr) if isinstance(lr, (int, float)) else None

    @property
    def theta(self) -> torch.Tensor:
        """theta_outer (in the hand-off's theta region once the ranks load it as is: `OuterRound.share_with`)."""
        return self.round.theta

    # -- the outer thread -----------------------------------------------------------------------------------

    def thread(self) -> ThreadPoolExecutor:
        """The one thread the outer state's long passes run on, off the event loop (a commit, a delayed update's
        contribution, the served state's copies, an install, the round buffers' first write: `on_thread`), made
        on first use (no thread may start before the DHT forks), with the event loop thread's torch threads."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1,
                thread_name_prefix="farloco-outer",
                initializer=torch.set_num_threads,  # per thread, like the event loop's own (Agent.__init__)
                initargs=(torch.get_num_threads(),),
            )
        return self._executor

    async def on_thread(self, work: Callable[..., _T], *args: Any) -> tuple[_T, bool]:
        """`work(*args)` on the outer thread, the event loop free meanwhile; seen through even if we are cancelled
        while it runs (it writes the outer state or its buffers): its result, and whether we were (the caller
        re-raises CancelledError once its own state is consistent)."""
        done = asyncio.get_running_loop().run_in_executor(self.thread(), work, *args)
        cancelled = False
        while not done.done():
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                cancelled = True
        return done.result(), cancelled

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)  # a commit under way is seen through

    # -- changes --------------------------------------------------------------------------------------------

    def contribution(
        self, theta_local: torch.Tensor, reference: torch.Tensor | None = None
    ) -> torch.Tensor | OnDemand:
        """`OuterRound.contribution`, its error (non-finite weights from the ranks) ending the node, named."""
        try:
            return self.round.contribution(theta_local, reference)
        except OuterError as exc:
            raise AgentError(f"round {self.round_id}: {exc}") from None

    async def commit(
        self,
        contribution: torch.Tensor | OnDemand,
        transmitted: Transmitted,
        mean: torch.Tensor,
        withheld: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """`OuterRound.commit` (the outer step and theta's digest: seconds at 10B) on the outer thread, so the
        event loop goes on serving the swarm meanwhile; then round r+1. `withheld`: ranges of our contribution
        in no mean (AverageResult.withheld), kept whole by the error feedback."""
        async with self.lock:
            self.outer_hash, cancelled = await self.on_thread(
                self.round.commit, contribution, transmitted, mean, withheld
            )
            self.merge_pending = True
            self.round_id += 1
            self._snapshot = None
        if cancelled:
            raise asyncio.CancelledError

    def advance(self) -> None:
        """Close the round without an outer step: theta_outer stays as it is (so every peer that closes it this
        way still agrees)."""
        self.round_id += 1
        self._snapshot = None

    async def install(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Make `tensors` (a donor's, or a checkpoint's) our outer state at round `meta['round_id']`. The copies
        and the digest (seconds at 1B) run on the outer thread under `lock`, like a commit."""
        async with self.lock:
            outer_hash, cancelled = await self.on_thread(self.load_state, meta, tensors)
            self.round_id = int(meta["round_id"])
            self.outer_hash = outer_hash
            self._snapshot = None
        if cancelled:
            raise asyncio.CancelledError

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
        """Check a fetched or resumed state against our run and copy it into the outer state: theta's hash.
        Nothing is changed when a check fails. Runs on the outer thread (`install`)."""
        if meta.get("run_hash") != self.run_hash:
            theirs = meta.get("run_config", {})
            raise AgentError(
                "donor serves another run: " + "; ".join(diff_run(run_section(self.config), theirs) or ["?"])
            )
        theta = tensors.get("theta")
        if theta is None or theta.shape != self.theta.shape or theta.dtype != torch.float32:
            got = None if theta is None else f"{theta.dtype}{list(theta.shape)}"
            raise AgentError(f"donor state: expected theta float32[{self.num_params}], got {got}")
        try:
            self.strategy.load_state_dict(_strategy_part(tensors))  # checks everything before it writes
        except StrategyError as exc:
            raise AgentError(f"donor state: {exc}") from None
        self.theta.copy_(theta)
        return theta_hash(self.theta)

    # -- what donors serve ----------------------------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        """The committed state as donors serve it and checkpoints write it: copies, made on the first request
        for this state (a joiner's, or a checkpoint due) and kept until the state changes. A node no joiner
        asks and no checkpoint is due costs no copy per round. The copies (12 bytes per parameter with
        diloco: 12 GB at 1B) are made on the outer thread under `lock`: the event loop serves the swarm
        meanwhile, and no commit or install changes the state half-way through them."""
        async with self.lock:
            if self._snapshot is not None and self._snapshot[0]["round_id"] == self.round_id:
                return self._snapshot
            meta = {
                "round_id": self.round_id,
                "run_hash": self.run_hash,
                "outer_hash": self.outer_hash,
                "run_config": run_section(self.config),
            }
            tensors, cancelled = await self.on_thread(self.round.snapshot)
            snapshot = self._snapshot = (meta, tensors)
        if cancelled:
            raise asyncio.CancelledError
        return snapshot

    def state_layout(self) -> dict[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]]:
        """Name -> (dtypes, shape) of every tensor of the state we serve and install (`OuterRound.snapshot`;
        the dtypes a tensor may come in, ours first: `OuterStrategy.state_layout`)."""
        layout: dict[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]] = {
            "theta": ((torch.float32,), (self.num_params,))
        }
        layout.update({f"strategy.{k}": v for k, v in self.strategy.state_layout().items()})
        return layout

    def state_problem(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str | None:
        """What keeps a fetched state from being installed (`load_state` would refuse it), or None: a donor's
        strategy state of the wrong layout, with NaN/Inf or a negative round count. Reads every value: called
        in a worker thread (statesync.fetch_state's `check`)."""
        try:
            self.strategy.check_state_dict(_strategy_part(tensors))
        except StrategyError as exc:
            return str(exc)
        return None


def _strategy_part(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The strategy's state in a served or saved state (its `strategy.` tensors, without the prefix)."""
    return {k.removeprefix("strategy."): v for k, v in tensors.items() if k.startswith("strategy.")}
