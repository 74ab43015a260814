"""Chaos scenarios: a local swarm of real `farloco join` processes on 127.0.0.1, faults on purpose, and what
the swarm paid for each, measured from the nodes' own events and metrics.

A scenario is a swarm (peers, rounds, config overrides) and a timeline of faults. A fault is either in a node's
fault plan from its start (`FARLOCO_FAULTS`, node/faults/plan.py: crash, hang, drop, delay, corrupt, wrong at a
phase of a round; the node writes a `fault` event as it acts) or done to it from outside once the swarm reached
a round (SIGKILL, SIGSTOP/SIGCONT, `farloco leave`, a new `farloco join`). A node that a fault ended is started
again (same run directory: same identity, its checkpoints) when the fault says so.

Figures per fault, from the survivors' round events: detection (the fault to the first round committed
without the node), the degraded round (the longest gap between two commits after it), rejoin (the fault to the
first round with the node again), rounds aborted, rounds the node missed; per scenario: messages refused by reason
(the survivors' /metrics), the held-out loss against the healthy run's, memory growth. Invariants checked after
every scenario (`Outcome.broken`): no NaN, one outer hash per round among the nodes that committed it, no node
that no fault touched exited other than cleanly, memory bounded, no process left behind.

The scenarios are benchmarks/chaos_scenarios.py. Used by the chaos tests (the fast scenarios) and
benchmarks/chaos.py (all of them, RELIABILITY.md)."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farloco.node.tools.demo import (
    PeerProcess,
    demo_config,
    read_events,
    start_bootstrap,
    start_peer,
    stop_process,
)

# Rounds of H = 8 inner steps of the tiny preset: a few seconds each on 2 cores.
BASE_OVERRIDES = ("run.inner_steps=8", "node.eval_batches=2", "checkpoint.every_rounds=2")
MEMORY_GROWTH_LIMIT = 0.5  # a node's RSS may grow by at most half over a scenario (after its first round)


@dataclass(frozen=True)
class Fault:
    """One fault of a scenario's timeline, done to peer `peer` (an index)."""

    name: str
    peer: int
    at_round: int
    plan: str = ""  # a FARLOCO_FAULTS entry the peer starts with (acts by itself at its phase and round)
    signal: str = ""  # or done from outside once the swarm committed `at_round`: sigkill, hang=S, leave, join
    restart_after: float | None = None  # start the peer again this many seconds after it exited
    expected: str = ""
    checks: tuple[str, ...] = ()  # what must have happened (CHECKS), beside the invariants


@dataclass(frozen=True)
class Scenario:
    name: str
    setup: str
    faults: tuple[Fault, ...] = ()
    peers: int = 3
    rounds: int = 8
    overrides: tuple[str, ...] = ()
    late_peers: tuple[int, ...] = ()  # peers started only by a `join` fault
    timeout: float = 240.0
    diverges: bool = (
        False  # a control that breaks the swarm on purpose: every node ending with an error holds
    )
    # A namespace WAN (node/tools/netns.py, with its relay: partitions and silent stalls) instead of loopback:
    # every node a host of its own, the bootstrap one more; the value is each uplink's rate ("" = loopback).
    wan: str = ""
    sides: tuple[
        tuple[int, ...], ...
    ] = ()  # the peers of each side of a `partition` fault (the bootstrap: side 0)


@dataclass
class FaultFigures:
    name: str
    at: float | None = None  # wall time the fault happened (its event, or when we did it)
    detection_s: float | None = None
    degraded_round_s: float | None = None
    rejoin_s: float | None = None
    rounds_aborted: int = 0
    rounds_missed: int = 0


@dataclass
class Outcome:
    scenario: str
    faults: list[FaultFigures] = field(default_factory=list)
    rounds: int = 0  # rounds committed by the swarm (distinct round ids)
    round_period_s: float | None = None  # median gap between commits of the first peer
    round_gaps_s: dict[str, float] = field(default_factory=dict)  # p50, p90, p99, max of those gaps
    final_loss: float | None = None
    rejected: dict[str, float] = field(default_factory=dict)
    probes: dict[str, dict[str, str]] = field(default_factory=dict)  # probe fault -> request -> what it got
    not_done: dict[str, str] = field(default_factory=dict)  # outside fault -> why it could not be done
    # node -> its checkpoints directory as listed when a process of it exited non-zero, then at the end
    checkpoints: dict[str, list[list[str]]] = field(default_factory=dict)
    # DHT records the survivors did not believe, by reason
    ignored: dict[str, float] = field(default_factory=dict)
    # per partition: the sides, rounds each committed apart, who fetched whose state after, when they met again
    splits: list[dict[str, Any]] = field(default_factory=list)
    forged_peers: list[str] = field(default_factory=list)
    memory_growth: float = 0.0  # the largest relative RSS growth of a node over the run
    exit_codes: dict[str, list[int]] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)  # invariants that did not hold
    events: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    exchange_timeout_s: float = 60.0  # the swarm's timeouts.exchange_timeout (its data deadline is 60% of it)
    # Inner steps, in rounds' worth, over every node: trained in a round that closed (committed, or closed
    # without us while the swarm went on), and of those the ones that reached an outer update (run.late_work)
    steps_trained: float = 0.0
    steps_reached: float = 0.0

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k not in ("events", "faults")}
        data["faults"] = [f.__dict__ for f in self.faults]
        return data


