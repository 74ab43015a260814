"""The agent: the long-running daemon that `farloco join` starts, one per node.

It owns everything network-facing and the outer state, each part a collaborator it makes and hands what it
needs (node/daemon/core.py lists them):
- the node's facts (`NodeState`) and its outer state (`OuterState`: theta_outer, the strategy, the round id);
- the trainer ranks (`Ranks`), launched and supervised in a thread through torch's elastic launcher, fed through
  the shared-memory hand-off, and their checkpoints (`Checkpoints`);
- the network (`Network`: the hivemind DHT node, created first because it forks and grpcio does not survive a
  fork taken after its threads started; the gRPC server and client; the exchange; membership; matchmaking);
- the swarm side (`Swarm`: record, heartbeat, join, isolation, catch-up, healing) and the round runner
  (`RoundRunner`), made with the network;
- the local control endpoint, the status views it serves, and the JSON-lines event log.

It never initialises CUDA. A node whose fault plan (FARLOCO_FAULTS) is empty has no fault code in its path; one
with a plan gets the injector's wrappers (node/faults) in front of the collaborators the plan names.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from farloco.node.config import Config, ConfigError, run_section
from farloco.node.daemon.checkpoints import Checkpoints
from farloco.node.daemon.control import ControlServer
from farloco.node.daemon.core import (
    DAEMON_STRATEGIES,
    AgentError,
    Counters,
    EventLog,
    Network,
    NodeState,
    Status,
    agent_threads,
    build_outer,
    ddp_bytes_per_round,
    dht_now,
    log,
    overlap_steps,
)
from farloco.node.daemon.dhtnode import DHTStartError, make_dht, stop_dht, visible_maddrs
from farloco.node.daemon.knownpeers import KnownPeers
from farloco.node.daemon.outer import theta_hash
from farloco.node.daemon.outerstate import OuterState
from farloco.node.daemon.ranks import Ranks
from farloco.node.daemon.rounds import RoundRunner
from farloco.node.daemon.swarm import Swarm
from farloco.optim import ranges
from farloco.protocol.tcpstream import tune_malloc
from farloco.util import parallel
from farloco.util.addresses import (
    announced_host,
    bind_multiaddr,
    is_unspecified,
    join_host_port,
    split_host_port,
    tcp_multiaddr,
)
from farloco.util.tasks import cancel_and_wait, wait_for
from farloco.util.tasks import run as run_bounded

if TYPE_CHECKING:
    from farloco.node.daemon.island import Island
    from farloco.protocol.statesync import StateServer

__all__ = [
    "DAEMON_STRATEGIES",
    "Agent",
    "AgentError",
    "Counters",
    "EventLog",
    "Status",
    "build_outer",
    "ddp_bytes_per_round",
    "overlap_steps",
    "theta_hash",
]


@dataclass(frozen=True)
class Serving:
    """What exists only while the node serves, made at once after the DHT process forked (`Agent._serve`)."""

    net: Network
    swarm: Swarm
    rounds: RoundRunner
    state_server: StateServer
    control: ControlServer


class Agent:
    """One node of the swarm. `run()` blocks until the node has left; its return value is the exit code.

    Made before anything starts (a bad config fails here, before a port is bound or a process forked): the
    node's facts, its outer state, its ranks (not started) and checkpoints. `run()` starts the DHT, then makes the
    network, the swarm side and the round runner together (`Serving`), joins, runs the rounds, leaves within a
    bound and shuts down."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        # The agent's share of the cores (node.agent_threads: by default what the ranks leave). The round's large
        # passes (theta's digest, int8's kernels, the contribution, the outer step) are cut into contiguous
        # ranges over that many threads (util/parallel.py); on CPU its torch ops take no more, since the
        # trainer ranks own the other cores (oversubscribed torch threads were measured 20-100x slower here).
        threads = agent_threads(config)
        if config.node.device != "cuda":
            torch.set_num_threads(threads)
        parallel.set_threads(threads)
        ranges.set_range_runner(parallel.map_ranges)
        self.config = config
        self.state = NodeState(config, run_dir, self.metric_values)
        self.outer = OuterState(config, self.state.run_hash, self.state.injector)
        self.ranks = Ranks(self.state, self.outer)
        injector = self.state.injector
        self.checkpoints = Checkpoints(
            self.state, self.outer, self.ranks, durable=injector.durable if injector is not None else None
        )
        self.known_peers = KnownPeers(self.state.run_dir, self.state.run_hash)
        self.serving: Serving | None = None

    # -- the lifecycle ------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Blocking entry point (main thread)."""
        state = self.state
        tune_malloc()  # message-sized buffers stay in the heap: no page faults per received chunk
        # The hundreds of thousands of objects torch and hivemind create at import never die; leave them out of
        # every later collection (full collections walking them cost ~5% of a 64 MiB exchange's CPU).
        gc.freeze()
        try:
            # asyncio.run would wait without bound for a task that ignores cancellation; leaving is bounded.
            run_bounded(self._main(), cleanup_timeout=3.0)
        except (AgentError, DHTStartError, ConfigError) as exc:
            state.error = str(exc)
            state.status = Status.FAILED
            log.error("%s", exc)
            state.events.write("failed", error=str(exc))
        except Exception as exc:
            state.error = f"{type(exc).__name__}: {exc}"
            state.status = Status.FAILED
            log.exception("node failed")
            state.events.write("failed", error=state.error)
        finally:
            self.outer.close()
            state.events.close()
        return 0 if state.status is Status.STOPPED else 1

    @property
    def error(self) -> str | None:
        return self.state.error

    def request_leave(self, mode: str) -> None:
        """Thread-safe: ask the node to leave ('graceful', 'drain' or 'now'). A leaving node uses no more inner
        steps (the round in flight, if it ends in time, needs only what the ranks already handed off), so unless
        it drains the ranks stop now, after the step they are in: they get the whole leave to exit."""
        self.state.request_leave(mode, on_request=self.ranks.request_stop)

    def _on_signal(self) -> None:
        """SIGTERM / Ctrl+C: leave gracefully (after a drain: leave now-ish, gracefully); a second one while
        already leaving gracefully: leave at once."""
        self.request_leave("now" if self.state.leave_mode in ("graceful", "now") else "graceful")

    async def _main(self) -> None:
        state = self.state
        state.loop = asyncio.get_running_loop()
        state.leave_event = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            state.loop.add_signal_handler(sig, self._on_signal)
        if state.leave_mode is not None:
            state.leave_event.set()  # asked to leave while starting (farloco join's early handler)

        net = self.config.network
        # The members this node last saw live (known-peers.json) are dialled beside the initial peers: if the
        # bootstrap is gone (the swarm trains on without it), a restarted node still gets in through them. One
        # start with both lists: a DHT node forked a second time in one process, after a failed one, hangs until
        # its start-up timeout.
        known = (
            [m for m in self.known_peers.load() if m not in net.initial_peers] if net.initial_peers else []
        )
        from farloco.protocol.membership import make_record_validators

        dht = make_dht(
            host_maddrs=[bind_multiaddr(net.host, net.dht_port)],
            announce_maddrs=[tcp_multiaddr(net.announce_host, net.dht_port)] if net.announce_host else None,
            # Behind NAT nobody can dial our DHT node: it asks, it is never asked (hivemind's client mode).
            client_mode=net.reachability == "private",
            initial_peers=[*net.initial_peers, *known],
            record_validators=make_record_validators(self.config.run.name),
            identity_path=str(state.run_dir / "identity.key"),
            niceness=net.dht_niceness,
            start=True,
        )
        if known:
            state.events.write("known_peers", initial_peers=list(net.initial_peers), known=known)
        try:
            await self._serve(dht)
        finally:
            log.info("shutting down the DHT node")
            stop_dht(dht)
            log.info("DHT node stopped")

    async def _serve(self, dht: Any) -> None:
        # Imported here: protocol pulls in grpc, which must not start threads before the DHT forks.
        from farloco.node.config import transport_tls
        from farloco.protocol.auth import Authenticator
        from farloco.protocol.exchange import PUSH_METHOD, Exchange
        from farloco.protocol.matchmaking import DHTMatchmaker
        from farloco.protocol.membership import DHTMembership
        from farloco.protocol.rpc import RpcClient, RpcServer
        from farloco.protocol.statesync import StateServer
        from farloco.protocol.types import NO_INBOUND

        state, outer = self.state, self.outer
        net, run = self.config.network, self.config.run
        if net.reachability == "private":
            from farloco.optim import get_codec

            if not get_codec(run.codec, **run.codec_options).dense:
                raise AgentError(
                    f"network.reachability = 'private' needs a dense codec (its share goes to the members that "
                    f"own the parts): run.codec = {run.codec!r} sends every payload to every member"
                )
        injector = state.injector
        if injector is not None:
            dht = injector.wrap_dht(dht)  # a real DHT that refuses or stops answering some calls
        state.peer_id = dht.peer_id.to_base58()
        state.multiaddrs = await asyncio.to_thread(visible_maddrs, dht)
        run_id = f"{run.name}:{state.run_hash}"
        auth = Authenticator(run_id, state.run_secret, state.peer_id)
        # TLS 1.3 on gRPC and the data plane beyond loopback: the operator's certificates, else the run secret's.
        tls = transport_tls(self.config, state.run_secret, run_id, state.peer_id)
        data_port = net.data_port if net.data_plane == "tcp" else None
        buffers = net.socket_buffer_bytes
        server = RpcServer(
            auth, host=net.host, port=net.grpc_port, tls=tls, data_port=data_port, socket_buffer_bytes=buffers
        )
        client = RpcClient(auth, tls=tls, socket_buffer_bytes=buffers)
        membership: DHTMembership | None = None

        def gone(peer_id: str) -> bool:
            """Whether `peer_id` has no live member record in our view (no heartbeat for timeouts.member_ttl, or
            a departure): what lets an exchange give up a member frozen mid-exchange before its data deadline
            (protocol/exchange GONE_SILENCE_SECONDS, only with a strict majority of the group left, and only once
            it answers no ping). The member given up, thawed, holds the theta of before the round; the next
            round's hash check, decided on the group record's hashes, makes it take the others' state."""
            return membership is not None and peer_id not in {
                m.peer_id for m in membership.core.live(dht_now())
            }

        exchange: Any = Exchange(
            server,
            injector.wrap_exchange_client(client, PUSH_METHOD) if injector is not None else client,
            state.peer_id,
            streams_per_peer=net.streams_per_peer,
            slices=run.island_slices,
            gone=gone,
            codec_threads=net.codec_threads,
        )
        if injector is not None:
            exchange = injector.wrap_exchange(exchange)
        if run.exchange_group_size:
            from farloco.protocol.exchange.grouped import GroupedExchange

            exchange = GroupedExchange(exchange, server, client, state.peer_id, run.exchange_group_size)
        island = self._make_island() if self.config.node.island else None
        if injector is None:
            state_server = StateServer(outer.snapshot)
        else:  # a donor that serves a poisoned state, or dies mid-transfer
            state_server = StateServer(
                injector.wrap_served_state(outer.snapshot), on_served=injector.on_served()
            )
        state_server.register(server)
        bound = await server.start()
        if net.reachability == "private":
            state.grpc_address = NO_INBOUND  # nobody dials us: we call them (protocol/types.py)
        else:  # what the others dial: announce_host, the bound host, or (bound to every interface) one of ours
            try:
                host = announced_host(net.host, net.announce_host, state.multiaddrs)
            except ValueError as exc:
                raise AgentError(str(exc)) from None
            state.grpc_address = join_host_port(host, split_host_port(bound)[1])
        membership = DHTMembership(
            dht,
            run.name,
            state.run_hash,
            run_section(self.config),
            ttl=self.config.timeouts.member_ttl,
            heartbeat_interval=self.config.timeouts.heartbeat,
            auth=auth,  # binds our peer id to our DHT key; records of keys without the run secret are ignored
            retry_seconds=self.config.timeouts.dht_retry,
            # heartbeats go straight to the members key's replicas, found again once per member_ttl
            replan_every=self.config.timeouts.member_ttl,
        )
        # Ready and group messages travel over the members' gRPC links; the DHT is the fallback.
        matchmaker = DHTMatchmaker(dht, run.name, membership, server=server, client=client)
        network = Network(dht, server, client, exchange, membership, matchmaker, island)
        swarm = Swarm(state, outer, self.ranks, self.checkpoints, network, self.known_peers)
        rounds = RoundRunner(
            state,
            outer,
            self.ranks,
            self.checkpoints,
            swarm,
            network,
            phase_hook=injector.phase if injector is not None else None,
        )
        control = ControlServer(
            state.run_dir,
            net.control_host,
            net.control_port,
            status=self.status_dict,
            peers=self.peers_list,
            leave=self.request_leave,
            metrics=state.metrics.text,
            ready=lambda: state.status in (Status.TRAINING, Status.EXCHANGING),
        )
        self.serving = Serving(network, swarm, rounds, state_server, control)
        control.start()
        (state.run_dir / "agent.pid").write_text(str(os.getpid()))
        state.events.write(
            "started",
            peer_id=state.peer_id,
            pid=os.getpid(),
            dht_pid=getattr(dht, "pid", None),  # the DHT child process (what chaos tests stall)
            multiaddrs=state.multiaddrs,
            grpc=state.grpc_address,
            run_hash=state.run_hash,
            num_params=outer.num_params,
        )
        print(f"farloco node {state.peer_id} listening", flush=True)
        for maddr in state.multiaddrs:
            print(f"multiaddr {maddr}", flush=True)
        work = asyncio.create_task(self._work(self.serving), name="farloco-node")
        try:
            await self._until_left(work)
            state.status = Status.STOPPED
        finally:
            await self._shut_down(self.serving)

    def _make_island(self) -> Island:
        """The node's side of its island (node/daemon/island.py), its thread started: it joins the island's
        rendezvous in the background while the node joins the swarm."""
        from farloco.node.daemon.island import Island

        node, run, timeouts, net = (
            self.config.node,
            self.config.run,
            self.config.timeouts,
            self.config.network,
        )
        if node.island_backend == "nccl" and not torch.cuda.is_available():
            raise AgentError("node.island_backend='nccl': expected a CUDA device on this node, found none")
        island = Island(
            name=node.island,
            endpoint=node.island_endpoint,
            run_id=f"{run.name}-{self.state.run_hash[:16]}",
            # gloo binds to this address: the node's own, unless it listens on every interface.
            host=net.host if not is_unspecified(net.host) else net.announce_host,
            max_nodes=node.island_size or run.island_slices,
            slices=run.island_slices,
            wait=timeouts.leader_timeout,
            # Also how long building the group may wait for a node of the rendezvous. A collective starts only once
            # every node agreed to the round (or, for the gather, finished the same exchange), so it waits for the
            # fabric, not for a straggler: a node that dies meanwhile is known at once (its connections reset).
            collective_timeout=min(60.0, timeouts.exchange_timeout),
            backend=node.island_backend,
            device="cuda:0" if node.island_backend == "nccl" else "cpu",
        )
        island.start()
        self.state.events.write("island", name=node.island, endpoint=node.island_endpoint)
        return island

    async def _work(self, serving: Serving) -> None:
        """What the node does until it leaves: join, start the ranks, run rounds."""
        await serving.swarm.join()  # starts the trainer ranks and the heartbeat once our data slot is known
        self.checkpoints.request_inner_load()
        steps = None
        if self.config.node.log_every_steps:
            steps = asyncio.create_task(self.ranks.watch_intervals(), name="farloco-steps")
        try:
            await serving.rounds.run()
        finally:
            if steps is not None:
                await cancel_and_wait(steps)

    def _leave_grace(self) -> float:
        """Seconds, from the leave request, that the node's own work may take to wind down by itself."""
        if self.state.leave_mode == "now":
            return 2.0  # the round loop abandons its exchange itself and writes what it withdrew from
        if self.state.status in (Status.STARTING, Status.SYNCING):
            return 0.0  # joining or fetching state: nothing to finish
        return self.config.timeouts.leave_timeout / 2  # finish the round in flight if it ends in time

    async def _until_left(self, work: asyncio.Task[None]) -> None:
        """Wait for `work` to end. Once a leave (not a drain) is asked for, it gets `_leave_grace()` seconds
        to end by itself, then it is cancelled, so leaving takes at most timeouts.leave_timeout."""
        assert self.state.leave_event is not None
        while not work.done():
            waiter = asyncio.ensure_future(self.state.leave_event.wait())
            try:
                await asyncio.wait({work, waiter}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(waiter)
            if work.done() or self.state.leave_requested_at is None:
                continue
            if time.monotonic() - self.state.leave_requested_at >= self._leave_grace():
                log.warning(
                    "leaving now: %s did not wind down within %.1f s of the leave request",
                    self.state.status.value,
                    self._leave_grace(),
                )
                self.state.events.write(
                    "withdrew", round_id=self.outer.round_id, state=self.state.status.value, bounded=True
                )
                await cancel_and_wait(work, timeout=3.0)
                return
        work.result()  # the node's own error, if it failed

    async def _shut_down(self, serving: Serving) -> None:
        """Deregister, stop the ranks and the servers; each step bounded, all within timeouts.leave_timeout of
        the leave request (or of now, when the node stops for another reason)."""
        from farloco.protocol.membership import MembershipError

        state, net, swarm = self.state, serving.net, serving.swarm
        timeouts = self.config.timeouts
        start = state.leave_requested_at if state.leave_requested_at is not None else time.monotonic()
        # What is left after this method: stopping the DHT process (hivemind allows it 3 s) and the exit.
        reserve = min(4.0, timeouts.leave_timeout / 4)
        end = max(start + timeouts.leave_timeout - reserve, time.monotonic() + 3.0)

        def left(share: float = 1.0) -> float:
            return max(0.2, (end - time.monotonic()) * share)

        state.status = Status.LEAVING if state.status is not Status.FAILED else state.status
        self.ranks.request_stop()  # the ranks wind down while we deregister; `Ranks.stop` waits for them
        await cancel_and_wait(swarm.heartbeat_task, timeout=1.0)
        await cancel_and_wait(swarm.record_task, timeout=1.0)
        await cancel_and_wait(self.checkpoints.inner_load_task, timeout=1.0)
        try:
            bound = left(0.4)
            await swarm.while_dht_daemon_lives(
                wait_for(net.membership.remove(retry_seconds=min(timeouts.dht_retry, bound)), bound)
            )
        except (MembershipError, TimeoutError) as exc:
            log.warning(
                "could not store our departure on the DHT (%s); the others drop us once our record expires "
                "(member_ttl=%.0f s)",
                exc,
                timeouts.member_ttl,
            )
        # The ranks (told STOP when the leave was asked for) get all that is left but what the servers' stop
        # needs: a rank's exit (torch's teardown) takes seconds on a loaded machine.
        self.ranks.stop(timeout=left() - 1.5)
        if net.island is not None:
            await asyncio.to_thread(net.island.close)
        await net.matchmaker.close()
        await net.client.close()
        await net.server.stop(grace=min(1.0, left()))
        net.exchange.close()
        serving.control.stop()
        # A checkpoint still being written gets what is left.
        await self.checkpoints.finish(timeout=left())
        if state.status is not Status.FAILED:
            state.status = Status.STOPPED
        steps = max((r.inner_step for r in self.ranks.reports()), default=0)
        state.events.write("stopped", round_id=self.outer.round_id, error=state.error, inner_step=steps)
        self.ranks.close()

    # -- the views the control server serves (from its thread) ----------------------------------------------

    def status_dict(self) -> dict[str, Any]:
        state, outer, counters = self.state, self.outer, self.state.counters
        serving = self.serving
        with state.lock:
            reports = self.ranks.reports()
            inner_step = max((r.inner_step for r in reports), default=0)
            step_seconds = max((r.step_seconds for r in reports), default=0.0)
            raw = counters.raw_bytes
            island = serving.net.island if serving is not None else None
            return {
                "peer_id": state.peer_id,
                "state": state.status.value,
                "round_id": outer.round_id,
                "inner_step": inner_step,
                "loss": state.train_loss,
                "eval_loss": state.eval_loss,
                "inner_lr": state.inner_lr,
                "outer_lr": self.outer.outer_lr,
                "num_peers": len(state.peers_view),
                "outer_hash": outer.outer_hash,
                "bytes_sent": counters.bytes_sent,
                "bytes_received": counters.bytes_received,
                "ddp_bytes": counters.ddp_bytes,
                "compression_ratio": (raw / counters.bytes_sent) if counters.bytes_sent else None,
                "multiaddrs": state.multiaddrs,
                "grpc_address": state.grpc_address,
                "slot": state.slot,
                "run_name": self.config.run.name,
                "run_hash": state.run_hash,
                "strategy": self.config.run.strategy,
                "codec": self.config.run.codec,
                "num_params": outer.num_params,
                "num_ranks": self.config.node.num_ranks,
                "rounds_committed": counters.rounds_committed,
                "partial_contributions": counters.partial_contributions,
                # Of the last 100 rounds this node closed, the fraction it contributed to.
                "group_share": state.shares.share(state.peer_id) if state.peer_id else None,
                "left_out": dict(state.shares.left_out),
                "peers_left_out": dict(state.shares.peers_left_out),
                "rounds_aborted": counters.rounds_aborted,
                "rounds_late": counters.rounds_late,
                "hash_mismatches": counters.hash_mismatches,
                "trainer_pids": [r.pid for r in reports],
                "trainer_restarts": self.ranks.failures.restarts,
                "trainer_last_exit": self.ranks.failures.last_exit,
                "inner_step_seconds": step_seconds if step_seconds > 0 else None,
                "tokens_per_second": self.ranks.tokens_per_second(),
                "isolated": state.isolation.verdict == "isolated",
                "isolated_seconds": state.isolation.isolated_for(dht_now()),
                "vanished_peers": list(state.isolation.vanished),
                "sync": state.sync_progress.snapshot() if state.sync_progress is not None else None,
                "leave_mode": state.leave_mode,
                "last_round_seconds": counters.last_round_seconds,
                # The straggler wait we proposed last round (adaptive, protocol/matchmaking/rules.py StragglerWait).
                "match_wait_seconds": (serving.net.matchmaker.last_wait or None)
                if serving is not None
                else None,
                "island": island.view() if island is not None else None,
                "error": state.error,
                "last_checkpoint": self.checkpoints.last,
                "metrics_url": (serving.control.url + "/metrics") if serving is not None else None,
                "pid": os.getpid(),
                "uptime_seconds": time.time() - state.started_at,
            }

    def peers_list(self) -> list[dict[str, Any]]:
        with self.state.lock:
            return list(self.state.peers_view)

    def metric_values(self) -> dict[str, Any]:
        """What `/metrics` shows at scrape time (node/daemon/metrics.py): the status, plus the counters kept by the
        transport (refused RPCs by reason), the membership (DHT records not believed) and the isolation watch."""
        state, serving = self.state, self.serving
        values = self.status_dict()
        sync = values.get("sync")
        if sync is not None:
            values["sync_bytes_done"], values["sync_bytes_total"] = sync["bytes_done"], sync["bytes_total"]
        values["isolated"] = int(bool(values.get("isolated")))
        values["isolations"] = state.isolation.episodes
        values["ranks_idle_seconds"] = state.counters.ranks_idle_seconds
        values["trainer_last_exit_code"] = self.ranks.failures.last_exit_code
        values["rejected"] = dict(serving.net.server.rejections) if serving is not None else {}
        for reason, count in state.refused_states.items():  # states refused from donors
            values["rejected"][reason] = values["rejected"].get(reason, 0) + count
        values["ignored"] = dict(serving.net.membership.core.ignored) if serving is not None else {}
        values["swarm"] = self.peers_list()
        values["last_contributors"] = (
            state.counters.last_contributors if state.counters.rounds_committed else None
        )
        return values
