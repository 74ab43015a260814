"""Islands: farloco nodes that share a fast fabric reduce among themselves first and cross the slow network once.

An island is the set of nodes whose config names the same `node.island` (and `node.island_endpoint`). They form
one torch.distributed group through torch's own elastic rendezvous (the `c10d` backend of
`torch.distributed.elastic.rendezvous`: a TCPStore at the endpoint, hosted by the node whose address it is,
keep-alive heartbeats, nodes joining a wait list and the group re-formed when one comes or goes), with a gloo
process group over it (the pseudo-gradients live in host memory, where the agent's exchange reads them).

One round r of an island of k nodes (`Island.reduce`, then `Island.gather`):
1. Agreement (the rendezvous store): every node that reached the exchange of round r in group G posts
   (r, G, its weight). The first node that sees all k posts agreeing decides *go* with one compare-and-set; a
   node that times out (`wait` seconds), or sees another post for a later round, another group, or an *out*,
   decides *off* the same way. Whatever was set first holds for everyone. Off: each node exchanges alone this
   round (its own contribution, all of it, its own weight): exactly a node without an island.
2. Go: a reduce-scatter of the weighted contributions (gloo). Node j of the island holds the island's weighted
   mean on its span: slices [j*S/k, (j+1)*S/k) of the run's `island_slices` S, and takes it across the slow
   network with its island's total weight (protocol/exchange/plan.py, Spans): the matching slices of every island
   meet at the same owners, each island node on its own links (no leader carries the island's traffic).
3. An all-gather of one flag per node (did its exchange return the mean of its span?), then, when every flag
   is set, of the means and of what the swarm saw of the island's contribution (for error feedback): every
   node of the island then holds the whole mean, bit-identical with every other node of the swarm. A flag that
   is not set, or a collective that fails (a node died), makes every node of the island sit the round out:
   its round aborts, and the swarm's next state reaches it as for any node that missed a round.

The group lives in one thread of the agent (`farloco-island`), which also re-forms it between rounds when the
rendezvous has nodes waiting, or after a failure: rounds never wait for a rendezvous (a node whose island is
re-forming exchanges alone). Weights: a node's island weight is the sum of its members' weights, so the swarm's
weighted mean is the mean over nodes whatever the island layout (a hierarchical all-reduce: the island reduces first, the swarm second).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger("farloco.island")

GO = "go"
OFF = "off"
# How often a node waiting for the island's posts reads the store.
POLL_SECONDS = 0.005
# Rendezvous settings (seconds; torch takes whole seconds): how long a rendezvous may take, how long it waits for
# more nodes once it has enough, and the keep-alive that finds a node that died (interval x attempts).
JOIN_TIMEOUT = 60
LAST_CALL = 1
KEEP_ALIVE_INTERVAL = 2
KEEP_ALIVE_ATTEMPTS = 3
STORE_TIMEOUT = 10
# Rounds of posts kept in the store behind the current one.
KEEP_ROUNDS = 4
BACKENDS = ("gloo", "nccl")
# NCCL's staging buffers: 16M values (64 MiB) per node of the island, and as much again for the result.
STAGE_ELEMS = 16 << 20


class IslandError(Exception):
    """The island's collective failed this round (a node died, a flag was not set): the round sits out."""


def _skip_bootstrap_store(handler: Any, host: str) -> None:
    """Tell torch's handler that its bootstrap store is set up, so `next_rendezvous` skips it.

    That step is for the workers torchrun launches (rank 0 publishes MASTER_ADDR and a TCPStore of its own); we
    build our group over the rendezvous store itself. torch (2.11-2.13) also does it only on a handler's first
    rendezvous: a node that was rank 0 of an earlier round and is rank 0 again never writes MASTER_ADDR under the
    new round, and a node joining for the first time waited for it until its store timed out, failed its
    rendezvous, and left the first one building a group it never joined: an island of two nodes started a few
    seconds apart formed 95 s late (found by tests/stress.sh). Private attributes, hence the hasattr."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    if hasattr(handler, "_bootstrap_store_info") and hasattr(handler, "_shared_tcp_store_server"):
        handler._bootstrap_store_info = RendezvousStoreInfo(host or "127.0.0.1", 0)
        if handler._shared_tcp_store_server is None:
            handler._shared_tcp_store_server = getattr(handler, "_store", None) or object()


def _is_local(host: str) -> bool:
    """Whether `host` is an address of this machine (or network namespace): one we can bind to."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
                return True
        except OSError:
            continue
    return False


