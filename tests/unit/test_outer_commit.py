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
from farloco.node.daemon.core import AgentError, Prepared
from farloco.node.daemon.rounds import Averaged
from farloco.protocol.exchange import OnDemand
from farloco.protocol.statesync import StateServer


def committable(tmp_path: Path) -> tuple[Agent, StateServer, Prepared, Averaged]:
    """A bare agent (int8) with the state server it registers, and a round's contribution ready to commit."""
    agent = Agent(load_config(None, ['run.codec="int8"']), tmp_path / "node")
    server = StateServer(agent.outer.snapshot)  # what the node serves joiners, as Agent._serve registers it
    generator = torch.Generator().manual_seed(0)
    theta_local = agent.outer.theta + 1e-3 * torch.randn(agent.outer.theta.shape, generator=generator)
    contribution = agent.outer.contribution(theta_local)
    # The synchronous loop's contribution with a dense codec: made on demand, sent in one range here.
    assert isinstance(contribution, OnDemand)
    whole = contribution.chunk(0, contribution.numel)
    transmitted = agent.outer.codec.decode(agent.outer.codec.encode(whole))
    prepared = Prepared(theta_local, contribution, fixed_reference=False)
    return agent, server, prepared, Averaged(((0, contribution.numel),), transmitted, ("self",), 0, 0, 0)


def test_a_commit_runs_off_the_event_loop_and_is_seen_through(tmp_path: Path) -> None:
    agent, server, prepared, averaged = committable(tmp_path)
    before, theta_before = agent.outer.round_id, agent.outer.theta.clone()

    # The commit, held inside its thread until the test lets it go.
    in_thread, release = threading.Event(), threading.Event()
    commit = agent.outer.round.commit
    threads: list[str] = []

    def held_commit(*args: Any) -> str:
        threads.append(threading.current_thread().name)
        in_thread.set()
        assert release.wait(30)
        return commit(*args)

    agent.outer.round.commit = held_commit  # type: ignore[method-assign]

    async def scenario() -> None:
        committing = asyncio.create_task(
            agent.outer.commit(prepared.contribution, averaged.transmitted, averaged.mean)
        )
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
        assert agent.outer.round_id == before + 1
        assert agent.outer.outer_hash == theta_hash(agent.outer.theta)
        assert not torch.equal(agent.outer.theta, theta_before)
        manifest, _ = await asyncio.wait_for(served, 30)
        assert manifest.round_id == before + 1
        assert manifest.meta["outer_hash"] == agent.outer.outer_hash

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert threads == ["farloco-outer_0"]
    # The commit's thread runs its torch ops on as many threads as the event loop's.
    executor = agent.outer.thread()
    assert executor.submit(torch.get_num_threads).result() == torch.get_num_threads()
    executor.shutdown()


