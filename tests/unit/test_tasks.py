"""farloco.util.tasks: what a cancelled or abandoned task leaves behind. asyncio logs "Task exception was never
retrieved" for a task whose exception nobody looked at (seen in a 64-peer run: the data server's preamble read,
cancelled in the turn its connection reset)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from farloco.util.tasks import cancel_and_wait, wait_for


def unretrieved(main: Any) -> list[dict[str, Any]]:
    """Run `main()` on a fresh loop; what the loop's exception handler heard, garbage collected at the end."""
    heard: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, context: heard.append(context))
    try:
        loop.run_until_complete(main())
        gc.collect()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    gc.collect()
    return heard


def test_wait_for_cancelled_in_the_turn_its_awaitable_fails_consumes_the_failure() -> None:
    async def main() -> None:
        outer: asyncio.Task[Any] | None = None

        async def fails() -> None:
            await asyncio.sleep(0)
            assert outer is not None
            outer.cancel()  # the caller is cancelled in the very turn the awaited thing ends with an error
            raise ConnectionResetError("the peer closed the connection")

        outer = asyncio.ensure_future(wait_for(fails(), 10.0))
        with pytest.raises(asyncio.CancelledError):
            await outer

    heard = unretrieved(main)
    assert not [c for c in heard if "never retrieved" in str(c.get("message"))], heard


def test_a_task_cancel_and_wait_gave_up_on_has_its_late_failure_consumed() -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def stubborn() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await release.wait()  # ignores the cancellation for a while, then fails
                raise ValueError("failed long after it was cancelled") from None

        task = asyncio.ensure_future(stubborn())
        await asyncio.sleep(0)
        assert not await cancel_and_wait(task, timeout=0.05)  # gave up: the task is still running
        release.set()
        await asyncio.sleep(0.01)
        assert task.done()  # and nobody here looks at its exception

    heard = unretrieved(main)
    assert not [c for c in heard if "never retrieved" in str(c.get("message"))], heard
