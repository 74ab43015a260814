"""Islands (run.island_slices) end to end: two islands of two `farloco join` nodes each and a lone node, through the CLI,
on 127.0.0.1 with a real DHT, gRPC and each island's own c10d rendezvous and gloo group."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.net import free_port
from helpers.swarm import Swarm, rounds_of, wait_for

from farloco.node.tools.demo import read_events

pytestmark = [pytest.mark.multiprocess, pytest.mark.dht, pytest.mark.timeout(600)]


# ~55 s on 2 cores (five nodes): `-m slow`, so that the default suite keeps under ~15 minutes. The default suite
# keeps the island's group with real processes (tests/test_island.py) and an island started through the CLI
# (tests/test_slurm.py::test_the_sbatch_makes_one_island_of_its_nodes).
@pytest.mark.slow
def test_two_islands_of_two_and_a_lone_node_train_as_one_swarm(tmp_path: Path) -> None:
    rounds = 6
    made = Swarm(tmp_path, [f"run.max_rounds={rounds}", "run.inner_steps=4", "run.island_slices=8"])
    try:
        peers = []
        for island, size in (("a", "2"), ("b", "0")):  # island b leaves its size to run.island_slices
            endpoint = f"127.0.0.1:{free_port()}"
            for index in range(2):
                peers.append(
                    made.add(
                        f"{island}{index}",
                        extra=(
                            "--island",
                            island,
                            "--island-endpoint",
                            endpoint,
                            "--set",
                            f"node.island_size={size}",
                        ),
                    )
                )
        peers.append(made.add("lone"))
        wait_for(
            lambda: all(p.process.poll() == 0 for p in peers),
            500,
            f"5 nodes to train {rounds} rounds and stop",
            peers,
        )
        by_peer = {p.name: {e["round_id"]: e for e in rounds_of(p)} for p in peers}
        num_params = next(e["num_params"] for e in read_events(peers[-1].run_dir) if e["event"] == "started")
        # Every committed hash agrees, round by round, islands or not.
        for round_id in range(1, rounds + 1):
            hashes = {name: r[round_id]["outer_hash"] for name, r in by_peer.items() if round_id in r}
            assert len(set(hashes.values())) == 1, f"round {round_id}: {hashes}"
        # Once formed, each island goes through its rounds together: rank 0 and rank 1, each with half the
        # slices, and the five nodes are in the same rounds.
        together = [
            r
            for r in range(1, rounds + 1)
            if all(r in by_peer[n] for n in by_peer)
            and all((by_peer[n][r]["island"] or {}).get("size") == 2 for n in ("a0", "a1", "b0", "b1"))
        ]
        assert together, {n: [e["island"] for e in r.values()] for n, r in by_peer.items()}
        for r in together:
            events = {n: by_peer[n][r] for n in by_peer}
            assert len(events["lone"]["contributors"]) == 5
            for island in "ab":
                spans = sorted(tuple(events[f"{island}{i}"]["island"]["span"]) for i in range(2))
                assert spans == [(0, 4), (4, 8)]
            # The lone node's share of the exchange is what it would be among three members (island a, island b
            # and itself): it pushes every value outside its part and returns its part's mean to one node of each
            # island, 4 (N + P) bytes of fp32 for a part of P values, where a flat exchange of five would have it
            # return its part to four members: 4 (N + 3P).
            part = num_params // 5
            assert 4 * (num_params + part) <= events["lone"]["fp32_bytes"] <= 4 * (num_params + part + 1), (
                events
            )
        assert by_peer["lone"][rounds]["island"] is None
    finally:
        made.close()


@pytest.mark.slow
def test_an_island_node_sigkilled_mid_run_costs_its_island_a_round_and_nothing_forks(tmp_path: Path) -> None:
    """An island under faults: a node of an island dies (SIGKILL) while the swarm trains. Its island partner goes on
    alone (then as an island of one), the other island and the lone node never stop, and every committed hash
    agrees round by round: nobody averaged a slice the dead node never delivered."""
    import os
    import signal

    made = Swarm(tmp_path, ["run.max_rounds=0", "run.inner_steps=4", "run.island_slices=8"])
    try:
        peers = {}
        for island in "ab":
            endpoint = f"127.0.0.1:{free_port()}"
            for index in range(2):
                name = f"{island}{index}"
                peers[name] = made.add(
                    name,
                    extra=("--island", island, "--island-endpoint", endpoint, "--set", "node.island_size=2"),
                )
        peers["lone"] = made.add("lone")
        everyone = list(peers.values())

        def together_rounds() -> list[int]:
            by = {n: {e["round_id"]: e for e in rounds_of(p)} for n, p in peers.items()}
            return [
                r
                for r in by["lone"]
                if all(
                    r in by[n] and (by[n][r]["island"] or {}).get("size") == 2
                    for n in ("a0", "a1", "b0", "b1")
                )
            ]

        wait_for(lambda: len(together_rounds()) >= 2, 300, "2 rounds with both islands together", everyone)
        killed_at = max(e["round_id"] for e in rounds_of(peers["a1"]))
        os.killpg(peers["a1"].process.pid, signal.SIGKILL)
        peers["a1"].process.wait()
        survivors = [p for n, p in peers.items() if n != "a1"]
        target = killed_at + 6
        wait_for(
            lambda: all(any(e["round_id"] >= target for e in rounds_of(p)) for p in survivors),
            300,
            f"the four survivors to reach round {target}",
            survivors,
        )
        by = {p.name: {e["round_id"]: e for e in rounds_of(p)} for p in survivors}
        for round_id in range(1, target + 1):
            hashes = {n: r[round_id]["outer_hash"] for n, r in by.items() if round_id in r}
            assert len(set(hashes.values())) == 1, f"round {round_id}: {hashes}"
        # The lone node and island b never missed a round after the kill.
        for name in ("lone", "b0", "b1"):
            assert all(r in by[name] for r in range(killed_at + 1, target + 1)), (name, sorted(by[name]))
        # a0 trains on: its later rounds are committed alone or as an island of one, never with a dead partner.
        later = [by["a0"][r] for r in range(killed_at + 2, target + 1) if r in by["a0"]]
        assert later and all(
            (e["island"] or {}).get("size", 1) == 1 or e["island"].get("alone") for e in later
        ), later
    finally:
        made.close()
