"""Transport security (protocol/transport.py) over real sockets on 127.0.0.1: the run secret's CA, TLS 1.3 on
the data plane and gRPC, refusal of outsiders, and an on-path relay that reads and alters the bytes."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from farloco.node.config import ConfigError, build_config, transport_tls
from farloco.protocol.auth import Authenticator
from farloco.protocol.rpc import CallContext, Frame, RpcClient, RpcError, RpcServer, decode_frame_owned
from farloco.protocol.tcpstream import MAGIC, TAMPERED, TLS_HANDSHAKE, open_stream
from farloco.protocol.transport import SERVER_NAME, TlsConfig, make_pki, run_credentials, ssl_context

RUN = "run-tls"
SECRET = b"a run secret of 32 bytes, really"
MARKER = b"plaintext-marker" * 64  # what a frame carries; must never be seen on the wire under TLS


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout=60))


async def echo(ctx: CallContext, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
    async for frame in frames:
        yield Frame({"i": frame.header["i"], "sender": ctx.sender}, bytes(frame.payload))


async def served(tls: TlsConfig | None) -> tuple[RpcServer, str]:
    server = RpcServer(Authenticator(RUN, SECRET, "server"), host="127.0.0.1", tls=tls, data_port=0)
    server.add_stream("Echo", echo)

    async def hello(ctx: CallContext, frame: Frame) -> Frame:
        return Frame({"hi": ctx.sender})

    server.add_unary("Hello", hello)
    return server, await server.start()


async def payloads(count: int, size: int = 1 << 20) -> AsyncIterator[Frame]:
    body = (MARKER * (size // len(MARKER) + 1))[:size]
    for i in range(count):
        yield Frame({"i": i}, body)


class Relay:
    """An on-path TCP relay on 127.0.0.1: records every byte it forwards and may flip one byte of the client's
    direction at offset `flip_at` (counted from the connection's start)."""

    def __init__(self, target_port: int, flip_at: int | None = None) -> None:
        self.target_port, self.flip_at = target_port, flip_at
        self.seen = bytearray()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, flip: bool) -> None:
            offset = 0
            with contextlib.suppress(ConnectionError):
                while data := await src.read(1 << 16):
                    if flip and self.flip_at is not None and offset <= self.flip_at < offset + len(data):
                        data = bytearray(data)
                        data[self.flip_at - offset] ^= 0x01
                    offset += len(data)
                    self.seen += data
                    dst.write(bytes(data))
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()

        try:
            await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))
        finally:
            for w in (writer, up_writer):
                w.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def relayed_stream(server: RpcServer, relay: Relay, tls: TlsConfig | None, count: int) -> list[Frame]:
    """An Echo stream to `server`'s data plane through `relay`, as RpcClient would open it."""
    auth = Authenticator(RUN, SECRET, "client")
    port = await relay.start()
    try:
        return [
            answer
            async for answer in open_stream(
                "127.0.0.1",
                port,
                "Echo",
                auth.metadata("Echo", 1),
                payloads(count),
                timeout=30,
                max_message_bytes=8 << 20,
                decode=decode_frame_owned,
                ssl_context=None if tls is None else ssl_context(tls, server=False),
                server_name=None if tls is None else tls.server_name,
            )
        ]
    finally:
        await relay.stop()


def test_the_run_secret_makes_one_ca_and_a_fresh_certificate_per_node() -> None:
    a, b = run_credentials(SECRET, RUN, "a"), run_credentials(SECRET, RUN, "b")
    other = run_credentials(b"another secret of 32 bytes......", RUN, "a")
    other_run = run_credentials(SECRET, "another-run", "a")

    def key(pem: bytes) -> bytes:
        public = x509.load_pem_x509_certificate(pem).public_key()
        return public.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)

    assert key(a.root_certificates) == key(b.root_certificates)  # one CA per secret and run
    assert key(a.root_certificates) != key(other.root_certificates)
    assert key(a.root_certificates) != key(other_run.root_certificates)
    assert key(a.certificate_chain) != key(b.certificate_chain)  # a fresh key per node
    leaf = x509.load_pem_x509_certificate(a.certificate_chain)
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [SERVER_NAME] and a.server_name == SERVER_NAME


