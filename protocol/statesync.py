"""State transfer to joiners: a donor serves its outer state over the `GetState` stream; a joiner fetches it.

Wire (all frames, see rpc.py; nothing is pickled):
- request: one frame, header `{"ranges": [[name, start, end], ...], "manifest_id": str}`. No ranges asks for
  the manifest only. `manifest_id` (when given) pins the state the ranges refer to. A donor that moved to a new
  round keeps serving the state it replaced for as long as a transfer of it goes on (the one snapshot before
  the current one, released `keep_seconds` after its last request): a transfer slower than a round still ends.
  Any older state is refused with FAILED_PRECONDITION / STATE_CHANGED rather than mixing two rounds.
- answer: a manifest frame (header `{"kind": "manifest"}`, payload = msgpack of
  `{"meta": {...}, "tensors": [{"name", "dtype", "shape", "nbytes", "sha256"}], "chunk_bytes": int}`), then
  for each range its bytes in chunks of at most 1 MiB: header `{"kind": "chunk", "name", "offset", "crc32"}`,
  payload = the tensor's raw little-endian bytes at [offset, offset + len).
Each of these is a typed message (`StateRequest`, `Manifest` with its `TensorEntry`s, `StateChunk`) decoded with
the field checks of `farloco.protocol.messages`.

The joiner (`fetch_state`) reads every donor's manifest, keeps the donors of the highest round that agree on
one manifest, checks sizes/dtypes/shapes against its limits *before* allocating, then lets each donor pull
segments of at most `segment_bytes` from a shared queue (so a fast donor serves more). Every chunk's crc32 is
checked as it arrives; a donor that fails or sends a bad chunk is dropped and the rest of its segment goes back
on the queue for the others (resume by byte range). At the end every tensor's digest must match the manifest
(its `sha256` fields hold `farloco.protocol.digest`'s sha256 tree hash: for theta, the value of `outer_hash`).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import math
import sys
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import msgpack
import numpy as np
import torch

from farloco.protocol import digest
from farloco.protocol.messages import Fields, WireError, check_int, check_str
from farloco.protocol.rpc import CallContext, Frame, Reject, RpcClient, RpcError, RpcServer
from farloco.protocol.types import DTYPES
from farloco.util.tasks import wait_for

logger = logging.getLogger(__name__)

METHOD = "GetState"
CHUNK_BYTES = 1 << 20
SEGMENT_BYTES = 8 << 20  # bytes per request: large enough to amortise a stream, small enough to rebalance
KEEP_SECONDS = 30.0  # a replaced snapshot is served this long after the last request that pinned it
DEFAULT_MAX_TOTAL_BYTES = 16 << 30
DEFAULT_MAX_TENSORS = 65536
MAX_MANIFEST_BYTES = 6 << 20  # must fit in one gRPC message (8 MiB by default)

# Wire dtype names; only plain numeric types travel (no object/complex/quantised tensors).
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

_State = tuple[dict[str, Any], dict[str, torch.Tensor]]
StateProvider = Callable[[], _State | Awaitable[_State]]
"""What `StateServer` serves: (meta, tensors), or a coroutine giving them (an agent waits out a commit)."""

if sys.byteorder != "little":  # raw tensor bytes travel as they sit in memory
    raise ImportError("farloco.protocol.statesync needs a little-endian host")


class StateSyncError(Exception):
    """A state fetch failed: no usable donor, a manifest over our limits, or data that does not verify."""


MAX_NAME = 1024  # characters of a tensor name
MAX_DIMS = 16
MAX_RANGES = 1 << 16  # ranges one request may ask for


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the manifest."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sha256: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "sha256": self.sha256,
        }

    @classmethod
    def from_wire(cls, data: object, where: str) -> TensorEntry:
        """Decode a manifest's tensor entry; its nbytes must be what its dtype and shape take (`WireError`)."""
        fields = Fields(data, where, ("name", "dtype", "shape", "nbytes", "sha256"))
        name = fields.text("name", min_len=1, max_len=MAX_NAME)
        dtype = fields.choice("dtype", sorted(DTYPES))
        shape = tuple(fields.items("shape", check_int, max_len=MAX_DIMS))
        itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
        expected = math.prod(shape) * itemsize
        nbytes = fields.raw("nbytes")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes != expected:
            raise WireError(
                fields.at("nbytes"), f"{expected} (shape {list(shape)} x {itemsize} bytes)", nbytes
            )
        return cls(name, dtype, shape, nbytes, fields.hex("sha256", exact=64))


