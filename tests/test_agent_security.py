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
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from farloco.node.config import ConfigError, build_config, load_config, load_tls, run_hash
from farloco.node.control import ControlClient, ControlError
from farloco.node.demo import PeerProcess, demo_config, read_events, start_bootstrap, start_peer, stop_process
from farloco.protocol.auth import Authenticator
from farloco.protocol.rpc import SERVICE, Frame, TlsConfig, encode_frame

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
class Swarm:
    root: Path
    config_path: Path
    maddr: str
    authority: Authority
    agents: list[Agent]
    bootstrap: Any

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
        """Round events after `after` whose contributors are exactly the agents."""
        ids = sorted(a.peer_id for a in self.agents)
        return [e for e in self.agents[0].rounds() if e["round_id"] > after and e["contributors"] == ids]


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
    config_path.write_text(demo_config(0, ["run.inner_steps=6"]))
    bootstrap, maddr = start_bootstrap(root)
    peers: list[PeerProcess] = []
    try:
        for name in ("a", "b"):
            tls = issue(authority, f"peer-{name}", root / f"tls-{name}")
            peers.append(
                start_peer(name, root, config_path, maddr, 1, tls.args(), {"FARLOCO_RUN_SECRET": SECRET})
            )
        made = Swarm(root, config_path, maddr, authority, [], bootstrap)
        made.agents = [Agent(p, {}) for p in peers]
        made.wait(lambda: all(_status(p).get("grpc_address") for p in peers), 120, "both agents to listen")
        for agent in made.agents:
            agent.status = _status(agent.peer)
        yield made
    finally:
        for peer in peers:
            stop_process(peer.process)
        stop_process(bootstrap)


def test_mtls_agents_commit_rounds_together_and_agree(swarm: Swarm) -> None:
    swarm.wait(lambda: len(swarm.rounds_together(0)) >= 2, 180, "two rounds with both agents over mTLS")
    b = swarm.agents[1]
    hashes_b = {e["round_id"]: e["outer_hash"] for e in b.rounds()}
    together = swarm.rounds_together(0)
    assert all(hashes_b.get(e["round_id"]) in (None, e["outer_hash"]) for e in together)
    assert any(hashes_b.get(e["round_id"]) == e["outer_hash"] for e in together)
    assert all(e["bytes_sent"] > 0 for e in together)


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
        lambda: bool(swarm.rounds_together(start_round + 1)), 120, "a round of both agents after the probes"
    )
