"""Security of running agents: mutual TLS, per-call tokens, bad input and forged DHT records, end to end.

Real `farloco join` daemons (agent + trainer ranks) on 127.0.0.1 behind mutual TLS, with certificates made here.
The attackers run in the test process with real protocol objects: a raw gRPC client (wrong secret, replayed
token, malformed and oversized frames), a hivemind DHT node with its own signing key but no run secret
(forged member / ready / group records), and an insider that holds the secret and a certificate but sends NaN,
wrong-shape and stale-round data in a real round. Every refusal must carry its stable reason, show in the
agent's /metrics, and the round must go on without the bad contribution.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from farloco.node.config import ConfigError, build_config, load_config, load_tls, run_hash, run_section
from farloco.node.daemon.control import ControlClient, ControlError
from farloco.node.daemon.dhtnode import make_dht
from farloco.node.tools.demo import (
    PeerProcess,
    demo_config,
    read_events,
    start_bootstrap,
    start_peer,
    stop_process,
)
from farloco.protocol.auth import Authenticator
from farloco.protocol.rpc import SERVICE, Frame, RpcClient, RpcError, TlsConfig, encode_frame

SECRET = "agent-security-test-secret"
RUN_NAME = "farloco-demo"  # demo_config's run name

# --------------------------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path

    def args(self) -> tuple[str, ...]:
        return (
            "--set", f"network.tls_cert={self.cert}",
            "--set", f"network.tls_key={self.key}",
            "--set", f"network.tls_ca={self.ca}",
        )  # fmt: skip

    def config(self) -> TlsConfig:
        return TlsConfig(self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


def make_authority(common_name: str) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    )
    return Authority(key, _validity(builder).sign(key, hashes.SHA256()))


def issue(authority: Authority, common_name: str, directory: Path) -> TlsFiles:
    """A peer certificate (server and client use, valid for 127.0.0.1) signed by `authority`, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(authority.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
    )
    cert = _validity(builder).sign(authority.key, hashes.SHA256())
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "cert.pem", directory / "key.pem", directory / "ca.pem")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    files.ca.write_bytes(authority.cert.public_bytes(serialization.Encoding.PEM))
    return files


# --------------------------------------------------------------------------------------------- config


def test_tls_config_needs_all_three_readable_pem_files_and_a_matching_key(tmp_path: Path) -> None:
    authority = make_authority("test CA")
    good = issue(authority, "peer", tmp_path / "good")
    other = issue(authority, "other", tmp_path / "other")

    def network(**values: str) -> Any:
        return build_config({"network": values}).network

    assert load_tls(network()) is None
    tls = load_tls(network(tls_cert=str(good.cert), tls_key=str(good.key), tls_ca=str(good.ca)))
    assert isinstance(tls, TlsConfig) and tls.private_key == good.key.read_bytes() and tls.server_name is None
    with pytest.raises(
        ConfigError, match=r"together: got \['tls_cert'\], missing \['network.tls_key', 'network.tls_ca'\]"
    ):
        network(tls_cert=str(good.cert))
    with pytest.raises(ConfigError, match=r"network\.tls_ca: expected a readable PEM file"):
        network(tls_cert=str(good.cert), tls_key=str(good.key), tls_ca=str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="expected PEM certificates"):
        network(tls_cert=str(tmp_path / "junk.pem"), tls_key=str(good.key), tls_ca=str(good.ca))
    with pytest.raises(ConfigError, match=r"network\.tls_key: expected an unencrypted PEM private key"):
        network(tls_cert=str(good.cert), tls_key=str(good.cert), tls_ca=str(good.ca))
    with pytest.raises(ConfigError, match="does not belong to the first certificate"):
        network(tls_cert=str(good.cert), tls_key=str(other.key), tls_ca=str(good.ca))
    with pytest.raises(ConfigError, match="tls_server_name: only meaningful"):
        network(tls_server_name="farloco")


# --------------------------------------------------------------------------------------------- the swarm