@dataclass(frozen=True)
class Manifest:
    """What a donor serves: the provider's meta (round_id, run_hash, ...) and its tensors' layout and hashes.

    On the wire: the payload of the answer's first frame, msgpack of `{meta, tensors, chunk_bytes}`."""

    meta: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    chunk_bytes: int

    @property
    def round_id(self) -> int:
        return int(self.meta["round_id"])

    @property
    def manifest_id(self) -> str:
        """sha256 over the round, run hash and every tensor's name, dtype, shape and hash."""
        summary = hashlib.sha256(f"{self.round_id}\0{self.meta.get('run_hash', '')}".encode())
        for t in self.tensors:
            summary.update(f"\0{t.name}\0{t.dtype}\0{list(t.shape)}\0{t.sha256}".encode())
        return summary.hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def encode(self) -> bytes:
        wire = {
            "meta": self.meta,
            "tensors": [t.to_wire() for t in self.tensors],
            "chunk_bytes": self.chunk_bytes,
        }
        return bytes(msgpack.packb(wire, use_bin_type=True))

    @classmethod
    def decode(
        cls,
        payload: bytes | memoryview,
        *,
        max_total_bytes: int,
        max_tensors: int,
        max_chunk_bytes: int = 4 * CHUNK_BYTES,
    ) -> Manifest:
        """Decode and check a manifest against our limits (StateSyncError naming the field); nothing is
        allocated for the tensors here."""
        if len(payload) > MAX_MANIFEST_BYTES:
            raise _fail("manifest", f"at most {MAX_MANIFEST_BYTES} bytes", f"{len(payload)} bytes")
        try:
            wire = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_array_len=max_tensors + 16)
        except Exception as error:  # msgpack raises several unrelated types on bad input
            raise _fail("manifest", "valid msgpack", f"{type(error).__name__}: {error}") from None
        try:
            fields = Fields(wire, "manifest", ("meta", "tensors", "chunk_bytes"))
            meta = fields.raw("meta")
            if not isinstance(meta, dict):
                raise WireError(fields.at("meta"), "a map with round_id: int >= 0", meta)
            Fields.loose(meta, fields.at("meta")).integer("round_id")
            chunk_bytes = fields.integer("chunk_bytes", low=1, high=max_chunk_bytes)
            entries = fields.items("tensors", TensorEntry.from_wire, max_len=max_tensors)
        except WireError as error:
            raise StateSyncError(str(error)) from None
        names = [t.name for t in entries]
        if len(set(names)) != len(names):
            raise _fail("manifest.tensors", "unique names", sorted(n for n in names if names.count(n) > 1))
        total = 0
        for entry in entries:
            total += entry.nbytes
            if total > max_total_bytes:
                raise _fail(
                    "manifest",
                    f"a state of at most max_total_bytes={max_total_bytes}",
                    f"more than {total} bytes",
                )
        return cls(meta, tuple(entries), chunk_bytes)


@dataclass(frozen=True)
class StateRequest:
    """A `GetState` request: the byte ranges `[name, start, end)` wanted (none: the manifest only), of the state
    `manifest_id` pins (None: the donor's current one). Whether a range lies within a tensor is the donor's
    check."""

    ranges: tuple[tuple[str, int, int], ...] = ()
    manifest_id: str | None = None

    def encode(self) -> dict[str, Any]:
        header: dict[str, Any] = {"ranges": [list(r) for r in self.ranges]}
        if self.manifest_id is not None:
            header["manifest_id"] = self.manifest_id
        return header

    @classmethod
    def decode(cls, header: dict[str, Any]) -> StateRequest:
        """Decode a request frame's header; `Reject` (INVALID_ARGUMENT, BAD_RANGE or BAD_REQUEST) if malformed."""
        fields = Fields.loose(header, "request")
        try:
            ranges = fields.items("ranges", _check_range, max_len=MAX_RANGES) if fields.has("ranges") else []
        except WireError as error:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, "BAD_RANGE", str(error)) from None
        try:
            pinned = None if fields.raw("manifest_id") is None else fields.hex("manifest_id", exact=64)
        except WireError as error:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST", str(error)) from None
        return cls(tuple(ranges), pinned)


