"""The shared-memory hand-off: layout, sequence protocol, and sharing across real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from farloco.node.handoff import Handoff, canonical_layout, flatten, layout_of, unflatten


def test_canonical_layout_is_sorted_and_packed() -> None:
    layout = canonical_layout({"b.weight": (2, 3), "a.weight": (4,), "c": ()})
    assert [s.name for s in layout] == ["a.weight", "b.weight", "c"]
    assert [s.offset for s in layout] == [0, 4, 10]
    assert layout[-1].numel == 1


def test_flatten_unflatten_round_trip() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    layout = layout_of(model)
    flat = flatten(model, layout)
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    views = unflatten(flat, layout)
    for name, param in model.named_parameters():
        assert torch.equal(views[name], param.detach())


def _rank(path: str, rank: int) -> None:
    handoff = Handoff.attach(Path(path))
    while handoff.publish_seq < 1:
        pass
    reload, round_id, step_base, steps = handoff.work()
    assert (reload, round_id, step_base, steps) == (True, 3, 60, 20)
    half = handoff.num_params // 2
    rows = slice(rank * half, (rank + 1) * half)
    handoff.local[rows] = handoff.theta[rows] * 2 + rank
    handoff.mark_done(rank, 1, train_loss=1.5 + rank, step_seconds=0.01, steps=4)


@pytest.mark.multiprocess
def test_sequence_protocol_across_processes(tmp_path: Path) -> None:
    handoff = Handoff.create(num_params=8, world_size=2, directory=tmp_path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(str(handoff.path), r)) for r in range(2)]
    for p in procs:
        p.start()
    theta = torch.arange(8, dtype=torch.float32)
    published_ns = time.time_ns()
    seq = handoff.publish(theta, round_id=3, step_base=60, inner_steps=20)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert handoff.all_done(seq)
    # When each rank reported done: from then on it waits for the agent (the round event's ranks_idle_seconds).
    assert all(published_ns <= handoff.report(r).done_ns <= time.time_ns() for r in range(2))
    expected = theta * 2 + torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.float32)
    assert torch.equal(handoff.local, expected)
    assert [handoff.report(r).train_loss for r in range(2)] == [1.5, 2.5]
    assert [handoff.report(r).seq_steps for r in range(2)] == [4, 4]
    path = handoff.path
    handoff.close()
    assert not path.exists()


def test_attach_refuses_foreign_files(tmp_path: Path) -> None:
    bogus = tmp_path / "x.bin"
    bogus.write_bytes(b"\0" * 8192)
    with pytest.raises(ValueError, match="not a farloco"):
        Handoff.attach(bogus)
    handoff = Handoff.create(num_params=4, world_size=1, directory=tmp_path)
    with pytest.raises(ValueError, match=r"expected float32\[4\]"):
        handoff.publish(torch.zeros(5), round_id=0, step_base=0, inner_steps=1)
    handoff.close()


def test_hand_off_files_of_dead_agents_are_swept_at_the_next_create(tmp_path: Path) -> None:
    """A SIGKILLed agent cannot unlink its hand-off (8 bytes per parameter in /dev/shm): the next agent's create
    removes it, and leaves alone the files of live agents and anything not named like a hand-off."""
    import subprocess
    import sys

    from farloco.node.handoff import Handoff

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale = [
        tmp_path / f"farloco-handoff-{dead_pid}-0123abcd.bin",
        tmp_path / f"farloco-handoff-{dead_pid}-0123abcd.bin.inner",
    ]
    live = tmp_path / f"farloco-handoff-{os.getppid()}-89abcdef.bin"  # our parent is alive
    other = tmp_path / "farloco-handoff-notes.txt"
    for path in (*stale, live, other):
        path.write_bytes(b"x")
    handoff = Handoff.create(16, 1, tmp_path)
    try:
        assert not any(path.exists() for path in stale)
        assert live.exists() and other.exists() and handoff.path.exists()
    finally:
        handoff.close()
