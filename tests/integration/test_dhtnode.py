"""node/daemon/dhtnode.py: a DHT node restarted with its identity takes back its place in the DHT (real hivemind DHTs)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from farloco.node.daemon.dhtnode import (
    DHTStartError,
    LateAnswerFilter,
    daemon_alive,
    make_dht,
    stable_node_id,
    stop_dht,
    visible_maddrs,
)
from farloco.node.tools.demo import start_bootstrap
from farloco.protocol.membership import make_record_validators, members_key

pytestmark = pytest.mark.dht


def test_node_id_follows_the_identity_file(tmp_path: Path) -> None:
    first = stable_node_id(str(tmp_path / "a" / "identity.key"))  # made on first use
    assert (tmp_path / "a" / "identity.key").is_file()
    assert stable_node_id(str(tmp_path / "a" / "identity.key")) == first
    assert stable_node_id(str(tmp_path / "b.key")) != first


# Every call into a DHT process here is bounded: make_dht waits for readiness at most `ready_timeout`, stores and
# address reads go through futures with a timeout, and the restarted peer's id is read from its identity file.
# (It once hung under a CPU hog: a DHT forked after an earlier test's gRPC objects spun for ever in its child
# when the gc collected one of them; make_dht now freezes the inherited objects in the child.)
def test_the_others_stores_keep_working_after_a_peer_restarts_with_its_identity(tmp_path: Path) -> None:
    """SIGKILL a DHT node and start it again with the same identity: the survivor's signed sub-key stores must
    keep succeeding. With hivemind's random node id per start they failed for the rest of the run (the restarted
    peer sat in the survivor's routing table twice, and the second copy of every store answered False)."""
    from hivemind import DHT
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    run = "restart"
    key = members_key(run)

    def node(name: str, **kwargs: object) -> tuple[object, bytes]:
        private = RSAPrivateKey()
        dht = make_dht(
            ready_timeout=60,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=make_record_validators(run, private_key=private),
            start=True,
            **kwargs,
        )
        return dht, RSASignatureValidator(private).local_public_key

    def store(dht: object, subkey: bytes, peer_id: str) -> bool:
        now = get_dht_time()
        record = {"peer_id": peer_id, "heartbeat": now, "left": True, "proof": "test"}
        future = dht.store(key, record, now + 8, subkey=subkey, return_future=True)  # type: ignore[attr-defined]
        return bool(future.result(timeout=30))

    boot, _ = node("boot")
    started = []
    try:
        maddrs = boot.run_coroutine(DHT._get_visible_maddrs, return_future=True).result(timeout=30)  # type: ignore[attr-defined]
        maddr = str(maddrs[0])
        survivor, survivor_key = node("survivor", initial_peers=[maddr])
        started.append(survivor)
        identity = str(tmp_path / "restarted.key")
        restarted, restarted_key = node("restarted", initial_peers=[maddr], identity_path=identity)
        started.append(restarted)
        for _ in range(4):
            assert store(restarted, restarted_key, "restarted") and store(survivor, survivor_key, "survivor")
            time.sleep(0.2)
        peer_id = str(PeerID.from_identity(Path(identity).read_bytes()))
        os.kill(restarted.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        restarted.join(10)  # type: ignore[attr-defined]
        again, again_key = node("again", initial_peers=[maddr], identity_path=identity)
        started.append(again)
        again_id = again.run_coroutine(DHT._get_peer_id, return_future=True).result(timeout=30)  # type: ignore[attr-defined]
        assert str(again_id) == peer_id
        results = []
        for _ in range(12):
            results.append(store(again, again_key, "restarted"))
            results.append(store(survivor, survivor_key, "survivor"))
            time.sleep(0.25)
        # The first stores may reach the dead node's last address (not answering: no status); every one after
        # the restarted node is known again must succeed, the survivor's included.
        assert all(results[4:]), results
    finally:
        for dht in [*started, boot]:
            if dht.is_alive():  # a killed one answers nothing any more  # type: ignore[attr-defined]
                dht.shutdown()  # type: ignore[attr-defined]


def _p2pd_of(dht: object) -> int:
    """The pid of the DHT child's libp2p daemon."""
    pid = dht.pid  # type: ignore[attr-defined]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                name, _, rest = f.read().rpartition(")")
                if name.endswith("(p2pd") and int(rest.split()[1]) == pid and rest.split()[0] != "Z":
                    return int(entry)
    raise AssertionError("the DHT child has no p2pd")


def test_a_sigterm_to_the_whole_node_leaves_the_dht_child_to_its_owner_and_stopping_it_is_quick() -> None:
    """What Slurm and systemd do on a leave: SIGTERM to every process of the node. The DHT child ignores it (the
    agent still needs it to deregister), p2pd dies of it; `daemon_alive` says so, and `stop_dht` then stops the
    child at once instead of waiting out hivemind's grace period for a daemon that is gone."""
    dht = make_dht(ready_timeout=60, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        assert daemon_alive(dht)
        os.kill(dht.pid, signal.SIGTERM)
        os.kill(_p2pd_of(dht), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while daemon_alive(dht) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dht.is_alive(), "the DHT child must outlive a SIGTERM (its owner stops it)"
        assert not daemon_alive(dht)
        started = time.monotonic()
        stop_dht(dht)
        assert time.monotonic() - started < 2.0
        assert not dht.is_alive()
    finally:
        if dht.is_alive():
            dht.kill()
            dht.join(5)


def test_stop_dht_is_graceful_while_the_daemon_lives() -> None:
    dht = make_dht(ready_timeout=60, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    p2pd = _p2pd_of(dht)
    stop_dht(dht)
    assert not dht.is_alive()
    deadline = time.monotonic() + 10
    while _running(p2pd) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(p2pd), "p2pd outlived its DHT"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_failed_starts_libp2p_daemon_holding_our_identity_is_killed(tmp_path: Path) -> None:
    """Before a DHT start is tried again (a peer could not dial us back), the daemon the failed try left running
    with our identity is killed: found by its `-id=PATH`, ours only (another identity's daemon lives on)."""
    import shutil
    import subprocess

    from farloco.node.daemon.dhtnode import _kill_daemons_of

    fake = tmp_path / "p2pd"  # a process whose command line reads like hivemind's p2pd
    shutil.copy("/bin/sh", fake)
    ours, theirs = tmp_path / "ours.key", tmp_path / "theirs.key"
    # It waits in the shell's builtin `read`: no child of its own. A `sleep` forked by the shell carried the same
    # command line until its exec, and a busy machine caught it there: two "daemons" of ours killed, not one.
    started = [
        subprocess.Popen([str(fake), "-c", "read line", f"-id={key}"], stdin=subprocess.PIPE)
        for key in (ours, theirs)
    ]
    try:
        assert _kill_daemons_of(str(ours)) == [started[0].pid]
        assert started[0].wait(timeout=10) == -9
        assert started[1].poll() is None
        assert _kill_daemons_of("") == [] and _kill_daemons_of(None) == []
    finally:
        for process in started:
            process.kill()
            process.wait()
            assert process.stdin is not None
            process.stdin.close()


class _SilentDHT:
    """Answers get_visible_maddrs never, as a hivemind DHT whose reply could not be unpickled did."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def get_visible_maddrs(self) -> list[str]:
        self.release.wait()
        return []


def test_asking_a_silent_dht_for_its_addresses_is_bounded_and_stoppable() -> None:
    silent = _SilentDHT()
    try:
        started = time.monotonic()
        with pytest.raises(DHTStartError, match="did not report its addresses in 1 s"):
            visible_maddrs(silent, timeout=1.0)
        assert time.monotonic() - started < 5
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        started = time.monotonic()
        with pytest.raises(DHTStartError, match="stopped"):
            visible_maddrs(silent, timeout=60.0, stop=stop)  # a SIGTERM's flag ends the wait
        assert time.monotonic() - started < 5
    finally:
        silent.release.set()


def test_a_bootstrap_that_never_comes_up_is_stopped_with_its_session(tmp_path: Path) -> None:
    """start_bootstrap gives up on a bootstrap that wrote no multiaddrs in time and stops it, the processes of
    its session included (it once left them running), naming the log's tail."""
    pid_file = tmp_path / "pid"
    # Stands in for the bootstrap: says something, records its pid, and waits with a child in its session.
    script = f"echo 'the DHT is stuck'; echo $$ > {pid_file}; sleep 600 & wait"
    with pytest.raises(RuntimeError, match=r"(?s)failed to start.*the DHT is stuck"):
        start_bootstrap(tmp_path, prefix=("sh", "-c", script, "sh"), timeout=2.0)
    session = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while True:
        left = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.getsid(int(entry)) == session:
                        left.append(int(entry))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == [], f"processes of the bootstrap's session still there: {left}"


def test_a_late_answer_to_a_cancelled_dht_request_is_not_logged_as_an_error() -> None:
    """The DHT process's asyncio logs "Task exception was never retrieved" when hivemind's request handler sets
    its late answer on an MPFuture that farloco cancelled (its wait ended first): a real MPFuture, cancelled, and a
    handler task named as hivemind's is. LateAnswerFilter drops that record and only that one: another task's
    lost error is still logged."""
    import asyncio
    import gc
    import logging

    from hivemind.utils.mpfuture import MPFuture

    class DHT:  # the handler's qualified name as hivemind's: DHT._get
        async def _get(self, future: MPFuture) -> None:
            future.set_result("late answer")  # InvalidStateError: the caller cancelled it

    async def other() -> None:
        raise ValueError("a real lost error")

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    asyncio_log = logging.getLogger("asyncio")
    late = LateAnswerFilter()
    keep = Keep()
    asyncio_log.addFilter(late)
    asyncio_log.addHandler(keep)
    try:

        async def main() -> None:
            future: MPFuture = MPFuture()
            future.cancel()
            tasks = [asyncio.ensure_future(DHT()._get(future)), asyncio.ensure_future(other())]
            await asyncio.wait(tasks)  # neither task's exception is retrieved
            del tasks

        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()
        gc.collect()
    finally:
        asyncio_log.removeFilter(late)
        asyncio_log.removeHandler(keep)
    messages = [r.getMessage() for r in records]
    assert len(messages) == 1, messages
    assert "never retrieved" in messages[0] and "a real lost error" in messages[0]