def _check_range(value: object, where: str) -> tuple[str, int, int]:
    if not isinstance(value, list) or len(value) != 3:
        raise WireError(where, "[name, start, end]", value)
    return (
        check_str(value[0], f"{where}.name", min_len=1, max_len=MAX_NAME),
        check_int(value[1], f"{where}.start"),
        check_int(value[2], f"{where}.end"),
    )


@dataclass(frozen=True)
class StateChunk:
    """The header of an answer's chunk frame: the payload is tensor `name`'s bytes from `offset`, of CRC-32
    `crc32`."""

    name: str
    offset: int
    crc32: int

    def encode(self) -> dict[str, Any]:
        return {"kind": "chunk", "name": self.name, "offset": self.offset, "crc32": self.crc32}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> StateChunk:
        """Decode a chunk frame's header; `WireError` naming the bad field."""
        fields = Fields(header, "chunk", ("kind", "name", "offset", "crc32"))
        fields.choice("kind", ("chunk",))
        return cls(
            fields.text("name", min_len=1, max_len=MAX_NAME),
            fields.integer("offset"),
            fields.integer("crc32", high=0xFFFFFFFF),
        )


MANIFEST_HEADER = {"kind": "manifest"}  # the header of an answer's first frame (the manifest is its payload)


def _fail(where: str, expected: str, got: object) -> StateSyncError:
    return StateSyncError(f"{where}: expected {expected}, got {got!r:.200}")


