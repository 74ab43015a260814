"""The tree hash that vouches for the model's bytes (farloco.protocol.digest): its value, against a plain
re-implementation of its definition, does not depend on the threads that compute it and tells buffers apart."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from farloco.protocol.digest import LEAF_BYTES, PREFIX, digest


def _reference(data: bytes) -> str:
    """The definition in the module's docstring, spelled out sequentially."""
    leaves = [data[i : i + LEAF_BYTES] for i in range(0, len(data), LEAF_BYTES)] or [b""]
    root = hashlib.sha256(PREFIX + struct.pack("<QQ", len(data), LEAF_BYTES))
    for leaf in leaves:
        root.update(hashlib.sha256(leaf).digest())
    return root.hexdigest()


@pytest.mark.parametrize(
    "nbytes",
    [0, 1, 4095, LEAF_BYTES - 1, LEAF_BYTES, LEAF_BYTES + 1, 3 * LEAF_BYTES + 5, 37 * LEAF_BYTES + 12],
)
def test_the_digest_is_its_definition(nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    assert digest(data) == _reference(data)


def test_a_known_value() -> None:
    # Pinned: peers of one run must agree on it; a change here is a protocol change (checkpoints' format_version).
    assert digest(b"farloco") == "0842c1472976723f033f89bba0693c7805bd03a1e791a1bd35ffac4a56ff90be"
    assert digest(b"") == "191e8bec4f9807a02f9b03744e42123d6f313105c8465802c3bfa25e15f6d8e2"


def test_threads_do_not_change_the_value() -> None:
    theta = torch.randn(41 * LEAF_BYTES // 4 + 3)  # 41 leaves and a bit: uneven spans for every thread count
    array = theta.numpy()
    values = {digest(array.data, threads=threads) for threads in (1, 2, 3, 5, 8, 64)}
    assert values == {_reference(array.tobytes())}


def test_any_change_of_bytes_or_length_changes_it() -> None:
    array = np.zeros(20 * LEAF_BYTES // 4, dtype=np.float32)
    base = digest(array.data, threads=4)
    flipped = array.copy()
    flipped.view(np.uint8)[13 * LEAF_BYTES + 7] ^= 1  # one bit in the 14th leaf
    assert digest(flipped.data, threads=4) != base
    assert digest(array[:-1].data, threads=4) != base  # a shorter buffer of the same zeros
    # Unlike the plain sha256 of the same bytes: the scheme is its own value.
    assert base != hashlib.sha256(array.data).hexdigest()


def test_a_non_contiguous_buffer_is_refused() -> None:
    array = np.arange(10, dtype=np.float32)[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        digest(array)


def test_map_ranges_covers_every_unit_once_in_order_and_waits_for_every_range() -> None:
    import threading
    import time

    from farloco.util.parallel import MIN_BYTES_PER_THREAD, map_ranges, workers_for

    assert workers_for(100 * MIN_BYTES_PER_THREAD, 1000, threads=7) == 7
    assert workers_for(3 * MIN_BYTES_PER_THREAD, 1000, threads=7) == 3  # too little work for 7
    assert workers_for(100 * MIN_BYTES_PER_THREAD, 2, threads=7) == 2  # one unit each at most
    assert workers_for(0, 0, threads=7) == 1
    barrier = threading.Barrier(4, timeout=10)

    def span(first: int, last: int) -> tuple[int, int]:
        barrier.wait()  # all four at once: each range on a thread of its own
        return first, last

    ranges = map_ranges(span, 1001, 100 * MIN_BYTES_PER_THREAD, threads=4)
    assert ranges == [(0, 250), (250, 500), (500, 750), (750, 1001)]

    finished: list[int] = []

    def work(first: int, last: int) -> int:
        if first == 0:
            raise RuntimeError("range 0 failed")
        time.sleep(0.2)
        finished.append(first)
        return first

    with pytest.raises(RuntimeError, match="range 0 failed"):
        map_ranges(work, 4, 100 * MIN_BYTES_PER_THREAD, threads=4)
    assert sorted(finished) == [1, 2, 3]  # the others ran to their end before the error was raised


def test_a_pass_started_inside_a_range_runs_there_instead_of_waiting_on_the_pool() -> None:
    from farloco.util.parallel import MIN_BYTES_PER_THREAD, map_ranges

    big = 100 * MIN_BYTES_PER_THREAD
    inner = map_ranges(lambda a, b: map_ranges(lambda c, d: (c, d), 8, big, threads=64), 64, big, threads=64)
    assert inner == [[(0, 8)]] * 64  # 64 ranges on 64 threads, each running its own pass inline
