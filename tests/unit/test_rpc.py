"""RpcServer / RpcClient over real grpc.aio on 127.0.0.1: frames, auth, rejections, limits, errors."""

from __future__ import annotations

import asyncio
import datetime
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import msgpack
import pytest

from farloco.protocol.auth import Authenticator
from farloco.protocol.rpc import (
    SERVICE,
    CallContext,
    Frame,
    FrameError,
    Reject,
    RpcClient,
    RpcError,
    RpcServer,
    TlsConfig,
    decode_frame,
    encode_frame,
    knock,
)

RUN = "run-test"
SECRET = b"test-secret"


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout=60))


async def echo(ctx: CallContext, frame: Frame) -> Frame:
    if frame.header.get("refuse"):
        raise Reject(
            grpc.StatusCode.FAILED_PRECONDITION, "STALE_ROUND", f"expected round 9, got {ctx.round_id}"
        )
    if frame.header.get("crash"):
        raise RuntimeError("boom")
    return Frame(
        {"sender": ctx.sender, "round": ctx.round_id, "method": ctx.method, **frame.header}, frame.payload
    )


async def doubler(ctx: CallContext, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
    async for frame in frames:
        if frame.header.get("refuse"):
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, "SIZE_MISMATCH", "expected 4 bytes, got 5")
        yield Frame({"i": frame.header["i"], "sender": ctx.sender}, bytes(frame.payload) * 2)


async def started(**server_options: Any) -> tuple[RpcServer, str]:
    server = RpcServer(Authenticator(RUN, SECRET, "server"), **server_options)
    server.add_unary("Echo", echo)
    server.add_stream("Double", doubler)
    return server, await server.start()


def test_frame_round_trip_and_limits() -> None:
    frame = Frame({"a": 1, "b": [1.5, "x"], "c": b"\x00\x01", "d": {"e": True}}, b"payload")
    data = encode_frame(frame)
    back = decode_frame(data, max_header_bytes=1024)
    assert back.header == frame.header and bytes(back.payload) == b"payload"
    # The header length is checked before anything is unpacked: a 4 GiB claim is refused at once.
    with pytest.raises(FrameError) as info:
        decode_frame(struct.pack("<I", 0xFFFFFFFF) + b"xx", max_header_bytes=1024)
    assert info.value.reason == "FRAME_TOO_LARGE"
    with pytest.raises(FrameError) as info:
        decode_frame(struct.pack("<I", 100) + b"xx", max_header_bytes=1024)
    assert info.value.reason == "MALFORMED_FRAME"
    with pytest.raises(FrameError):
        decode_frame(struct.pack("<I", 1) + msgpack.packb(7), max_header_bytes=1024)  # not a map
    with pytest.raises(TypeError, match="header"):
        encode_frame(Frame({"x": object()}))


def test_unary_and_stream_round_trip() -> None:
    async def body() -> None:
        server, address = await started()
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            answer = await client.unary(
                address, "Echo", Frame({"k": "v"}, b"\x01" * 1000), round_id=3, timeout=5
            )
            assert answer.header == {"sender": "client", "round": 3, "method": "Echo", "k": "v"}
            assert bytes(answer.payload) == b"\x01" * 1000
            # the control traffic is counted per method: the request and answer frames and the auth metadata
            request, reply = encode_frame(Frame({"k": "v"}, b"\x01" * 1000)), encode_frame(answer)
            metadata = sum(len(k) + len(v) for k, v in client.auth.metadata("Echo", 3))
            assert client.unary_bytes == {"Echo": len(request) + metadata + len(reply)}

            async def frames() -> AsyncIterator[Frame]:
                for i in range(20):
                    yield Frame({"i": i}, bytes([i]) * 1000)

            answers = [f async for f in client.stream(address, "Double", frames(), round_id=3, timeout=5)]
            assert [f.header["i"] for f in answers] == list(range(20))
            assert all(bytes(f.payload) == bytes([f.header["i"]]) * 2000 for f in answers)
            assert not server.rejections
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_reject_reaches_caller_and_is_counted() -> None:
    async def body() -> None:
        server, address = await started()
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Echo", Frame({"refuse": True}), round_id=4, timeout=5)
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.reason == "STALE_ROUND"
            assert "expected round 9, got 4" in info.value.detail

            async def frames() -> AsyncIterator[Frame]:
                yield Frame({"i": 0}, b"abcd")
                yield Frame({"i": 1, "refuse": True}, b"abcde")

            got = []
            with pytest.raises(RpcError) as info:
                async for frame in client.stream(address, "Double", frames(), round_id=4, timeout=5):
                    got.append(frame)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.reason == "SIZE_MISMATCH"
            assert len(got) == 1

            with pytest.raises(RpcError) as info:
                await client.unary(address, "Echo", Frame({"crash": True}), round_id=4, timeout=5)
            assert (info.value.code, info.value.reason) == (grpc.StatusCode.INTERNAL, "HANDLER_ERROR")
            assert server.rejections == {"STALE_ROUND": 1, "SIZE_MISMATCH": 1, "HANDLER_ERROR": 1}
            # The server keeps serving after refusals.
            ok = await client.unary(address, "Echo", Frame({}), round_id=4, timeout=5)
            assert ok.header["round"] == 4
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_unauthenticated_caller_refused_and_counted() -> None:
    async def body() -> None:
        server, address = await started()
        intruder = RpcClient(Authenticator(RUN, b"wrong-secret", "intruder"))
        other_run = RpcClient(Authenticator("run-other", SECRET, "lost"))
        try:
            for client, reason in ((intruder, "BAD_SIGNATURE"), (other_run, "RUN_MISMATCH")):
                with pytest.raises(RpcError) as info:
                    await client.unary(address, "Echo", Frame({}), round_id=1, timeout=5)
                assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, reason)
            assert server.rejections == {"BAD_SIGNATURE": 1, "RUN_MISMATCH": 1}
        finally:
            await intruder.close()
            await other_run.close()
            await server.stop(0)

    run(body)


