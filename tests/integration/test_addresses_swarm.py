"""Addresses as the internet has them: a bootstrap given by DNS name (/dns4, /dns), and a swarm on IPv6 addresses
only (each node in its own namespace with one fd00::/64 address, encrypted as every node beyond loopback), each
trained with `farloco join` as a user runs it. The namespace test needs root and iproute2: it skips with the
reason elsewhere, and removes every namespace it made."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.swarm import rounds_of, started_event, wait_for_exit

from farloco.node.tools.demo import (
    PeerProcess,
    demo_config,
    start_bootstrap,
    start_peer,
    stop_process,
)
from farloco.node.tools.netns import NamespaceWAN, unavailable

pytestmark = [pytest.mark.multiprocess, pytest.mark.dht]

ROUNDS = 3


def _one_swarm(peers: list[PeerProcess]) -> list[dict[str, object]]:
    """Every round 1..ROUNDS committed by every node with all of them in the group and one hash; the nodes'
    `started` events."""
    for round_id in range(1, ROUNDS + 1):
        events = [
            next(
                (e for e in rounds_of(p) if e["round_id"] == round_id),
                None,
            )
            for p in peers
        ]
        assert all(events), f"round {round_id} missing on some node: {events}"
        assert len({e["outer_hash"] for e in events if e}) == 1, f"round {round_id}: two hashes"
        assert all(len(e["group"]) == len(peers) for e in events if e), events
    return [started_event(p) for p in peers]


def test_a_bootstrap_given_by_dns_name_is_joined(tmp_path: Path) -> None:
    """/dns4/localhost/... and /dns/localhost/...: libp2p resolves the name, the nodes find each other."""
    config = tmp_path / "swarm.toml"
    config.write_text(demo_config(ROUNDS, ["run.inner_steps=4", "node.eval_batches=0"]))
    bootstrap, maddr = start_bootstrap(tmp_path)
    peers: list[PeerProcess] = []
    try:
        assert maddr.startswith("/ip4/127.0.0.1/tcp/"), maddr
        rest = maddr.removeprefix("/ip4/127.0.0.1")
        peers = [
            start_peer(name, tmp_path, config, f"{kind}/localhost{rest}", 1)
            for name, kind in (("a", "/dns4"), ("b", "/dns"))
        ]
        wait_for_exit(peers, 120, f"{ROUNDS} rounds")
    finally:
        stop_process(bootstrap, *(p.process for p in peers))
    _one_swarm(peers)


def test_a_swarm_on_ipv6_addresses_only_trains_as_one(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    config = tmp_path / "swarm.toml"
    config.write_text(demo_config(ROUNDS, ["run.inner_steps=4", "node.eval_batches=0"]))
    processes = []
    with NamespaceWAN(2, "1gbit", ipv6=True) as wan:
        try:
            bootstrap, maddr = start_bootstrap(tmp_path, host=wan.address(1), prefix=wan.prefix_command(1))
            processes.append(bootstrap)
            assert maddr.startswith(f"/ip6/{wan.address(1)}/tcp/"), maddr
            peers = [
                start_peer(
                    f"n{i}", tmp_path, config, maddr, 1, host=wan.address(i), prefix=wan.prefix_command(i)
                )
                for i in (1, 2)
            ]
            processes += [p.process for p in peers]
            wait_for_exit(peers, 150, f"{ROUNDS} rounds")
        finally:
            stop_process(*processes)
    started = _one_swarm(peers)
    # Each announced its IPv6 address (in brackets) for gRPC, and its DHT address as /ip6.
    for i, event in enumerate(started, start=1):
        assert event["grpc"].startswith(f"[{wan.address(i)}]:"), event  # type: ignore[attr-defined]
        assert all(m.startswith("/ip6/") for m in event["multiaddrs"]), event  # type: ignore[attr-defined]
