"""Links: unary calls to a peer over one kept-open, authenticated data-plane connection.

Why they exist. A round's agreement is a handful of small messages (ready records, the group, announcements)
that every member sends every other member the moment it is ready; the freeze lasts as long as the slowest of
them takes to reach its handler. An authenticated gRPC unary call to 7 processes on one 2-core host reaches the
last in 2.5 ms when idle and 8.5 ms after a second of sleep (what a member does through its inner steps), a line
on an open TCP connection in 0.2 and 2.2 ms (BENCHMARKS.md, "Where the freeze's milliseconds go"). A link is
such a connection: the TCP data plane's stream method `Link` (tcpstream.py), opened once per peer with the same
token as any call (sender, method, time, one-time nonce; TLS 1.3 beyond loopback), then kept open; each unary
call is one frame on it and its answer one frame back, matched by a call id, so calls never wait for each other.

On the wire (inside the stream's frames, `rpc.encode_frame`):
    request   header {"i": call id, "m": method, "r": round id, "t": the caller's timeout in seconds,
              "h": the call's header}, payload: the call's
    answer    header {"i": call id, "h": the answer's header}, payload: the answer's
              or {"i": call id, "e": [status name, reason, detail]} (a refusal, as `Reject`)

The handler of a call is the one `RpcServer.add_unary` registered for its method; it sees a `CallContext` with
the link's authenticated sender and the round the request names (the sender vouches for it as it does for every
other field of its messages); it is cancelled when the caller's timeout passes, as gRPC cancels a handler at the
call's deadline. A refusal is logged and counted like any other (`RpcServer.rejections`) and the
link keeps serving; a request whose shape is wrong in its call id ends the link with MALFORMED_FRAME.

The client side (`LinkPool`, owned by `RpcClient`) opens a link on the first call to an address, renews it after
`LINK_SECONDS`, and retries a call once on a new link when the one it went out on broke before it was answered
(the peer restarted, or the connection was reset): so a link call may reach its handler twice, and is only for
methods whose handlers take a repeat as the same message (`RpcClient.unary(link=True)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc

from farloco.protocol.errors import Reject, RpcError
from farloco.util.tasks import cancel_and_wait

log = logging.getLogger(__name__)

LINK_METHOD = "Link"
# A link is used for new calls this long, then drained (its answers still come) and a new one opened.
LINK_SECONDS = 300.0
# How long the data plane lets a link's stream run: its last calls' answers must be back by then.
LINK_STREAM_SECONDS = LINK_SECONDS + 120.0
# Calls a link serves at once; further requests wait in the kernel's buffers (TCP's backpressure).
MAX_IN_FLIGHT = 64
MAX_DETAIL_CHARS = 4096
LINK_LOST = "LINK_LOST"  # the link broke (connection lost, reset, its stream's deadline) before the answer
NO_LINKS = "NO_LINKS"  # the peer serves no links: its calls go over gRPC


def _int_field(header: Mapping[str, Any], key: str) -> int | None:
    value = header.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


async def serve_link(
    call: Any,
    frames: AsyncIterator[Any],
    *,
    handlers: Mapping[str, Callable[[Any, Any], Any]],
    on_reject: Callable[[str, Reject, str], object],
) -> AsyncIterator[Any]:
    """Serve one link (the stream handler of `LINK_METHOD`): run each request's unary handler as it comes, at
    most `MAX_IN_FLIGHT` at once, and yield each answer as it is ready."""
    from farloco.protocol.rpc import CallContext, Frame

    answers: asyncio.Queue[Any] = asyncio.Queue()
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    running: set[asyncio.Task[None]] = set()

    async def one(call_id: int, method: str, round_id: int, timeout: float, frame: Any) -> None:
        try:
            handler = handlers.get(method)
            if handler is None:
                raise Reject(
                    grpc.StatusCode.UNIMPLEMENTED,
                    "UNKNOWN_METHOD",
                    f"expected a unary method of {sorted(handlers)}, got {method!r:.80}",
                )
            try:
                async with asyncio.timeout(timeout):
                    answer = await handler(
                        CallContext(method=method, sender=call.sender, round_id=round_id), frame
                    )
            except TimeoutError:
                raise Reject(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "DEADLINE_EXCEEDED",
                    f"the caller's {timeout:.3f} s passed",
                ) from None
            answers.put_nowait(Frame({"i": call_id, "h": answer.header}, answer.payload))
        except Reject as rejection:
            on_reject(method, rejection, call.sender)
            refusal = [rejection.code.name, rejection.reason, rejection.detail[:MAX_DETAIL_CHARS]]
            answers.put_nowait(Frame({"i": call_id, "e": refusal}))
        except Exception as exc:
            log.exception("handler of %s failed for %s (on a link)", method, call.sender)
            failure = Reject(grpc.StatusCode.INTERNAL, "HANDLER_ERROR", type(exc).__name__)
            on_reject(method, failure, call.sender)
            answers.put_nowait(
                Frame({"i": call_id, "e": [failure.code.name, failure.reason, failure.detail]})
            )
        finally:
            slots.release()

    async def read() -> None:
        try:
            async for frame in frames:
                header = frame.header
                call_id = _int_field(header, "i")
                if call_id is None:
                    raise Reject(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "MALFORMED_FRAME",
                        f"expected a link request with a call id 'i' >= 0, got {header.get('i')!r:.40}",
                    )
                method, round_id, inner = header.get("m"), _int_field(header, "r"), header.get("h")
                timeout = header.get("t")
                await slots.acquire()
                if (
                    not isinstance(method, str)
                    or round_id is None
                    or not isinstance(inner, dict)
                    or not isinstance(timeout, float | int)
                    or isinstance(timeout, bool)
                    or not 0 < timeout <= LINK_STREAM_SECONDS
                ):
                    bad = Reject(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "MALFORMED_FRAME",
                        "expected a link request {i, m: method name, r: round id >= 0, t: timeout in (0, "
                        f"{LINK_STREAM_SECONDS:.0f}] s, h: header map}}, got m={method!r:.40} "
                        f"r={header.get('r')!r:.20} t={timeout!r:.20} h={type(inner).__name__}",
                    )
                    on_reject(str(method)[:80], bad, call.sender)
                    answers.put_nowait(Frame({"i": call_id, "e": [bad.code.name, bad.reason, bad.detail]}))
                    slots.release()
                    continue
                task = asyncio.create_task(
                    one(call_id, method, round_id, float(timeout), Frame(inner, frame.payload))
                )
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            if running:
                await asyncio.wait(set(running))
            answers.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (answer := await answers.get()) is not None:
            yield answer
        await reader  # a malformed request ends the link with its refusal
    finally:
        for task in (reader, *running):
            await cancel_and_wait(task)


Opener = Callable[[AsyncIterator[Any]], AsyncIterator[Any]]


class Link:
    """One kept-open link to a peer, client side: calls go out as frames, answers resolve them by call id."""

    def __init__(
        self, address: str, opener: Opener, on_end: Callable[[Link], object] = lambda link: None
    ) -> None:
        self.address = address
        self.opened = asyncio.get_running_loop().time()
        self.closed = False  # takes no new calls (drained, or broken)
        self._opener = opener
        self._outgoing: asyncio.Queue[Any] = asyncio.Queue()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._task = asyncio.create_task(self._run())
        self._task.add_done_callback(lambda _: on_end(self))

    async def _requests(self) -> AsyncIterator[Any]:
        while (frame := await self._outgoing.get()) is not None:
            yield frame

    async def _run(self) -> None:
        from farloco.protocol.rpc import Frame

        error = RpcError(grpc.StatusCode.UNAVAILABLE, LINK_LOST, f"the link to {self.address} ended")
        try:
            async for answer in self._opener(self._requests()):
                call_id = _int_field(answer.header, "i")
                future = self._pending.pop(call_id, None) if call_id is not None else None
                if future is None or future.done():
                    continue  # a call that timed out meanwhile
                refusal = answer.header.get("e")
                inner = answer.header.get("h")
                if isinstance(refusal, list) and len(refusal) == 3:
                    code = getattr(grpc.StatusCode, str(refusal[0]), grpc.StatusCode.UNKNOWN)
                    future.set_exception(RpcError(code, str(refusal[1]), f"{self.address}: {refusal[2]}"))
                elif isinstance(inner, dict):
                    future.set_result(Frame(inner, answer.payload))
                else:
                    future.set_exception(
                        RpcError(
                            grpc.StatusCode.INTERNAL,
                            "MALFORMED_FRAME",
                            f"answer on the link to {self.address}: expected {{i, h}} or {{i, e}}, "
                            f"got keys {sorted(answer.header)!r:.80}",
                        )
                    )
        except RpcError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED and exc.reason == "UNKNOWN_METHOD":
                error = RpcError(exc.code, NO_LINKS, exc.detail)  # a peer that serves no links
            elif exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                error = RpcError(grpc.StatusCode.UNAVAILABLE, LINK_LOST, exc.detail)
            else:  # refused as it opened (e.g. UNAUTHENTICATED): the peer's answer to every call on it
                error = exc
        except Exception as exc:  # our own side failed (e.g. a request over the size limit)
            error = RpcError(
                grpc.StatusCode.INTERNAL, LINK_LOST, f"{self.address}: {type(exc).__name__}: {exc}"
            )
        finally:
            self.closed = True
            pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(error)

    async def call(self, method: str, frame: Any, *, round_id: int, timeout: float) -> Any:
        """One request, its answer; raises RpcError (LINK_LOST when the link broke before the answer came)."""
        from farloco.protocol.rpc import Frame

        if self.closed:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, LINK_LOST, f"the link to {self.address} is closed")
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        self._outgoing.put_nowait(
            Frame(
                {
                    "i": call_id,
                    "m": method,
                    "r": round_id,
                    "t": min(float(timeout), LINK_STREAM_SECONDS),
                    "h": frame.header,
                },
                frame.payload,
            )
        )
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise RpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "DEADLINE_EXCEEDED",
                f"{method} at {self.address} (on a link): no answer within {timeout:.3f} s",
            ) from None
        finally:
            self._pending.pop(call_id, None)

    def drain(self) -> None:
        """Take no new calls; the ones in flight still get their answers, then the link ends."""
        if not self.closed:
            self.closed = True
            self._outgoing.put_nowait(None)

    async def close(self) -> None:
        self.drain()
        await cancel_and_wait(self._task, timeout=1.0)


class LinkPool:
    """The links of one `RpcClient`, one per address in use; `open(address)` makes one with the client's
    authenticated data-plane stream."""

    def __init__(self, open_link: Callable[[str], Opener]) -> None:
        self._open_link = open_link
        self._links: dict[str, Link] = {}
        self._draining: set[Link] = set()
        self.opened = 0  # links made, a metric of reconnects

    def _link(self, address: str) -> Link:
        link = self._links.get(address)
        if link is not None and not link.closed:
            if asyncio.get_running_loop().time() - link.opened < LINK_SECONDS:
                return link
            link.drain()
            self._draining.add(link)
        link = Link(address, self._open_link(address), self._draining.discard)
        self._links[address] = link
        self.opened += 1
        return link

    async def call(self, address: str, method: str, frame: Any, *, round_id: int, timeout: float) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        before = self.opened
        link = self._link(address)
        reused = self.opened == before
        try:
            return await link.call(method, frame, round_id=round_id, timeout=timeout)
        except RpcError as exc:
            # A link that broke under a call it was reused for (the peer restarted, a reset): once more on a
            # new one. A new link's own failure is the peer's answer.
            left = deadline - loop.time()
            if exc.reason != LINK_LOST or not reused or left <= 0:
                raise
        link = self._link(address)
        return await link.call(method, frame, round_id=round_id, timeout=left)

    async def close(self) -> None:
        links = [*self._links.values(), *self._draining]
        self._links, self._draining = {}, set()
        for link in links:
            with contextlib.suppress(Exception):
                await link.close()
