"""Injectable clocks for farloco.protocol's timed logic (membership TTLs, matchmaking deadlines).

Every timed decision in membership and matchmaking reads `now` from a `Clock`, so tests drive time by hand
(`FakeClock`) instead of sleeping, and production uses hivemind's DHT time (`DHTClock`), the same time base
the DHT uses for record expirations.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Protocol

from hivemind.utils.timed_storage import get_dht_time


class Clock(Protocol):
    """A source of time in seconds plus a way to wait on that same time base."""

    def now(self) -> float:
        """Current time in seconds (DHT time for the real clock)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock's time (returns at once for seconds <= 0)."""
        ...


class DHTClock:
    """hivemind's DHT time (wall clock by default) and asyncio.sleep: what the agent uses."""

    def now(self) -> float:
        return float(get_dht_time())

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that only moves when a test calls `advance`; sleepers wake when their deadline is reached."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        # (deadline, tie-breaker, future): the counter keeps heap order stable without comparing futures
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._counter = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._counter), future))
        await future

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds` (>= 0) and wake every sleeper whose deadline has come."""
        if seconds < 0:
            raise ValueError(f"FakeClock.advance expects seconds >= 0, got {seconds}")
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)