def _raw_bytes(tensor: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The tensor's bytes as a flat uint8 array (little-endian, row-major), without a copy when contiguous."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _digests(buffers: Mapping[str, np.ndarray[Any, np.dtype[np.uint8]]]) -> dict[str, str]:
    """Every buffer's digest (`farloco.protocol.digest`: the value theta's `outer_hash` is), over the agent's
    threads (`farloco.util.parallel`)."""
    return {name: digest.digest(b.data) for name, b in buffers.items()}


# --------------------------------------------------------------------------------------------- donor


class _Served:
    """One snapshot as served: its manifest, raw bytes, and when a request last asked for it (monotonic)."""

    def __init__(self, manifest: Manifest, raw: dict[str, np.ndarray[Any, np.dtype[np.uint8]]]) -> None:
        self.round_id = manifest.round_id
        self.manifest = manifest
        self.raw = raw
        self.used = time.monotonic()


class StateServer:
    """Serves the node's outer state on `GetState`; `provider()` returns `(meta, tensors)`, or a coroutine that
    does.

    meta must hold `round_id` (int) and `run_hash` (str) plus anything msgpack-able (the run config...).
    The provider must return a snapshot that stays unchanged for as long as its round_id does, and a new one
    (not the same tensors changed in place) for a new round_id: hashes are computed once per round_id (in a
    worker thread) and reused for every joiner of that round, and the snapshot a new round replaced is still
    served to transfers that pinned it (at most one such, held `keep_seconds` after its last request: memory of
    one more copy of the state, only while a joiner slower than a round fetches it).
    """

    def __init__(
        self,
        provider: StateProvider,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        on_served: Callable[[int], None] | None = None,
        keep_seconds: float = KEEP_SECONDS,
    ) -> None:
        self.provider = provider
        self.chunk_bytes = chunk_bytes
        # Called with `bytes_served` after each chunk went out: the agent's fault injector uses it to make a
        # donor die mid-transfer; nothing else needs it.
        self.on_served = on_served
        self.keep_seconds = keep_seconds
        self.bytes_served = 0
        self._cache: _Served | None = None
        self._kept: _Served | None = None  # the snapshot the current one replaced, while transfers pin it
        self._release: asyncio.TimerHandle | None = None
        self._lock = asyncio.Lock()

    @property
    def kept_round(self) -> int | None:
        """The round of the replaced snapshot still served to pinned transfers (None: none is held)."""
        return None if self._kept is None else self._kept.round_id

    def _keep(self, old: _Served) -> None:
        """Hold the snapshot a new round replaced if a request asked for it lately, else drop it."""
        self._kept = old if time.monotonic() - old.used < self.keep_seconds else None
        if self._kept is not None and self._release is None:
            self._release = asyncio.get_running_loop().call_later(self.keep_seconds, self._expire)

    def _expire(self) -> None:
        self._release = None
        kept = self._kept
        if kept is None:
            return
        idle = time.monotonic() - kept.used
        if idle >= self.keep_seconds:
            logger.debug("released the state of round %d (no request for %.0f s)", kept.round_id, idle)
            self._kept = None
        else:
            self._release = asyncio.get_running_loop().call_later(self.keep_seconds - idle, self._expire)

    def register(self, server: RpcServer) -> None:
        server.add_stream(METHOD, self.handle)

    async def snapshot(self) -> tuple[Manifest, dict[str, np.ndarray[Any, np.dtype[np.uint8]]]]:
        """The current manifest and raw bytes (hashes cached per round_id)."""
        async with self._lock:
            provided = self.provider()
            meta, tensors = await provided if inspect.isawaitable(provided) else provided
            round_id = meta.get("round_id")
            if not isinstance(round_id, int) or not isinstance(meta.get("run_hash"), str):
                raise Reject(
                    grpc.StatusCode.UNAVAILABLE,
                    "NO_STATE",
                    f"state meta lacks round_id/run_hash: {sorted(meta)}",
                )
            if self._cache is not None and self._cache.round_id == round_id:
                self._cache.used = time.monotonic()
                return self._cache.manifest, self._cache.raw
            raw = {name: _raw_bytes(t) for name, t in tensors.items()}
            hashes = await asyncio.to_thread(_digests, raw)
            entries = []
            for name, tensor in tensors.items():
                if tensor.dtype not in _DTYPE_NAMES:
                    raise Reject(
                        grpc.StatusCode.INTERNAL,
                        "BAD_STATE",
                        f"tensor {name} has unsupported dtype {tensor.dtype}",
                    )
                entries.append(
                    TensorEntry(
                        name,
                        _DTYPE_NAMES[tensor.dtype],
                        tuple(tensor.shape),
                        int(raw[name].nbytes),
                        hashes[name],
                    )
                )
            manifest = Manifest({**meta, "sha256": hashes}, tuple(entries), self.chunk_bytes)
            if self._cache is not None:
                self._keep(self._cache)
            self._cache = _Served(manifest, raw)
            return manifest, raw

    def _pinned(self, manifest_id: object) -> _Served | None:
        for served in (self._cache, self._kept):
            if served is not None and served.manifest.manifest_id == manifest_id:
                return served
        return None

    async def handle(self, ctx: CallContext, requests: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
        """The `GetState` stream handler: manifest, then the requested ranges in crc32-checked chunks."""
        request = await anext(requests, None)
        if request is None:
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                "BAD_REQUEST",
                "GetState expects one request frame, got none",
            )
        asked = StateRequest.decode(request.header)
        pinned = asked.manifest_id
        served = self._pinned(pinned) if pinned is not None else None
        if served is not None:  # the state this transfer began on, current or kept: no new snapshot needed
            served.used = time.monotonic()
            manifest, raw = served.manifest, served.raw
        else:
            manifest, raw = await self.snapshot()
        if pinned is not None and pinned != manifest.manifest_id:
            kept = "" if self._kept is None else f"; it keeps only round {self._kept.round_id}'s besides"
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                "STATE_CHANGED",
                f"requested state {str(pinned)[:16]}, this donor now serves round {manifest.round_id} "
                f"({manifest.manifest_id[:16]}){kept}",
            )
        for name, start, end in asked.ranges:
            if name not in raw or not start < end <= raw[name].nbytes:
                raise Reject(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "BAD_RANGE",
                    f"expected [name, start, end] within a tensor, got {[name, start, end]!r:.120}",
                )
        yield Frame(dict(MANIFEST_HEADER), manifest.encode())
        for name, start, end in asked.ranges:
            data = raw[name].data
            for offset in range(start, end, self.chunk_bytes):
                payload = data[offset : min(offset + self.chunk_bytes, end)]
                self.bytes_served += len(payload)
                yield Frame(StateChunk(name, offset, zlib.crc32(payload)).encode(), payload)
                if self.on_served is not None:
                    self.on_served(self.bytes_served)


# --------------------------------------------------------------------------------------------- joiner


async def _one_request(frame: Frame) -> AsyncIterator[Frame]:
    yield frame


