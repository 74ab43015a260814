"""Membership of a farloco run on the hivemind DHT: member records, their TTL, state queries and data slots.

Records live under the DHT key `farloco/{run_name}/members`, one sub-key per member. The sub-key is the
member's RSA public key as hivemind's `RSASignatureValidator` formats it, so every record is signed and only
its owner can overwrite it; `MembersValidator` refuses an entry that `parse_entry` (the records' one decoder)
refuses, at `store()` and on every read from a remote peer.

Two layers:
- `Membership` is the sans-IO core: a table of records keyed by owner, queried with an explicit `now`
  (TTL expiry, run-hash filtering, state/round queries, slot choice). Tests drive it with plain numbers.
- `DHTMembership` is the async IO side: it publishes our record (plus a heartbeat task), reads the table
  back with `DHT.get(..., latest=True)` and graceful leave. Every hivemind call goes through
  `farloco.protocol.dhtcall` (bounded, cancellable, never touching our event loop from hivemind's thread). A
  store we need (a record, a slot claim, a tombstone) is retried with back-off for `retry_seconds` of real time
  and re-stamped on each try, so a retry never carries an expired entry; only a refusal that outlasts that
  deadline raises `MembershipError`, naming the key, the attempts and what to check. A heartbeat is tried once
  (the next beat is its retry). Times in records (heartbeats, TTLs) come from the injected `Clock`; waits that
  are about the DHT's own speed (back-off, claim settling) are real time.

Binding signers to members. The signature validator only proves *which key* wrote a sub-key; anyone can run a
DHT node with a key of their own. So a record of our run must carry `proof`, an HMAC of the run secret over
(run, peer id, the sub-key it is stored under) (`farloco.protocol.auth.Authenticator.member_proof`). With an
`auth` given, records of our run_hash and tombstones whose proof does not verify are ignored, logged once and
counted in `Membership.ignored` by reason; `Membership.owners()` names the keys that own a live, proven member
record, and every other DHT record the agent reads (ready and group records, see matchmaking) is accepted only
from those keys. Records of another run_hash are kept unproven (our secret cannot check them): they only feed
the run-mismatch diagnostics, never the member list.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hashlib
import logging
import math
import re
import struct
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from farloco.protocol import dhtcall
from farloco.protocol.messages import Fields, WireError, check_str
from farloco.util.clock import Clock, DHTClock
from farloco.util.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

ConfigValue = str | int | float | bool
MEMBER_STATES: tuple[str, ...] = ("starting", "syncing", "training", "exchanging", "isolated", "leaving")
NO_SLOT = -1  # slot of a member that has not claimed one yet
_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# Caps keep one member record small: the DHT carries it on every heartbeat of every member.
MAX_CONFIG_KEYS = 256
MAX_MADDRS = 16
MAX_PEER_ID = 128  # characters of a peer id (other text fields: at most 256)
# Distinct (reason, owner, where) triples remembered so a record re-read every poll is logged and counted once.
MAX_IGNORED_REMEMBERED = 4096

# How long a store we need (a record, a tombstone) is retried with back-off by default (the agent passes
# timeouts.dht_retry). A heartbeat is tried once: the next beat is its retry.
DEFAULT_RETRY_SECONDS = 60.0
STORE_HINT = (
    "check that network.initial_peers are reachable from this host, that the other members can reach this "
    "node's DHT port (network.dht_port, network.announce_host), that this host's clock agrees with theirs "
    "(hivemind refuses an entry whose expiration has passed), and that the DHT process is not starved of CPU"
)


class MembershipError(Exception):
    """A membership operation failed: the DHT refused a store, or the caller used the API out of order."""


class SlotsExhaustedError(MembershipError):
    """Every data slot is held by another live member."""


class RunMismatchError(Exception):
    """A peer runs another [run] configuration (another run_hash); the message names every differing key."""

    def __init__(self, peer_id: str, expected_hash: str, got_hash: str, differences: list[str]) -> None:
        self.peer_id = peer_id
        self.expected_hash = expected_hash
        self.got_hash = got_hash
        self.differences = differences
        detail = (
            "; ".join(differences) if differences else "no [run] key differs (hash computed differently?)"
        )
        super().__init__(
            f"peer {peer_id} runs run_hash={got_hash[:16]}, expected run_hash={expected_hash[:16]}: {detail}"
        )


def members_key(run_name: str) -> str:
    """DHT key holding the member records of `run_name` (checked: 1-64 chars of [A-Za-z0-9._-])."""
    if not isinstance(run_name, str) or not _RUN_NAME_RE.match(run_name):
        raise ValueError(f"run_name must be 1-64 characters of [A-Za-z0-9._-], got {run_name!r}")
    return f"farloco/{run_name}/members"


# --------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class MemberRecord:
    """What one member tells the swarm about itself; refreshed every heartbeat.

    `round_id` is the outer round the member is working on (training towards, or exchanging in);
    `outer_hash` is the hex digest of the theta_outer it holds, i.e. the result of round `round_id - 1`
    ("" while unknown). `heartbeat` is DHT time of publication; the record is live until heartbeat + ttl.
    """

    peer_id: str
    address: str
    state: str
    round_id: int
    inner_step: int
    slot: int
    run_hash: str
    run_config: Mapping[str, ConfigValue]
    outer_hash: str
    loss: float
    heartbeat: float
    maddrs: tuple[str, ...]
    version: str
    # HMAC binding peer_id to the key that signs this record (set by DHTMembership.publish; "" without auth).
    proof: str = ""
    # The member's training tokens/s in its last round's inner steps (the swarm view; 0 while unknown). Optional
    # on the wire: a record without it (an older node's) reads as 0.
    tokens_per_second: float = 0.0

    def __post_init__(self) -> None:
        """A record built in code meets the decoder's checks too (`WireError`, a ValueError, if not)."""
        if not isinstance(self.maddrs, tuple):
            raise WireError("member record.maddrs", f"a tuple of at most {MAX_MADDRS} str", self.maddrs)
        if not isinstance(self.run_config, Mapping):
            raise WireError(
                "member record.run_config", f"a map of at most {MAX_CONFIG_KEYS} keys", self.run_config
            )
        _member_fields(Fields(self.to_wire(), "member record", _MEMBER_KEYS, optional=_MEMBER_OPTIONAL))

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able dict stored on the DHT (the fields in their declared order)."""
        wire = {name: getattr(self, name) for name in (*_MEMBER_KEYS, *_MEMBER_OPTIONAL)}
        wire["run_config"] = dict(self.run_config)
        wire["maddrs"] = list(self.maddrs)
        return wire

    @classmethod
    def from_wire(cls, data: object) -> MemberRecord:
        """Decode a DHT value (exactly the record's fields); `WireError` (a ValueError) naming the bad field."""
        return cls(**_member_fields(Fields(data, "member record", _MEMBER_KEYS, optional=_MEMBER_OPTIONAL)))


_MEMBER_OPTIONAL = ("tokens_per_second",)
_MEMBER_KEYS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(MemberRecord) if f.name not in _MEMBER_OPTIONAL
)


