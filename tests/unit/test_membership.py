"""Membership: the sans-IO table with hand-set times, and DHTMembership on real hivemind DHTs on 127.0.0.1.
(the real-DHT fixtures `dht_nodes` and `dht_swarm`: tests/helpers/dht.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from helpers.dht import CONFIG, DhtPeer, dht_nodes, dht_swarm, rec  # noqa: F401  (dht_nodes, dht_swarm: fixtures)
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from farloco.protocol.auth import Authenticator
from farloco.protocol.membership import (
    NO_SLOT,
    Departure,
    DHTMembership,
    HeartbeatPacer,
    MemberRecord,
    Membership,
    MembershipError,
    MembersValidator,
    MemoSignatureValidator,
    RunMismatchError,
    SlotsExhaustedError,
    VerdictMemo,
    bootstrap_record_validators,
    config_differences,
    make_record_validators,
    members_key,
    parse_entry,
    table_read_interval,
)
from farloco.util.clock import FakeClock

# --------------------------------------------------------------------------------------------- sans-IO


def test_live_members_expire_after_ttl_and_other_runs_are_kept_aside() -> None:
    table = Membership("h1", CONFIG, ttl=10.0)
    table.observe(b"a", rec("a", heartbeat=100.0))
    table.observe(b"b", rec("b", heartbeat=105.0))
    other = dict(CONFIG, outer_lr=0.5, extra=1)
    table.observe(b"c", rec("c", heartbeat=105.0, run_hash="h2", run_config=other))
    assert [r.peer_id for r in table.live(109.0)] == ["a", "b"]
    assert [r.peer_id for r in table.live(110.0)] == ["b"]  # a's heartbeat + ttl has passed
    assert [(r.peer_id, keys) for r, keys in table.mismatched(110.0)] == [("c", ["extra", "outer_lr"])]
    with pytest.raises(
        RunMismatchError, match=r"outer_lr: expected=0.7 got=0.5.*extra: |extra: expected='<absent>' got=1"
    ):
        table.check_compatible(rec("c", run_hash="h2", run_config=other))


def test_an_older_read_never_replaces_a_newer_record_and_departure_hides_at_once() -> None:
    table = Membership("h1", CONFIG, ttl=10.0)
    table.observe(b"a", rec("a", heartbeat=100.0, state="exchanging"))
    table.observe(b"a", rec("a", heartbeat=99.0, state="training"))
    assert table.get("a", 100.0) is not None and table.get("a", 100.0).state == "exchanging"  # type: ignore[union-attr]
    table.observe(b"a", Departure("a", 101.0))
    assert table.live(101.5) == []
    # the same peer id coming back later (new key after a restart) is live again
    table.observe(b"a2", rec("a", heartbeat=102.0))
    assert [r.peer_id for r in table.live(102.5)] == ["a"]


def test_round_and_state_queries_skip_leaving_members() -> None:
    table = Membership("h1", CONFIG, ttl=10.0)
    table.observe(b"a", rec("a", round_id=4))
    table.observe(b"b", rec("b", round_id=4, state="leaving"))
    table.observe(b"c", rec("c", round_id=5))
    assert [r.peer_id for r in table.in_round(4, 100.0)] == ["a"]
    assert [r.peer_id for r in table.in_state("leaving", 100.0)] == ["b"]
    with pytest.raises(ValueError, match="state must be one of"):
        table.in_state("asleep", 100.0)


def test_slot_rule_lowest_free_slot_and_lower_peer_id_keeps_a_collided_slot() -> None:
    table = Membership("h1", CONFIG, ttl=10.0)
    table.observe(b"b", rec("b", slot=0))
    table.observe(b"d", rec("d", slot=2))
    # a newcomer never takes a slot it sees held, even by a higher peer id
    assert table.free_slot("a", 4, 100.0) == 1
    table.observe(b"a", rec("a", slot=0))  # a and b claimed 0 at the same time
    assert table.slot_conflict("b", 0, 100.0) is not None  # b must move
    assert table.slot_conflict("a", 0, 100.0) is None  # a keeps it
    table.observe(b"c", rec("c", slot=1))
    with pytest.raises(SlotsExhaustedError, match="all 3 data slots are held"):
        table.free_slot("e", 3, 100.0)
    with pytest.raises(ValueError, match="num_slots must be an int >= 1"):
        table.free_slot("e", 0, 100.0)


def test_the_heartbeat_reads_the_table_at_a_quarter_of_the_ttl_and_stores_every_beat() -> None:
    # a read carries every member's record: paced by member_ttl, never more often than a beat
    assert table_read_interval(1.0, 8.0) == 2.0
    assert table_read_interval(3.0, 8.0) == 3.0
    assert table_read_interval(0.5, 60.0) == 15.0
    pacer = HeartbeatPacer(1.0, 8.0)
    beats = [t for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0) if pacer.read_due(t)]
    assert beats == [1.0, 3.0, 5.0, 7.0, 9.0]
    # a beat that comes a little early (the loop's jitter) still reads, so reads never slip a whole beat
    jittery = HeartbeatPacer(1.0, 8.0)
    assert [t for t in (1.0, 2.0, 2.95, 4.0, 4.93) if jittery.read_due(t)] == [1.0, 2.95, 4.93]
    # a live member's record is never older than ttl in our view between two reads
    assert table_read_interval(1.0, 8.0) + 1.0 < 8.0
    every_beat = HeartbeatPacer(1.0, 8.0, read_interval=0.0)
    assert all(every_beat.read_due(t) for t in (1.0, 1.0, 2.0))
    with pytest.raises(ValueError, match="read_interval must be in"):
        HeartbeatPacer(1.0, 8.0, read_interval=8.0)


def test_each_distinct_record_is_judged_once_and_a_forgery_stays_refused() -> None:
    """The copies of one record that a table read gets from several DHT nodes cost one signature check."""
    signer = MemoSignatureValidator(RSAPrivateKey())
    owner = signer.local_public_key
    key = DHTID.generate(source=members_key("memo")).to_bytes()
    unsigned = DHTRecord(key, DHTProtocol.serializer.dumps(owner), b"\x81\xa1a\x01", 100.0)
    signed = DHTRecord(key, unsigned.subkey, signer.sign_value(unsigned), 100.0)
    forged = DHTRecord(key, unsigned.subkey, signed.value.replace(b"\xa1a\x01", b"\xa1a\x02"), 100.0)
    assert all(signer.validate(signed) for _ in range(5)) and signer.memo.hits == 4
    assert not any(signer.validate(forged) for _ in range(3)) and signer.memo.hits == 6
    # another expiration is another record: judged afresh
    assert not signer.validate(DHTRecord(key, signed.subkey, signed.value, 101.0)) and signer.memo.hits == 6
    memo = VerdictMemo(size=2)
    calls: list[bytes] = []

    def decide(record: DHTRecord) -> bool:
        calls.append(record.value)
        return record.value != b"bad"

    records = [DHTRecord(key, b"s", value, 1.0) for value in (b"x", b"bad", b"y")]
    assert [memo.judge(r, decide) for r in records] == [True, False, True]
    assert memo.judge(records[2], decide) and not memo.judge(records[1], decide) and memo.hits == 2
    assert memo.judge(records[0], decide) and calls == [b"x", b"bad", b"y", b"x"]  # the oldest went out


def test_config_differences_tell_types_apart() -> None:
    assert config_differences({"a": 1}, {"a": 1.0}) == ["a: expected=1 got=1.0"]
    assert config_differences({"a": 1}, {"a": True}) == ["a: expected=1 got=True"]
    assert config_differences({"a": "x"}, {"a": "x"}) == []


def test_member_record_validation_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match=r"member record.state: expected one of"):
        rec("a", state="sleeping")
    with pytest.raises(ValueError, match=r"member record.round_id: expected an int >= 0, got -1"):
        rec("a", round_id=-1)
    with pytest.raises(ValueError, match=r"member record.loss: expected a float, got 1"):
        rec("a", loss=1)
    with pytest.raises(ValueError, match="missing \\['version'\\]"):
        MemberRecord.from_wire({k: v for k, v in rec("a").to_wire().items() if k != "version"})
    assert MemberRecord.from_wire(rec("a").to_wire()) == rec("a")
    with pytest.raises(ValueError, match="run_name must be 1-64 characters"):
        members_key("a/b")


def test_records_of_our_run_need_a_proof_binding_peer_id_to_the_signing_key() -> None:
    auth = Authenticator("run:h1", b"secret", "a")
    table = Membership("h1", CONFIG, ttl=10.0, auth=auth)
    table.observe(b"key-a", rec("a", proof=auth.member_proof("a", b"key-a")))
    table.observe(b"key-x", rec("x", proof="00" * 32))  # a foreign key that does not know the secret
    table.observe(b"key-y", rec("a", heartbeat=101.0, proof=auth.member_proof("a", b"key-a")))  # copied proof
    table.observe(b"key-z", Departure("a", 102.0, proof="nope"))  # a forged tombstone must not hide a
    other = Authenticator("run:h2", b"another secret", "c")
    table.observe(b"key-c", rec("c", run_hash="h2", proof=other.member_proof("c", b"key-c")))
    assert [r.peer_id for r in table.live(103.0)] == ["a"]
    assert table.owners(103.0) == {b"key-a": "a"}
    assert table.ignored == {"BAD_MEMBER_PROOF": 3}
    table.observe(b"key-x", rec("x", heartbeat=103.0, proof="00" * 32))  # re-read: counted once per key
    assert table.ignored == {"BAD_MEMBER_PROOF": 3}
    # another run's record is kept unproven, for the mismatch diagnostics only
    assert [r.peer_id for r, _ in table.mismatched(103.0)] == ["c"]
    table.observe(b"key-a", Departure("a", 104.0, proof=auth.member_proof("a", b"key-a")))
    assert table.live(104.5) == [] and table.owners(104.5) == {}
    assert not auth.check_member_proof("a", b"key-a", "\u00e9" * 64)  # non-ASCII never raises


# --------------------------------------------------------------------------------------------- real DHT


@pytest.mark.dht
def test_published_records_are_seen_by_other_peers_and_removed_at_once(dht_swarm: Any) -> None:  # noqa: F811
    a, b, c = dht_swarm(3, run_name="members")

    async def main() -> None:
        await a.membership.publish(a.record(0, slot=0))
        await b.membership.publish(b.record(0, slot=1))
        seen = await c.membership.members()
        assert sorted(r.peer_id for r in seen) == sorted([a.me.peer_id, b.me.peer_id])
        assert {r.peer_id: r.slot for r in seen}[a.me.peer_id] == 0
        # what each call cost is counted: one store per publish, one read per table read
        assert a.membership.counters == {"stores": 1} and c.membership.counters == {"reads": 1}
        await a.membership.remove()
        assert [r.peer_id for r in await c.membership.members()] == [b.me.peer_id]
        # a leaves and rejoins: its new record replaces the tombstone
        await a.membership.publish(a.record(1))
        assert a.me.peer_id in [r.peer_id for r in await b.membership.members()]

    asyncio.run(main())


@pytest.mark.dht
def test_dht_refuses_wrong_schema_and_forged_records(dht_swarm: Any) -> None:  # noqa: F811
    """Stores through a real DHT: what `parse_entry` refuses (a wrong type, a bool for an int, an extra or a missing
    field, a bad tombstone) and what is not signed by the sub-key's owner is refused; a record and its tombstone
    are stored and read back."""
    a, b = dht_swarm(2, run_name="schema")
    key = members_key("schema")

    async def main() -> None:
        expiration = get_dht_time() + 30

        async def store(value: object, subkey: bytes = a.membership.public_key, later: float = 0.0) -> bool:
            return bool(await a.dht.store(key, value, expiration + later, subkey=subkey, return_future=True))

        record = a.record(0, heartbeat=get_dht_time())
        good = record.to_wire()
        for bad in (
            dict(good, state="dreaming"),
            dict(good, loss=1),  # int where a float is due
            dict(good, round_id=0.0),
            dict(good, slot=False),
            dict(good, extra=1),
            {k: v for k, v in good.items() if k != "maddrs"},
            dict(Departure(record.peer_id, record.heartbeat).to_wire(), left=False),
        ):
            assert not await store(bad), bad
        assert not await store(good, subkey=b"no-key")  # unsigned
        # a cannot write under b's key: it has no b's private key, so the signature check fails
        assert not await store(b.record(0, state="leaving").to_wire(), subkey=b.membership.public_key)
        assert await b.membership.members() == []
        assert await store(good)
        assert [r.peer_id for r in await b.membership.members()] == [record.peer_id]
        # the DHT keeps a sub-key's entry with the latest expiration: the tombstone expires later
        assert await store(Departure(record.peer_id, record.heartbeat + 1.0).to_wire(), later=1.0)
        await b.membership.refresh()
        assert b.membership.departed() == {record.peer_id}

    asyncio.run(main())


@pytest.mark.dht
def test_a_bootstrap_replica_refuses_unsigned_forged_and_wrong_schema_member_entries() -> None:
    """`farloco bootstrap`'s DHT node stores the records near its id like any replica. With its validators
    (`bootstrap_record_validators`, the run given) it refuses what a member refuses: an entry under a member's
    sub-key without that member's signature, and a signed one of the wrong schema; a member's signed record is
    stored. (A DHT node without validators stores the first two: the store calls below return True.)"""
    from farloco.node.daemon.dhtnode import make_dht, stop_dht

    key, run = members_key("schema"), "schema"
    boot = make_dht(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=bootstrap_record_validators([run]),
    )
    peers = boot.get_visible_maddrs()
    member_key = RSAPrivateKey()
    # Client mode: they store nothing themselves, so the bootstrap is the only replica of every record.
    member = make_dht(
        start=True,
        client_mode=True,
        initial_peers=peers,
        record_validators=make_record_validators(run, private_key=member_key),
    )
    forger = make_dht(start=True, client_mode=True, initial_peers=peers)  # no validators: signs nothing
    # Signs with the member's key but checks no schema (a member's own DHT node would refuse to send it).
    signer = make_dht(
        start=True,
        client_mode=True,
        initial_peers=peers,
        record_validators=[RSASignatureValidator(member_key)],
    )
    try:
        owner = RSASignatureValidator(member_key).local_public_key
        good = rec("member", heartbeat=get_dht_time()).to_wire()
        expiration = get_dht_time() + 30
        unsigned = forger.store(key, good, expiration, subkey=owner)
        # later than the unsigned one: a replica keeps a sub-key's entry only for a later expiration
        wrong_schema = signer.store(key, dict(good, state="dreaming"), expiration + 0.5, subkey=owner)
        assert unsigned is False and wrong_schema is False
        assert boot.get(key, latest=True) is None
        assert member.store(key, good, expiration + 1, subkey=owner)
        kept = boot.get(key, latest=True)
        assert kept is not None and kept.value[owner].expiration_time == expiration + 1
    finally:
        for dht in (signer, forger, member, boot):
            stop_dht(dht)


def _entry(validator: MembersValidator, value: object, subkey: object, key: str) -> bool:
    """What `validator` says of `value` stored under `subkey` of DHT key `key` (as hivemind serializes them)."""
    serializer = DHTProtocol.serializer
    raw_subkey = subkey if isinstance(subkey, bytes) and subkey in DHTProtocol.RESERVED_SUBKEYS else None
    record = DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        raw_subkey if raw_subkey is not None else serializer.dumps(subkey),
        serializer.dumps(value),
        get_dht_time() + 30,
    )
    return validator.validate(record)


def test_members_validator_accepts_exactly_what_parse_entry_accepts() -> None:
    """The members key's DHT validator refuses what the records' decoder refuses: no coercion, no extra field,
    no missing field, a public key in the sub-key; other keys pass; validators of two runs merge."""
    validator = MembersValidator("schema")
    owner = RSASignatureValidator(RSAPrivateKey()).local_public_key
    key = members_key("schema")
    good = rec("a").to_wire()
    departure = Departure("a", 100.0, "proof").to_wire()
    accepted = [
        good,
        departure,
        dict(good, slot=NO_SLOT, maddrs=[], run_config={}),
        dict(good, loss=float("nan")),
    ]
    refused = [
        dict(good, extra=1),
        {k: v for k, v in good.items() if k != "version"},
        dict(good, round_id=3.0),
        dict(good, inner_step=True),
        dict(good, loss=1),
        dict(good, heartbeat=float("inf")),
        dict(good, state="dreaming"),
        dict(good, peer_id=""),
        dict(good, peer_id="p" * 129),
        dict(good, address="a" * 257),
        dict(good, maddrs=[1]),
        dict(good, maddrs=["m"] * 17),
        dict(good, run_config={"k": None}),
        dict(good, run_config={"k": "v" * 257}),
        dict(departure, extra=1),
        dict(departure, left=False),
        dict(departure, heartbeat=100),
        {k: v for k, v in departure.items() if k != "proof"},
        [1, 2],
        None,
    ]
    for value in accepted:
        assert _entry(validator, value, owner, key), value
        assert parse_entry(value) is not None
    for value in refused:
        assert not _entry(validator, value, owner, key), value
        with pytest.raises(ValueError):
            parse_entry(value)
    for subkey in (b"no key", "a str", 5, DHTProtocol.IS_REGULAR_VALUE, DHTProtocol.IS_DICTIONARY):
        assert not _entry(validator, good, subkey, key), subkey
    assert _entry(validator, "anything", owner, members_key("another"))  # another key: not ours to check
    other = MembersValidator("another")
    assert validator.merge_with(other) and not validator.merge_with(RSASignatureValidator(RSAPrivateKey()))
    assert not _entry(validator, dict(good, extra=1), owner, members_key("another"))
    assert validator.priority < RSASignatureValidator(RSAPrivateKey()).priority  # it sees the stripped value


@pytest.mark.dht
def test_ttl_expiry_with_a_fake_clock_and_run_mismatch(dht_swarm: Any) -> None:  # noqa: F811
    clock = FakeClock(get_dht_time())
    a, b = dht_swarm(2, run_name="ttl", ttl=5.0, heartbeat_interval=1.0, clock=clock)

    async def main() -> None:
        await a.membership.publish(a.record(0))
        other = DHTMembership(
            b.dht, "ttl", "h2", dict(CONFIG, model="big"), public_key=b.membership.public_key
        )
        await other.publish(rec(b.me.peer_id, run_hash="h2", run_config=dict(CONFIG, model="big")))
        assert [r.peer_id for r in await b.membership.members()] == [a.me.peer_id]
        assert [(r.peer_id, keys) for r, keys in b.membership.mismatched()] == [(b.me.peer_id, ["model"])]
        clock.advance(5.5)  # a's heartbeat + ttl is past in our time, whatever the DHT still holds
        assert await b.membership.members() == []

    asyncio.run(main())


@pytest.mark.dht
def test_simultaneous_joiners_claim_distinct_slots(dht_swarm: Any) -> None:  # noqa: F811
    peers = dht_swarm(3, run_name="slots", claim_settle=0.2)

    async def main() -> None:
        for p in peers:
            await p.membership.publish(p.record(0))
        slots = await asyncio.gather(*(p.membership.claim_slot(p.me.peer_id, 3) for p in peers))
        assert sorted(slots) == [0, 1, 2]
        seen = {r.peer_id: r.slot for r in await peers[0].membership.members()}
        assert seen == {p.me.peer_id: s for p, s in zip(peers, slots, strict=True)}
        late = DHTMembership(peers[0].dht, "slots", "h1", CONFIG, public_key=b"[owner:x]")
        await late.refresh()
        with pytest.raises(SlotsExhaustedError):
            late.core.free_slot("zz", 3, get_dht_time())

    asyncio.run(main())


@pytest.mark.dht
def test_a_claim_keeps_its_asked_slot_and_never_waits_for_a_settled_higher_peer(dht_swarm: Any) -> None:  # noqa: F811
    # The race a loaded Slurm job showed: the higher peer id read before the lower one's claim reached it, kept
    # the slot and never looked again; the lower one waited for it to move until its claim gave up (36 attempts).
    low, high = sorted(dht_swarm(2, run_name="settled", claim_settle=0.1), key=lambda p: p.me.peer_id)

    async def main() -> None:
        await high.membership.publish(high.record(0, slot=0))  # settled on slot 0: it claims nothing more
        await low.membership.publish(low.record(0, slot=2))  # a resumed node asks for its checkpoint's slot
        assert await low.membership.claim_slot(low.me.peer_id, 3) == 2  # free: kept
        await low.membership.publish(low.record(0, slot=0))
        started = time.monotonic()
        slot = await low.membership.claim_slot(low.me.peer_id, 3, patience=3)
        assert slot == 1, "the lower peer id moves off a slot a settled higher peer keeps"
        assert time.monotonic() - started < 5.0
        seen = {r.peer_id: r.slot for r in await high.membership.members()}
        assert seen == {low.me.peer_id: 1, high.me.peer_id: 0}

    asyncio.run(main())


@pytest.mark.dht
def test_heartbeat_republishes_on_the_clock_and_stops_on_remove(dht_swarm: Any) -> None:  # noqa: F811
    # The fake clock drives the heartbeat schedule; the DHT itself checks expirations against real time, and the
    # fake clock falls behind it by however long the test takes. A TTL far longer than the test keeps every
    # record stamped by the fake clock valid on the DHT (with ttl=5 a loaded run saw its tombstone refused).
    clock = FakeClock(get_dht_time())
    a, b = dht_swarm(2, run_name="beat", ttl=120.0, heartbeat_interval=1.0, clock=clock)

    async def republished(after: float) -> float:
        for _ in range(
            200
        ):  # wait for the DHT round trip, not for time to pass: the fake clock does not move
            seen = {r.peer_id: r.heartbeat for r in await b.membership.members()}
            if seen.get(a.me.peer_id, -1.0) > after:
                return seen[a.me.peer_id]
            await asyncio.sleep(0.02)
        raise AssertionError(f"no heartbeat of {a.me.peer_id} after {after}")

    async def main() -> None:
        first = (await a.membership.publish(a.record(0))).heartbeat
        a.membership.start_heartbeat()
        await asyncio.sleep(0)
        clock.advance(1.0)
        assert await republished(first) == pytest.approx(first + 1.0)
        await a.membership.remove()
        clock.advance(1.0)
        await asyncio.sleep(0.2)
        assert await b.membership.members() == []

    asyncio.run(main())


@pytest.mark.dht
def test_a_dht_call_that_never_answers_does_not_freeze_the_node(
    dht_swarm: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hivemind future that never resolves: a read keeps the last view, a store becomes a MembershipError
    (which the agent survives), both after DHT_CALL_TIMEOUT real seconds instead of never."""
    import concurrent.futures

    import farloco.protocol.dhtcall as dhtcall_module
    import farloco.protocol.membership as membership_module

    a, b = dht_swarm(2, run_name="hang")

    async def main() -> None:
        await a.membership.publish(a.record(0))
        for _ in range(200):
            if [r.peer_id for r in await b.membership.members()] == [a.me.peer_id]:
                break
            await asyncio.sleep(0.02)
        monkeypatch.setattr(dhtcall_module, "DHT_CALL_TIMEOUT", 0.3)
        # A fresh future per call, as hivemind returns, none of which ever resolves.
        monkeypatch.setattr(b.membership.dht, "get", lambda *args, **kwargs: concurrent.futures.Future())
        monkeypatch.setattr(a.membership.dht, "store", lambda *args, **kwargs: concurrent.futures.Future())
        assert [r.peer_id for r in await asyncio.wait_for(b.membership.members(), 5)] == [a.me.peer_id]
        with pytest.raises(membership_module.MembershipError, match="refused our member record"):
            await asyncio.wait_for(a.membership.publish(a.record(0), retry_seconds=1.0), 10)

    asyncio.run(main())