@dataclass
class Agent:
    peer: PeerProcess
    status: dict[str, Any]

    @property
    def peer_id(self) -> str:
        return str(self.status["peer_id"])

    @property
    def address(self) -> str:
        return str(self.status["grpc_address"])

    def rounds(self) -> list[dict[str, Any]]:
        return [e for e in read_events(self.peer.run_dir) if e["event"] == "round"]

    def metrics(self) -> dict[tuple[str, str], float]:
        """{(metric, reason): value} of the labelled counters in the agent's /metrics."""
        with urllib.request.urlopen(self.status["metrics_url"], timeout=10) as response:
            text = response.read().decode()
        found = re.findall(r'^(farloco_\w+)\{reason="(\w+)"\} (\S+)$', text, flags=re.M)
        return {(name, reason): float(value) for name, reason, value in found}

    def rejected(self, reason: str) -> float:
        return self.metrics().get(("farloco_rejected_messages_total", reason), 0.0)


@dataclass
class DhtNode:
    """A hivemind DHT node in the test process, on the swarm's DHT, with its own RSA signing key."""

    dht: Any
    public_key: bytes

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)


def _dht_node(maddr: str) -> DhtNode:
    from hivemind.utils.crypto import RSAPrivateKey

    from farloco.protocol.membership import make_record_validators

    # Its own key (not hivemind's process-wide one), and the run's validators so what it stores is well-formed:
    # only farloco's own checks can tell these records apart from real ones.
    validators = make_record_validators(RUN_NAME, private_key=RSAPrivateKey())
    dht = make_dht(
        initial_peers=[maddr],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=validators,
        start=True,
    )
    return DhtNode(dht, validators[0].local_public_key)  # type: ignore[attr-defined]


