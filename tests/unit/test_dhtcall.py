"""dhtcall: hivemind futures awaited safely (bounded, cancellable, never running our loop from another thread),
and retries until a deadline; FlakyDHT's fault specs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from typing import Any

import pytest
from hivemind.utils.mpfuture import MPFuture

from farloco.node.faults import FlakyDHT, parse_dht_faults
from farloco.protocol import dhtcall


def _resolve_while_stopped(await_it: Any) -> tuple[list[str], Any]:
    """Start awaiting an MPFuture, stop the loop (as between two run_until_complete calls of asyncio.run's
    clean-up), resolve the future from another thread, then finish the wait. Returns the names of threads
    other than ours that ran the loop, and what the wait returned."""
    loop = asyncio.new_event_loop()

    async def start() -> tuple[MPFuture[int], asyncio.Future[Any]]:
        future: MPFuture[int] = MPFuture()
        task = asyncio.ensure_future(await_it(future))
        await asyncio.sleep(0)
        return future, task

    try:
        future, task = loop.run_until_complete(start())
        foreign: list[str] = []
        real = loop.run_until_complete

        def spy(*args: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                foreign.append(threading.current_thread().name)
            return real(*args)

        loop.run_until_complete = spy  # type: ignore[method-assign]
        resolver = threading.Thread(target=future.set_result, args=(42,), name="hivemind-like")
        resolver.start()
        resolver.join()
        return foreign, real(asyncio.wait_for(task, 5))
    finally:
        loop.close()


def test_hivemind_runs_a_stopped_loop_from_its_own_thread_and_dhtcall_never_lets_it() -> None:
    """Why dhtcall exists: an MPFuture resolved while its loop is stopped makes the resolving thread run that
    loop (the hazard behind a clean-up that hung for good); a future awaited through dhtcall does not."""
    foreign, value = _resolve_while_stopped(lambda future: asyncio.wait_for(future, 30))
    assert foreign == ["hivemind-like"] and value == 42
    foreign, value = _resolve_while_stopped(lambda future: dhtcall.await_future(future, 30))
    assert foreign == [] and value == 42


def test_a_cancelled_or_timed_out_wait_returns_at_once_and_cancels_the_future() -> None:
    async def main() -> None:
        never: concurrent.futures.Future[int] = concurrent.futures.Future()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await dhtcall.await_future(never, 0.1)
        assert time.monotonic() - started < 1.0 and never.cancelled()
        other: concurrent.futures.Future[int] = concurrent.futures.Future()
        task = asyncio.ensure_future(dhtcall.await_future(other, 30))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert other.cancelled()
        # An answer that comes after the loop is gone is dropped quietly.
        late: concurrent.futures.Future[int] = concurrent.futures.Future()
        with pytest.raises(TimeoutError):
            await dhtcall.await_future(late, 0.01)

    asyncio.run(main())


def test_an_exception_from_the_dht_reaches_the_caller() -> None:
    async def main() -> None:
        failed: concurrent.futures.Future[int] = concurrent.futures.Future()
        threading.Timer(0.05, failed.set_exception, args=(KeyError("boom"),)).start()
        with pytest.raises(KeyError, match="boom"):
            await dhtcall.await_future(failed, 5)

    asyncio.run(main())


def test_retry_backs_off_until_success_and_raises_naming_the_key_after_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dhtcall, "FIRST_DELAY", 0.01)
    monkeypatch.setattr(dhtcall, "MAX_DELAY", 0.05)
    answers = [False, False, TimeoutError(), True]
    timeouts: list[float] = []

    async def flaky(timeout: float) -> bool:
        timeouts.append(timeout)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def never(timeout: float) -> bool:
        return False

    async def main() -> None:
        attempts = await dhtcall.retry(
            flaky, deadline=time.monotonic() + 10, key="farloco/x/members", what="a record", hint="look"
        )
        assert attempts == 4
        assert all(dhtcall.MIN_CALL_TIMEOUT <= t <= dhtcall.DHT_CALL_TIMEOUT for t in timeouts)
        started = time.monotonic()
        with pytest.raises(dhtcall.DHTRefusedError) as caught:
            await dhtcall.retry(
                never,
                deadline=started + 0.3,
                key="farloco/x/members",
                what="a record",
                hint="check the peers",
            )
        assert 0.2 < time.monotonic() - started < 1.0
        error = caught.value
        assert error.key == "farloco/x/members" and error.attempts > 3
        assert "farloco/x/members" in str(error) and "check the peers" in str(error)
        # A deadline already past still gets one attempt.
        assert (
            await dhtcall.retry(
                lambda timeout: asyncio.sleep(0, True), deadline=0.0, key="k", what="w", hint="h"
            )
            == 1
        )

    asyncio.run(main())


def test_flaky_dht_refuses_the_stores_it_is_told_to_and_passes_the_rest_through() -> None:
    class Real:
        def store(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
            future: concurrent.futures.Future[bool] = concurrent.futures.Future()
            future.set_result(True)
            return future

        def get(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
            return "got"

        def run_coroutine(self, coro: Any, return_future: bool = False) -> Any:
            return self.store(return_future=return_future) if coro.func is dhtcall.store_near else "ran"

        peer_id = "me"

    flaky = FlakyDHT(Real(), **parse_dht_faults("corrupt-theta@2, dht-refuse-stores=2"))
    results = [flaky.store("k", 1, 2.0, return_future=True).result() for _ in range(4)]
    assert results == [False, False, True, True] and flaky.refused == 2 and flaky.stores == 4
    # a member record stored near its key (`store_near`, in the DHT's process) is a store like any other
    near = functools.partial(
        dhtcall.store_near, key="k", value=1, expiration=2.0, subkey=b"me", replan_every=8
    )
    other = functools.partial(print, "not a store")
    refusing = FlakyDHT(Real(), **parse_dht_faults("dht-refuse-stores=1"))
    assert refusing.run_coroutine(near, return_future=True).result() is False
    assert refusing.run_coroutine(near, return_future=True).result() is True
    assert refusing.run_coroutine(other, return_future=True) == "ran" and refusing.stores == 2
    assert flaky.peer_id == "me" and flaky.get("k", return_future=True) == "got"
    silent = FlakyDHT(Real(), **parse_dht_faults("dht-silent-after=0"))
    assert not silent.store("k", 1, 2.0, return_future=True).done()
    assert not silent.run_coroutine(near, return_future=True).done()
    assert not silent.run_coroutine(other, return_future=True).done()
    assert not silent.get("k", return_future=True).done()
    timed = FlakyDHT(Real(), **parse_dht_faults("dht-refuse-stores-for=60"))
    assert timed.store("k", 1, 2.0, return_future=True).result() is False
    with pytest.raises(ValueError, match="dht-refuse-stores=N"):
        parse_dht_faults("dht-refuse-stores=many")
    with pytest.raises(ValueError, match="dht-oops"):
        parse_dht_faults("dht-oops=1")


def test_a_cancellation_arriving_as_the_answer_does_is_never_swallowed() -> None:
    """Before Python 3.12, asyncio.wait_for returned the result when the caller was cancelled in the loop turn
    its future completed, and the caller ran on as if never cancelled (a cancelled heartbeat loop kept
    publishing after remove()). Neither dhtcall.await_future nor tasks.wait_for may do that."""
    from farloco.util import tasks

    async def body(wait: Any, future: Any) -> str:
        await wait(future)
        return "ran on after being cancelled"

    async def main(wait: Any, make: Any) -> None:
        future = make()
        caller = asyncio.ensure_future(body(wait, future))
        await asyncio.sleep(0)  # the caller waits on the future
        future.set_result(1)  # the answer lands ...
        caller.cancel()  # ... in the same turn as the cancellation
        with pytest.raises(asyncio.CancelledError):
            await caller

    loop_future = lambda: asyncio.get_running_loop().create_future()  # noqa: E731
    asyncio.run(main(lambda f: tasks.wait_for(f, 10.0), loop_future))
    asyncio.run(main(lambda f: dhtcall.await_future(f, 10.0), concurrent.futures.Future))

    # The timeout still works, and cancels what it waited for.
    async def slow() -> None:
        inner = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(TimeoutError):
            await tasks.wait_for(inner, 0.05)
        assert inner.cancelled()

    asyncio.run(slow())


@pytest.mark.dht
async def signed_nodes(count: int) -> tuple[list[Any], list[Any]]:
    """`count` real hivemind DHT nodes in this process on 127.0.0.1, each signing with a key of its own: (signers,
    nodes)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.node import DHTNode
    from hivemind.utils.crypto import RSAPrivateKey

    signers = [RSASignatureValidator(RSAPrivateKey()) for _ in range(count)]
    nodes: list[Any] = []
    for signer in signers:
        initial = [str(m) for m in await nodes[0].p2p.get_visible_maddrs()] if nodes else []
        nodes.append(
            await DHTNode.create(
                initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validator=signer
            )
        )
    return signers, nodes


