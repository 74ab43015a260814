"""Suite-wide hygiene: every test stops what it started, and a hung test fails the run instead of hanging it.

- `_hygiene` (autouse) fails a test that leaves behind a pending asyncio task, a live child process or a
  listening socket of this process, naming each one. Tests run their coroutines with `asyncio.run`, which here
  is a checked runner: once the coroutine returns, any task it left pending is recorded (name, coroutine and
  where it waits), cancelled, and given `TASK_CANCEL_GRACE` seconds to end; a task that ignores cancellation
  is named as such and the loop is closed anyway, so clean-up can never hang the run (plain `asyncio.run`
  waits forever for such a task). An asyncio error nobody retrieved ("Future exception was never retrieved",
  reported when the future is freed) fails the test too: it is an error the code lost.
- Timeouts: pytest-timeout's `signal` method fails a test at its timeout (300 s, or its `timeout` marker) with
  every thread's stack, and covers fixture set-up and tear-down. It fires once; if the test's clean-up then
  hangs too, a watchdog thread `HARD_TIMEOUT_GRACE` seconds later (60, or `FARLOCO_TEST_HARD_GRACE`) kills
  the test's child processes, prints every thread's stack and the captured output, and ends the pytest
  process with exit code 1. A whole run that exceeds `FARLOCO_TEST_SESSION_LIMIT` seconds (default 2700) ends
  the same way. So a hang costs CI at most a few minutes, never its 90.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import psutil
import pytest
import pytest_timeout

from farloco.util.tasks import describe, run

TASK_CANCEL_GRACE = 5.0
HARD_TIMEOUT_GRACE = float(os.environ.get("FARLOCO_TEST_HARD_GRACE", "60"))
SESSION_LIMIT = float(os.environ.get("FARLOCO_TEST_SESSION_LIMIT", "2700"))
# Helper processes that the standard library or torch (shared-memory tensors) start once for the session.
_SESSION_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch_shm_manager")

_original_run = asyncio.run
_leftover_tasks: list[str] = []
_unretrieved: list[str] = []


def _record_unretrieved(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: an error nobody took ("Future/Task exception was never retrieved", reported
    when the future is freed) is a bug of the test or of the code, and fails the test; everything else is logged
    as asyncio would."""
    message = str(context.get("message", ""))
    if "never retrieved" in message:
        _unretrieved.append(f"{message}: {context.get('exception')!r}")
    loop.default_exception_handler(context)


def checked_run(main: Coroutine[Any, Any, Any], *, debug: bool | None = None) -> Any:
    """`asyncio.run`, except that leftover tasks and errors never retrieved are recorded and clean-up is bounded
    (module docstring)."""

    def leftover(task: asyncio.Task[Any], ignored_cancel: bool) -> None:
        _leftover_tasks.append(describe(task, ignored_cancel=ignored_cancel))

    async def handled() -> Any:
        # Kept by the loop after it closed: a future freed later still reports to it.
        asyncio.get_running_loop().set_exception_handler(_record_unretrieved)
        return await main

    return run(handled(), cleanup_timeout=TASK_CANCEL_GRACE, on_leftover=leftover, debug=debug)


def _live_children(owned_by_longer_fixtures: set[int] = frozenset()) -> dict[int, str]:  # type: ignore[assignment]
    """Live descendants of this process, except helpers and the descendants of `owned_by_longer_fixtures`
    (processes that a module- or session-scoped fixture started before the test, and their children)."""
    me = os.getpid()
    found = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(child.cmdline())[:200]
            if any(helper in command for helper in _SESSION_HELPERS):
                continue
            ancestors = {parent.pid for parent in child.parents()} - {me}
            if ancestors & owned_by_longer_fixtures:
                continue
            found[child.pid] = command
    return found


def _listening() -> set[str]:
    return {
        f"{conn.laddr.ip}:{conn.laddr.port}"
        for conn in psutil.Process().net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }


def _kill_children() -> None:
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def _test_timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0)


class _Watchdog:
    """Ends the pytest process (stacks dumped, children killed) if a deadline passes; re-armed per test."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadline = float("inf")
        self._item: pytest.Item | None = None
        self._why = ""
        self._session_deadline = time.monotonic() + SESSION_LIMIT
        threading.Thread(target=self._watch, name="farloco-test-watchdog", daemon=True).start()

    def arm(self, item: pytest.Item, seconds: float, why: str) -> None:
        with self._lock:
            self._item, self._deadline, self._why = item, time.monotonic() + seconds, why

    def disarm(self) -> None:
        with self._lock:
            self._deadline = float("inf")

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                now = time.monotonic()
                item, why = self._item, self._why
                if now >= self._session_deadline:
                    why = f"the whole test run exceeded FARLOCO_TEST_SESSION_LIMIT={SESSION_LIMIT:.0f} s"
                elif now < self._deadline:
                    continue
            if item is None:
                os._exit(1)
            print(
                f"\nFATAL: {item.nodeid}: {why}; killing its child processes and ending the run", flush=True
            )
            _kill_children()
            settings = pytest_timeout.Settings(
                timeout=0, method="thread", func_only=False, disable_debugger_detection=True
            )
            pytest_timeout.timeout_timer(item, settings)  # dumps output and every stack, then os._exit(1)


_watchdog: _Watchdog | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _watchdog
    if _watchdog is None:
        _watchdog = _Watchdog()
    timeout = _test_timeout(item)
    if timeout > 0:
        _watchdog.arm(
            item,
            timeout + HARD_TIMEOUT_GRACE,
            f"still running {HARD_TIMEOUT_GRACE:.0f} s after its {timeout:.0f} s timeout "
            "(the timeout fired and the clean-up that followed hung)",
        )
    try:
        yield
    finally:
        _watchdog.disarm()


@pytest.fixture(autouse=True)
def _hygiene(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test that leaves asyncio tasks, child processes or listening sockets behind (module docstring)."""
    children_before = set(_live_children())
    listening_before = _listening()
    _leftover_tasks.clear()
    _unretrieved.clear()
    monkeypatch.setattr(asyncio, "run", checked_run)
    yield
    monkeypatch.setattr(asyncio, "run", _original_run)
    problems = [f"left a pending asyncio {task}" for task in _leftover_tasks]
    problems += [f"left an asyncio error unretrieved: {error}" for error in _unretrieved]
    _leftover_tasks.clear()
    _unretrieved.clear()
    # Processes and sockets a test stopped may take a moment to go: look again for a few seconds.
    deadline = time.monotonic() + 5.0
    while True:
        children = {
            pid: cmd for pid, cmd in _live_children(children_before).items() if pid not in children_before
        }
        sockets = _listening() - listening_before
        if (not children and not sockets) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    problems += [f"left child process {pid} running: {command}" for pid, command in sorted(children.items())]
    problems += [f"left a listening socket open on {address}" for address in sorted(sockets)]
    if children:
        _kill_children_of(children)
    if problems:
        pytest.fail("the test did not clean up after itself:\n  " + "\n  ".join(problems), pytrace=False)


def _kill_children_of(children: dict[int, str]) -> None:
    for pid in children:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


pytest_plugins = ["pytester"]  # tests/integration/test_hygiene.py runs small suites under this conftest
