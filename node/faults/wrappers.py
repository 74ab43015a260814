"""Wrappers that make a real collaborator of a node misbehave on purpose, each in front of the real one: what
the fault injector (node/faults/injector.py) puts in place of the DHT, the exchange's RPC client, the exchange
and the outer state when a node's fault plan asks for it. Everything a wrapper does not change goes to the real
object as it is."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import torch

from farloco.protocol import dhtcall

log = logging.getLogger("farloco.agent")


def _answered(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future


class FlakyDHT:
    """A real DHT whose stores are refused N times / for S seconds, or whose calls stop answering after S."""

    def __init__(
        self,
        dht: Any,
        *,
        refuse_stores: int = 0,
        refuse_stores_for: float = 0.0,
        silent_after: float | None = None,
    ) -> None:
        self._dht = dht
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.refuse_stores = refuse_stores
        self.refuse_stores_for = refuse_stores_for
        self.silent_after = silent_after
        self.refused = 0  # stores refused so far
        self.stores = 0  # stores asked for so far

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dht, name)

    def _silent(self) -> bool:
        return self.silent_after is not None and time.monotonic() - self._started >= self.silent_after

    def store(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
        return self._store(
            lambda: self._dht.store(*args, return_future=return_future, **kwargs), return_future
        )

    def run_coroutine(self, coro: Any, return_future: bool = False) -> Any:
        """A store near the key (`dhtcall.store_near`, how member records are stored) is a store like any other;
        other coroutines pass, unless the DHT is silent."""

        def call() -> Any:
            return self._dht.run_coroutine(coro, return_future=return_future)

        if isinstance(coro, functools.partial) and coro.func is dhtcall.store_near:
            return self._store(call, return_future)
        if self._silent():
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            return future if return_future else future.result()
        return call()

    def _store(self, call: Any, return_future: bool) -> Any:
        with self._lock:
            self.stores += 1
            if self._silent():
                refused: Any = None  # never answers
            elif self.refuse_stores > 0 or time.monotonic() - self._started < self.refuse_stores_for:
                self.refuse_stores = max(0, self.refuse_stores - 1)
                self.refused += 1
                refused = False
            else:
                return call()
        if refused is None:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            return future if return_future else future.result()
        return _answered(False) if return_future else False

    def get(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
        if self._silent():
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            return future if return_future else future.result()
        return self._dht.get(*args, return_future=return_future, **kwargs)


class CorruptingClient:
    """An RPC client (protocol/rpc.py `RpcClient`) whose exchange pushes of the rounds in `rounds` go out
    corrupted (FARLOCO_FAULTS `corrupt[=MODE]@exchange`): every payload of the stream's frames is overwritten as
    `corrupt_payload` says, headers untouched. Other methods and rounds go through as they are."""

    def __init__(self, client: Any, method: str) -> None:
        self._client = client
        self._method = method
        self.rounds: dict[int, str] = {}  # round id -> corrupt mode (node/faults/plan.py CORRUPT_MODES)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def arm(self, round_id: int, mode: str) -> None:
        self.rounds[round_id] = mode
        self.rounds.pop(round_id - 8, None)

    def stream(self, address: str, method: str, frames: AsyncIterator[Any], **kwargs: Any) -> Any:
        mode = self.rounds.get(kwargs.get("round_id", -1)) if method == self._method else None
        if mode is not None:
            frames = _corrupted(frames, mode)
        return self._client.stream(address, method, frames, **kwargs)


async def _corrupted(frames: AsyncIterator[Any], mode: str) -> AsyncIterator[Any]:
    async for frame in frames:
        yield replace(frame, payload=corrupt_payload(frame.payload, mode)) if frame.payload else frame


def corrupt_payload(data: bytes | memoryview, mode: str) -> bytes:
    """`data` corrupted: all 0xFF bytes (`bytes`: NaN floats, out-of-range indices), float32 +Inf (`inf`: must be
    refused) or 1e38 (`huge`: a valid, wrong value for the aggregator to defend), or its first half (`short`)."""
    if mode == "short":
        return bytes(data[: len(data) // 2])
    if mode in ("inf", "huge"):
        value = struct.pack("<f", math.inf if mode == "inf" else 1e38)
        return value * (len(data) // 4) + b"\x00" * (len(data) % 4)
    return b"\xff" * len(data)


class ByzantineExchange:
    """An exchange (protocol/exchange/ `Exchange`) through which a Byzantine insider sends a wrong-but-valid
    update in place of its own in the rounds `wrong(round_id)` names an attack for (FARLOCO_FAULTS
    `wrong=ATTACK@exchange[:ROUNDS]`, `byzantine=ATTACK`; farloco.optim ATTACKS). What it reports as transmitted
    is what the swarm would have seen of its honest update (the codec's round trip), so its error feedback stays
    honest and the wrong update is only in the rounds the plan names."""

    def __init__(
        self,
        exchange: Any,
        wrong: Callable[[int], str | None],
        on_sent: Callable[[int, str], None],
    ) -> None:
        self._exchange = exchange
        self._wrong = wrong
        self._on_sent = on_sent
        self._stale: torch.Tensor | None = None  # the last honest update ("stale" sends the round before's)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._exchange, name)

    async def average(self, group: Any, contribution: Any, codec: Any, **kwargs: Any) -> Any:
        from farloco.optim import byzantine_update
        from farloco.protocol.exchange import OnDemand

        attack = self._wrong(group.round_id)
        if attack is None:
            return await self._exchange.average(group, contribution, codec, **kwargs)
        on_demand = isinstance(contribution, OnDemand)
        if on_demand:  # the attacks need the whole update: made here, in the fault's own memory
            contribution = contribution.chunk(0, contribution.numel)
        sent = byzantine_update(attack, contribution, self._stale)
        self._on_sent(group.round_id, attack)
        self._stale = contribution.clone()
        result = await self._exchange.average(group, sent, codec, **kwargs)
        if on_demand and not codec.dense:
            # The node stages its error feedback from the payload it sent: the honest update's, as it would
            # have gone out.
            return replace(result, transmitted=None, payload=codec.encode(contribution, checksum=False))
        if on_demand:
            # The node rebuilds what the swarm saw of its honest update from the ranges encoded in, which depend
            # on the attempt alone, not on the values sent.
            return replace(result, transmitted=None)
        honest = contribution
        if not codec.lossless:
            honest = torch.empty_like(contribution)
            codec.encode_decoded(contribution, checksum=False, out=honest)
        return replace(result, transmitted=honest)


class CorruptingOuter:
    """The outer state (node/daemon/outer.py `OuterRound`) nudged right after the commits of the rounds
    `corrupt(round_id)` names (FARLOCO_FAULTS `corrupt-theta@R`): the node silently diverges, and the next round's
    hash check must repair it. `round_id()` is the round being committed."""

    def __init__(self, outer: Any, round_id: Callable[[], int], corrupt: Callable[[int], bool]) -> None:
        self._outer = outer
        self._round_id = round_id
        self._corrupt = corrupt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._outer, name)

    def commit(self, *args: Any) -> str:
        from farloco.node.daemon.outer import theta_hash

        outer_hash = self._outer.commit(*args)
        if not self._corrupt(self._round_id()):
            return str(outer_hash)
        theta = self._outer.theta
        theta[0] += 1e-3
        log.warning("fault injected: theta_outer corrupted after round %d", self._round_id())
        return theta_hash(theta)


def slowed(step: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """`step` taking `seconds` longer each call (FARLOCO_FAULTS `slow-steps=S`: a node with less compute than the
    others, a straggler)."""

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        time.sleep(seconds)
        return result

    return slow_step
