"""A round whose matchmaking ends in a group of the node alone while its peers vanished (their records expired
without a departure, as the isolation watch says) is not committed alone: it closes as a failed matchmaking, so
the node takes the state of whoever reaches the next round instead of forking the swarm. A node that is alone
by right (its peers left properly, or it never had any) still rounds alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from farloco.node.config import build_config
from farloco.node.daemon.core import NodeState
from farloco.node.daemon.rounds import RoundRunner
from farloco.node.daemon.rules import RoundFacts
from farloco.protocol.types import Group, GroupMember


class _Swarm:
    """The swarm's member read, as `Swarm.isolated_now` does it: the live others and the departed into the
    node's isolation watch."""

    def __init__(self, state: NodeState, live: list[str], departed: list[str]) -> None:
        self.state, self.live, self.departed = state, live, departed

    async def isolated_now(self) -> bool:
        self.state.isolation.observe(100.0, self.live, self.departed)
        return self.state.isolation.verdict == "isolated"


def _runner(tmp_path: Path, live: list[str], departed: list[str]) -> tuple[RoundRunner, NodeState]:
    state = NodeState(build_config({}), tmp_path, dict)
    state.peer_id, state.grpc_address = "me", "127.0.0.1:1"
    state.isolation.observe(90.0, ["p1", "p2"], [])  # we knew two peers, live

    async def form_group(round_id: int, member: GroupMember, **_: Any) -> Group:
        return Group(round_id=round_id, group_id="g", members=(member,))  # they vanished meanwhile: us alone

    outer = SimpleNamespace(round_id=7, outer_hash="h", strategy=SimpleNamespace(num_rounds=7))
    net = SimpleNamespace(matchmaker=SimpleNamespace(form_group=form_group), island=None)
    runner = RoundRunner(state, outer, None, None, _Swarm(state, live, departed), net)  # type: ignore[arg-type]
    return runner, state


def _events(state: NodeState) -> list[str]:
    state.events.close()
    return (state.run_dir / "logs" / "agent.jsonl").read_text()


@pytest.mark.parametrize(
    ("live", "departed", "refused"),
    [
        ([], [], True),  # both vanished without leaving: isolated
        ([], ["p1", "p2"], False),  # both left properly: alone by right
        (["p1"], [], False),  # one is live (it grouped elsewhere, or is behind): not isolated
    ],
    ids=["vanished", "departed", "one-live"],
)
def test_a_group_of_us_alone_is_refused_only_while_isolated(
    tmp_path: Path, live: list[str], departed: list[str], refused: bool
) -> None:
    runner, state = _runner(tmp_path, live, departed)
    group, facts = asyncio.run(runner._match(RoundFacts(7, 1)))
    if refused:
        assert group is None and facts.matchmaking == "failed"
        assert '"solo_group_refused"' in _events(state) and '"p1"' in _events(state)
    else:
        assert group is not None and [m.peer_id for m in group.members] == ["me"]
        assert facts.matchmaking == "grouped" and facts.group_size == 1
        assert "solo_group_refused" not in _events(state)
