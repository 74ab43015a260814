"""One pass over a large vector spread over threads, each thread owning one contiguous range.

The agent's per-round passes (hashing theta, quantizing a contribution, dequantizing a peer's, the outer step)
are bound by memory bandwidth and by one core's speed: at 1B parameters one core spends seconds on them while a
GPU host's other cores idle. torch's intra-op threads cannot help the two largest (a sha256 and the C kernels
are not torch ops) and help the others little (they split each cache-sized chunk across threads and meet again
after every operation). Here each of `set_threads` threads takes one contiguous run of the vector and calls
code that releases the GIL (hashlib, the C kernels, torch ops on its range), so the threads neither share cache
lines nor wait on each other. The pool's threads run torch ops on one thread each (torch's thread count is
per thread: the agent's own keeps its intra-op threads for everything else), so nothing is oversubscribed.

The split never changes a result: the work is cut on the caller's boundaries (leaves of a hash, codec blocks,
chunks of the outer step), and every range computes what the whole pass would for it. Users:
`farloco.protocol.digest`, and optim's codecs and strategies, which the agent hands `map_ranges`
(`farloco.optim.ranges.set_range_runner`: optim itself starts no threads).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch

MAX_THREADS = 64
MIN_BYTES_PER_THREAD = 8 << 20
"""Below this much work per thread, a thread's hand-off costs more than its share saves."""

_R = TypeVar("_R")
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_threads = 1
_local = threading.local()  # `in_pool` is set in the pool's own threads


def set_threads(threads: int) -> None:
    """How many threads the passes of this process may use (the agent: its share of the host's cores)."""
    global _threads
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"set_threads: expected an int >= 1, got {threads!r}")
    _threads = min(threads, MAX_THREADS)


def get_threads() -> int:
    return _threads


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=MAX_THREADS, thread_name_prefix="farloco-parallel", initializer=_pool_thread
            )
        return _pool


def _pool_thread() -> None:
    # Per thread: each range runs its torch ops inline (the caller keeps its own intra-op threads), and a pass
    # started inside a range runs there too instead of waiting on the pool it occupies.
    torch.set_num_threads(1)
    _local.in_pool = True


def workers_for(nbytes: int, units: int, threads: int | None = None) -> int:
    """How many threads a pass over `nbytes` bytes cut into `units` indivisible units uses: `threads` (default:
    `set_threads`'s), at most one per unit and one per `MIN_BYTES_PER_THREAD`."""
    wanted = _threads if threads is None else threads
    return max(1, min(wanted, MAX_THREADS, units, nbytes // MIN_BYTES_PER_THREAD))


def map_ranges(
    work: Callable[[int, int], _R], units: int, nbytes: int, threads: int | None = None
) -> list[_R]:
    """`work(first, last)` for contiguous ranges of units [0, units) (one per thread, in order; one range
    [0, units) on the calling thread when one thread does it), results in range order."""
    workers = workers_for(nbytes, units, threads)
    if workers <= 1 or getattr(_local, "in_pool", False):
        return [work(0, units)]
    bounds = [units * i // workers for i in range(workers + 1)]
    futures = [_executor().submit(work, first, last) for first, last in itertools.pairwise(bounds)]
    wait(futures)  # every range done (or failed) before anything is returned or raised: none writes on after
    return [future.result() for future in futures]
