"""Keeping a process's large tensors out of the children it forks.

A forked child shares its parent's pages copy-on-write: the first write to each page after the fork copies it,
page fault by page fault, in the parent, and the child keeps the old page for as long as it lives. The agent
forks its DHT node (hivemind runs it as a child process) after it built theta_outer and the outer strategy's
state, so without this the first write of each (the first commit's outer step, the first contribution into the
strategy's freed residual) paid a copy-on-write fault per 4 KiB page: 3.6 ns per byte on one core, seconds per
GB, and the node held two copies of those pages from then on. The child never touches them: excluded from the
fork (madvise MADV_DONTFORK), they are simply not mapped there.

Only a storage that has its mapping to itself is excluded, so that the excluded pages hold that tensor alone and
go away with it: at least `MIN_BYTES` (glibc's mmap threshold is at most 32 MiB), and either the start of a
mapping (a file or an mmap of its own) or a malloc chunk glibc mapped for it alone (IS_MMAPPED in the chunk's
header). A large request can also be served from a free chunk of the heap (tcpstream's `tune_malloc` keeps up to
256 MiB free there): excluding those pages would outlive the tensor, and whatever malloc placed there next would
be missing from every later child. Those are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MADV_DONTFORK = 10  # linux/mman-common.h
MIN_BYTES = 64 << 20


def libc_function(name: str) -> Any | None:
    """The C library's function `name` through ctypes (errno kept), or None where there is none to call (not
    Linux, no libc found, no such symbol)."""
    if not sys.platform.startswith("linux"):
        return None
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return getattr(ctypes.CDLL(library, use_errno=True), name)
    except (OSError, AttributeError):
        return None


def _madvise() -> Any | None:
    madvise = libc_function("madvise")
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    return madvise


def exclude_from_fork(*tensors: torch.Tensor) -> int:
    """Keep the pages of these CPU tensors' storages out of every child this process forks from now on (the
    whole pages inside each storage of at least MIN_BYTES). Returns the bytes excluded: 0 where the platform
    has no MADV_DONTFORK (not Linux) or the kernel refused, which changes nothing but the cost above."""
    madvise = _madvise()
    if madvise is None:
        return 0
    page = mmap.PAGESIZE
    excluded = 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() < MIN_BYTES:
            continue
        address = storage.data_ptr()
        if not _own_mapping(address):
            continue
        start = -(-address // page) * page
        end = (address + storage.nbytes()) // page * page
        if end > start and madvise(start, end - start, MADV_DONTFORK) == 0:
            excluded += end - start
    return excluded


IS_MMAPPED = 0x2  # glibc malloc: the chunk was mmapped for this allocation alone (size word's bit 1)


def _own_mapping(address: int) -> bool:
    """Whether the storage at `address` has its mapping to itself (see the module docstring)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                if low <= address < high:
                    break
            else:
                return False
    except OSError:
        return False
    if address - low < 16:  # it starts its mapping: no malloc header before it
        return True
    # A malloc chunk: the size word just before the pointer, inside the same mapping.
    return bool(ctypes.c_size_t.from_address(address - 8).value & IS_MMAPPED)