def fixed_identity(index: int) -> bytes:
    """The libp2p identity (an RSA key, as hivemind makes them) of node `index`: made once with `cryptography`
    and kept in FARLOCO_CACHE (default ~/.cache/farloco)/chaos-identities/, so node `index` has the same peer id
    in every scenario and every run on this machine.

    A node's peer id fixes its place in the exchange: parts are owned, and each chunk's contributions summed, in
    sorted peer id order. With fresh identities every run sums the same contributions in another order, the
    float32 sums round apart and the runs' held-out losses differ by up to ~0.1, as much as the rows that compare
    theirs with the healthy run look for. With these, a row whose faults leave its rounds alone trains the same
    bits every run. For swarms on 127.0.0.1 and the runner's namespaces only."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2

    from farloco.node.fsutil import write_atomic

    cache = Path(os.environ.get("FARLOCO_CACHE", Path.home() / ".cache" / "farloco")) / "chaos-identities"
    path = cache / f"node-{index}.key"
    if path.exists():
        return path.read_bytes()
    der = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    key: bytes = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    cache.mkdir(parents=True, exist_ok=True)
    write_atomic(path, key)  # two runners starting at once: one key wins, both read it below
    return path.read_bytes()


class ChaosSwarm:
    """The processes of one scenario (started, restarted, stopped) and what we sample from them meanwhile."""

    def __init__(self, scenario: Scenario, work: Path) -> None:
        self.scenario = scenario
        self.work = work
        self.config = work / "swarm.toml"
        self.config.write_text(demo_config(scenario.rounds, [*BASE_OVERRIDES, *scenario.overrides]))
        self.wan: Any = None
        self.splits: list[tuple[float, float, tuple[tuple[int, ...], ...]]] = []  # (start, healed, sides)
        if scenario.wan:
            from farloco.node.tools.netns import NamespaceWAN, unavailable

            reason = unavailable()
            if reason is not None:
                raise RuntimeError(f"chaos scenario {scenario.name} needs a namespace WAN: {reason}")
            self.wan = NamespaceWAN(scenario.peers + 1, scenario.wan, relay=True).up()
            try:
                host = scenario.peers + 1
                self.bootstrap, self.maddr = start_bootstrap(
                    work, host=self.wan.address(host), prefix=self.wan.prefix_command(host)
                )
            except BaseException:
                self.wan.down()
                raise
        else:
            self.bootstrap, self.maddr = start_bootstrap(work)
        self.peers: dict[int, PeerProcess] = {}
        self.exits: dict[int, list[int]] = {}
        self.rss: dict[int, list[int]] = {}
        self.metrics: dict[int, dict[tuple[str, str], float]] = {}
        self.done_at: dict[str, float] = {}  # fault name -> when an outside fault was done
        self.first_round: dict[int, int] = {}  # round events a process must have logged before its RSS counts
        self.probes: dict[str, dict[str, str]] = {}  # probe fault -> what each probe got back
        self.not_done: dict[str, str] = {}  # outside fault -> why it could not be done
        # When every node was down at once: the swarm's history starts again from checkpoints there, and the
        # rounds committed after the newest checkpoint are trained again (to other hashes where timing differs).
        self.whole_swarm_down: list[float] = []
        self.checkpoints: dict[
            int, list[list[str]]
        ] = {}  # peer -> listings (at each non-zero exit, at the end)
        self.forged_peers: list[str] = []  # the peer ids of DHT nodes that wrote forged records

    def list_checkpoints(self, index: int) -> list[str]:
        from farloco.node.checkpoint import checkpoints_dir

        root = checkpoints_dir(self.work / f"p{index}")
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []

    def start(self, index: int, plan: str = "") -> None:
        identity = self.work / f"p{index}" / "identity.key"
        if not identity.exists():  # a restart keeps the identity its run directory has
            identity.parent.mkdir(parents=True, exist_ok=True)
            identity.write_bytes(fixed_identity(index))
            identity.chmod(0o400)
        env = {"FARLOCO_FAULTS": plan}
        where: dict[str, Any] = {}
        if self.wan is not None:
            where = {"host": self.wan.address(index + 1), "prefix": self.wan.prefix_command(index + 1)}
        # Node i asks for data slot i (the slots' race at start otherwise gave each run another permutation).
        slot = ("--set", f"node.data_slot={index}")
        self.peers[index] = start_peer(
            f"p{index}", self.work, self.config, self.maddr, 1, slot, env=env, **where
        )
        self.rss[index] = []  # a new process: its memory is measured from its own first round
        self.first_round[index] = len(self.rounds_of(index)) + 1

    def rounds_of(self, index: int) -> list[dict[str, Any]]:
        return [e for e in read_events(self.work / f"p{index}") if e["event"] == "round"]

    def committed(self) -> int:
        """The newest round every running peer has reached: committed, or taken over from the swarm (a restarted
        node that fetched the state of round r is at r without having committed the rounds before it; counting
        its commits only held a timeline's next fault back until the swarm had finished)."""
        running = [i for i, p in self.peers.items() if p.process.poll() is None]
        reached = ("round", "synced", "resumed", "joined")
        return min(
            (
                max(
                    (
                        int(e["round_id"])
                        for e in read_events(self.work / f"p{i}")
                        if e["event"] in reached and isinstance(e.get("round_id"), int)
                    ),
                    default=0,
                )
                for i in running
            ),
            default=0,
        )

    def sample(self) -> None:
        import psutil

        for index, peer in self.peers.items():
            if peer.process.poll() is not None:
                continue
            if len(self.rounds_of(index)) >= self.first_round[index]:  # started: ranks and DHT process up
                with contextlib.suppress(psutil.Error):
                    root = psutil.Process(peer.process.pid)
                    total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                    self.rss[index].append(total)
            prefix = self.wan.prefix_command(index + 1) if self.wan is not None else ()
            self.metrics[index] = {**self.metrics.get(index, {}), **_metrics(self.work / f"p{index}", prefix)}

    def stop(self) -> None:
        try:
            stop_process(*(p.process for p in self.peers.values()), self.bootstrap)
            for index, peer in self.peers.items():
                if peer.process.returncode is not None and index not in self.exits:
                    self.exits[index] = [peer.process.returncode]
        finally:
            if self.wan is not None:
                self.wan.down()


# Inside a namespace host (its control endpoint is on that host's loopback): the node's /metrics text.
_METRICS_IN_HOST = (
    "import json, sys, urllib.request; url = json.load(open(sys.argv[1]))['url']; "
    "print(urllib.request.urlopen(url + '/metrics', timeout=5).read().decode())"
)


def _metrics(run_dir: Path, prefix: Sequence[str] = ()) -> dict[tuple[str, str], float]:
    """{(metric, reason): value} of a running node's labelled counters (empty when it does not answer).
    `prefix`: the node runs in a namespace host (`NamespaceWAN.prefix_command`); read it from in there."""
    from farloco.node.daemon.control import CONTROL_FILE, ControlClient, ControlError

    try:
        if prefix:
            done = subprocess.run(
                [*prefix, sys.executable, "-c", _METRICS_IN_HOST, str(run_dir / CONTROL_FILE)],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            text = done.stdout
        else:
            url = ControlClient(run_dir).status()["metrics_url"]
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
    except (ControlError, OSError, KeyError, ValueError, subprocess.SubprocessError):
        return {}
    found = re.findall(r'^(farloco_\w+)\{reason="(\w+)"\} (\S+)$', text, flags=re.M)
    return {(name, reason): float(value) for name, reason, value in found}


PROBES = ("probe", "control-probe", "forge")  # outside faults that only send things: the node must not notice
PROBE_FLOOD = 300  # requests of the flood probe, sent 50 at a time


def probe(swarm: ChaosSwarm, run_dir: Path) -> dict[str, str]:
    """Bad requests at a running node's gRPC server, from an outsider (no run secret) and from an insider (the
    secret, replaying or malforming): what each got back (status code and the node's `farloco-reason`).

    Outsider: no token, a token made with a wrong secret, a flood of PROBE_FLOOD such calls. Insider: a replayed
    token, an inflated round id, a malformed frame, a frame whose header claims 1 MiB, a message over the gRPC
    cap (9 MiB), ready records speaking for another peer and for another round (sender mismatch). The node must
    refuse each with its reason and count it, and its rounds must not notice."""
    import asyncio

    import grpc

    from farloco.node.config import load_config, run_secret
    from farloco.node.daemon.control import ControlClient
    from farloco.protocol.auth import Authenticator
    from farloco.protocol.matchmaking import READY_METHOD, ReadyRecord
    from farloco.protocol.rpc import SERVICE, Frame, encode_frame

    status = ControlClient(run_dir).status()
    address, run_id = status["grpc_address"], f"{status['run_name']}:{status['run_hash']}"
    # The nodes' own secret (on loopback with none given: derived from the run hash, as each node derives it).
    secret = run_secret(load_config(run_dir / "config.toml"), status["run_hash"], environ=os.environ)
    insider = Authenticator(run_id, secret, "chaos-insider")
    outsider = Authenticator(run_id, b"not the run secret at all", "chaos-outsider")
    round_id = int(status["round_id"])
    good = encode_frame(Frame({"g": 5}))
    method = "ExchangeVote"

    async def call(channel: Any, request: bytes, metadata: Any, to: str = method) -> str:
        try:
            await channel.unary_unary(f"/{SERVICE}/{to}")(request, metadata=metadata, timeout=20)
        except grpc.aio.AioRpcError as error:
            reason = dict(error.trailing_metadata() or ()).get("farloco-reason", "")
            return f"{error.code().name} {reason}".strip()
        return "ACCEPTED"

    async def main() -> dict[str, str]:
        got: dict[str, str] = {}
        async with grpc.aio.insecure_channel(
            address, options=[("grpc.max_send_message_length", 16 << 20)]
        ) as channel:
            got["no token"] = await call(channel, good, ())
            got["wrong secret"] = await call(channel, good, outsider.metadata(method, round_id))
            token = insider.metadata(method, round_id)
            await call(channel, good, token)
            got["replayed token"] = await call(channel, good, token)
            got["inflated round id"] = await call(channel, good, insider.metadata(method, 1 << 40))
            got["malformed frame"] = await call(channel, b"\x01", insider.metadata(method, round_id))
            huge_header = (1 << 20).to_bytes(4, "little") + b"\x00" * 16
            got["header claims 1 MiB"] = await call(channel, huge_header, insider.metadata(method, round_id))
            got["9 MiB message"] = await call(
                channel, b"\x00" * (9 << 20), insider.metadata(method, round_id)
            )
            # An insider speaking for another member: a ready record of node 0's own peer id, then one of its own
            # id for another round than its token's.
            for what, peer, ready_round in (
                ("ready record of another peer", status["peer_id"], round_id),
                ("ready record of another round", "chaos-insider", round_id + 5),
            ):
                ready = ReadyRecord(peer, "127.0.0.1:9", ready_round, time.time()).to_wire()
                got[what] = await call(
                    channel,
                    encode_frame(Frame({"r": ready})),
                    insider.metadata(READY_METHOD, round_id),
                    READY_METHOD,
                )
            started = time.monotonic()
            answers: list[str] = []
            for _ in range(PROBE_FLOOD // 50):
                answers += await asyncio.gather(
                    *(call(channel, good, outsider.metadata(method, round_id)) for _ in range(50))
                )
            kinds = sorted(set(answers))
            got["flood"] = f"{len(answers)} in {time.monotonic() - started:.1f} s: {', '.join(kinds)}"
        return got

    return asyncio.run(main())


CONTROL_IDLE = 200  # idle connections the control probe opens before its real call


def probe_control(run_dir: Path) -> dict[str, str]:
    """Calls at a running node's control endpoint (`farloco status`/`leave`'s HTTP API) without its token or
    with malformed requests, an unknown path, CONTROL_IDLE connections that never send a request (then a real
    `status` call, timed), and a connection from this host's non-loopback address: what each got back. Every one
    must be refused and the node must neither leave nor notice."""
    import http.client
    import json
    import socket
    from urllib.parse import urlparse

    from farloco.node.daemon.control import CONTROL_FILE, TOKEN_FILE, ControlClient

    url = urlparse(json.loads((run_dir / CONTROL_FILE).read_text())["url"])
    host, port = url.hostname or "127.0.0.1", int(url.port or 80)
    token = (run_dir / TOKEN_FILE).read_text().strip()
    wrong = "0" * len(token)

    def call(method: str, path: str, headers: dict[str, str], body: bytes | None = None) -> str:
        connection = http.client.HTTPConnection(host, port, timeout=20)
        try:
            connection.putrequest(method, path)
            for key, value in headers.items():
                connection.putheader(key, value)
            if body is not None and "Content-Length" not in headers:
                connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body)
            response = connection.getresponse()
            text = response.read().decode(errors="replace")
            return f"{response.status} {text.strip()[:80]}"
        except OSError as exc:
            return f"no answer: {type(exc).__name__}"
        finally:
            connection.close()

    bearer = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    got = {
        "status, no token": call("GET", "/status", {}),
        "status, wrong token": call("GET", "/status", {"Authorization": f"Bearer {wrong}"}),
        "leave, no token": call("POST", "/leave", {}, b'{"mode": "now"}'),
        "leave, wrong token": call(
            "POST", "/leave", {"Authorization": f"Bearer {wrong}"}, b'{"mode": "now"}'
        ),
        "leave, bad mode": call("POST", "/leave", bearer, b'{"mode": "explode"}'),
        "leave, 1 MiB body": call("POST", "/leave", bearer, b" " * (1 << 20)),
        "leave, Content-Length -1": call("POST", "/leave", {**bearer, "Content-Length": "-1"}, b""),
        "leave, body not JSON": call("POST", "/leave", bearer, b"{mode: now"),
        "unknown path": call("GET", "/admin", bearer),
    }
    idle = []
    try:
        for _ in range(CONTROL_IDLE):
            with contextlib.suppress(OSError):
                idle.append(socket.create_connection((host, port), timeout=5))
        started = time.monotonic()
        try:
            ControlClient(run_dir, timeout=20).status()
            got[f"status with the token behind {CONTROL_IDLE} idle connections"] = (
                f"200 in {time.monotonic() - started:.2f} s"
            )
        except Exception as exc:  # what it got is the figure
            got[f"status with the token behind {CONTROL_IDLE} idle connections"] = f"FAILED: {exc}"
    finally:
        for connection in idle:
            connection.close()
    # From this host's own non-loopback address (what another machine would dial): nothing listens there.
    outside = _non_loopback_address()
    if outside is not None:
        try:
            socket.create_connection((outside, port), timeout=5).close()
            got[f"connect from {outside}"] = "CONNECTED"
        except OSError as exc:
            got[f"connect from {outside}"] = f"refused: {type(exc).__name__}"
    return got


def forge_records(swarm: ChaosSwarm, run_dir: Path) -> dict[str, str]:
    """A DHT node of our own joins the swarm's DHT (through its bootstrap) knowing the run's config but not its
    secret, and writes: a member record with a forged membership proof and ready records for the coming rounds
    under its own key (well-formed and signed: only farloco's checks can tell them from real ones), an unsigned
    member record, a real member's record rewritten under that member's key, a record of the wrong schema. What
    the DHT answered to each store (True: stored)."""
    import asyncio

    from hivemind.utils.crypto import RSAPrivateKey
    from hivemind.utils.timed_storage import get_dht_time

    from farloco.node.config import load_config, run_section
    from farloco.node.daemon.control import ControlClient
    from farloco.node.daemon.dhtnode import make_dht
    from farloco.protocol.matchmaking import ReadyRecord, round_key
    from farloco.protocol.membership import NO_SLOT, MemberRecord, make_record_validators, members_key

    status = ControlClient(run_dir).status()
    run_name, current = status["run_name"], int(status["round_id"])
    validators = make_record_validators(run_name, private_key=RSAPrivateKey())
    own_key: bytes = validators[0].local_public_key
    dht = make_dht(
        initial_peers=[swarm.maddr],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=validators,
        start=True,
    )
    peer_id = str(dht.peer_id)
    swarm.forged_peers.append(peer_id)
    key = members_key(run_name)

    def record(**changes: Any) -> dict[str, Any]:
        made = MemberRecord(
            peer_id=peer_id, address="127.0.0.1:9", state="training", round_id=current + 1, inner_step=0,
            slot=NO_SLOT, run_hash=status["run_hash"], run_config=run_section(load_config(run_dir / "config.toml")),
            outer_hash="", loss=0.0, heartbeat=get_dht_time(), maddrs=(), version="chaos", proof="0" * 64,
        )  # fmt: skip
        wire = made.to_wire()
        wire.update(changes)
        return wire

    async def store(what: str, dht_key: str, value: Any, subkey: bytes, tries: int) -> str:
        expiration = get_dht_time() + 120
        for attempt in range(tries):  # a store no replica answered in time says False too: try again
            if await dht.store(dht_key, value, expiration, subkey=subkey, return_future=True):
                return "stored"
            await asyncio.sleep(0.25 * 2**attempt)
        return f"refused ({tries} tries)"

    async def main() -> dict[str, str]:
        got = {"member record, forged proof": await store("proof", key, record(), own_key, 6)}
        for r in range(current + 1, current + 4):
            ready = ReadyRecord(peer_id, "127.0.0.1:9", r, get_dht_time()).to_wire()
            got[f"ready record, round {r}"] = await store("ready", round_key(run_name, r), ready, own_key, 6)
        got["member record, unsigned"] = await store("unsigned", key, record(), b"no-key", 2)
        got["member record, wrong schema"] = await store("schema", key, record(state="dreaming"), own_key, 2)
        found = await dht.get(key, latest=True, return_future=True)
        others = [sub for sub in (found.value if found is not None else {}) if sub != own_key]
        if others:
            got["a member's record rewritten under its key"] = await store(
                "theirs", key, record(state="leaving"), others[0], 2
            )
        else:
            got["a member's record rewritten under its key"] = "NOT TRIED: no member record found"
        return got

    try:
        return asyncio.run(main())
    finally:
        dht.shutdown()


def _non_loopback_address() -> str | None:
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(
            ("192.0.2.1", 9)
        )  # a documentation address: nothing is sent, the route picks our address
        address = str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def _do(swarm: ChaosSwarm, fault: Fault) -> None:
    """An outside fault, now."""
    peer = swarm.peers.get(fault.peer)
    kind, _, value = fault.signal.partition("=")
    swarm.done_at[fault.name] = time.time()
    if kind == "join":
        swarm.start(fault.peer)
    elif peer is None or peer.process.poll() is not None:
        return
    elif kind == "sigkill":
        os.killpg(peer.process.pid, signal.SIGKILL)
    elif kind == "hang":
        os.killpg(peer.process.pid, signal.SIGSTOP)
        time.sleep(float(value))
        os.killpg(peer.process.pid, signal.SIGCONT)
    elif kind == "partition":
        # The swarm split in sides (scenario.sides; the bootstrap with side 0) for `value` seconds: every packet
        # between sides dropped silently (no FIN, no RST), then the network heals.
        sides = [[i + 1 for i in side] for side in swarm.scenario.sides]
        sides[0].append(swarm.scenario.peers + 1)
        split_at = time.time()
        swarm.wan.partition(*sides)
        try:
            time.sleep(float(value))
        finally:
            swarm.wan.heal()
        swarm.splits.append((split_at, time.time(), swarm.scenario.sides))
    elif kind == "vanish":
        # The node's packets, both ways, silently dropped, then the node SIGKILLed: its FIN and RST never reach
        # anyone, so every connection to it is half-open; the network heals `value` seconds later.
        host = fault.peer + 1
        for other in range(1, swarm.scenario.peers + 2):
            if other != host:
                swarm.wan.stall(host, other)
                swarm.wan.stall(other, host)
        os.killpg(peer.process.pid, signal.SIGKILL)
        time.sleep(float(value))
        swarm.wan.heal()
    elif kind == "dht-stop":
        # The node's DHT process (its hivemind daemon) frozen: its stores and reads never answer, the others'
        # requests to it time out; the agent and its links live on.
        started = [e for e in read_events(peer.run_dir) if e["event"] == "started" and e.get("dht_pid")]
        if not started:
            del swarm.done_at[fault.name]
            swarm.not_done[fault.name] = "the node wrote no started event naming its DHT process"
            return
        dht_pid = int(started[-1]["dht_pid"])
        os.kill(dht_pid, signal.SIGSTOP)
        try:
            time.sleep(float(value))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(dht_pid, signal.SIGCONT)
    elif kind == "bootstrap-lost":
        # The swarm's only initial peer is gone for good; then the node dies and must find the swarm without it.
        swarm.bootstrap.kill()
        swarm.bootstrap.wait(10)
        time.sleep(1.0)
        os.killpg(peer.process.pid, signal.SIGKILL)
    elif kind == "probe":
        from farloco.node.daemon.control import ControlError

        try:
            swarm.probes[fault.name] = probe(swarm, peer.run_dir)
        except ControlError as exc:  # it stopped in between (its last round): nothing was probed
            swarm.probes[fault.name] = {"control": f"NOT PROBED: {exc}"}
    elif kind == "forge":
        swarm.probes[fault.name] = forge_records(swarm, peer.run_dir)
    elif kind == "control-probe":
        swarm.probes[fault.name] = probe_control(peer.run_dir)
    elif kind == "leave":
        done = subprocess.run(
            [sys.executable, "-m", "farloco.node.tools.cli", "leave", "--run-dir", str(peer.run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:  # not done: say so instead of measuring a fault that never happened
            del swarm.done_at[fault.name]
            swarm.not_done[fault.name] = (
                f"`farloco leave` exited {done.returncode}: {done.stderr.strip()[-300:]}"
            )
    else:
        raise ValueError(f"chaos: unknown outside fault {fault.signal!r}")


def run(scenario: Scenario, work: Path, *, progress: Callable[[str], None] | None = None) -> Outcome:
    """Run `scenario` in `work` (a fresh directory) to its last round; its figures and broken invariants."""
    work.mkdir(parents=True, exist_ok=True)
    swarm = ChaosSwarm(scenario, work)
    pending = [f for f in scenario.faults if f.signal]
    # peer -> the restart delay of the fault that ends it next (a plan fault from the start; an outside one once
    # done); a peer is restarted when it exits non-zero with one set, without blocking the loop meanwhile.
    restarts = {f.peer: f.restart_after for f in scenario.faults if f.plan and f.restart_after is not None}
    due: dict[int, float] = {}  # peer -> when to start it again
    exited_at: dict[int, float] = {}
    down = False
    started = time.monotonic()
    timed_out = ""
    try:
        for index in range(scenario.peers):
            if index not in scenario.late_peers:
                plans = [f.plan for f in scenario.faults if f.peer == index and f.plan]
                swarm.start(index, ",".join(plans))
        last_sample = 0.0
        while True:
            if time.monotonic() - started > scenario.timeout:
                # A row that did not hold, with the figures of what ran: not an error that loses the table.
                timed_out = (
                    f"not over in {scenario.timeout:.0f} s: the swarm committed {swarm.committed()} of "
                    f"{scenario.rounds} rounds, {len(pending)} faults not yet done"
                )
                break
            committed = swarm.committed()
            for fault in [f for f in pending if committed >= f.at_round]:
                pending.remove(fault)
                if progress:
                    progress(f"{scenario.name}: {fault.name} at round {committed}")
                if fault.restart_after is not None:
                    restarts[fault.peer] = fault.restart_after
                _do(swarm, fault)
                if fault.signal == "join":
                    exited_at.pop(fault.peer, None)  # a new process of that peer, watched afresh
            for index, peer in list(swarm.peers.items()):
                code = peer.process.poll()
                if code is None or index in exited_at:
                    continue
                exited_at[index] = time.monotonic()
                swarm.exits.setdefault(index, []).append(code)
                if code != 0:
                    swarm.checkpoints.setdefault(index, []).append(swarm.list_checkpoints(index))
                delay = restarts.pop(index, None)
                if delay is not None and code != 0:
                    due[index] = time.monotonic() + delay
            running = [p for p in swarm.peers.values() if p.process.poll() is None]
            if swarm.peers and not running and not down:
                swarm.whole_swarm_down.append(time.time())
            down = bool(swarm.peers) and not running
            for index, when in list(due.items()):
                if time.monotonic() >= when:
                    del due[index]
                    swarm.start(index)  # without its fault plan: the node comes back healthy
                    del exited_at[index]
            if all(p.process.poll() is not None for p in swarm.peers.values()) and not pending and not due:
                break
            if time.monotonic() - last_sample > 1.0:
                swarm.sample()
                last_sample = time.monotonic()
            time.sleep(0.2)
    finally:
        swarm.stop()
    for index in swarm.checkpoints:
        swarm.checkpoints[index].append(swarm.list_checkpoints(index))
    outcome = _outcome(scenario, swarm)
    if timed_out:
        outcome.broken.append(timed_out)
    return outcome


def steps_accounted(events: dict[str, list[dict[str, Any]]]) -> tuple[float, float]:
    """(trained, reached): inner steps, in rounds' worth, that the nodes trained in rounds that closed, and of
    those the ones that reached an outer update. A committed round's `weight` reached it, `merged_weight` of it
    trained in the round before (counted there); a round that went on without the node trained its `own`
    (late_work: kept for the next round, or dropped). Not counted: the steps of a node that crashed or left mid
    round, and of a round it sat out on its own weights (they stay in the ranks)."""
    trained = reached = 0.0
    for log in events.values():
        for e in log:
            if e["event"] == "round":
                weight, merged = float(e.get("weight", 1.0)), float(e.get("merged_weight", 0.0))
                trained += weight - merged
                reached += weight
            elif e["event"] == "late_work":
                trained += float(e.get("own", 0.0))
    return trained, reached


def _outcome(scenario: Scenario, swarm: ChaosSwarm) -> Outcome:
    events = {f"p{i}": read_events(swarm.work / f"p{i}") for i in range(scenario.peers)}
    ids: dict[str, str] = {}
    for name, log in events.items():
        ids.update((name, e["peer_id"]) for e in log if e["event"] == "started")
    outcome = Outcome(scenario.name, events=events)
    from farloco.node.config import load_config

    outcome.exchange_timeout_s = load_config(swarm.config).timeouts.exchange_timeout
    outcome.exit_codes = {f"p{i}": codes for i, codes in sorted(swarm.exits.items())}
    rounds = {name: [e for e in log if e["event"] == "round"] for name, log in events.items()}
    outcome.steps_trained, outcome.steps_reached = steps_accounted(events)
    # a probed node must not notice
    faulty = {f"p{f.peer}" for f in scenario.faults if f.signal not in PROBES}
    # Invariants.
    # One outer hash per round id within each life of the swarm (a whole-swarm restart begins a new one), and
    # while a partition keeps the swarm apart, within each side (from the split until its sides commit a round
    # together again: each side trains on, and after the heal one side takes the other's state).
    windows = _split_windows(swarm.splits, rounds, ids, outcome)
    hashes: dict[tuple[int, int, int], set[str]] = {}
    for name, log in rounds.items():
        evaluated = False
        for e in log:
            life = bisect.bisect(swarm.whole_swarm_down, e["time"])
            side = next(
                (w["side_of"].get(name, -1) for w in windows if w["start"] <= e["time"] < w["end"]), -1
            )
            hashes.setdefault((life, e["round_id"], side), set()).add(e["outer_hash"])
            train, held_out = e.get("train_loss"), e.get("eval_loss")
            if isinstance(train, float) and not math.isfinite(train):
                outcome.broken.append(f"{name} round {e['round_id']}: train loss {train}")
            # A held-out loss is NaN only before the node's first evaluation, never after, never infinite.
            if (
                isinstance(held_out, float)
                and not math.isfinite(held_out)
                and (evaluated or held_out == held_out)
            ):
                outcome.broken.append(f"{name} round {e['round_id']}: held-out loss {held_out}")
            evaluated = evaluated or (isinstance(held_out, float) and math.isfinite(held_out))
    outcome.broken += [
        f"round {r}: {len(h)} different outer hashes" for (_, r, _), h in sorted(hashes.items()) if len(h) > 1
    ]
    for name, codes in outcome.exit_codes.items():
        if name not in faulty and any(code != 0 for code in codes) and not scenario.diverges:
            outcome.broken.append(f"{name} (no fault) exited with {codes}")
    for samples in swarm.rss.values():
        if len(samples) >= 2:
            growth = (max(samples) - samples[0]) / samples[0]
            outcome.memory_growth = max(outcome.memory_growth, growth)
    if outcome.memory_growth > MEMORY_GROWTH_LIMIT:
        outcome.broken.append(f"a node's memory grew by {outcome.memory_growth:.0%}")
    left = _left_behind(swarm.work)
    if left:
        outcome.broken.append(f"processes left behind: {left}")
    if swarm.wan is not None:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        kept = [line.split()[0] for line in names.splitlines() if line.startswith(swarm.wan.prefix)]
        if kept:
            outcome.broken.append(f"namespaces left behind: {kept}")
    # Figures.
    outcome.rounds = len({r for _, r, _ in hashes})
    survivors = [n for n in rounds if n not in faulty] or list(rounds)
    reference = rounds[survivors[0]]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(reference[1:])]
    outcome.round_period_s = sorted(gaps)[len(gaps) // 2] if gaps else None
    if gaps:
        ordered = sorted(gaps)
        outcome.round_gaps_s = {
            f"p{round(100 * q)}": ordered[min(len(ordered) - 1, int(q * len(ordered)))]
            for q in (0.5, 0.9, 0.99)
        }
        outcome.round_gaps_s["max"] = ordered[-1]
    losses = [
        e["eval_loss"]
        for e in reference
        if isinstance(e.get("eval_loss"), float) and math.isfinite(e["eval_loss"])
    ]
    outcome.final_loss = losses[-1] if losses else None
    culprits = {f"p{f.peer}" for f in scenario.faults if f.plan}  # the senders of bad data themselves
    for index, counts in swarm.metrics.items():
        if f"p{index}" in culprits:
            continue
        for (metric, reason), value in counts.items():
            if metric == "farloco_rejected_messages_total" and value:
                outcome.rejected[reason] = outcome.rejected.get(reason, 0) + value
            if metric == "farloco_ignored_dht_records_total" and value:
                outcome.ignored[reason] = outcome.ignored.get(reason, 0) + value
    outcome.probes = dict(swarm.probes)
    outcome.not_done = dict(swarm.not_done)
    outcome.forged_peers = list(swarm.forged_peers)
    outcome.checkpoints = {f"p{i}": listings for i, listings in sorted(swarm.checkpoints.items())}
    for fault in scenario.faults:
        outcome.faults.append(_fault_figures(fault, events, rounds, survivors, ids, swarm.done_at))
    return outcome


def _split_windows(
    splits: list[tuple[float, float, tuple[tuple[int, ...], ...]]],
    rounds: dict[str, list[dict[str, Any]]],
    ids: dict[str, str],
    outcome: Outcome,
) -> list[dict[str, Any]]:
    """Per partition: from its start until the first round committed by members of more than one side after the
    heal (the sides met again), which side each node was on; and its figures in `outcome.splits` (the rounds
    each side committed apart, who took whose state after the heal, how long after the heal the sides met)."""
    windows = []
    for started, healed, sides in splits:
        side_of = {f"p{i}": n for n, side in enumerate(sides) for i in side}
        by_id = {ids[name]: n for name, n in side_of.items() if name in ids}
        together = [
            e["time"]
            for log in rounds.values()
            for e in log
            if e["time"] > healed and len({by_id[c] for c in e["contributors"] if c in by_id}) > 1
        ]
        end = min(together, default=math.inf)
        apart = [
            len({e["round_id"] for name in side_of if side_of[name] == n for e in rounds.get(name, [])
                 if started <= e["time"] < end})
            for n in range(len(sides))
        ]  # fmt: skip
        # who fetched another side's state once the network healed (the healing rule's losers, or the side behind)
        synced = sorted(
            name
            for name in side_of
            for e in outcome.events.get(name, [])
            if e["event"] == "synced"
            and healed - 1 <= e["time"] <= (end if end < math.inf else e["time"]) + 5
        )
        outcome.splits.append(
            {
                "sides": [[f"p{i}" for i in side] for side in sides],
                "rounds_apart": apart,
                "synced_after_heal": sorted(set(synced)),
                "met_again_after_heal_s": None if end == math.inf else end - healed,
                "partition_s": healed - started,
            }
        )
        if end == math.inf:
            outcome.broken.append(
                f"the sides {outcome.splits[-1]['sides']} never committed a round together again"
            )
        windows.append({"start": started, "end": end, "side_of": side_of})
    return windows


def _fault_figures(
    fault: Fault,
    events: dict[str, list[dict[str, Any]]],
    rounds: dict[str, list[dict[str, Any]]],
    survivors: list[str],
    ids: dict[str, str],
    done_at: dict[str, float],
) -> FaultFigures:
    name = f"p{fault.peer}"
    figures = FaultFigures(fault.name)
    if fault.plan:
        acted = [e for e in events[name] if e["event"] == "fault" and e.get("fault") in fault.plan.split(",")]
        figures.at = acted[0]["time"] if acted else None
    else:
        figures.at = done_at.get(fault.name)
    if figures.at is None or name not in ids:
        return figures
    at = figures.at
    peer_id = ids[name]
    seen = rounds[survivors[0]]
    after = [e for e in seen if e["time"] >= at]
    without = [e for e in after if peer_id not in e["contributors"]]
    if without:
        figures.detection_s = without[0]["time"] - at
    # Back: the first round after the fault that has the node again (after the first one without it, if any;
    # a node restarted within the others' straggler wait may be in the very next round: no round lost).
    since = without[0]["time"] if without else at
    back = [e for e in after if e["time"] > since and peer_id in e["contributors"]]
    if back:
        figures.rejoin_s = back[0]["time"] - at
    before = [e for e in seen if e["time"] < at]
    times = [before[-1]["time"] if before else at] + [e["time"] for e in after[:4]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    figures.degraded_round_s = max(gaps) if gaps else None
    window_end = (figures.rejoin_s or 60.0) + at
    figures.rounds_aborted = sum(
        1
        for survivor in survivors
        for e in events[survivor]
        if e["event"] == "aborted" and at <= e["time"] <= window_end
    ) // max(1, len(survivors))
    figures.rounds_missed = len(
        [e for e in after if e["time"] <= window_end and peer_id not in e["contributors"]]
    )
    return figures


def _left_behind(work: Path) -> list[str]:
    """Processes still running whose command line names this scenario's directory (a node, its ranks, its DHT)."""
    import psutil

    left = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(work) in part for part in process.info["cmdline"] or []):
                left.append(f"{process.pid} {' '.join(process.info['cmdline'])[:120]}")
    return left


NOT_WAITED_SECONDS = 10.0  # "the others never wait for it": no round after the fault took this long
LOSS_TOLERANCE = 0.15  # "as in the healthy run": the final held-out loss within this of the healthy one's


def verdict(scenario: Scenario, outcome: Outcome, healthy: Outcome | None = None) -> list[str]:
    """What did not hold: the invariants (`outcome.broken`), then each fault's `checks`."""
    problems = list(outcome.broken)
    for fault, figures in zip(scenario.faults, outcome.faults, strict=True):
        name = f"p{fault.peer}"
        for check in fault.checks:
            problem = _check(check, fault, figures, outcome, healthy, name)
            if problem:
                problems.append(f"{fault.name}: {problem}")
    return problems


def _check(
    check: str, fault: Fault, figures: FaultFigures, outcome: Outcome, healthy: Outcome | None, name: str
) -> str | None:
    if figures.at is None:
        why = outcome.not_done.get(fault.name, "no fault event, or the swarm never reached its round")
        return f"the fault never happened ({why})"
    if check == "fired":
        return None
    if check == "left_out":
        return None if figures.detection_s is not None else "no round went on without the node"
    if check == "back":
        return None if figures.rejoin_s is not None else "the node never contributed again"
    if check == "exit_0":
        codes = outcome.exit_codes.get(name, [])
        return None if codes and codes[0] == 0 else f"exit codes {codes}, expected 0"
    if check == "not_waited":
        # no round after it waited anything like the straggler wait (the demo's match_timeout is 20 s)
        slow = figures.degraded_round_s
        return None if slow is not None and slow < NOT_WAITED_SECONDS else f"the longest round took {slow} s"
    if check == "no_abort":
        return None if figures.rounds_aborted == 0 else f"{figures.rounds_aborted} rounds aborted"
    if check == "synced":
        synced = [e for e in outcome.events[name] if e["event"] == "synced"]
        return None if synced else "the node never synced the swarm's state"
    if check == "nothing_alone":
        alone = [
            e["round_id"]
            for survivor, log in outcome.events.items()
            if survivor != name
            for e in log
            if e["event"] == "round" and len(e["contributors"]) < 2
        ]
        return None if not alone else f"rounds committed alone: {alone}"
    if check == "stopped_loudly":
        quiet = [
            survivor
            for survivor, log in outcome.events.items()
            if survivor != name
            and not any(e["event"] == "failed" and "non-finite" in str(e.get("error")) for e in log)
        ]
        return None if not quiet else f"{quiet} did not stop naming the non-finite parameters"
    if check == "all_refused":
        got = outcome.probes.get(fault.name, {})
        taken = [what for what, answer in got.items() if "ACCEPTED" in answer]
        if (
            fault.signal == "control-probe"
        ):  # HTTP: only the real call behind the idle connections may succeed
            taken = [
                what
                for what, answer in got.items()
                if ("idle connections" in what) != answer.startswith("200") or answer == "CONNECTED"
            ]
        if not got or any("NOT PROBED" in answer for answer in got.values()):
            return f"nothing probed: {got}"
        return None if not taken else f"accepted: {taken}"
    if check == "never_left_out":
        return (
            None
            if figures.detection_s is None and figures.rounds_missed == 0
            else f"left out of {figures.rounds_missed} rounds"
        )
    if check == "fallback":
        used = [e for e in outcome.events[name] if e["event"] == "known_peers"]
        return None if used else "the node never dialled the peers it knew"
    if check == "forged_ignored":
        got = outcome.probes.get(fault.name, {})
        must_refuse = ("unsigned", "wrong schema", "rewritten under its key")
        stored = [
            what for what, answer in got.items() if any(m in what for m in must_refuse) and answer == "stored"
        ]
        if not got or stored:
            return f"the DHT took forged records: {stored or got}"
        believed = [
            (node, e["round_id"])
            for node, log in outcome.events.items()
            for e in log
            if e["event"] == "round" and set(outcome.forged_peers) & set(e.get("group", []))
        ]
        if believed:
            return f"a forged member was grouped with: {believed[:5]}"
        return (
            None
            if outcome.ignored.get("BAD_MEMBER_PROOF")
            else f"no node counted the forged proof: {outcome.ignored}"
        )
    if check in ("poison_refused", "strategy_poison_refused"):
        reason = "WRONG_STATE" if check == "poison_refused" else "BAD_STATE_VALUES"
        refused = [e for e in outcome.events[name] if e["event"] == "state_refused" and e["reason"] == reason]
        if not refused:
            return f"the joiner refused no state as {reason}"
        synced = [e for e in outcome.events[name] if e["event"] == "synced"]
        poisoned = {e["donor"] for e in refused}
        only_poisoned = [e for e in synced if set(e.get("donors", [])) <= poisoned]
        if not synced or only_poisoned:
            return f"synced only from refused donors: {only_poisoned or 'never synced'}"
        return None
    if check == "given_up_early":
        # found by its heartbeat in under half the exchange's data deadline (60% of timeouts.exchange_timeout)
        deadline = 0.6 * outcome.exchange_timeout_s
        found = figures.detection_s
        return None if found is not None and found < deadline / 2 else f"left out {found} s after the fault"
    if check == "one_state_after_heal":
        # Each side trains on apart (neither sees itself alone) or waits; after the heal one state, no fork: the
        # invariant above checks one hash per round within a side while apart and across the swarm after.
        if not outcome.splits:
            return "no partition happened"
        split = outcome.splits[-1]
        if split["met_again_after_heal_s"] is None:
            return "the sides never met again"
        if sum(1 for n in split["rounds_apart"] if n) > 1 and not split["synced_after_heal"]:
            return f"both sides committed apart ({split['rounds_apart']}) and nobody took the other's state"
        return None
    if check == "torn_cleaned":
        # The crash left the round's checkpoint durable under its temporary name, never renamed: the node came
        # back from an older one (or the swarm's state), and its next save removed the dead writer's directory.
        listings = outcome.checkpoints.get(name, [])
        torn = f"round-{fault.at_round:08d}.tmp-"
        at_crash = listings[0] if listings else []
        if not any(entry.startswith(torn) for entry in at_crash):
            return f"no {torn}* directory when the node died: {at_crash}"
        if f"round-{fault.at_round:08d}" in at_crash:
            return f"round {fault.at_round}'s checkpoint was renamed before the crash: {at_crash}"
        if any(".tmp-" in entry for entry in listings[-1]):
            return f"a temporary directory outlived the node's later saves: {listings[-1]}"
        loaded = [
            e
            for e in outcome.events[name]
            if e["event"] == "resumed" and f"round-{fault.at_round:08d}.tmp" in str(e.get("path", ""))
        ]
        return None if not loaded else f"resumed from the torn checkpoint: {loaded}"
    if check == "refused":
        return None if outcome.rejected else "no receiver refused anything"
    if check == "loss_as_healthy":
        if healthy is None or healthy.final_loss is None or outcome.final_loss is None:
            return None  # nothing to compare with (the healthy run was not part of this run)
        gap = outcome.final_loss - healthy.final_loss
        return (
            None
            if gap <= LOSS_TOLERANCE
            else f"final loss {outcome.final_loss:.3f}, healthy {healthy.final_loss:.3f}"
        )
    raise ValueError(f"chaos: unknown check {check!r}")
