"""Matchmaking's wire: the ready and group records (pushed over the members' links and copied in the DHT under
`round_key`), the link messages that carry them, and reading what the DHT holds of a round. Every record is a
frozen dataclass with one decoder (`from_wire`) built on protocol/messages.py's field checks."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from farloco.protocol.membership import members_key
from farloco.protocol.messages import Fields, WireError, check_hex, check_int, check_str
from farloco.protocol.types import Group, GroupMember

logger = logging.getLogger("farloco.protocol.matchmaking")


class LateForRound(Exception):
    """This peer is not in the group of `round_id` (frozen without it, or no group formed): go to round_id + 1."""

    def __init__(self, round_id: int, peer_id: str, reason: str, *, group_formed: bool) -> None:
        super().__init__(f"peer {peer_id} is late for round {round_id}: {reason}")
        self.round_id = round_id
        self.peer_id = peer_id
        self.reason = reason
        # True: a group of round_id exists without us (its members move on; fetch their state).
        # False: no group formed at all, so nobody's theta changed in round_id.
        self.group_formed = group_formed


class MatchmakingError(Exception):
    """The DHT refused one of our matchmaking records, or did not answer a read in time."""


def round_key(run_name: str, round_id: int) -> str:
    """DHT key of round `round_id`'s ready records (its group lives under this key + '/group')."""
    if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
        raise ValueError(f"round_id must be an int >= 0, got {round_id!r}")
    return f"{members_key(run_name).rsplit('/', 1)[0]}/round/{round_id}"


MAX_WAIT = 86400.0  # the largest straggler wait a ready record may propose (seconds)
MAX_GROUP = 4096  # the most members a group record may list
MAX_UPDATES = (1 << 53) - 1  # outer steps a declared theta may hold (exact in a float)
_EXPECTED = re.compile(r"[1-9][0-9]{0,3}:[0-9a-f]{32}")


def expected_digest(peer_ids: Collection[str]) -> str:
    """What a ready record declares of the members its peer expects in the round (itself included): their
    number and a digest of their sorted ids, `"<n>:<32 hex>"`. Peers whose records declare the same digest,
    and are exactly that set, froze their group in one hop (rules.py, `one_hop_sets`)."""
    if not 1 <= len(peer_ids) <= MAX_GROUP:
        raise ValueError(f"an expected set holds 1 to {MAX_GROUP} peers, got {len(peer_ids)}")
    digest = hashlib.sha256()
    for peer_id in sorted(peer_ids):
        digest.update(peer_id.encode())
        digest.update(b"\0")
    return f"{len(peer_ids)}:{digest.hexdigest()[:32]}"


def _check_expected(value: object, where: str) -> str:
    """An expected-set digest as it travels: "" (none declared) or `"<n>:<32 hex>"` with 1 <= n <= MAX_GROUP."""
    text = check_str(value, where, max_len=40)
    if text and (not _EXPECTED.fullmatch(text) or int(text.split(":")[0]) > MAX_GROUP):
        raise WireError(where, f'"<n>:<32 hex digits>" with 1 <= n <= {MAX_GROUP}', text)
    return text


def _check_name(value: object, where: str) -> str:
    """A peer id or an address as it travels: a non-empty str of at most 256 characters."""
    return check_str(value, where, min_len=1)


def _check_hash(value: object, where: str) -> str:
    """A theta hash as it travels: lowercase hex, at most 128 characters ("" where none is declared)."""
    return check_hex(value, where, max_len=128)


def _check_updates(value: object, where: str) -> int:
    """How many outer steps a declared theta holds: an int >= 0."""
    return check_int(value, where, high=MAX_UPDATES)


def _check_member(value: object, where: str) -> GroupMember:
    """A group record's member entry: [peer_id, address, outer_hash, updates]."""
    if not isinstance(value, list | tuple) or len(value) != 4:
        raise WireError(where, "[peer_id, address, outer_hash, updates]", value)
    return GroupMember(
        _check_name(value[0], f"{where}.peer_id"),
        _check_name(value[1], f"{where}.address"),
        _check_hash(value[2], f"{where}.outer_hash"),
        _check_updates(value[3], f"{where}.updates"),
    )


@dataclass(frozen=True)
class ReadyRecord:
    """'Peer `peer_id`, serving on `address`, finished its local work for `round_id` at `ready_at`, holding the
    theta_outer of hash `outer_hash` with `updates` outer steps applied, expecting the members of digest
    `expected` in the round (`expected_digest`; "" declares none); if its record opens the round, wait `wait`
    seconds for stragglers' (0: the configured match_timeout; see `schedule`). The group record copies each
    member's hash and steps.'"""

    peer_id: str
    address: str
    round_id: int
    ready_at: float
    wait: float = 0.0
    outer_hash: str = ""
    updates: int = 0
    expected: str = ""

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "peer_id": self.peer_id,
            "address": self.address,
            "round_id": self.round_id,
            "ready_at": self.ready_at,
            "wait": self.wait,
            "outer_hash": self.outer_hash,
            "updates": self.updates,
        }
        if self.expected:
            wire["expected"] = self.expected
        return wire

    @classmethod
    def from_wire(cls, data: object) -> ReadyRecord:
        """Decode a ready record (its seven fields, and `expected` when declared); `WireError` (a ValueError)
        naming the bad field."""
        fields = Fields(
            data,
            "ready record",
            ("peer_id", "address", "round_id", "ready_at", "wait", "outer_hash", "updates"),
            optional=("expected",),
        )
        return cls(
            _check_name(fields.raw("peer_id"), fields.at("peer_id")),
            _check_name(fields.raw("address"), fields.at("address")),
            fields.integer("round_id"),
            fields.real("ready_at", finite=True),
            fields.real("wait", low=0.0, high=MAX_WAIT),
            _check_hash(fields.raw("outer_hash"), fields.at("outer_hash")),
            _check_updates(fields.raw("updates"), fields.at("updates")),
            _check_expected(fields.raw("expected", ""), fields.at("expected")),
        )


