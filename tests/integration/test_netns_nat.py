"""Nodes behind NAT as full members: each node in its own network namespace on one bridge, the NAT'd ones behind
a router namespace of their own that masquerades (they can dial out; nobody can dial them), every node started
with `farloco join` as a user runs it, the NAT'd ones with `network.reachability = "private"`. Needs root,
iproute2 and nftables: skips with the reason elsewhere, and removes every namespace it made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.swarm import rounds_of, started_event, wait_for, wait_for_exit

from farloco.node.tools.demo import (
    PeerProcess,
    demo_config,
    start_bootstrap,
    start_peer,
    stop_process,
)
from farloco.node.tools.netns import NamespaceWAN, nat_unavailable

pytestmark = [pytest.mark.multiprocess, pytest.mark.dht]

PRIVATE = ["--set", 'network.reachability="private"']


def _run(
    tmp_path: Path,
    ids: dict[str, str],
    nodes: int,
    nat: tuple[int, ...],
    rounds: int,
    late: tuple[int, ...] = (),
) -> dict[str, dict[int, dict[str, Any]]]:
    """Train `rounds` rounds with `nodes` nodes, those in `nat` behind NAT, those in `late` started once the
    others committed round 2; returns each node's round events by round id, fills `ids` (name -> peer id) and
    checks every exit code."""
    reason = nat_unavailable()
    if reason is not None:
        pytest.skip(reason)
    config = tmp_path / "swarm.toml"
    config.write_text(demo_config(rounds, ["run.inner_steps=4", "node.eval_batches=0"]))
    processes = []
    peers: list[PeerProcess] = []
    with NamespaceWAN(nodes, "1gbit", nat=nat) as wan:
        try:
            bootstrap, maddr = start_bootstrap(tmp_path, host=wan.address(1), prefix=wan.prefix_command(1))
            processes.append(bootstrap)

            def start(i: int) -> PeerProcess:
                peer = start_peer(
                    f"n{i}", tmp_path, config, maddr, 1, PRIVATE if i in nat else (),
                    host=wan.address(i), prefix=wan.prefix_command(i),
                )  # fmt: skip
                processes.append(peer.process)
                return peer

            peers = [start(i) for i in range(1, nodes + 1) if i not in late]
            if late:  # against a hang (round 1 alone took 16 s on a loaded machine), not a timing
                first = peers[0]
                wait_for(lambda: any(e["round_id"] >= 2 for e in rounds_of(first)), 300, "round 2", peers)
                peers += [start(i) for i in late]
            # A bound against a hang, not a timing: rounds take ~3 s here, up to ~15 s on a loaded 2-core machine.
            wait_for_exit(peers, 120 + 20 * rounds, f"{nodes} nodes to finish {rounds} rounds")
        finally:
            stop_process(*processes)
    ids.update({p.name: started_event(p)["peer_id"] for p in peers})
    return {p.name: {e["round_id"]: e for e in rounds_of(p)} for p in peers}


def _check(
    committed: dict[str, dict[int, dict[str, Any]]], ids: dict[str, str], rounds: range, nat: list[str]
) -> None:
    """Every node committed every round of `rounds` with one hash; every node behind NAT is among the contributors
    of >= 95% of them, as every public node is."""
    for round_id in rounds:
        events = {name: by_round.get(round_id) for name, by_round in committed.items()}
        assert all(events.values()), f"round {round_id} missing on {[n for n, e in events.items() if not e]}"
        assert len({e["outer_hash"] for e in events.values() if e}) == 1, f"round {round_id}: two hashes"
    for name in committed:
        contributed = [r for r in rounds if ids[name] in committed[name][r]["contributors"]]
        share = len(contributed) / len(rounds)
        assert share >= 0.95, (name, name in nat, share, sorted(set(rounds) - set(contributed)))


def test_a_node_behind_nat_trains_in_every_round_like_the_others(tmp_path: Path) -> None:
    ids: dict[str, str] = {}
    committed = _run(tmp_path, ids, 3, nat=(3,), rounds=12)
    _check(committed, ids, range(1, 13), ["n3"])


@pytest.mark.slow
def test_a_swarm_half_behind_nat_trains_and_agrees_and_a_late_one_takes_state_from_donors(
    tmp_path: Path,
) -> None:
    """4 nodes, 2 of them behind NAT, one of those joining late: it takes the swarm's state from the public
    nodes (a node behind NAT serves none) and contributes from then on."""
    ids: dict[str, str] = {}
    committed = _run(tmp_path, ids, 4, nat=(3, 4), rounds=12, late=(4,))
    first = min(committed["n4"])  # the first round n4 committed, after taking the state
    _check(committed, ids, range(first + 1, 13), ["n3", "n4"])
