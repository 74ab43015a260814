"""A round whose matchmaking ends in a group of the node alone while its peers vanished (their records expired
without a departure, as the isolation watch says) is not committed as it stands: the isolation policy applies
there as before a round: if the swarm moved on the node takes its state (no round of its own: the fork this
prevents); if the peers come back at its round or behind it, or the policy lets it go on alone (run.min_peers =
1, past timeouts.isolation_timeout), its group of one stands. A node alone by right (its peers left properly)
or with a live peer rounds as before."""

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
    """The swarm's member reads into the node's isolation watch (as `Swarm.isolated_now` makes them), and the
    isolation policy's outcome given (`Swarm.ride_out_isolation`: a peer back, the swarm's state taken, or alone)."""

    def __init__(self, state: NodeState, live: list[str], departed: list[str], policy: str) -> None:
        self.state, self.live, self.departed, self.policy = state, live, departed, policy
        self.rode_out = 0

    async def isolated_now(self) -> bool:
        self.state.isolation.observe(100.0, self.live, self.departed)
        return self.state.isolation.verdict == "isolated"

    async def ride_out_isolation(self) -> bool | None:
        self.rode_out += 1
        if self.policy == "back":
            self.state.isolation.observe(101.0, ["p1"], [])
        elif self.policy == "alone":
            self.state.isolation.forget()
        return True if self.policy == "moved-on" else None


def _solo(tmp_path: Path, live: list[str], departed: list[str], policy: str = "") -> tuple[Any, ...]:
    state = NodeState(build_config({}), tmp_path, dict)
    state.peer_id, state.grpc_address = "me", "127.0.0.1:1"
    state.isolation.observe(90.0, ["p1", "p2"], [])  # we knew two peers, live

    async def form_group(round_id: int, member: GroupMember, **_: Any) -> Group:
        return Group(round_id=round_id, group_id="g", members=(member,))  # they vanished meanwhile: us alone

    outer = SimpleNamespace(
        round_id=7,
        outer_hash="h",
        num_params=4,
        strategy=SimpleNamespace(num_rounds=7, keeps_local_progress=False),
    )
    net = SimpleNamespace(matchmaker=SimpleNamespace(form_group=form_group), island=None)
    swarm = _Swarm(state, live, departed, policy)
    runner = RoundRunner(state, outer, None, None, swarm, net)  # type: ignore[arg-type]

    async def run() -> tuple[Any, RoundFacts, bool | None]:
        group, facts = await runner._match(RoundFacts(7, 1))
        return await runner._solo_while_isolated(group, facts)

    group, facts, over = asyncio.run(run())
    state.events.close()
    events = (state.run_dir / "logs" / "agent.jsonl").read_text()
    return group, facts, over, swarm.rode_out, events


@pytest.mark.parametrize("live, departed", [([], ["p1", "p2"]), (["p1"], [])], ids=["departed", "one-live"])
def test_a_group_of_us_alone_stands_when_we_are_not_isolated(
    tmp_path: Path, live: list[str], departed: list[str]
) -> None:
    group, facts, over, rode_out, events = _solo(tmp_path, live, departed)
    assert over is None and rode_out == 0 and "solo_group_isolated" not in events
    assert [m.peer_id for m in group.members] == ["me"] and facts.matchmaking == "grouped"


def test_isolated_and_the_swarm_moved_on_the_round_is_over(tmp_path: Path) -> None:
    _group, _facts, over, rode_out, events = _solo(tmp_path, [], [], "moved-on")
    assert over is True and rode_out == 1
    assert '"solo_group_isolated"' in events and '"p1", "p2"' in events


def test_isolated_then_the_peers_come_back_at_our_round_the_group_of_one_stands(tmp_path: Path) -> None:
    """A restarted peer back at our round (or behind): our group record is in the DHT, so it is late for this
    round and takes the next one's state from us; refusing our group too would leave both waiting for a round
    nobody trains."""
    group, facts, over, rode_out, _events = _solo(tmp_path, [], [], "back")
    assert over is None and rode_out == 1 and facts.matchmaking == "grouped"
    assert [m.peer_id for m in group.members] == ["me"]


def test_isolated_past_the_timeout_with_min_peers_1_goes_on_alone(tmp_path: Path) -> None:
    group, facts, over, rode_out, _events = _solo(tmp_path, [], [], "alone")
    assert over is None and rode_out == 1 and facts.matchmaking == "grouped"
    assert [m.peer_id for m in group.members] == ["me"]