@dataclass
class Swarm:
    root: Path
    config_path: Path
    maddr: str
    authority: Authority
    agents: list[Agent]
    bootstrap: Any
    foreign: DhtNode  # a DHT node with its own key and no run secret
    insider: DhtNode  # a DHT node whose owner holds the run secret and a certificate of the run's CA

    @property
    def run_id(self) -> str:
        return f"{RUN_NAME}:{run_hash(load_config(self.config_path))}"

    def client_tls(self, name: str) -> TlsFiles:
        return issue(self.authority, name, self.root / f"tls-{name}")

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for agent in self.agents:
                if agent.peer.process.poll() is not None:
                    log = agent.peer.log_path.read_text(errors="replace")[-3000:]
                    pytest.fail(f"{agent.peer.name} exited while waiting for {what}:\n{log}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.3)

    def current_round(self) -> int:
        return max(int(ControlClient(a.peer.run_dir).status()["round_id"]) for a in self.agents)

    def rounds_together(self, after: int) -> list[dict[str, Any]]:
        """Round events after `after` whose contributors are exactly the agents, and that every agent has logged
        (each agent writes its own round event when it commits: one may trail the other by a moment)."""
        ids = sorted(a.peer_id for a in self.agents)
        logged = [{e["round_id"] for e in a.rounds()} for a in self.agents[1:]]
        return [
            e
            for e in self.agents[0].rounds()
            if e["round_id"] > after and e["contributors"] == ids and all(e["round_id"] in r for r in logged)
        ]


def _status(peer: PeerProcess) -> dict[str, Any]:
    try:
        return ControlClient(peer.run_dir).status()
    except (ControlError, OSError):
        return {}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    """A bootstrap node and two agents with mutual TLS and a known run secret, stopped at the end."""
    root = tmp_path_factory.mktemp("secure-swarm")
    authority = make_authority("farloco test CA")
    config_path = root / "swarm.toml"
    # Short rounds and no held-out evaluation: these tests are about what the agents refuse, not training.
    config_path.write_text(demo_config(0, ["run.inner_steps=4", "node.eval_batches=0"]))
    bootstrap, maddr = start_bootstrap(root)
    peers: list[PeerProcess] = []
    nodes: list[DhtNode] = []
    try:
        # hivemind's DHT forks: start the in-process nodes before this process runs any gRPC (module docstring
        # of node/daemon/agent.py), or the fork can inherit a lock a gRPC thread holds.
        nodes += [_dht_node(maddr), _dht_node(maddr)]
        for name in ("a", "b"):
            tls = issue(authority, f"peer-{name}", root / f"tls-{name}")
            peers.append(
                start_peer(name, root, config_path, maddr, 1, tls.args(), {"FARLOCO_RUN_SECRET": SECRET})
            )
        made = Swarm(root, config_path, maddr, authority, [], bootstrap, *nodes)
        made.agents = [Agent(p, {}) for p in peers]
        made.wait(lambda: all(_status(p).get("grpc_address") for p in peers), 120, "both agents to listen")
        for agent in made.agents:
            agent.status = _status(agent.peer)
        yield made
    finally:
        stop_process(*(peer.process for peer in peers))
        for node in nodes:
            node.dht.shutdown()
        stop_process(bootstrap)


def test_mtls_agents_commit_rounds_together_and_agree(swarm: Swarm) -> None:
    a, b = swarm.agents

    def common() -> set[int]:
        """Rounds both agents committed together (each writes its own event once it committed)."""
        ids = sorted([a.peer_id, b.peer_id])
        return {e["round_id"] for e in a.rounds() if e["contributors"] == ids} & {
            e["round_id"] for e in b.rounds() if e["contributors"] == ids
        }

    swarm.wait(lambda: bool(common()), 180, "a round both agents committed together over mTLS")
    for round_id in common():
        ours, theirs = (next(e for e in x.rounds() if e["round_id"] == round_id) for x in (a, b))
        assert ours["outer_hash"] == theirs["outer_hash"] and ours["group_id"] == theirs["group_id"]
        assert ours["bytes_sent"] > 0 and theirs["bytes_sent"] > 0


def _call(
    address: str, tls: TlsConfig | None, method: str, request: bytes, metadata: Any
) -> grpc.aio.AioRpcError:
    """One raw unary call that must fail; returns its error (code, details, trailing reason)."""

    async def go() -> grpc.aio.AioRpcError:
        if tls is None:
            channel = grpc.aio.insecure_channel(address)
        else:
            credentials = grpc.ssl_channel_credentials(
                tls.root_certificates, tls.private_key, tls.certificate_chain
            )
            channel = grpc.aio.secure_channel(address, credentials)
        try:
            await channel.unary_unary(f"/{SERVICE}/{method}")(request, metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as error:
            return error
        finally:
            await channel.close()
        raise AssertionError(f"{method} at {address} was accepted")

    return asyncio.run(go())


def _reason(error: grpc.aio.AioRpcError) -> str:
    return dict(error.trailing_metadata() or ()).get("farloco-reason", error.code().name)


def test_clients_without_a_certificate_of_the_run_ca_are_refused(swarm: Swarm) -> None:
    a = swarm.agents[0]
    auth = Authenticator(swarm.run_id, SECRET.encode(), "outsider")
    request = encode_frame(Frame({"g": 5}))
    clear = _call(a.address, None, "ExchangeVote", request, auth.metadata("ExchangeVote", 0))
    assert clear.code() == grpc.StatusCode.UNAVAILABLE
    rogue = issue(make_authority("rogue CA"), "rogue", swarm.root / "tls-rogue")
    # the rogue client trusts the swarm's CA, so only its own certificate can make the handshake fail
    refused = _call(
        a.address,
        dataclasses.replace(
            rogue.config(), root_certificates=swarm.authority.cert.public_bytes(serialization.Encoding.PEM)
        ),
        "ExchangeVote",
        request,
        auth.metadata("ExchangeVote", 0),
    )
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    # with a certificate of the run's CA the same call gets through TLS and reaches the handler
    admitted = _call(
        a.address,
        swarm.client_tls("client").config(),
        "ExchangeVote",
        request,
        auth.metadata("ExchangeVote", 0),
    )
    assert (admitted.code(), _reason(admitted)) == (grpc.StatusCode.INVALID_ARGUMENT, "BAD_HEADER")


def test_running_agent_refuses_bad_tokens_and_frames_with_stable_reasons_and_counts_them(
    swarm: Swarm,
) -> None:
    a = swarm.agents[0]
    tls = swarm.client_tls("prober").config()
    auth = Authenticator(swarm.run_id, SECRET.encode(), "prober")
    wrong = Authenticator(swarm.run_id, b"not the run secret", "prober")
    good = encode_frame(Frame({"g": 5}))  # passes auth, then refused by the handler at once (BAD_HEADER)
    before = a.metrics()
    start_round = swarm.current_round()

    def call(request: bytes, metadata: Any) -> tuple[grpc.StatusCode, str, str]:
        error = _call(a.address, tls, "ExchangeVote", request, metadata)
        return error.code(), _reason(error), error.details() or ""

    code, reason, details = call(good, wrong.metadata("ExchangeVote", 0))
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "BAD_SIGNATURE") and "wrong secret" in details
    assert call(good, ())[:2] == (grpc.StatusCode.UNAUTHENTICATED, "MISSING_TOKEN")
    token = auth.metadata("ExchangeVote", 0)
    assert call(good, token)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "BAD_HEADER")
    assert call(good, token)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "REPLAYED_NONCE")
    moved = (*((k, v) for k, v in token if k != "farloco-round"), ("farloco-round", "1"))
    assert call(good, moved)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "BAD_SIGNATURE")  # token bound to round
    fresh = lambda: auth.metadata("ExchangeVote", 0)  # noqa: E731
    assert call(b"\x01", fresh())[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_FRAME")
    huge_header = (1 << 20).to_bytes(4, "little") + b"\x00" * 16  # claims 1 MiB of header, sends 16 bytes
    assert call(huge_header, fresh())[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "FRAME_TOO_LARGE")
    # Over the gRPC message cap (8 MiB): gRPC itself refuses it before any farloco code or allocation runs.
    assert call(b"\x00" * (9 << 20), fresh())[0] == grpc.StatusCode.RESOURCE_EXHAUSTED

    after = a.metrics()
    for reason, count in (("BAD_SIGNATURE", 2), ("MISSING_TOKEN", 1), ("REPLAYED_NONCE", 1), ("BAD_HEADER", 1),
                          ("MALFORMED_FRAME", 1), ("FRAME_TOO_LARGE", 1)):  # fmt: skip
        key = ("farloco_rejected_messages_total", reason)
        assert after.get(key, 0) - before.get(key, 0) == count, (reason, before, after)
    # the agents kept serving each other: a later round still has both of them
    swarm.wait(
        lambda: bool(swarm.rounds_together(start_round)), 120, "a round of both agents after the probes"
    )


# --------------------------------------------------------------------------------------------- DHT attackers


def _record(peer_id: str, address: str, round_id: int, swarm: Swarm, **changes: Any) -> Any:
    from farloco.protocol.membership import NO_SLOT, MemberRecord

    config = load_config(swarm.config_path)
    record = MemberRecord(
        peer_id=peer_id, address=address, state="training", round_id=round_id, inner_step=0, slot=NO_SLOT,
        run_hash=run_hash(config), run_config=run_section(config), outer_hash="", loss=0.0, heartbeat=0.0,
        maddrs=(), version="test",
    )  # fmt: skip
    return dataclasses.replace(record, **changes)


def test_records_of_a_foreign_dht_node_are_ignored_by_running_agents(swarm: Swarm) -> None:
    """A DHT node that knows the run config (so its run_hash) but not the secret writes a member record and
    ready records for the coming rounds: the agents neither list it nor wait for it, and count it."""
    from hivemind.utils.timed_storage import get_dht_time

    from farloco.protocol.matchmaking import ReadyRecord, round_key
    from farloco.protocol.membership import members_key

    node = swarm.foreign
    current = swarm.current_round()

    async def forge() -> None:
        expiration = get_dht_time() + 120
        fake = _record(
            node.peer_id, "127.0.0.1:9", current + 1, swarm, heartbeat=get_dht_time(), proof="0" * 64
        )
        writes = [(members_key(RUN_NAME), fake.to_wire())] + [
            (
                round_key(RUN_NAME, r),
                ReadyRecord(node.peer_id, "127.0.0.1:9", r, get_dht_time()).to_wire(),
            )
            for r in range(current + 1, current + 4)
        ]
        for key, value in writes:
            # As the daemon's own stores do (DHTMembership._store): on a loaded machine no replica may answer
            # the first try in time, and hivemind says so with False; a retry gets through.
            for attempt in range(6):
                if await node.dht.store(key, value, expiration, subkey=node.public_key, return_future=True):
                    break
                await asyncio.sleep(0.25 * 2**attempt)
            else:
                raise AssertionError(f"no DHT node accepted the forged entry under {key} in 6 tries")

    asyncio.run(forge())
    # the fake record says round current+1: the agents' round after that is one it would have stalled
    swarm.wait(lambda: bool(swarm.rounds_together(current + 1)), 120, "a round of both agents after it")
    timeouts = load_config(swarm.config_path).timeouts
    # The forged member record is counted when an agent's heartbeat reads the table, every member_ttl/4: a round
    # that forms in a second can end before that read.
    proof = ("farloco_ignored_dht_records_total", "BAD_MEMBER_PROOF")
    swarm.wait(
        lambda: all(agent.metrics().get(proof, 0) >= 1 for agent in swarm.agents),
        4 * timeouts.member_ttl,
        "each agent's table read to count the forged member record",
    )
    for agent in swarm.agents:
        counts = agent.metrics()
        assert counts.get(("farloco_ignored_dht_records_total", "BAD_MEMBER_PROOF"), 0) >= 1, counts
        # Its forged ready records are not counted here: the round's ready messages travel over the members'
        # links, and a round that forms in milliseconds may end before the DHT copy is read at all (the DHT
        # path's NOT_A_MEMBER filter is tested in test_matchmaking.py::test_records_of_a_foreign_dht_node_are_ignored_and_counted). What matters is below:
        # never listed, never waited for, never grouped.
        assert node.peer_id not in {p["peer_id"] for p in ControlClient(agent.peer.run_dir).peers()}
        later = [e for e in agent.rounds() if e["round_id"] > current + 1]
        assert later and all(node.peer_id not in e["group"] for e in later)
        # had the fake member been believed, every leader would wait match_timeout for it to get ready
        assert all(e["seconds"] < timeouts.match_timeout / 2 for e in later), [e["seconds"] for e in later]


# `-m slow`: the default suite's chaos timeline (tests/test_chaos.py) has a member whose chunks are NaN, refused
# by reason (counted in /metrics), the round committed without it.
@pytest.mark.slow
@pytest.mark.parametrize("attack", ["nan", "shape"])
def test_an_insiders_bad_data_is_refused_counted_and_the_round_commits_without_it(
    swarm: Swarm, monkeypatch: pytest.MonkeyPatch, attack: str
) -> None:
    """A member with the secret and a certificate joins a real round with the agents and sends either NaN
    (after a stream that claims the previous round) or a tensor of the wrong shape: each is refused with its
    reason and counted in /metrics, and the round commits with the two agents' contributions only."""
    from helpers.exchange import skip_own_check

    from farloco.optim import get_codec
    from farloco.protocol.exchange import Exchange, ExchangeAborted
    from farloco.protocol.matchmaking import DHTMatchmaker, LateForRound
    from farloco.protocol.membership import DHTMembership
    from farloco.protocol.rpc import RpcServer
    from farloco.protocol.types import GroupMember

    # The insider skips the check that stops an honest node from sending its own NaN.
    skip_own_check(monkeypatch)
    config = load_config(swarm.config_path)
    timeouts = config.timeouts
    ids = sorted(a.peer_id for a in swarm.agents)
    numel = int(swarm.agents[0].status["num_params"])
    node = swarm.insider
    before = [a.metrics() for a in swarm.agents]

    async def agents_round(membership: Any, pick: Callable[..., int]) -> int:
        return pick((r.round_id for r in await membership.members() if r.peer_id in ids), default=0)

    async def insider() -> tuple[int, str, str | None]:
        auth = Authenticator(swarm.run_id, SECRET.encode(), node.peer_id)
        tls = swarm.client_tls("insider").config()
        server, client = RpcServer(auth, host="127.0.0.1", port=0, tls=tls), RpcClient(auth, tls=tls)
        exchange = Exchange(server, client, node.peer_id)
        membership = DHTMembership(
            node.dht, RUN_NAME, run_hash(config), run_section(config), ttl=timeouts.member_ttl,
            heartbeat_interval=timeouts.heartbeat_interval, public_key=node.public_key, auth=auth,
        )  # fmt: skip
        matchmaker = DHTMatchmaker(node.dht, RUN_NAME, membership)
        me = GroupMember(node.peer_id, await server.start())
        codec = get_codec(config.run.codec, **config.run.codec_options)
        try:
            membership.start_heartbeat()
            for _ in range(
                3
            ):  # a try can come late (the agents froze their group first): take the next round
                target = await agents_round(membership, max) + 1
                await membership.publish(_record(node.peer_id, me.address, target, swarm))
                # Declare ready only once the agents train `target` too (else we would freeze it alone).
                while await agents_round(membership, min) < target:
                    await asyncio.sleep(0.1)
                try:
                    group = await matchmaker.form_group(
                        target,
                        me,
                        match_timeout=timeouts.match_timeout,
                        leader_timeout=timeouts.leader_timeout,
                    )
                    break
                except LateForRound:
                    continue
            else:
                raise AssertionError("the insider never got into a group with the agents")
            assert sorted(m.peer_id for m in group.members) == sorted([*ids, node.peer_id])
            stale = None
            if attack == "nan":
                # A stream of this round's group that claims the previous round, sent before our data.
                hello = Frame({"g": group.group_id, "a": 0, "n": numel, "ce": exchange.chunk_elems, "c": codec.name,
                               "d": True, "w": 1.0, "r": True})  # fmt: skip

                async def once(frame: Frame = hello) -> Any:
                    yield frame

                owner = next(m for m in group.members if m.peer_id != node.peer_id)
                # Sent once the agents are in their attempt (their pushes to us wait for ours), the claim meets
                # the started attempt and is refused as STALE_ROUND; sent before, the owner's move to `target`
                # would refuse it as ATTEMPT_OVER (this node moved on), a refusal for a different reason.
                deadline = time.monotonic() + timeouts.exchange_timeout
                while not any(
                    a.key == group.group_id and a.waiters >= len(ids) for a in exchange.attempts.values()
                ):
                    assert time.monotonic() < deadline, "the agents never pushed to the insider"
                    await asyncio.sleep(0.02)
                try:
                    async for _ in client.stream(
                        owner.address, "ExchangePush", once(), round_id=target - 1, timeout=30
                    ):
                        pass
                except RpcError as error:
                    stale = error.reason
            bad = torch.full((numel,), float("nan")) if attack == "nan" else torch.zeros(numel + 1)
            try:
                await exchange.average(group, bad, codec, timeout=timeouts.exchange_timeout)
                outcome = "accepted"
            except ExchangeAborted as aborted:
                outcome = aborted.reason
            return target, outcome, stale
        finally:
            await membership.remove()
            await client.close()
            await server.stop(0)

    target, outcome, stale = asyncio.run(asyncio.wait_for(insider(), timeout=240))
    assert outcome != "accepted", "the insider got a mean although its data was refused"

    def outcome_of(agent: Agent) -> dict[str, Any] | None:
        """The agent's event closing round `target`: its commit (round_id target+1) or its abort."""
        for e in read_events(agent.peer.run_dir):
            if (e["event"], e.get("round_id")) in (("round", target + 1), ("aborted", target)):
                return e
        return None

    swarm.wait(lambda: all(outcome_of(a) for a in swarm.agents), 90, f"both agents to close round {target}")
    events = [outcome_of(a) for a in swarm.agents]
    after = [a.metrics() for a in swarm.agents]

    def grown(reason: str) -> float:
        key = ("farloco_rejected_messages_total", reason)
        return sum(new.get(key, 0) - old.get(key, 0) for old, new in zip(before, after, strict=True))

    # The refusals carry their stable reasons and are counted, whatever the round's fate.
    if attack == "nan":
        assert stale == "STALE_ROUND" and grown("STALE_ROUND") == 1, (stale, after)
        assert grown("BAD_PAYLOAD") >= 1, after
    else:
        assert grown("SHAPE_MISMATCH") >= 1, after
    # Never a split, and the round went on: every owner checks chunks on arrival, and an agent whose attempt
    # failed on another member's report keeps checking what is still arriving (and keeps sending its own)
    # before it votes, so both honest agents name the insider and the retry commits without it.
    kinds = {e["event"] for e in events if e is not None}
    assert kinds == {"round"}, events
    # The round went on: the insider was in the group but not among the contributors.
    assert all(e is not None and node.peer_id in e["group"] and e["contributors"] == ids for e in events), (
        events
    )
    assert events[0]["outer_hash"] == events[1]["outer_hash"]  # type: ignore[index]


# --------------------------------------------------------------------------------------------- joiner resume

DONOR_DIES_AFTER = 1 << 20  # bytes of state served: one 1 MiB chunk of a 4 MiB tensor


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_joiner_resumes_from_another_donor_when_its_donor_dies_mid_transfer(tmp_path: Path) -> None:
    """Donor `a` is SIGKILLed by the fault injector after serving 1 MiB of state to a joiner; the joiner takes
    the rest from `b` (same round, same manifest), enters at the boundary and, after its first round with `b`,
    holds the same theta_outer hash."""
    config_path = tmp_path / "swarm.toml"
    config_path.write_text(demo_config(0, ["run.inner_steps=4", "node.eval_batches=0"]))
    bootstrap, maddr = start_bootstrap(tmp_path)
    peers: list[PeerProcess] = []
    try:
        a = start_peer(
            "a",
            tmp_path,
            config_path,
            maddr,
            1,
            (),
            {"FARLOCO_FAULTS": f"die-serving-state@{DONOR_DIES_AFTER}"},
        )
        b = start_peer("b", tmp_path, config_path, maddr, 1)
        peers += [a, b]

        def committed_together(peer: PeerProcess) -> bool:
            return any(
                len(e["contributors"]) == 2 for e in read_events(peer.run_dir) if e["event"] == "round"
            )

        deadline = time.monotonic() + 240
        while not (committed_together(a) and committed_together(b)):
            assert a.process.poll() is None and b.process.poll() is None, (
                "a donor exited before the joiner came"
            )
            assert time.monotonic() < deadline, "a and b never committed a round together"
            time.sleep(0.3)
        # The joiner asks every member of the newest round; when it catches only `b` there, `a` serves nothing
        # and the fault never fires: try again with a fresh joiner (rare: they commit within milliseconds).
        for attempt in range(3):
            joiner = start_peer(f"joiner{attempt}", tmp_path, config_path, maddr, 1)
            peers.append(joiner)
            deadline = time.monotonic() + 240
            while not any(e["event"] == "synced" for e in read_events(joiner.run_dir)):
                assert joiner.process.poll() is None, joiner.log_path.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "the joiner never synced"
                time.sleep(0.3)
            if a.process.poll() is not None:
                break
        else:
            pytest.fail("the joiner never fetched from the faulty donor")
        assert a.process.wait(timeout=30) == -9  # SIGKILLed by its fault injector, mid-transfer
        events = read_events(joiner.run_dir)
        synced = next(e for e in events if e["event"] == "synced")
        b_address = ControlClient(b.run_dir).status()["grpc_address"]
        assert b_address in synced["donors"], synced
        # Either the transfer lost `a` and finished from `b` by byte range, or (when `a` was the only donor of
        # the newest round) the joiner looked again and fetched from `b`: both are logged.
        log = joiner.log_path.read_text(errors="replace")
        assert "failed at" in log or any(e["event"] == "sync_failed" for e in events), log[-3000:]

        def first_round() -> dict[str, Any] | None:
            return next((e for e in read_events(joiner.run_dir) if e["event"] == "round"), None)

        deadline = time.monotonic() + 240
        while first_round() is None:
            assert joiner.process.poll() is None, joiner.log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the joiner never committed a round"
            time.sleep(0.3)
        mine = first_round()
        assert mine is not None and mine["round_id"] > synced["round_id"]
        theirs = {e["round_id"]: e["outer_hash"] for e in read_events(b.run_dir) if e["event"] == "round"}
        deadline = time.monotonic() + 60
        while mine["round_id"] not in theirs and time.monotonic() < deadline:
            time.sleep(0.3)
            theirs = {e["round_id"]: e["outer_hash"] for e in read_events(b.run_dir) if e["event"] == "round"}
        assert theirs.get(mine["round_id"]) == mine["outer_hash"], (mine, theirs)
    finally:
        stop_process(*(peer.process for peer in peers))
        stop_process(bootstrap)


# -- secure by default -------------------------------------------------------------------------------------------


def test_a_node_beyond_loopback_without_a_secret_is_refused_and_told_how_to_make_one(tmp_path: Path) -> None:
    from farloco.node.config import run_secret

    def config(**values: Any) -> Any:
        return build_config({"network": {"host": values.pop("host", "127.0.0.1")}, "auth": values})

    digest = run_hash(config())
    derived = run_secret(config(), digest, environ={})  # loopback: the secret derived from the run hash
    assert len(derived) == 32
    for host in ("0.0.0.0", "10.1.2.3", "node-7.cluster"):
        with pytest.raises(ConfigError) as refused:
            run_secret(config(host=host), digest, environ={})
        message = str(refused.value)
        assert f"network.host = {host!r}" in message and "farloco secret" in message
        assert "auth.insecure_no_secret = true" in message and "FARLOCO_RUN_SECRET" in message
    assert run_secret(config(host="10.1.2.3", insecure_no_secret=True), digest, environ={}) == derived
    assert run_secret(config(host="::1"), digest, environ={}) == derived
    # A given secret: from the environment or a file, at least 16 bytes.
    assert run_secret(config(host="10.1.2.3"), digest, environ={"FARLOCO_RUN_SECRET": "x" * 16}) == b"x" * 16
    with pytest.raises(
        ConfigError, match=r"FARLOCO_RUN_SECRET: expected a secret of at least 16 bytes .*got 5"
    ):
        run_secret(config(host="10.1.2.3"), digest, environ={"FARLOCO_RUN_SECRET": "short"})
    path = tmp_path / "run-secret"
    with pytest.raises(ConfigError, match=r"auth\.secret_file: cannot read"):
        run_secret(config(secret_file=str(path)), digest, environ={})
    from click.testing import CliRunner

    from farloco.node.tools.cli import main

    made = CliRunner().invoke(main, ["secret", "--out", str(path)])
    assert made.exit_code == 0, made.output
    assert path.stat().st_mode & 0o777 == 0o600 and re.fullmatch(r"[0-9a-f]{64}\n", path.read_text())
    assert (
        run_secret(config(host="10.1.2.3", secret_file=str(path)), digest, environ={})
        == path.read_bytes().strip()
    )
    again = CliRunner().invoke(main, ["secret", "--out", str(path)])
    assert again.exit_code != 0 and "exists" in again.output  # a run keeps its secret
    printed = CliRunner().invoke(main, ["secret"])
    assert re.fullmatch(r"[0-9a-f]{64}\n", printed.output) and printed.output != path.read_text()


def test_farloco_join_on_a_lan_address_without_a_secret_exits_at_once_naming_the_fix(
    tmp_path: Path,
) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FARLOCO_RUN_SECRET"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "farloco.node.tools.cli", "join", "--run-dir", str(tmp_path / "node"),
         "--host", "192.0.2.10"],  # a documentation address: refused before anything would bind it
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]  # a usage error, before anything listens
    assert "listens beyond this machine, but the run has no secret" in done.stderr
    assert "farloco secret --out run-secret" in done.stderr
    assert time.monotonic() - started < 60
