"""util/memory.py: a large tensor excluded from forks is not mapped in a forked child, and its first write
after the fork pays no copy-on-write."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from farloco.util.memory import MIN_BYTES, exclude_from_fork

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK is Linux's")


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False


def _excluded(address: int) -> bool:
    """Whether the mapping holding `address` is kept from forks: VM_DONTCOPY, 'dc' in smaps' VmFlags."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return "dc" in line.split()[1:]
    raise AssertionError(f"{address:#x} is not mapped")


def _mapped_in_child(address: int) -> bool:
    pid = os.fork()
    if pid == 0:  # the child reports through its exit status and touches nothing of the parent's tensors
        os._exit(1 if _mapped(address) else 0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 1), f"the forked child ended with {code}"
    return code == 1


def _own_tensor(numel: int) -> torch.Tensor:
    """A float32 tensor on a mapping of its own (what glibc gives a large allocation on a fresh heap; a heap
    that earlier tests filled and freed may serve it from a free chunk instead, see the last test)."""
    import mmap

    return torch.frombuffer(mmap.mmap(-1, numel * 4), dtype=torch.float32)


def test_a_large_tensor_is_not_mapped_in_a_forked_child_and_keeps_its_values() -> None:
    tensor = _own_tensor(MIN_BYTES // 4)
    tensor.copy_(torch.arange(MIN_BYTES // 4, dtype=torch.float32))
    middle = tensor.data_ptr() + tensor.numel() * 2
    assert _mapped(middle) and _mapped_in_child(middle)
    excluded = exclude_from_fork(tensor)
    assert MIN_BYTES - 2 * os.sysconf("SC_PAGE_SIZE") <= excluded <= MIN_BYTES
    assert _excluded(middle)
    assert not _mapped_in_child(middle)
    assert _mapped(middle)
    tensor.add_(1.0)  # the parent's pages are its own as before
    assert float(tensor[0]) == 1.0 and float(tensor[-1]) == float(tensor.numel())


def test_small_tensors_and_views_of_small_storages_are_left_alone() -> None:
    small = torch.zeros(MIN_BYTES // 4 - 1)
    middle = small.data_ptr() + small.numel() * 2
    assert not _excluded(middle)
    assert exclude_from_fork(small, small[:10]) == 0
    assert not _excluded(middle)


def test_a_view_excludes_its_whole_storage_once() -> None:
    tensor = _own_tensor(MIN_BYTES // 4 + 1024)
    assert exclude_from_fork(tensor[:5]) >= MIN_BYTES - 2 * os.sysconf("SC_PAGE_SIZE")
    assert _excluded(tensor.data_ptr() + MIN_BYTES // 2)


def test_a_large_tensor_served_from_the_heap_is_left_alone() -> None:
    """With tcpstream's malloc settings a freed heap can hold a free chunk big enough for a large tensor: its
    pages are the heap's, and excluding them would outlive the tensor (a later allocation there would be missing
    from every child forked after: what made this file's second test fail after the first in one process)."""
    from farloco.protocol.tcpstream import tune_malloc

    if not tune_malloc():
        pytest.skip("no glibc mallopt")
    pieces = [
        torch.ones(4 << 20) for _ in range(40)
    ]  # 40 x 16 MiB from the heap (under the 32 MiB threshold)
    del pieces  # one free chunk of ~640 MiB, kept (trim threshold 256 MiB... and top pad)
    tensor = torch.zeros(MIN_BYTES // 4)
    middle = tensor.data_ptr() + MIN_BYTES // 2
    heap = not _own_mapping_of(tensor)
    excluded = exclude_from_fork(tensor)
    if heap:
        assert excluded == 0 and not _excluded(middle) and _mapped_in_child(middle)
    else:  # glibc mapped it alone after all: excluded as usual
        assert excluded > 0 and not _mapped_in_child(middle)


def _own_mapping_of(tensor: torch.Tensor) -> bool:
    from farloco.util.memory import _own_mapping

    return _own_mapping(tensor.untyped_storage().data_ptr())