async def shut_down(nodes: list[Any]) -> None:
    """Forget the replica plans and stop `nodes`, leaving no task of farloco's behind."""
    dhtcall.forget_replicas()
    for node in nodes:
        await node.shutdown()
    await asyncio.sleep(0.1)  # the stores that were not waited for end with their replicas' shutdown
    # hivemind's DHTNode leaves one bare asyncio.sleep task behind after its shutdown (a timer of its walks, plain
    # hivemind does it too): its own, cancelled so the hygiene check sees what farloco left
    for task in asyncio.all_tasks() - {asyncio.current_task()}:
        if task.get_coro().__qualname__ == "sleep":  # type: ignore[union-attr]
            task.cancel()


def test_a_store_near_the_key_walks_the_dht_once_per_plan_then_goes_straight_to_the_replicas() -> None:
    """Real hivemind DHT nodes in this process: the first store walks the DHT (and finds the replicas), the next
    ones are signed, sent to those replicas only and read back elsewhere; a plan whose replicas are gone, or that
    is older than replan_every, is made again by a walk."""
    from hivemind.utils.timed_storage import get_dht_time

    async def main() -> None:
        signers, nodes = await signed_nodes(3)
        walks: list[str] = []
        a, owner = nodes[0], signers[0].local_public_key
        real_store = a.store

        async def counted(*args: Any, **kwargs: Any) -> Any:
            walks.append("walk")
            return await real_store(*args, **kwargs)

        a.store = counted

        async def store(value: int, replan_every: float = 60.0) -> bool:
            return await dhtcall.store_near(
                None, a, key="farloco/t/members", value={"v": value}, expiration=get_dht_time() + 60,
                subkey=owner, replan_every=replan_every,
            )  # fmt: skip

        try:
            assert await store(1) and len(walks) == 1
            for value in (2, 3, 4):
                assert await store(value)
            assert len(walks) == 1  # straight to the replicas
            read = await nodes[2].get("farloco/t/members", latest=True)
            assert read is not None and read.value[owner].value == {"v": 4}  # signed: the reader validated it
            assert await store(5, replan_every=0.0) and len(walks) == 2  # a plan older than replan_every
            while len(nodes) > 1:
                await nodes.pop().shutdown()
            assert await store(6)  # ourselves still a replica; the others did not answer...
            assert len(walks) == 2
            assert await store(7) and len(walks) == 3  # ...so the next store walks the DHT again
        finally:
            await shut_down(nodes)

    asyncio.run(main())


