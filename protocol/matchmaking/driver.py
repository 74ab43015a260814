"""`DHTMatchmaker`: the matchmaking rule (rules.py) driven over the members' authenticated gRPC links, with a
copy of every record in the DHT for the peers a link misses: pushes and relays, background DHT reads, the
inbox of records that arrive for rounds around ours, the waits and the late answers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from farloco.protocol import dhtcall
from farloco.protocol.errors import Reject
from farloco.protocol.matchmaking.records import (
    AT_METHOD,
    GROUP_METHOD,
    MAX_GROUP,
    READY_METHOD,
    AtMessage,
    GroupRecord,
    LateForRound,
    MatchmakingError,
    ReadyRecord,
    RecordPush,
    dht_entries,
    expected_digest,
    parse_groups,
    parse_ready,
    round_key,
)
from farloco.protocol.matchmaking.rules import (
    Joined,
    Late,
    Publish,
    RoundView,
    StragglerWait,
    Wait,
    decide,
    schedule,
    spread_sample,
)
from farloco.protocol.membership import DHTMembership, members_key
from farloco.protocol.rpc import knock
from farloco.protocol.types import NO_INBOUND, Group, GroupMember
from farloco.util.clock import Clock, DHTClock
from farloco.util.tasks import cancel_and_wait, wait_for

logger = logging.getLogger("farloco.protocol.matchmaking")
T = TypeVar("T")
STORE_ATTEMPTS = 4
# Seconds a ready or group record's DHT copy waits behind the links' pushes (at most leader_timeout / 16): longer
# than a freeze takes on loopback, short beside the leader_timeout / 2 in which a record must reach every peer.
COPY_DELAY = 0.1
KNOCK_EVERY = 1.0  # seconds between knocks at a vanished member's address
# A vanished member that answers (alive: its record lapsed, as under load) is knocked at half as often after
# each answer, down to every KNOCK_EVERY * 2**KNOCK_BACKOFF_STEPS seconds: on an overloaded swarm every record
# lapses at once, and a knock a second from every member at every other (a connect and an authenticated call
# each) fed the overload (11% of a worker's CPU at 64 protocol peers on 2 cores).
KNOCK_BACKOFF_STEPS = 3
KNOCK_TIMEOUT = 2.0  # a knock that has no answer by then says nothing
FROZEN_READ_TIMEOUT = 5.0  # `frozen_without` is an optimisation: a catch-up never waits longer on it
# Rounds of pushed messages kept around the one we are in: behind it (a relay or a duplicate arriving late) and
# ahead of it (peers that finished their local work before us).
_INBOX_BEHIND = 2
_INBOX_AHEAD = 16
_INBOX_PER_ROUND = 4096


@dataclass
class _DHTView:
    """What the background DHT reads of one round found so far."""

    ready: dict[str, ReadyRecord]
    owners: dict[str, bytes]
    groups: list[GroupRecord]
    polls: int = 0
    error: MatchmakingError | None = None


class DHTMatchmaker:
    """Runs `decide` for this peer: ready and group messages over the members' own links, the DHT as fallback.

    With links (`server` and `client`, the node's authenticated gRPC server and client), a peer that is ready
    pushes its ready record to every live member at once (`MatchReady`), the leader pushes the frozen group to its
    members (`MatchGroup`), and a member that learns the group from someone relays it once to the others (so a
    leader that dies after reaching some members only still reaches all). Pushed messages wake the decision at
    once. The same records are also stored in and read from the DHT in the background (a member our links miss,
    a joiner whose member record we have not seen yet), so the DHT is off the round's critical path: a slow or
    refusing DHT delays nobody whose link works. The copies (and a one-hop group's relays) wait `copy_delay`
    behind the pushes, at most `leader_timeout / 16`, and a ready record's copy goes at once when one of its
    pushes fails: on a loaded machine a copy's store (the DHT child, its libp2p daemon, the replicas') took the
    cores the last member's pushes needed, and the freeze waited for it. A pushed ready record must come from the
    peer it names (the sender's authenticated peer id), and a group only from one of its members.

    Without links (tests of the DHT path alone) the ready record is stored first and a refusal raises
    MatchmakingError, as before.

    DHT polling starts at `min_poll_interval` and doubles up to `poll_interval`, each poll reading the round's
    ready and group records and the member table. With links the first read waits `poll_interval` (most rounds
    freeze over the links before it: no DHT read at all), the reads after it back off, doubling up to
    `leader_timeout / 8` (with 32 peers on 2 cores each read is a walk of the DHT whose answers carry every ready
    record, and a round that waited seconds for its leader read it a dozen times; a record a link missed still
    reaches us well within the `leader_timeout / 2` the agreement argument needs), and polls leave the member
    table to the heartbeat's reads, since the links carry the round and the DHT only backs them up (reading it
    every few ms cost each peer three DHT traversals per poll, CPU the round's critical path competes for). A
    member behind NAT, which nobody pushes to, reads at once and every `poll_interval`.
    Reads use `latest=True` (a full traversal merging every replica's sub-keys); a plain get stops at the first
    copy it finds, often our own partial one, and would miss other peers' records. With a membership that stores
    near its key (the agent's), round records are stored near the round's keys too (`dhtcall.store_near`: the
    first store walks, and finds the key's replicas), and a pushed-to peer's polls read a few of those replicas
    (`dhtcall.get_near`) instead of walking: at 32 peers on 2 cores the round keys' walks, each of whose hops
    answered with every ready record, were a fifth of a worker's profile.
    """

    def __init__(
        self,
        dht: Any,
        run_name: str,
        membership: DHTMembership,
        *,
        clock: Clock | None = None,
        poll_interval: float = 0.25,
        min_poll_interval: float = 0.01,
        server: Any = None,
        client: Any = None,
        push_timeout: float = 2.0,
        copy_delay: float = COPY_DELAY,
    ) -> None:
        if not 0 < min_poll_interval <= poll_interval:
            raise ValueError(
                f"need 0 < min_poll_interval <= poll_interval, got {min_poll_interval} and {poll_interval}"
            )
        if (server is None) != (client is None):
            raise ValueError("links need both the gRPC server and the client (or neither)")
        if not push_timeout > 0:
            raise ValueError(f"push_timeout must be > 0, got {push_timeout}")
        if not copy_delay >= 0:
            raise ValueError(f"copy_delay must be >= 0, got {copy_delay}")
        self.dht = dht
        self.run_name = run_name
        self.membership = membership
        self.clock: Clock = clock if clock is not None else DHTClock()
        self.poll_interval = poll_interval
        self.min_poll_interval = min_poll_interval
        self.client = client
        self.push_timeout = push_timeout
        self.copy_delay_max = copy_delay
        # Pushes ride the kept-open links to the members (protocol/links.py); False sends each as a gRPC call
        # (benchmarks/matchmaking.py --no-links compares the two).
        self.over_links = True
        members_key(run_name)  # validates run_name early
        self._current = 0
        self._ready_in: dict[int, dict[str, ReadyRecord]] = {}
        self._groups_in: dict[int, dict[str, GroupRecord]] = {}
        self._wake: asyncio.Event | None = None
        # peer id -> (the round it announced it works on, our clock when it arrived, its theta hash there)
        self._at: dict[str, tuple[int, float, str]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        # The adaptive straggler wait, once form_group is given a floor.
        self.straggler: StragglerWait | None = None
        self.last_wait = 0.0  # the straggler wait we proposed in our last ready record
        self.last_leader = ""  # who froze the group form_group last returned
        # How form_group last returned a group (the round event carries it): frozen in one hop, and the seconds
        # from the last of its members' ready records (their ready_at) to the group known here (our clock).
        self.last_one_hop = False
        self.last_freeze_seconds: float | None = None
        self._last_group: tuple[int, dict[str, str]] = (-1, {})  # (round, peer id -> address) of that group
        # Members of the last group whose record vanished: peer id -> (when we last knocked at its address, the
        # verdict: "refused" (no process listens there any more), "silent" or "" (it answered), how many knocks
        # in a row it answered: KNOCK_BACKOFF_STEPS).
        self._knocked: dict[str, tuple[float, str, int]] = {}
        # pushes_ok / pushes_failed / ready_received / groups_received / relayed / rejected / one_hop (groups
        # frozen in one hop) / knocks (at lapsed members of the last group)
        self.counters: Counter[str] = Counter()
        if server is not None:
            server.add_unary(READY_METHOD, self._on_ready)
            server.add_unary(GROUP_METHOD, self._on_group)
            server.add_unary(AT_METHOD, self._on_at)

    # -- receiving ----------------------------------------------------------------------------------------

    def _file(self, box: dict[int, dict[str, Any]], round_id: int, peer_id: str, record: Any) -> None:
        if round_id < self._current - _INBOX_BEHIND:
            self.counters["rejected"] += 1
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                "STALE_ROUND",
                f"round {round_id} is over here (we are in round {self._current})",
            )
        if round_id > self._current + _INBOX_AHEAD:
            self.counters["rejected"] += 1
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                "ROUND_TOO_FAR",
                f"round {round_id} is more than {_INBOX_AHEAD} rounds ahead of ours ({self._current})",
            )
        entries = box.setdefault(round_id, {})
        if peer_id not in entries and len(entries) >= _INBOX_PER_ROUND:
            self.counters["rejected"] += 1
            raise Reject(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "TOO_MANY",
                f"round {round_id} already holds {len(entries)}",
            )
        entries[peer_id] = record
        if self._wake is not None:
            self._wake.set()

    def _parse(self, decode: Callable[[], T], reason: str) -> T:
        """`decode()`, or `Reject` (INVALID_ARGUMENT, `reason`) naming the bad field."""
        try:
            return decode()
        except ValueError as exc:
            self.counters["rejected"] += 1
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, reason, str(exc)) from None

    async def _on_ready(self, ctx: Any, frame: Any) -> Any:
        from farloco.protocol.rpc import Frame

        record = self._parse(lambda: RecordPush.decode(frame.header, ReadyRecord), "BAD_READY").record
        if record.peer_id != ctx.sender or record.round_id != ctx.round_id:
            self.counters["rejected"] += 1
            raise Reject(
                grpc.StatusCode.PERMISSION_DENIED,
                "SENDER_MISMATCH",
                f"expected a ready record of the sender {ctx.sender} for the token's round {ctx.round_id}, "
                f"got one of {record.peer_id} for round {record.round_id}",
            )
        self._file(self._ready_in, record.round_id, record.peer_id, record)
        self.counters["ready_received"] += 1
        return Frame({"ok": True})

    async def _on_at(self, ctx: Any, frame: Any) -> Any:
        from farloco.protocol.rpc import Frame

        if len(self._at) >= _INBOX_PER_ROUND and ctx.sender not in self._at:
            self._prune_at()
            if len(self._at) >= _INBOX_PER_ROUND:
                self.counters["rejected"] += 1
                raise Reject(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY", f"{len(self._at)} peers announced rounds"
                )
        outer_hash = self._parse(lambda: AtMessage.decode(frame.header), "BAD_ANNOUNCEMENT").outer_hash
        self._at[ctx.sender] = (ctx.round_id, self.clock.now(), outer_hash)
        if self._wake is not None:
            self._wake.set()
        return Frame({"ok": True})

    def newest_announced(self) -> int:
        """The newest round another peer announced over the links that it works on (-1 if none): where a peer
        that was late catches up to."""
        return max((round_id for round_id, _, _ in self._at.values()), default=-1)

    def _prune_at(self) -> None:
        horizon = self.clock.now() - self.membership.core.ttl
        for peer_id in [p for p, (_, at, _) in self._at.items() if at < horizon]:
            del self._at[peer_id]

    def announce(self, round_id: int, peer_id: str, outer_hash: str = "") -> None:
        """Tell every live member that our local work for `round_id` starts now (call it when it does), from
        theta_outer with hash `outer_hash`.

        This is what the leader's early freeze waits on: a member whose record or announcement says round r is
        waited for in r. Member records say it too, but through the DHT, a heartbeat or more late; with rounds
        of a fraction of a second that lag would let a leader freeze without a member that is merely slower.
        The hash tells a joiner which theta the swarm vouches for in each round (`announced_hashes`: a donor
        serving another is refused). The hash check of a round reads the hashes of the group record instead
        (each member's ready record declares its own), which every member of the group sees alike."""
        # Ours too: what the early freeze needs of our own record ("works on round r", before it is ready) is
        # this announcement, not a member-record store a heartbeat later.
        self._at[peer_id] = (round_id, self.clock.now(), outer_hash)
        if self.client is None:
            return
        header = AtMessage(outer_hash).encode()
        live = self.membership.core.live(self.clock.now())
        for address in self._link_targets(round_id, live, peer_id).values():
            self._spawn(self._push(address, AT_METHOD, header, round_id))

    def _link_targets(self, round_id: int, live: Sequence[Any], me: str) -> dict[str, str]:
        """Peer id -> address of whom round `round_id`'s messages go to over the links: the live members not
        leaving, and the members of our group of round r-1 whatever the member table says (with one node's DHT
        process stopped both nodes' tables emptied; pushing only to the table, neither reached the other and each
        led a group of one: the same round committed twice)."""
        leaving = {r.peer_id for r in live if r.state == "leaving"}
        # A member behind NAT (NO_INBOUND) is never pushed to: it reads the round's records from the DHT.
        targets = {r.peer_id: r.address for r in live if r.peer_id not in leaving and r.address != NO_INBOUND}
        if self._last_group[0] == round_id - 1:
            targets.update(
                (p, a)
                for p, a in self._last_group[1].items()
                if p not in targets and p not in leaving and a != NO_INBOUND
            )
        targets.pop(me, None)
        return targets

    def announced_hashes(self, round_id: int) -> dict[str, str]:
        """Peer id -> the theta hash it announced for `round_id` (announcements younger than the member ttl)."""
        horizon = self.clock.now() - self.membership.core.ttl
        return {p: h for p, (r, at, h) in self._at.items() if r == round_id and h and at >= horizon}

    def waiting_for(self, round_id: int, me: str) -> bool:
        """Whether every other member expected in `round_id` already told us over the links that it is ready
        for it (it waits for us now): a straggler's cue to end its inner steps early (a partial contribution).
        False without links (the DHT's ready records are read only while forming a group), and when no other
        member is expected."""
        if self.client is None:
            return False
        now = self.clock.now()
        live = self.membership.core.live(now)
        expected = self._expected(round_id, live, now, me) - {me}
        ready = self._ready_in.get(round_id, {})
        return bool(expected) and expected <= ready.keys()

    def _expected(self, round_id: int, live: Sequence[Any], now: float, me: str) -> frozenset[str]:
        """Whom round `round_id` waits for: live members working on it and not leaving, the members of our last
        group still in step (`_from_last_group`), members fetching the swarm's state (`_catching_up`), and
        members that announced the round whose record we do not hold (`_announced`)."""
        return (
            frozenset(r.peer_id for r in live if self.round_of(r, now) == round_id and r.state != "leaving")
            | self._from_last_group(round_id, live, now, me)
            | self._catching_up(round_id, live, now, me)
            | self._announced(round_id, live, now, me)
        )

    def _announced(self, round_id: int, live: Sequence[Any], now: float, me: str) -> frozenset[str]:
        """Members that told us over the links, within the member ttl, that they work on round r, and whose member
        record we do not hold (expired in our view, or not read yet), unless they left (a tombstone). Their own
        fresh word outweighs a table read seconds late: 16 nodes on 2 cores read records 7-14 s old, and a node
        that had just fetched the swarm's state was missing from the leader's table when it announced the next
        round; the leader froze without it, it fetched the next state, and so on round after round."""
        held = {r.peer_id for r in live}
        departed = self.membership.core.departed(now)
        horizon = now - self.membership.core.ttl
        return frozenset(
            peer
            for peer, (announced, at, _) in self._at.items()
            if announced == round_id
            and at >= horizon
            and peer != me
            and peer not in held
            and peer not in departed
        )

    def _from_last_group(self, round_id: int, live: Sequence[Any], now: float, me: str) -> frozenset[str]:
        """The members of our group of round r-1, expected in round r: they were in step with us a round ago,
        whatever our member table says (under load its DHT reads lag by seconds; a leader that trusted only the
        table froze a group of 2 while the lowest peer id froze the group of all 8). Not those whose record says
        they leave or that they are already past r, nor those that left (their departure tombstone: without
        this, the round after a `farloco leave` waited the whole straggler wait for the member that left)."""
        last_round, members = self._last_group
        if last_round != round_id - 1:
            return frozenset()
        records = {r.peer_id: r for r in live}
        departed = self.membership.core.departed(now)
        verdicts = {p: self._knocked.get(p, (0.0, "", 0))[1] for p in members if p != me and p not in records}
        refused = {p for p, verdict in verdicts.items() if verdict == "refused"}
        silent = {p for p, verdict in verdicts.items() if verdict == "silent"}
        # Silent members are given up only while the rest of the group (less those whose process is gone for
        # sure) is a strict majority of it: the sides of a partition cannot both be, so neither stops waiting.
        counted = len(members) - len(refused)
        given_up = refused | (silent if 2 * (counted - len(silent)) > counted else set())
        return frozenset(
            p
            for p in members
            if p != me
            # left (a tombstone) and not back (a restarted node keeps its peer id: a newer record means back)
            and (p in records or p not in departed)
            # crashed (its record expired and its address refuses connections) or frozen (it answers no call),
            # see `_knock_vanished`
            and p not in given_up
            and not (
                p in records and (records[p].state == "leaving" or self.round_of(records[p], now) > round_id)
            )
        )

    def _knock_vanished(self, round_id: int, live: Sequence[Any], now: float, me: str) -> None:
        """Knock at the address of each member of our last group whose record vanished, every KNOCK_EVERY
        seconds while it stays so (twice as long after each answer, up to KNOCK_BACKOFF_STEPS doublings): a TCP
        connect, then an authenticated call (`RpcClient.answers`). A refused
        connection means its process is gone (crashed, killed; a restarted one listens again): the round stops
        waiting for it instead of waiting out the straggler wait. No answer within KNOCK_TIMEOUT is `silent`: a
        frozen process (its kernel still accepts the connect), a dead host without reset, or a partition; the
        round stops waiting for silent members only while the rest of the last group is a strict majority of it
        (`_from_last_group`), so a partition's sides keep waiting (bounded by the round's wait, as before)."""
        last_round, members = self._last_group
        records = {r.peer_id for r in live}
        for peer_id in list(self._knocked):
            if peer_id in records or peer_id not in members:
                del self._knocked[peer_id]  # back (or no longer of our last group): forget the knock
        if last_round != round_id - 1 or self.client is None:
            return
        for peer_id, address in members.items():
            if peer_id == me or peer_id in records or address == NO_INBOUND:
                continue
            knocked_at, verdict, answered = self._knocked.get(peer_id, (-math.inf, "", 0))
            if now - knocked_at >= KNOCK_EVERY * 2 ** min(answered, KNOCK_BACKOFF_STEPS):
                self._knocked[peer_id] = (now, verdict, answered)
                self._spawn(self._knock(peer_id, address, round_id))

    async def _knock(self, peer_id: str, address: str, round_id: int) -> None:
        self.counters["knocks"] += 1
        verdict = await knock(address, KNOCK_TIMEOUT)
        if verdict == "open":
            verdict = ""
            if self.client is not None and not await self.client.answers(
                address, round_id=round_id, timeout=KNOCK_TIMEOUT
            ):
                verdict = "silent"
        if peer_id in self._knocked:
            knocked_at, was, answered = self._knocked[peer_id]
            self._knocked[peer_id] = (knocked_at, verdict, 0 if verdict else answered + 1)
            if verdict and verdict != was:
                logger.info(
                    "%s (of our last group) vanished and %s: not waited for%s",
                    peer_id[:16],
                    f"its address {address} refuses connections"
                    if verdict == "refused"
                    else "answers no call (frozen, or cut off)",
                    "" if verdict == "refused" else " while the rest of the group is a majority",
                )

    def _catching_up(self, round_id: int, live: Sequence[Any], now: float, me: str) -> frozenset[str]:
        """Live members whose record says they fetch the swarm's state (`syncing`) and are not past round r:
        they join the round once their transfer and first inner steps are done, so the round waits for them
        (bounded by its wait) rather than freezing without them and sending them after a newer state again."""
        return frozenset(
            r.peer_id
            for r in live
            if r.peer_id != me and r.state == "syncing" and self.round_of(r, now) <= round_id
        )

    def round_of(self, record: Any, now: float) -> int:
        """The newest round we know `record`'s member works on: its record's, or what it announced since."""
        at = self._at.get(record.peer_id)
        if at is None or at[1] < now - self.membership.core.ttl:
            return int(record.round_id)
        return max(int(record.round_id), at[0])

    async def _on_group(self, ctx: Any, frame: Any) -> Any:
        from farloco.protocol.rpc import Frame

        record = self._parse(lambda: RecordPush.decode(frame.header, GroupRecord), "BAD_GROUP").record
        members = {m.peer_id for m in record.group.members}
        if ctx.sender not in members or record.group.round_id != ctx.round_id:
            self.counters["rejected"] += 1
            raise Reject(
                grpc.StatusCode.PERMISSION_DENIED,
                "SENDER_MISMATCH",
                f"a group may come only from one of its members, for the token's round {ctx.round_id}; got "
                f"one of round {record.group.round_id} from {ctx.sender}",
            )
        self._file(self._groups_in, record.group.round_id, record.leader, record)
        self.counters["groups_received"] += 1
        return Frame({"ok": True})

    # -- sending ------------------------------------------------------------------------------------------

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def copy_delay(self, leader_timeout: float) -> float:
        """How long a DHT copy of a round's record waits behind the links' pushes: `copy_delay`, at most
        `leader_timeout / 16` (what the agreement argument's `leader_timeout / 2` bound can spare)."""
        return min(self.copy_delay_max, leader_timeout / 16)

    @staticmethod
    async def _after_freeze(
        store: Coroutine[Any, Any, Any], delay: float, now: asyncio.Event | None = None
    ) -> None:
        """Run `store` once `delay` seconds passed (real time), or at once when `now` is set."""
        try:
            if now is None:
                await asyncio.sleep(delay)
            else:
                with contextlib.suppress(TimeoutError):
                    await wait_for(now.wait(), delay)
        except BaseException:
            store.close()
            raise
        await store

    async def _push(
        self,
        address: str,
        method: str,
        header: dict[str, Any],
        round_id: int,
        *,
        failed: asyncio.Event | None = None,
    ) -> bool:
        from farloco.protocol.rpc import Frame, RpcError

        assert self.client is not None
        try:
            # Over the kept-open link to the peer (protocol/links.py): the handlers file a repeat as the same
            # record, so a push retried on a new link is harmless.
            await self.client.unary(
                address,
                method,
                Frame(header),
                round_id=round_id,
                timeout=self.push_timeout,
                link=self.over_links,
            )
        except (RpcError, OSError) as exc:
            self.counters["pushes_failed"] += 1
            if failed is not None:  # its DHT copy now: the peer we missed reads it there
                failed.set()
            logger.debug("round %d: %s to %s failed: %s", round_id, method, address, exc)
            return False
        self.counters["pushes_ok"] += 1
        return True

    async def close(self) -> None:
        """Cancel the pushes and DHT stores still in flight."""
        for task in list(self._background):
            await cancel_and_wait(task)

    # -- the DHT ------------------------------------------------------------------------------------------

    async def _store(self, key: str, value: dict[str, Any], expiration: float) -> bool:
        # Every DHT call is bounded (dhtcall.DHT_CALL_TIMEOUT): a hivemind future that never resolves would
        # otherwise hold the round, and the node, for good. A store that does not answer counts as refused.
        try:
            replan_every = self.membership.replan_every
            if replan_every > 0:  # near the key, as the member table's stores: a retry goes straight there
                store = functools.partial(
                    dhtcall.store_near,
                    key=key,
                    value=value,
                    expiration=expiration,
                    subkey=self.membership.public_key,
                    replan_every=replan_every,
                )
                ok = await dhtcall.run_in_dht(self.dht, store)
            else:
                ok = await dhtcall.call(
                    self.dht.store, key, value, expiration, subkey=self.membership.public_key
                )
        except TimeoutError:
            logger.warning("DHT store under %s did not answer within %.0f s", key, dhtcall.DHT_CALL_TIMEOUT)
            return False
        return bool(ok)

    async def _store_ready(self, key: str, mine: ReadyRecord, expiration: float) -> bool:
        for attempt in range(STORE_ATTEMPTS):
            if await self._store(key, mine.to_wire(), expiration):
                return True
            # A store fails when no replica answers in time: a short retry usually gets through. With links the
            # DHT copy is only the fallback (the members already have our record): not worth a warning.
            logger.log(
                logging.INFO if self.client is not None else logging.WARNING,
                "the DHT refused our ready record for round %d (attempt %d)",
                mine.round_id,
                attempt + 1,
            )
            await asyncio.sleep(0.25 * 2**attempt)  # real time: the DHT's own speed
        return False

    async def _get(self, key: str, timeout: float | None = None, *, near: bool = False) -> dict[bytes, Any]:
        """The entries under `key`: a walk of the DHT (`latest=True`), or with `near` (and the membership's reads
        near their key) from a few of the key's replicas, as found by our store or read of it before
        (`dhtcall.get_near`; a walk when there is no such plan)."""
        timeout = dhtcall.DHT_CALL_TIMEOUT if timeout is None else timeout
        try:
            if near and self.membership.read_near:
                read = functools.partial(dhtcall.get_near, key=key, replan_every=self.membership.replan_every)
                result = await dhtcall.run_in_dht(self.dht, read, timeout=timeout)
            else:
                result = await dhtcall.call(
                    self.dht.get, key, latest=True, beam_size=dhtcall.READ_BEAM, timeout=timeout
                )
        except TimeoutError as exc:
            # No view of the round to decide on: the agent catches up from the others (as for a refused store).
            raise MatchmakingError(f"the DHT did not answer a read of {key} within {timeout:.0f} s") from exc
        return dht_entries(result)

    async def frozen_without(self, round_id: int, peer_id: str) -> bool:
        """Whether the DHT holds a group of round `round_id` (stored by one of its members) that leaves `peer_id`
        out: a node about to fetch the state that round started from asks it, since with that state it could
        only be late for the round. False when the DHT does not answer within FROZEN_READ_TIMEOUT (the fetch
        goes ahead, as without the question)."""
        key = round_key(self.run_name, round_id)
        try:
            group_raw, ready_raw = await asyncio.gather(
                self._get(f"{key}/group", FROZEN_READ_TIMEOUT), self._get(key, FROZEN_READ_TIMEOUT)
            )
        except MatchmakingError as exc:
            logger.info("round %d: could not read its group (%s)", round_id, exc)
            return False
        _, _, groups = self._parse_round(round_id, ready_raw, group_raw)
        return any(peer_id not in {m.peer_id for m in g.group.members} for g in groups)

    def _parse_round(
        self, round_id: int, ready_raw: Mapping[bytes, Any], group_raw: Mapping[bytes, Any]
    ) -> tuple[dict[str, ReadyRecord], dict[str, bytes], list[GroupRecord]]:
        """Round `round_id`'s ready records (with each peer id's owner key) and group records, as read from the
        DHT, kept only where a current member's key wrote them for itself (`_from_members`)."""
        key = round_key(self.run_name, round_id)
        now = self.clock.now()
        ready, owners = parse_ready(self._from_members(ready_raw, key, now), round_id)
        groups = parse_groups(self._from_members(group_raw, f"{key}/group", now), round_id, owners)
        return ready, owners, groups

    def _from_members(self, raw: Mapping[bytes, Any], key: str, now: float) -> dict[bytes, Any]:
        """The entries of `raw` signed by a current member's key and speaking for that member's peer id."""
        core = self.membership.core
        owners = core.owners(now)
        owners[self.membership.public_key] = owners.get(self.membership.public_key, "")
        kept = {}
        for owner, value in raw.items():
            claimed = value.get("peer_id", value.get("leader")) if isinstance(value, dict) else None
            peer_id = owners.get(owner)
            if peer_id and isinstance(value, dict) and "members" in value:
                # A group record speaks for its members: any of them may keep a copy (parse_groups checks it).
                members = value["members"] if isinstance(value["members"], list) else []
                if any(isinstance(m, list | tuple) and m and m[0] == peer_id for m in members):
                    claimed = peer_id
            if peer_id is None:
                core.ignore(
                    "NOT_A_MEMBER", owner, key, f"its key owns no live member record (claims {claimed!r:.80})"
                )
            elif peer_id and claimed != peer_id:
                core.ignore(
                    "PEER_ID_MISMATCH", owner, key, f"the key of member {peer_id} wrote for {claimed!r:.80}"
                )
            else:
                kept[owner] = value
        return kept

    async def _poll(
        self, round_id: int, view: _DHTView, wake: asyncio.Event, *, pushed_to: bool, leader_timeout: float
    ) -> None:
        """Read the round's ready and group records (and without links the member table), again and again, into
        `view`. `pushed_to`: the members' links reach us, so the first read can wait, and the reads after it
        back off, doubling up to `leader_timeout / 8` (class docstring)."""
        key = round_key(self.run_name, round_id)
        group_key = f"{key}/group"
        linked = self.client is not None
        interval = self.poll_interval if linked else self.min_poll_interval
        ceiling = self.poll_interval
        if linked and pushed_to:
            ceiling = max(self.poll_interval, leader_timeout / 8)
        rechecked: set[bytes] = set()  # unknown ready-record keys we already re-read the member table for
        if linked and pushed_to:
            await self.clock.sleep(self.poll_interval)
        while True:
            try:
                # Pushed to, the DHT only backs the links up: read near the round's keys, no walk.
                near = linked and pushed_to
                reads: list[Awaitable[Any]] = [self._get(group_key, near=near), self._get(key, near=near)]
                if not linked:
                    reads.append(self.membership.refresh())
                group_raw, ready_raw, *_ = await asyncio.gather(*reads)
                unknown = set(ready_raw) - self.membership.core.owners(self.clock.now()).keys() - rechecked
                if unknown:
                    # Maybe a member whose record reached us after our read of the table: look once more.
                    rechecked |= unknown
                    await self.membership.refresh()
            except MatchmakingError as exc:
                if self.client is None:
                    view.error = exc
                    wake.set()
                    return
                logger.warning("round %d: %s (the members' links carry on)", round_id, exc)
            else:
                view.ready, view.owners, view.groups = self._parse_round(round_id, ready_raw, group_raw)
                view.polls += 1
                wake.set()
            await self.clock.sleep(interval)
            interval = min(interval * 2, ceiling)

    # -- one round ----------------------------------------------------------------------------------------

    def _enter(self, round_id: int) -> asyncio.Event:
        self._current = max(self._current, round_id)
        for box in (self._ready_in, self._groups_in):
            for old in [r for r in box if r < self._current - _INBOX_BEHIND]:
                del box[old]
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    async def _wait(self, wake: asyncio.Event, seconds: float) -> None:
        """Until something arrives (a pushed message, a DHT read) or `seconds` pass on our clock."""
        if wake.is_set():
            return
        waiter = asyncio.ensure_future(wake.wait())
        sleeper = asyncio.ensure_future(self.clock.sleep(max(seconds, 0.0)))
        try:
            await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiter, sleeper):
                await cancel_and_wait(task)

    async def form_group(
        self,
        round_id: int,
        me: GroupMember,
        *,
        match_timeout: float,
        leader_timeout: float,
        match_timeout_min: float | None = None,
    ) -> Group:
        """Declare us ready for `round_id` and return the round's group; LateForRound if we are not in it.

        With `match_timeout_min`, the straggler wait we propose adapts to recent rounds (`StragglerWait`,
        between it and `match_timeout`); without, it is `match_timeout`.

        Precondition (what makes the early freeze safe): our member record already says `round_id`, and it
        moved there when our local work for the round started, not just now.
        """
        key = round_key(self.run_name, round_id)
        group_key = f"{key}/group"
        wake = self._enter(round_id)
        now = self.clock.now()
        wait = 0.0
        if match_timeout_min is not None:
            if self.straggler is None or (self.straggler.floor, self.straggler.ceiling) != (
                match_timeout_min,
                match_timeout,
            ):
                self.straggler = StragglerWait(match_timeout_min, match_timeout)
            wait = self.straggler.wait()
            if self._catching_up(round_id, self.membership.core.live(now), now, me.peer_id):
                # A member is fetching the swarm's state to join it: give it the whole match_timeout (its
                # transfer and first inner steps, not a straggler's spread). Without, a node that rejoined a
                # swarm of short rounds fetched round r, found the swarm at r+2, fetched again, forever.
                wait = match_timeout
        self.last_wait = wait or match_timeout
        live = self.membership.core.live(now)
        # The members we expect in the round, declared in our ready record: when every one of them declares the
        # same, each peer holding their records knows the group at once (rules.one_hop_sets). Never a set of us
        # alone: a peer whose member table is still empty would freeze by itself while others are in the round.
        expected = self._expected(round_id, live, now, me.peer_id) | {me.peer_id}
        # Members past this round before we are ready for it: no group of it can hold us and them.
        left_before_us = frozenset(
            r.peer_id for r in live if r.peer_id != me.peer_id and self.round_of(r, now) > round_id
        )
        mine = ReadyRecord(
            me.peer_id,
            me.address,
            round_id,
            float(now),
            wait,
            me.outer_hash,
            me.updates,
            expected_digest(expected) if 2 <= len(expected) <= MAX_GROUP else "",
        )
        # Records must outlive every candidate's window; a generous floor keeps them readable for late peers.
        expiration = now + max(60.0, 4 * (match_timeout + 8 * leader_timeout))
        linked = self.client is not None
        if not linked and not await self._store_ready(key, mine, expiration):
            raise MatchmakingError(f"the DHT refused our ready record for round {round_id} under {key}")
        pushed: set[str] = {me.peer_id}  # peers our ready record went to (or that we gave up on)
        stored = not linked  # our ready record's DHT copy is under way (without links: stored above)
        # The DHT copies are the links' fallback: they wait `copy_delay` (or a push of ours that failed), so
        # their stores do not take the cores the round's pushes need while it freezes (class docstring).
        copy_delay = self.copy_delay(leader_timeout)
        push_failed = asyncio.Event()
        dht = _DHTView({}, {}, [])
        poller = asyncio.ensure_future(
            self._poll(round_id, dht, wake, pushed_to=me.dialable, leader_timeout=leader_timeout)
        )
        try:
            while True:
                wake.clear()
                if dht.error is not None:
                    raise dht.error
                now = self.clock.now()
                live = self.membership.core.live(now)
                direct = self._ready_in.get(round_id, {})
                ready = {**dht.ready, **direct, me.peer_id: mine}
                if linked:
                    targets = self._link_targets(round_id, live, me.peer_id)
                    targets.update(
                        (p, r.address)
                        for p, r in ready.items()
                        if p != me.peer_id and r.address != NO_INBOUND
                    )
                    for peer_id, address in targets.items():
                        if peer_id not in pushed:
                            pushed.add(peer_id)
                            self._spawn(
                                self._push(
                                    address,
                                    READY_METHOD,
                                    RecordPush(mine).encode(),
                                    round_id,
                                    failed=push_failed,
                                )
                            )
                    if not stored:  # the DHT copy after the pushes, held back while the round freezes
                        stored = True
                        self._spawn(
                            self._after_freeze(
                                self._store_ready(key, mine, expiration), copy_delay, push_failed
                            )
                        )
                groups = list(dht.groups)
                groups += [g for g in self._groups_in.get(round_id, {}).values() if g.leader in ready]
                catching_up = self._catching_up(round_id, live, now, me.peer_id)
                self._knock_vanished(round_id, live, now, me.peer_id)
                view = RoundView(
                    now=now,
                    ready=ready,
                    groups=groups,
                    expected=self._expected(round_id, live, now, me.peer_id),
                    catching_up=catching_up,
                    ahead=frozenset(r.peer_id for r in live if self.round_of(r, now) > round_id),
                    leaving=frozenset(r.peer_id for r in live if r.state == "leaving"),
                    left_before_us=left_before_us,
                )
                decision = decide(
                    round_id, me, view, match_timeout=match_timeout, leader_timeout=leader_timeout
                )
                if isinstance(decision, Joined):
                    chosen = decision.record
                    assert chosen is not None
                    if decision.one_hop:
                        self.counters["one_hop"] += 1
                        # Every member derives the group itself: nothing to relay. Its two lowest peer ids (one
                        # survives either's death) push it to the others `copy_delay` later, so a member one of
                        # whose ready records is slow or lost has it then, not at its next DHT read; and keep a
                        # DHT copy, which tells peers the records missed that they are late.
                        if me.peer_id in [m.peer_id for m in decision.group.members[:2]]:
                            if linked and not any(g.group == decision.group for g in groups):
                                # after `copy_delay`: the others derive it from the same records meanwhile,
                                # and these pushes would take the cores their last record needs to reach them
                                self._relay(chosen, me, copy_delay)
                            self._spawn(
                                self._after_freeze(
                                    self._store(group_key, chosen.to_wire(), expiration), copy_delay
                                )
                            )
                    elif linked and chosen.leader != me.peer_id:
                        self._relay(chosen, me)
                        # A DHT copy under our key too: if the leader died having reached only us and our relays
                        # are lost, the next candidate must still see this group before its window opens, or it
                        # freezes a second one (tests/unit/test_matchmaking_links.py finds such rounds without it).
                        self._spawn(
                            self._after_freeze(
                                self._store(group_key, chosen.to_wire(), expiration), copy_delay
                            )
                        )
                    self.last_leader = chosen.leader
                    self._last_group = (round_id, {m.peer_id: m.address for m in decision.group.members})
                    self._sample(decision.group, view, match_timeout, leader_timeout, decision.one_hop)
                    return decision.group
                plan = schedule(view, match_timeout=match_timeout, leader_timeout=leader_timeout)
                early = isinstance(decision, Publish) and now < plan.freeze_at
                giving_up = isinstance(decision, Late) and not decision.group_formed
                # Acting on the deadline (a takeover, giving up): only on a view that includes the DHT's.
                # Without links, every decision waits for one (the DHT is then our only source).
                on_deadline = (isinstance(decision, Publish) and not early) or giving_up
                if (on_deadline or not linked) and dht.polls == 0 and not isinstance(decision, Wait):
                    await self._wait(wake, self.poll_interval)
                    continue
                if isinstance(decision, Late):
                    raise LateForRound(
                        round_id, me.peer_id, decision.reason, group_formed=decision.group_formed
                    )
                if isinstance(decision, Publish):
                    if await self._publish(decision.record, view, live, group_key, expiration):
                        self.last_leader = me.peer_id
                        self._last_group = (
                            round_id,
                            {m.peer_id: m.address for m in decision.record.group.members},
                        )
                        self._sample(decision.record.group, view, match_timeout, leader_timeout)
                        return decision.record.group
                    await self._wait(wake, self.min_poll_interval)
                    continue
                await self._wait(wake, decision.until - now)
        finally:
            await cancel_and_wait(poller)

    def _sample(
        self,
        group: Group,
        view: RoundView,
        match_timeout: float,
        leader_timeout: float,
        one_hop: bool = False,
    ) -> None:
        self.last_one_hop = one_hop
        readies = [view.ready[m.peer_id].ready_at for m in group.members if m.peer_id in view.ready]
        # A member whose ready record we never saw (the group reached us through its leader) is left out.
        self.last_freeze_seconds = max(0.0, self.clock.now() - max(readies)) if readies else None
        if self.straggler is not None:
            plan = schedule(view, match_timeout=match_timeout, leader_timeout=leader_timeout)
            self.straggler.observe(spread_sample(group, view, plan))

    def _relay(self, record: GroupRecord, me: GroupMember, delay: float = 0.0) -> None:
        """Pass the group on once to its other members (the leader may have reached only some), after `delay`
        seconds (real time)."""
        self.counters["relayed"] += 1
        header = RecordPush(record).encode()
        for member in record.group.members:
            if member.peer_id not in (me.peer_id, record.leader) and member.dialable:
                push = self._push(member.address, GROUP_METHOD, header, record.group.round_id)
                self._spawn(self._after_freeze(push, delay) if delay > 0 else push)

    async def _publish(
        self, record: GroupRecord, view: RoundView, live: Sequence[Any], group_key: str, expiration: float
    ) -> bool:
        """Deliver our group to its members; True once it is ours (delivered to all, or stored in the DHT)."""
        round_id = record.group.round_id
        logger.info(
            "round %d: publishing a group of %d (ready %s, expected %s, ahead %s, live %s)",
            round_id,
            len(record.group.members),
            sorted(p[:8] for p in view.ready),
            sorted(p[:8] for p in view.expected),
            sorted(p[:8] for p in view.ahead),
            [(r.peer_id[:8], r.round_id, r.state, round(view.now - r.heartbeat, 2)) for r in live],
        )
        # Members behind NAT take the group from the DHT copy (they poll it): it is stored in every case.
        others = [m for m in record.group.members if m.peer_id != record.leader and m.dialable]
        if self.client is not None and others:
            header = RecordPush(record).encode()
            delivered = await asyncio.gather(
                *(self._push(m.address, GROUP_METHOD, header, round_id) for m in others)
            )
            self._file(self._groups_in, round_id, record.leader, record)
            if any(delivered):
                # Those we reached relay it to the rest; the DHT copy is for late readers.
                self._spawn(self._store(group_key, record.to_wire(), expiration))
                return True
        if await self._store(group_key, record.to_wire(), expiration):
            return True
        logger.warning("the DHT refused our group record for round %d; retrying", round_id)
        return False