def _choose(manifests: Mapping[str, Manifest], expect_run_hash: str | None) -> tuple[Manifest, list[str]]:
    """Donors of the highest round that agree on one manifest (the largest such set; ties by manifest id)."""
    usable = {
        d: m
        for d, m in manifests.items()
        if expect_run_hash is None or m.meta.get("run_hash") == expect_run_hash
    }
    if not usable:
        raise StateSyncError(
            f"no donor serves run_hash={expect_run_hash}: got "
            + ", ".join(f"{d}: {m.meta.get('run_hash')!r}" for d, m in manifests.items())
        )
    top = max(m.round_id for m in usable.values())
    by_id: dict[str, list[str]] = {}
    for donor, manifest in usable.items():
        if manifest.round_id == top:
            by_id.setdefault(manifest.manifest_id, []).append(donor)
    chosen_id, donors = min(by_id.items(), key=lambda item: (-len(item[1]), item[0]))
    if len(by_id) > 1:
        logger.warning("donors disagree on the state of round %d; using %s (%s)", top, chosen_id[:16], donors)
    return usable[donors[0]], donors


@dataclass
class _Segment:
    name: str
    start: int
    end: int


async def fetch_state(
    client: RpcClient,
    donors: list[str],
    *,
    timeout: float,
    on_progress: Callable[[int, int], None] | None = None,
    expect_run_hash: str | None = None,
    vouched: Mapping[int, Collection[str]] | None = None,
    on_refused: Callable[[str, str, str], None] | None = None,
    layout: Mapping[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]] | None = None,
    check: Callable[[dict[str, Any], dict[str, torch.Tensor]], str | None] | None = None,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    max_tensors: int = DEFAULT_MAX_TENSORS,
    segment_bytes: int = SEGMENT_BYTES,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Download a donor's outer state, from several donors in parallel; returns `(meta, tensors)`.

    meta is the donor's meta plus `sha256` (tensor name -> hex). `on_progress(done_bytes, total_bytes)` is
    called once the manifest is chosen (done_bytes=0) and after every crc-checked chunk, from the event loop
    (keep it cheap: a progress bar update); bytes a failed donor delivered are kept, so done_bytes never goes
    back (but for a transfer retried donor by donor, below, which starts again from 0).

    `vouched`: round id -> the theta hashes the swarm's members publish for that round (their signed records,
    what they announced over the links). A donor whose manifest's theta is not vouched for its round is refused
    before a byte is fetched: `WRONG_STATE` when the round's members vouch for another hash (a poisoned donor),
    `UNVOUCHED_ROUND` when none speaks for that round yet (a donor a round ahead of what we read: asking again
    shortly finds it vouched). When the downloaded tensors do not hash to the manifest and several donors served
    them, each is asked alone in turn (the manifest they agreed on is the reference): a donor whose own transfer
    fails the check is refused (`BAD_STATE_DATA`), and the first that passes gives the state, so one donor
    serving wrong bytes under the right manifest cannot stop a join. `on_refused(donor, reason, detail)` hears
    of every refusal. Raises StateSyncError when no donor can serve a consistent, verified state within
    `timeout` seconds.

    What the state must be for the caller to install it: `layout` (tensor name -> (the dtypes it may come in,
    shape)) is checked
    against each manifest before a byte is fetched (`WRONG_LAYOUT`); `check(meta, tensors)` on the verified
    tensors (in a worker thread: it may read them all, for finiteness say) returns None or what is wrong with
    them, which refuses every donor that served that manifest (`BAD_STATE_VALUES`: their bytes were its bytes)
    and the next manifest's donors are asked. A theta the swarm vouches for does not vouch for the strategy
    state beside it: without these a donor could serve a NaN momentum the joiner's install would refuse only
    after the fetch, with no other donor tried.
    """
    if not donors:
        raise StateSyncError("fetch_state needs at least one donor address, got none")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    failures: dict[str, str] = {}

    def refuse(donor: str, reason: str, detail: str) -> None:
        failures[donor] = f"{reason}: {detail}"
        logger.warning("state donor %s refused (%s): %s", donor, reason, detail)
        if on_refused is not None:
            on_refused(donor, reason, detail)

    async def manifest_of(donor: str) -> Manifest | None:
        try:
            async for frame in client.stream(
                donor,
                METHOD,
                _one_request(Frame(StateRequest().encode())),
                round_id=0,
                timeout=max(deadline - loop.time(), 0.001),
            ):
                if frame.header != MANIFEST_HEADER:
                    raise _fail(f"first frame from {donor}", "a manifest", frame.header)
                return Manifest.decode(
                    frame.payload, max_total_bytes=max_total_bytes, max_tensors=max_tensors
                )
            raise _fail(f"answer from {donor}", "a manifest frame", "an empty stream")
        except (RpcError, StateSyncError) as error:
            failures[donor] = str(error)
            return None

    found = await asyncio.gather(*(manifest_of(d) for d in dict.fromkeys(donors)))
    manifests = {d: m for d, m in zip(dict.fromkeys(donors), found, strict=True) if m is not None}
    if vouched is not None:
        for donor, candidate in list(manifests.items()):
            theta = next((t.sha256 for t in candidate.tensors if t.name == "theta"), "")
            hashes = set(vouched.get(candidate.round_id, ()))
            if theta in hashes:
                continue
            del manifests[donor]
            if hashes:
                refuse(
                    donor,
                    "WRONG_STATE",
                    f"serves round {candidate.round_id} with theta {theta[:16]}; the round's members vouch for "
                    f"{sorted(h[:16] for h in hashes)}",
                )
            else:
                refuse(
                    donor,
                    "UNVOUCHED_ROUND",
                    f"serves round {candidate.round_id}, for which no member vouches yet",
                )
    if layout is not None:
        for donor, candidate in list(manifests.items()):
            problem = _layout_problem(candidate, layout)
            if problem is not None:
                del manifests[donor]
                refuse(donor, "WRONG_LAYOUT", problem)
    while True:
        if not manifests:
            raise StateSyncError(f"no donor answered with a usable manifest: {failures}")
        manifest, chosen = _choose(manifests, expect_run_hash)
        tensors = await _download_verified(
            client, manifest, chosen, deadline, failures, refuse, on_progress, segment_bytes
        )
        meta = dict(manifest.meta)
        problem = None if check is None else await asyncio.to_thread(check, meta, tensors)
        if problem is None:
            return meta, tensors
        for donor in chosen:
            del manifests[donor]
            refuse(donor, "BAD_STATE_VALUES", problem)


def _layout_problem(
    manifest: Manifest, layout: Mapping[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]]
) -> str | None:
    """What in `manifest` differs from the expected tensor layout (name -> (dtypes, shape)), or None."""
    served = {t.name: (DTYPES[t.dtype], tuple(t.shape)) for t in manifest.tensors}
    if served.keys() != layout.keys():
        return (
            f"expected tensors {sorted(layout)}, got {sorted(served)} (missing {sorted(layout.keys() - served)}, "
            f"unexpected {sorted(served.keys() - layout)})"
        )
    for name, (dtypes, shape) in layout.items():
        got_dtype, got_shape = served[name]
        if got_dtype not in dtypes or got_shape != tuple(shape):
            expected = " or ".join(str(dtype) for dtype in dtypes)
            return f"tensor {name}: expected {expected} {list(shape)}, got {got_dtype} {list(got_shape)}"
    return None


async def _download_verified(
    client: RpcClient,
    manifest: Manifest,
    chosen: list[str],
    deadline: float,
    failures: dict[str, str],
    refuse: Callable[[str, str, str], None],
    on_progress: Callable[[int, int], None] | None,
    segment_bytes: int,
) -> dict[str, torch.Tensor]:
    """The tensors of `manifest` from `chosen`, hash-verified. When they do not hash to the manifest and several
    donors served them, each is asked alone in turn, and the first whose own transfer verifies gives them; a
    donor whose does not is refused (`BAD_STATE_DATA`). StateSyncError when none does."""

    async def download(donors: list[str]) -> dict[str, torch.Tensor]:
        return await _download(
            client, manifest, donors, deadline, failures, on_progress=on_progress, segment_bytes=segment_bytes
        )

    try:
        return await download(chosen)
    except _BadData as bad:
        if len(chosen) == 1:
            refuse(chosen[0], "BAD_STATE_DATA", str(bad))
            raise StateSyncError(str(bad)) from None
        logger.warning("%s: asking each donor alone", bad)
        for donor in chosen:
            try:
                return await download([donor])
            except _BadData as alone:
                refuse(donor, "BAD_STATE_DATA", str(alone))
            except StateSyncError as error:
                failures[donor] = str(error)
        raise StateSyncError(
            f"no donor of round {manifest.round_id} served data matching its manifest: {failures}"
        ) from None


class _BadData(StateSyncError):
    """The downloaded tensors do not hash to the manifest every donor of the transfer agreed on."""


async def _download(
    client: RpcClient,
    manifest: Manifest,
    chosen: list[str],
    deadline: float,
    failures: dict[str, str],
    *,
    on_progress: Callable[[int, int], None] | None,
    segment_bytes: int,
) -> dict[str, torch.Tensor]:
    """The tensors of `manifest` from the donors `chosen` (a shared queue of segments), crc-checked per chunk and
    sha256-checked at the end (`_BadData`); StateSyncError when the donors fail or time runs out."""
    loop = asyncio.get_running_loop()
    timeout = max(deadline - loop.time(), 0.001)
    # Sizes were checked by Manifest.decode: only now allocate.
    tensors = {t.name: torch.empty(t.shape, dtype=DTYPES[t.dtype]) for t in manifest.tensors}
    buffers = {name: _raw_bytes(t) for name, t in tensors.items()}  # views sharing the tensors' storage
    total, done = manifest.total_bytes, 0
    queue: list[_Segment] = [
        _Segment(t.name, start, min(start + segment_bytes, t.nbytes))
        for t in manifest.tensors
        for start in range(0, t.nbytes, segment_bytes)
    ]
    if on_progress is not None:
        on_progress(0, total)
    in_flight = 0
    changed = asyncio.Event()  # set whenever the queue or in_flight changes, to wake idle donors

    async def receive(donor: str, segment: _Segment) -> None:
        nonlocal done
        request = Frame(
            StateRequest(((segment.name, segment.start, segment.end),), manifest.manifest_id).encode()
        )
        frames = client.stream(
            donor,
            METHOD,
            _one_request(request),
            round_id=manifest.round_id,
            timeout=max(deadline - loop.time(), 0.001),
        )
        first = True
        async for frame in frames:
            if first:
                first = False
                if frame.header != MANIFEST_HEADER:
                    raise _fail(f"first frame from {donor}", "a manifest", frame.header)
                continue
            payload = frame.payload
            try:
                chunk = StateChunk.decode(frame.header)
            except WireError as error:
                raise StateSyncError(f"chunk from {donor}: {error}") from None
            if chunk.name != segment.name or chunk.offset != segment.start:
                raise _fail(f"chunk from {donor}", f"{segment.name}@{segment.start}", frame.header)
            size = len(payload)
            if not 0 < size <= segment.end - segment.start:
                raise _fail(
                    f"chunk {segment.name}@{segment.start} from {donor}",
                    f"1..{segment.end - segment.start} bytes",
                    size,
                )
            if zlib.crc32(payload) != chunk.crc32:
                raise _fail(
                    f"chunk {segment.name}@{segment.start} from {donor}",
                    f"crc32={chunk.crc32}",
                    zlib.crc32(payload),
                )
            buffers[segment.name][segment.start : segment.start + size] = np.frombuffer(
                payload, dtype=np.uint8
            )
            segment.start += size
            done += size
            if on_progress is not None:
                on_progress(done, total)
        if segment.start != segment.end:
            raise _fail(
                f"stream from {donor}",
                f"{segment.name} up to byte {segment.end}",
                f"end at byte {segment.start}",
            )

    async def worker(donor: str) -> None:
        nonlocal in_flight
        while True:
            if not queue:
                if in_flight == 0:
                    return
                # Another donor may still fail and hand its segment back: wait for that or for the end.
                changed.clear()
                await changed.wait()
                continue
            segment = queue.pop(0)
            in_flight += 1
            try:
                await receive(donor, segment)
            except (RpcError, StateSyncError) as error:
                # Resume: whatever this donor did not deliver goes back for the others; this donor is done.
                failures[donor] = str(error)
                logger.warning(
                    "state donor %s failed at %s@%d: %s", donor, segment.name, segment.start, error
                )
                queue.insert(0, segment)
                return
            finally:
                in_flight -= 1
                changed.set()

    try:
        await wait_for(
            asyncio.gather(*(worker(d) for d in chosen)), timeout=max(deadline - loop.time(), 0.001)
        )
    except TimeoutError:
        raise StateSyncError(
            f"state transfer did not finish within {timeout}s ({done}/{total} bytes)"
        ) from None
    if queue:
        raise StateSyncError(
            f"every donor of round {manifest.round_id} failed with {total - done} of {total} bytes missing: {failures}"
        )
    hashes = await asyncio.to_thread(_digests, buffers)
    bad = [t.name for t in manifest.tensors if hashes[t.name] != t.sha256]
    if bad:
        raise _BadData(
            f"the digest (sha256 tree hash) of {bad} does not match the manifest of round {manifest.round_id} "
            f"from {chosen}"
        )
    return tensors
