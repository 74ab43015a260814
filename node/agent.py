"""The agent: the long-running daemon that `farloco join` starts, one per node.

It owns everything network-facing and the outer state:
- the hivemind DHT node (created first: it forks, and grpcio does not survive a fork taken after its threads
  started), the member record and its heartbeats;
- the gRPC server and clients (exchange, state transfer), on an asyncio loop in the main thread;
- the outer state (node/outer.py): the CPU master copy of theta_outer (kept in the hand-off's theta region where
  the ranks load it as is), the outer strategy (optimizer + error-feedback state), the
  round id;
- the trainer ranks, launched and supervised in a thread through torch's elastic launcher, fed through the
  shared-memory hand-off;
- the local control endpoint and the JSON-lines event log.

It never initialises CUDA. The round loop (`_round`) is the heart; see ARCHITECTURE.md for one round step by step.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import hashlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from farloco.node.config import Config, ConfigError, diff_run, run_hash, run_section, to_toml
from farloco.node.control import ControlServer
from farloco.node.dhtnode import DHTStartError, daemon_alive, make_dht, stop_dht
from farloco.node.handoff import COMMAND_STOP, Handoff, flatten, layout_of
from farloco.node.logs import LauncherFailures, SyncProgress, console_format
from farloco.node.metrics import NodeMetrics
from farloco.node.model import build_model, model_config, num_parameters
from farloco.node.outer import OuterError, OuterRound, theta_hash
from farloco.protocol import shares
from farloco.protocol.faults import FlakyDHT, parse_dht_faults
from farloco.protocol.isolation import IsolationWatch
from farloco.protocol.shares import RoundShares, left_out_reason
from farloco.protocol.tasks import cancel_and_wait, wait_for
from farloco.protocol.tasks import run as run_bounded
from farloco.protocol.tcpstream import tune_malloc

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
    return codec, strategy


def ddp_bytes_per_round(num_params: int, inner_steps: int, num_peers: int) -> int:
    """Bytes one worker of plain DDP would send for the same steps: a ring all-reduce of fp32 grads per step."""
    if num_peers < 2:
        return 0
    return int(inner_steps * 2 * (num_peers - 1) / num_peers * 4 * num_params)


class EventLog:
    """Append-only JSON-lines log of what the node did (rounds, joins, errors): the source of `farloco report`."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the agent
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        record = {"time": time.time(), "event": event, **fields}
        with self._lock:
            self._file.write(json.dumps(record, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


@dataclass
class Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    ddp_bytes: int = 0
    raw_bytes: int = 0
    rounds_committed: int = 0
    rounds_aborted: int = 0
    rounds_late: int = 0
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
    trained_from: str = ""
    """run.outer_update delayed/eager: the outer_hash of the theta_outer the ranks' sequence started from (with
    eager, the one their preview was built on); the round event reports it."""


class Agent:
    """One node of the swarm. `run()` blocks until the node has left; its return value is the exit code."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(config))
        self.events = EventLog(self.run_dir / "logs" / "agent.jsonl")
        self.run_hash = run_hash(config)
        self.status = Status.STARTING
        self.counters = Counters()
        self.metrics = NodeMetrics(self.metric_values)
        self.round_id = 0
        self.outer_hash = ""
        self.eval_loss = math.nan
        self.train_loss = math.nan
        self.leave_mode: str | None = None
        self._leave_requested_at: float | None = None  # monotonic time of the first non-drain leave request
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
        if config.node.device != "cuda":
            # The trainer ranks own the cores; the agent's tensor work (outer step, codecs) must not fight
            # them: oversubscribed torch threads were measured 20-100x slower here.
            spare = (os.cpu_count() or 1) - config.node.num_ranks * config.node.threads_per_rank
            torch.set_num_threads(max(1, spare))

        model = build_model(model_config(config.run.model), seed=config.run.seed)
        self.layout = layout_of(model)
        self.num_params = num_parameters(model)
        self.theta = flatten(model, self.layout)
        if self.theta.numel() != self.num_params:
            raise AgentError(f"flat layout has {self.theta.numel()} values, the model {self.num_params}")
        del model
        # Built before anything listens, so a bad strategy or codec is a config error, not a half-started node.
        self.codec, self.strategy = build_outer(config, self.num_params)
        self.outer = OuterRound(self.theta, self.strategy, self.codec)
        # The state donors serve, built when a joiner first asks for a round (None: not built for this state).
        self._snapshot: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        self._overlap_steps = overlap_steps(config)
        self._overlap_seq: int | None = None  # the hand-off sequence the ranks train during an exchange
        self._merge_pending = False  # an outer step was applied: merge it into the ranks' weights
        self._checkpoint_task: asyncio.Task[None] | None = None
        self.last_checkpoint: str | None = None
        self.launcher_failures = LauncherFailures(
            config.node.max_restarts, on_failure=self._on_trainer_failure
        )
        self.sync_progress: SyncProgress | None = None  # while a state sync runs
        self._inner_resume: Path | None = None  # verified inner/ of the checkpoint resumed from
        self._inner_load_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        # A member-record store after a round, while in flight.
        self._record_task: asyncio.Task[None] | None = None
        self.isolation = IsolationWatch()
        self.shares = RoundShares()
        self._peer_maddrs: dict[str, tuple[str, ...]] = {}  # last multiaddrs of the peers seen live

    # ---- public, thread-safe views ----------------------------------------------------------------------------
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
        """What `/metrics` shows at scrape time (node/metrics.py): the status, plus the counters kept by the
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
        membership = getattr(self, "membership", None)
        values["ignored"] = dict(membership.core.ignored) if membership is not None else {}
        return values

    def metrics_text(self) -> str:
        return self.metrics.text()

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Blocking entry point (main thread)."""
        tune_malloc()  # message-sized buffers stay in the heap: no page faults per received chunk
        # The hundreds of thousands of objects torch and hivemind create at import never die; leave them out of
        # every later collection (full collections walking them cost ~5% of a 64 MiB exchange's CPU).
        gc.freeze()
        try:
            # asyncio.run would wait without bound for a task that ignores cancellation; leaving is bounded.
            run_bounded(self._main(), cleanup_timeout=3.0)
        except (AgentError, DHTStartError) as exc:
            self.error = str(exc)
            self.status = Status.FAILED
            log.error("%s", exc)
            self.events.write("failed", error=str(exc))
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = Status.FAILED
            log.exception("node failed")
            self.events.write("failed", error=self.error)
        finally:
            self.events.close()
        return 0 if self.status is Status.STOPPED else 1

    async def _main(self) -> None:
        # Imported here: protocol pulls in grpc, which must not start threads before the DHT forks.

        from farloco.protocol.membership import DHTMembership, make_record_validators

        self._loop = asyncio.get_running_loop()
        self._leave_event = asyncio.Event()
        self._publish_lock = asyncio.Lock()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._on_signal)

        net = self.config.network
        identity = self.run_dir / "identity.key"
        self.dht = make_dht(
            host_maddrs=[f"/ip4/{net.host}/tcp/{net.dht_port}"],
            announce_maddrs=[f"/ip4/{net.announce_host}/tcp/{net.dht_port}"] if net.announce_host else None,
            initial_peers=list(net.initial_peers),
            record_validators=make_record_validators(self.config.run.name),
            identity_path=str(identity),
            start=True,
        )
        faults = parse_dht_faults(os.environ.get("FARLOCO_FAULTS", ""))
        if faults:  # test and chaos hook: a real DHT that refuses or stops answering some calls
            log.warning("fault injected: the DHT misbehaves on purpose (%s)", faults)
            self.dht = FlakyDHT(self.dht, **faults)
        try:
            await self._serve(DHTMembership)
        finally:
            log.info("shutting down the DHT node")
            stop_dht(self.dht)
            log.info("DHT node stopped")

    async def _serve(self, membership_cls: Any) -> None:
        from farloco.protocol.auth import Authenticator
        from farloco.protocol.exchange import Exchange
        from farloco.protocol.matchmaking import DHTMatchmaker
        from farloco.protocol.rpc import RpcClient, RpcServer
        from farloco.protocol.statesync import StateServer

        net, run = self.config.network, self.config.run
        self.peer_id = self.dht.peer_id.to_base58()
        self.multiaddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        secret = self._secret()
        auth = Authenticator(f"{run.name}:{self.run_hash}", secret, self.peer_id)
        from farloco.node.config import load_tls

        tls = load_tls(net)  # mutual TLS when [network] names a cert, key and CA (checked at config load)
        data_port = net.data_port if net.data_plane == "tcp" else None  # RpcServer ignores it under TLS
        self.server = RpcServer(auth, host=net.host, port=net.grpc_port, tls=tls, data_port=data_port)
        self.client = RpcClient(auth, tls=tls)
        self.exchange = Exchange(self.server, self.client, self.peer_id)
        self.state_server = StateServer(self._state_snapshot, on_served=self._state_fault())
        self.state_server.register(self.server)
        bound = await self.server.start()
        port = bound.rsplit(":", 1)[1]
        self.grpc_address = f"{net.announce_host or net.host}:{port}"
        self.membership = membership_cls(
            self.dht,
            run.name,
            self.run_hash,
            run_section(self.config),
            ttl=self.config.timeouts.member_ttl,
            heartbeat_interval=self.config.timeouts.heartbeat_interval,
            auth=auth,  # binds our peer id to our DHT key; records of keys without the run secret are ignored
            retry_seconds=self.config.timeouts.dht_retry,
        )
        # Ready and group messages travel over the members' gRPC links; the DHT is the fallback.
        self.matchmaker = DHTMatchmaker(
            self.dht, run.name, self.membership, server=self.server, client=self.client
        )
        self.control = ControlServer(
            self.run_dir,
            net.control_host,
            net.control_port,
            status=self.status_dict,
            peers=self.peers_list,
            leave=self.request_leave,
            metrics=self.metrics_text,
            ready=lambda: self.status in (Status.TRAINING, Status.EXCHANGING),
        )
        self.control.start()
        (self.run_dir / "agent.pid").write_text(str(os.getpid()))
        self.events.write(
            "started",
            peer_id=self.peer_id,
            pid=os.getpid(),
            dht_pid=getattr(self.dht, "pid", None),  # the DHT child process (what chaos tests stall)
            multiaddrs=self.multiaddrs,
            grpc=self.grpc_address,
            run_hash=self.run_hash,
            num_params=self.num_params,
        )
        print(f"farloco node {self.peer_id} listening", flush=True)
        for maddr in self.multiaddrs:
            print(f"multiaddr {maddr}", flush=True)
        work = asyncio.create_task(self._work(), name="farloco-node")
        try:
            await self._until_left(work)
            self.status = Status.STOPPED
        finally:
            await self._shut_down()

    async def _work(self) -> None:
        """What the node does until it leaves: join, start the ranks, run rounds."""
        await self._join()  # starts the trainer ranks and the heartbeat once our data slot is known
        self._request_inner_load()
        if self.config.run.outer_update == "sync":
            await self._round_loop()
        else:
            await self._overlapped_loop()

    def _leave_grace(self) -> float:
        """Seconds, from the leave request, that the node's own work may take to wind down by itself."""
        if self.leave_mode == "now":
            return 2.0  # the round loop abandons its exchange itself and writes what it withdrew from
        if self.status in (Status.STARTING, Status.SYNCING):
            return 0.0  # joining or fetching state: nothing to finish
        return self.config.timeouts.leave_timeout / 2  # finish the round in flight if it ends in time

    async def _until_left(self, work: asyncio.Task[None]) -> None:
        """Wait for `work` to end. Once a leave (not a drain) is asked for, it gets `_leave_grace()` seconds
        to end by itself, then it is cancelled, so leaving takes at most timeouts.leave_timeout."""
        assert self._leave_event is not None
        while not work.done():
            waiter = asyncio.ensure_future(self._leave_event.wait())
            try:
                await asyncio.wait({work, waiter}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(waiter)
            if work.done() or self._leave_requested_at is None:
                continue
            if time.monotonic() - self._leave_requested_at >= self._leave_grace():
                log.warning(
                    "leaving now: %s did not wind down within %.1f s of the leave request",
                    self.status.value,
                    self._leave_grace(),
                )
                self.events.write("withdrew", round_id=self.round_id, state=self.status.value, bounded=True)
                await cancel_and_wait(work, timeout=3.0)
                return
        work.result()  # the node's own error, if it failed

    async def _shut_down(self) -> None:
        """Deregister, stop the ranks and the servers; each step bounded, all within timeouts.leave_timeout of
        the leave request (or of now, when the node stops for another reason)."""
        from farloco.protocol.membership import MembershipError

        timeouts = self.config.timeouts
        start = self._leave_requested_at if self._leave_requested_at is not None else time.monotonic()
        # What is left after this method: stopping the DHT process (hivemind allows it 3 s) and the exit.
        reserve = min(4.0, timeouts.leave_timeout / 4)
        end = max(start + timeouts.leave_timeout - reserve, time.monotonic() + 3.0)

        def left(share: float = 1.0) -> float:
            return max(0.2, (end - time.monotonic()) * share)

        self.status = Status.LEAVING if self.status is not Status.FAILED else self.status
        if getattr(self, "handoff", None) is not None:
            self.handoff.stop()  # the ranks wind down while we deregister; _stop_trainers waits for them
        await cancel_and_wait(self._heartbeat_task, timeout=1.0)
        await cancel_and_wait(self._record_task, timeout=1.0)
        await cancel_and_wait(self._inner_load_task, timeout=1.0)
        try:
            bound = left(0.4)
            await self._while_dht_daemon_lives(
                wait_for(self.membership.remove(retry_seconds=min(timeouts.dht_retry, bound)), bound)
            )
        except (MembershipError, TimeoutError) as exc:
            log.warning(
                "could not store our departure on the DHT (%s); the others drop us once our record expires "
                "(member_ttl=%.0f s)",
                exc,
                timeouts.member_ttl,
            )
        self._stop_trainers(timeout=left(0.5))
        await self.matchmaker.close()
        await self.client.close()
        await self.server.stop(grace=min(1.0, left()))
        self.control.stop()
        if self._checkpoint_task is not None:
            # A checkpoint still being written gets what is left; an unfinished one stays a .tmp- directory,
            # which is never loaded.
            done, _ = await asyncio.wait({self._checkpoint_task}, timeout=left())
            if not done:
                log.warning("the checkpoint in progress did not finish before leaving; it is discarded")
                await cancel_and_wait(self._checkpoint_task, timeout=1.0)
        if self.status is not Status.FAILED:
            self.status = Status.STOPPED
        self.events.write("stopped", round_id=self.round_id, error=self.error)
        if getattr(self, "handoff", None) is not None:
            self.handoff.close()

    async def _while_dht_daemon_lives(self, work: Awaitable[Any]) -> Any:
        """`work` (a DHT call), cut short with TimeoutError as soon as the DHT's p2pd is gone: a signal sent to
        the whole node (Slurm, systemd) ends p2pd as it starts our leave, and a DHT call would then wait out its
        whole bound for nothing."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                await asyncio.wait({task}, timeout=0.1)  # first: the work has started when we may cancel it
                if task.done():
                    return task.result()
                if not daemon_alive(self.dht):
                    raise TimeoutError(
                        "the DHT's daemon (p2pd) is gone: a signal to the whole node ends it too"
                    )
        finally:
            await cancel_and_wait(task, timeout=1.0)

    def _secret(self) -> bytes:
        path = self.config.auth.secret_file
        if path:
            return Path(path).read_bytes().strip()
        env = os.environ.get("FARLOCO_RUN_SECRET")
        if env:
            return env.encode()
        return hashlib.sha256(b"farloco-run-secret:" + self.run_hash.encode()).digest()

    # ---- state: snapshot for donors, install from a donor -------------------------------------------------------
    def _state_snapshot(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The committed state as donors serve it: copies, made on the first request for this state (on the
        event loop, between rounds, so never half-way through a commit) and kept until the state changes. A
        node no joiner asks costs no copy per round."""
        if self._snapshot is None or self._snapshot[0]["round_id"] != self.round_id:
            meta = {
                "round_id": self.round_id,
                "run_hash": self.run_hash,
                "outer_hash": self.outer_hash,
                "run_config": run_section(self.config),
            }
            self._snapshot = (meta, self.outer.snapshot())
        return self._snapshot

    def _install_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        if meta.get("run_hash") != self.run_hash:
            theirs = meta.get("run_config", {})
            raise AgentError(
                "donor serves another run: " + "; ".join(diff_run(run_section(self.config), theirs) or ["?"])
            )
        theta = tensors.get("theta")
        if theta is None or theta.shape != self.theta.shape or theta.dtype != torch.float32:
            got = None if theta is None else f"{theta.dtype}{list(theta.shape)}"
            raise AgentError(f"donor state: expected theta float32[{self.num_params}], got {got}")
        self.theta.copy_(theta)
        self.strategy.load_state_dict(
            {k.removeprefix("strategy."): v for k, v in tensors.items() if k.startswith("strategy.")}
        )
        self.round_id = int(meta["round_id"])
        self.outer_hash = theta_hash(self.theta)
        self._snapshot = None

    async def _sync_from(self, donors: list[str], why: str) -> None:
        from farloco.protocol.statesync import fetch_state

        self.status = Status.SYNCING
        started = time.monotonic()
        self.sync_progress = SyncProgress(f"state sync ({why})")
        try:
            meta, tensors = await fetch_state(
                self.client,
                donors,
                timeout=self.config.timeouts.sync_timeout,
                expect_run_hash=self.run_hash,
                on_progress=self.sync_progress.update,
            )
        finally:
            self.sync_progress.close()
            self.sync_progress = None
        self._install_state(meta, tensors)
        self.counters.resyncs += 1
        self.events.write(
            "synced", why=why, round_id=self.round_id, donors=donors, seconds=time.monotonic() - started
        )
        log.info("synced state of round %d from %s (%s)", self.round_id, donors, why)

    def _stage_inner(self) -> tuple[Path | None, int]:
        """Stage this round's checkpoint directory and ask the ranks to save their inner state into its inner/;
        they do it at their next sequence boundary. Returns (staged directory, request seq), or (None, 0)."""
        from farloco.node.checkpoint import INNER_DIR, CheckpointError, checkpoints_dir, stage_checkpoint
        from farloco.node.handoff import INNER_SAVE

        try:
            staged = stage_checkpoint(checkpoints_dir(self.run_dir), self.round_id)
        except (CheckpointError, OSError) as exc:
            log.error("cannot stage the checkpoint of round %d: %s", self.round_id, exc)
            return None, 0
        return staged, self.handoff.request_inner(INNER_SAVE, staged / INNER_DIR)

    async def _wait_inner(self, seq: int) -> dict[str, Any] | None:
        """Wait for every rank to serve inner-state request `seq`: its outcome, or None if the ranks are gone."""
        from farloco.node.handoff import INNER_FAILED, INNER_FRESH, INNER_OK

        while not self.handoff.inner_all_done(seq):
            if self._trainers_exited.is_set():
                return None
            await asyncio.sleep(0.05)
        reports = [self.handoff.report(r) for r in range(self.handoff.world_size)]
        names = {INNER_OK: "ok", INNER_FRESH: "fresh", INNER_FAILED: "failed"}
        return {
            "result": names.get(max(r.inner_result for r in reports), "?"),
            "optimizer_step": reports[0].optimizer_step,
            "optimizer_fingerprint": reports[0].optimizer_fingerprint,
        }

    def _request_inner_load(self) -> None:
        """Resumed from a checkpoint with inner state: the ranks load it before their first sequence."""
        from farloco.node.handoff import INNER_LOAD

        if self._inner_resume is None:
            return
        seq = self.handoff.request_inner(INNER_LOAD, self._inner_resume)
        self._inner_load_task = asyncio.create_task(self._report_inner_load(seq, self._inner_resume))

    async def _report_inner_load(self, seq: int, directory: Path) -> None:
        outcome = await self._wait_inner(seq)
        if outcome is None:
            return
        if outcome["result"] != "ok":
            log.warning("the ranks could not load %s: they start with a fresh optimizer state", directory)
        self.events.write("inner_resumed", path=str(directory), **outcome)

    async def _checkpoint(
        self, tensors: dict[str, torch.Tensor], staged: Path | None = None, inner_seq: int = 0
    ) -> None:
        """Write the committed outer state `tensors` (the snapshot donors serve, taken at commit) off the event
        loop, then prune. With `staged`, first wait for the ranks to write their inner state into it (request
        `inner_seq`)."""
        import shutil

        from farloco.node.checkpoint import (
            INNER_DIR,
            CheckpointError,
            checkpoints_dir,
            prune_checkpoints,
            save_checkpoint,
        )

        round_id = self.round_id
        waited = time.monotonic()
        inner = await self._wait_inner(inner_seq) if staged is not None else None
        if inner is not None:
            inner["seconds"] = time.monotonic() - waited  # the ranks' save, from request (commit) to done
        if staged is not None and (inner is None or inner["result"] != "ok"):
            # Never commit a partial inner/: the checkpoint holds the outer state alone, resuming uses fresh AdamW.
            if inner is None and self.leave_mode not in (None, "drain"):
                log.info(
                    "round %d's checkpoint holds the outer state only: the ranks stopped for the leave",
                    round_id,
                )
            else:
                log.error("the ranks did not save their inner state for round %d (%s)", round_id, inner)
            await asyncio.to_thread(shutil.rmtree, staged / INNER_DIR, True)
        meta = {
            "run_hash": self.run_hash,
            "inner_step": str(round_id * self.config.run.inner_steps),
            "run_name": self.config.run.name,
        }
        root = checkpoints_dir(self.run_dir)
        started = time.monotonic()
        try:
            path = await asyncio.to_thread(save_checkpoint, root, round_id, tensors, meta, staged=staged)
            removed = await asyncio.to_thread(prune_checkpoints, root, self.config.checkpoint.keep)
        except (CheckpointError, OSError) as exc:  # a full disk must not stop training
            log.error("checkpoint of round %d failed: %s", round_id, exc)
            self.events.write("checkpoint_failed", round_id=round_id, error=str(exc))
            return
        self.last_checkpoint = str(path)
        self.events.write(
            "checkpoint",
            round_id=round_id,
            path=str(path),
            seconds=time.monotonic() - started,
            pruned=len(removed),
            inner=inner,
        )

    def _resume_from_checkpoint(self) -> None:
        """No peer is ahead: continue from this run directory's newest loadable checkpoint, if any."""
        from farloco.node.checkpoint import (
            CheckpointError,
            checkpoints_dir,
            latest_checkpoint,
            load_checkpoint,
            verify_inner,
        )

        path = latest_checkpoint(checkpoints_dir(self.run_dir))
        if path is None:
            return
        meta, tensors = load_checkpoint(path)
        if meta["run_hash"] != self.run_hash:
            raise AgentError(
                f"{path} was written by run_hash {meta['run_hash'][:12]}, this config has "
                f"{self.run_hash[:12]}: use a new --run-dir for a new run"
            )
        self._install_state({"round_id": meta["round_id"], "run_hash": meta["run_hash"]}, tensors)
        self.last_checkpoint = str(path)
        try:
            self._inner_resume = verify_inner(path)
        except CheckpointError as exc:
            log.warning("%s: the ranks start with a fresh optimizer state", exc)
        self.events.write("resumed", round_id=self.round_id, checkpoint=str(path))

    # ---- membership --------------------------------------------------------------------------------------------
    def _record(self) -> Any:
        from farloco.protocol.membership import MemberRecord

        return MemberRecord(
            peer_id=self.peer_id,
            address=self.grpc_address,
            state=self.status.value,
            round_id=self.round_id,
            inner_step=int(self.status_dict()["inner_step"]),
            slot=self.slot,
            run_hash=self.run_hash,
            run_config=run_section(self.config),
            outer_hash=self.outer_hash,
            loss=0.0 if math.isnan(self.train_loss) else float(self.train_loss),
            heartbeat=0.0,
            maddrs=tuple(self.multiaddrs),
            version=_version(),
        )

    async def _publish(self, retry_seconds: float = 0.0) -> None:
        """Publish our member record now (one try by default: the next heartbeat is the retry). Serialised:
        the DHT keeps only the entry with the latest expiration, so two overlapping stores of ours would refuse
        one another."""
        from farloco.protocol.membership import MembershipError

        async with self._publish_lock:
            try:
                await self.membership.publish(self._record(), retry_seconds=retry_seconds)
            except MembershipError as exc:  # survivable: the record lives for several heartbeats
                log.warning("publishing our member record failed: %s", exc)

    async def _refresh_peers(self) -> list[Any]:
        members = await self.membership.members()
        view = [
            {
                "peer_id": m.peer_id,
                "address": m.address,
                "state": m.state,
                "round_id": m.round_id,
                "inner_step": m.inner_step,
                "slot": m.slot,
                "loss": m.loss,
                "outer_hash": m.outer_hash,
                "heartbeat_age": max(0.0, _dht_now() - m.heartbeat),
                "share": self.shares.share(m.peer_id),
                "self": m.peer_id == self.peer_id,
            }
            for m in members
        ]
        others = [m for m in members if m.peer_id != self.peer_id]
        for m in others:
            self._peer_maddrs[m.peer_id] = tuple(m.maddrs)
        was = self.isolation.verdict
        verdict = self.isolation.observe(_dht_now(), [m.peer_id for m in others], self.membership.departed())
        self._peer_maddrs = {p: a for p, a in self._peer_maddrs.items() if p in self.isolation.known}
        if verdict == "isolated" and was != "isolated":
            log.warning(
                "isolated: the peers %s vanished without leaving (crashed, or the network between us is down); "
                "no round is committed alone while it lasts",
                ", ".join(self.isolation.vanished),
            )
        with self._lock:
            self.peers_view = view
        return list(members)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.timeouts.heartbeat_interval)
            try:
                await self._publish()
                await self._refresh_peers()
            except Exception as exc:  # the DHT may hiccup; the next beat retries
                log.warning("heartbeat failed: %s", exc)

    async def _join(self) -> None:
        """Refuse a mismatched run, claim a data slot, and fetch the swarm's state if it is already training."""
        from farloco.protocol.membership import MembershipError

        self.status = Status.SYNCING
        members = await self._refresh_peers()
        mismatched = self.membership.mismatched()
        if mismatched:
            record, _keys = mismatched[0]
            differences = diff_run(run_section(self.config), dict(record.run_config))
            raise AgentError(
                f"refusing to join: peer {record.peer_id} trains run {self.config.run.name!r} with another "
                f"config (run_hash {record.run_hash[:12]} vs ours {self.run_hash[:12]}): "
                + "; ".join(differences)
            )
        try:
            # Our first record must get out (the slot claim and every later lookup need it): a refused store is
            # retried for timeouts.dht_retry, and only then does the node give up, saying what to check.
            async with self._publish_lock:
                await self.membership.publish(self._record())
                self.slot = await self.membership.claim_slot(self.peer_id, self.config.run.data_slots)
        except MembershipError as exc:
            raise AgentError(f"joining: {exc}") from exc
        # The ranks start now (they know their data slot) and wait for the first round's theta: their start-up
        # (a Python process each, torch, the model, the data) overlaps the state fetch below instead of following
        # it. A restarted node that started them after its sync spent seconds past the round it had fetched, the
        # swarm froze that round without it, and it fetched again.
        self._start_trainers()
        # Heartbeats from now on: during a long state fetch our record must stay live and say `syncing`, which
        # is what makes the others wait for us (protocol/matchmaking.py, catching up).
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="farloco-heartbeat")
        others = [m for m in members if m.peer_id != self.peer_id and m.round_id > 0]
        if others:
            # The swarm is mid-round: take the state its current round started from and join that round. Our
            # record says `syncing`, so the round's members wait for us (up to match_timeout); if it still freezes
            # without us, we are late and take the next round's state the same way. (Waiting for the next round
            # boundary instead, as before, stalled every join: the swarm waited for the syncing node while the
            # node waited for the swarm to finish the round.)
            target = max(m.round_id for m in others)
            self.events.write("catching_up", round_id=target)
            if not await self._catch_up(target, "join", wait=self.config.timeouts.sync_timeout):
                raise AgentError(f"joining: no member reached round {target} within timeouts.sync_timeout")
        else:
            self._resume_from_checkpoint()
            self.outer_hash = theta_hash(self.theta)
        self.status = Status.TRAINING
        await self._publish()
        self.events.write("joined", round_id=self.round_id, slot=self.slot, num_peers=len(members))

    # ---- trainer ranks -----------------------------------------------------------------------------------------
    def _start_trainers(self) -> None:
        from farloco.node.data import builtin_dataset

        run = self.config.run
        if run.dataset == "builtin":
            dataset = builtin_dataset(
                Path(os.environ.get("FARLOCO_CACHE", Path.home() / ".cache" / "farloco"))
            )
        else:
            dataset = Path(run.dataset)
        self.handoff = Handoff.create(self.num_params, self.config.node.num_ranks)
        # theta_outer lives in the hand-off from now on where the ranks simply load it (OuterRound.share_with),
        # unless the ranks train from another theta while a round is in flight (run.outer_update delayed/eager):
        # there the hand-off's theta is the reference of their next contribution, theta_outer a private vector.
        if run.outer_update == "sync":
            self.theta = self.outer.share_with(self.handoff.theta)
        self._trainer_thread = threading.Thread(
            target=self._supervise_trainers, args=(dataset,), name="farloco-trainers", daemon=True
        )
        self._trainer_thread.start()

    def _supervise_trainers(self, dataset: Path) -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        node = self.config.node
        log_dir = self.run_dir / "logs" / "trainer"
        log_dir.mkdir(parents=True, exist_ok=True)
        launch = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=node.num_ranks,
            run_id=f"farloco-{os.getpid()}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            rdzv_configs={"is_host": True},
            max_restarts=node.max_restarts,
            monitor_interval=0.2,
            start_method="spawn",
            local_addr="127.0.0.1",
            # The ranks' output always lands in logs/trainer/; echoed on stderr only for text logs (a JSON
            # stderr must hold JSON lines only).
            logs_specs=DefaultLogsSpecs(
                log_dir=str(log_dir), tee=Std.ALL if console_format() == "text" else Std.NONE
            ),
        )
        args = (
            "-m",
            "farloco.node.trainer",
            "--handoff",
            str(self.handoff.path),
            "--config",
            str(self.run_dir / "config.toml"),
            "--dataset",
            str(dataset),
            "--slot",
            str(self.slot),
        )
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(node.threads_per_rank)
        self.launcher_failures.install()
        try:
            elastic_launch(launch, entrypoint=sys.executable)(*args)
        except BaseException as exc:
            self._trainer_error = exc
        finally:
            self.launcher_failures.uninstall()
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            self._trainers_exited.set()
            if self._loop is not None and self._leave_event is not None:
                self._loop.call_soon_threadsafe(self._leave_event.set)

    def _stop_trainers(self, timeout: float = 30.0) -> None:
        """Tell the ranks to stop and wait up to `timeout` seconds for them (a rank stuck in a collective or in
        a long step is then SIGKILLed, and the launcher, with STOP set, restarts none)."""
        if getattr(self, "handoff", None) is None or self._trainer_thread is None:
            return
        self.handoff.stop()
        # The ranks were told STOP when the leave was asked for; whatever the round's wind-down left of the
        # budget, a rank finishing its inner step gets RANK_STOP_FLOOR seconds more before it is SIGKILLed.
        if not self._trainers_exited.wait(timeout=max(RANK_STOP_FLOOR, timeout - 2.0)):
            for rank in range(self.handoff.world_size):
                pid = self.handoff.report(rank).pid
                if pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self._trainers_exited.wait(timeout=2.0)

    def _publish_work(
        self, load: torch.Tensor | None, *, round_id: int, step_base: int, inner_steps: int
    ) -> int:
        """Hand the ranks their next sequence (`Handoff.publish`), adding the time they waited for it since
        their last one ended to `counters.ranks_idle_seconds`."""
        if self._idle_since is not None:
            idle = time.monotonic() - self._idle_since
            self.counters.ranks_idle_seconds += idle
            self.metrics.ranks_idle.observe(idle)
            self._idle_since = None
        return self.handoff.publish(load, round_id=round_id, step_base=step_base, inner_steps=inner_steps)

    def _trainer_failure(self) -> str | None:
        if self._trainers_exited.is_set() and self.handoff.command == 0:
            return f"trainer ranks exited ({self._trainer_error or 'without error'})"
        return None

    async def _wait_ranks(self, seq: int) -> bool:
        """Wait until every rank finished sequence `seq`; False if the node must leave now."""
        while not self.handoff.all_done(seq):
            failure = self._trainer_failure()
            if failure:
                raise AgentError(f"{failure}; leaving the swarm")
            if self.leave_mode in ("graceful", "now"):
                return False
            assert self._leave_event is not None
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._leave_event.wait(), timeout=0.01)
            self._leave_event.clear()
        if self._idle_since is None:
            self._idle_since = time.monotonic()  # the ranks wait for us from here to the next publish
        return True

    # ---- rounds ------------------------------------------------------------------------------------------------
    async def _round_loop(self) -> None:
        run = self.config.run
        # What the ranks load at their next sequence: theta_outer, the merged local weights after a committed
        # round (streaming-diloco keeps the other fragments' local progress), or None: keep their weights.
        load: torch.Tensor | None = self.theta
        # Inner steps of this round the ranks already ran while the last exchange was in flight.
        steps_done = 0
        while True:
            if run.max_rounds and self.round_id >= run.max_rounds:
                self.events.write("finished", round_id=self.round_id)
                return
            if self.leave_mode is not None:
                return
            # The members wait for us in this round from now on (our record says so a heartbeat later).
            self.matchmaker.announce(self.round_id, self.peer_id, self.outer_hash)
            seq = self._publish_work(
                load,
                round_id=self.round_id,
                step_base=self.round_id * run.inner_steps + steps_done,
                inner_steps=run.inner_steps - steps_done,
            )
            self.status = Status.TRAINING
            if not await self._wait_ranks(seq):
                self.events.write("withdrew", round_id=self.round_id)
                return
            self._overlap_seq = None
            reload = await self._unless_leaving_now(self._round(seq))
            if reload is None:
                self.events.write("withdrew", round_id=self.round_id, mode="now")
                return
            steps_done = 0
            if self._overlap_seq is not None:
                # The merge must land on the weights the ranks reached after their tau overlapped steps.
                if not await self._wait_ranks(self._overlap_seq):
                    self.events.write("withdrew", round_id=self.round_id)
                    return
                steps_done = self._overlap_steps
            if reload and self._merge_pending:
                load = self.outer.merged(self.handoff.local, self.handoff.theta)
            elif reload:  # state sync: start the round afresh from the swarm's theta_outer
                load, steps_done = self.theta, 0
            else:
                load = None
            self._merge_pending = False
            if self.leave_mode == "drain":
                return

    async def _overlapped_loop(self) -> None:
        """run.outer_update = delayed | eager (Kale et al. 2025): the ranks never wait for the exchange.

        When the ranks end sequence s, the round in flight (s-1) is awaited, usually long done, committing its
        mean on theta_outer; the contribution of sequence s is measured from where the ranks started it (the
        hand-off's theta); the ranks start sequence s+1 at once from theta_outer (delayed), or from theta_outer
        with this node's fresh contribution previewed in place of its stale one (eager,
        `OuterRound.eager_start`); and round s is exchanged while they train. theta_outer, the hashes, the
        commits, state sync and catch-up are those of the synchronous loop: every peer holds the same
        theta_outer, one round behind what its ranks train on. The ranks wait only when a round takes longer than
        their inner steps, and after the last round (run.max_rounds)."""
        run = self.config.run
        pending: asyncio.Task[bool] | None = None
        # eager: what the swarm saw of our contribution to the round just applied
        stale: torch.Tensor | None = None
        # The members wait for us in a round from its announcement: here for the first, then as soon as the
        # round before it closed (`_round_in_flight`), while our ranks already work on it.
        self.matchmaker.announce(self.round_id, self.peer_id, self.outer_hash)
        started_from = self.outer_hash
        # Where the ranks' current sequence started, kept by us: the hand-off's theta gets the next start at the
        # hand-off, before the contribution of the sequence just ended is made (off the ranks' path).
        reference = self.outer.reference(self.theta)
        seq = self._publish_work(
            self.theta,
            round_id=self.round_id,
            step_base=self.round_id * run.inner_steps,
            inner_steps=run.inner_steps,
        )
        self.status = Status.TRAINING
        try:
            while True:
                ranks_done = await self._wait_ranks(seq)
                if pending is not None:
                    committed = self.counters.rounds_committed
                    # A graceful leave lets the round in flight end (bounded by the leave's grace).
                    outcome = await self._unless_leaving_now(pending)
                    pending = None
                    if outcome is None:
                        self.events.write("withdrew", round_id=self.round_id, mode="now")
                        return
                    if self.counters.rounds_committed == committed:
                        stale = None  # the round did not commit with our contribution in its mean
                if not ranks_done:
                    self.events.write("withdrew", round_id=self.round_id)
                    return
                if run.max_rounds and self.round_id >= run.max_rounds:
                    self.events.write("finished", round_id=self.round_id)
                    return
                if self.leave_mode is not None:
                    return
                last = bool(run.max_rounds) and self.round_id + 1 >= run.max_rounds
                trained_from, started_from = started_from, self.outer_hash
                self._read_reports(seq)  # before the next sequence's first eval overwrites them
                # The ranks' weights stay put in the hand-off until their next sequence ends: read in place.
                prepared: Prepared | None = None
                if last:
                    prepared = self._prepare_round(seq, copy=False, reference=reference, reports=False)
                    prepared.trained_from = trained_from
                    outcome = await self._unless_leaving_now(self._round(seq, prepared))
                    if outcome is None:
                        self.events.write("withdrew", round_id=self.round_id, mode="now")
                        return
                    continue
                start = self.theta
                if run.outer_update == "eager":
                    # The preview needs this round's contribution: made before the ranks go on.
                    prepared = self._prepare_round(seq, copy=False, reference=reference, reports=False)
                    group = self.counters.last_contributors or len(self._live_ids()) + 1
                    stale = self.outer.eager_start(self.handoff.theta, prepared.contribution, stale, group)
                    start = self.handoff.theta
                round_seq = seq
                seq = self._publish_work(
                    start,
                    round_id=self.round_id + 1,
                    step_base=(self.round_id + 1) * run.inner_steps,
                    inner_steps=run.inner_steps,
                )
                # The ranks train on from here; the rest of the hand-off is off their path.
                if prepared is None:
                    prepared = self._prepare_round(round_seq, copy=False, reference=reference, reports=False)
                prepared.trained_from = trained_from
                reference.copy_(self.handoff.theta)  # the start of the sequence just published
                pending = asyncio.create_task(
                    self._round_in_flight(round_seq, prepared), name="farloco-round"
                )
        finally:
            if pending is not None:
                await cancel_and_wait(pending)

    async def _round_in_flight(self, seq: int, prepared: Prepared) -> bool:
        """`_round` while the ranks train on: once it closed (committed, aborted, caught up), the next round's
        work is already under way, so it is announced at once, and the node's status says it trains."""
        try:
            return await self._round(seq, prepared)
        finally:
            if self.status in (Status.EXCHANGING, Status.SYNCING, Status.ISOLATED):
                self.status = Status.TRAINING
            if self.leave_mode is None:
                self.matchmaker.announce(self.round_id, self.peer_id, self.outer_hash)

    async def _unless_leaving_now(self, work: Awaitable[bool]) -> bool | None:
        """Run one round's exchange; `leave --now` abandons it (None): the others drop us from the exchange."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                if self.leave_mode == "now":
                    await cancel_and_wait(task)
                    return None
                await asyncio.wait({task}, timeout=0.05)
            return task.result()
        finally:
            if not task.done():  # we were cancelled ourselves (a bounded leave): the round goes with us
                await cancel_and_wait(task)

    def _read_reports(self, seq: int) -> None:
        """The ranks' train loss of sequence `seq` and the held-out loss of the theta it started from."""
        reports = [self.handoff.report(r) for r in range(self.handoff.world_size)]
        self.train_loss = sum(r.train_loss for r in reports) / len(reports)
        step_seconds = max(r.step_seconds for r in reports)
        if step_seconds > 0:
            self.metrics.inner_step_duration.observe(step_seconds)
        evals = [r.eval_loss for r in reports if r.eval_seq == seq]
        if evals:
            self.eval_loss = evals[0]

    def _prepare_round(
        self, seq: int, *, copy: bool, reference: torch.Tensor | None = None, reports: bool = True
    ) -> Prepared:
        """Read sequence `seq`'s reports (unless read already) and the ranks' weights (a copy when they train
        on meanwhile and would overwrite them) and make the round's contribution, measured from `reference`
        (default: theta_outer)."""
        if reports:
            self._read_reports(seq)
        theta_local = self.outer.read_local(self.handoff.local, copy=copy)
        try:
            contribution = self.outer.contribution(theta_local, reference)
        except OuterError as exc:
            raise AgentError(f"round {self.round_id}: {exc}") from None
        return Prepared(theta_local, contribution, fixed_reference=reference is not None)

    async def _round(self, seq: int, prepared: Prepared | None = None) -> bool:
        """Exchange and apply round `self.round_id` (its contribution `prepared` already, when the ranks train on
        meanwhile). Returns whether the ranks must reload theta."""
        from farloco.protocol.exchange import ExchangeAborted
        from farloco.protocol.matchmaking import LateForRound, MatchmakingError
        from farloco.protocol.statesync import StateSyncError
        from farloco.protocol.types import GroupMember

        run, timeouts = self.config.run, self.config.timeouts
        started = time.monotonic()
        overlap = (
            prepared is None
            and bool(self._overlap_steps)
            and not (run.max_rounds and self.round_id + 1 >= run.max_rounds)
        )
        if prepared is None:
            # While the ranks wait for us their weights stay put and are read in place; when they train on
            # during the exchange (overlap) we read a copy, taken before they can overwrite it.
            prepared = self._prepare_round(seq, copy=overlap)
        theta_local, contribution = prepared.theta_local, prepared.contribution
        if overlap:
            # streaming-diloco: the ranks run the next round's first tau inner steps while we exchange (their
            # reports and weights for this round were read above, before they can overwrite them).
            self._overlap_seq = self._publish_work(
                None,
                round_id=self.round_id + 1,
                step_base=(self.round_id + 1) * run.inner_steps,
                inner_steps=self._overlap_steps,
            )
        self.status = Status.EXCHANGING
        # No member-record store here: our record moved to this round when its work started (what the early
        # freeze needs); the next heartbeat says 'exchanging'. The round's agreement goes over the links.
        isolated = await self._ride_out_isolation()
        if isolated is not None:
            self._left_out(shares.ISOLATED)
            return isolated
        me = GroupMember(self.peer_id, self.grpc_address)
        try:
            group = await self.matchmaker.form_group(
                self.round_id,
                me,
                match_timeout=timeouts.match_timeout,
                leader_timeout=timeouts.leader_timeout,
                match_timeout_min=timeouts.match_timeout_min,
            )
        except MatchmakingError as exc:
            # We could not even declare ourselves ready: whatever the others did, take it from them.
            self.events.write("matchmaking_failed", round_id=self.round_id, error=str(exc))
            self._left_out(shares.NO_GROUP)
            self.outer.rollback()
            return await self._catch_up(self.round_id + 1, "matchmaking failed")
        except LateForRound as exc:
            self.counters.rounds_late += 1
            self.events.write(
                "late", round_id=self.round_id, reason=exc.reason, group_formed=exc.group_formed
            )
            self._left_out(shares.LATE if exc.group_formed else shares.NO_GROUP)
            self.outer.rollback()
            if exc.group_formed:
                # The group moves to round r+1 without us: take its state at that boundary.
                return await self._catch_up(self.round_id + 1, "late for round")
            # Nobody formed a group, so nobody's theta changed: everyone moves on with the same theta, and our
            # local work stays in the ranks to be sent next round.
            return self._advance_without_update("no group formed")
        try:
            resynced = await self._check_hashes(group)
        except StateSyncError as exc:
            # We hold the losing side of a fork and could not fetch the winner's state: contributing would
            # average into two models again. Sit this round out; the next one compares hashes again.
            return self._abort(f"healing a fork: the winning side's state did not arrive ({exc})", 1)
        if resynced and not prepared.fixed_reference:
            # We held a theta the group disagrees with and took the winning side's: redo our pseudo-gradient.
            # (Measured from where the ranks started instead, it is their own progress whatever theta is now.)
            try:
                contribution = self.outer.contribution(theta_local)
            except OuterError as exc:
                raise AgentError(f"round {self.round_id}: {exc}") from None
        try:
            if len(group.members) == 1:
                transmitted, averaged = self.outer.alone(contribution)
                sent, received, fp32_bytes = 0, 0, 0
                contributors: tuple[str, ...] = (self.peer_id,)
            else:
                # The mean and what the swarm saw of our contribution land in buffers kept across rounds.
                mean_out, sent_out = self.outer.exchange_buffers(contribution.numel())
                exchange_started = time.monotonic()
                result = await self.exchange.average(
                    group,
                    contribution,
                    self.codec,
                    timeout=timeouts.exchange_timeout,
                    out=mean_out,
                    transmitted_out=sent_out,
                )
                self.metrics.exchange_duration.observe(time.monotonic() - exchange_started)
                transmitted, averaged = result.transmitted, result.averaged
                contributors, sent, received = result.contributors, result.bytes_sent, result.bytes_received
                fp32_bytes = result.fp32_bytes
        except ExchangeAborted as exc:
            # What crossed the wire before the abort counts too (and its fp32 equivalent).
            self._count_bytes(exc.bytes_sent, exc.bytes_received, exc.fp32_bytes)
            self._left_out(shares.EXCHANGE_FAILED)
            return self._abort(f"exchange aborted: {exc}", len(group.members))
        # compression_ratio = fp32 baseline / bytes sent, both from the exchange's own count of every attempt:
        # a dense fp32 all-reduce of the values this member actually sent (a fragment, for streaming).
        self._count_bytes(sent, received, fp32_bytes)
        if len(contributors) < run.min_peers:
            self._left_out(shares.TOO_FEW)
            return self._abort(
                f"{len(contributors)} contributors < run.min_peers={run.min_peers}", len(contributors)
            )
        self._account_round(group, contributors)
        self.counters.last_contributors = len(contributors)
        fragment = getattr(self.strategy, "current_fragment", None)
        synced = fragment() if fragment is not None else slice(0, self.num_params)
        self.outer_hash = self.outer.commit(contribution, transmitted, averaged)
        self._merge_pending = True
        self.round_id += 1
        self._snapshot = None
        self._inject_faults()
        every = self.config.checkpoint.every_rounds
        if every and self.round_id % every == 0:
            if self._checkpoint_task is not None:
                await self._checkpoint_task  # one at a time, in round order (and its prune before staging)
            staged, inner_seq = self._stage_inner()
            # The copies donors would be served: later rounds never touch them while the write goes on.
            _, tensors = self._state_snapshot()
            self._checkpoint_task = asyncio.create_task(self._checkpoint(tensors, staged, inner_seq))
        ddp = ddp_bytes_per_round(self.num_params, run.inner_steps, len(contributors))
        self.counters.ddp_bytes += ddp
        self.counters.rounds_committed += 1
        self.counters.last_round_seconds = time.monotonic() - started
        self.metrics.round_duration.observe(self.counters.last_round_seconds)
        self.events.write(
            "round",
            round_id=self.round_id,
            group_id=group.group_id,
            group=[m.peer_id for m in group.members],
            contributors=list(contributors),
            train_loss=self.train_loss,
            eval_loss=self.eval_loss,
            outer_hash=self.outer_hash,
            bytes_sent=sent,
            bytes_received=received,
            ddp_bytes=ddp,
            synced=[synced.start, synced.stop],
            overlap_steps=self._overlap_steps if self._overlap_seq is not None else 0,
            fp32_bytes=fp32_bytes,
            seconds=self.counters.last_round_seconds,
            ranks_idle_seconds=self.counters.ranks_idle_seconds,
            trained_from=prepared.trained_from,
        )
        # Our record moves to the next round in the background: the round's path holds no DHT store (the next
        # round's MatchAt tells the members at once; the heartbeat retries a store that fails).
        if self._record_task is None or self._record_task.done():
            self._record_task = asyncio.create_task(self._publish(), name="farloco-record")
        return True

    def _live_ids(self) -> list[str]:
        return [m.peer_id for m in self.membership.core.live(_dht_now())]

    def _left_out(self, reason: str) -> None:
        """We are not among this round's contributors: say why (event, metric, our share)."""
        self.shares.left_out[reason] += 1
        self.shares.record([*self._live_ids(), self.peer_id], ())
        self.events.write("left_out", round_id=self.round_id, peer=self.peer_id, reason=reason, by="self")

    def _account_round(self, group: Any, contributors: tuple[str, ...]) -> None:
        """A committed round: record who took part; as its leader, name each live member left out and why."""
        now = _dht_now()
        live = {m.peer_id: m for m in self.membership.core.live(now)}
        self.shares.record([*live, self.peer_id], contributors)
        if self.matchmaker.last_leader != self.peer_id:
            return
        in_group = {m.peer_id for m in group.members}
        for peer_id, record in sorted(live.items()):
            if peer_id in contributors or peer_id == self.peer_id:
                continue
            reason = left_out_reason(
                record.state,
                self.matchmaker.round_of(record, now),
                self.round_id,
                in_group=peer_id in in_group,
            )
            self.shares.peers_left_out[reason] += 1
            self.events.write("left_out", round_id=self.round_id, peer=peer_id, reason=reason, by="leader")
            log.info("round %d: %s left out (%s)", self.round_id, peer_id, reason)

    def _count_bytes(self, sent: int, received: int, fp32_bytes: int) -> None:
        self.counters.bytes_sent += sent
        self.counters.bytes_received += received
        self.counters.raw_bytes += fp32_bytes

    def _abort(self, reason: str, num_peers: int) -> bool:
        self.counters.rounds_aborted += 1
        self.events.write("aborted", round_id=self.round_id, reason=reason, num_peers=num_peers)
        log.warning("round %d aborted: %s", self.round_id, reason)
        self.outer.rollback()  # the residual is not eaten
        return self._advance_without_update(reason)

    def _advance_without_update(self, reason: str) -> bool:
        """Close round r without an outer step: theta_outer stays as it is (so every peer that closes r this way
        still agrees), and the ranks keep their weights so the missed work rolls into the next delta. Round ids
        only ever move forward, so no round's matchmaking records are ever reused."""
        self.round_id += 1
        self._snapshot = None
        log.info("round %d closed without an update (%s)", self.round_id - 1, reason)
        return False

    async def _ride_out_isolation(self) -> bool | None:
        """The isolation policy (protocol/isolation.py), before a round's matchmaking. None: go on with the
        round (connected again at this round, alone because the others left, or alone past
        timeouts.isolation_timeout with run.min_peers = 1); a bool: the round is over (the swarm moved on and we
        took its state, or we are leaving), the value as `_round`'s."""
        watch = self.isolation
        if watch.verdict != "isolated":
            return None
        timeouts = self.config.timeouts
        limit = timeouts.isolation_timeout
        self.status = Status.ISOLATED
        self.events.write("isolated", round_id=self.round_id, vanished=list(watch.vanished), timeout=limit)
        log.warning(
            "round %d waits: isolated from %s; reaching the swarm through the initial peers and their last "
            "addresses for up to %.0f s (timeouts.isolation_timeout)",
            self.round_id,
            ", ".join(watch.vanished),
            limit,
        )
        started = time.monotonic()
        while True:
            if self.leave_mode is not None:
                self.strategy.rollback()
                return False
            await self._reach_swarm()
            members = await self._refresh_peers()
            if watch.verdict != "isolated":
                others = [m for m in members if m.peer_id != self.peer_id]
                seconds = time.monotonic() - started
                self.events.write(
                    "rejoined", round_id=self.round_id, peers=[m.peer_id for m in others], seconds=seconds
                )
                log.warning("rejoined the swarm after %.1f s: %d peers live", seconds, len(others))
                self.status = Status.EXCHANGING
                newest = max((m.round_id for m in others), default=self.round_id)
                if newest > self.round_id:  # the swarm went on without us: take its state
                    self.strategy.rollback()
                    return await self._catch_up(newest, "rejoined after isolation")
                return None  # same round (or the others are behind and catch up to us): match with them
            waited = time.monotonic() - started
            if waited >= limit:
                if self.config.run.min_peers > 1:
                    raise AgentError(
                        f"isolated for {waited:.0f} s (timeouts.isolation_timeout={limit:g}): the peers "
                        f"{', '.join(watch.vanished)} vanished without leaving and none came back, and "
                        f"run.min_peers={self.config.run.min_peers} forbids training alone; check the network "
                        f"to the initial peers {list(self.config.network.initial_peers)}"
                    )
                self.events.write("continuing_alone", round_id=self.round_id, vanished=list(watch.vanished))
                log.warning(
                    "still isolated after %.0f s: going on alone (run.min_peers=1); peers that come back "
                    "are matched with again",
                    waited,
                )
                watch.forget()
                self.status = Status.EXCHANGING
                return None
            await asyncio.sleep(min(max(2 * timeouts.heartbeat_interval, 1.0), max(limit - waited, 0.0)))

    async def _reach_swarm(self) -> None:
        """Dial the initial peers and the vanished peers' last addresses from the DHT node (bounded)."""
        from functools import partial

        from farloco.node.dhtnode import reach_peers
        from farloco.protocol import dhtcall

        maddrs = [*self.config.network.initial_peers]
        for peer in self.isolation.vanished:
            maddrs += [f"{m}/p2p/{peer}" if "/p2p/" not in m else m for m in self._peer_maddrs.get(peer, ())]
        if not maddrs:
            return
        try:
            answered = await dhtcall.call(self.dht.run_coroutine, partial(reach_peers, maddrs=tuple(maddrs)))
        except Exception as exc:  # unreachable is what we expect while isolated; the next pass tries again
            log.info("reaching the swarm: %s", exc or type(exc).__name__)
        else:
            log.info("reaching the swarm: %d of the peers dialled answered", answered)

    async def _catch_up(self, target_round: int, why: str, *, wait: float | None = None) -> bool:
        """Fetch the swarm's state once some member has reached `target_round` (bounded wait).

        Returns whether the ranks must reload theta (False when nobody got there and we move on alone)."""
        from farloco.protocol.statesync import StateSyncError

        timeouts = self.config.timeouts
        wait = wait if wait is not None else timeouts.exchange_timeout + timeouts.match_timeout
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self.leave_mode is None:
            members = await self._refresh_peers()
            # A member's round: the newer of its record and what it announced over our links (MatchAt), so a
            # member record a heartbeat behind does not hold us a round longer than the swarm's own word.
            now = _dht_now()
            rounds = {
                m.peer_id: self.matchmaker.round_of(m, now) for m in members if m.peer_id != self.peer_id
            }
            ahead = [m for m in members if rounds.get(m.peer_id, -1) >= target_round]
            if ahead:
                newest = max(rounds[m.peer_id] for m in ahead)
                try:
                    await self._sync_from([m.address for m in ahead if rounds[m.peer_id] == newest], why)
                except StateSyncError as exc:
                    # Every donor we asked failed (the only one of the newest round died mid-transfer, say):
                    # read the members again, so the next pass asks the survivors.
                    log.warning("state sync failed (%s); looking for other donors", exc)
                    self.events.write("sync_failed", why=why, round_id=newest, error=str(exc))
                    await asyncio.sleep(0.5)
                    continue
                return True
            await asyncio.sleep(0.2)
        log.warning("no peer reached round %d in time; moving on from round %d", target_round, self.round_id)
        return self._advance_without_update("nobody reached the next round")

    async def _check_hashes(self, group: Any) -> bool:
        """Compare our theta hash for this round with every live member's: what each announced over the links
        when its round started (`DHTMatchmaker.announced_hashes`), and the member records of our group as a
        fallback (no DHT read here: it would put the DHT back on the round's path). Returns whether we resynced.

        Healing rule (every member computes the same from the same records): the hash held by the most members
        wins; between sides of equal size, the side holding the lowest peer id wins. Every member of a losing side
        fetches the winning side's state before it contributes, so after this round the group holds one theta.
        (A tie used to only log: two halves of a partition that each committed a round alone stayed forked for
        good, averaging the same updates into two different models.)"""
        from farloco.protocol.statesync import StateSyncError

        if self.round_id == 0:
            return False
        in_group = {m.peer_id for m in group.members}
        members = self.membership.core.live(_dht_now())
        live = {m.peer_id for m in members}
        claims: dict[str, str] = {}
        for m in members:
            if m.peer_id in in_group and m.round_id == self.round_id and m.outer_hash:
                claims[m.peer_id] = m.outer_hash
        # Every live member's announcement for this round, grouped with us or not (sent over the links when its
        # round started): a fork between members that never share a group is seen all the same.
        for peer_id, outer_hash in self.matchmaker.announced_hashes(self.round_id).items():
            if peer_id in live:
                claims[peer_id] = outer_hash
        claims[self.peer_id] = self.outer_hash
        holders: dict[str, set[str]] = {}
        for peer_id, outer_hash in claims.items():
            holders.setdefault(outer_hash, set()).add(peer_id)
        if len(holders) <= 1:
            return False
        self.counters.hash_mismatches += 1
        winner = min(holders, key=lambda h: (-len(holders[h]), min(holders[h])))
        summary = {h[:12]: sorted(ids) for h, ids in holders.items()}
        self.events.write(
            "hash_mismatch", round_id=self.round_id, ours=self.outer_hash, winner=winner, votes=summary
        )
        log.error("round %d: theta_outer hashes disagree within the group: %s", self.round_id, summary)
        if winner == self.outer_hash:
            return False
        log.warning(
            "round %d: taking the state of %s (healing rule: larger side, then lowest peer id)",
            self.round_id,
            sorted(holders[winner]),
        )
        by_id = {m.peer_id: m for m in members}
        donors = [by_id[p].address for p in sorted(holders[winner])]
        for attempt in range(3):  # a link that just healed may fail the first call (a connection that died)
            try:
                await self._sync_from(donors, "hash mismatch")
                return True
            except StateSyncError as exc:
                if attempt == 2:
                    raise
                log.warning("fetching the winning side's state failed (%s); trying again", exc)
                await asyncio.sleep(1.0)
        return True

    def _state_fault(self) -> Any:
        """Test-only, from FARLOCO_FAULTS 'die-serving-state@N': SIGKILL this node once it has served N bytes
        of state, i.e. a donor that dies in the middle of a joiner's transfer."""
        for fault in filter(None, os.environ.get("FARLOCO_FAULTS", "").split(",")):
            kind, _, at = fault.partition("@")
            if kind == "die-serving-state" and at.isdigit():

                def die(served: int, limit: int = int(at)) -> None:
                    if served >= limit:
                        log.warning("fault injected: dying after serving %d bytes of state", served)
                        os.kill(os.getpid(), signal.SIGKILL)

                return die
        return None

    def _inject_faults(self) -> None:
        """Test-only fault injection, from FARLOCO_FAULTS (e.g. 'corrupt-theta@2'): after committing the named
        round, nudge theta_outer so this node silently diverges and the hash check has to repair it."""
        for fault in filter(None, os.environ.get("FARLOCO_FAULTS", "").split(",")):
            kind, _, at = fault.partition("@")
            if kind == "corrupt-theta" and at.isdigit() and int(at) == self.round_id:
                self.theta[0] += 1e-3
                self.outer_hash = theta_hash(self.theta)
                self._snapshot = None
                log.warning("fault injected: theta_outer corrupted after round %d", self.round_id)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("farloco")
    except PackageNotFoundError:
        return "0+unknown"


def _dht_now() -> float:
    from hivemind.utils import get_dht_time

    return float(get_dht_time())
