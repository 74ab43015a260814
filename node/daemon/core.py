"""The agent's state and its thread-safe views: what every room of the daemon shares.

`AgentCore.__init__` builds the node's outer state (theta_outer, strategy, codec: node/daemon/outer.py), the event
log, counters and metrics; the network parts (DHT, gRPC server and clients, membership, matchmaker, control
server) are attached by `Agent._serve` and the hand-off by `RanksAgent._start_trainers`. The status, peers and
metrics views are read from the control server's thread under `_lock`.

The agent is one object built in layers, one module each, every layer using only what is below it:
core (state, views) <- ranks (the trainer ranks and the hand-off) <- snapshots (served state, checkpoints,
resume) <- swarm (membership, joining, isolation, catching up, fork healing) <- rounds (the round loop and one
round, whose decisions are node/daemon/rules.py) <- agent (the lifecycle: start, serve, leave, shut down).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from farloco.node.config import Config, ConfigError, run_hash, run_secret, to_toml
from farloco.node.daemon.knownpeers import KnownPeers
from farloco.node.daemon.loggers import ExperimentLoggers
from farloco.node.daemon.metrics import NodeMetrics
from farloco.node.daemon.outer import OuterRound
from farloco.node.handoff import COMMAND_STOP, Handoff, flatten, layout_of
from farloco.node.logs import LauncherFailures, SyncProgress
from farloco.node.training.model import num_parameters
from farloco.node.training.models import build_spec
from farloco.node.training.parallel import check_node_layout
from farloco.optim import ranges
from farloco.protocol import parallel
from farloco.protocol.isolation import IsolationWatch
from farloco.protocol.shares import RoundShares

if TYPE_CHECKING:
    from farloco.node.faults.injector import FaultInjector

log = logging.getLogger("farloco.agent")

_T = TypeVar("_T")


class Status(enum.Enum):
    """Lifecycle of a node."""

    STARTING = "starting"
    SYNCING = "syncing"
    TRAINING = "training"
    EXCHANGING = "exchanging"
    ISOLATED = "isolated"  # had peers, they vanished: waits for the swarm (protocol/isolation.py)
    LEAVING = "leaving"
    STOPPED = "stopped"
    FAILED = "failed"


DAEMON_STRATEGIES = ("diloco", "streaming-diloco", "demo", "sparseloco")
# tau of streaming-diloco when strategy_options gives none: one inner step hides the exchange of a fragment.
DEFAULT_OVERLAP_STEPS = 1
# Seconds a rank finishing its inner step gets at the end of a leave before it is SIGKILLed (it was told STOP
# when the leave was asked for, so this is a floor, not its whole share).
RANK_STOP_FLOOR = 2.0


class AgentError(RuntimeError):
    """The node cannot go on; the message says why."""


def overlap_steps(config: Config) -> int:
    """tau: inner steps the ranks keep training while a round's fragment is exchanged (streaming-diloco's
    `strategy_options.tau`; 0 for the other strategies, whose ranks wait for the new theta_outer)."""
    run = config.run
    if run.strategy != "streaming-diloco":
        return 0
    tau = run.strategy_options.get("tau", DEFAULT_OVERLAP_STEPS)
    if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau < run.inner_steps:
        raise ConfigError(
            f"run.strategy_options.tau: expected an integer with 0 <= tau < run.inner_steps="
            f"{run.inner_steps} (the fragment lands after tau of the next round's inner steps), got {tau!r}"
        )
    return tau


def build_outer(config: Config, num_params: int) -> tuple[Any, Any]:
    """The run's codec and outer strategy; ConfigError naming the key for a name or option optim refuses."""
    from farloco.optim import CodecError, StrategyError, get_codec, make_strategy

    run = config.run
    if run.strategy not in DAEMON_STRATEGIES:
        raise ConfigError(f"run.strategy: expected one of {list(DAEMON_STRATEGIES)}, got {run.strategy!r}")
    if run.strategy == "demo" and run.inner_steps != 1:
        # DeMo's gradient is theta_outer - theta_local after one plain SGD step of lr 1 (optim DeMo).
        raise ConfigError(
            f"run.inner_steps: run.strategy='demo' takes exactly 1 inner step per round (its gradient is "
            f"theta_outer - theta_local after one SGD step of lr 1), got run.inner_steps={run.inner_steps}"
        )
    try:
        codec = get_codec(run.codec, **run.codec_options)
    except (CodecError, TypeError) as exc:
        raise ConfigError(f"run.codec / run.codec_options: {exc}") from exc
    hparams: dict[str, Any] = dict(run.strategy_options)
    if run.strategy in ("diloco", "streaming-diloco"):
        hparams.setdefault("lr", run.outer_lr)
        hparams.setdefault("momentum", run.outer_momentum)
    if run.strategy == "streaming-diloco":
        overlap_steps(config)  # validated here; tau shapes the round loop, not the outer math
        hparams.pop("tau", None)
    try:
        strategy = make_strategy(run.strategy, num_params, codec, **hparams)
    except (StrategyError, TypeError) as exc:
        raise ConfigError(f"run.strategy / run.strategy_options: {exc}") from exc
    if run.aggregator in ("norm_clip", "centered_clip") and not strategy.codec.dense:
        # Sparse payloads are aggregated by every member itself: a norm's reduction order (so its last bits) may
        # differ between machines, and the members' results with it. Dense chunks have one owner each.
        raise ConfigError(
            f"run.aggregator: {run.aggregator!r} needs a dense codec (every member would compute norms over "
            f"{strategy.codec.name!r}'s sparse payloads itself); use 'trimmed_mean' or 'median' with "
            f"run.strategy={run.strategy!r}"
        )
    return codec, strategy


