"""The agent: the long-running daemon that `farloco join` starts, one per node.

It owns everything network-facing and the outer state:
- the hivemind DHT node (created first: it forks, and grpcio does not survive a fork taken after its threads
  started), the member record and its heartbeats;
- the gRPC server and clients (exchange, state transfer), on an asyncio loop in the main thread;
- the outer state (node/daemon/outer.py): the CPU master copy of theta_outer (kept in the hand-off's theta region where
  the ranks load it as is), the outer strategy (optimizer + error-feedback state), the
  round id;
- the trainer ranks, launched and supervised in a thread through torch's elastic launcher, fed through the
  shared-memory hand-off;
- the local control endpoint and the JSON-lines event log.

It never initialises CUDA. The round (node/daemon/rounds.py `_round`, its decisions in node/daemon/rules.py) is the
heart; see ARCHITECTURE.md for one round step by step. The agent is built in layers, one module per concern:

    core.py       AgentCore      the state, counters, metrics, the thread-safe status/peers/leave views
    ranks.py      RanksAgent     the trainer ranks under torch's elastic launcher and the hand-off
    snapshots.py  SnapshotAgent  the state donors serve, checkpoints with the ranks' inner state, resume
    swarm.py      SwarmAgent     member record, heartbeat, joining, isolation, catching up, fork healing
    rounds.py     RoundAgent     the round loops (sync, delayed/eager) and one round
    agent.py      Agent          the lifecycle (this module): start, serve, join, leave, shut down

each using only the layers below it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from typing import Any

from farloco.node.config import run_section
from farloco.node.daemon.control import ControlServer
from farloco.node.daemon.core import (
    DAEMON_STRATEGIES,
    AgentError,
    Counters,
    EventLog,
    Status,
    build_outer,
    ddp_bytes_per_round,
    log,
    overlap_steps,
)
from farloco.node.daemon.dhtnode import DHTStartError, make_dht, stop_dht, visible_maddrs
from farloco.node.daemon.outer import theta_hash
from farloco.node.daemon.rounds import RoundAgent
from farloco.protocol.tasks import cancel_and_wait, wait_for
from farloco.protocol.tasks import run as run_bounded
from farloco.protocol.tcpstream import tune_malloc

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


class Agent(RoundAgent):
    """One node of the swarm. `run()` blocks until the node has left; its return value is the exit code.

    The lifecycle is here (start the DHT and the servers, join, run the rounds, leave within a bound, shut down);
    the rest lives in the layers below (node/daemon/core.py names them)."""

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
            if self._outer_executor is not None:
                self._outer_executor.shutdown(wait=True)  # a commit under way is seen through
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
        if self.leave_mode is not None:
            self._leave_event.set()  # asked to leave while starting (farloco join's early handler)

        net = self.config.network
        identity = self.run_dir / "identity.key"

        # The members this node last saw live (known-peers.json) are dialled beside the initial peers: if the
        # bootstrap is gone (the swarm trains on without it), a restarted node still gets in through them. One
        # start with both lists, not a second start after the first failed: a DHT node forked again in this
        # process after a failed one hung until its start-up timeout in the chaos runner.
        known = (
            [m for m in self.known_peers.load() if m not in net.initial_peers] if net.initial_peers else []
        )
        self.dht = make_dht(
            host_maddrs=[f"/ip4/{net.host}/tcp/{net.dht_port}"],
            announce_maddrs=[f"/ip4/{net.announce_host}/tcp/{net.dht_port}"] if net.announce_host else None,
            initial_peers=[*net.initial_peers, *known],
            record_validators=make_record_validators(self.config.run.name),
            identity_path=str(identity),
            start=True,
        )
        if known:
            self.events.write("known_peers", initial_peers=list(net.initial_peers), known=known)
        if self.injector is not None:
            self.dht = self.injector.wrap_dht(
                self.dht
            )  # a real DHT that refuses or stops answering some calls
        try:
            await self._serve(DHTMembership)
        finally:
            log.info("shutting down the DHT node")
            stop_dht(self.dht)
            log.info("DHT node stopped")

    async def _serve(self, membership_cls: Any) -> None:
        from farloco.protocol.auth import Authenticator
        from farloco.protocol.exchange import PUSH_METHOD, Exchange
        from farloco.protocol.matchmaking import DHTMatchmaker
        from farloco.protocol.rpc import RpcClient, RpcServer
        from farloco.protocol.statesync import StateServer

        net, run = self.config.network, self.config.run
        self.peer_id = self.dht.peer_id.to_base58()
        self.multiaddrs = await asyncio.to_thread(visible_maddrs, self.dht)
        secret = self.run_secret
        auth = Authenticator(f"{run.name}:{self.run_hash}", secret, self.peer_id)
        from farloco.node.config import load_tls

        tls = load_tls(net)  # mutual TLS when [network] names a cert, key and CA (checked at config load)
        data_port = net.data_port if net.data_plane == "tcp" else None  # RpcServer ignores it under TLS
        buffers = net.socket_buffer_bytes
        self.server = RpcServer(
            auth, host=net.host, port=net.grpc_port, tls=tls, data_port=data_port, socket_buffer_bytes=buffers
        )
        self.client = RpcClient(auth, tls=tls, socket_buffer_bytes=buffers)
        pushes = self.client
        if self.injector is not None:
            pushes = self.injector.wrap_exchange_client(self.client, PUSH_METHOD)
        self.exchange = Exchange(
            self.server,
            pushes,
            self.peer_id,
            streams_per_peer=net.streams_per_peer,
            slices=run.island_slices,
            gone=self._member_gone,
            codec_threads=net.codec_threads,
        )
        if self.injector is not None:
            self.exchange = self.injector.wrap_exchange(self.exchange)
        if self.config.node.island:
            self.island = self._make_island()
        if self.injector is None:
            self.state_server = StateServer(self._state_snapshot)
        else:  # a donor that serves a poisoned state, or dies mid-transfer
            served = self.injector.wrap_served_state(self._state_snapshot)
            self.state_server = StateServer(served, on_served=self.injector.on_served())
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

    def _make_island(self) -> Any:
        """The node's side of its island (node/daemon/island.py), its thread started: it joins the island's
        rendezvous in the background while the node joins the swarm."""
        from farloco.node.daemon.island import Island

        node, run, timeouts, net = (
            self.config.node,
            self.config.run,
            self.config.timeouts,
            self.config.network,
        )
        if node.island_backend == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise AgentError(
                    "node.island_backend='nccl': expected a CUDA device on this node, found none"
                )
        island = Island(
            name=node.island,
            endpoint=node.island_endpoint,
            run_id=f"{run.name}-{self.run_hash[:16]}",
            # gloo binds to this address: the node's own, unless it listens on every interface.
            host=net.host if net.host not in ("0.0.0.0", "::") else net.announce_host,
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
        self.events.write("island", name=node.island, endpoint=node.island_endpoint)
        return island

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
        # The ranks (told STOP when the leave was asked for) get all that is left but what the servers' stop
        # needs: a rank's exit (torch's teardown) takes seconds on a loaded machine.
        self._stop_trainers(timeout=left() - 1.5)
        if self.island is not None:
            await asyncio.to_thread(self.island.close)
        await self.matchmaker.close()
        await self.client.close()
        await self.server.stop(grace=min(1.0, left()))
        self.exchange.close()
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
        handoff = getattr(self, "handoff", None)
        steps = (
            max((handoff.report(r).inner_step for r in range(handoff.world_size)), default=0)
            if handoff
            else 0
        )
        self.events.write("stopped", round_id=self.round_id, error=self.error, inner_step=steps)
        if getattr(self, "handoff", None) is not None:
            self.handoff.close()
