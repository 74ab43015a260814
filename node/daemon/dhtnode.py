"""Starting a hivemind DHT node that never outlives the process that started it."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from farloco.protocol import dhtcall

logger = logging.getLogger(__name__)


def _set_parent_death_signal(sig: signal.Signals) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)


def stable_node_id(identity_path: str) -> Any:
    """The DHT node id of the peer whose libp2p identity is in `identity_path` (made there if missing).

    hivemind draws a random DHT node id at every start. A node restarted with the same identity (same libp2p peer
    id) then sits in the others' routing tables twice, under its old node id and its new one, and both answer
    since one process serves that peer id. Every store the others make reaches it twice: the second copy is no
    newer than the first, so it answers False, and hivemind reports the status of the last replica it heard from,
    so the other peers' stores "fail" for as long as both entries live, which is for good (a survivor's
    member and matchmaking records refused for the rest of the run after its peer was SIGKILLed and restarted).
    Deriving the node id from the peer id gives a restarted node its old place in the DHT instead.
    """
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import P2P, PeerID

    path = Path(identity_path)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    return DHTID.generate(source=PeerID.from_identity(path.read_bytes()).to_bytes())


class LateAnswerFilter(logging.Filter):
    """In the DHT process: drops asyncio's "Task exception was never retrieved" for a DHT request whose caller
    gave up first. farloco cancels a request's MPFuture when its wait ends early (protocol/dhtcall.py: a timeout,
    a shutdown); hivemind's handler of the request (`DHT._get`, `DHT._store`) then sets its late result on the
    cancelled future, which raises InvalidStateError in a task nobody awaits, logged at ERROR with a traceback
    (2 in 500 rounds of the chaos runner's long-run row). Nothing is lost: the answer came after nobody wanted
    it. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            "never retrieved" in message
            and "InvalidStateError" in message
            and "CANCELLED" in message
            and ("DHT._get()" in message or "DHT._store()" in message)
        )


# hivemind's start-up check that a peer can dial this node back (DHTProtocol.call_ping with validate=True).
DIAL_BACK_FAILED = "can't access this node"
DIAL_BACK_TRIES = 3
DIAL_BACK_PAUSE = 2.0
DIAL_BACK_TRY_SECONDS = (
    30.0  # a retry that is not ready by then gives way to the next (the last takes what is left)
)


class DHTStartError(RuntimeError):
    """The DHT node did not become ready in time."""