def test_data_plane_and_grpc_under_tls_carry_no_plaintext_and_answer_in_full() -> None:
    async def body() -> None:
        tls = run_credentials(SECRET, RUN, "server")
        server, address = await served(tls)
        try:
            assert server.data_port is not None  # the data plane is open under TLS too
            relay = Relay(server.data_port)
            answers = await relayed_stream(server, relay, run_credentials(SECRET, RUN, "client"), 4)
            assert [a.header["i"] for a in answers] == [0, 1, 2, 3]
            assert all(bytes(a.payload[: len(MARKER)]) == MARKER for a in answers)
            assert len(relay.seen) > 8 << 20  # 4 MiB each way went through the relay...
            assert MARKER[:32] not in relay.seen and MAGIC not in relay.seen  # ...none of it readable
            assert RUN.encode() not in relay.seen and b"client" not in relay.seen
            client = RpcClient(
                Authenticator(RUN, SECRET, "client"), tls=run_credentials(SECRET, RUN, "client")
            )
            try:
                reply = await client.unary(address, "Hello", Frame({}), round_id=1, timeout=10)
                assert reply.header == {"hi": "client"}
                streamed = [
                    f
                    async for f in client.stream(
                        address, "Echo", payloads(2), round_id=1, timeout=30, bulk=True
                    )
                ]
                assert len(streamed) == 2 and client._data_ports[address] == server.data_port
                # the next stream rides the same TLS session: no second handshake
                again = [
                    f
                    async for f in client.stream(
                        address, "Echo", payloads(3, 1000), round_id=2, timeout=30, bulk=True
                    )
                ]
                assert [f.header["i"] for f in again] == [0, 1, 2] and client.connections.reused == 1
            finally:
                await client.close()
            assert not server.rejections
        finally:
            await server.stop(0)
        # The same stream in plaintext (loopback's default) is readable on the wire: what the relay sees above
        # is the encryption's doing, not the relay's.
        server, _ = await served(None)
        try:
            assert server.data_port is not None
            relay = Relay(server.data_port)
            await relayed_stream(server, relay, None, 1)
            assert MARKER[:32] in relay.seen and MAGIC in relay.seen
        finally:
            await server.stop(0)

    run(body)


def test_a_byte_altered_on_the_wire_is_refused_as_tampered_and_counted() -> None:
    async def body() -> None:
        tls = run_credentials(SECRET, RUN, "server")
        server, _ = await served(tls)
        try:
            assert server.data_port is not None
            relay = Relay(
                server.data_port, flip_at=600_000
            )  # inside the first chunk, well after the handshake
            with pytest.raises(RpcError) as info:
                await relayed_stream(server, relay, run_credentials(SECRET, RUN, "client"), 4)
            assert info.value.reason in (TAMPERED, "CONNECTION_LOST"), info.value
            for _ in range(100):
                if server.rejections:
                    break
                await asyncio.sleep(0.05)
            assert server.rejections == {TAMPERED: 1}, server.rejections
        finally:
            await server.stop(0)

    run(body)


def test_outsiders_cannot_complete_a_handshake() -> None:
    """A client without the run secret's certificates (another secret, or plaintext) is refused at the
    handshake on the data plane, counted as TLS_HANDSHAKE, and cannot call gRPC either."""

    async def body() -> None:
        server, address = await served(run_credentials(SECRET, RUN, "server"))
        try:
            assert server.data_port is not None
            stranger = run_credentials(b"not the run's secret, 32 bytes..", RUN, "stranger")
            with pytest.raises(RpcError) as info:
                await relayed_stream(server, Relay(server.data_port), stranger, 1)
            assert info.value.reason == TLS_HANDSHAKE, info.value
            with pytest.raises(RpcError):  # plaintext to a TLS listener: refused, never a frame
                await relayed_stream(server, Relay(server.data_port), None, 1)
            for _ in range(100):
                if server.rejections[TLS_HANDSHAKE] >= 2:
                    break
                await asyncio.sleep(0.05)
            assert server.rejections == {TLS_HANDSHAKE: 2}, server.rejections
            client = RpcClient(Authenticator(RUN, SECRET, "stranger"), tls=stranger)
            try:
                with pytest.raises(RpcError) as info:
                    await client.unary(address, "Hello", Frame({}), round_id=1, timeout=5)
                assert info.value.code == grpc.StatusCode.UNAVAILABLE
            finally:
                await client.close()
        finally:
            await server.stop(0)

    run(body)