def test_the_served_state_is_copied_off_the_event_loop_and_nothing_changes_it_mid_copy(
    tmp_path: Path,
) -> None:
    """A donor's snapshot (12 bytes per parameter of copies with diloco: 12 GB at 1B) is copied on the outer
    thread while the loop serves; a commit and an install (a fork healed, a catch-up) that come meanwhile wait
    for the copy, so the bytes served are the state the manifest names; then both go through in order."""
    agent, server, prepared, averaged = committable(tmp_path)
    other = agent.outer.round.snapshot()
    other["theta"] += 0.5  # the state a donor of round 7 serves us
    other_meta = {"round_id": 7, "run_hash": agent.state.run_hash}
    before, hash_before, theta_before = (
        agent.outer.round_id,
        agent.outer.outer_hash,
        agent.outer.theta.clone(),
    )

    in_thread, release = threading.Event(), threading.Event()
    snapshot = agent.outer.round.snapshot
    threads: list[str] = []

    def held_snapshot() -> dict[str, torch.Tensor]:
        threads.append(threading.current_thread().name)
        in_thread.set()
        assert release.wait(30)
        return snapshot()

    agent.outer.round.snapshot = held_snapshot  # type: ignore[method-assign]
    order: list[str] = []
    commit, load_state = agent.outer.round.commit, agent.outer.load_state

    def logged_commit(*args: Any) -> str:
        order.append("commit")
        return commit(*args)

    def logged_load(*args: Any) -> str:
        order.append("install")
        return load_state(*args)

    agent.outer.round.commit = logged_commit  # type: ignore[method-assign]
    agent.outer.load_state = logged_load  # type: ignore[method-assign]

    async def scenario() -> None:
        served = asyncio.create_task(server.snapshot())
        while not in_thread.is_set():
            await asyncio.sleep(0.005)
        committing = asyncio.create_task(
            agent.outer.commit(prepared.contribution, averaged.transmitted, averaged.mean)
        )
        installing = asyncio.create_task(agent.outer.install(other_meta, other))
        ticks = 0
        for _ in range(5):
            await asyncio.sleep(0.01)  # the loop runs while the copy is under way
            ticks += 1
        assert ticks == 5 and not served.done()
        assert not committing.done() and not installing.done(), "the state changed under a donor's copy"
        assert torch.equal(agent.outer.theta, theta_before) and agent.outer.round_id == before
        release.set()
        manifest, raw = await asyncio.wait_for(served, 30)
        assert manifest.round_id == before and manifest.meta["outer_hash"] == hash_before
        served_theta = torch.from_numpy(raw["theta"].copy()).view(torch.float32)
        assert torch.equal(served_theta, theta_before)
        await asyncio.wait_for(committing, 30)
        await asyncio.wait_for(installing, 30)
        # The commit asked for the lock first, so it went first; the install ran after it (it may have finished
        # before this coroutine resumed from the commit, so the order is read from the thread, not the round id).
        assert order == ["commit", "install"]
        assert agent.outer.round_id == 7
        assert torch.equal(agent.outer.theta, other["theta"])
        assert agent.outer.outer_hash == theta_hash(other["theta"])
        again, _ = await server.snapshot()  # the installed state is what is served now
        assert again.round_id == 7 and again.meta["outer_hash"] == agent.outer.outer_hash

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert threads == ["farloco-outer_0", "farloco-outer_0"]  # the held copy, then the installed state's
    agent.outer.thread().shutdown()


def test_an_install_that_fails_its_checks_changes_nothing(tmp_path: Path) -> None:
    agent = Agent(load_config(None, []), tmp_path / "node")
    state = agent.outer.round.snapshot()
    before, hash_before, theta_before = (
        agent.outer.round_id,
        agent.outer.outer_hash,
        agent.outer.theta.clone(),
    )
    bad_shape = {**state, "theta": torch.zeros(agent.outer.num_params + 1)}
    with pytest.raises(
        AgentError, match=rf"expected theta float32\[{agent.outer.num_params}\], got torch.float32"
    ):
        asyncio.run(agent.outer.install({"round_id": 9, "run_hash": agent.state.run_hash}, bad_shape))
    nan_momentum = {
        **state,
        "strategy.momentum_buffer": torch.full_like(state["strategy.momentum_buffer"], 1.0),
    }
    nan_momentum["strategy.momentum_buffer"][-1] = float("nan")
    with pytest.raises(AgentError, match=r"donor state: .*momentum_buffer: expected only finite values"):
        asyncio.run(agent.outer.install({"round_id": 9, "run_hash": agent.state.run_hash}, nan_momentum))
    assert not agent.outer.strategy.state_dict()["momentum_buffer"].any()  # not half-installed either
    with pytest.raises(AgentError, match="donor serves another run"):
        asyncio.run(
            agent.outer.install({"round_id": 9, "run_hash": "0" * 64}, {**state, "theta": state["theta"] + 1})
        )
    assert agent.outer.round_id == before and agent.outer.outer_hash == hash_before
    assert torch.equal(agent.outer.theta, theta_before)
    agent.outer.thread().shutdown()
