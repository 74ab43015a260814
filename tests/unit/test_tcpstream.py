"""The TCP data plane beside gRPC (protocol/tcpstream.py), over real sockets on 127.0.0.1: the same frames,
authentication, rejections, limits and errors as gRPC streams; raw bytes sent to it are refused unread."""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import msgpack
import pytest
import torch

from farloco.protocol.auth import Authenticator
from farloco.protocol.rpc import CallContext, Frame, Reject, RpcClient, RpcError, RpcServer
from farloco.protocol.tcpstream import END, ERROR, MAGIC, size_socket_buffers, tune_malloc

RUN = "run-tcp"
SECRET = b"tcp-secret"


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout=60))


async def doubler(ctx: CallContext, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
    async for frame in frames:
        if frame.header.get("refuse"):
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, "SIZE_MISMATCH", "expected 4 bytes, got 5")
        yield Frame(
            {"i": frame.header["i"], "sender": ctx.sender, "round": ctx.round_id}, bytes(frame.payload) * 2
        )


async def started(**options: Any) -> tuple[RpcServer, str]:
    server = RpcServer(Authenticator(RUN, SECRET, "server"), data_port=0, **options)
    server.add_stream("Double", doubler)
    return server, await server.start()


async def frames_of(*items: tuple[dict[str, Any], bytes]) -> AsyncIterator[Frame]:
    for header, payload in items:
        yield Frame(header, payload)