def test_a_read_near_the_key_asks_a_few_replicas_and_merges_their_entries_without_a_walk() -> None:
    """Real hivemind DHT nodes in this process, each storing its own signed entry under one key near it: a node
    whose plan is fresh reads the whole dictionary from READ_NEAR_REPLICAS replicas (and its own storage)
    without walking the DHT, each entry validated and stripped of its signature as hivemind's read returns it,
    the newest one per sub-key; a stale plan, or replicas that do not answer, mean a walk."""
    from hivemind.utils.timed_storage import get_dht_time

    key = "farloco/t/members"

    async def main() -> None:
        signers, nodes = await signed_nodes(4)
        a = nodes[0]
        walks: list[str] = []
        real_get = a.get

        async def counted(*args: Any, **kwargs: Any) -> Any:
            walks.append("walk")
            return await real_get(*args, **kwargs)

        a.get = counted

        async def store(index: int, value: int) -> bool:
            return await dhtcall.store_near(
                None, nodes[index], key=key, value={"v": value}, expiration=get_dht_time() + 60,
                subkey=signers[index].local_public_key, replan_every=60.0,
            )  # fmt: skip

        def values(result: Any) -> dict[bytes, Any]:
            return {subkey: item.value for subkey, item in result.value.items()}

        try:
            for index in range(4):
                assert await store(index, index)
            expected = {s.local_public_key: {"v": i} for i, s in enumerate(signers)}
            read = await dhtcall.get_near(None, a, key=key, replan_every=60.0)
            assert walks == [] and values(read) == expected  # the plan of a's store: no walk
            assert await store(2, 20) and await store(2, 21)  # a newer entry of node 2's: the newest wins
            read = await dhtcall.get_near(None, a, key=key, replan_every=60.0)
            assert values(read)[signers[2].local_public_key] == {"v": 21} and walks == []
            # a plan older than replan_every
            read = await dhtcall.get_near(None, a, key=key, replan_every=0.0)
            assert walks == ["walk"] and values(read) == {**expected, signers[2].local_public_key: {"v": 21}}
            never = await dhtcall.get_near(None, a, key="farloco/t/nothing", replan_every=60.0)
            assert never is None and len(walks) == 2  # no plan for that key: a walk, which found nothing
            while len(nodes) > 1:
                await nodes.pop().shutdown()
            read = await dhtcall.get_near(None, a, key=key, replan_every=60.0)
            assert len(walks) == 3  # the replicas asked did not answer: a walk (a's own copy is what is left)
            assert read is not None and signers[0].local_public_key in values(read)
        finally:
            await shut_down(nodes)

    asyncio.run(main())