def test_an_operators_pki_works_like_the_secrets() -> None:
    files = make_pki(["a", "b"])
    assert set(files) == {"ca.pem", "ca.key", "a.pem", "a.key", "b.pem", "b.key"}

    def tls(node: str) -> TlsConfig:
        return TlsConfig(files["ca.pem"], files[f"{node}.pem"], files[f"{node}.key"], server_name=SERVER_NAME)

    async def body() -> None:
        server, address = await served(tls("a"))
        client = RpcClient(Authenticator(RUN, SECRET, "b"), tls=tls("b"))
        try:
            streamed = [
                f
                async for f in client.stream(address, "Echo", payloads(1), round_id=1, timeout=30, bulk=True)
            ]
            assert streamed[0].header["sender"] == "b"
        finally:
            await client.close()
            await server.stop(0)

    run(body)


@pytest.mark.parametrize(
    ("host", "mode", "insecure", "expect"),
    [
        ("127.0.0.1", "auto", False, None),
        ("::1", "auto", False, None),
        ("0.0.0.0", "auto", False, TlsConfig),
        ("10.0.0.5", "auto", False, TlsConfig),
        ("127.0.0.1", "tls", False, TlsConfig),
        ("127.0.0.1", "off", False, None),
        ("0.0.0.0", "off", False, ConfigError),
        ("0.0.0.0", "off", True, None),
    ],
)
def test_encryption_is_on_beyond_loopback_unless_refused_in_words(
    host: str, mode: str, insecure: bool, expect: type | None
) -> None:
    config = build_config(
        {},
        overrides=[
            f"network.host={host}",
            f"network.encryption={mode}",
            f"auth.insecure_no_secret={str(insecure).lower()}",
        ],
    )
    if expect is ConfigError:
        with pytest.raises(ConfigError, match="clear text"):
            transport_tls(config, SECRET, RUN, "node")
        return
    tls = transport_tls(config, SECRET, RUN, "node")
    assert (tls is None) if expect is None else isinstance(tls, TlsConfig)


def test_a_wrong_encryption_mode_names_the_choices() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("network.encryption: expected one of auto, tls, off, got 'yes'")
    ):
        build_config({}, overrides=["network.encryption=yes"])


def test_tls_frames_keep_their_bytes_exactly() -> None:
    """Frames of every size (empty, one byte, a record's edge, several MiB) cross TLS bit for bit."""

    async def body() -> None:
        server, address = await served(run_credentials(SECRET, RUN, "server"))
        client = RpcClient(Authenticator(RUN, SECRET, "client"), tls=run_credentials(SECRET, RUN, "client"))
        sizes = [0, 1, 16383, 16384, 16385, 3 << 20]
        blobs = [torch.randint(0, 256, (n,), dtype=torch.uint8).numpy().tobytes() for n in sizes]

        async def frames() -> AsyncIterator[Frame]:
            for i, blob in enumerate(blobs):
                yield Frame({"i": i}, blob)

        try:
            got = [
                f async for f in client.stream(address, "Echo", frames(), round_id=1, timeout=30, bulk=True)
            ]
            assert [bytes(f.payload) for f in got] == blobs
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_farloco_certs_makes_a_ca_and_node_certificates_once(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from farloco.node.tools.cli import main

    out = tmp_path / "pki"
    made = CliRunner().invoke(main, ["certs", "--out", str(out), "n1", "n2"])
    assert made.exit_code == 0, made.output
    assert sorted(p.name for p in out.iterdir()) == [
        "ca.key",
        "ca.pem",
        "n1.key",
        "n1.pem",
        "n2.key",
        "n2.pem",
    ]
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    leaf = x509.load_pem_x509_certificate((out / "n1.pem").read_bytes())
    leaf.verify_directly_issued_by(ca)
    again = CliRunner().invoke(main, ["certs", "--out", str(out), "n3"])
    assert again.exit_code == 2 and "ca.pem exists" in again.output
    bad = CliRunner().invoke(main, ["certs", "--out", str(tmp_path / "x"), "../evil"])
    assert bad.exit_code == 2 and "node names are file names" in bad.output