def ddp_bytes_per_round(num_params: int, inner_steps: int, num_peers: int) -> int:
    """Bytes one worker of plain DDP would send for the same steps: a ring all-reduce of fp32 grads per step."""
    if num_peers < 2:
        return 0
    return int(inner_steps * 2 * (num_peers - 1) / num_peers * 4 * num_params)


class EventLog:
    """Append-only JSON-lines log of what the node did (rounds, joins, errors): the source of `farloco report`."""

    def __init__(self, path: Path, loggers: ExperimentLoggers | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the agent
        self._lock = threading.Lock()
        self.loggers = loggers  # node.loggers: TensorBoard / wandb get the round events too

    def write(self, event: str, **fields: Any) -> None:
        record = {"time": time.time(), "event": event, **fields}
        with self._lock:
            self._file.write(json.dumps(record, default=str) + "\n")
        if self.loggers is not None:
            self.loggers.event(event, fields)

    def close(self) -> None:
        self._file.close()
        if self.loggers is not None:
            self.loggers.close()


@dataclass
class Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    ddp_bytes: int = 0
    raw_bytes: int = 0
    rounds_committed: int = 0
    rounds_aborted: int = 0
    rounds_late: int = 0
    partial_contributions: int = 0  # sequences cut short because the round's other members waited for us
    hash_mismatches: int = 0
    resyncs: int = 0
    last_round_seconds: float = math.nan
    # Wall time the ranks sat idle waiting for the agent between two sequences (all of it: the round, in sync
    # mode; the round in flight's rest and the hand-off, with run.outer_update = delayed or eager).
    ranks_idle_seconds: float = 0.0
    last_contributors: int = 0


@dataclass
class Prepared:
    """A round's input taken from the ranks: their weights and the contribution made from them."""

    theta_local: torch.Tensor
    contribution: torch.Tensor
    fixed_reference: bool
    """The contribution is measured from where the ranks started (not theta_outer): a state sync mid-round
    leaves it as it is."""
    inner_step: int = 0
    """The ranks' inner step count at the end of the sequence this round carries (the round event reports it)."""
    weight: float = 1.0
    """The contribution's weight in the round's mean: its share of the round's inner steps (below 1 for a
    partial contribution, node.partial_contributions)."""
    trained_from: str = ""
    """run.outer_update delayed/eager: the outer_hash of the theta_outer the ranks' sequence started from (with
    eager, the one their preview was built on); the round event reports it."""
    seconds: float = 0.0
    """How long reading the ranks' weights and making the contribution took (the round event's phase
    `prepare`)."""


class AgentCore:
    """The node's state and its thread-safe views (the base of `Agent`, see the module docstring)."""

    # Attached by Agent._serve (the network parts) and RanksAgent._start_trainers (the hand-off).
    dht: Any
    server: Any
    client: Any
    exchange: Any
    island: Any = None  # node/daemon/island.py Island when node.island names one
    _island_round: Any = None  # the IslandRound of the round in progress, None when we exchange alone
    state_server: Any
    membership: Any
    matchmaker: Any
    control: Any
    handoff: Handoff
    _publish_lock: asyncio.Lock

    def __init__(self, config: Config, run_dir: Path) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(config))
        loggers = (
            ExperimentLoggers(config, self.run_dir, name=self.run_dir.name) if config.node.loggers else None
        )
        self.events = EventLog(self.run_dir / "logs" / "agent.jsonl", loggers)
        self.run_hash = run_hash(config)
        # Resolved before anything listens: a node reachable beyond loopback without a secret refuses to start.
        self.run_secret = run_secret(config, self.run_hash)
        self.status = Status.STARTING
        self.counters = Counters()
        self.metrics = NodeMetrics(self.metric_values)
        self.round_id = 0
        self.outer_hash = ""
        self.eval_loss = math.nan
        self.train_loss = math.nan
        self.inner_step_seconds = 0.0  # the last sequence's mean inner step time (the slowest rank's)
        self.leave_mode: str | None = None
        self._leave_requested_at: float | None = None  # monotonic time of the first non-drain leave request
        self._seq_inner_step = 0  # the ranks' inner steps at the end of the last sequence read
        # Published sequence -> (step_base, inner_steps asked); the share of the round's steps a sequence the
        # agent cut short carries (`_seq_weight`, 1 when it ran in full) is read from the ranks' reports.
        self._seq_plans: dict[int, tuple[int, int]] = {}
        self._seq_weight = 1.0
        self._idle_since: float | None = (
            None  # when the ranks last finished a sequence we have not followed up
        )
        self.error: str | None = None
        self.peer_id = ""
        self.multiaddrs: list[str] = []
        self.grpc_address = ""
        self.slot = -1
        self.peers_view: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._leave_event: asyncio.Event | None = None
        self._trainer_thread: threading.Thread | None = None
        self._trainer_error: BaseException | None = None
        self._trainers_exited = threading.Event()
        self.started_at = time.time()
        # The agent's share of the cores (node.agent_threads: by default what the ranks leave). The round's large
        # passes (theta's digest, int8's kernels, the contribution, the outer step) are cut into contiguous
        # ranges over that many threads (protocol/parallel.py); on CPU its torch ops take no more, since the
        # trainer ranks own the other cores (oversubscribed torch threads were measured 20-100x slower here).
        threads = agent_threads(config)
        if config.node.device != "cuda":
            torch.set_num_threads(threads)
        parallel.set_threads(threads)
        ranges.set_range_runner(parallel.map_ranges)

        check_node_layout(
            config
        )  # tp against the model's heads and widths: a config error, before anything starts
        model = build_spec(config.run.model, seed=config.run.seed).module
        self.layout = layout_of(model)
        self.num_params = num_parameters(model)
        self.theta = flatten(model, self.layout)
        if self.theta.numel() != self.num_params:
            raise AgentError(f"flat layout has {self.theta.numel()} values, the model {self.num_params}")
        del model
        # Built before anything listens, so a bad strategy or codec is a config error, not a half-started node.
        self.codec, self.strategy = build_outer(config, self.num_params)
        from farloco.optim import Aggregator

        # run.aggregator: None keeps the exchange's own weighted mean
        self.aggregator = Aggregator(config.run.aggregator) if config.run.aggregator != "mean" else None
        # Faults on purpose (node/faults): an injector only when FARLOCO_FAULTS asks for one; a plan it cannot
        # read stops the node before it starts.
        from farloco.node.faults.plan import parse_faults
        from farloco.optim import ATTACKS

        try:
            plan = parse_faults(os.environ.get("FARLOCO_FAULTS", ""), ATTACKS)
        except ValueError as exc:
            raise AgentError(str(exc)) from None
        self.injector: FaultInjector | None = None
        if plan:
            from farloco.node.faults.injector import FaultInjector

            self.injector = FaultInjector(plan, self.events)
        self.outer: OuterRound = OuterRound(self.theta, self.strategy, self.codec)
        if self.injector is not None:
            self.outer = self.injector.wrap_outer(self.outer, lambda: self.round_id)
        # Called as each phase of a round begins (`_enter_phase`), and for the callback a checkpoint's writer
        # calls once the checkpoint is durable under its temporary name: the fault injector's, or none.
        self._phase_hook = self.injector.phase if self.injector is not None else None
        self._on_durable = self.injector.durable if self.injector is not None else None
        # The state donors serve, built when a joiner first asks for a round (None: not built for this state).
        self._snapshot: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        # Held while the outer state is changed (a commit, an install) or copied (the served snapshot) on the
        # outer thread: none of them ever sees another half-way through.
        self._outer_lock = asyncio.Lock()
        self._outer_executor: ThreadPoolExecutor | None = None
        self._overlap_steps = overlap_steps(config)
        self._overlap_seq: int | None = None  # the hand-off sequence the ranks train during an exchange
        self._phases: dict[str, float] = {}  # the current round's phase times (rounds.py `_round`)
        self._merge_pending = False  # an outer step was applied: merge it into the ranks' weights
        self._checkpoint_task: asyncio.Task[None] | None = None
        self.last_checkpoint: str | None = None
        self.launcher_failures = LauncherFailures(
            config.node.max_restarts, on_failure=self._on_trainer_failure
        )
        self.sync_progress: SyncProgress | None = None  # while a state sync runs
        self.refused_states: dict[str, int] = {}  # donors' states refused by reason (statesync.fetch_state)
        self._inner_resume: Path | None = None  # verified inner/ of the checkpoint resumed from
        self._inner_load_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        # While a joining node writes its round buffers' pages once (swarm.py `_join`).
        self._prefault_task: asyncio.Task[tuple[None, bool]] | None = None
        # A member-record store after a round, while in flight.
        self._record_task: asyncio.Task[None] | None = None
        self.isolation = IsolationWatch()
        self.shares = RoundShares()
        self._peer_maddrs: dict[str, tuple[str, ...]] = {}  # last multiaddrs of the peers seen live
        self.known_peers = KnownPeers(self.run_dir, self.run_hash)  # for a restart without the bootstrap

    def _outer_thread(self) -> ThreadPoolExecutor:
        """The one thread the outer state's long passes run on, off the event loop (a commit, a delayed
        update's contribution, the served state's copies, an install, the round buffers' first write:
        `_on_outer_thread`), made on first use (no thread may start before the DHT forks), with the event loop
        thread's torch thread count."""
        if self._outer_executor is None:
            self._outer_executor = ThreadPoolExecutor(
                1,
                thread_name_prefix="farloco-outer",
                initializer=_outer_thread_init,
                initargs=(torch.get_num_threads(),),
            )
        return self._outer_executor

    async def _on_outer_thread(self, work: Callable[..., _T], *args: Any) -> tuple[_T, bool]:
        """`work(*args)` on the agent's outer thread (`_outer_thread`), the event loop free meanwhile; seen
        through even if we are cancelled while it runs (it writes the outer state or its buffers): its result,
        and whether we were (the caller re-raises CancelledError once its own state is consistent)."""
        done = asyncio.get_running_loop().run_in_executor(self._outer_thread(), work, *args)
        cancelled = False
        while not done.done():
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                cancelled = True
        return done.result(), cancelled

    async def _enter_phase(self, phase: str, round_id: int | None = None) -> None:
        """A phase of round `round_id` (default: the current one) begins (node/faults/plan.py PHASES)."""
        if self._phase_hook is not None:
            await self._phase_hook(phase, self.round_id if round_id is None else round_id)

    def status_dict(self) -> dict[str, Any]:
        with self._lock:
            reports = []
            if getattr(self, "handoff", None) is not None:
                reports = [self.handoff.report(r) for r in range(self.handoff.world_size)]
            inner_step = max((r.inner_step for r in reports), default=0)
            step_seconds = max((r.step_seconds for r in reports), default=0.0)
            raw = self.counters.raw_bytes
            return {
                "peer_id": self.peer_id,
                "state": self.status.value,
                "round_id": self.round_id,
                "inner_step": inner_step,
                "loss": self.train_loss,
                "eval_loss": self.eval_loss,
                "num_peers": len(self.peers_view),
                "outer_hash": self.outer_hash,
                "bytes_sent": self.counters.bytes_sent,
                "bytes_received": self.counters.bytes_received,
                "ddp_bytes": self.counters.ddp_bytes,
                "compression_ratio": (raw / self.counters.bytes_sent) if self.counters.bytes_sent else None,
                "multiaddrs": self.multiaddrs,
                "grpc_address": self.grpc_address,
                "slot": self.slot,
                "run_name": self.config.run.name,
                "run_hash": self.run_hash,
                "strategy": self.config.run.strategy,
                "codec": self.config.run.codec,
                "num_params": self.num_params,
                "num_ranks": self.config.node.num_ranks,
                "rounds_committed": self.counters.rounds_committed,
                "partial_contributions": self.counters.partial_contributions,
                # Of the last 100 rounds this node closed, the fraction it contributed to.
                "group_share": self.shares.share(self.peer_id) if self.peer_id else None,
                "left_out": dict(self.shares.left_out),
                "peers_left_out": dict(self.shares.peers_left_out),
                "rounds_aborted": self.counters.rounds_aborted,
                "rounds_late": self.counters.rounds_late,
                "hash_mismatches": self.counters.hash_mismatches,
                "trainer_pids": [r.pid for r in reports],
                "trainer_restarts": self.launcher_failures.restarts,
                "trainer_last_exit": self.launcher_failures.last_exit,
                "inner_step_seconds": step_seconds if step_seconds > 0 else None,
                # The ranks step in lockstep (FSDP collectives): the node's batch per slowest rank's step time.
                "tokens_per_second": (
                    self.config.run.batch_size * self.config.run.seq_len / step_seconds
                    if step_seconds > 0
                    else None
                ),
                "isolated": self.isolation.verdict == "isolated",
                "isolated_seconds": self.isolation.isolated_for(_dht_now()),
                "vanished_peers": list(self.isolation.vanished),
                "sync": self.sync_progress.snapshot() if self.sync_progress is not None else None,
                "leave_mode": self.leave_mode,
                "last_round_seconds": self.counters.last_round_seconds,
                # The straggler wait we proposed last round (adaptive, protocol/matchmaking.py StragglerWait).
                "match_wait_seconds": getattr(getattr(self, "matchmaker", None), "last_wait", None) or None,
                "island": self.island.view() if self.island is not None else None,
                "error": self.error,
                "last_checkpoint": self.last_checkpoint,
                "metrics_url": (self.control.url + "/metrics") if getattr(self, "control", None) else None,
                "pid": os.getpid(),
                "uptime_seconds": time.time() - self.started_at,
            }

    def peers_list(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.peers_view)

    def request_leave(self, mode: str) -> None:
        """Thread-safe: ask the node to leave ('graceful', 'drain' or 'now')."""
        if self.leave_mode is None or mode == "now":
            self.leave_mode = mode
        if mode != "drain" and self._leave_requested_at is None:
            # A drain finishes its round first; every other leave is bounded by timeouts.leave_timeout from here.
            self._leave_requested_at = time.monotonic()
        if mode != "drain" and getattr(self, "handoff", None) is not None:
            # A leaving node uses no more inner steps (the round in flight, if it ends in time, needs only what
            # the ranks already handed off), so they stop now, after the step they are in: they get the whole
            # leave to exit, not what the round's wind-down leaves of it. One write to the shared header.
            self.handoff.stop()
        if self._loop is not None and self._leave_event is not None:
            self._loop.call_soon_threadsafe(self._leave_event.set)

    def _on_signal(self) -> None:
        """SIGTERM / Ctrl+C: leave gracefully (after a drain: leave now-ish, gracefully); a second one while
        already leaving gracefully: leave at once."""
        self.request_leave("now" if self.leave_mode in ("graceful", "now") else "graceful")

    def _on_trainer_failure(self, reason: str) -> None:
        """Called from the launcher's thread for each failed rank group."""
        if getattr(self, "handoff", None) is not None and self.handoff.command == COMMAND_STOP:
            # We told the ranks to stop (a leave): one that did not in time was ended by us, and the ranks the
            # launcher starts again see STOP and exit at once. Part of the leave, not a failure.
            log.info("trainer %s while the node stops its ranks", reason)
            self.events.write("trainer_stopped", reason=reason)
            return
        restarting = self.launcher_failures.failures <= self.launcher_failures.max_restarts
        log.warning(
            "trainer %s; %s", reason, "the launcher restarts the ranks" if restarting else "no restarts left"
        )
        self.events.write(
            "trainer_failed", reason=reason, restarts=self.launcher_failures.restarts, restarting=restarting
        )

    def metric_values(self) -> dict[str, Any]:
        """What `/metrics` shows at scrape time (node/daemon/metrics.py): the status, plus the counters kept by the
        transport (refused RPCs by reason), the membership (DHT records not believed) and the isolation watch."""
        values = self.status_dict()
        sync = values.get("sync")
        if sync is not None:
            values["sync_bytes_done"], values["sync_bytes_total"] = sync["bytes_done"], sync["bytes_total"]
        values["isolated"] = int(bool(values.get("isolated")))
        values["isolations"] = self.isolation.episodes
        values["ranks_idle_seconds"] = self.counters.ranks_idle_seconds
        values["trainer_last_exit_code"] = self.launcher_failures.last_exit_code
        server = getattr(self, "server", None)
        values["rejected"] = dict(server.rejections) if server is not None else {}
        for reason, count in getattr(self, "refused_states", {}).items():  # states refused from donors
            values["rejected"][reason] = values["rejected"].get(reason, 0) + count
        membership = getattr(self, "membership", None)
        values["ignored"] = dict(membership.core.ignored) if membership is not None else {}
        return values

    def metrics_text(self) -> str:
        return self.metrics.text()

    def _live_ids(self) -> list[str]:
        return [m.peer_id for m in self.membership.core.live(_dht_now())]

    def _member_gone(self, peer_id: str) -> bool:
        """Whether `peer_id` has no live member record in our view (no heartbeat for timeouts.member_ttl, or a
        departure): what lets an exchange give up a member frozen mid-exchange before its data deadline
        (protocol/exchange.py GONE_SILENCE_SECONDS, only with a strict majority of the group left, and only
        once it answers no ping). The member given up, thawed, holds the theta of before the round; the next
        round's hash check, decided on the group record's hashes, makes it take the others' state."""
        membership = getattr(self, "membership", None)
        return membership is not None and peer_id not in self._live_ids()

    def _left_out(self, reason: str) -> None:
        """We are not among this round's contributors: say why (event, metric, our share)."""
        self.shares.left_out[reason] += 1
        self.shares.record([*self._live_ids(), self.peer_id], ())
        self.events.write("left_out", round_id=self.round_id, peer=self.peer_id, reason=reason, by="self")

    def _count_bytes(self, sent: int, received: int, fp32_bytes: int) -> None:
        self.counters.bytes_sent += sent
        self.counters.bytes_received += received
        self.counters.raw_bytes += fp32_bytes


def _outer_thread_init(torch_threads: int) -> None:
    torch.set_num_threads(torch_threads)  # per thread, like the event loop's own (see AgentCore.__init__)


def agent_threads(config: Config) -> int:
    """node.agent_threads, or (0) the cores the trainer ranks leave the agent: on cpu the process's cores less
    num_ranks x threads_per_rank, on cuda less one per rank (each drives its GPU); at least 1."""
    if config.node.agent_threads:
        return config.node.agent_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    node = config.node
    taken = node.num_ranks if node.device == "cuda" else node.num_ranks * node.threads_per_rank
    return max(1, cores - taken)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("farloco")
    except PackageNotFoundError:
        return "0+unknown"


def _dht_now() -> float:
    from hivemind.utils import get_dht_time

    return float(get_dht_time())