def test_a_node_whose_routing_table_lost_everyone_pings_its_initial_peers_back_at_its_next_walk() -> None:
    """Real hivemind DHT nodes in this process. A node whose requests all timed out (hivemind then drops the peers
    from its routing table) walks among what it has left: nothing, so its stores stay with itself and its member
    table holds itself. Its next walk pings its initial peers first; one that answers is back in the routing
    table, and the walk after finds the rest: its record reaches the others and it reads theirs."""
    import types

    from hivemind.utils.timed_storage import get_dht_time

    key = "farloco/t/members"

    async def main() -> None:
        signers, nodes = await signed_nodes(3)
        a, b, c = nodes
        dht = types.SimpleNamespace(initial_peers=[str(m) for m in await a.p2p.get_visible_maddrs()])

        async def store(index: int, value: int, replan_every: float) -> bool:
            return await dhtcall.store_near(
                dht, nodes[index], key=key, value={"v": value}, expiration=get_dht_time() + 60,
                subkey=signers[index].local_public_key, replan_every=replan_every,
            )  # fmt: skip

        try:
            assert await store(0, 0, 60.0) and await store(2, 2, 60.0)
            for lost in (a.node_id, c.node_id):  # every request of b's went unanswered
                del b.protocol.routing_table[lost]
            assert len(b.protocol.routing_table.uid_to_peer_id) == 0
            assert await store(1, 1, 60.0)  # a walk among nobody; a ping of a goes out meanwhile
            for _ in range(100):
                if a.node_id in b.protocol.routing_table:
                    break
                await asyncio.sleep(0.05)
            assert a.node_id in b.protocol.routing_table
            assert dhtcall.rejoin_initial_peers(dht, b, 60.0) == 0  # looked at once per `every` at most
            assert await store(1, 11, 0.0)  # the next walk: through a, to every replica
            read = await dhtcall.get_near(dht, b, key=key, replan_every=0.0)
            assert read is not None and {s.local_public_key for s in signers} <= set(read.value)
            read = await c.get(key, latest=True)
            assert read is not None and read.value[signers[1].local_public_key].value == {"v": 11}
        finally:
            await shut_down(nodes)

    asyncio.run(main())


def test_a_wait_for_a_coroutine_in_the_dht_process_that_ends_early_leaves_its_future_alone() -> None:
    """hivemind's DHT process sets a coroutine's result without checking whether the future was cancelled, and
    logged a traceback (InvalidStateError) for each one cancelled: a node leaving while a store or read near a
    key was in flight. `run_in_dht` leaves the future to finish unheard, whether its wait is cancelled or times
    out, while `call` (hivemind's own methods) still cancels."""

    class Dht:
        def __init__(self) -> None:
            self.futures: list[concurrent.futures.Future[Any]] = []

        def run_coroutine(self, coro: Any, return_future: bool = False) -> Any:
            self.futures.append(concurrent.futures.Future())
            return self.futures[-1]

        def get(self, key: str, return_future: bool = False) -> Any:
            return self.run_coroutine(None)

    async def main() -> None:
        dht = Dht()
        waiting = asyncio.ensure_future(dhtcall.run_in_dht(dht, functools.partial(dhtcall.get_near)))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(TimeoutError):
            await dhtcall.run_in_dht(dht, functools.partial(dhtcall.get_near), timeout=0.01)
        assert [f.cancelled() for f in dht.futures] == [False, False]
        dht.futures[0].set_result(None)  # what the DHT process does when the coroutine ends: no error
        with pytest.raises(TimeoutError):
            await dhtcall.call(dht.get, "k", timeout=0.01)
        assert dht.futures[-1].cancelled()

    asyncio.run(main())


def test_plans_past_their_use_are_dropped_once_the_table_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round's keys get a plan of their replicas; rounds never end, so the table must not grow with
    them: once it holds PLANS_KEPT plans, those older than their own replan interval go."""
    monkeypatch.setattr(dhtcall, "_REPLICAS", {})
    now = time.monotonic()
    for i in range(dhtcall.PLANS_KEPT - 1):
        dhtcall._REPLICAS[(0, bytes([i]))] = (now - 10.0, [], 5.0)  # past its use
    dhtcall._REPLICAS[(0, b"members")] = (now - 10.0, [], 60.0)  # still in use
    dhtcall._remember((0, b"round 9"), [], 8.0)
    assert set(dhtcall._REPLICAS) == {(0, b"members"), (0, b"round 9")}
    dhtcall._remember((0, b"round 10"), [], 8.0)  # below the bound: nothing is scanned
    assert len(dhtcall._REPLICAS) == 3
