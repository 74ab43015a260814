"""farloco's bulk data plane: the same authenticated bidirectional frame streams as gRPC, over plain TCP.

Why it exists. Python gRPC copies every message twice beyond the kernel's own copies (into and out of its
slices) and wakes its poller thread per message; for the exchange's tens to hundreds of MiB per round that made
farloco's fp32 exchange cost ~3x the CPU of torch.distributed's gloo all_reduce (see BENCHMARKS.md). Here a
chunk goes from the tensor's memory to `send` and from `recv_into` to a buffer the reducer sums from: the kernel
copies are the only ones. It also carries links (protocol/links.py: the round's small unary messages on
one kept-open stream per peer, votes among them). Everything else stays on gRPC: state sync, and the way a
caller finds this listener (`DataAddress`, a unary gRPC method answered with the port).

It serves the handlers registered on an `RpcServer` with `add_stream` (the exchange's `ExchangePush`), with the
same `Authenticator` tokens (sender, method, round, time, one-time nonce), the same frames (`rpc.encode_frame`),
the same size caps before allocation, the same rejection counting and stable reasons; callers see the same
`RpcError`. With TLS material (protocol/transport.py) every connection is TLS 1.3 with a certificate both ways,
driven by the same event loop (`_TlsConn`); a record altered on the wire fails its tag and the stream ends with
the stable reason TAMPERED, counted like any refusal. Without it (loopback) the bytes are plaintext.

Connection layout (all integers little-endian):
    client -> server   b"FLC1" | u32 n | msgpack {"m": method, "md": [[key, value], ...], "t": timeout_s}
    then, both ways    u32 L | frame of L bytes        (L <= max_message_bytes, checked before allocating)
                       u32 END                        (this side has no more frames: a half-close)
                       u32 ERROR | u32 n | msgpack {"code": grpc status name, "reason": str, "detail": str}
The server answers with the handler's frames, then END. A stream both sides ended leaves the connection open:
the client may send the next stream's preamble on it (`ConnectionPool`: a client keeps an idle connection per
peer 20 s, the server waits 60 s for the next preamble); any other end closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import msgpack
import torch

from farloco.protocol.errors import FrameError, Reject, RpcError
from farloco.util.addresses import ip_version
from farloco.util.memory import libc_function
from farloco.util.tasks import cancel_and_wait, wait_for

log = logging.getLogger(__name__)

MAGIC = b"FLC1"
END = 0xFFFFFFFF
ERROR = 0xFFFFFFFE
MAX_PREAMBLE_BYTES = 64 << 10
MAX_ERROR_BYTES = 64 << 10
# A stream nobody bounded (or that claims more) is cut after this long.
MAX_STREAM_SECONDS = 3600.0
# A connection waits this long between streams for the next before the server closes it; a client keeps an
# idle one for less (`POOL_IDLE_SECONDS`), so it never sends on one the server is closing.
IDLE_SECONDS = 60.0
POOL_IDLE_SECONDS = 20.0
POOL_PER_PEER = 8  # idle connections a client keeps per peer (a part's lanes open several at once)
# After a handler that did not read the client's END (it took the frames it expected), how long the server waits
# for that END before it closes the connection instead of keeping it for the next stream.
END_WAIT_SECONDS = 5.0
_U32 = struct.Struct("<I")


def tune_malloc() -> bool:
    """Keep freed message-sized buffers in glibc's heap instead of mmap/munmap per message.

    Every received chunk is a fresh 1-2 MiB buffer; above glibc's default 128 KiB mmap threshold each one is a
    new mapping whose pages fault on first touch, which cost 21-29% of a bulk exchange's time in measurements.
    Same effect as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_/MALLOC_TOP_PAD_ in the environment. Returns
    False (and changes nothing) where glibc's mallopt is not available.
    """
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = bool(mallopt(m_mmap_threshold, 32 << 20))  # glibc's maximum on 64-bit
    ok = bool(mallopt(m_trim_threshold, 256 << 20)) and ok
    return bool(mallopt(m_top_pad, 64 << 20)) and ok


# A sysctl read is kept this long: every data-plane connection asks, an operator rarely changes one.
_SYSCTL_SECONDS = 60.0
_sysctls: dict[tuple[str, int], tuple[float, int | None]] = {}


def _sysctl_int(path: str, field: int = 0) -> int | None:
    now = time.monotonic()
    cached = _sysctls.get((path, field))
    if cached is not None and now - cached[0] < _SYSCTL_SECONDS:
        return cached[1]
    try:
        with open(path) as f:
            value: int | None = int(f.read().split()[field])
    except (OSError, ValueError, IndexError):
        value = None
    _sysctls[path, field] = (now, value)
    return value


_warned_buffers: set[int] = set()


def size_socket_buffers(sock: socket.socket, requested: int) -> None:
    """Size a data-plane socket's buffers for long fat links (call before connect or listen).

    `requested` > 0: SO_SNDBUF and SO_RCVBUF set to it (the kernel caps each at net.core.wmem_max/rmem_max,
    which bounds what one stream can keep in flight: window = buffer / RTT; a warning names the sysctl once).
    0 (the default): receive autotuning is kept (it grows to net.ipv4.tcp_rmem's max), and the send buffer is set
    to the kernel's ceiling for explicit sizes, 2 x net.core.wmem_max, where send autotuning would stop below it
    (net.ipv4.tcp_wmem's max: 4 MiB on most kernels, a window of 320 Mbit/s at 100 ms). Links with more in flight
    than one stream's window carry several streams per peer (network.streams_per_peer).
    """
    if requested > 0:
        for option, name, sysctl in (
            (socket.SO_SNDBUF, "SO_SNDBUF", "net.core.wmem_max"),
            (socket.SO_RCVBUF, "SO_RCVBUF", "net.core.rmem_max"),
        ):
            sock.setsockopt(socket.SOL_SOCKET, option, requested)
            got = sock.getsockopt(socket.SOL_SOCKET, option) // 2  # the kernel reports twice what it allows
            if got < requested and option not in _warned_buffers:
                _warned_buffers.add(option)
                log.warning(
                    "network.socket_buffer_bytes=%d: the kernel allows %s of %d bytes only; raise %s",
                    requested, name, got, sysctl,
                )  # fmt: skip
        return
    if requested < 0:
        return
    ceiling = _sysctl_int("/proc/sys/net/core/wmem_max")
    autotuned = _sysctl_int("/proc/sys/net/ipv4/tcp_wmem", 2)
    if ceiling is not None and autotuned is not None and 2 * ceiling > autotuned:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, ceiling)


def _status(name: Any) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.name == name and code != grpc.StatusCode.OK:
            return code
    return grpc.StatusCode.UNKNOWN


_OPEN: weakref.WeakSet[_Conn] = weakref.WeakSet()  # every data-plane connection of this process (drop_all)


def drop_all() -> int:
    """Chaos: shut every open data-plane connection of this process down, both ways, at once (the peers see
    them reset mid-stream, as when a link drops). Returns how many there were."""
    conns = list(_OPEN)
    for conn in conns:
        with contextlib.suppress(OSError):
            socket.socket.shutdown(
                conn.sock, socket.SHUT_RDWR
            )  # the TCP socket's: SSLSocket's drops its state
    return len(conns)


def _lost(where: str, exc: BaseException) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, "CONNECTION_LOST", f"{where}: connection lost: {exc}")


def _writer_error(writer: asyncio.Task[None], where: str) -> BaseException:
    """What the stream's writer failed with, a socket error as the caller's RpcError (CONNECTION_LOST): a raw
    OSError would escape every caller that handles RpcError, and its exchange attempt would wait for nothing."""
    exc = writer.exception()
    assert exc is not None
    return _lost(where, exc) if isinstance(exc, OSError) else exc


class _Conn:
    """One non-blocking TCP connection driven by the running event loop, with exact reads into new buffers."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        _OPEN.add(self)

    async def read_into(self, view: memoryview) -> None:
        got, size = 0, len(view)
        while got < size:
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise ConnectionResetError(f"{self.peer} closed the connection ({got} of {size} bytes read)")
            got += n

    async def read(self, size: int) -> memoryview:
        """`size` bytes into a new writable buffer. Not a bytearray: that zero-fills first, one more pass over
        every MiB received; torch's allocator hands out (with tune_malloc, recycled) memory as is."""
        buffer = (
            torch.empty(size, dtype=torch.uint8).numpy().data if size > 4096 else memoryview(bytearray(size))
        )
        if size:
            await self.read_into(buffer)
        return buffer

    async def read_u32(self) -> int:
        (value,) = _U32.unpack(await self.read(4))
        return int(value)

    async def write(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            if len(part):
                await self.loop.sock_sendall(self.sock, part)

    async def wait_readable(self) -> None:
        """Until the connection has bytes to read (or the peer's end of it)."""
        waiter: asyncio.Future[None] = self.loop.create_future()
        fd = self.sock.fileno()

        def readable() -> None:
            if not waiter.done():
                waiter.set_result(None)

        self.loop.add_reader(fd, readable)
        try:
            await waiter
        finally:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(fd)

    def _peek(self) -> bytes | None:
        """The next byte of the TCP socket without reading it: None when there is none yet, b"" at the peer's
        end (or a reset)."""
        try:
            return socket.socket.recv(self.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def at_eof(self) -> bool:
        """Whether the peer closed the connection (or reset it), without reading anything."""
        return self._peek() == b""

    def idle_and_open(self) -> bool:
        """Whether a connection between streams can carry the next: open, and nothing unread on it."""
        return self._peek() is None

    async def drain(self, seconds: float = 5.0) -> None:
        """Half-close, then discard what the peer still sends until it closes: closing a socket with unread
        bytes makes the kernel send a reset, which can destroy our last frames before the peer reads them."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        scratch = bytearray(64 << 10)
        with contextlib.suppress(OSError, ConnectionError, TimeoutError):
            async with asyncio.timeout(seconds):
                while await self.loop.sock_recv_into(self.sock, scratch):
                    pass

    def close(self) -> None:
        _OPEN.discard(self)
        with contextlib.suppress(OSError):
            self.sock.close()


# The stable reasons of the data plane's TLS failures (counted in RpcServer.rejections like any refusal).
TAMPERED = "TAMPERED"  # a record failed its tag: altered, cut or replayed on the wire
TLS_HANDSHAKE = (
    "TLS_HANDSHAKE"  # no common TLS: no certificate of the run's CA, plaintext, a wrong server name
)
HANDSHAKE_SECONDS = 10.0


class _TlsConn(_Conn):
    """A `_Conn` whose bytes are TLS 1.3 records: a non-blocking `ssl.SSLSocket` driven by the event loop.

    OpenSSL encrypts from the caller's memory and decrypts into it (no copy beyond the plaintext path's), with
    the GIL released. Reads and writes of one connection run on the loop's thread one at a time, as OpenSSL
    requires of one connection; each waits for the socket when OpenSSL asks (want read / want write).
    Not memory BIOs: their copy of the ciphertext each way made a 256 MiB echo 15% slower than this socket's
    syscall per record (measured on 2 cores)."""

    def __init__(self, sock: ssl.SSLSocket, peer: str) -> None:
        super().__init__(sock, peer)
        self.tls: ssl.SSLSocket = sock
        self._waiting: dict[bool, list[asyncio.Future[None]]] = {True: [], False: []}

    def _wake(self, readable: bool) -> None:
        (self.loop.remove_reader if readable else self.loop.remove_writer)(self.tls.fileno())
        waiters, self._waiting[readable] = self._waiting[readable], []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, readable: bool) -> None:
        """Until the socket is readable (or writable); several waiters share one registration."""
        waiter: asyncio.Future[None] = self.loop.create_future()
        if not self._waiting[readable]:
            add = self.loop.add_reader if readable else self.loop.add_writer
            add(self.tls.fileno(), self._wake, readable)
        self._waiting[readable].append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiting[readable]:
                self._waiting[readable].remove(waiter)
                if not self._waiting[readable] and self.tls.fileno() >= 0:
                    (self.loop.remove_reader if readable else self.loop.remove_writer)(self.tls.fileno())

    def idle_and_open(self) -> bool:
        return not self.tls.pending() and super().idle_and_open()

    async def wait_readable(self) -> None:
        if not self.tls.pending():
            await super().wait_readable()

    def at_eof(self) -> bool:
        return not self.tls.pending() and super().at_eof()

    async def handshake(self) -> None:
        """The TLS handshake; raises ssl.SSLError (a certificate not of the run's CA, plaintext, ...)."""
        while True:
            try:
                self.tls.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._wait(True)
            except ssl.SSLWantWriteError:
                await self._wait(False)

    async def read_into(self, view: memoryview) -> None:
        got, size = 0, len(view)
        while got < size:
            try:
                n = self.tls.recv_into(view[got:])
            except ssl.SSLWantReadError:
                await self._wait(True)
                continue
            except ssl.SSLWantWriteError:
                await self._wait(False)
                continue
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                n = 0
            except ssl.SSLError as exc:  # a record that fails its tag, or any TLS alert of the peer
                raise FrameError(TAMPERED, f"from {self.peer}: {exc.reason or exc}") from None
            if n == 0:
                raise ConnectionResetError(f"{self.peer} closed the connection ({got} of {size} bytes read)")
            got += n

    async def write(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            if not len(part):
                continue
            while True:
                try:
                    self.tls.send(part)  # without partial writes OpenSSL takes all of it, or retries the same
                    break
                except ssl.SSLWantWriteError:
                    await self._wait(False)
                except ssl.SSLWantReadError:
                    await self._wait(True)

    async def drain(self, seconds: float = 5.0) -> None:
        """As `_Conn.drain`; the half-close is the TCP socket's (our last record is already sent), so the peer
        sees the end of the stream after reading every record, and we go on reading its records."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.tls, socket.SHUT_WR)
        scratch = bytearray(64 << 10)
        with contextlib.suppress(
            OSError, TimeoutError
        ):  # ssl.SSLError is an OSError: a failed record ends it
            async with asyncio.timeout(seconds):
                while True:
                    try:
                        if not self.tls.recv_into(scratch):
                            return
                    except ssl.SSLWantReadError:
                        await self._wait(True)
                    except ssl.SSLWantWriteError:
                        await self._wait(False)

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):  # a closed socket's fileno() is -1
            if self.tls.fileno() >= 0:
                self.loop.remove_reader(self.tls.fileno())
                self.loop.remove_writer(self.tls.fileno())
        for readable in (True, False):
            for waiter in self._waiting[readable]:
                if not waiter.done():
                    waiter.set_exception(ConnectionResetError(f"connection to {self.peer} closed"))
        super().close()


async def _secure(
    sock: socket.socket,
    peer: str,
    context: ssl.SSLContext,
    *,
    server_side: bool,
    server_name: str | None = None,
) -> _TlsConn:
    """`sock` (connected) wrapped in TLS and its handshake done; raises ssl.SSLError, OSError or TimeoutError."""
    tls = context.wrap_socket(
        sock, server_side=server_side, do_handshake_on_connect=False, server_hostname=server_name
    )
    conn = _TlsConn(tls, peer)
    try:
        async with asyncio.timeout(HANDSHAKE_SECONDS):
            await conn.handshake()
    except BaseException:
        conn.close()
        raise
    return conn


def _frame_parts(frame: Any, limit: int, method: str) -> tuple[bytes, bytes | memoryview]:
    """(length prefix + frame header, payload) of a frame: the payload is sent from its own memory."""
    from farloco.protocol.rpc import encode_frame_header

    head = encode_frame_header(frame)
    size = len(head) + len(frame.payload)
    if size > limit:
        raise RpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "FRAME_TOO_LARGE",
            f"{method} frame of {size} bytes exceeds max_message_bytes={limit}",
        )
    return _U32.pack(size) + head, frame.payload


def _frame_error_code(exc: FrameError) -> grpc.StatusCode:
    return grpc.StatusCode.DATA_LOSS if exc.reason == TAMPERED else grpc.StatusCode.INVALID_ARGUMENT


async def _write_error(conn: _Conn, rejection: Reject) -> None:
    body = msgpack.packb(
        {"code": rejection.code.name, "reason": rejection.reason, "detail": rejection.detail[:4096]},
        use_bin_type=True,
    )
    await conn.write(_U32.pack(ERROR) + _U32.pack(len(body)) + body)


# Where the payload of an incoming frame should land: (header, payload bytes) -> writable memoryview or None.
Sink = Callable[[dict[str, Any], int], memoryview | None]


async def _read_frame_or_marker(
    conn: _Conn, limit: int, decode: Callable[[memoryview], Any], sink: Sink | None = None
) -> Any:
    """The next frame, END, or an ERROR's (code, reason, detail). Raises FrameError on a bad length."""
    size = await conn.read_u32()
    if size == END:
        return END
    if size == ERROR:
        length = await conn.read_u32()
        if length > MAX_ERROR_BYTES:
            raise FrameError("MALFORMED_FRAME", f"error report of {length} bytes (limit {MAX_ERROR_BYTES})")
        try:
            report = msgpack.unpackb(await conn.read(length), raw=False)
            return (_status(report["code"]), str(report["reason"]), str(report["detail"]))
        except Exception:  # any malformed report is the same failure to the caller
            return (grpc.StatusCode.UNKNOWN, "MALFORMED_FRAME", "unreadable error report")
    if size > limit:
        raise FrameError("FRAME_TOO_LARGE", f"frame of {size} bytes exceeds the limit of {limit} bytes")
    if sink is None or size < _U32.size:
        return decode(await conn.read(size))
    from farloco.protocol.rpc import DEFAULT_MAX_HEADER_BYTES, Frame, decode_frame_header

    # Header first, then the payload straight into the memory the consumer names (one copy fewer).
    header_len = await conn.read_u32()
    if header_len > min(size - _U32.size, DEFAULT_MAX_HEADER_BYTES):
        raise FrameError(
            "MALFORMED_FRAME",
            f"header of {header_len} bytes in a frame of {size} (limit {DEFAULT_MAX_HEADER_BYTES})",
        )
    header = decode_frame_header(await conn.read(header_len))
    payload_len = size - _U32.size - header_len
    target = sink(header, payload_len)
    if target is None or len(target) != payload_len or target.readonly:
        return Frame(header, await conn.read(payload_len))
    await conn.read_into(target)
    return Frame(header, target)


class DataServer:
    """The TCP listener beside an `RpcServer`: authenticates each connection and runs the registered handler.

    `open_stream(method, metadata) -> (CallContext, handler)` is supplied by the RpcServer: it authenticates and
    finds the handler exactly as for gRPC calls, raising `Reject`; `on_reject(method, rejection, sender)` logs
    and counts a refusal in the server's `rejections`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        max_message_bytes: int,
        open_stream: Callable[[str, list[tuple[str, str]]], Awaitable[tuple[Any, Any]]],
        on_reject: Callable[[str, Reject, str], object],
        socket_buffer_bytes: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.ssl_context = ssl_context  # TLS on every connection (protocol/transport.py), else plaintext
        self.max_message_bytes = max_message_bytes
        self._open_stream = open_stream
        self._on_reject = on_reject
        self.socket_buffer_bytes = socket_buffer_bytes
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Bind and start accepting; returns the port actually bound."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            size_socket_buffers(listener, self.socket_buffer_bytes)  # accepted connections inherit them
            listener.bind((self.host, self.port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE,
                "BIND_FAILED",
                f"could not bind the data plane to {self.host}:{self.port}: {exc}",
            ) from None
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept_loop())
        return self.port

    async def stop(self) -> None:
        if self._accepting is not None:
            await cancel_and_wait(self._accepting)
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        tasks, self._connections = self._connections, set()
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: a connection that ignored cancellation must not hold the node's shutdown
            await asyncio.wait(tasks, timeout=5.0)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, address = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. EMFILE: keep serving the connections we have
                log.warning("data plane accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(sock, f"{address[0]}:{address[1]}"))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket, peer: str) -> None:
        if self.ssl_context is None:
            conn = _Conn(sock, peer)
        else:
            try:
                conn = await _secure(sock, peer, self.ssl_context, server_side=True)
            except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
                sock.close()
                detail = f"from {peer}: {getattr(exc, 'reason', None) or exc or 'no handshake'}"
                self._on_reject("?", Reject(grpc.StatusCode.UNAUTHENTICATED, TLS_HANDSHAKE, detail), peer)
                return
        method, sender = "?", "?"
        # Streams this connection carried: a client reuses it for the next (ConnectionPool).
        served = 0
        try:
            while True:
                if served and not await self._next_stream(conn):
                    return
                try:
                    method, metadata, timeout = await wait_for(self._read_preamble(conn), timeout=10.0)
                except TimeoutError:
                    raise Reject(
                        grpc.StatusCode.DEADLINE_EXCEEDED, "TRUNCATED", "no stream preamble within 10 s"
                    ) from None
                except ConnectionError:
                    if served:  # the client closed it between streams (TLS: its close_notify came first)
                        return
                    raise
                call, handler = await self._open_stream(method, metadata)
                sender = call.sender
                async with asyncio.timeout(timeout):
                    ended = await self._run(conn, method, call, handler)
                served += 1
                # Outside the stream's deadline: our END is written, and no error may follow it.
                ended = ended or await self._read_end(conn)
                if not ended:  # the client may still be sending: let it finish, then close
                    await conn.drain()
                    return
        except Reject as exc:
            await self._refuse(conn, method, exc, sender)
        except FrameError as exc:  # a TLS record that failed its tag before the handler read frames
            await self._refuse(
                conn, method, Reject(grpc.StatusCode.DATA_LOSS, exc.reason, exc.detail), sender
            )
        except TimeoutError:
            deadline = Reject(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE", "the stream's deadline passed")
            await self._refuse(conn, method, deadline, sender)
        except (OSError, ConnectionError) as exc:
            log.info("data stream %s from %s (%s) ended: %s", method, sender, conn.peer, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("data stream handler of %s failed for %s", method, sender)
            failure = Reject(grpc.StatusCode.INTERNAL, "HANDLER_ERROR", type(exc).__name__)
            await self._refuse(conn, method, failure, sender)
        finally:
            conn.close()

    async def _next_stream(self, conn: _Conn) -> bool:
        """After a stream both sides ended: wait for the next one's first byte on the same connection, False when
        the client closes it or leaves it idle for `IDLE_SECONDS`."""
        try:
            async with asyncio.timeout(IDLE_SECONDS):
                await conn.wait_readable()
        except TimeoutError:
            return False
        return not conn.at_eof()

    async def _refuse(self, conn: _Conn, method: str, rejection: Reject, sender: str) -> None:
        """Log and count the refusal, tell the caller why, and let it read that before we close."""
        self._on_reject(method, rejection, sender)
        with contextlib.suppress(OSError, ConnectionError):
            await _write_error(conn, rejection)
            await conn.drain(1.0)

    async def _read_preamble(self, conn: _Conn) -> tuple[str, list[tuple[str, str]], float]:
        magic = await conn.read(len(MAGIC))
        if magic != MAGIC:
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                "MALFORMED_FRAME",
                f"expected the farloco data-plane magic {MAGIC!r}, got {magic.tobytes()!r}",
            )
        size = await conn.read_u32()
        if size > MAX_PREAMBLE_BYTES:
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                "FRAME_TOO_LARGE",
                f"stream preamble of {size} bytes exceeds the limit of {MAX_PREAMBLE_BYTES} bytes",
            )
        try:
            preamble = msgpack.unpackb(await conn.read(size), raw=False, strict_map_key=True)
            method, raw_metadata, timeout = preamble["m"], preamble["md"], float(preamble["t"])
            metadata = [(str(key), str(value)) for key, value in raw_metadata]
            if not isinstance(method, str):
                raise TypeError("method is not a string")
        except Exception as exc:  # msgpack and the shape checks raise several unrelated types
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                "MALFORMED_FRAME",
                f"expected a msgpack preamble {{m, md, t}}, got {type(exc).__name__}: {exc}",
            ) from None
        if not timeout > 0:
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT, "BAD_HEADER", f"expected a timeout > 0, got {timeout}"
            )
        return method, metadata, min(timeout, MAX_STREAM_SECONDS)

    async def _run(self, conn: _Conn, method: str, call: Any, handler: Any) -> bool:
        """Serve one stream; True when the client's END was read (nothing of it is left on the connection)."""
        from farloco.protocol.rpc import decode_frame_owned

        limit = self.max_message_bytes
        ended = False

        def decode(data: memoryview) -> Any:
            try:
                return decode_frame_owned(data)
            except FrameError as exc:
                raise Reject(grpc.StatusCode.INVALID_ARGUMENT, exc.reason, exc.detail) from None

        async def frames() -> AsyncIterator[Any]:
            nonlocal ended
            while True:
                try:
                    item = await _read_frame_or_marker(conn, limit, decode)
                except FrameError as exc:
                    raise Reject(_frame_error_code(exc), exc.reason, exc.detail) from None
                except (OSError, ConnectionError):
                    return  # the peer went away: the handler sees an early end (TRUNCATED)
                if item == END:
                    ended = True
                    return
                if isinstance(item, tuple):
                    return  # a client never sends errors; treat it as a half-close
                yield item

        async for response in handler(call, frames()):
            head, payload = _frame_parts(response, limit, method)
            await conn.write(head, payload)
        await conn.write(_U32.pack(END))
        return ended

    @staticmethod
    async def _read_end(conn: _Conn) -> bool:
        """After a handler that took just the frames it expected (the exchange's): read the client's END, which
        follows its last frame at once. True when it came; anything else, or nothing within END_WAIT_SECONDS,
        and the connection is closed (a connection with bytes unread is, and then every stream of every round
        costs a new TCP connection and TLS session)."""
        with contextlib.suppress(TimeoutError, OSError, ConnectionError, FrameError):
            async with asyncio.timeout(END_WAIT_SECONDS):
                return await conn.read_u32() == END
        return False


class ConnectionPool:
    """A client's idle data-plane connections, by peer: a stream both sides ended leaves its connection here, and
    the next stream to that peer takes it instead of a new TCP (and TLS) handshake. One per `RpcClient` (its
    event loop's); `close()` closes what is left."""

    def __init__(self) -> None:
        self._idle: dict[tuple[Any, ...], list[tuple[float, _Conn]]] = {}
        self.reused = 0  # streams that went out on a kept connection

    def take(self, key: tuple[Any, ...]) -> _Conn | None:
        now = time.monotonic()
        idle = self._idle.get(key, [])
        while idle:
            since, conn = idle.pop()
            if now - since < POOL_IDLE_SECONDS and conn.idle_and_open():
                self.reused += 1
                return conn
            conn.close()
        return None

    def put(self, key: tuple[Any, ...], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= POOL_PER_PEER or not conn.idle_and_open():
            conn.close()
            return
        idle.append((time.monotonic(), conn))

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for _, conn in conns:
                conn.close()


async def _connect(
    host: str,
    port: int,
    where: str,
    deadline: float,
    socket_buffer_bytes: int,
    ssl_context: ssl.SSLContext | None,
    server_name: str | None,
) -> _Conn:
    """A new data-plane connection to host:port (TLS with `ssl_context`); raises RpcError (UNAVAILABLE)."""
    loop = asyncio.get_running_loop()
    target: Any = (host, port)
    if ip_version(host) is None:  # a name (network.announce_host): its first address, of either family
        try:
            target = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0][4]
        except OSError as exc:
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", f"{where}: cannot resolve: {exc}"
            ) from None
    sock = socket.socket(socket.AF_INET6 if ":" in target[0] else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        size_socket_buffers(sock, socket_buffer_bytes)  # before connect: the window scale is fixed then
        try:
            async with asyncio.timeout_at(deadline):
                await loop.sock_connect(sock, target)
        except (OSError, TimeoutError) as exc:
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", f"{where}: cannot connect: {exc}"
            ) from None
        if ssl_context is None:
            return _Conn(sock, f"{host}:{port}")
        try:
            async with asyncio.timeout_at(deadline):
                return await _secure(
                    sock, f"{host}:{port}", ssl_context, server_side=False, server_name=server_name
                )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE,
                TLS_HANDSHAKE,
                f"{where}: no TLS session: {getattr(exc, 'reason', None) or exc or 'timed out'} (does the "
                "peer hold the run's secret or certificates, with the same network.encryption?)",
            ) from None
    except BaseException:
        sock.close()
        raise


async def open_stream(
    host: str,
    port: int,
    method: str,
    metadata: tuple[tuple[str, str], ...],
    frames: AsyncIterator[Any],
    *,
    timeout: float,
    max_message_bytes: int,
    decode: Callable[[memoryview], Any],
    sink: Sink | None = None,
    socket_buffer_bytes: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    server_name: str | None = None,
    pool: ConnectionPool | None = None,
) -> AsyncIterator[Any]:
    """Client side of one data-plane stream: send `frames`, yield the answers; raises RpcError on any failure.
    With `ssl_context` the connection is TLS (the server's certificate checked against `server_name`).

    With `pool`, the stream goes out on an idle connection to the peer if the pool holds one, and a stream that
    both sides ended leaves its connection there for the next; otherwise the connection is closed when the
    iterator finishes or is closed early (which is how a caller cancels).
    """
    where = f"{method} at {host}:{port}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    key = (host, port, id(ssl_context), server_name, socket_buffer_bytes)
    conn = pool.take(key) if pool is not None else None
    if conn is None:
        conn = await _connect(host, port, where, deadline, socket_buffer_bytes, ssl_context, server_name)
    writer: asyncio.Task[None] | None = None
    reusable = False
    try:
        preamble = msgpack.packb(
            {"m": method, "md": [list(item) for item in metadata], "t": max(0.001, timeout)},
            use_bin_type=True,
        )
        try:
            await conn.write(MAGIC + _U32.pack(len(preamble)) + preamble)
        except (
            OSError
        ) as exc:  # reset as it opened (a dropped link): the caller's RpcError, not a raw OSError
            raise _lost(where, exc) from None

        async def write_all() -> None:
            assert conn is not None
            async for frame in frames:
                head, payload = _frame_parts(frame, max_message_bytes, method)
                await conn.write(head, payload)
            await conn.write(_U32.pack(END))

        writer = asyncio.create_task(write_all())

        def stop_reading(task: asyncio.Task[None]) -> None:
            # Our own side failed (e.g. a frame over the limit): unblock the reader below, which re-raises it.
            if not task.cancelled() and task.exception() is not None:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)

        writer.add_done_callback(stop_reading)
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await _read_frame_or_marker(conn, max_message_bytes, decode, sink)
            except TimeoutError:
                raise RpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", f"{where}: deadline passed"
                ) from None
            except FrameError as exc:
                raise RpcError(
                    _frame_error_code(exc), exc.reason, f"answer of {where}: {exc.detail}"
                ) from None
            except (OSError, ConnectionError) as exc:
                if writer.done() and not writer.cancelled() and writer.exception() is not None:
                    raise _writer_error(writer, where) from None
                raise _lost(where, exc) from None
            if item == END:
                break
            if isinstance(item, tuple):
                code, reason, detail = item
                raise RpcError(code, reason, f"{where}: {detail}")
            yield item
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            raise _writer_error(writer, where) from None
        # Both sides ended (the server's END read, ours written): nothing of this stream is left on the wire.
        reusable = writer.done() and not writer.cancelled()
    finally:
        if writer is not None and not writer.done():
            writer.cancel()
            with contextlib.suppress(BaseException):
                await writer
        if reusable and pool is not None:
            pool.put(key, conn)
        else:
            conn.close()
