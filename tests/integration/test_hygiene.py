"""The suite's own hygiene (tests/conftest.py), run on small suites of its own: a test that leaves a task, an
asyncio error never retrieved, a child process or a listening socket behind fails naming it, and a test whose clean-up hangs after its timeout
ends the run with every thread's stack instead of hanging it."""

from __future__ import annotations

import shutil
import time

import pytest
from helpers import TESTS

CONFTEST = TESTS / "conftest.py"

LEAKY = """
import asyncio, socket, subprocess, sys

def test_clean():
    async def main():
        task = asyncio.create_task(asyncio.sleep(0.01))
        await task
    asyncio.run(main())

def test_leaves_a_task():
    async def main():
        asyncio.create_task(asyncio.sleep(3600), name="forgotten")
    asyncio.run(main())

def test_leaves_a_task_that_ignores_cancel():
    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
    async def main():
        asyncio.create_task(stubborn(), name="stubborn")
    asyncio.run(main())

def test_leaves_an_error_unretrieved():
    async def fails():
        raise ValueError("lost error")
    async def main():
        future = asyncio.ensure_future(fails())
        await asyncio.wait([future])  # waited for, its error never taken
    asyncio.run(main())

def test_leaves_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])

SOCKETS = []

def test_leaves_a_socket():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    SOCKETS.append(server)
"""

HANGS = """
import time
import pytest

@pytest.mark.timeout(1)
def test_hangs_after_its_timeout():
    try:
        time.sleep(30)
    finally:
        while True:  # a clean-up that never ends and swallows the timeout's own exception
            try:
                time.sleep(30)
            except BaseException:
                pass

def test_never_reached():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    shutil.copy(CONFTEST, pytester.path / "conftest.py")
    return pytester


def test_leftover_tasks_processes_and_sockets_fail_the_test_that_left_them(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_leaky=LEAKY)
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=6, errors=5)
    text = result.stdout.str()
    assert "left a pending asyncio task 'forgotten'" in text
    assert (
        "left an asyncio error unretrieved: Task exception was never retrieved: ValueError('lost error')"
        in text
    )
    assert "'stubborn'" in text and "IGNORED cancellation" in text
    assert "left child process" in text and "time.sleep(3600)" in text
    assert "left a listening socket open on 127.0.0.1:" in text
    assert "test_clean" not in text.split("short test summary")[-1]


def test_a_clean_up_that_hangs_after_the_timeout_ends_the_run_with_every_stack(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.makepyfile(test_hangs=HANGS)
    monkeypatch.setenv("FARLOCO_TEST_HARD_GRACE", "2")
    started = time.monotonic()
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=60)
    assert time.monotonic() - started < 30
    assert result.ret == 1
    text = result.stdout.str() + result.stderr.str()
    assert "FATAL: test_hangs.py::test_hangs_after_its_timeout" in text
    assert "Stack of MainThread" in text and "in test_hangs_after_its_timeout" in text
    assert "test_never_reached" not in text