def make_dht(*, ready_timeout: float = 120.0, niceness: int = 0, **kwargs: Any) -> Any:
    """A hivemind.DHT whose forked child dies with its parent: a SIGKILLed agent or bootstrap must not
    leave its DHT node (and the port it holds) behind, or it could not be restarted on the same address.

    With `start=True` it is started and waited for at most `ready_timeout` seconds (hivemind would wait for
    ever): past that the child is killed and DHTStartError names what it was started with.
    With an `identity_path`, its DHT node id follows from that identity (`stable_node_id`). With `niceness`, the
    child and its libp2p daemon run that much below their parent's priority (`network.dht_niceness`)."""
    import hivemind
    import torch.multiprocessing

    # hivemind switches torch's sharing strategy to "file_system" when imported: its shared tensors then go
    # through a helper process, torch_shm_manager, that each process starts on first use. A SIGTERM sent to
    # every process of a node (Slurm's scancel --signal=TERM, systemd's control-group stop) kills that helper
    # as the leave begins, and every DHT call after it (each makes an MPFuture, whose buffer is shared memory)
    # failed with "Broken pipe", in a C++ thread an abort. Nothing farloco shares needs a name: hivemind's
    # MPFuture buffers reach the DHT child by fork, which "file_descriptor" (torch's Linux default) serves
    # without a helper.
    torch.multiprocessing.set_sharing_strategy("file_descriptor")  # type: ignore[no-untyped-call]
    if kwargs.get("identity_path") and "node_id" not in kwargs:
        kwargs["node_id"] = stable_node_id(str(kwargs["identity_path"]))

    class _DHT(hivemind.DHT):  # type: ignore[misc]
        def run(self) -> None:
            _set_parent_death_signal(signal.SIGKILL)
            # Its owner stops it (shutdown) and the kernel kills it with its owner. A SIGTERM sent to the whole
            # node (Slurm's scancel --signal=TERM, systemd's control-group stop) is the owner's cue to leave,
            # which needs this process a while longer to deregister.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            # The child is a fork: it inherits every object of the parent, grpc's included, but not the parent's
            # threads. Had the cyclic gc collected an inherited grpc object here, its dealloc would join a thread
            # that does not exist in this process and spin at 100% CPU for good (seen: a DHT started after a
            # test's gRPC server never became ready). Nothing inherited is the child's to collect: freeze it.
            gc.freeze()
            logging.getLogger("asyncio").addFilter(LateAnswerFilter())
            if niceness:  # before hivemind starts p2pd here: the daemon inherits it
                os.nice(niceness)
            super().run()

    # hivemind waits 3 s for a peer's answer; on a loaded machine a store then fails for want of replies, so
    # give DHT requests more room (a dead peer still costs at most this long per request).
    kwargs.setdefault("wait_timeout", 8.0)
    for option, value in dhtcall.DHT_NODE_OPTIONS.items():
        kwargs.setdefault(option, value)
    start = bool(kwargs.pop("start", False))
    if not start:
        return _DHT(start=False, **kwargs)
    deadline = time.monotonic() + ready_timeout
    for attempt in range(1, DIAL_BACK_TRIES + 1):
        if attempt > 1:
            # The identity is ours (our run directory's) and the daemon that held it is gone: hivemind's check
            # that nobody else uses it dials our peer id through peers that still hold stale connections to it,
            # and hung the whole start-up budget (120 s) in the chaos runner's half-open row.
            kwargs["check_if_identity_free"] = False
        dht = _DHT(start=False, **kwargs)
        gc.collect()  # what is garbage now is collected here, where its threads live, not in the forked child
        budget = deadline - time.monotonic()
        if attempt < DIAL_BACK_TRIES:
            budget = min(budget, DIAL_BACK_TRY_SECONDS) if attempt > 1 else budget
        try:
            dht.run_in_background(await_ready=True, timeout=max(1.0, budget))
        except TimeoutError:
            if dht.is_alive():
                dht.kill()
                dht.join(5)
            if 1 < attempt < DIAL_BACK_TRIES and time.monotonic() < deadline:
                _kill_daemons_of(kwargs.get("identity_path"))
                logger.warning("the DHT node's try %d was not ready in %.0f s: trying again", attempt, budget)
                continue
            raise DHTStartError(
                f"the DHT node did not become ready within {ready_timeout:g} s (host_maddrs="
                f"{kwargs.get('host_maddrs')}, initial_peers={kwargs.get('initial_peers')}); check that those "
                "addresses can be bound and reached"
            ) from None
        except Exception as exc:  # hivemind's P2PDaemonError and friends, raised in the child and passed back
            if dht.is_alive():
                dht.kill()
                dht.join(5)
            if DIAL_BACK_FAILED in str(exc) and attempt < DIAL_BACK_TRIES and time.monotonic() < deadline:
                # The failed try's libp2p daemon outlives its killed parent and holds our identity: the next try's
                # check that the identity is free would find it (and hang on it).
                _kill_daemons_of(kwargs.get("identity_path"))
                # The peer we joined through could not dial us back. After a crash without FIN or RST (a machine
                # that lost power, a partition), that peer still holds its connection to our peer id from our
                # last life and tries it first; our host answers it with a reset now, so the next try dials fresh.
                logger.warning(
                    "a peer could not dial this DHT node back (%s); a connection from before a crash may still be "
                    "half-open at its end: starting the DHT node again (try %d of %d)",
                    " ".join(str(exc).split())[:200],
                    attempt + 1,
                    DIAL_BACK_TRIES,
                )
                time.sleep(DIAL_BACK_PAUSE)
                continue
            raise DHTStartError(_start_failure(str(exc), kwargs)) from None
        return dht
    raise AssertionError("unreachable: the last try returns or raises")


def _kill_daemons_of(identity_path: Any) -> list[int]:
    """SIGKILL every libp2p daemon (p2pd) running with `identity_path` (`-id=PATH` on its command line: ours, the
    identity lives in our run directory); the pids killed. Linux only (reads /proc)."""
    if not identity_path or not sys.platform.startswith("linux"):
        return []
    flag = f"-id={identity_path}".encode()
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            if flag in args and os.path.basename(args[0]) == b"p2pd":
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
        except (OSError, IndexError):
            continue
    return killed


def _start_failure(error: str, kwargs: dict[str, Any]) -> str:
    """One line saying why the DHT node did not start, naming the addresses involved."""
    error = " ".join(error.split())
    initial = [str(m) for m in kwargs.get("initial_peers") or []]
    if initial and ("bootstrap peers" in error or "connect" in error):
        return (
            f"could not reach any initial peer (tried {', '.join(initial)}): {error}; check that the bootstrap "
            "node runs, that this address and port reach it from here, and the peer id after /p2p/"
        )
    return f"the DHT node did not start (host_maddrs={kwargs.get('host_maddrs')}): {error}"


def daemon_alive(dht: Any) -> bool:
    """Whether the DHT child process and its libp2p daemon (p2pd) both still run.

    A SIGTERM sent to every process of a node (Slurm's `scancel --signal=TERM`, systemd's control-group stop)
    kills p2pd, whose Go runtime exits on it, while the DHT child, which ignores it, lives on: every DHT call
    then waits out its timeout. Leaving checks this first. Linux reads /proc; elsewhere a live child is enough."""
    pid = getattr(dht, "pid", None)
    if pid is None or not dht.is_alive():
        return False
    if not sys.platform.startswith("linux"):
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                name, _, rest = f.read().rpartition(")")
        except OSError:
            continue
        state, ppid = rest.split()[:2]
        if name.endswith("(p2pd") and int(ppid) == pid and state not in ("Z", "X"):  # a zombie is gone
            return True
    return False