@dataclass(frozen=True)
class GroupRecord:
    """A frozen group as its `leader` published it at `frozen_at`."""

    leader: str
    group: Group
    frozen_at: float

    def to_wire(self) -> dict[str, Any]:
        return {
            "leader": self.leader,
            "round_id": self.group.round_id,
            "group_id": self.group.group_id,
            "members": [[m.peer_id, m.address, m.outer_hash, m.updates] for m in self.group.members],
            "frozen_at": self.frozen_at,
        }

    @classmethod
    def from_wire(cls, data: object) -> GroupRecord:
        """Decode and check a group record: the group id must match its round and members, the leader be one
        of them (`WireError`, a ValueError, naming what is wrong)."""
        fields = Fields(data, "group record", ("leader", "round_id", "group_id", "members", "frozen_at"))
        members = fields.items("members", _check_member, min_len=1, max_len=MAX_GROUP)
        group = Group.make(fields.integer("round_id"), members)
        if len({m.peer_id for m in group.members}) != len(group.members):
            raise WireError(fields.at("members"), "distinct peer ids", [m.peer_id for m in group.members])
        if fields.raw("group_id") != group.group_id:
            raise WireError(
                fields.at("group_id"),
                f"the group id of its round and members, {group.group_id[:16]}...",
                str(fields.raw("group_id"))[:16],
            )
        leader = _check_name(fields.raw("leader"), fields.at("leader"))
        if leader not in {m.peer_id for m in group.members}:
            raise WireError(fields.at("leader"), "one of its members", leader)
        return cls(leader, group, fields.real("frozen_at", finite=True))


R = TypeVar("R", ReadyRecord, GroupRecord)


@dataclass(frozen=True)
class RecordPush(Generic[R]):
    """A `MatchReady` or `MatchGroup` call: a ready record pushed by its peer (header `r`), or a group record
    pushed or relayed by one of its members (header `g`)."""

    record: R

    def encode(self) -> dict[str, Any]:
        return {_PUSH_KEYS[type(self.record)]: self.record.to_wire()}

    @classmethod
    def decode(cls, header: dict[str, Any], kind: type[R]) -> RecordPush[R]:
        """The `kind` of record the method carries, decoded (`WireError`, a ValueError, if malformed)."""
        return cls(kind.from_wire(header.get(_PUSH_KEYS[kind])))


_PUSH_KEYS: dict[type, str] = {ReadyRecord: "r", GroupRecord: "g"}


@dataclass(frozen=True)
class AtMessage:
    """A `MatchAt` call: the sender starts its local work for the token's round from the theta of hash
    `outer_hash` (header `h`, left out when "")."""

    outer_hash: str = ""

    def encode(self) -> dict[str, Any]:
        return {"h": self.outer_hash} if self.outer_hash else {}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> AtMessage:
        return cls(_check_hash(header.get("h", ""), "announcement.h"))


READY_METHOD = "MatchReady"
GROUP_METHOD = "MatchGroup"
AT_METHOD = "MatchAt"


def dht_entries(result: Any) -> dict[bytes, Any]:
    """{sub-key: raw value} of a hivemind get() result on a dictionary key (empty when nothing is stored)."""
    value = getattr(result, "value", None) if result is not None else None
    if not isinstance(value, dict):
        return {}
    return {
        subkey: getattr(item, "value", None) for subkey, item in value.items() if isinstance(subkey, bytes)
    }


def parse_ready(raw: Mapping[bytes, Any], round_id: int) -> tuple[dict[str, ReadyRecord], dict[str, bytes]]:
    """Ready records of `round_id` by peer id, and each peer id's owner key.

    A peer id claimed under two different owner keys is dropped: we cannot tell which one is real.
    """
    ready: dict[str, ReadyRecord] = {}
    owners: dict[str, bytes] = {}
    disputed: set[str] = set()
    for owner, value in raw.items():
        try:
            record = ReadyRecord.from_wire(value)
        except ValueError as error:
            logger.warning("ignoring a malformed ready record for round %d: %s", round_id, error)
            continue
        if record.round_id != round_id:
            logger.warning("ignoring a ready record of round %d under round %d", record.round_id, round_id)
            continue
        if record.peer_id in owners and owners[record.peer_id] != owner:
            disputed.add(record.peer_id)
        ready[record.peer_id], owners[record.peer_id] = record, owner
    for peer_id in disputed:
        logger.warning("ignoring peer %s in round %d: two owner keys claim it", peer_id, round_id)
        del ready[peer_id], owners[peer_id]
    return ready, owners


def parse_groups(raw: Mapping[bytes, Any], round_id: int, owners: Mapping[str, bytes]) -> list[GroupRecord]:
    """Group records of `round_id` stored by one of the group's members, under the key that owns that member's
    ready record (the leader's copy, or the copy a member keeps once it learned the group from someone else)."""
    writers = {owner: peer_id for peer_id, owner in owners.items()}
    groups = []
    for owner, value in raw.items():
        try:
            record = GroupRecord.from_wire(value)
        except ValueError as error:
            logger.warning("ignoring a malformed group record for round %d: %s", round_id, error)
            continue
        if record.group.round_id != round_id or writers.get(owner) not in {
            m.peer_id for m in record.group.members
        }:
            # Unknown writer (its ready record not seen yet, or not a member): look again next poll.
            continue
        groups.append(record)
    return groups