async def raw_exchange(port: int, data: bytes, read: int = 1 << 16) -> bytes:
    """Send raw bytes to the data port and return whatever comes back before the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(read), timeout=10)
    finally:
        writer.close()


def error_of(answer: bytes) -> dict[str, Any]:
    (marker,) = struct.unpack_from("<I", answer, 0)
    assert marker == ERROR, answer[:16]
    (length,) = struct.unpack_from("<I", answer, 4)
    report: dict[str, Any] = msgpack.unpackb(answer[8 : 8 + length])
    return report


def preamble(method: str, metadata: Any, timeout: float = 5.0) -> bytes:
    body = msgpack.packb({"m": method, "md": [list(m) for m in metadata], "t": timeout})
    return MAGIC + struct.pack("<I", len(body)) + body


def test_stream_rides_the_data_plane_with_the_same_results() -> None:
    async def body() -> None:
        server, address = await started()
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            assert server.data_port
            items = [({"i": i}, bytes([i]) * (1000 + i)) for i in range(5)]
            answers = [
                f
                async for f in client.stream(
                    address, "Double", frames_of(*items), round_id=7, timeout=10, bulk=True
                )
            ]
            assert [f.header for f in answers] == [{"i": i, "sender": "client", "round": 7} for i in range(5)]
            assert [bytes(f.payload) for f in answers] == [p * 2 for _, p in items]
            # The answers came over TCP, not gRPC: the port was asked once and cached.
            assert client._data_ports == {address: server.data_port}
            # A sink receives payloads straight into the caller's memory.
            target = torch.zeros(500, dtype=torch.uint8)
            sink_answers = [
                f
                async for f in client.stream(
                    address,
                    "Double",
                    frames_of(({"i": 0}, b"\x07" * 250)),
                    round_id=7,
                    timeout=10,
                    bulk=True,
                    sink=lambda header, size: target.numpy().data if size == 500 else None,
                )
            ]
            assert bytes(sink_answers[0].payload) == b"\x07" * 500 and int(target.sum()) == 7 * 500
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_refusals_on_the_data_plane_are_rpc_errors_with_reasons_and_counted() -> None:
    async def body() -> None:
        server, address = await started(max_message_bytes=1 << 20)
        client = RpcClient(Authenticator(RUN, SECRET, "client"), max_message_bytes=1 << 20)
        intruder = RpcClient(Authenticator(RUN, b"wrong-secret", "intruder"))
        try:
            with pytest.raises(RpcError) as info:
                async for _ in client.stream(
                    address,
                    "Double",
                    frames_of(({"i": 0, "refuse": True}, b"x")),
                    round_id=1,
                    timeout=5,
                    bulk=True,
                ):
                    pass
            assert (info.value.code, info.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "SIZE_MISMATCH")
            # The intruder cannot even learn the data port (gRPC refuses it) ...
            with pytest.raises(RpcError) as info:
                async for _ in intruder.stream(
                    address, "Double", frames_of(), round_id=1, timeout=5, bulk=True
                ):
                    pass
            assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "BAD_SIGNATURE")
            # ... and with the port, its token is refused on the data plane itself.
            intruder._data_ports[address] = server.data_port
            with pytest.raises(RpcError) as info:
                async for _ in intruder.stream(
                    address, "Double", frames_of(), round_id=1, timeout=5, bulk=True
                ):
                    pass
            assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "BAD_SIGNATURE")
            # Our client refuses to send an oversized frame, with a clear RpcError.
            with pytest.raises(RpcError) as info:
                async for _ in client.stream(
                    address, "Double", frames_of(({"i": 0}, bytes(2 << 20))), round_id=1, timeout=5, bulk=True
                ):
                    pass
            assert info.value.reason == "FRAME_TOO_LARGE"
            assert server.rejections["SIZE_MISMATCH"] == 1
            assert server.rejections["BAD_SIGNATURE"] == 2
        finally:
            await client.close()
            await intruder.close()
            await server.stop(0)

    run(body)


def test_raw_bad_input_is_refused_before_allocation_and_replays_fail() -> None:
    async def body() -> None:
        server, _ = await started(max_message_bytes=1 << 20)
        port = server.data_port
        assert port is not None
        auth = Authenticator(RUN, SECRET, "raw")
        try:
            # Not our protocol at all.
            report = error_of(await raw_exchange(port, b"GET / HTTP/1.1\r\n\r\n"))
            assert report["reason"] == "MALFORMED_FRAME" and "magic" in report["detail"]
            # A preamble claiming 4 GiB is refused unread.
            report = error_of(await raw_exchange(port, MAGIC + struct.pack("<I", 0xFFFFFFF0)))
            assert report["reason"] == "FRAME_TOO_LARGE"
            # A valid preamble, then a frame claiming 512 MiB: refused before anything is allocated.
            metadata = auth.metadata("Double", 1)
            report = error_of(
                await raw_exchange(port, preamble("Double", metadata) + struct.pack("<I", 512 << 20))
            )
            assert report["reason"] == "FRAME_TOO_LARGE" and report["code"] == "INVALID_ARGUMENT"
            # The same token again: a replay.
            report = error_of(await raw_exchange(port, preamble("Double", metadata) + struct.pack("<I", END)))
            assert (report["code"], report["reason"]) == ("UNAUTHENTICATED", "REPLAYED_NONCE")
            # A frame whose header is not msgpack.
            bad = struct.pack("<I", 3) + b"\xc1\xc1\xc1"
            data = preamble("Double", auth.metadata("Double", 1)) + struct.pack("<I", len(bad)) + bad
            report = error_of(await raw_exchange(port, data))
            assert report["reason"] == "MALFORMED_FRAME"
            # An unknown method.
            report = error_of(await raw_exchange(port, preamble("Nope", auth.metadata("Nope", 1))))
            assert (report["code"], report["reason"]) == ("UNIMPLEMENTED", "UNKNOWN_METHOD")
            assert server.rejections["FRAME_TOO_LARGE"] == 2
            assert server.rejections["MALFORMED_FRAME"] == 2
            assert server.rejections["REPLAYED_NONCE"] == 1
        finally:
            await server.stop(0)

    run(body)


def test_falls_back_to_grpc_without_a_data_plane_and_under_tls() -> None:
    async def body() -> None:
        server = RpcServer(Authenticator(RUN, SECRET, "server"))  # no data_port: gRPC only
        server.add_stream("Double", doubler)
        address = await server.start()
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            answers = [
                f
                async for f in client.stream(
                    address, "Double", frames_of(({"i": 1}, b"ab")), round_id=2, timeout=5, bulk=True
                )
            ]
            assert bytes(answers[0].payload) == b"abab"
            assert client._data_ports == {address: None}
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_peer_that_vanishes_mid_stream_is_an_rpc_error() -> None:
    async def body() -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        loop = asyncio.get_running_loop()

        async def hang_up() -> None:
            conn, _ = await loop.sock_accept(listener)
            await asyncio.sleep(0.2)
            conn.close()  # no answer, no END: what a SIGKILLed peer looks like

        server_task = asyncio.create_task(hang_up())
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        client._data_ports["127.0.0.1:1"] = port
        try:
            with pytest.raises(RpcError) as info:
                async for _ in client.stream(
                    "127.0.0.1:1", "Double", frames_of(({"i": 0}, b"x")), round_id=1, timeout=5, bulk=True
                ):
                    pass
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert "127.0.0.1:1" not in client._data_ports  # asked again next time
        finally:
            await server_task
            listener.close()
            await client.close()

    run(body)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tune_malloc_applies_on_glibc() -> None:
    assert tune_malloc() is True


def _sysctl(path: str, field: int = 0) -> int:
    with open(path) as f:
        return int(f.read().split()[field])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's net sysctls")
def test_socket_buffers_are_sized_for_long_fat_links() -> None:
    ceiling, autotuned = _sysctl("/proc/sys/net/core/wmem_max"), _sysctl("/proc/sys/net/ipv4/tcp_wmem", 2)
    with socket.socket() as default, socket.socket() as kernel, socket.socket() as explicit:
        before = default.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        size_socket_buffers(default, 0)
        after = default.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        if 2 * ceiling > autotuned:  # an explicit send buffer reaches further than autotuning would
            assert after == 2 * ceiling, (after, ceiling)
        else:
            assert after == before
        size_socket_buffers(kernel, -1)  # left to the kernel
        assert kernel.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == before
        size_socket_buffers(explicit, 1 << 20)
        assert explicit.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * min(1 << 20, ceiling)
        assert explicit.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * min(
            1 << 20, _sysctl("/proc/sys/net/core/rmem_max")
        )


async def doubled(client: RpcClient, address: str, n: int, round_id: int = 7) -> list[bytes]:
    items = [({"i": i}, bytes([i + 1]) * (100 + i)) for i in range(n)]
    return [
        bytes(f.payload)
        async for f in client.stream(
            address, "Double", frames_of(*items), round_id=round_id, timeout=10, bulk=True
        )
    ]


def test_a_stream_both_sides_ended_leaves_its_connection_to_the_next() -> None:
    async def body() -> None:
        server, address = await started()
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            for round_id in range(5):
                assert await doubled(client, address, 3, round_id) == [
                    bytes([i + 1]) * (200 + 2 * i) for i in range(3)
                ]
            assert client.connections.reused == 4  # one TCP connection for the five streams
            # two streams at once need two connections; both are kept for the next two
            first, second = await asyncio.gather(doubled(client, address, 2), doubled(client, address, 4))
            assert len(first) == 2 and len(second) == 4
            assert client.connections.reused == 5
            await asyncio.gather(doubled(client, address, 1), doubled(client, address, 1))
            assert client.connections.reused == 7
        finally:
            await client.close()
            await server.stop(0)

    run(body)


async def taker(ctx: CallContext, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
    """As the exchange's handler: takes just the frames its first header announces, never reads the END."""
    incoming = frames.__aiter__()
    first = await anext(incoming)
    rest = [await anext(incoming) for _ in range(first.header["more"])]
    yield Frame({"got": 1 + len(rest)}, b"")


