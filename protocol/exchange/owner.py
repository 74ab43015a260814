"""The owner's side of the exchange: members' streams of our part taken in, each chunk reduced once every member's
contribution is in, and the mean sent back on every member's stream.

Every incoming stream starts with a hello (wire.py), checked against our attempt: a sender whose stream is
refused cannot contribute, so the attempt fails at once rather than at the deadline. Each chunk is checked on
arrival (size; raw float32: finite; coded: decoded on the codec threads, a refusal reported from the decoding
thread at once), so a member that sent bad data is named by every owner it sent it to, and the owner tells that
member why on its own stream. The contributions to a chunk are reduced in member order whatever the order of
arrival (reduce.py); a member absent on a chunk (outside its span) gets an absent frame instead of the mean. A
failed attempt keeps checking, without reducing, what its members still send (evidence for the vote). Sparse
codecs: each member's whole payload is reassembled (its size checked before allocating), checked whole (parsed,
or decoded where the codec cannot parse) and confirmed, and summed into the mean in member order as soon as the
members before it are in (reduce.py's `sparse_sum`); with the last, the rest and the division.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

import torch

from farloco.protocol.exchange.attempt import Attempt, Attempts
from farloco.protocol.exchange.codec import all_finite, decode, own_chunk_error, raw_view, take_payload
from farloco.protocol.exchange.codecpool import CodecPool
from farloco.protocol.exchange.plan import lanes_for, max_chunk_payload
from farloco.protocol.exchange.reduce import (
    OWN_CHUNK,
    Marker,
    OwnChunkError,
    blame_nonfinite,
    chunk_mean,
    encode_sparse,
    sparse_mean,
    sparse_sum,
)
from farloco.protocol.exchange.wire import (
    AttemptRef,
    Blamed,
    Chunk,
    Done,
    Hello,
    Piece,
    blame,
    invalid,
    precondition,
    wire_size,
    within,
)
from farloco.protocol.rpc import CallContext, Frame, Reject

log = logging.getLogger("farloco.protocol.exchange")


class Owner:
    """Serves `ExchangePush` for the attempts in `attempts`: takes members' chunks of our part, reduces them on
    `pool`, sends the means back. `max_payload_bytes` caps a sparse payload."""

    def __init__(self, attempts: Attempts, pool: CodecPool, max_payload_bytes: int) -> None:
        self.attempts = attempts
        self.pool = pool
        self.max_payload_bytes = max_payload_bytes

    async def own_sparse(self, attempt: Attempt) -> None:
        """Our own sparse payload, encoded for the others (see `encode_sparse`): one of the mean's terms."""
        attempt.payload, attempt.decoded[attempt.me] = await self.pool.wide(
            attempt.jobs, encode_sparse, attempt
        )
        await self._sparse_part_done(attempt)

    def _check_hello(self, attempt: Attempt, ctx: CallContext, header: dict[str, Any]) -> tuple[int, Hello]:
        """The hello of `ctx.sender`'s stream for `attempt`, decoded and checked against the attempt: the sender's
        member index and its hello. Records the sender's lane count (every stream of a sender says the same)."""
        sender = attempt.member_ids.index(ctx.sender)
        where = f"round {attempt.round_id} from {ctx.sender}"
        try:
            hello = Hello.decode(header)
        except Reject as exc:
            raise within(where, exc) from None
        if (hello.ref.attempt, hello.ref.stage) != (attempt.attempt_no, attempt.stage):
            raise precondition(
                "ATTEMPT_MISMATCH",
                f"{where}: expected attempt {attempt.attempt_no} of stage {attempt.stage}, got attempt "
                f"{hello.ref.attempt!r} of stage {hello.ref.stage!r}",
            )
        if hello.numel != attempt.plan.numel:
            raise invalid(
                "SHAPE_MISMATCH", f"{where}: expected numel={attempt.plan.numel}, got {hello.numel!r}"
            )
        if (
            hello.codec != attempt.codec.name
            or hello.dense is not attempt.dense
            or hello.raw is not attempt.raw
        ):
            raise invalid(
                "CODEC_MISMATCH", f"{where}: expected codec {attempt.codec.name!r}, got {hello.codec!r:.40}"
            )
        if hello.chunk_elems != attempt.plan.chunk_elems or hello.slices != attempt.plan.slices:
            raise invalid(
                "CHUNK_MISMATCH",
                f"{where}: expected chunks of {attempt.plan.chunk_elems} elements cut at {attempt.plan.slices} "
                f"slices, got {hello.chunk_elems!r:.20} at {hello.slices!r:.20}",
            )
        if hello.aggregator != attempt.aggregator:
            raise invalid(
                "AGGREGATOR_MISMATCH",
                f"{where}: expected aggregator {attempt.aggregator!r}, got {hello.aggregator!r:.40}",
            )
        lanes, lane = hello.lanes, hello.lane
        if attempt.lanes_of.get(sender, lanes) != lanes:
            raise invalid(
                "LANES_MISMATCH", f"{where}: expected {attempt.lanes_of[sender]} lanes as before, got {lanes}"
            )
        chunks = len(attempt.plan.chunks(attempt.me)) if attempt.dense else 1
        if not 0 <= lane < lanes_for(lanes, chunks):
            raise invalid(
                "BAD_HEADER", f"{where}: expected a lane in 0..{lanes_for(lanes, chunks) - 1}, got {lane}"
            )
        if (sender, lane) in attempt.streams_from:
            raise invalid(
                "DUPLICATE_STREAM", f"{where}: a stream from this sender on lane {lane} is already open"
            )
        attempt.lanes_of[sender] = lanes
        return sender, hello

    async def on_push(self, ctx: CallContext, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
        incoming = frames.__aiter__()
        try:
            first = await anext(incoming)
        except StopAsyncIteration:
            # Cut before its hello (a connection reset): the sender's part of the attempt it was for will not
            # come, and no hello says which attempt that was. Every attempt of that round with the sender among
            # its members fails now (nobody's fault) rather than wait for the data phase's deadline.
            for attempt in self.attempts.values():
                if (
                    attempt.started.is_set()
                    and attempt.round_id == ctx.round_id
                    and ctx.sender in attempt.member_ids
                    and ctx.sender != self.attempts.peer_id
                ):
                    attempt.fail(f"stream from {ctx.sender} cut before its first frame")
            raise invalid("TRUNCATED", f"stream from {ctx.sender} ended before its first frame") from None
        attempt = await self.attempts.find(ctx, AttemptRef.decode(first.header))
        try:
            sender, hello = self._check_hello(attempt, ctx, first.header)
        except Reject as exc:
            # A member whose stream we refuse cannot contribute: fail now rather than wait for the deadline.
            attempt.fail(f"refused stream from {ctx.sender}: {exc.reason}", blame(exc, ctx.sender))
            raise
        lane = hello.lane
        attempt.streams_from.add((sender, lane))
        attempt.heard[sender] = asyncio.get_running_loop().time()
        attempt.weights[sender] = hello.weight
        if hello.tag:
            attempt.tags[sender] = hello.tag
        if attempt.dense:  # a sparse hello is counted with its payload (_receive_sparse)
            attempt.bytes_received += wire_size(first)
        outbox = attempt.outbox(sender, lane)
        if attempt.dense:
            consumer = asyncio.create_task(self._receive_dense(attempt, sender, lane, incoming))
            chunks = len(attempt.plan.chunks(attempt.me))
            expected = len(range(lane, chunks, lanes_for(attempt.lanes_of[sender], chunks)))
        else:
            consumer = asyncio.create_task(
                self._receive_sparse(attempt, sender, first, hello.length, incoming)
            )
            expected = 1
        attempt.consumers.add(consumer)
        try:
            for _ in range(expected):
                item = await outbox.get()
                if isinstance(item, Reject):
                    if item.reason == "ATTEMPT_FAILED":
                        # The attempt failed elsewhere: read what this sender still sends (checked, for our
                        # vote) before closing, and name its own fault to it if that turns up.
                        await attempt.gather_evidence(consumer)
                        item = specific_rejection(outbox) or item
                    raise item
                attempt.bytes_sent += wire_size(item)
                if attempt.dense and not item.header.get("x"):  # a mean we made (`_send_mean`)
                    a, b = attempt.plan.chunks(attempt.me)[item.header["k"]]
                    attempt.fp32_sent += 4 * (b - a)
                yield item
            # Every answer went out, so every chunk from this sender was already taken in.
            await consumer
        finally:
            if not consumer.done():
                consumer.cancel()
                attempt.fail(f"stream from {ctx.sender} ended early")

    async def _receive_dense(
        self, attempt: Attempt, sender: int, lane: int, incoming: AsyncIterator[Frame]
    ) -> None:
        """Take `sender`'s chunks of our part on lane `lane`; reduce each chunk once every member's copy is in."""
        peer = attempt.member_ids[sender]
        chunks = attempt.plan.chunks(attempt.me)
        ks = range(lane, len(chunks), lanes_for(attempt.lanes_of[sender], len(chunks)))
        loop = asyncio.get_running_loop()
        decodes: list[Future[torch.Tensor]] = []

        def refused(job: Future[torch.Tensor]) -> None:  # on the codec thread that decoded the chunk
            error = None if job.cancelled() else job.exception()
            if isinstance(error, Reject):
                with contextlib.suppress(
                    RuntimeError
                ):  # the loop closed meanwhile (a shutdown): nobody to tell
                    loop.call_soon_threadsafe(self._refuse, attempt, sender, error)

        try:
            for got, k in enumerate(ks):
                a, b = chunks[k]
                try:
                    frame = await anext(incoming)
                except StopAsyncIteration:
                    raise invalid(
                        "TRUNCATED", f"{peer} sent {got} of {len(ks)} chunks on lane {lane}"
                    ) from None
                attempt.heard[sender] = loop.time()
                chunk = Chunk.decode(frame.header)
                if chunk.index != k:
                    raise invalid("CHUNK_ORDER", f"{peer}: expected chunk {k}, got {chunk.index!r}")
                contribution: torch.Tensor | Future[torch.Tensor] | None
                if chunk.absent:
                    # Outside the sender's span (see Spans in plan.py): it takes no part in this chunk.
                    if frame.payload:
                        raise invalid(
                            "BAD_HEADER",
                            f"{peer}: chunk {k} is marked absent but carries {len(frame.payload)} bytes",
                        )
                    attempt.bytes_received += wire_size(frame)
                    if attempt.checking:
                        continue
                    slot = attempt.pending.setdefault(k, {})
                    slot[sender] = None
                    if len(slot) == len(attempt.members) - 1:
                        self._start_reduce(attempt, k, sender)
                    continue
                if len(frame.payload) > max_chunk_payload(b - a):
                    raise invalid(
                        "SIZE_MISMATCH",
                        f"{peer}: chunk {k} of {b - a} elements came as {len(frame.payload)} bytes",
                    )
                attempt.bytes_received += wire_size(frame)
                what = f"chunk {k} from {peer}"
                if attempt.raw:
                    # A view of the received message, summed from in place. Checked on arrival (one pass over a
                    # chunk that is still in cache): the sender is then named by every owner it sent NaN/Inf to,
                    # whatever the others' chunks do, so a majority can drop it.
                    contribution = raw_view(frame.payload, b - a, what)
                    completes = len(attempt.pending.get(k, ())) == len(attempt.members) - 2
                    # The chunk that completes its slot is checked by the reduction right away (one pass over
                    # the mean, then each input if that is not finite), so it needs no pass of its own.
                    if (attempt.checking or not completes) and not all_finite(contribution):
                        raise invalid("BAD_PAYLOAD", f"{what}: expected only finite float32 values")
                else:
                    # Decoded on the codec threads while we read on; the reduction takes the job (not awaited
                    # here: no wake-up of the loop per chunk). A refusal is reported from the job's thread as
                    # soon as it is found, so the sender is named whatever becomes of the chunk's slot.
                    job = self.pool.submit(
                        attempt.jobs, decode, attempt.codec, frame.payload, b - a, what, attempt.fast
                    )
                    if job.done():
                        contribution = job.result()  # decoded on the loop (no codec threads): raises here
                    else:
                        job.add_done_callback(refused)
                        decodes.append(job)
                        contribution = job
                if attempt.checking:
                    continue  # failed elsewhere: checked for the vote, not reduced
                slot = attempt.pending.setdefault(k, {})
                slot[sender] = contribution
                if len(slot) == len(attempt.members) - 1:
                    self._start_reduce(attempt, k, sender)
            # Every chunk of ours from this sender checked before we say we read its stream (the vote's evidence
            # waits for that); a refusal among them was reported before these waits end.
            # (Their errors are taken here, not left to be logged as never retrieved.)
            await asyncio.gather(*(asyncio.wrap_future(job) for job in decodes), return_exceptions=True)
        except Reject as exc:
            self._refuse(attempt, sender, exc)

    def _refuse(self, attempt: Attempt, sender: int, exc: Reject) -> None:
        """Data that came on `sender`'s stream (or completed a chunk there) was refused: tell the culprit why and
        fail the attempt. The culprit's own stream carries the specific reason (the server logs and counts it
        there); the other streams get ABORTED from fail(). The culprit is not always `sender`: a bad chunk is
        found when the slot completes, which may be on an honest member's chunk, and that member must not be
        told its data was bad."""
        peer = attempt.member_ids[sender]
        blamed = exc.peer if isinstance(exc, Blamed) else blame(exc, peer)
        culprit = attempt.member_ids.index(blamed) if blamed in attempt.member_ids else sender
        for (member, _), outbox in attempt.outboxes.items():
            if member == culprit:
                outbox.put_nowait(exc)
        attempt.fail(f"refused data from {blamed or peer}: {exc.reason}", blamed)

    def _start_reduce(self, attempt: Attempt, k: int, sender: int) -> None:
        """Every other member's contribution to our chunk k is in (the last came from `sender`): reduce it in a
        task of its own, so the streams read on meanwhile and chunks are reduced side by side (codecpool.py)."""
        task = asyncio.create_task(self._reduce_chunk(attempt, k, attempt.pending.pop(k), sender))
        attempt.reducers.add(task)
        task.add_done_callback(attempt.reducers.discard)

    async def _reduce_chunk(
        self, attempt: Attempt, k: int, contributions: dict[int, Any], sender: int
    ) -> None:
        a, b = attempt.plan.chunks(attempt.me)[k]
        try:
            if not attempt.covers(a, b):
                contributions[attempt.me] = None
            elif attempt.lossless:
                contributions[attempt.me] = attempt.own(a, b)
            else:
                contributions[attempt.me] = OWN_CHUNK  # encoded and decoded in the reduction's job
            # Sum in member (= sorted peer id) order so the owner's arithmetic does not depend on arrival order;
            # the members whose span leaves this chunk out take no part in it (see Spans in plan.py).
            present = [i for i in range(len(attempt.members)) if contributions[i] is not None]
            if not present:
                self._send_mean(attempt, Frame(Chunk(k, absent=True).encode()), present)
                return
            inputs = [c for i in present if (c := contributions[i]) is not None]
            weights = [attempt.weights[i] for i in present]
            try:
                mean = await self.pool.run(attempt.jobs, chunk_mean, attempt, a, b, inputs, weights)
            except OwnChunkError as exc:  # our own chunk cannot be encoded (NaN): as our push finds too
                attempt.fail_locally(exc.error)
                return
            if isinstance(mean, Marker):  # UNDECODABLE
                return  # a contribution was refused: reported from its decode (`_receive_dense`)
            if mean is None:  # a raw chunk that is not finite: whose?
                if self._own_chunk_failed(attempt, contributions[attempt.me], a):
                    return
                blame_nonfinite(attempt.member_ids, contributions)
            if attempt.mean_chunks is not None:
                attempt.mean_chunks[a] = (b, bytes(mean))
            self._send_mean(attempt, Frame(Chunk(k).encode(), mean), present)
        except Reject as exc:
            self._refuse(attempt, sender, exc)
        except Exception as exc:
            log.exception("reducing chunk %d failed unexpectedly", k)
            attempt.fail(f"reducing chunk {k} failed: {type(exc).__name__}: {exc}", evidence=False)

    def _own_chunk_failed(self, attempt: Attempt, own: torch.Tensor | None, offset: int) -> bool:
        """Our own input to a chunk is bad: fail locally, exclude ourselves, tell the caller (as an encode
        would). Returns whether it was."""
        error = None if own is None else own_chunk_error(attempt.codec, own, offset)
        if error is None:
            return False
        attempt.fail_locally(error)
        return True

    def _send_mean(self, attempt: Attempt, frame: Frame, present: list[int]) -> None:
        # Counted as sent when the member's stream takes it (on_push), not when queued. Every member's lane
        # that carries chunk k is open: its contribution to k came on it. A member absent on the chunk gets an
        # absent frame.
        k = frame.header["k"]
        absent = Frame(Chunk(k, absent=True).encode())
        for j in range(len(attempt.members)):
            if j != attempt.me:
                attempt.outboxes[(j, attempt.lane_of(j, k))].put_nowait(frame if j in present else absent)
        attempt.chunks_reduced += 1
        if attempt.chunks_reduced == len(attempt.plan.chunks(attempt.me)):
            attempt.part_done()

    async def _receive_sparse(
        self, attempt: Attempt, sender: int, hello: Frame, total: int | None, incoming: AsyncIterator[Frame]
    ) -> None:
        """Reassemble `sender`'s whole payload (size checked before allocating), check it (`take_payload`), confirm
        receipt."""
        peer = attempt.member_ids[sender]
        try:
            if total is None or total > self.max_payload_bytes:
                raise invalid(
                    "SIZE_MISMATCH",
                    f"{peer}: expected a payload of 0..{self.max_payload_bytes} bytes, got {total!r}",
                )
            attempt.bytes_received += wire_size(hello)
            buffer = bytearray(total)
            filled = 0
            while filled < total:
                try:
                    frame = await anext(incoming)
                except StopAsyncIteration:
                    raise invalid("TRUNCATED", f"{peer} sent {filled} of {total} payload bytes") from None
                size = len(frame.payload)
                offset = Piece.decode(frame.header).offset
                if offset != filled or size == 0 or filled + size > total:
                    raise invalid(
                        "SIZE_MISMATCH",
                        f"{peer}: expected bytes from offset {filled} (of {total}), got {size} at {offset!r}",
                    )
                buffer[filled : filled + size] = frame.payload
                filled += size
                attempt.bytes_received += wire_size(frame)
            attempt.decoded[sender] = await self.pool.wide(
                attempt.jobs,
                take_payload,
                attempt.codec,
                memoryview(buffer),
                attempt.plan.numel,
                f"payload of {peer}",
                attempt.fast,
            )
            attempt.outboxes[(sender, 0)].put_nowait(Frame(Done().encode()))
            await self._sparse_part_done(attempt)
        except Reject as exc:
            attempt.outboxes[(sender, 0)].put_nowait(exc)
            attempt.fail(f"refused data from {peer}: {exc.reason}", blame(exc, peer))

    async def _sparse_part_done(self, attempt: Attempt) -> None:
        """One payload (ours or a member's) is checked. The terms are summed into the mean in member order as
        soon as they can be: each time, the run of consecutive members in after those summed (`sparse_sum`), so
        the decodes overlap the wait for the others; with the last payload, the rest and the division, then the
        attempt holds the mean. A robust rule takes every payload at once, with the last."""
        members = len(attempt.members)
        attempt.terms_in += 1  # before any wait: the last payload's call is the last to take the lock
        final = attempt.terms_in == members
        async with attempt.summing:  # one run at a time, in member order (FIFO)
            if attempt.finished.is_set():  # failed meanwhile: nothing more is reduced
                pass
            elif attempt.rule is not None:
                if final:
                    terms = [attempt.decoded.pop(i) for i in range(members)]
                    weights = [attempt.weights[i] for i in range(members)]
                    await self.pool.wide(
                        attempt.jobs, sparse_mean, attempt.rule, terms, weights, attempt.result
                    )
            else:
                first = attempt.summed
                last = first
                while last < members and last in attempt.decoded:
                    last += 1
                if last > first or final:
                    terms = [attempt.decoded.pop(i) for i in range(first, last)]
                    weights = [attempt.weights[i] for i in range(first, last)]
                    divisor = math.fsum(attempt.weights[i] for i in range(members)) if final else None
                    attempt.summed = last
                    await self.pool.wide(
                        attempt.jobs, sparse_sum, terms, weights, attempt.result, first == 0, divisor
                    )
        attempt.part_done()


def specific_rejection(outbox: asyncio.Queue[Frame | Reject]) -> Reject | None:
    """A rejection naming the sender's own fault, if one was queued behind the attempt's generic failure."""
    while not outbox.empty():
        item = outbox.get_nowait()
        if isinstance(item, Reject) and item.reason != "ATTEMPT_FAILED":
            return item
    return None
