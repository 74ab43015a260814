"""What the agent's collaborators share: the node's facts (`NodeState`), its lifecycle (`Status`), counters, the
event log, and the run's outer strategy built from the config.

The agent (node/daemon/agent.py) is one object that owns its collaborators, each given what it needs when it is
made:

    core.py        NodeState     who the node is, where it stands, what it counted, whether it must leave
    outerstate.py  OuterState    theta_outer at round r, its hash, the outer thread and lock, the served state
    ranks.py       Ranks         the trainer ranks under torch's elastic launcher and the hand-off
    checkpoints.py Checkpoints   checkpoints with the ranks' inner state, and resuming from them
    swarm.py       Swarm         member record, heartbeat, joining, isolation, catching up, fork healing
    rounds.py      RoundRunner   the round loops and one round (its decisions: rules.py)
    agent.py       Agent         the lifecycle (start, serve, leave, shut down) and the status views

The network parts (DHT, gRPC server and client, exchange, membership, matchmaker: `agent.Network`) exist only
once the DHT process forked, so the swarm and the round runner are made then, with them.
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from farloco.node.config import Config, ConfigError, run_hash, run_secret, to_toml
from farloco.node.daemon.loggers import ExperimentLoggers
from farloco.node.daemon.metrics import NodeMetrics
from farloco.node.logs import SyncProgress
from farloco.protocol.exchange import OnDemand
from farloco.protocol.isolation import IsolationWatch
from farloco.protocol.shares import RoundShares

if TYPE_CHECKING:
    from hivemind import DHT

    from farloco.node.daemon.island import Island
    from farloco.node.faults.injector import FaultInjector
    from farloco.protocol.exchange import Exchange
    from farloco.protocol.matchmaking import DHTMatchmaker
    from farloco.protocol.membership import DHTMembership
    from farloco.protocol.rpc import RpcClient, RpcServer

log = logging.getLogger("farloco.agent")


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
    contribution: torch.Tensor | OnDemand  # OnDemand: made chunk by chunk (OuterRound.on_demand)
    fixed_reference: bool
    """The contribution is measured from where the ranks started (not theta_outer): a state sync mid-round
    leaves it as it is."""
    inner_step: int = 0
    """The ranks' inner step count at the end of the sequence this round carries (the round event reports it)."""
    weight: float = 1.0
    """The contribution's weight in the round's mean: its share of the round's inner steps (below 1 for a
    partial contribution, node.partial_contributions)."""
    merged_weight: float = 0.0
    """Of `weight`, the share carried by the work of the round we were late for, merged in (run.late_work)."""
    trained_from: str = ""
    """run.outer_update delayed/eager: the outer_hash of the theta_outer the ranks' sequence started from (with
    eager, the one their preview was built on); the round event reports it."""
    seconds: float = 0.0
    """How long reading the ranks' weights and making the contribution took (the round event's phase
    `prepare`)."""


@dataclass(frozen=True)
class Network:
    """The node's network parts, made together once the DHT process forked (`Agent._serve`): what the swarm and
    the round runner talk through. `dht` is hivemind's DHT (or the fault injector's wrapper of it), `exchange`
    the exchange (or its wrapper), `island` the node's island when node.island names one."""

    dht: DHT
    server: RpcServer
    client: RpcClient
    exchange: Exchange
    membership: DHTMembership
    matchmaker: DHTMatchmaker
    island: Island | None


class NodeState:
    """The facts about this node that its collaborators share (see the module docstring): who it is, where it
    stands, what it counted, and whether it was asked to leave. Changed on the event loop; the control server's
    thread reads it under `lock`."""

    def __init__(self, config: Config, run_dir: Path, metric_values: Callable[[], dict[str, Any]]) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(config))
        loggers = ExperimentLoggers(config, self.run_dir) if config.node.loggers else None
        self.events = EventLog(self.run_dir / "logs" / "agent.jsonl", loggers)
        self.run_hash = run_hash(config)
        # Resolved before anything listens: a node reachable beyond loopback without a secret refuses to start.
        self.run_secret = run_secret(config, self.run_hash)
        self.status = Status.STARTING
        self.error: str | None = None
        self.counters = Counters()
        self.metrics = NodeMetrics(metric_values)
        self.started_at = time.time()
        # Who we are on the network (known once the DHT node and the gRPC server started) and our data slot.
        self.peer_id = ""
        self.multiaddrs: list[str] = []
        self.grpc_address = ""
        self.slot = -1
        # What the ranks' last sequence reported (Ranks.read_reports).
        self.train_loss = math.nan
        self.eval_loss = math.nan
        self.inner_lr = math.nan  # the inner learning rate of the last sequence's last step (run.lr_schedule)
        self.inner_step_seconds = 0.0  # the last sequence's mean inner step time (the slowest rank's)
        # The swarm as we see it: the members' table (for `farloco peers`), who contributed to each round, whether
        # our peers vanished, the donors' states we refused by reason, the state sync under way.
        self.peers_view: list[dict[str, Any]] = []
        self.shares = RoundShares()
        self.isolation = IsolationWatch()
        self.refused_states: dict[str, int] = {}
        self.sync_progress: SyncProgress | None = None
        self.lock = threading.Lock()
        # Leaving: the mode asked for, when (monotonic, the first non-drain request), and the event that wakes the
        # node's waits; `loop` and `leave_event` exist once the node runs (Agent.run).
        self.leave_mode: str | None = None
        self.leave_requested_at: float | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.leave_event: asyncio.Event | None = None
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

    def request_leave(self, mode: str, on_request: Callable[[], None] | None = None) -> None:
        """Thread-safe: ask the node to leave ('graceful', 'drain' or 'now'); `on_request` runs for a leave that
        is not a drain (the agent stops the ranks there)."""
        if self.leave_mode is None or mode == "now":
            self.leave_mode = mode
        if mode != "drain" and self.leave_requested_at is None:
            # A drain finishes its round first; every other leave is bounded by timeouts.leave_timeout from here.
            self.leave_requested_at = time.monotonic()
        if mode != "drain" and on_request is not None:
            on_request()
        self.wake()

    def wake(self) -> None:
        """Thread-safe: wake whatever waits on `leave_event` (a leave, the ranks' exit)."""
        if self.loop is not None and self.leave_event is not None:
            self.loop.call_soon_threadsafe(self.leave_event.set)

    def left_out(self, reason: str, live_ids: list[str], round_id: int) -> None:
        """We are not among round `round_id`'s contributors: say why (event, metric, our share)."""
        self.shares.left_out[reason] += 1
        self.shares.record([*live_ids, self.peer_id], ())
        self.events.write("left_out", round_id=round_id, peer=self.peer_id, reason=reason, by="self")

    def count_bytes(self, sent: int, received: int, fp32_bytes: int) -> None:
        self.counters.bytes_sent += sent
        self.counters.bytes_received += received
        self.counters.raw_bytes += fp32_bytes


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


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("farloco")
    except PackageNotFoundError:
        return "0+unknown"


def dht_now() -> float:
    from hivemind.utils import get_dht_time

    return float(get_dht_time())