def span_of(rank: int, size: int, slices: int) -> tuple[int, int]:
    """The slices node `rank` of an island of `size` nodes carries across the slow network."""
    return rank * slices // size, (rank + 1) * slices // size


def element_range(numel: int, slices: int, span: tuple[int, int]) -> tuple[int, int]:
    return span[0] * numel // slices, span[1] * numel // slices


@dataclass
class IslandRound:
    """A round the island goes through together (`Island.reduce` said go)."""

    round_id: int
    rank: int
    size: int
    span: tuple[int, int]  # in slices
    bounds: tuple[int, int]  # in elements
    weight: float  # the island's total weight: what this node's exchange carries
    mean: torch.Tensor  # full-size; on `bounds`, the island's weighted mean of the contributions


@dataclass
class _Request:
    kind: str  # "reduce" | "gather"
    args: tuple[Any, ...]
    future: Future[Any] = field(default_factory=Future)
    deadline: float = math.inf  # reduce: not started by then -> alone


class Island:
    """One node's side of its island: the rendezvous, the gloo group and the round protocol, in one thread.

    `reduce` and `gather` are called from the agent's event loop (through `asyncio.wrap_future`) and run in the
    island's thread, one at a time, in order."""

    def __init__(
        self,
        *,
        name: str,
        endpoint: str,
        run_id: str,
        host: str,
        max_nodes: int,
        slices: int,
        wait: float,
        collective_timeout: float,
        is_host: bool | None = None,
        backend: str = "gloo",
        device: str = "cpu",
        stage_elems: int = 0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"island backend: expected one of {BACKENDS}, got {backend!r}")
        self.name = name
        self.endpoint = endpoint
        self.run_id = f"farloco-{run_id}-{name}"
        self.host = host
        self.max_nodes = max_nodes
        self.slices = slices
        self.wait = wait
        self.collective_timeout = collective_timeout
        self.is_host = is_host
        self.backend = backend
        self.device = torch.device(device)
        # NCCL reduces device memory: the host buffers go through a staging buffer of this many values per node
        # (k + 1 of them on the device), piece by piece. gloo works on the host buffers in place (0), except in
        # tests, which stage on the CPU to exercise the same path.
        self.stage_elems = stage_elems or (STAGE_ELEMS if backend == "nccl" else 0)
        self.rank = 0
        self.size = 1
        self.generation = 0  # rendezvous rounds joined
        self.rendezvous_errors = 0
        self.last_error = ""
        self._handler: Any = None
        self._store: Any = None
        self._pg: Any = None
        self._open: IslandRound | None = None  # between a go and its gather
        self._reform = True
        self._closed = threading.Event()
        self._requests: queue.Queue[_Request] = queue.Queue()
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread = threading.Thread(target=self._run, name="farloco-island", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (a collective in progress ends at its timeout) and stop our keep-alive, so the others
        re-form without us once it expires."""
        self._closed.set()
        self._requests.put(_Request("close", ()))
        self._thread.join(timeout=1.0)
        self._drop()

    @property
    def ready(self) -> bool:
        return self._pg is not None

    def view(self) -> dict[str, Any]:
        """For `farloco status`: the island, our rank, its size, the rendezvous round."""
        return {
            "name": self.name,
            "endpoint": self.endpoint,
            "rank": self.rank,
            "size": self.size if self._pg is not None else 0,
            "generation": self.generation,
            "rendezvous_errors": self.rendezvous_errors,
            "last_error": self.last_error,
        }

    # -- the round's calls (any thread) ------------------------------------------------------------------

    def submit_reduce(
        self, round_id: int, group_id: str, contribution: torch.Tensor, weight: float
    ) -> Future[IslandRound | None]:
        """Round `round_id` of group `group_id`: the island's weighted mean on our span (an IslandRound), or
        None: exchange alone this round. Never waits for a rendezvous: a request the thread has not taken up
        within `wait` seconds (it is re-forming the group) answers None."""
        request = _Request("reduce", (round_id, group_id, contribution, weight))
        request.deadline = time.monotonic() + self.wait
        self._requests.put(request)
        return request.future

    def submit_gather(
        self,
        ok: bool,
        mean: torch.Tensor,
        transmitted: torch.Tensor,
        mean_out: torch.Tensor,
        sent_out: torch.Tensor,
    ) -> Future[None]:
        """After the exchange of the open round: `ok` says whether `mean` and `transmitted` hold our span's
        result. Fills `mean_out` and `sent_out` whole, or raises IslandError: some node of the island has no
        result (the island sits the round out)."""
        request = _Request("gather", (ok, mean, transmitted, mean_out, sent_out))
        self._requests.put(request)
        return request.future

    def post_out(self, round_id: int) -> None:
        """We will not reach the exchange of round `round_id` (late, aborted before it): tell the island at once
        instead of letting it wait."""
        self._requests.put(_Request("out", (round_id,)))

    # -- the thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.is_set():
            if self._open is None and (self._reform or self._nodes_waiting()):
                self._rendezvous()
                continue
            try:
                request = self._requests.get(timeout=0.5)
            except queue.Empty:
                continue
            if request.kind == "close":
                return
            if not request.future.set_running_or_notify_cancel():
                continue
            try:
                if request.kind == "reduce":
                    request.future.set_result(self._reduce(request))
                elif request.kind == "gather":
                    self._gather(*request.args)
                    request.future.set_result(None)
                else:
                    self._post(request.args[0], {"out": True})
                    request.future.set_result(None)
            except BaseException as exc:  # the round's await gets it
                request.future.set_exception(exc)

    def _nodes_waiting(self) -> bool:
        if self._handler is None:
            return True
        try:
            return bool(self._handler.num_nodes_waiting() > 0)
        except Exception as exc:  # the store is gone: re-form
            self._failed(f"rendezvous store: {exc}")
            return True

    def _rendezvous(self) -> None:
        """Join the next round of the island's rendezvous and build the gloo group over it. On failure, wait a
        little and try again later: rounds meanwhile exchange alone."""
        from torch.distributed import PrefixStore  # type: ignore[attr-defined]
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        self._pg = None
        self._fail_pending()
        try:
            if self._handler is None:
                self._handler = self._make_handler(get_rendezvous_handler, RendezvousParameters)
            _skip_bootstrap_store(self._handler, self.host)
            info = self._handler.next_rendezvous()
            store = PrefixStore("farloco-island", info.store)
            self._pg = self._make_group(store, info.rank, info.world_size)
            self._store = store
            self.rank, self.size = info.rank, info.world_size
            self.generation += 1
            self._reform = False
            log.info(
                "island %s: rank %d of %d (rendezvous round %d)",
                self.name,
                self.rank,
                self.size,
                self.generation,
            )
        except Exception as exc:  # the rounds go on alone; the next try may work
            self._failed(f"rendezvous at {self.endpoint}: {type(exc).__name__}: {exc}")
            self._handler = None
            self._closed.wait(min(30.0, 2.0 * min(self.rendezvous_errors, 5)))

    def _make_group(self, store: Any, rank: int, size: int) -> Any:
        """The island's process group over the rendezvous store: gloo bound to our address, or NCCL on our
        device (node.island_backend)."""
        timeout = timedelta(seconds=self.collective_timeout)
        if self.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            torch.cuda.set_device(self.device)
            nccl_options = ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            return ProcessGroupNCCL(store, rank, size, nccl_options)
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [
            ProcessGroupGloo.create_device(hostname=self.host)
            if self.host
            else ProcessGroupGloo.create_default_device()
        ]
        return ProcessGroupGloo(store, rank, size, options)

    def _device_buffer(self, name: str, numel: int) -> torch.Tensor:
        key = f"device-{name}"
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=torch.float32, device=self.device)
            self._buffers[key] = buffer
        return buffer[:numel]

    def _reduce_scatter(self, out: torch.Tensor, padded: torch.Tensor, block: int) -> None:
        """`out` (block values) = the island's sum of row `rank` of every node's `padded` (size x block)."""
        if not self.stage_elems:
            self._pg._reduce_scatter_base(out, padded).wait()
            return
        rows = padded.view(self.size, block)
        step = self.stage_elems
        staged_in, staged_out = self._device_buffer("in", self.size * step), self._device_buffer("out", step)
        for start in range(0, block, step):
            n = min(step, block - start)
            staged = staged_in[: self.size * n].view(self.size, n)
            staged.copy_(rows[:, start : start + n])
            self._pg._reduce_scatter_base(staged_out[:n], staged_in[: self.size * n]).wait()
            out[start : start + n].copy_(staged_out[:n])

    def _all_gather(self, gathered: torch.Tensor, mine: torch.Tensor, block: int) -> None:
        """Row r of `gathered` (size x block) = node r's `mine` (block values)."""
        if not self.stage_elems:
            self._pg._allgather_base(gathered, mine).wait()
            return
        rows = gathered.view(self.size, block)
        step = self.stage_elems
        staged_all, staged_mine = (
            self._device_buffer("in", self.size * step),
            self._device_buffer("out", step),
        )
        for start in range(0, block, step):
            n = min(step, block - start)
            staged_mine[:n].copy_(mine[start : start + n])
            self._pg._allgather_base(staged_all[: self.size * n], staged_mine[:n]).wait()
            rows[:, start : start + n].copy_(staged_all[: self.size * n].view(self.size, n))

    def _make_handler(self, get_rendezvous_handler: Any, parameters: Any) -> Any:
        """torch's c10d rendezvous handler for the island. The node whose address the endpoint is hosts the
        store: torch guesses that from the host name, which inside a container or a network namespace names
        another address, so we try to host it whenever the endpoint is one of our addresses, and fall back to
        joining as a client when another node of this host got there first (the port is taken)."""
        host = self.endpoint.rsplit(":", 1)[0].strip("[]")
        candidates = (
            [self.is_host] if self.is_host is not None else ([True, False] if _is_local(host) else [False])
        )
        error: Exception | None = None
        for is_host in candidates:
            try:
                return get_rendezvous_handler(
                    parameters(
                        backend="c10d",
                        endpoint=self.endpoint,
                        run_id=self.run_id,
                        min_nodes=1,
                        max_nodes=self.max_nodes,
                        local_addr=self.host or None,
                        join_timeout=JOIN_TIMEOUT,
                        last_call_timeout=LAST_CALL,
                        keep_alive_interval=KEEP_ALIVE_INTERVAL,
                        keep_alive_max_attempt=KEEP_ALIVE_ATTEMPTS,
                        read_timeout=STORE_TIMEOUT,
                        is_host=is_host,
                    )
                )
            except Exception as exc:
                error = exc
        assert error is not None
        raise error

    def _failed(self, what: str) -> None:
        self.rendezvous_errors += 1
        self.last_error = what
        self._reform = True
        self._pg = None
        log.warning("island %s: %s", self.name, what)

    def _fail_pending(self) -> None:
        """Requests queued while we re-form: a reduce answers alone, a gather fails (its round was open before)."""
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return
            if request.kind == "close":
                self._requests.put(request)
                return
            if request.future.set_running_or_notify_cancel():
                if request.kind == "gather":
                    request.future.set_exception(
                        IslandError("the island re-formed before the round's gather")
                    )
                else:
                    request.future.set_result(None)

    def _drop(self) -> None:
        self._pg = None
        self._store = None
        handler, self._handler = self._handler, None
        if handler is not None:
            with contextlib.suppress(Exception):
                handler._stop_heartbeats()  # torch has no public "this node leaves"; its keep-alive expires

    def _post(self, round_id: int, value: dict[str, Any]) -> None:
        if self._store is None:
            return
        self._store.set(f"h{round_id}/{self.rank}", json.dumps(value))
        self._store.set(f"at/{self.rank}", str(round_id))
        old = round_id - KEEP_ROUNDS
        if old >= 0:
            self._store.delete_key(f"h{old}/{self.rank}")
            if self.rank == 0:
                self._store.delete_key(f"d{old}")

    def _decide(self, round_id: int, group_id: str, deadline: float) -> tuple[str, list[dict[str, Any]]]:
        """Wait for every node's post for this round; set the decision (first set wins) and return it."""
        store = self._store
        key = f"d{round_id}"
        heads = [f"h{round_id}/{rank}" for rank in range(self.size)]
        while True:
            if store.check([key]):
                decision = store.get(key).decode()
                break
            verdict = None
            if store.check(heads):
                posts = [json.loads(store.get(h)) for h in heads]
                good = all(not p.get("out") and p.get("g") == group_id for p in posts)
                verdict = GO if good else OFF
            elif time.monotonic() >= deadline:
                verdict = OFF
            elif any(
                int(store.get(f"at/{rank}")) > round_id
                for rank in range(self.size)
                if rank != self.rank and store.check([f"at/{rank}"])
            ):
                verdict = OFF  # another node is past this round already
            if verdict is not None:
                decision = store.compare_set(key, "", verdict).decode()
                break
            time.sleep(POLL_SECONDS)
        if decision != GO:
            if time.monotonic() >= deadline:
                self._reform = True  # someone never came: maybe gone; re-form between rounds
            return decision, []
        return decision, [json.loads(store.get(h)) for h in heads]

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=torch.float32)
            self._buffers[name] = buffer
        return buffer[:numel]

    def _reduce(self, request: _Request) -> IslandRound | None:
        round_id, group_id, contribution, weight = request.args
        if self._pg is None or self.size == 1 or time.monotonic() > request.deadline:
            if self._pg is not None and self.size > 1:
                self._post(round_id, {"out": True})
            return None
        try:
            self._post(round_id, {"g": group_id, "w": weight})
            decision, posts = self._decide(round_id, group_id, time.monotonic() + self.wait)
        except Exception as exc:  # the store is gone
            self._failed(f"island store: {type(exc).__name__}: {exc}")
            return None
        if decision != GO:
            return None
        numel = contribution.numel()
        spans = [span_of(rank, self.size, self.slices) for rank in range(self.size)]
        ranges = [element_range(numel, self.slices, span) for span in spans]
        block = max(hi - lo for lo, hi in ranges)
        # Each node's slice of our weighted contribution at its place in a padded layout, then one
        # reduce-scatter: node j receives the island's sum on its slice.
        padded = self._buffer("padded", block * self.size)
        for rank, (lo, hi) in enumerate(ranges):
            torch.mul(contribution[lo:hi], weight, out=padded[rank * block : rank * block + hi - lo])
            padded[rank * block + hi - lo : (rank + 1) * block].zero_()
        summed = self._buffer("summed", block)
        lo, hi = ranges[self.rank]
        total = math.fsum(float(p["w"]) for p in posts)
        self._open = IslandRound(
            round_id, self.rank, self.size, spans[self.rank], (lo, hi), total, self._buffer("mean", numel)
        )
        try:
            self._reduce_scatter(summed, padded, block)
        except Exception as exc:  # a node died mid-collective: everyone alone, then re-form
            self._open = None
            self._failed(f"reduce-scatter of round {round_id}: {exc}")
            return None
        torch.div(summed[: hi - lo], total, out=self._open.mean[lo:hi])
        return self._open

    def _gather(
        self,
        ok: bool,
        mean: torch.Tensor,
        transmitted: torch.Tensor,
        mean_out: torch.Tensor,
        sent_out: torch.Tensor,
    ) -> None:
        current, self._open = self._open, None
        if current is None:
            raise IslandError("no island round is open")
        try:
            flags = torch.zeros(self.size, dtype=torch.float32)
            self._all_gather(flags, torch.tensor([1.0 if ok else 0.0]), 1)
            if not bool((flags == 1.0).all()):
                missing = [rank for rank in range(self.size) if flags[rank] != 1.0]
                raise IslandError(
                    f"round {current.round_id}: island nodes {missing} have no mean of their slices"
                )
            numel = mean_out.numel()
            ranges = [
                element_range(numel, self.slices, span_of(r, self.size, self.slices))
                for r in range(self.size)
            ]
            block = max(hi - lo for lo, hi in ranges)
            lo, hi = current.bounds
            padded = self._buffer("padded", block * self.size)
            mine = self._buffer("summed", block)
            for source, target in ((mean, mean_out), (transmitted, sent_out)):
                mine[: hi - lo].copy_(source[lo:hi])
                self._all_gather(padded, mine, block)
                for rank, (a, b) in enumerate(ranges):
                    target[a:b].copy_(padded[rank * block : rank * block + b - a])
        except IslandError:
            raise
        except Exception as exc:  # a node died: the island sits the round out, then re-forms
            self._failed(f"all-gather of round {current.round_id}: {exc}")
            raise IslandError(f"round {current.round_id}: the island's all-gather failed: {exc}") from None