def test_malformed_and_oversized_frames_refused() -> None:
    async def body() -> None:
        server, address = await started(max_message_bytes=1 << 20)
        auth = Authenticator(RUN, SECRET, "raw")
        channel = grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)])
        call = channel.unary_unary(f"/{SERVICE}/Echo")
        try:
            bad_header = struct.pack("<I", 3) + b"\xc1\xc1\xc1"  # 0xc1 is never valid msgpack
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(bad_header, timeout=5, metadata=auth.metadata("Echo", 1))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "MALFORMED_FRAME" in (info.value.details() or "")
            huge_header = struct.pack("<I", 1 << 30) + b"\x80"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(huge_header, timeout=5, metadata=auth.metadata("Echo", 1))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert server.rejections == {"MALFORMED_FRAME": 1, "FRAME_TOO_LARGE": 1}
            # A message above the server's max_message_bytes is refused by gRPC before the handler runs.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(
                    encode_frame(Frame({}, bytes(2 << 20))), timeout=5, metadata=auth.metadata("Echo", 1)
                )
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Our client refuses to send it at all, with a clear RpcError.
            client = RpcClient(auth, max_message_bytes=1 << 20)
            with pytest.raises(RpcError) as rpc_info:
                await client.unary(address, "Echo", Frame({}, bytes(2 << 20)), round_id=1, timeout=5)
            assert rpc_info.value.reason == "FRAME_TOO_LARGE"
            await client.close()
        finally:
            await channel.close()
            await server.stop(0)

    run(body)


def test_transport_failures_become_rpc_errors() -> None:
    async def slow(ctx: CallContext, frame: Frame) -> Frame:
        await asyncio.sleep(5)
        return frame

    async def body() -> None:
        server, address = await started()
        server.add_unary("Slow", slow)  # added after start: methods are looked up per call
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Slow", Frame({}), round_id=1, timeout=0.2)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Nope", Frame({}), round_id=1, timeout=5)
            assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
            await server.stop(0)
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Echo", Frame({}), round_id=1, timeout=2)
            assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_calls_in_flight_when_the_client_closes_fail_as_rpc_errors_not_cancellations() -> None:
    """Closing a channel cancels its calls locally, and grpc.aio then raises asyncio.CancelledError in the task
    that awaits one though nobody cancelled that task: the node's round loop ended as if asked to stop (a dropped
    connection fault killed a node). A call the close cut off fails like any lost connection; a task that is
    itself cancelled still gets its CancelledError."""

    async def slow(ctx: CallContext, frame: Frame) -> Frame:
        await asyncio.sleep(5)
        return frame

    async def slow_stream(ctx: CallContext, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
        async for frame in frames:
            await asyncio.sleep(5)
            yield frame

    async def one_frame() -> AsyncIterator[Frame]:
        yield Frame({"i": 0}, b"x")

    async def body() -> None:
        server, address = await started()
        server.add_unary("Slow", slow)
        server.add_stream("SlowStream", slow_stream)
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:

            async def streamed() -> list[Frame]:
                return [
                    f async for f in client.stream(address, "SlowStream", one_frame(), round_id=1, timeout=5)
                ]

            calls = [
                asyncio.ensure_future(client.unary(address, "Slow", Frame({}), round_id=1, timeout=5)),
                asyncio.ensure_future(streamed()),
            ]
            await asyncio.sleep(0.3)  # both in flight at the server
            await client.close()
            for call in calls:
                with pytest.raises(RpcError) as info:
                    await call
                assert (
                    info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.reason == "CHANNEL_CLOSED"
                )
                assert "Slow" in str(info.value)
            # a task cancelled from outside is cancelled, as ever
            cancelled = asyncio.ensure_future(client.unary(address, "Slow", Frame({}), round_id=1, timeout=5))
            await asyncio.sleep(0.3)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert cancelled.cancelled()
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def _self_signed_tls() -> TlsConfig:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "farloco-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("farloco-test")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return TlsConfig(
        root_certificates=pem, certificate_chain=pem, private_key=key_pem, server_name="farloco-test"
    )


def test_mutual_tls_round_trip() -> None:
    pytest.importorskip("cryptography")
    tls = _self_signed_tls()

    async def body() -> None:
        server, address = await started(tls=tls)
        client = RpcClient(Authenticator(RUN, SECRET, "client"), tls=tls)
        plain = RpcClient(Authenticator(RUN, SECRET, "plain"))
        try:
            answer = await client.unary(address, "Echo", Frame({"k": 1}), round_id=2, timeout=10)
            assert answer.header["k"] == 1
            with pytest.raises(RpcError) as info:
                await plain.unary(address, "Echo", Frame({}), round_id=2, timeout=2)
            assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        finally:
            await client.close()
            await plain.close()
            await server.stop(0)

    run(body)


def test_a_knock_tells_a_port_nobody_listens_on_from_one_that_accepts_and_from_a_bad_address() -> None:
    """`knock`: "refused" where no process listens (a crashed node's address), "open" where something accepts,
    "silent" for a malformed address (and, by its timeout, for a host that never answers)."""

    async def body() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        assert await knock(f"127.0.0.1:{port}", 2.0) == "open"
        server.close()
        await server.wait_closed()
        assert await knock(f"127.0.0.1:{port}", 2.0) == "refused"
        assert await knock("no-port-here", 2.0) == "silent"

    run(body)
