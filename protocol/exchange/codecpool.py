"""The codec's work off the event loop: the exchange's thread pool and the count of each attempt's jobs.

Threads. With `codec_threads` > 0 the codec's work on a chunk (encoding our contribution, decoding a member's, an
owner's sum and the encoding of the mean, decoding a mean) runs on the exchange's own threads, not on the event
loop: at 1B parameters it is seconds a round, which on the loop is one core's worth while a many-core host's others
idle. The C kernels and torch release the GIL, so chunks are coded side by side: a push encodes a few chunks ahead
of the one it sends; a member's chunk is decoded while the stream is read on, and the chunk's reduction (a task of
its own once every contribution is in) takes the decode's job, which ran first (one FIFO pool) or runs now; a
decode's refusal is reported from its thread at once; a mean is decoded into the result a few chunks behind. Every
job only computes, into memory no other job of the attempt writes (its chunk of `transmitted` or of the result, or
fresh tensors); the event loop keeps every decision (refusals, blame, what goes on which stream). An attempt is
retired only once every job it started has ended (`Jobs.wait`), so no job of an abandoned attempt writes into a
buffer the next attempt or the caller already uses. The order of arithmetic is the same as on the loop (an owner
sums in member order whatever the order of arrival), so results are bit-identical to the loop's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

_T = TypeVar("_T")

# Most threads the codec work may use.
MAX_CODEC_THREADS = 64
# Chunks a push encodes ahead of the one it sends, at most (and at least 2: one on the wire, one being encoded).
MAX_ENCODE_AHEAD = 8


class Jobs:
    """The codec jobs of one attempt not yet ended. A job's end is counted on its own thread (nothing wakes the
    event loop for it)."""

    def __init__(self) -> None:
        self._running = 0
        self._ended = threading.Condition()

    def started(self) -> None:
        with self._ended:
            self._running += 1

    def ended(self, _job: Future[Any]) -> None:
        """A job ran, failed or was cancelled before it ran (a done callback)."""
        with self._ended:
            self._running -= 1
            if self._running == 0:
                self._ended.notify_all()

    def wait(self) -> None:
        """Until every job ended: at most the chunks in flight, milliseconds each, so the loop just waits."""
        with self._ended:
            self._ended.wait_for(lambda: self._running == 0)


class CodecPool:
    """`threads` codec threads (0: the work runs on the event loop, at once). ThreadPoolExecutor starts its threads
    on first submit, so none runs before a caller's forks (the DHT)."""

    def __init__(self, threads: int) -> None:
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="farloco-codec", initializer=_codec_thread)
            if threads
            else None
        )
        # Chunks a push encodes ahead of the one it sends, and means decoded behind the one received.
        self.ahead = max(2, min(MAX_ENCODE_AHEAD, threads))
        self._torch_threads = torch.get_num_threads()

    def close(self) -> None:
        """End the threads (a job still running is seen through)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, jobs: Jobs, work: Callable[..., _T], *args: Any) -> Future[_T]:
        """`work(*args)` on the codec threads (on the loop, at once, without them), counted in `jobs` until it
        ends."""
        job: Future[_T] = Future()
        if self._pool is None:
            try:
                job.set_result(work(*args))
            except Exception as exc:  # the caller's await raises it, as the thread's would
                job.set_exception(exc)
            return job
        jobs.started()
        job = self._pool.submit(work, *args)
        job.add_done_callback(jobs.ended)  # run, failed or cancelled before it ran
        return job

    async def run(self, jobs: Jobs, work: Callable[..., _T], *args: Any) -> _T:
        return await result(self.submit(jobs, work, *args))

    async def wide(self, jobs: Jobs, work: Callable[..., _T], *args: Any) -> _T:
        """`run` for a pass over a whole tensor (sparse codecs): with the torch threads of the pool's maker."""
        if self._pool is None:
            return work(*args)
        return await self.run(jobs, _with_torch_threads, self._torch_threads, work, *args)


async def result(job: Future[_T]) -> _T:
    """The result of a job `CodecPool.submit` made (its exception raised here). Cancelled meanwhile, the job runs
    on (the attempt's `Jobs.wait` waits for it)."""
    return job.result() if job.done() else await asyncio.wrap_future(job)


def _codec_thread() -> None:
    # A chunk's work is small (a cache-sized run): the threads work side by side on different chunks, each with
    # one torch thread (torch's count is per thread), rather than every op spread over every core.
    torch.set_num_threads(1)


def _with_torch_threads(threads: int, work: Callable[..., _T], *args: Any) -> _T:
    """`work(*args)` with `threads` torch threads on this thread (a whole-tensor pass: a sparse codec's)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return work(*args)
    finally:
        torch.set_num_threads(previous)
