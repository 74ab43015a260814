"""Members given up as gone before the data deadline: frozen mid-exchange, their membership record expired, and
not answering a ping.

A member frozen mid-exchange (SIGSTOP, a hung machine; its sockets stay open, so no error comes): with a `gone`
callback (its membership record expired: no heartbeat for the member ttl), a member we have heard nothing from
for GONE_SILENCE_SECONDS is pinged (an authenticated `DataAddress` call its event loop answers); one that does
not answer within GONE_PING_SECONDS is given up before the data deadline, but only while the others are a strict
majority of the attempt: both sides of a partition cannot be, so neither side of a 1|1 or 2|2 split goes on alone
early (each waits for the deadline, as without the callback). The ping matters: a frozen member's DHT process
freezes with it, the others' heartbeats then fail to store, and their records expire too (the chaos runner's
frozen-exchange row: a healthy member was given up on its record alone). Checked every GONE_CHECK_SECONDS, in
the data phase and for votes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Sequence

from farloco.protocol.exchange.attempt import Attempt
from farloco.protocol.rpc import RpcClient
from farloco.util.tasks import wait_for

GONE_SILENCE_SECONDS = 2.0
GONE_PING_SECONDS = 2.0
GONE_CHECK_SECONDS = 0.5


class GoneWatch:
    """Finds the members of an attempt to give up as gone: `gone(peer)` says whether a peer's membership record
    expired (None: never), `client` pings them."""

    def __init__(self, client: RpcClient, gone: Callable[[str], bool] | None) -> None:
        self.client = client
        self.gone = gone

    @property
    def watching(self) -> bool:
        return self.gone is not None

    async def wait_for_data(self, attempt: Attempt, deadline: float) -> None:
        """Until the attempt finished; TimeoutError at `deadline`. Meanwhile members found gone (`lost`) fail
        the attempt at once, so the vote and the retry without them start now instead of at the deadline."""
        loop = asyncio.get_running_loop()
        while not attempt.finished.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            step = remaining if self.gone is None else min(remaining, GONE_CHECK_SECONDS)
            with contextlib.suppress(TimeoutError):
                await wait_for(attempt.finished.wait(), timeout=step)
            if attempt.finished.is_set():
                return
            lost = self.lost(attempt)
            if lost:
                attempt.gone |= lost
                attempt.fail(
                    f"MEMBER_GONE: {sorted(lost)} stopped heartbeating, sent nothing for {GONE_SILENCE_SECONDS:g} s "
                    f"and did not answer a ping; the {len(attempt.members) - len(attempt.gone)} others of "
                    f"{len(attempt.members)} members go on without them",
                    evidence=False,
                )

    def lost(self, attempt: Attempt, among: Sequence[int] | None = None) -> set[str]:
        """Members (of `among`, default all others) that are gone (`gone`) and silent for
        GONE_SILENCE_SECONDS, if the members left besides them and those already given up are a strict
        majority of the attempt; else none (a partition's sides never are both)."""
        if self.gone is None:
            return set()
        now = asyncio.get_running_loop().time()
        others = [j for j in range(len(attempt.members)) if j != attempt.me] if among is None else among
        silent = set()
        for j in others:
            peer = attempt.members[j].peer_id
            if now - attempt.heard.get(j, now) < GONE_SILENCE_SECONDS or not self.gone(peer):
                continue
            sent, ping = attempt.pings.get(j, (-math.inf, None))
            if ping is None or (ping.done() and ping.result() and now - sent >= GONE_SILENCE_SECONDS):
                # ask (again): an answer means it is alive, only slow or waiting itself
                attempt.pings[j] = (now, asyncio.ensure_future(self._ping(attempt, j)))
            elif ping.done() and not ping.result():
                silent.add(peer)
        n = len(attempt.members)
        if not silent or 2 * (n - len(silent | attempt.gone)) <= n:
            return set()
        return silent

    async def _ping(self, attempt: Attempt, j: int) -> bool:
        """Whether member j's node answers an authenticated call within GONE_PING_SECONDS (its event loop runs)."""
        return await self.client.answers(
            attempt.members[j].address, round_id=attempt.round_id, timeout=GONE_PING_SECONDS
        )
