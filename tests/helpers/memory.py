"""The process's peak memory around a piece of work: for tests that a path holds no vector of the model's size."""

from __future__ import annotations

import os
from collections.abc import Callable

# Linux resets a process's peak RSS (VmHWM) to its current RSS when "5" is written here.
CLEAR_REFS = "/proc/self/clear_refs"
CAN_MEASURE = os.path.exists(CLEAR_REFS)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_growth_mib(work: Callable[[], object]) -> float:
    """How far the process's peak RSS rose above its RSS while `work` ran (VmHWM reset first), in MiB. Pages the
    work writes for the first time count too: touch its outputs before."""
    with open(CLEAR_REFS, "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    work()
    return (_status_kib("VmHWM") - before) / 1024
