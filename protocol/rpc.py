"""farloco's RPC transport: frames on the wire, one authenticated grpc.aio server per node, pooled clients.

Every farloco RPC is a generic raw-bytes gRPC method `/farloco.v1/<Method>` (no .proto, no protobuf, no
pickle). Each message is a *frame*: `u32 little-endian header length | msgpack header (a dict) | raw payload`.
Handlers receive decoded frames plus a `CallContext` holding the sender authenticated by `Authenticator`; they
refuse a request by raising `Reject`, which the server logs, counts in `RpcServer.rejections` and turns into a
gRPC status whose trailing metadata carries the stable reason. Callers only ever see `RpcError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import msgpack

from farloco.protocol.auth import Authenticator
from farloco.protocol.errors import FrameError, Reject, RpcError
from farloco.protocol.links import LINK_METHOD, LINK_STREAM_SECONDS, NO_LINKS, LinkPool, Opener, serve_link
from farloco.protocol.tcpstream import ConnectionPool, DataServer, Sink, open_stream
from farloco.protocol.transport import TlsConfig, ssl_context
from farloco.protocol.types import NO_INBOUND
from farloco.util.addresses import join_host_port, split_host_port

__all__ = [
    "SERVICE",
    "CallContext",
    "Frame",
    "FrameError",
    "Reject",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "Sink",
    "StreamHandler",
    "TlsConfig",
    "UnaryHandler",
    "decode_frame",
    "encode_frame",
]

log = logging.getLogger(__name__)

SERVICE = "farloco.v1"
# Built-in unary method: where this server's TCP data plane listens ({"port": int} or {"port": None}).
DATA_ADDRESS_METHOD = "DataAddress"
REASON_KEY = "farloco-reason"
NOT_DIALLABLE = "NOT_DIALLABLE"  # the reason of every call to a peer that accepts no inbound connection
# Headers are small dicts (ids, shapes, indices); anything bigger is an attack or a bug.
DEFAULT_MAX_HEADER_BYTES = 64 << 10
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class Frame:
    """One message: a msgpack-able header (str/int/float/bool/bytes/list/dict) and raw payload bytes."""

    header: dict[str, Any]
    payload: bytes | memoryview = b""


def encode_frame(frame: Frame) -> bytes:
    """Serialise a frame as `u32 LE header length | msgpack header | payload` (one copy of the payload)."""
    return b"".join((encode_frame_header(frame), frame.payload))


def encode_frame_header(frame: Frame) -> bytes:
    """`u32 LE header length | msgpack header` of a frame: what precedes its payload on the wire."""
    if not isinstance(frame.header, dict):
        raise TypeError(f"Frame.header must be a dict, got {type(frame.header).__name__}")
    try:
        header: bytes = msgpack.packb(frame.header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"Frame.header must hold only str/int/float/bool/bytes/list/dict values: {exc}"
        ) from exc
    return _LEN.pack(len(header)) + header


def decode_frame_owned(data: memoryview) -> Frame:
    """decode_frame for a buffer the caller owns (the data plane's receive buffers): the payload is a writable
    view, so tensors can view it in place."""
    return decode_frame(data, max_header_bytes=DEFAULT_MAX_HEADER_BYTES)


def decode_frame(data: bytes | bytearray | memoryview, *, max_header_bytes: int) -> Frame:
    """Parse a frame; the payload is a zero-copy memoryview into `data`. Raises FrameError on bad input.

    The header length is checked against `max_header_bytes` and the data size before anything is unpacked.
    """
    size = len(data)
    if size < _LEN.size:
        raise FrameError("MALFORMED_FRAME", f"expected at least {_LEN.size} bytes of frame, got {size}")
    (header_len,) = _LEN.unpack_from(data, 0)
    if header_len > max_header_bytes:
        raise FrameError(
            "FRAME_TOO_LARGE", f"header of {header_len} bytes exceeds the limit of {max_header_bytes} bytes"
        )
    if _LEN.size + header_len > size:
        raise FrameError(
            "MALFORMED_FRAME",
            f"header claims {header_len} bytes but only {size - _LEN.size} follow the length",
        )
    view = memoryview(data)
    header = decode_frame_header(view[_LEN.size : _LEN.size + header_len])
    return Frame(header, view[_LEN.size + header_len :])


def decode_frame_header(data: bytes | memoryview) -> dict[str, Any]:
    """The msgpack header of a frame (without its length prefix); raises FrameError if it is not a map."""
    try:
        header = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types (ExtraData, FormatError, ValueError...)
        raise FrameError(
            "MALFORMED_FRAME", f"header is not valid msgpack: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(header, dict):
        raise FrameError("MALFORMED_FRAME", f"header must be a msgpack map, got {type(header).__name__}")
    return header


@dataclass(frozen=True)
class CallContext:
    """Who called what: the method name, the authenticated sender peer_id and the round from its token."""

    method: str
    sender: str
    round_id: int


UnaryHandler = Callable[[CallContext, Frame], Awaitable[Frame]]
StreamHandler = Callable[[CallContext, AsyncIterator[Frame]], AsyncIterator[Frame]]


KEEPALIVE_MS = 10_000


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Bulk transfer tuning, measured on loopback with 1 MiB messages (raw grpc.aio stream, one direction):
        # ~0.5 GiB/s with defaults, ~0.9 GiB/s with these. gRPC's default 16 KiB HTTP/2 frames and small TCP
        # read chunks cost a Python-visible wakeup per few KiB.
        ("grpc.http2.max_frame_size", (1 << 24) - 1),
        ("grpc.http2.write_buffer_size", 8 << 20),
        ("grpc.experimental.tcp_read_chunk_size", 1 << 20),
        ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
        ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20),
        # A connection that died silently (a partition, a peer's host gone: no RST ever comes) is found by
        # HTTP/2 pings within ~15 s instead of after TCP's retransmission back-off, which left calls stalled on a
        # healed link for many seconds and then failed them. The server side accepts pings that often.
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ]


def _check_method(method: str) -> None:
    if not method or "/" in method or not method.isascii():
        raise ValueError(f"method must be a plain ASCII name such as 'Exchange', got {method!r}")


class RpcServer:
    """One grpc.aio server per node serving every registered farloco method, authenticated per call.

    Handlers may be added before or after `start()`; methods are looked up per call.
    """

    def __init__(
        self,
        auth: Authenticator,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = 8 << 20,
        tls: TlsConfig | None = None,
        data_port: int | None = None,
        socket_buffer_bytes: int = 0,
    ) -> None:
        self.auth = auth
        self.socket_buffer_bytes = socket_buffer_bytes  # the data plane's (tcpstream.size_socket_buffers)
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        # The TCP data plane for stream methods (see tcpstream.py): TLS 1.3 with the same certificates as gRPC
        # when `tls` is given, else plaintext.
        self.data_port = data_port
        self.rejections: Counter[str] = Counter()
        self._unary: dict[str, UnaryHandler] = {}
        self._stream: dict[str, StreamHandler] = {}
        self._server: grpc.aio.Server | None = None
        self._data: DataServer | None = None
        self.address: str | None = None
        self.add_unary(DATA_ADDRESS_METHOD, self._on_data_address)
        self.add_stream(LINK_METHOD, self._serve_link)

    def add_unary(self, method: str, handler: UnaryHandler) -> None:
        """Serve `/farloco.v1/<method>` as a unary call handled by `handler`."""
        self._register(method)
        self._unary[method] = handler

    def add_stream(self, method: str, handler: StreamHandler) -> None:
        """Serve `/farloco.v1/<method>` as a bidirectional stream handled by `handler`."""
        self._register(method)
        self._stream[method] = handler

    def _register(self, method: str) -> None:
        _check_method(method)
        if method in self._unary or method in self._stream:
            raise ValueError(f"method {method!r} is already registered on this server")

    async def start(self) -> str:
        """Bind and start serving; return the "host:port" actually bound."""
        if self._server is not None:
            raise RuntimeError(f"RpcServer already started on {self.address}")
        server = grpc.aio.server(options=_channel_options(self.max_message_bytes))
        server.add_generic_rpc_handlers((_Dispatcher(self),))
        target = join_host_port(self.host, self.port)
        if self.tls is None:
            port = server.add_insecure_port(target)
        else:
            credentials = grpc.ssl_server_credentials(
                [(self.tls.private_key, self.tls.certificate_chain)],
                root_certificates=self.tls.root_certificates,
                require_client_auth=True,
            )
            port = server.add_secure_port(target, credentials)
        if port == 0:
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE, "BIND_FAILED", f"could not bind gRPC server to {target}"
            )
        if self.data_port is not None:
            data = DataServer(
                self.host,
                self.data_port,
                self.max_message_bytes,
                self._open_data_stream,
                self._reject,
                socket_buffer_bytes=self.socket_buffer_bytes,
                ssl_context=None if self.tls is None else ssl_context(self.tls, server=True),
            )
            try:
                self.data_port = await data.start()
            except RpcError:
                await server.stop(0)
                raise
            self._data = data
        await server.start()
        self._server = server
        self.address = join_host_port(self.host, port)
        return self.address

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving; in-flight calls get `grace` seconds to finish."""
        if self._data is not None:
            await self._data.stop()
            self._data = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def _on_data_address(self, call: CallContext, frame: Frame) -> Frame:
        # Only the port: the caller reaches it on the host it already reaches our gRPC port on.
        return Frame({"port": self.data_port if self._data is not None else None})

    def _serve_link(self, call: CallContext, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
        """The built-in stream `Link` (protocol/links.py): unary calls over one kept-open connection."""
        return serve_link(call, frames, handlers=self._unary, on_reject=self._reject)

    async def _open_data_stream(
        self, method: str, metadata: list[tuple[str, str]]
    ) -> tuple[CallContext, StreamHandler]:
        """Authenticate a data-plane stream exactly like a gRPC call and find its handler."""
        if method not in self._stream:
            raise Reject(
                grpc.StatusCode.UNIMPLEMENTED,
                "UNKNOWN_METHOD",
                f"expected a stream method of {sorted(self._stream)}, got {method!r:.80}",
            )
        sender, round_id = self.auth.verify(method, metadata)
        return CallContext(method=method, sender=sender, round_id=round_id), self._stream[method]

    # -- per-call plumbing -------------------------------------------------------------------------------

    def _reject(self, method: str, rejection: Reject, sender: str = "?") -> tuple[grpc.StatusCode, str]:
        self.rejections[rejection.reason] += 1
        log.warning(
            "rejected %s from %s: %s reason=%s %s",
            method,
            sender,
            rejection.code.name,
            rejection.reason,
            rejection.detail,
        )
        return rejection.code, f"reason={rejection.reason} {rejection.detail}"

    def _authenticate(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> CallContext:
        metadata = context.invocation_metadata() or ()
        sender, round_id = self.auth.verify(method, [(m[0], m[1]) for m in metadata])
        return CallContext(method=method, sender=sender, round_id=round_id)

    def _decode(self, data: bytes) -> Frame:
        try:
            return decode_frame(data, max_header_bytes=DEFAULT_MAX_HEADER_BYTES)
        except FrameError as exc:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, exc.reason, exc.detail) from None

    async def _abort(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, rejection: Reject, sender: str
    ) -> None:
        code, details = self._reject(method, rejection, sender)
        await context.abort(code, details, trailing_metadata=((REASON_KEY, rejection.reason),))

    async def _serve_unary(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        sender = "?"
        try:
            call = self._authenticate(method, context)
            sender = call.sender
            response = await self._unary[method](call, self._decode(request))
            return encode_frame(response)
        except Reject as rejection:
            await self._abort(context, method, rejection, sender)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            log.exception("handler of %s failed for %s", method, sender)
            await self._abort(
                context,
                method,
                Reject(grpc.StatusCode.INTERNAL, "HANDLER_ERROR", f"{type(exc).__name__}"),
                sender,
            )
        raise AssertionError("unreachable: context.abort always raises")

    async def _serve_stream(
        self, method: str, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        sender = "?"
        try:
            call = self._authenticate(method, context)
            sender = call.sender

            async def frames() -> AsyncIterator[Frame]:
                async for data in requests:
                    yield self._decode(data)

            async for response in self._stream[method](call, frames()):
                yield encode_frame(response)
        except Reject as rejection:
            await self._abort(context, method, rejection, sender)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            log.exception("stream handler of %s failed for %s", method, sender)
            await self._abort(
                context,
                method,
                Reject(grpc.StatusCode.INTERNAL, "HANDLER_ERROR", f"{type(exc).__name__}"),
                sender,
            )


class _Dispatcher(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc ships no type hints
    """Routes `/farloco.v1/<Method>` to the server's registered handlers (raw bytes in and out)."""

    def __init__(self, server: RpcServer) -> None:
        self._server = server

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        path: str = handler_call_details.method
        prefix = f"/{SERVICE}/"
        if not path.startswith(prefix):
            return None
        method = path[len(prefix) :]
        server = self._server
        if method in server._unary:

            async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
                return await server._serve_unary(method, request, context)

            return grpc.unary_unary_rpc_method_handler(unary)
        if method in server._stream:
            # grpc.aio only treats a handler as streaming if it is itself an async generator function.
            async def stream(
                requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[bytes]:
                async for response in server._serve_stream(method, requests, context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(stream)
        return None


def _check_dialable(address: str) -> None:
    """RpcError (NOT_DIALLABLE) for the address of a peer behind NAT: nobody calls it, it calls us."""
    if address == NO_INBOUND:
        raise RpcError(
            grpc.StatusCode.UNAVAILABLE,
            NOT_DIALLABLE,
            "this peer accepts no inbound connection (behind NAT): it calls us, we never call it",
        )


def _to_rpc_error(exc: grpc.aio.AioRpcError, address: str, method: str) -> RpcError:
    code = exc.code()
    reason = code.name
    for key, value in exc.trailing_metadata() or ():
        if key == REASON_KEY and isinstance(value, str):
            reason = value
    details = exc.details() or ""
    prefix = f"reason={reason} "
    if details.startswith(prefix):
        details = details[len(prefix) :]
    return RpcError(code, reason, f"{method} at {address}: {details}")


def _closed_channel_error(address: str, method: str) -> BaseException:
    """What a call that raised asyncio.CancelledError fails with. grpc.aio raises it in the awaiting task when the
    call was cancelled locally (its channel closed: `RpcClient.close`, a dropped-connections fault) though nobody
    cancelled that task; passed on, it ends whatever awaited the call as if that had been asked to stop. Such a
    call fails like a lost connection; a task that is being cancelled gets its CancelledError back."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return asyncio.CancelledError()
    return RpcError(
        grpc.StatusCode.UNAVAILABLE,
        "CHANNEL_CLOSED",
        f"{method} at {address}: our channel to it was closed while the call was in flight",
    )


class RpcClient:
    """Calls farloco methods on other nodes; one channel per remote address, reused across calls."""

    def __init__(
        self,
        auth: Authenticator,
        *,
        max_message_bytes: int = 8 << 20,
        tls: TlsConfig | None = None,
        socket_buffer_bytes: int = 0,
    ) -> None:
        self.auth = auth
        self.socket_buffer_bytes = socket_buffer_bytes
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        self._ssl = None if tls is None else ssl_context(tls, server=False)  # the data plane's client side
        self._channels: dict[str, grpc.aio.Channel] = {}
        # gRPC address -> the peer's data-plane port, or None where it has none (then streams ride gRPC).
        self._data_ports: dict[str, int | None] = {}
        # method -> bytes of our unary calls (request, its auth metadata, the answer): the control traffic, which
        # the benchmarks weigh per peer (gRPC's own framing and the streams' payloads are not counted).
        self.unary_bytes: Counter[str] = Counter()
        # Idle data-plane connections by peer: the next stream to a peer takes one instead of a new handshake.
        self.connections = ConnectionPool()
        self.links = LinkPool(self._open_link)
        self._no_links: set[str] = set()  # addresses whose peer serves no links (no data plane)

    def _open_link(self, address: str) -> Opener:
        def opener(frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
            return self._link_stream(address, frames)

        return opener

    async def _link_stream(self, address: str, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
        """A link's stream (protocol/links.py): the peer's data plane, authenticated as `LINK_METHOD`."""
        port = await self._data_port(address, 0, 10.0)
        if port is None:
            raise RpcError(grpc.StatusCode.UNIMPLEMENTED, "UNKNOWN_METHOD", f"{address} has no data plane")
        async for answer in self._data_stream(address, port, LINK_METHOD, 0, frames, LINK_STREAM_SECONDS):
            yield answer

    async def _data_stream(
        self,
        address: str,
        port: int,
        method: str,
        round_id: int,
        frames: AsyncIterator[Frame],
        timeout: float,
        sink: Sink | None = None,
    ) -> AsyncIterator[Frame]:
        """One stream on the peer's data plane (tcpstream.open_stream), on a kept connection when there is one."""
        host = split_host_port(address)[0]
        try:
            async for answer in open_stream(
                host,
                port,
                method,
                self.auth.metadata(method, round_id),
                frames,
                timeout=timeout,
                max_message_bytes=self.max_message_bytes,
                decode=lambda data: self._decode_owned(data, address, method),
                sink=sink,
                socket_buffer_bytes=self.socket_buffer_bytes,
                ssl_context=self._ssl,
                server_name=None if self.tls is None else self.tls.server_name or host,
                pool=self.connections,
            ):
                yield answer
        except RpcError as exc:
            if exc.code == grpc.StatusCode.UNAVAILABLE:
                self._data_ports.pop(address, None)  # it may have restarted elsewhere: ask again next time
            raise

    def _channel(self, address: str) -> grpc.aio.Channel:
        _check_dialable(address)
        channel = self._channels.get(address)
        if channel is None:
            options: list[tuple[str, Any]] = list(_channel_options(self.max_message_bytes))
            if self.tls is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                credentials = grpc.ssl_channel_credentials(
                    root_certificates=self.tls.root_certificates,
                    private_key=self.tls.private_key,
                    certificate_chain=self.tls.certificate_chain,
                )
                if self.tls.server_name:
                    options.append(("grpc.ssl_target_name_override", self.tls.server_name))
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            self._channels[address] = channel
        return channel

    def _decode(self, data: bytes, address: str, method: str) -> Frame:
        try:
            return decode_frame(data, max_header_bytes=DEFAULT_MAX_HEADER_BYTES)
        except FrameError as exc:
            raise RpcError(
                grpc.StatusCode.INTERNAL, exc.reason, f"answer of {method} at {address}: {exc.detail}"
            ) from None

    async def answers(self, address: str, *, round_id: int, timeout: float) -> bool:
        """Whether the node at `address` answers an authenticated call (`DataAddress`, served by its event loop)
        within `timeout` seconds. A refusal with a reason of its own is an answer too (it runs); a deadline, a
        reset or a refused connection is not: a frozen process (its kernel still accepts connections), a dead one
        or a partition."""
        try:
            await self.unary(address, DATA_ADDRESS_METHOD, Frame({}), round_id=round_id, timeout=timeout)
        except RpcError as exc:
            return bool(exc.reason not in (exc.code.name, NOT_DIALLABLE))
        except (OSError, TimeoutError):
            return False
        return True

    async def unary(
        self, address: str, method: str, frame: Frame, *, round_id: int, timeout: float, link: bool = False
    ) -> Frame:
        """One request, one answer; raises RpcError on any failure.

        `link=True` sends it over the kept-open link to the peer (protocol/links.py) when it serves links, else
        over gRPC: the same handler, authentication, limits and errors; a link call may reach the handler twice
        (retried once when its link broke), so only for messages whose handler takes a repeat as the same."""
        _check_method(method)
        request = encode_frame(frame)
        if len(request) > self.max_message_bytes:
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "FRAME_TOO_LARGE",
                f"{method} request of {len(request)} bytes exceeds max_message_bytes={self.max_message_bytes}",
            )
        if link and address not in self._no_links:
            _check_dialable(address)
            try:
                answer: Frame = await self.links.call(
                    address, method, frame, round_id=round_id, timeout=timeout
                )
            except RpcError as exc:
                if exc.reason != NO_LINKS:
                    raise
                self._no_links.add(address)
            else:
                self.unary_bytes[method] += len(request) + len(encode_frame(answer))
                return answer
        call = self._channel(address).unary_unary(f"/{SERVICE}/{method}")
        metadata = self.auth.metadata(method, round_id)
        self.unary_bytes[method] += len(request) + sum(len(k) + len(v) for k, v in metadata)
        try:
            response = await call(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise _to_rpc_error(exc, address, method) from None
        except asyncio.CancelledError:
            raise _closed_channel_error(address, method) from None
        self.unary_bytes[method] += len(response)
        return self._decode(response, address, method)

    async def stream(
        self,
        address: str,
        method: str,
        frames: AsyncIterator[Frame],
        *,
        round_id: int,
        timeout: float,
        bulk: bool = False,
        sink: Sink | None = None,
    ) -> AsyncIterator[Frame]:
        """Bidirectional stream: send `frames`, yield the answers; raises RpcError on any failure.

        `bulk=True` sends it over the peer's TCP data plane when it has one (with TLS when this client has TLS
        material), else over gRPC: same frames, authentication, limits and errors either way. On the
        data plane, `sink(header, payload_bytes)` may name where an answer's payload is received (a writable
        memoryview of exactly that size, or None for a new buffer): the answer's payload is then that memory.
        Closing the returned iterator early cancels the call.
        """
        _check_method(method)
        limit = self.max_message_bytes
        _check_dialable(address)  # before any frame is taken
        port = await self._data_port(address, round_id, timeout) if bulk else None
        if port is not None:
            async for answer in self._data_stream(address, port, method, round_id, frames, timeout, sink):
                yield answer
            return

        async def requests() -> AsyncIterator[bytes]:
            async for frame in frames:
                data = encode_frame(frame)
                if len(data) > limit:
                    raise RpcError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "FRAME_TOO_LARGE",
                        f"{method} frame of {len(data)} bytes exceeds max_message_bytes={limit}",
                    )
                yield data

        multicallable = self._channel(address).stream_stream(f"/{SERVICE}/{method}")
        call = multicallable(requests(), timeout=timeout, metadata=self.auth.metadata(method, round_id))
        try:
            async for response in call:
                yield self._decode(response, address, method)
        except grpc.aio.AioRpcError as exc:
            raise _to_rpc_error(exc, address, method) from None
        except asyncio.CancelledError:
            raise _closed_channel_error(address, method) from None
        finally:
            call.cancel()

    def _decode_owned(self, data: memoryview, address: str, method: str) -> Frame:
        try:
            return decode_frame_owned(data)
        except FrameError as exc:
            raise RpcError(
                grpc.StatusCode.INTERNAL, exc.reason, f"answer of {method} at {address}: {exc.detail}"
            ) from None

    async def _data_port(self, address: str, round_id: int, timeout: float) -> int | None:
        """The peer's data-plane port (asked once per address over gRPC), None if it has none."""
        if address in self._data_ports:
            return self._data_ports[address]
        try:
            answer = await self.unary(
                address, DATA_ADDRESS_METHOD, Frame({}), round_id=round_id, timeout=min(timeout, 10.0)
            )
        except RpcError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            port = None  # an older peer without a data plane
        else:
            value = answer.header.get("port")
            port = (
                value
                if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536
                else None
            )
        self._data_ports[address] = port
        return port

    async def close(self) -> None:
        """Close every link and channel."""
        await self.links.close()
        self.connections.close()
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()


async def knock(address: str, timeout: float) -> str:
    """A bare TCP connection to `address` (no handshake, nothing sent): "refused" (no process listens there: it
    is gone, and serves nothing), "silent" (no answer within `timeout`, another error, or a malformed address: a
    frozen host, a partition) or "open" (something accepted it)."""
    try:
        host, port = split_host_port(address)
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), max(0.001, timeout))
    except ConnectionRefusedError:
        return "refused"
    except (OSError, TimeoutError, ValueError):
        return "silent"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return "open"
