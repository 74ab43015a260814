"""Links (protocol/links.py): unary calls over one kept-open, authenticated data-plane connection per peer, over
real sockets on 127.0.0.1 (and TLS 1.3): the same handlers, answers, refusals and limits as gRPC calls; one
connection for many calls; calls that never wait for each other; a peer that restarts, refuses, or serves no
links; malformed link requests refused with their reason while the link keeps serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from farloco.protocol.auth import Authenticator
from farloco.protocol.links import LINK_METHOD, LINK_SECONDS
from farloco.protocol.rpc import (
    CallContext,
    Frame,
    Reject,
    RpcClient,
    RpcError,
    RpcServer,
    decode_frame_owned,
)
from farloco.protocol.tcpstream import open_stream
from farloco.protocol.transport import run_credentials

RUN = "run-links"
SECRET = b"links-secret"


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout=60))


class Served:
    """A server with a few unary methods that record what they were called with."""

    def __init__(self, **options: Any) -> None:
        self.server = RpcServer(Authenticator(RUN, SECRET, "server"), host="127.0.0.1", **options)
        self.calls: list[tuple[str, str, int, dict[str, Any], bytes]] = []
        self.server.add_unary("Echo", self.echo)
        self.server.add_unary("Slow", self.slow)
        self.server.add_unary("Refuse", self.refuse)
        self.server.add_unary("Crash", self.crash)
        self.release = asyncio.Event()
        self.cancelled = 0  # Slow handlers cancelled at their caller's deadline

    async def echo(self, ctx: CallContext, frame: Frame) -> Frame:
        self.calls.append((ctx.method, ctx.sender, ctx.round_id, frame.header, bytes(frame.payload)))
        return Frame(
            {"n": frame.header.get("n"), "sender": ctx.sender, "round": ctx.round_id},
            bytes(frame.payload)[::-1],
        )

    async def slow(self, ctx: CallContext, frame: Frame) -> Frame:
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return Frame({"slow": True})

    async def refuse(self, ctx: CallContext, frame: Frame) -> Frame:
        raise Reject(grpc.StatusCode.FAILED_PRECONDITION, "STALE_ROUND", f"round {ctx.round_id} is over")

    async def crash(self, ctx: CallContext, frame: Frame) -> Frame:
        raise RuntimeError("a bug in a handler")


async def serving(**options: Any) -> tuple[Served, str]:
    served = Served(**options)
    return served, await served.server.start()


def test_many_calls_ride_one_connection_and_reach_the_handler_as_grpc_calls_do() -> None:
    async def main() -> None:
        served, address = await serving(data_port=0)
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            for n in range(20):
                answer = await client.unary(
                    address, "Echo", Frame({"n": n}, b"abc%d" % n), round_id=n + 3, timeout=5.0, link=True
                )
                assert answer.header == {"n": n, "sender": "client", "round": n + 3}
                assert bytes(answer.payload) == (b"abc%d" % n)[::-1]
            assert client.links.opened == 1
            assert [c[2] for c in served.calls] == [n + 3 for n in range(20)]
            assert all(c[1] == "client" and c[0] == "Echo" for c in served.calls)
            # the same call over gRPC gets the same answer
            direct = await client.unary(address, "Echo", Frame({"n": 99}, b"xy"), round_id=7, timeout=5.0)
            assert (
                direct.header == {"n": 99, "sender": "client", "round": 7} and bytes(direct.payload) == b"yx"
            )
            assert client.unary_bytes["Echo"] > 0
        finally:
            await client.close()
            await served.server.stop()

    run(main)


def test_a_slow_call_never_holds_the_others_and_a_deadline_leaves_the_link_serving() -> None:
    async def main() -> None:
        served, address = await serving(data_port=0)
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            slow = asyncio.ensure_future(
                client.unary(address, "Slow", Frame({}), round_id=1, timeout=10.0, link=True)
            )
            await asyncio.sleep(0.05)
            start = time.monotonic()
            answer = await client.unary(address, "Echo", Frame({"n": 1}), round_id=1, timeout=5.0, link=True)
            assert answer.header["n"] == 1 and time.monotonic() - start < 1.0 and not slow.done()
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Slow", Frame({}), round_id=1, timeout=0.2, link=True)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.1)
            assert (
                served.cancelled == 1
            )  # the handler too was cancelled at the caller's deadline, as gRPC does
            served.release.set()
            assert (await slow).header == {"slow": True}
            assert (
                await client.unary(address, "Echo", Frame({"n": 2}), round_id=1, timeout=5.0, link=True)
            ).header["n"] == 2
            assert client.links.opened == 1
        finally:
            await client.close()
            await served.server.stop()

    run(main)


def test_refusals_keep_their_code_and_reason_are_counted_and_leave_the_link_open() -> None:
    async def main() -> None:
        served, address = await serving(data_port=0)
        client = RpcClient(Authenticator(RUN, SECRET, "client"), max_message_bytes=1 << 16)
        try:
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Refuse", Frame({}), round_id=4, timeout=5.0, link=True)
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.reason == "STALE_ROUND" and "round 4 is over" in info.value.detail
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Nope", Frame({}), round_id=4, timeout=5.0, link=True)
            assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNIMPLEMENTED, "UNKNOWN_METHOD")
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Crash", Frame({}), round_id=4, timeout=5.0, link=True)
            assert (info.value.code, info.value.reason) == (grpc.StatusCode.INTERNAL, "HANDLER_ERROR")
            with pytest.raises(RpcError) as info:  # refused before it is sent: the link is not touched
                await client.unary(
                    address, "Echo", Frame({}, b"x" * (1 << 17)), round_id=4, timeout=5.0, link=True
                )
            assert info.value.reason == "FRAME_TOO_LARGE"
            answer = await client.unary(address, "Echo", Frame({"n": 5}), round_id=4, timeout=5.0, link=True)
            assert answer.header["n"] == 5 and client.links.opened == 1
            assert served.server.rejections["STALE_ROUND"] == 1
            assert served.server.rejections["UNKNOWN_METHOD"] == 1
            assert served.server.rejections["HANDLER_ERROR"] == 1
        finally:
            await client.close()
            await served.server.stop()

    run(main)


def test_a_wrong_secret_is_refused_as_the_link_opens() -> None:
    async def main() -> None:
        served, address = await serving(data_port=0)
        client = RpcClient(Authenticator(RUN, b"another secret", "intruder"))
        try:
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Echo", Frame({"n": 1}), round_id=1, timeout=5.0, link=True)
            assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "BAD_SIGNATURE")
            assert served.calls == [] and served.server.rejections["BAD_SIGNATURE"] >= 1
        finally:
            await client.close()
            await served.server.stop()

    run(main)


def test_a_peer_restarted_on_the_same_ports_is_reached_on_a_new_link() -> None:
    async def main() -> None:
        served, address = await serving(data_port=0)
        data_port = served.server.data_port
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            await client.unary(address, "Echo", Frame({"n": 1}), round_id=1, timeout=5.0, link=True)
            await served.server.stop(0)
            grpc_port = address.rsplit(":", 1)[1]
            again = Served(port=int(grpc_port), data_port=data_port)
            assert await again.server.start() == address
            try:
                answer = await client.unary(
                    address, "Echo", Frame({"n": 2}), round_id=2, timeout=5.0, link=True
                )
                assert answer.header["n"] == 2 and [c[2] for c in again.calls] == [2]
                assert client.links.opened == 2
            finally:
                await again.server.stop()
            # nobody there any more: the caller is told, in a bounded time
            with pytest.raises(RpcError) as info:
                await client.unary(address, "Echo", Frame({"n": 3}), round_id=3, timeout=5.0, link=True)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            await client.close()

    run(main)


def test_a_peer_without_a_data_plane_is_called_over_grpc() -> None:
    async def main() -> None:
        served, address = await serving()  # no data plane: no links
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            for n in range(3):
                answer = await client.unary(
                    address, "Echo", Frame({"n": n}), round_id=1, timeout=5.0, link=True
                )
                assert answer.header["n"] == n
            assert len(served.calls) == 3
        finally:
            await client.close()
            await served.server.stop()

    run(main)


def test_links_ride_tls_when_the_client_has_its_material() -> None:
    async def main() -> None:
        served, address = await serving(data_port=0, tls=run_credentials(SECRET, RUN, "server"))
        client = RpcClient(Authenticator(RUN, SECRET, "client"), tls=run_credentials(SECRET, RUN, "client"))
        plain = RpcClient(Authenticator(RUN, SECRET, "plain"))
        try:
            answer = await client.unary(
                address, "Echo", Frame({"n": 1}, b"secret"), round_id=1, timeout=5.0, link=True
            )
            assert answer.header["n"] == 1 and bytes(answer.payload) == b"terces"
            assert client.links.opened == 1
            with pytest.raises(RpcError):  # a plaintext client gets no link (nor any call) through
                await plain.unary(address, "Echo", Frame({"n": 2}), round_id=1, timeout=3.0, link=True)
            assert len(served.calls) == 1
        finally:
            await client.close()
            await plain.close()
            await served.server.stop()

    run(main)


def test_malformed_link_requests_are_refused_with_their_reason() -> None:
    """Requests sent straight on a link's stream: a bad method, round or timeout is answered with MALFORMED_FRAME for that
    call and the link keeps serving; a request without a call id ends the link with MALFORMED_FRAME."""

    async def main() -> None:
        served, _ = await serving(data_port=0)
        auth = Authenticator(RUN, SECRET, "client")
        assert served.server.data_port is not None
        outgoing: asyncio.Queue[Frame | None] = asyncio.Queue()

        async def frames() -> AsyncIterator[Frame]:
            while (frame := await outgoing.get()) is not None:
                yield frame

        answers = open_stream(
            "127.0.0.1",
            served.server.data_port,
            LINK_METHOD,
            auth.metadata(LINK_METHOD, 0),
            frames(),
            timeout=10.0,
            max_message_bytes=1 << 20,
            decode=decode_frame_owned,
        )
        try:
            outgoing.put_nowait(Frame({"i": 1, "m": 7, "r": 0, "t": 5.0, "h": {}}))
            first = await answers.__anext__()
            assert first.header["i"] == 1 and first.header["e"][:2] == ["INVALID_ARGUMENT", "MALFORMED_FRAME"]
            outgoing.put_nowait(Frame({"i": 2, "m": "Echo", "r": -1, "t": 5.0, "h": {}}))
            second = await answers.__anext__()
            assert second.header["i"] == 2 and second.header["e"][1] == "MALFORMED_FRAME"
            outgoing.put_nowait(Frame({"i": 3, "m": "Echo", "r": 5, "t": 5.0, "h": {"n": 9}}, b"ok"))
            third = await answers.__anext__()
            assert third.header == {"i": 3, "h": {"n": 9, "sender": "client", "round": 5}}
            assert bytes(third.payload) == b"ko"
            outgoing.put_nowait(Frame({"i": 4, "m": "Echo", "r": 5, "t": -1.0, "h": {}}))
            fourth = await answers.__anext__()
            assert fourth.header["i"] == 4 and fourth.header["e"][1] == "MALFORMED_FRAME"
            assert "t=-1.0" in fourth.header["e"][2]
            outgoing.put_nowait(Frame({"m": "Echo", "r": 5, "h": {}}))
            with pytest.raises(RpcError) as info:
                await answers.__anext__()
            assert info.value.reason == "MALFORMED_FRAME" and "call id" in info.value.detail
            assert served.server.rejections["MALFORMED_FRAME"] == 4
        finally:
            outgoing.put_nowait(None)
            await answers.aclose()
            await served.server.stop()

    run(main)


def test_a_link_is_renewed_after_its_lifetime(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        served, address = await serving(data_port=0)
        client = RpcClient(Authenticator(RUN, SECRET, "client"))
        try:
            await client.unary(address, "Echo", Frame({"n": 1}), round_id=1, timeout=5.0, link=True)
            (link,) = client.links._links.values()
            link.opened -= LINK_SECONDS + 1  # as if it had served its time
            await client.unary(address, "Echo", Frame({"n": 2}), round_id=1, timeout=5.0, link=True)
            assert client.links.opened == 2
            await asyncio.sleep(0.2)
            assert link.closed and not client.links._draining  # the old one drained and ended
            assert len(served.calls) == 2
        finally:
            await client.close()
            await served.server.stop()

    run(main)
