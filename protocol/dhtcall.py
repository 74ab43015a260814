"""Calling hivemind's DHT from asyncio: every call bounded, cancellable, and retried until a deadline.

hivemind's `DHT.store/get(..., return_future=True)` return an `MPFuture` that a background thread of hivemind's
resolves when the DHT process answers. Awaiting that future directly, or through `asyncio.wait_for`, is unsafe:
- The MPFuture remembers the event loop it was made on. If it is resolved while that loop is not running (between
  two `run_until_complete` calls, as during `asyncio.run`'s clean-up, which is exactly when a timed-out or
  cancelled call's late answer tends to arrive), hivemind's thread calls `run_until_complete` on *our* loop from
  its own thread. The loop's callbacks then run in the wrong thread, a wake-up can be lost, and a task waiting on
  it never runs again: `asyncio.run` then waits for it forever.
- Cancelling the task that awaits it (a timeout, a shutdown) leaves the MPFuture pending in the DHT process.

`call()` therefore detaches each MPFuture from hivemind's loop machinery at once (it becomes a plain
`concurrent.futures.Future`, resolved by hivemind's thread), bridges its result into an asyncio future with
`loop.call_soon_threadsafe` (safe whatever state the loop is in, a no-op once it is closed), bounds the wait, and
cancels the MPFuture when the wait ends early. A cancelled or timed-out `call()` returns at once.

`retry()` runs an operation that must eventually succeed (a member record, a tombstone) with jittered
exponential back-off until a deadline, logging what it waits for; only a refusal that outlasts the deadline
raises, as `DHTRefusedError` naming the key, the attempts and the time spent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A guard, in real seconds, on each awaited hivemind call: hivemind's own requests time out sooner (its
# wait_timeout), but a future that never resolves would otherwise freeze the caller for good.
DHT_CALL_TIMEOUT = 30.0
# Each attempt of a retried operation waits at least this long for its answer (hivemind's own per-request
# timeout, wait_timeout, is 8 s in farloco's DHT nodes), at most DHT_CALL_TIMEOUT.
MIN_CALL_TIMEOUT = 10.0
FIRST_DELAY = 0.25
MAX_DELAY = 4.0
# A failed attempt is logged at once, then at most every this many seconds while retries go on.
LOG_EVERY = 10.0


# How many of the key's nearest nodes a read (`get(..., latest=True)`) keeps in its walk: hivemind's default is its
# bucket size (20), and every node visited answers with the whole value, so a read of a dictionary of N records cost
# up to 20 N. A store puts its copies on the `num_replicas` (5) nearest nodes; 8 reads those and a few more for
# a storer whose view of the nearest differed.
READ_BEAM = 8

# What farloco's DHT nodes turn off of hivemind's caching (keyword arguments of `DHTNode.create`, which
# `hivemind.DHT` passes on). farloco reads its keys itself, on its own schedule (the member table every
# member_ttl/4, a round's records while it forms), always with latest=True, so neither pays:
# - cache_refresh_before_expiry (hivemind: 5 s): a node that read a key reads it again in the background before
#   the earliest of its cached entries expires. The member table's entries are renewed every heartbeat, so each
#   node walked the DHT for the whole table every few seconds, and again for every round key it had read.
# - cache_nearest (hivemind: 1): after a read, the value found (the whole dictionary) is stored on the nearest
#   node that did not hold it, one more store of every record per read.
# At 32 protocol peers on 2 cores (benchmarks/protocol_scale.py) a round took about half the time without them.
DHT_NODE_OPTIONS: dict[str, Any] = {"cache_refresh_before_expiry": 0, "cache_nearest": 0}


class DHTRefusedError(Exception):
    """A DHT operation kept failing until its deadline; the message names the key, attempts and time spent."""

    def __init__(self, key: str, what: str, attempts: int, seconds: float, hint: str) -> None:
        super().__init__(
            f"the DHT refused {what} under {key} for {seconds:.1f} s ({attempts} attempts): {hint}"
        )
        self.key = key
        self.what = what
        self.attempts = attempts
        self.seconds = seconds


class _AlreadySet:
    """Stands in for an MPFuture's asyncio.Event: 'already set', so hivemind never wakes a loop for it."""

    def is_set(self) -> bool:
        return True

    def set(self) -> None:
        pass


