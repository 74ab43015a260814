"""Ending asyncio tasks without hanging and without swallowing the caller's own cancellation.

The pattern `task.cancel(); with suppress(CancelledError): await task` has two faults: if the *caller* is
cancelled while it waits, the suppress swallows the caller's own CancelledError (its cancellation is lost
and whoever cancelled it waits forever), and a task that ignores cancellation holds the caller forever.
`cancel_and_wait` waits through `asyncio.wait`, which never raises the child's outcome, lets the caller's
own cancellation through, and gives up after a bound, logging the task that would not end.

`run` is `asyncio.run` with a bounded clean-up (the agent's main loop and the test suite use it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Future[Any] | None, *, timeout: float = 5.0) -> bool:
    """Cancel `task` and wait up to `timeout` seconds for it to end. Returns whether it ended.

    The task's own outcome (result, exception, cancellation) is consumed, never raised; the caller's own
    cancellation is raised as usual.
    """
    if task is None:
        return True
    if not task.done():
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
            logger.error("task %s did not end within %.1f s of being cancelled; leaving it", name, timeout)
            # Its outcome, whenever it comes, is consumed too (else asyncio logs "exception was never
            # retrieved" for it at garbage collection).
            task.add_done_callback(_consume)
            return False
    if not task.cancelled() and task.exception() is not None:
        logger.debug("cancelled task ended with %r", task.exception())
    return True


def _consume(task: asyncio.Future[Any]) -> None:
    """Mark a finished task's outcome as seen (its exception, if any, is of no use to anyone any more)."""
    if not task.cancelled():
        task.exception()


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """`asyncio.wait_for` without its fault before Python 3.12: there, a cancellation that arrives in the loop
    turn in which the awaited thing completes is swallowed (wait_for returns the result and the caller never
    sees its CancelledError), so a loop that was cancelled runs on. That let a cancelled membership heartbeat
    go on re-publishing after `remove()` (seen in a stress run: "did not end within 5 s of being cancelled").

    Here the caller's cancellation always propagates (the inner awaitable is then cancelled and waited for,
    bounded); TimeoutError after `timeout` seconds (None: no bound), the inner awaitable cancelled likewise.
    """
    inner = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({inner}, timeout=timeout)
    except BaseException:
        if inner.done():  # it ended in the turn we were cancelled in: its outcome goes unused, consume it
            _consume(inner)
        else:
            await cancel_and_wait(inner)
        raise
    if not done:
        await cancel_and_wait(inner)
        raise TimeoutError(f"not done within {timeout} s")
    return inner.result()


def run(
    main: Coroutine[Any, Any, T],
    *,
    cleanup_timeout: float = 5.0,
    on_leftover: Callable[[asyncio.Task[Any], bool], None] | None = None,
    debug: bool | None = None,
) -> T:
    """`asyncio.run(main)` with a clean-up that cannot hang.

    `asyncio.run` cancels the tasks `main` left behind and then waits for them, and for the default executor's
    threads, without any bound: one task that ignores cancellation, or one thread stuck in a call, and the
    process never exits. Here both waits last at most `cleanup_timeout` seconds; `on_leftover(task,
    ignored_cancel)` hears of every task still pending once `main` returned (default: a log line), and the
    loop is closed regardless.
    """
    loop = asyncio.new_event_loop()
    if debug is not None:
        loop.set_debug(debug)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            # Tasks that end on their own within a few loop turns (done-callbacks, closing streams) are fine.
            for _ in range(5):
                if all(task.done() for task in asyncio.all_tasks(loop)):
                    break
                loop.run_until_complete(asyncio.sleep(0.01))
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in pending:
                task.cancel()
            still: set[asyncio.Task[Any]] = set()
            if pending:
                _, still = loop.run_until_complete(asyncio.wait(pending, timeout=cleanup_timeout))
            for task in pending:
                if on_leftover is not None:
                    on_leftover(task, task in still)
                else:
                    logger.warning("%s", describe(task, ignored_cancel=task in still))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_default_executor(), cleanup_timeout))
        except TimeoutError:
            logger.warning("an executor thread did not finish within %.1f s of shutdown", cleanup_timeout)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def describe(task: asyncio.Task[Any], *, ignored_cancel: bool = False) -> str:
    """'task NAME (COROUTINE) waiting at FILE:LINE in FUNCTION', for a task left pending."""
    coro = task.get_coro()
    where = ""
    frames = task.get_stack(limit=1)
    if frames:
        frame = frames[-1]
        where = f" waiting at {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
    name = getattr(coro, "__qualname__", type(coro).__name__)
    suffix = " - and it IGNORED cancellation" if ignored_cancel else ""
    return f"task {task.get_name()!r} ({name}){where}{suffix}"
