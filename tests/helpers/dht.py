"""Real hivemind DHT nodes on 127.0.0.1 for the membership and matchmaking tests, and member records of a run.

`dht_nodes` (module-scoped: three DHT nodes with a signing key each) and `dht_swarm` (a factory of peers on
them) are fixtures: a test module imports both to use them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from farloco.node.daemon.dhtnode import make_dht
from farloco.protocol.membership import NO_SLOT, DHTMembership, MemberRecord, make_record_validators
from farloco.protocol.types import GroupMember

CONFIG: dict[str, str | int | float | bool] = {
    "model": "tiny",
    "inner_steps": 50,
    "outer_lr": 0.7,
    "nesterov": True,
}


def rec(
    peer_id: str, *, heartbeat: float = 100.0, round_id: int = 0, slot: int = NO_SLOT, **changes: Any
) -> MemberRecord:
    base = MemberRecord(
        peer_id=peer_id, address=f"127.0.0.1:{5000 + len(peer_id)}", state="training", round_id=round_id,
        inner_step=3, slot=slot, run_hash="h1", run_config=dict(CONFIG), outer_hash="", loss=2.5,
        heartbeat=heartbeat, maddrs=("/ip4/127.0.0.1/tcp/1",), version="0.1.0",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


@dataclass
class DhtPeer:
    """One DHT node with its own signing key, a DHTMembership and the GroupMember it would be."""

    dht: Any
    membership: DHTMembership
    me: GroupMember

    def record(self, round_id: int, **changes: Any) -> MemberRecord:
        return rec(self.me.peer_id, round_id=round_id, address=self.me.address, **changes)


# One set of DHT nodes per test module, with validators for every run name the tests use; each test takes
# its own run name, so its records live under their own members key (starting a DHT node costs ~1.5 s).
RUN_NAMES = ("mm", "members", "schema", "ttl", "slots", "settled", "beat", "foreign", "hang", "flaky", "lost")


@pytest.fixture(scope="module")
def dht_nodes() -> Iterator[list[tuple[Any, bytes]]]:
    """Three hivemind DHT nodes on 127.0.0.1, each with its own signing key: [(dht, public_key)]."""
    nodes: list[tuple[Any, bytes]] = []
    try:
        for _ in range(3):
            key = RSAPrivateKey()  # one key per peer: hivemind's process-wide key would be shared by all
            validators = [v for run in RUN_NAMES for v in make_record_validators(run, private_key=key)]
            dht = make_dht(
                initial_peers=nodes[0][0].get_visible_maddrs() if nodes else None,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                start=True,
                record_validators=validators,
            )
            nodes.append((dht, validators[0].local_public_key))  # type: ignore[attr-defined]
        yield nodes
    finally:
        for dht, _ in nodes:
            dht.shutdown()


@pytest.fixture
def dht_swarm(dht_nodes: list[tuple[Any, bytes]]) -> Callable[..., list[DhtPeer]]:
    """Factory: `dht_swarm(n, run_name=..., **membership_kwargs)` -> n peers on the module's DHT nodes."""

    def make(n: int, run_name: str = "mm", **kwargs: Any) -> list[DhtPeer]:
        assert run_name in RUN_NAMES, f"add {run_name!r} to RUN_NAMES so the DHT nodes validate it"
        return [
            DhtPeer(
                dht,
                DHTMembership(dht, run_name, "h1", CONFIG, public_key=public_key, **kwargs),
                GroupMember(str(dht.peer_id), f"127.0.0.1:{7000 + i}"),
            )
            for i, (dht, public_key) in enumerate(dht_nodes[:n])
        ]

    return make