def _detach(future: Any) -> None:
    """Make a hivemind MPFuture a plain concurrent future: it no longer touches any asyncio loop itself.

    MPFuture (hivemind 1.1) keeps an asyncio.Event to wake `await future`, and its state setter, in hivemind's
    thread, wakes the loop only while that event is not set. One attribute store replaces it with one that
    is always set, so whichever event the thread reads, it never runs our loop (the old one can only be read
    while the loop is still running this very call). We never `await` the MPFuture itself.
    """
    if hasattr(future, "_aio_event"):
        future._aio_event = _AlreadySet()


async def await_future(future: concurrent.futures.Future[T], timeout: float, *, cancel: bool = True) -> T:
    """Wait at most `timeout` seconds for a future resolved by another thread; TimeoutError after that.

    The wait is cancellable at any point, and an unfinished `future` is cancelled when the wait ends early (with
    `cancel`; without, it is left to finish unheard).
    """
    _detach(future)
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def settle(source: concurrent.futures.Future[T]) -> None:
        if waiter.done():
            return
        if source.cancelled():
            waiter.cancel()
        elif source.exception() is not None:
            waiter.set_exception(source.exception())  # type: ignore[arg-type]
        else:
            waiter.set_result(source.result())

    def resolved(source: concurrent.futures.Future[T]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for this answer any more
            loop.call_soon_threadsafe(settle, source)

    future.add_done_callback(resolved)

    def expire() -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError(f"the DHT did not answer within {timeout:g} s"))

    # A timer, not asyncio.wait_for: before Python 3.12 wait_for swallows a cancellation that arrives in the
    # turn its future completes (util/tasks.py wait_for), and a cancelled heartbeat then ran on.
    timer = loop.call_later(timeout, expire)
    try:
        return await waiter
    finally:
        timer.cancel()
        if cancel and not future.done():
            future.cancel()


