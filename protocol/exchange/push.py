"""The streaming push: our contribution to each owner, and (dense codecs) the owner's means back.

Dense codecs use reduce-scatter + all-gather. Every member opens one bidirectional `ExchangePush` stream to every
other member j (one per lane, see plan.py): on the request side it sends its encoded chunks of part j, on the
response side j sends back the encoded *mean* of each chunk of part j as soon as j has every member's contribution
to that chunk, so the reduce-scatter and the all-gather overlap chunk by chunk. The means of a lane's chunks come
in whatever order the owner completes them; each is decoded into the result (raw float32: received straight into
it). Sparse codecs (`dense=False`) use an all-gather: each member streams its whole payload to every other member,
which confirms it with a done frame.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import grpc
import torch

from farloco.protocol.exchange.attempt import Attempt
from farloco.protocol.exchange.codec import all_finite, decode, own_chunk_error, raw_bytes, raw_view
from farloco.protocol.exchange.codecpool import CodecPool, result
from farloco.protocol.exchange.plan import lanes_for, max_chunk_payload
from farloco.protocol.exchange.reduce import encode_chunk
from farloco.protocol.exchange.wire import (
    PUSH_METHOD,
    Chunk,
    Done,
    Piece,
    blame,
    invalid,
    wire_size,
    within,
)
from farloco.protocol.rpc import Frame, Reject, RpcClient, RpcError

log = logging.getLogger("farloco.protocol.exchange")


class Pusher:
    """Pushes our contribution through `client`, `lanes` streams per owner at most (dense codecs), in pieces of
    `chunk_elems` float32 sizes (sparse payloads), the codec's work on `pool`."""

    def __init__(self, client: RpcClient, pool: CodecPool, lanes: int, chunk_elems: int) -> None:
        self.client = client
        self.pool = pool
        self.lanes = lanes
        self.chunk_elems = chunk_elems

    async def push(self, attempt: Attempt, j: int, lane: int, deadline: float) -> None:
        """Stream our contribution to member j and, for dense codecs, receive j's mean of its part: the chunks of
        lane `lane` (see Lanes in plan.py)."""
        member = attempt.members[j]
        codec = attempt.codec
        loop = asyncio.get_running_loop()
        hello = attempt.hello(lane, self.lanes if attempt.dense else 1)
        part = attempt.plan.chunks(j)
        ks = list(range(lane, len(part), lanes_for(self.lanes, len(part)))) if attempt.dense else []
        chunks = [part[k] for k in ks]

        # Encoded chunks, ahead of the one being sent (codecpool.py): chunk index -> its job. Coded chunks only.
        ahead: deque[tuple[int, Future[bytes]]] = deque()
        to_encode = iter(
            [(k, a, b) for k, (a, b) in zip(ks, chunks, strict=True) if attempt.covers(a, b)]
            if not attempt.raw
            else []
        )

        def encode_ahead() -> None:
            while len(ahead) < self.pool.ahead:
                k, a, b = next(to_encode, (-1, 0, 0))
                if k < 0:
                    return
                ahead.append((k, self.pool.submit(attempt.jobs, encode_chunk, attempt, a, b)))

        async def dense_frames() -> AsyncIterator[Frame]:
            try:
                first = Frame(hello.encode())
                attempt.bytes_sent += wire_size(first)
                encode_ahead()
                yield first
                for k, (a, b) in zip(ks, chunks, strict=True):
                    if not attempt.covers(a, b):
                        frame = Frame(Chunk(k, absent=True).encode())
                        attempt.bytes_sent += wire_size(frame)
                        yield frame
                        continue
                    if attempt.raw:
                        # Our own NaN/Inf is refused chunk by chunk as it goes out: summing a chunk just before it
                        # is sent also brings it into cache for the send (one pass over 64 MiB up front cost more).
                        own = attempt.own(a, b)
                        error = own_chunk_error(codec, own, a)
                        if error is not None:
                            attempt.fail_locally(error)
                            return
                        # The tensor's own bytes: sent from its memory (data plane) or copied once (gRPC).
                        frame = Frame(Chunk(k).encode(), raw_bytes(own))
                        attempt.bytes_sent += wire_size(frame)
                        attempt.fp32_sent += 4 * (b - a)
                        yield frame
                        continue
                    queued, job = ahead.popleft()
                    assert queued == k, f"encoded chunk {queued} came up for chunk {k}"
                    try:
                        data = await result(job)
                    except Exception as exc:
                        attempt.fail_locally(exc)
                        return
                    encode_ahead()
                    frame = Frame(Chunk(k).encode(), data)
                    attempt.bytes_sent += wire_size(frame)
                    attempt.fp32_sent += 4 * (b - a)
                    yield frame
            finally:
                # Closed early (the attempt failed, the stream broke): chunks not yet started are not coded.
                for _, job in ahead:
                    job.cancel()

        async def sparse_frames() -> AsyncIterator[Frame]:
            payload = memoryview(attempt.payload)
            first = Frame(replace(hello, length=len(payload)).encode())
            attempt.bytes_sent += wire_size(first)
            yield first
            step = self.chunk_elems * 4
            # The dense equivalent of one attempt is a ring all-reduce, 2(k-1)/k * 4 bytes per value, spread over
            # the k-1 copies of our payload we send.
            members = len(attempt.members)
            dense_per_byte = 8 * attempt.plan.numel / (members * max(1, len(payload)))
            for offset in range(0, len(payload), step):
                frame = Frame(Piece(offset).encode(), payload[offset : offset + step])
                attempt.bytes_sent += wire_size(frame)
                attempt.fp32_sent += len(frame.payload) * dense_per_byte
                yield frame

        received = 0
        # Means being decoded into the result, in arrival order.
        decoding: deque[Future[torch.Tensor]] = deque()
        # The means of this lane's chunks, in whatever order the owner completes them: with lanes, a chunk whose
        # contributions all came early is reduced before an earlier one still on its way.
        remaining = set(ks)

        def mean_sink(header: dict[str, Any], size: int) -> memoryview | None:
            # Raw means land straight in the result (checked once in place below); anything unexpected gets a
            # buffer of its own and is refused there.
            k = header.get("k")
            if k not in remaining:
                return None
            a, b = part[k]
            return raw_bytes(attempt.result[a:b]) if size == 4 * (b - a) and attempt.covers(a, b) else None

        try:
            frames = dense_frames() if attempt.dense else sparse_frames()
            answers = self.client.stream(
                member.address,
                PUSH_METHOD,
                frames,
                round_id=attempt.round_id,
                timeout=max(0.001, deadline - loop.time()),
                bulk=True,
                sink=mean_sink if attempt.raw else None,
            )
            async for frame in answers:
                attempt.heard[j] = loop.time()
                if not attempt.dense:
                    attempt.bytes_received += wire_size(frame)
                    try:
                        Done.decode(frame.header)
                    except Reject as exc:
                        raise within(member.peer_id, exc) from None
                    received = 1
                    continue
                chunk = Chunk.decode(frame.header)
                k = chunk.index
                if k not in remaining:
                    raise invalid(
                        "CHUNK_ORDER",
                        f"expected one of chunks {sorted(remaining)[:8]} of part {j} (lane {lane}), got {k!r:.20}",
                    )
                remaining.discard(k)
                a, b = part[k]
                absent = chunk.absent
                if absent or not attempt.covers(a, b):
                    # Outside our span the owner answers with an absent frame, and only there.
                    if not (absent and not attempt.covers(a, b) and not frame.payload):
                        raise invalid(
                            "SPAN_MISMATCH",
                            f"part {j} chunk {k}: expected "
                            f"{'the mean' if attempt.covers(a, b) else 'an absent frame'} (our span "
                            f"{attempt.lo}..{attempt.hi}), got {'an absent frame' if absent else 'a mean'}",
                        )
                    attempt.bytes_received += wire_size(frame)
                    received += 1
                    continue
                if len(frame.payload) > max_chunk_payload(b - a):
                    raise invalid(
                        "SIZE_MISMATCH", f"mean chunk of {len(frame.payload)} bytes for {b - a} elements"
                    )
                attempt.bytes_received += wire_size(frame)
                what = f"mean of part {j} chunk {k}"
                if attempt.raw:
                    target = attempt.result[a:b]
                    view = raw_view(frame.payload, b - a, what)
                    if view.data_ptr() != target.data_ptr():  # received into the result by mean_sink already
                        target.copy_(view)
                    if not all_finite(target):
                        raise invalid("BAD_PAYLOAD", f"{what}: expected only finite float32 values")
                else:
                    if attempt.mean_chunks is not None:
                        attempt.mean_chunks[a] = (b, bytes(frame.payload))
                    # Decoded into the result on the codec threads while the next means come in; waited for a few
                    # chunks behind (a bad mean is refused within those) and all before the part counts as done.
                    decoding.append(
                        self.pool.submit(
                            attempt.jobs,
                            decode,
                            codec,
                            frame.payload,
                            b - a,
                            what,
                            attempt.fast,
                            attempt.result[a:b],
                        )
                    )
                    while decoding and (decoding[0].done() or len(decoding) > self.pool.ahead):
                        await result(decoding.popleft())
                received += 1
            while decoding:
                await result(decoding.popleft())
            if attempt.dense and received != len(chunks):
                raise invalid(
                    "TRUNCATED", f"part {j} lane {lane}: expected {len(chunks)} mean chunks, got {received}"
                )
            if not attempt.dense and received != 1:
                raise invalid(
                    "TRUNCATED", f"{member.peer_id} closed the stream without confirming our payload"
                )
            if attempt.dense:
                attempt.part_done()
        except RpcError as exc:
            attempt.fail(
                f"push to {member.peer_id} failed: {exc.code.name} reason={exc.reason}",
                # Not in another group: what we and the others still send is evidence worth a vote.
                evidence=exc.code != grpc.StatusCode.FAILED_PRECONDITION,
            )
        except Reject as exc:
            attempt.fail(
                f"bad answer from {member.peer_id}: reason={exc.reason} {exc.detail}",
                blame(exc, member.peer_id),
            )
        except asyncio.CancelledError:
            attempt.fail(f"push to {member.peer_id} cancelled", evidence=False)
            raise
        except Exception as exc:
            # Anything else (a bug, a socket error that escaped its RpcError) must still end the attempt: a push
            # task that dies quietly leaves every member waiting for its data until the data phase's deadline.
            log.exception("push to %s failed unexpectedly", member.peer_id)
            attempt.fail(f"push to {member.peer_id} failed: {type(exc).__name__}: {exc}", evidence=False)