def visible_maddrs(dht: Any, timeout: float = 60.0, stop: threading.Event | None = None) -> list[str]:
    """The DHT's multiaddrs, asked of its process in a thread and waited for at most `timeout` seconds (and no
    longer once `stop` is set). hivemind's own call has no bound: a DHT process whose coroutine failed with an
    exception that does not unpickle (a missing module under its multiaddr codecs was one) drops the reply, and
    the caller, our SIGTERM handler's flag with it, waited forever."""
    answer: dict[str, Any] = {}

    def ask() -> None:
        try:
            answer["maddrs"] = [str(m) for m in dht.get_visible_maddrs()]
        except BaseException as exc:
            answer["error"] = exc

    thread = threading.Thread(target=ask, name="farloco-dht-maddrs", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        if stop is not None and stop.is_set():
            raise DHTStartError("stopped while waiting for the DHT's addresses")
        if time.monotonic() > deadline:
            raise DHTStartError(
                f"the DHT process did not report its addresses in {timeout:.0f} s (its log above says why)"
            )
        thread.join(0.1)
    if "error" in answer:
        raise DHTStartError(f"the DHT process could not report its addresses: {answer['error']}") from answer[
            "error"
        ]
    return list(answer["maddrs"])


def stop_dht(dht: Any) -> None:
    """Stop a DHT started by `make_dht`: hivemind's graceful shutdown (a few seconds at most) while its daemon
    lives, at once when the daemon is or goes away (a graceful shutdown without p2pd only waits out hivemind's
    grace period: a SIGTERM to the whole node reaches p2pd as it reaches us), and for sure (hivemind's own
    fallback is a SIGTERM, which the child ignores: see make_dht)."""
    graceful = None
    if daemon_alive(dht):
        graceful = threading.Thread(target=dht.shutdown, name="farloco-dht-shutdown", daemon=True)
        graceful.start()
        while graceful.is_alive() and daemon_alive(dht):
            graceful.join(0.1)
    if dht.is_alive():
        dht.kill()
    if graceful is not None:
        # Its own join of the child returns once the child is gone: wait for it, so no two threads reap the same
        # child at once (the one whose waitpid comes second gets ECHILD, and multiprocessing then reports a dead
        # child as alive: tests/integration/test_dhtnode.py saw `is_alive()` true right after this returned).
        graceful.join(10)
    dht.join(5)


REACH_TIMEOUT = 4.0  # per dial + ping, and for the routing-table lookup after


async def reach_peers(
    _dht: Any, node: Any, maddrs: tuple[str, ...] = (), timeout: float = REACH_TIMEOUT
) -> int:
    """Run inside the DHT process (`dht.run_coroutine(functools.partial(reach_peers, maddrs=...))`): dial every
    peer in `maddrs` (multiaddrs ending in /p2p/<peer id>), ping it into the routing table, then look up our own
    node id so the routing table fills with the peers near us, as at start-up. Returns how many peers answered.

    An isolated node (protocol/isolation.py) calls this to find its swarm again: after a partition the routing
    tables on both sides have dropped each other, and nobody would dial across by themselves. Every dial, ping and
    the lookup are bounded by `timeout`: one pass that dialled into the cut just before it was mended hung for the
    caller's whole 30 s, and the node rejoined 41 s after its peer had (tests/integration/test_netns_partition.py)."""
    import asyncio

    by_peer = dhtcall.peers_of(maddrs, node.peer_id)

    async def reach(peer: Any, addresses: list[Any]) -> bool:
        return await dhtcall.dial_and_ping(node, peer, addresses, timeout)

    answered = await asyncio.gather(*(reach(p, a) for p, a in by_peer.items()), return_exceptions=True)
    if any(ok is True for ok in answered):
        # Waited for at most `timeout`, never cancelled: hivemind's lookup (dht/traverse.py) leaves a task of its own
        # waiting on an event that a cancelled lookup never sets, destroyed pending later and logged at ERROR
        # ("Task was destroyed but it is pending!", 3 at a time in the chaos runner's frozen-exchange row). Left to
        # run, it ends by hivemind's own request timeouts; the routing table fills on later lookups anyway.
        lookup = asyncio.ensure_future(node.find_nearest_nodes([node.node_id]))
        _LOOKUPS.add(lookup)
        lookup.add_done_callback(_lookup_done)
        await asyncio.wait([lookup], timeout=timeout)
    return sum(ok is True for ok in answered)


_LOOKUPS: set[Any] = set()  # reach_peers' routing-table lookups still running (referenced until they end)


def _lookup_done(lookup: Any) -> None:
    _LOOKUPS.discard(lookup)
    if not lookup.cancelled():
        lookup.exception()  # taken: a lookup that failed is no one's error (the next one tries again)