async def call(method: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
    """`method(*args, **kwargs, return_future=True)` (a hivemind DHT call), awaited for at most `timeout`
    seconds (default DHT_CALL_TIMEOUT); TimeoutError after that."""
    future = method(*args, **kwargs, return_future=True)
    return await await_future(future, DHT_CALL_TIMEOUT if timeout is None else timeout)


async def run_in_dht(dht: Any, coroutine: Callable[..., Any], *, timeout: float | None = None) -> Any:
    """`dht.run_coroutine(coroutine)` (run in the DHT's process: `store_near`, `get_near`, `reach_peers`),
    awaited for at most `timeout` seconds (default DHT_CALL_TIMEOUT); TimeoutError after that.

    A wait that ends early does not cancel the coroutine's future: hivemind's DHT process sets its result
    without checking, and a cancelled one made it log a traceback (InvalidStateError) whenever a node left while
    a store or read near a key was in flight. Each such coroutine is bounded on its own (STORE_NEAR_WAIT,
    hivemind's wait_timeout), so it ends unheard."""
    future = dht.run_coroutine(coroutine, return_future=True)
    return await await_future(future, DHT_CALL_TIMEOUT if timeout is None else timeout, cancel=False)


async def retry(
    attempt: Callable[[float], Awaitable[bool]],
    *,
    deadline: float,
    key: str,
    what: str,
    hint: str,
) -> int:
    """Run `attempt(call_timeout)` until it returns True; back off between tries; give up at `deadline`.

    `deadline` is a `time.monotonic()` value; at least one attempt is made even if it has passed. Each attempt
    gets `call_timeout`: the time left, at least MIN_CALL_TIMEOUT and at most DHT_CALL_TIMEOUT. Returns the
    number of attempts; raises DHTRefusedError after the deadline. A TimeoutError from an attempt counts as a
    refusal.
    """
    started = time.monotonic()
    attempts = 0
    delay = FIRST_DELAY
    last_log = -float("inf")
    while True:
        attempts += 1
        left = deadline - time.monotonic()
        try:
            ok = await attempt(min(DHT_CALL_TIMEOUT, max(MIN_CALL_TIMEOUT, left)))
        except TimeoutError:
            ok = False
        if ok:
            if attempts > 1:
                logger.info(
                    "the DHT took %s under %s after %d attempts (%.1f s)",
                    what,
                    key,
                    attempts,
                    time.monotonic() - started,
                )
            return attempts
        now = time.monotonic()
        if now >= deadline:
            raise DHTRefusedError(key, what, attempts, now - started, hint)
        if now - last_log >= LOG_EVERY:
            last_log = now
            logger.warning(
                "the DHT refused %s under %s (attempt %d); retrying for up to %.0f s more",
                what,
                key,
                attempts,
                deadline - now,
            )
        # The last try comes at the deadline itself.
        await asyncio.sleep(min(delay * random.uniform(0.8, 1.2), deadline - now))
        delay = min(2 * delay, MAX_DELAY)


# --------------------------------------------------------------------------------------------- stores near


# In the DHT's process: (node, key) -> (when the replicas were found, monotonic; the nodes that hold the key's
# copies, nearest first; how long the plan is used). The DHT process is the agent's own fork, so this table
# lives as long as its node; plans past their use are dropped once it holds PLANS_KEPT (a round's keys get one
# each, and rounds never end).
_REPLICAS: dict[tuple[int, bytes], tuple[float, list[Any], float]] = {}
PLANS_KEPT = 64
_IN_FLIGHT: set[asyncio.Future[Any]] = set()
# How long a store near the key waits for its replicas' answers (the rest are not waited for).
STORE_NEAR_WAIT = 2.0


async def store_near(
    _dht: Any,
    node: Any,
    *,
    key: str,
    value: Any,
    expiration: float,
    subkey: Any,
    replan_every: float,
) -> bool:
    """Store `value` under (`key`, `subkey`) on the nodes that hold the key: run in the DHT's process
    (`dht.run_coroutine(functools.partial(store_near, key=..., ...))`, `node` is its hivemind DHTNode).

    hivemind's store walks the DHT to the key's nearest nodes every time, and every node asked on the way answers
    with the whole value it holds there: for a key whose value is a dictionary of every member's record (the
    member table), each store pulled the table from several nodes, validating every entry's signature, so a
    heartbeat cost grew with the swarm. Here a full store (with its walk) runs once per `replan_every` seconds
    and finds the key's replicas; the stores in between go straight to those replicas (and to our own storage
    when we are one of them): a heartbeat costs one record per replica, whatever the swarm's size. A plan older
    than `replan_every`, or one whose replicas mostly did not answer, is made again by a full store: a node that
    joined nearer the key is found within one `replan_every`. Returns whether a replica took the entry (hivemind's
    store reports the last replica's answer; any one is enough for the record to be read)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    key_id = DHTID.generate(source=key)
    slot = (id(node), key_id.to_bytes())
    now = time.monotonic()
    plan = _REPLICAS.get(slot)
    if plan is None or now - plan[0] >= replan_every:
        rejoin_initial_peers(_dht, node, replan_every)
        ok = bool(await node.store(key, value, expiration, subkey=subkey))
        _remember(slot, _nearest(node, key_id), replan_every)
        return ok
    protocol = node.protocol
    serializer = protocol.serializer
    record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), serializer.dumps(value), expiration)
    if protocol.record_validator is not None:
        record = DHTRecord(
            record.key, record.subkey, protocol.record_validator.sign_value(record), expiration
        )
    stored = False
    remote = []
    for node_id, peer_id in plan[1]:
        if node_id == node.node_id:
            if protocol.record_validator is None or protocol.record_validator.validate(record):
                stored = (
                    bool(protocol.storage.store(key_id, record.value, expiration, subkey=subkey)) or stored
                )
        else:
            remote.append(peer_id)
    tasks = [
        asyncio.ensure_future(protocol.call_store(peer, [key_id], [record.value], expiration, [subkey]))
        for peer in remote
    ]
    done: set[asyncio.Future[Any]] = set()
    if tasks:
        # A replica that is gone costs hivemind's wait_timeout (8 s in farloco's nodes): the heartbeat does not
        # wait for it. What is still pending runs on, held here so that it is not collected mid-flight.
        done, pending = await asyncio.wait(tasks, timeout=STORE_NEAR_WAIT)
        for task in pending:
            _IN_FLIGHT.add(task)
            task.add_done_callback(_IN_FLIGHT.discard)
    answered = [task.result() for task in done if not task.cancelled() and task.exception() is None]
    answered = [answer for answer in answered if answer is not None]
    if 2 * len(answered) < len(remote):
        _REPLICAS.pop(slot, None)  # most replicas did not answer: the next store walks the DHT again
    return stored or any(bool(answer and answer[0]) for answer in answered)


# In the DHT's process: id(node) -> when `rejoin_initial_peers` last looked at its routing table (monotonic).
_REJOIN_LOOKED: dict[int, float] = {}
REJOIN_TIMEOUT = 4.0  # per dial and ping of an initial peer


def rejoin_initial_peers(dht: Any, node: Any, every: float) -> int:
    """Ping back into `node`'s routing table the initial peers (`dht.initial_peers`, hivemind's) it lost; at most
    once per `every` seconds per node, in the background. Returns how many it tries.

    hivemind drops a node from the routing table when a request to it goes unanswered and re-adds it only when
    the two talk again, so a node whose requests all timed out (a loaded machine, a cut link) walks among what
    it has left, for good: its stores stay there and its member table holds what it holds. The initial peers are
    how a node found the swarm at start; one that answers again is a way back, and the walk after it finds the
    rest. A plan's walk (`store_near`, `get_near`) calls this first."""
    initial = getattr(dht, "initial_peers", None)
    now = time.monotonic()
    if not initial or now - _REJOIN_LOOKED.get(id(node), -math.inf) < every:
        return 0
    _REJOIN_LOOKED[id(node)] = now
    table = node.protocol.routing_table
    lost = {peer: addrs for peer, addrs in peers_of(initial, node.peer_id).items() if peer not in table}

    async def ping(peer: Any, addresses: list[Any]) -> None:
        with contextlib.suppress(Exception):  # unreachable now: the next look tries again
            await dial_and_ping(node, peer, addresses, REJOIN_TIMEOUT)

    for peer, addresses in lost.items():
        task = asyncio.ensure_future(ping(peer, addresses))
        _IN_FLIGHT.add(task)
        task.add_done_callback(_IN_FLIGHT.discard)
    if lost:
        logger.info("the DHT routing table lost %d initial peer(s): pinging them back", len(lost))
    return len(lost)