@pytest.mark.dht
def test_refused_stores_are_retried_at_every_stage_until_the_deadline(dht_swarm: Any) -> None:  # noqa: F811
    """A real DHT behind FlakyDHT: the first stores of a record, of a slot claim and of a tombstone are
    refused and each gets through on a retry; a DHT that keeps refusing past retry_seconds ends in one
    MembershipError naming the key and the attempts."""
    from farloco.node.faults import FlakyDHT

    a, b = dht_swarm(2, run_name="flaky")
    flaky = FlakyDHT(a.dht, refuse_stores=3)
    member = DHTMembership(flaky, "flaky", "h1", CONFIG, public_key=a.membership.public_key, retry_seconds=30)

    async def seen_by_b() -> dict[str, MemberRecord]:
        for _ in range(200):
            seen = {r.peer_id: r for r in await b.membership.members()}
            if a.me.peer_id in seen:
                return seen
            await asyncio.sleep(0.05)
        raise AssertionError(f"b never saw {a.me.peer_id}")

    async def main() -> None:
        await member.publish(a.record(0))  # join: 3 refusals, then stored
        assert flaky.refused == 3 and (await seen_by_b())[a.me.peer_id].slot == NO_SLOT
        flaky.refuse_stores = 2
        assert await member.claim_slot(a.me.peer_id, 4) == 0  # the slot claim is retried too
        assert flaky.refused == 5 and (await seen_by_b())[a.me.peer_id].slot == 0
        flaky.refuse_stores = 2
        await member.remove()  # leaving: the tombstone is retried
        assert flaky.refused == 7
        for _ in range(100):
            if a.me.peer_id not in {r.peer_id for r in await b.membership.members()}:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the tombstone never hid the record")
        flaky.refuse_stores = 10**6
        started = time.monotonic()
        with pytest.raises(
            MembershipError, match=r"refused our member record under farloco/flaky/members"
        ) as err:
            await member.publish(a.record(1), retry_seconds=1.5)
        assert 1.0 < time.monotonic() - started < 10.0
        assert "attempts" in str(err.value) and "initial_peers" in str(err.value)

    asyncio.run(main())