def _member_fields(fields: Fields) -> dict[str, Any]:
    """A member record's fields, each checked (strict types, the size caps above)."""
    return {
        "peer_id": fields.text("peer_id", min_len=1, max_len=MAX_PEER_ID),
        "address": fields.text("address"),
        "state": fields.choice("state", MEMBER_STATES),
        "round_id": fields.integer("round_id"),
        "inner_step": fields.integer("inner_step"),
        "slot": fields.integer("slot", low=NO_SLOT),
        "run_hash": fields.text("run_hash"),
        "run_config": fields.scalars("run_config", max_keys=MAX_CONFIG_KEYS),
        "outer_hash": fields.text("outer_hash"),
        "loss": fields.real("loss"),
        "heartbeat": fields.real("heartbeat", finite=True),
        "maddrs": tuple(fields.items("maddrs", check_str, max_len=MAX_MADDRS)),
        "version": fields.text("version"),
        "proof": fields.text("proof"),
        "tokens_per_second": (
            fields.real("tokens_per_second", finite=True, low=0.0) if fields.has("tokens_per_second") else 0.0
        ),
    }


@dataclass(frozen=True)
class Departure:
    """A tombstone: the member with this peer id left gracefully at `heartbeat` (DHT time).

    On the wire: `{peer_id, heartbeat, left: True, proof}`."""

    peer_id: str
    heartbeat: float
    proof: str = ""  # as MemberRecord.proof: a tombstone hides a member only if its writer speaks for it

    def to_wire(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "heartbeat": self.heartbeat, "left": True, "proof": self.proof}

    @classmethod
    def from_wire(cls, data: object) -> Departure:
        """Decode a tombstone; `WireError` (a ValueError) naming the bad field."""
        fields = Fields(data, "departure", ("peer_id", "heartbeat", "left", "proof"))
        if fields.raw("left") is not True:
            raise WireError(fields.at("left"), "True", fields.raw("left"))
        return cls(
            fields.text("peer_id", min_len=1, max_len=MAX_PEER_ID),
            fields.real("heartbeat"),
            fields.text("proof"),
        )


