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


def test_a_large_tensor_is_not_mapped_in_a_forked_child_and_keeps_its_values() -> None:
    tensor = torch.arange(MIN_BYTES // 4, dtype=torch.float32)
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
    tensor = torch.zeros(MIN_BYTES // 4 + 1024)
    assert exclude_from_fork(tensor[:5]) >= MIN_BYTES - 2 * os.sysconf("SC_PAGE_SIZE")
    assert _excluded(tensor.data_ptr() + MIN_BYTES // 2)
