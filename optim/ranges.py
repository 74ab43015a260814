"""How optim's large passes are cut into contiguous ranges, and who runs the ranges.

optim is pure tensor math and starts no threads. Its passes over whole vectors (int8's kernels, the outer step,
the contribution, the finiteness checks) are written as `work(first, last)` over units (codec blocks, chunks of
`CHUNK` values) and handed to the runner set here: by default one call over every unit, on the calling thread;
the agent sets `farloco.util.parallel.map_ranges`, which runs one contiguous range per thread. Every range
computes what the whole pass computes for it, so the bits are the same whoever runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

_R = TypeVar("_R")

RangeRunner = Callable[[Callable[[int, int], Any], int, int], list[Any]]
"""`runner(work, units, nbytes)` -> `[work(first, last), ...]` over contiguous ranges covering [0, units), in
order; `nbytes`, the pass's size, says whether splitting is worth it."""

# Values per chunk of the chunked passes: 4 x 128K x 4 bytes = 2 MiB of operands, about an L2 cache.
CHUNK = 1 << 17


def _one_range(work: Callable[[int, int], _R], units: int, nbytes: int) -> list[_R]:
    return [work(0, units)]


_runner: RangeRunner = _one_range


def set_range_runner(runner: RangeRunner | None) -> None:
    """Run optim's passes through `runner` (None: one call, the default)."""
    global _runner
    _runner = runner or _one_range


def run_ranges(work: Callable[[int, int], _R], units: int, nbytes: int) -> list[_R]:
    """`work(first, last)` over contiguous ranges of [0, units) by the runner set; results in range order."""
    return _runner(work, units, nbytes)


def chunks(numel: int, size: int = CHUNK) -> list[slice]:
    """Contiguous slices covering [0, numel) in order, `size` values each (the last one shorter)."""
    return [slice(start, min(start + size, numel)) for start in range(0, numel, size)]


def run_split(work: Callable[[slice], object], numel: int, nbytes_per_value: int) -> None:
    """`work(part)` for contiguous parts covering [0, numel) (whole chunks, one part per range of the runner):
    for single-pass elementwise operations, which need no chunking to stay in cache."""
    run_ranges(
        lambda first, last: work(slice(first * CHUNK, min(last * CHUNK, numel))),
        -(-numel // CHUNK),
        numel * nbytes_per_value,
    )


def run_chunked(work: Callable[[slice, torch.Tensor], None], numel: int, nbytes_per_value: int) -> None:
    """`work(part, scratch)` for every chunk of [0, numel) (`chunks`), the chunks cut into contiguous runs by the
    runner; each run gets its own scratch tensor of one chunk (float32)."""

    def run(first: int, last: int) -> None:
        scratch = torch.empty(min(CHUNK, numel))
        for index in range(first, last):
            work(slice(index * CHUNK, min((index + 1) * CHUNK, numel)), scratch)

    run_ranges(run, -(-numel // CHUNK), numel * nbytes_per_value)