def parse_entry(data: object) -> MemberRecord | Departure:
    """A member sub-key's value: a live record or a departure tombstone (a map with `left`); ValueError if
    neither. This is the one check of the members key: `MembersValidator` stores and serves exactly what it
    accepts."""
    if isinstance(data, dict) and "left" in data:
        return Departure.from_wire(data)
    return MemberRecord.from_wire(data)


# --------------------------------------------------------------------------------------------- DHT validator

# The sub-key of a member entry: bytes holding the owner's public key, as RSASignatureValidator formats it.
_OWNER_SUBKEY = re.compile(b".*" + RSASignatureValidator.PUBLIC_KEY_REGEX + b".*")


class MembersValidator(RecordValidatorBase):  # type: ignore[misc]  # hivemind ships no type hints
    """Refuses, at every store and every read from a remote peer, a members-key entry that `parse_entry` refuses
    or whose sub-key holds no public key; entries of other keys pass (they are other validators' business).

    It runs after `RSASignatureValidator` (priority 0, below the signature validator's, so it sees the value
    with the signature stripped) and merges with the validators of other runs on the same DHT.
    """

    def __init__(self, run_name: str) -> None:
        self._keys = {DHTID.generate(source=members_key(run_name)).to_bytes(): members_key(run_name)}
        self.memo = VerdictMemo()

    def validate(self, record: DHTRecord) -> bool:
        key = self._keys.get(record.key)
        if key is None:
            return True
        return self.memo.judge(record, lambda entry: self._judge(entry, key))

    def _judge(self, record: DHTRecord, key: str) -> bool:
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            logger.debug("refusing an entry under %s: not under a member's sub-key", key)
            return False
        try:
            owner = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
        except Exception as error:  # msgpack raises several unrelated types on bad input
            logger.debug("refusing an entry under %s: not msgpack (%s)", key, error)
            return False
        if not isinstance(owner, bytes) or _OWNER_SUBKEY.match(owner) is None:
            logger.debug("refusing an entry under %s: its sub-key holds no public key", key)
            return False
        try:
            parse_entry(value)
        except ValueError as error:
            logger.debug("refusing an entry under %s: %s", key, error)
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, MembersValidator):
            return False
        self._keys.update(other._keys)
        return True


