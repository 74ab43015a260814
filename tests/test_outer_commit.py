"""A round's commit (the outer step and theta's digest, seconds at 10B) runs off the agent's event loop: the loop
goes on meanwhile, a donor's state request waits for the commit instead of copying a theta half-way through its
step, and a round cancelled meanwhile (a leave) still sees its step through and advances the round."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from farloco.node.config import load_config
from farloco.node.daemon.agent import Agent, theta_hash
from farloco.node.daemon.core import Prepared
from farloco.node.daemon.rounds import Averaged
from farloco.protocol.statesync import StateServer


def test_a_commit_runs_off_the_event_loop_and_is_seen_through(tmp_path: Path) -> None:
    agent = Agent(load_config(None, ['run.codec="int8"']), tmp_path / "node")
    server = StateServer(agent._served_state)  # what the node serves joiners, as Agent._serve registers it
    generator = torch.Generator().manual_seed(0)
    theta_local = agent.theta + 1e-3 * torch.randn(agent.theta.shape, generator=generator)
    contribution = agent.outer.contribution(theta_local)
    transmitted = agent.codec.decode(agent.codec.encode(contribution))
    prepared = Prepared(theta_local, contribution, fixed_reference=False)
    averaged = Averaged(transmitted, transmitted, ("self",), 0, 0, 0)
    before, theta_before = agent.round_id, agent.theta.clone()

    # The commit, held inside its thread until the test lets it go.
    in_thread, release = threading.Event(), threading.Event()
    commit = agent.outer.commit
    threads: list[str] = []

    def held_commit(*args: Any) -> str:
        threads.append(threading.current_thread().name)
        in_thread.set()
        assert release.wait(30)
        return commit(*args)

    agent.outer.commit = held_commit  # type: ignore[method-assign]

    async def scenario() -> None:
        committing = asyncio.create_task(agent._outer_commit(prepared, averaged))
        while not in_thread.is_set():
            await asyncio.sleep(0.005)
        served = asyncio.create_task(server.snapshot())
        for _ in range(5):
            await asyncio.sleep(0.01)  # the loop runs while the step is under way
        assert not served.done(), "a donor built its snapshot while theta was being stepped"
        committing.cancel()  # a leave meanwhile
        await asyncio.sleep(0.05)
        assert not committing.done(), "the round was abandoned half-way through its step"
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await committing
        assert agent.round_id == before + 1
        assert agent.outer_hash == theta_hash(agent.theta)
        assert not torch.equal(agent.theta, theta_before)
        manifest, _ = await asyncio.wait_for(served, 30)
        assert manifest.round_id == before + 1
        assert manifest.meta["outer_hash"] == agent.outer_hash

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert threads == ["farloco-outer_0"]
    # The commit's thread runs its torch ops on as many threads as the event loop's.
    executor = agent._outer_thread()
    assert executor.submit(torch.get_num_threads).result() == torch.get_num_threads()
    executor.shutdown()