@pytest.mark.dht
def test_a_tombstone_after_a_store_whose_answer_was_lost_is_not_refused(dht_swarm: Any) -> None:  # noqa: F811
    """A heartbeat lands in the DHT but its answer never reaches us (the call was cancelled by a leave, or timed
    out under load); the tombstone stored next, in the same instant, must still be strictly newer. It had that
    heartbeat's exact expiration and was refused for the whole retry window (seen once in a stress run)."""
    import concurrent.futures

    clock = FakeClock(get_dht_time())
    a, b = dht_swarm(2, run_name="lost", ttl=120.0, heartbeat_interval=1.0, clock=clock)
    real = a.membership.dht

    class AnswerLost:
        """Stores really happen; their answers never come back."""

        def store(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
            real.store(*args, return_future=True, **kwargs).result(timeout=30)
            return concurrent.futures.Future()  # never resolved

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    async def main() -> None:
        first = (await a.membership.publish(a.record(0))).heartbeat
        clock.advance(1.0)
        a.membership.dht = AnswerLost()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(a.membership.publish(a.record(0), retry_seconds=0), timeout=1.0)
        a.membership.dht = real
        seen = {r.peer_id: r.heartbeat for r in await b.membership.members()}
        assert seen[a.me.peer_id] == pytest.approx(first + 1.0)  # it landed
        await a.membership.remove(retry_seconds=5.0)  # the clock has not moved: same instant
        assert await b.membership.members() == []

    asyncio.run(main())