class VerdictMemo:
    """The verdicts of the last `size` distinct records a validator judged, keyed by a digest of the record's
    bytes: the same bytes always get the same verdict, so each is worked out once.

    A read of the member table walks several DHT nodes and every one answers with the whole table, so hivemind
    validates each record once per node that holds a copy (up to its beam of 20), and again at the next read if
    it did not change: at 16 peers on 2 cores, RSA signature checks and record decoding of those copies took half
    of a peer's DHT CPU (`benchmarks/protocol_scale.py`). Bounded (least recently used first out), so a flood of
    distinct records costs memory of `size` digests at most."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._verdicts: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self.hits = 0

    def judge(self, record: DHTRecord, decide: Callable[[DHTRecord], bool]) -> bool:
        digest = hashlib.blake2b(digest_size=20)
        for part in (record.key, record.subkey, record.value, struct.pack("<d", record.expiration_time)):
            digest.update(len(part).to_bytes(4, "little"))
            digest.update(part)
        key = digest.digest()
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self.hits += 1
            self._verdicts.move_to_end(key)
            return verdict
        verdict = bool(decide(record))
        self._verdicts[key] = verdict
        if len(self._verdicts) > self.size:
            self._verdicts.popitem(last=False)
        return verdict


class MemoSignatureValidator(RSASignatureValidator):  # type: ignore[misc]  # hivemind ships no type hints
    """hivemind's `RSASignatureValidator`, each distinct record's signature checked once (`VerdictMemo`)."""

    def __init__(self, private_key: RSAPrivateKey | None = None) -> None:
        super().__init__(private_key)
        self.memo = VerdictMemo()

    def validate(self, record: DHTRecord) -> bool:
        return self.memo.judge(record, super().validate)


def make_record_validators(
    run_name: str, *, private_key: RSAPrivateKey | None = None
) -> list[RecordValidatorBase]:
    """Validators the agent passes to `hivemind.DHT(record_validators=...)` for this run.

    The signature validator signs records whose sub-key holds our public key (and refuses unsigned or
    forged ones); `MembersValidator` checks the members key. Both judge each distinct record once
    (`VerdictMemo`). `private_key` defaults to hivemind's process-wide key; tests running several DHTs in one
    process pass one key per peer.
    """
    return [MemoSignatureValidator(private_key), MembersValidator(run_name)]


def bootstrap_record_validators(run_names: Sequence[str] = ()) -> list[RecordValidatorBase]:
    """Validators for a DHT node that is no member (`farloco bootstrap`), which is a replica of the records whose
    keys lie near its own id like any other node: it refuses what a member's DHT node refuses. The signature check
    needs no run (an entry under a sub-key holding a public key must be signed by that key's owner); the members
    key's schema needs the run's name, one `MembersValidator` per run that uses this bootstrap."""
    return [MemoSignatureValidator(), *(MembersValidator(name) for name in run_names)]


# --------------------------------------------------------------------------------------------- sans-IO core


def config_differences(expected: Mapping[str, ConfigValue], got: Mapping[str, ConfigValue]) -> list[str]:
    """Keys whose values differ between two flat [run] configs, as `key: expected=... got=...` lines."""
    lines = []
    for key in sorted(set(expected) | set(got)):
        mine, theirs = expected.get(key, "<absent>"), got.get(key, "<absent>")
        # type matters: 1 and 1.0 and True hash differently in the run config
        if type(mine) is not type(theirs) or mine != theirs:
            lines.append(f"{key}: expected={mine!r} got={theirs!r}")
    return lines


class MemberAuth(Protocol):
    """What binds a peer id to its DHT signing key (`farloco.protocol.auth.Authenticator` is one)."""

    def member_proof(self, peer_id: str, owner: bytes) -> str: ...

    def check_member_proof(self, peer_id: str, owner: bytes, proof: str) -> bool: ...


@dataclass
class Membership:
    """Sans-IO table of member records keyed by owner (the DHT sub-key); every query takes `now`.

    With `auth`, entries of our run whose proof does not bind their peer id to their owner are ignored and
    counted in `ignored` (module docstring); without it (tests of the table alone) every entry is believed.

    Slot rule (documented for the agent): a member claims the lowest slot in [0, num_slots) not held by any
    other live member. Two members that claimed the same slot at the same time both see the collision on
    their next read; the lower peer id keeps the slot and the other one claims again. A newcomer never takes
    a slot it can see held, so an established member is never pushed off its slot.
    """

    run_hash: str
    run_config: Mapping[str, ConfigValue]
    ttl: float = 15.0
    auth: MemberAuth | None = None
    ignored: Counter[str] = field(default_factory=Counter, init=False)
    _entries: dict[bytes, MemberRecord | Departure] = field(default_factory=dict, init=False, repr=False)
    _ignored_seen: set[tuple[str, bytes, str]] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {self.ttl}")

    def ignore(self, reason: str, owner: bytes, where: str, detail: str) -> None:
        """Count and log a DHT record we refuse to believe, once per (reason, owner, where)."""
        seen = (reason, owner, where)
        if seen in self._ignored_seen:
            return
        if len(self._ignored_seen) >= MAX_IGNORED_REMEMBERED:
            self._ignored_seen.clear()  # a flood of fake keys: recount rather than grow without bound
        self._ignored_seen.add(seen)
        self.ignored[reason] += 1
        logger.warning(
            "ignoring a DHT record under %s signed by %s: reason=%s %s",
            where,
            _short_key(owner),
            reason,
            detail,
        )

    def observe(self, owner: bytes, entry: MemberRecord | Departure) -> None:
        """Merge one entry; an older heartbeat never replaces a newer one (reads can lag our own writes).

        With `auth`, a tombstone or a record of our run_hash whose proof does not bind its peer id to `owner`
        is ignored (reason BAD_MEMBER_PROOF).
        """
        proven = isinstance(entry, Departure) or entry.run_hash == self.run_hash
        if (
            self.auth is not None
            and proven
            and not self.auth.check_member_proof(entry.peer_id, owner, entry.proof)
        ):
            kind = "tombstone" if isinstance(entry, Departure) else "member record"
            self.ignore(
                "BAD_MEMBER_PROOF",
                owner,
                "members",
                f"{kind} claiming peer {entry.peer_id[:64]!r} carries no valid proof of the run secret",
            )
            return
        current = self._entries.get(owner)
        if current is None or entry.heartbeat >= current.heartbeat:
            self._entries[owner] = entry

    def observe_all(self, entries: Mapping[bytes, MemberRecord | Departure]) -> None:
        for owner, entry in entries.items():
            self.observe(owner, entry)

    def prune(self, now: float) -> None:
        """Forget entries whose TTL has passed (they can no longer affect any query)."""
        self._entries = {o: e for o, e in self._entries.items() if e.heartbeat + self.ttl > now}

    def _present(self, now: float) -> list[MemberRecord]:
        # A departure hides every record of that peer id with an older heartbeat, whichever key published it.
        departed: dict[str, float] = {}
        for entry in self._entries.values():
            if isinstance(entry, Departure):
                departed[entry.peer_id] = max(departed.get(entry.peer_id, -math.inf), entry.heartbeat)
        freshest: dict[str, MemberRecord] = {}
        for entry in self._entries.values():
            if not isinstance(entry, MemberRecord) or entry.heartbeat + self.ttl <= now:
                continue
            if entry.heartbeat <= departed.get(entry.peer_id, -math.inf):
                continue
            known = freshest.get(entry.peer_id)
            if known is None or entry.heartbeat > known.heartbeat:
                freshest[entry.peer_id] = entry
        return sorted(freshest.values(), key=lambda record: record.peer_id)

    def owners(self, now: float) -> dict[bytes, str]:
        """Signing key -> peer id, for every key whose live record of our run is a current member.

        The keys other DHT records of the run (ready, group) must be signed by, each speaking for its peer id.
        """
        live = {(record.peer_id, record.heartbeat) for record in self.live(now)}
        return {
            owner: entry.peer_id
            for owner, entry in self._entries.items()
            if isinstance(entry, MemberRecord) and (entry.peer_id, entry.heartbeat) in live
        }

    def departed(self, now: float) -> set[str]:
        """Peer ids whose departure tombstone we hold (tombstones live `ttl` past their time, like records)."""
        return {
            e.peer_id
            for e in self._entries.values()
            if isinstance(e, Departure) and e.heartbeat + self.ttl > now
        }

    def live(self, now: float) -> list[MemberRecord]:
        """Live members of our run (same run_hash), sorted by peer id; includes members in state 'leaving'."""
        return [record for record in self._present(now) if record.run_hash == self.run_hash]

    def mismatched(self, now: float) -> list[tuple[MemberRecord, list[str]]]:
        """Live records of another run_hash, each with the [run] keys that differ from ours."""
        return [
            (
                record,
                [line.split(":", 1)[0] for line in config_differences(self.run_config, record.run_config)],
            )
            for record in self._present(now)
            if record.run_hash != self.run_hash
        ]

    def check_compatible(self, record: MemberRecord) -> None:
        """RunMismatchError naming every differing [run] key, with both values, if `record` is another run."""
        if record.run_hash != self.run_hash:
            raise RunMismatchError(
                record.peer_id,
                self.run_hash,
                record.run_hash,
                config_differences(self.run_config, record.run_config),
            )

    def get(self, peer_id: str, now: float) -> MemberRecord | None:
        """The live record of `peer_id` in our run, if any."""
        return next((record for record in self.live(now) if record.peer_id == peer_id), None)

    def in_state(self, state: str, now: float) -> list[MemberRecord]:
        if state not in MEMBER_STATES:
            raise ValueError(f"state must be one of {MEMBER_STATES}, got {state!r}")
        return [record for record in self.live(now) if record.state == state]

    def in_round(self, round_id: int, now: float) -> list[MemberRecord]:
        """Live members whose record says `round_id` and that are not leaving: who a round waits for."""
        return [
            record for record in self.live(now) if record.round_id == round_id and record.state != "leaving"
        ]

    def free_slot(self, peer_id: str, num_slots: int, now: float) -> int:
        """Lowest slot in [0, num_slots) not held by another live member (SlotsExhaustedError if none)."""
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        held = {record.slot: record.peer_id for record in self.live(now) if record.peer_id != peer_id}
        for slot in range(num_slots):
            if slot not in held:
                return slot
        raise SlotsExhaustedError(
            f"all {num_slots} data slots are held by other live members "
            f"({', '.join(f'{slot}={held[slot][:12]}' for slot in sorted(held) if slot >= 0)}); "
            f"raise num_slots or wait for a member to leave"
        )

    def slot_conflict(self, peer_id: str, slot: int, now: float) -> MemberRecord | None:
        """A live member with a lower peer id holding `slot` (so `peer_id` must claim again), or None."""
        return next(
            (r for r in self.live(now) if r.slot == slot and r.peer_id != peer_id and r.peer_id < peer_id),
            None,
        )


def _short_key(owner: bytes) -> str:
    """A signing key as a short, log-friendly fingerprint."""
    return hashlib.sha256(owner).hexdigest()[:16]


# --------------------------------------------------------------------------------------------- IO side


def _unwrap_entries(result: Any, where: str) -> dict[bytes, MemberRecord | Departure]:
    """Turn a hivemind get() result (ValueWithExpiration of {subkey: ValueWithExpiration}) into entries.

    Entries that do not parse are skipped with a log line: one bad peer must not hide the others.
    """
    entries: dict[bytes, MemberRecord | Departure] = {}
    if result is None:
        return entries
    value = getattr(result, "value", None)
    if not isinstance(value, dict):
        logger.warning("ignoring %s: expected a dictionary of sub-keys, got %s", where, type(value).__name__)
        return entries
    for subkey, item in value.items():
        try:
            if not isinstance(subkey, bytes):
                raise ValueError(
                    f"sub-key must be the owner's public key (bytes), got {type(subkey).__name__}"
                )
            entries[subkey] = parse_entry(getattr(item, "value", None))
        except ValueError as error:
            logger.warning("ignoring a malformed entry under %s: %s", where, error)
    return entries


def table_read_interval(heartbeat_interval: float, ttl: float) -> float:
    """How often a member's heartbeat reads the whole member table: a quarter of the member ttl, never more
    often than it stores its record. A read costs every member's record (it grows with the swarm); a store
    costs one. A live member's record, stored every heartbeat, is at most one read interval plus one heartbeat
    old when we read it, so it never expires in our view between two reads while `ttl/4 + heartbeat < ttl`
    (the constructor's check `heartbeat < ttl` leaves room). The round's own reads (the matchmaker's, when a
    record it does not know appears) are not paced."""
    return max(heartbeat_interval, ttl / 4)


class HeartbeatPacer:
    """Whether this beat reads the member table (`table_read_interval`), on a monotonic clock."""

    def __init__(self, heartbeat_interval: float, ttl: float, *, read_interval: float | None = None) -> None:
        self.read_interval = (
            table_read_interval(heartbeat_interval, ttl) if read_interval is None else read_interval
        )
        if not 0 <= self.read_interval < ttl:
            raise ValueError(f"read_interval must be in [0, ttl={ttl}), got {self.read_interval}")
        self._last = -math.inf

    def read_due(self, now: float) -> bool:
        """True (and counted as read) when at least `read_interval` has passed since the last read; a small
        slack (a tenth of a beat's jitter) keeps a read from slipping a whole beat late."""
        if now - self._last < self.read_interval * 0.95:
            return False
        self._last = now
        return True


class DHTMembership:
    """Our membership in a run, on a running `hivemind.DHT` (the agent owns the DHT and its validators)."""

    REMOVE_MARGIN: ClassVar[float] = 1e-3  # a tombstone must expire strictly after our last record

    def __init__(
        self,
        dht: Any,
        run_name: str,
        run_hash: str,
        run_config: Mapping[str, ConfigValue],
        *,
        ttl: float = 15.0,
        heartbeat_interval: float = 2.0,
        clock: Clock | None = None,
        public_key: bytes | None = None,
        claim_settle: float = 0.5,
        auth: MemberAuth | None = None,
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
        replan_every: float = 0.0,
        read_near: bool = True,
    ) -> None:
        if not 0 < heartbeat_interval < ttl:
            raise ValueError(
                f"heartbeat_interval must be in (0, ttl={ttl}) so a live member never expires, got {heartbeat_interval}"
            )
        self.dht = dht
        self.key = members_key(run_name)
        self.core = Membership(run_hash, dict(run_config), ttl, auth)
        self.auth = auth
        self.heartbeat_interval = heartbeat_interval
        self.claim_settle = claim_settle
        if not retry_seconds >= 0:
            raise ValueError(f"retry_seconds must be >= 0, got {retry_seconds}")
        self.retry_seconds = retry_seconds
        # > 0: our record goes straight to the members key's replicas, found again by a full store every this
        # many seconds (`dhtcall.store_near`); 0: every store walks the DHT (hivemind's store).
        if not replan_every >= 0:
            raise ValueError(f"replan_every must be >= 0, got {replan_every}")
        self.replan_every = replan_every
        # With stores near the key: read the table from a few of its replicas (`dhtcall.get_near`) instead of a walk.
        self.read_near = read_near and replan_every > 0
        self.clock: Clock = clock if clock is not None else DHTClock()
        # Sub-key = our public key: the signature validator signs what we store under it.
        self.public_key = public_key if public_key is not None else RSASignatureValidator().local_public_key
        self._record: MemberRecord | None = None
        self._last_expiration = -math.inf  # the latest expiration of any entry we sent (it may have landed)
        self._heartbeat_task: asyncio.Task[None] | None = None
        # "stores" (our record, each attempt) and "reads" (whole-table reads): what the benchmarks weigh per peer.
        self.counters: Counter[str] = Counter()

    @property
    def record(self) -> MemberRecord | None:
        """The record we last published (None before the first publish or after remove)."""
        return self._record

    async def _store(
        self,
        make: Callable[[], tuple[dict[str, Any], float]],
        what: str,
        retry_seconds: float,
        *,
        near: bool = False,
    ) -> None:
        """Store `make()`'s (value, expiration) under our sub-key, retried with back-off for `retry_seconds`
        (real time); `make` is called afresh for each attempt, so a retry never sends an expired entry.
        MembershipError, naming the key, the attempts and what to check, once the deadline has passed."""

        async def attempt(timeout: float) -> bool:
            value, expiration = make()
            # Counted before the answer: a store whose answer we never get (timed out, or cancelled by a leave)
            # may still land, and the DHT keeps only a strictly later entry after it. With what succeeded only,
            # a tombstone stamped in the same instant as a heartbeat whose answer was lost had its exact
            # expiration and was refused for the whole retry window (seen under a CPU hog).
            self._last_expiration = max(self._last_expiration, expiration)
            self.counters["stores"] += 1
            if near:
                store = functools.partial(
                    dhtcall.store_near,
                    key=self.key,
                    value=value,
                    expiration=expiration,
                    subkey=self.public_key,
                    replan_every=self.replan_every,
                )
                return bool(await dhtcall.run_in_dht(self.dht, store, timeout=timeout))
            ok = bool(
                await dhtcall.call(
                    self.dht.store, self.key, value, expiration, subkey=self.public_key, timeout=timeout
                )
            )
            return ok

        try:
            await dhtcall.retry(
                attempt, deadline=time.monotonic() + retry_seconds, key=self.key, what=what, hint=STORE_HINT
            )
        except dhtcall.DHTRefusedError as exc:
            raise MembershipError(str(exc)) from exc

    def _stamp(self, record: MemberRecord) -> MemberRecord:
        """`record` with heartbeat = now (strictly after anything we stored before) and our proof."""
        now = self.clock.now()
        # Heartbeats must be strictly increasing: the DHT keeps the entry with the latest expiration.
        heartbeat = max(now, self._last_expiration - self.core.ttl + self.REMOVE_MARGIN)
        proof = self.auth.member_proof(record.peer_id, self.public_key) if self.auth else record.proof
        return dataclasses.replace(record, heartbeat=float(heartbeat), proof=proof)

    async def publish(self, record: MemberRecord, *, retry_seconds: float | None = None) -> MemberRecord:
        """Store `record` (heartbeat set to now) under our sub-key; returns what was stored.

        A refused store is retried, re-stamped, for `retry_seconds` (default: the membership's
        `retry_seconds`; 0: one attempt, as a heartbeat does); MembershipError after that.
        """
        if record.run_hash != self.core.run_hash:
            raise ValueError(
                f"publish() got a record of run_hash={record.run_hash[:16]}, this membership is for "
                f"run_hash={self.core.run_hash[:16]}"
            )
        stamped = record

        def make() -> tuple[dict[str, Any], float]:
            nonlocal stamped
            stamped = self._stamp(record)
            return stamped.to_wire(), stamped.heartbeat + self.core.ttl

        seconds = self.retry_seconds if retry_seconds is None else retry_seconds
        await self._store(make, "our member record", seconds, near=self.replan_every > 0)
        self._record = stamped
        self.core.observe(self.public_key, stamped)
        return stamped

    async def refresh(self) -> None:
        """Read the whole members dictionary: from a few of the key's replicas (`dhtcall.get_near`, when our
        stores go near the key too), else with a full walk (latest=True merges the sub-keys of every replica)."""
        self.counters["reads"] += 1
        try:
            if self.read_near:
                read = functools.partial(dhtcall.get_near, key=self.key, replan_every=self.replan_every)
                result = await dhtcall.run_in_dht(self.dht, read)
            else:
                result = await dhtcall.call(self.dht.get, self.key, latest=True, beam_size=dhtcall.READ_BEAM)
        except TimeoutError:
            # Reads are advisory: keep the last view (pruned below) and read again next time.
            logger.warning(
                "DHT get of %s did not answer within %.0f s; keeping the last view",
                self.key,
                dhtcall.DHT_CALL_TIMEOUT,
            )
        else:
            self.core.observe_all(_unwrap_entries(result, self.key))
        self.core.prune(self.clock.now())

    async def members(self) -> list[MemberRecord]:
        """Live members of our run (same run_hash, decoded by `parse_entry`), sorted by peer id."""
        await self.refresh()
        return self.core.live(self.clock.now())

    def departed(self) -> set[str]:
        """From the last read: peer ids that left with a tombstone."""
        return self.core.departed(self.clock.now())

    def mismatched(self) -> list[tuple[MemberRecord, list[str]]]:
        """From the last read: live records of another run_hash with the [run] keys that differ."""
        return self.core.mismatched(self.clock.now())

    async def claim_slot(self, peer_id: str, num_slots: int, *, patience: int = 4) -> int:
        """Claim a data slot (rule in `Membership`), publish it, and return it once no lower peer id holds it.

        Needs a published record (the claim travels in it); the slot that record already names (a resumed node's
        slot) is kept while no other live member holds it. Each attempt waits `claim_settle` real seconds so a
        simultaneous joiner's claim becomes visible; n simultaneous joiners settle in at most n attempts.

        A higher peer id that still shares our slot after `patience` reads has settled without seeing our claim
        (its last read came before our claim reached it, as on a loaded DHT) and will not look again; waiting for
        it to move would wait forever, so we claim again ourselves among the slots nobody else holds. A refused
        store of the claim is retried like any publish (MembershipError only after `retry_seconds`).
        """
        if self._record is None or self._record.peer_id != peer_id:
            raise MembershipError(
                f"claim_slot({peer_id!r}) needs a published record of that peer first, "
                f"have {self._record.peer_id if self._record else None!r}"
            )
        attempts = (patience + 2) * (num_slots + 1)
        shared = 0  # consecutive reads with a higher peer id on our slot
        for _ in range(attempts):
            await self.refresh()
            now = self.clock.now()
            current = self._record.slot
            if (
                current != NO_SLOT
                and current < num_slots
                and self.core.slot_conflict(peer_id, current, now) is None
            ):
                higher = [
                    r.peer_id for r in self.core.live(now) if r.slot == current and r.peer_id != peer_id
                ]
                if not higher:
                    return current
                shared += 1
                if shared <= patience:
                    # Only higher peer ids share our slot: they move, we keep it. Look again after they did.
                    logger.info("slot %d: waiting for %s (a higher peer id) to move", current, higher[0][:16])
                    await asyncio.sleep(self.claim_settle)  # real time: the DHT's own propagation
                    continue
                logger.info(
                    "slot %d: %s (a higher peer id) kept it for %d reads: it settled without seeing our claim; "
                    "claiming another",
                    current,
                    higher[0][:16],
                    shared - 1,
                )
            shared = 0
            slot = self.core.free_slot(peer_id, num_slots, now)
            await self.publish(dataclasses.replace(self._record, slot=slot))
            await asyncio.sleep(self.claim_settle)  # real time: the DHT's own propagation
        held = {r.peer_id[:16]: r.slot for r in self.core.live(self.clock.now())}
        raise MembershipError(
            f"slot claims of {peer_id} did not settle after {attempts} attempts "
            f"({self.claim_settle:g} s apart); last view of the slots: {held}"
        )

    async def remove(self, *, retry_seconds: float | None = None) -> None:
        """Graceful leave: stop heartbeats and store a tombstone over our record, hiding it at once.

        hivemind refuses stores whose expiration is already past and keeps, per sub-key, the entry with the
        latest expiration, so the tombstone expires one TTL from now and strictly after our last record. A
        refused tombstone is retried for `retry_seconds` (default: the membership's); MembershipError after
        that (the record then simply expires after its TTL).
        """
        await self.stop_heartbeat()
        record = self._record
        if record is None:
            return
        departure = Departure(record.peer_id, record.heartbeat, record.proof)

        def make() -> tuple[dict[str, Any], float]:
            nonlocal departure
            departure = Departure(
                record.peer_id,
                float(max(self.clock.now(), record.heartbeat + self.REMOVE_MARGIN)),
                record.proof,
            )
            expiration = max(departure.heartbeat + self.core.ttl, self._last_expiration + self.REMOVE_MARGIN)
            return departure.to_wire(), expiration

        seconds = self.retry_seconds if retry_seconds is None else retry_seconds
        await self._store(make, "our departure", seconds)
        self.core.observe(self.public_key, departure)
        self._record = None

    def start_heartbeat(self) -> None:
        """Re-publish our record every heartbeat_interval seconds until `stop_heartbeat` or `remove`."""
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = asyncio.create_task(
                self._heartbeat_loop(), name="farloco-membership-heartbeat"
            )

    async def stop_heartbeat(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        await cancel_and_wait(task)

    async def _heartbeat_loop(self) -> None:
        while True:
            await self.clock.sleep(self.heartbeat_interval)
            if self._record is None:
                continue
            try:
                await self.publish(self._record, retry_seconds=0)
            except MembershipError as error:
                # A missed heartbeat is survivable (ttl spans several intervals); the next one retries.
                logger.warning("membership heartbeat failed: %s", error)