def peers_of(maddrs: Any, me: Any = None) -> dict[Any, list[Any]]:
    """hivemind PeerID -> its addresses (without the /p2p/ part), from multiaddrs that end in /p2p/<peer id>;
    malformed ones and `me` are left out."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    by_peer: dict[Any, list[Any]] = {}
    for text in maddrs:
        try:
            maddr = Multiaddr(str(text))
            peer = PeerID.from_base58(maddr["p2p"])
        except Exception:  # an address without /p2p/ or malformed: nothing to dial
            continue
        by_peer.setdefault(peer, []).append(maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}")))
    by_peer.pop(me, None)
    return by_peer


async def dial_and_ping(node: Any, peer: Any, addresses: list[Any], timeout: float) -> bool:
    """Dial `peer` at `addresses` through `node`'s libp2p daemon, then ping it: an answer puts it (back) in the
    routing table (hivemind's update_routing_table). Each step bounded by `timeout`; True if it answered."""
    from farloco.util.tasks import wait_for

    with contextlib.suppress(Exception):  # unreachable now: the ping below says so
        await wait_for(node.p2p._client.connect(peer, addresses), timeout)
    return await wait_for(node.protocol.call_ping(peer), timeout) is not None


# How many of the key's replicas a read near the key asks (besides our own storage when we are one of them).
READ_NEAR_REPLICAS = 2


async def get_near(_dht: Any, node: Any, *, key: str, replan_every: float) -> Any:
    """Read the dictionary under `key` from the nodes that hold it: run in the DHT's process, like `store_near`
    (whose plan of the key's replicas it shares). Returns what `node.get(key, latest=True)` returns.

    A read with latest=True walks the DHT to the key's nearest nodes, READ_BEAM of them, and every node asked on
    the way answers with the whole dictionary it holds: for the member table, each read cost N records from
    each of up to 8 nodes and the walk's extra hops. Every member stores its record on each of the key's
    replicas (`store_near`), so any one of them holds nearly the whole table: this asks the READ_NEAR_REPLICAS
    nearest of the plan (and our own storage when we are a replica) and merges what they hold, newest entry per
    sub-key, as hivemind's read does. Without a plan younger than `replan_every`, or when none of the replicas
    asked answers, it reads with the full walk (which finds the replicas again)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.timed_storage import ValueWithExpiration

    key_id = DHTID.generate(source=key)
    slot = (id(node), key_id.to_bytes())
    plan = _REPLICAS.get(slot)

    async def walk() -> Any:
        rejoin_initial_peers(_dht, node, replan_every)
        result = await node.get(key, latest=True, beam_size=READ_BEAM)
        _remember(slot, _nearest(node, key_id), replan_every)
        return result

    if plan is None or time.monotonic() - plan[0] >= replan_every:
        return await walk()
    protocol = node.protocol
    merged = DictionaryDHTValue()

    def take(value: Any) -> None:
        if isinstance(value, DictionaryDHTValue):
            for subkey, entry in value.items():
                merged.store(subkey, entry.value, entry.expiration_time)

    remote = [peer_id for node_id, peer_id in plan[1] if node_id != node.node_id][:READ_NEAR_REPLICAS]
    if any(node_id == node.node_id for node_id, _ in plan[1]):
        local = protocol.storage.get(key_id)
        take(local.value if local is not None else None)
    tasks = [asyncio.ensure_future(protocol.call_find(peer, [key_id])) for peer in remote]
    done: set[asyncio.Future[Any]] = set()
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=STORE_NEAR_WAIT)
        for task in pending:
            task.cancel()
    answers = [task.result() for task in done if not task.cancelled() and task.exception() is None]
    answers = [answer for answer in answers if answer is not None]
    if remote and not answers:
        _REPLICAS.pop(slot, None)  # no replica answered: walk, and find them again
        return await walk()
    for answer in answers:
        found_value = answer.get(key_id, (None, {}))[0]
        take(found_value.value if found_value is not None else None)
    if len(merged) == 0:
        return None
    serializer = protocol.serializer
    entries = {}
    for subkey, (value_bytes, expiration) in merged.items():
        if protocol.record_validator is not None:
            record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value_bytes, expiration)
            value_bytes = protocol.record_validator.strip_value(record)
        entries[subkey] = ValueWithExpiration(serializer.loads(value_bytes), expiration)
    return ValueWithExpiration(entries, merged.latest_expiration_time)


def _remember(slot: tuple[int, bytes], nodes: list[Any], keep_for: float) -> None:
    """Keep `nodes` as the plan of `slot` for `keep_for` seconds; drop the plans past their use first when the
    table is full."""
    now = time.monotonic()
    if len(_REPLICAS) >= PLANS_KEPT:
        for old in [s for s, (found, _, kept) in _REPLICAS.items() if now - found >= kept]:
            del _REPLICAS[old]
    _REPLICAS[slot] = (now, nodes, keep_for)


def _nearest(node: Any, key_id: Any) -> list[Any]:
    """The key's replicas as hivemind's walk chose them: the num_replicas nearest of what `node` knows,
    itself included, nearest first."""
    mine = node.protocol.routing_table.get_nearest_neighbors(
        key_id, k=node.num_replicas, exclude=node.node_id
    )
    ranked = sorted([*mine, (node.node_id, None)], key=lambda item: key_id.xor_distance(item[0]))
    return ranked[: node.num_replicas]


def forget_replicas() -> None:
    """Drop every remembered replica set and rejoin look (tests; a DHT process restarted in place)."""
    _REPLICAS.clear()
    _REJOIN_LOOKED.clear()
