"""Plain value types shared across farloco.protocol: who is in a round's group, which tensor dtypes travel."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# Tensor dtypes by wire name: only plain numeric types travel or are stored (no object/complex/quantised ones).
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


# The address of a node that accepts no inbound connection (behind NAT, `network.reachability = "private"`): it
# dials every other node itself and is never dialled. Calls to it fail at once (RpcClient), the exchange gives it
# no part to own and takes its vote from its own call (protocol/exchange), it never leads a round's matchmaking
# and never serves state.
NO_INBOUND = "no-inbound"


@dataclass(frozen=True, order=True)
class GroupMember:
    """One peer of a round's group: its hivemind peer id, the gRPC address it serves on, the hash of the
    theta_outer it declared itself ready with (its ready record's; "" where no hash is known) and how many outer
    steps that theta holds (`updates`: the strategy's applied rounds, carried by checkpoints and state sync; a
    member that closed a round without an update holds one fewer). Every member reads the same claims from the
    group record, so the hash check's healing rule decides the same on every member."""

    peer_id: str
    address: str
    outer_hash: str = ""
    updates: int = 0

    @property
    def dialable(self) -> bool:
        """Whether other nodes can open connections to this member (not behind NAT)."""
        return self.address != NO_INBOUND


@dataclass(frozen=True)
class Group:
    """The agreed group of one outer round. Every member of the round sees the same tuple (sorted by peer id)."""

    round_id: int
    group_id: str
    members: tuple[GroupMember, ...]

    @staticmethod
    def make(round_id: int, members: list[GroupMember] | tuple[GroupMember, ...]) -> Group:
        """Build a group with its members sorted and its id derived from the round, the member ids and the
        hashes they declared (two records of the same members with other hashes are two groups)."""
        ordered = tuple(sorted(members, key=lambda m: m.peer_id))
        return Group(
            round_id,
            group_id_of(
                round_id,
                [m.peer_id for m in ordered],
                [m.outer_hash for m in ordered],
                [m.updates for m in ordered],
            ),
            ordered,
        )

    def hashes(self) -> dict[str, str]:
        """Member peer id -> the theta hash it declared for this round (members that declared one)."""
        return {m.peer_id: m.outer_hash for m in self.members if m.outer_hash}

    def updates(self) -> dict[str, int]:
        """Member peer id -> the outer steps its declared theta holds (members that declared a hash)."""
        return {m.peer_id: m.updates for m in self.members if m.outer_hash}

    def index_of(self, peer_id: str) -> int:
        """Position of `peer_id` in the group; ValueError naming the members if it is not one."""
        for index, member in enumerate(self.members):
            if member.peer_id == peer_id:
                return index
        raise ValueError(
            f"peer {peer_id} is not in group {self.group_id[:12]} of round {self.round_id}: "
            f"members are {[m.peer_id for m in self.members]}"
        )


def group_id_of(
    round_id: int, peer_ids: list[str], hashes: list[str] | None = None, updates: list[int] | None = None
) -> str:
    """sha256 over the round id, the sorted member ids and each member's declared theta hash and outer steps
    (where it declared a hash): equal on every peer that agrees on the group."""
    digest = hashlib.sha256(f"round={round_id}".encode())
    declared = dict(zip(peer_ids, hashes, strict=True)) if hashes is not None else {}
    steps = dict(zip(peer_ids, updates, strict=True)) if updates is not None else {}
    for peer_id in sorted(peer_ids):
        digest.update(b"\0" + peer_id.encode())
        if declared.get(peer_id):
            digest.update(b"#" + declared[peer_id].encode() + b"@" + str(steps.get(peer_id, 0)).encode())
    return digest.hexdigest()