def test_a_handler_that_took_just_its_frames_still_leaves_the_connection_to_the_next() -> None:
    """The client's END after the frames the handler took is read by the server, so the connection stays open
    for the next stream: one TCP (and TLS) handshake for many rounds of the exchange, not one per stream."""

    async def body() -> None:
        server, address = await started()
        server.add_stream("Take", taker)
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            for round_id in range(4):
                items = [({"more": 2}, b"a"), ({}, b"b" * 5000), ({}, b"c")]
                answers = [
                    f.header["got"]
                    async for f in client.stream(
                        address, "Take", frames_of(*items), round_id=round_id, timeout=10, bulk=True
                    )
                ]
                assert answers == [3]
            assert client.connections.reused == 3
            # a client that sends more than the handler takes: that connection is closed, the next is new
            items = [({"more": 0}, b"a"), ({}, b"surplus")]
            async for _ in client.stream(
                address, "Take", frames_of(*items), round_id=9, timeout=10, bulk=True
            ):
                pass
            assert client.connections.reused == 4  # the surplus stream went out on a kept connection
            await asyncio.sleep(0.2)  # the server's close of it (a few turns of this event loop) reaches us
            assert await doubled(client, address, 1) == [b"\x01" * 200]
            assert client.connections.reused == 4  # on a new connection: that one was not kept
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_a_stream_closed_early_takes_its_connection_with_it() -> None:
    async def body() -> None:
        server, address = await started()
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            items = [({"i": i}, b"x" * 10) for i in range(4)]
            answers = client.stream(address, "Double", frames_of(*items), round_id=1, timeout=10, bulk=True)
            async for _ in answers:
                break  # the caller cancels after the first answer
            await answers.aclose()
            assert await doubled(client, address, 2) == [b"\x01" * 200, b"\x02" * 202]
            assert client.connections.reused == 0  # the cancelled stream's connection was not kept
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_a_kept_connection_the_server_closed_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server closes a connection idle for IDLE_SECONDS, and a stopped server closes all of its own: the
    client's next stream finds the kept one closed and opens a new one; nothing fails."""
    import farloco.protocol.tcpstream as tcpstream

    monkeypatch.setattr(tcpstream, "IDLE_SECONDS", 0.2)

    async def body() -> None:
        server, address = await started()
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            await doubled(client, address, 1)
            await asyncio.sleep(0.5)  # past the server's idle time: it closed its end
            assert await doubled(client, address, 2) == [b"\x01" * 200, b"\x02" * 202]
            assert client.connections.reused == 0
            port, data_port = int(address.rsplit(":", 1)[1]), server.data_port
            await server.stop(0)
            again = RpcServer(Authenticator(RUN, SECRET, "server"), port=port, data_port=data_port)
            again.add_stream("Double", doubler)
            assert await again.start() == address
            try:
                assert await doubled(client, address, 1) == [b"\x01" * 200]
                assert client.connections.reused == 0
            finally:
                await again.stop(0)
        finally:
            await client.close()

    run(body)
