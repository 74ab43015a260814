"""The shared-memory hand-off between the agent and its trainer ranks.

One file, owned and created by the agent (under /dev/shm when it exists), mapped by every rank with
`torch.from_file(..., shared=True)`. Python's `multiprocessing.shared_memory` is avoided on purpose: on 3.11 its
resource tracker unlinks a segment when *any* attached process exits, which would tear the buffer away from the
agent whenever a trainer rank crashes.

Layout (little-endian):

    [0, 8192)                       header: int64 slots (see the constants below), one block per rank
    [8192, 8192 + 4N)               theta: the outer parameters the agent publishes, float32, canonical order
    [8192 + 4N, 8192 + 8N)          local: the ranks' parameters after their inner steps, float32, canonical order

Canonical order: parameters sorted by fully-qualified name, each row-major. A rank that holds rows [a, b) of a
parameter (FSDP2 shards on dim 0) reads and writes exactly that contiguous range, so the agent sees one flat
vector whatever the node's sharding — a 1-rank node and an 8-rank node produce the same layout.

Synchronisation is a sequence number, not a lock: the agent writes theta, then bumps `PUBLISH_SEQ`; a rank writes
its rows of `local`, then sets its `DONE_SEQ`. Each side only reads a region after seeing the other side's
sequence number, and never writes a region the other side may be reading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from farloco.node.fsutil import write_atomic

log = logging.getLogger("farloco.handoff")

HEADER_BYTES = 8192
MAGIC = 0x464C4F434F484F46  # "FLOCOHOF"
VERSION = 2

# Global header slots (int64 indices).
SLOT_MAGIC = 0
SLOT_VERSION = 1
SLOT_NUM_PARAMS = 2
SLOT_WORLD_SIZE = 3
SLOT_PUBLISH_SEQ = 4  # bumped by the agent after writing theta (or deciding ranks keep their weights)
SLOT_RELOAD = (
    5  # 1: ranks load theta for this sequence; 0: keep local weights (aborted round, missed work kept)
)
SLOT_ROUND_ID = 6  # outer round the published sequence belongs to
SLOT_COMMAND = 7  # COMMAND_RUN or COMMAND_STOP
SLOT_INNER_STEPS = 8  # H for this sequence
SLOT_STEP_BASE = 9  # global inner step at which this sequence starts (data position)
SLOT_INNER_OP = 10  # INNER_SAVE or INNER_LOAD: what the pending inner-state request asks
SLOT_INNER_SEQ = 11  # bumped by the agent after writing the request (op + its directory in the sidecar file)
SLOT_CUT_SEQ = (
    12  # the sequence the agent asks the ranks to end early: a partial contribution (a straggler's)
)

COMMAND_RUN = 0
COMMAND_STOP = 1

# Inner-state requests (the ranks' sharded model + optimizer state, torch.distributed.checkpoint). Ranks serve a
# pending request before they start their next sequence, and before they obey STOP, so every rank reaches the
# collective save/load at the same point and a leave never drops a checkpoint's inner state half-way.
INNER_SAVE = 1
INNER_LOAD = 2
# R_INNER_RESULT values.
INNER_OK = 1  # saved, or loaded
INNER_FRESH = 2  # load refused (missing, or does not match this model/optimizer): fresh optimizer state
INNER_FAILED = 3  # save failed (e.g. disk full): the checkpoint is written without inner state

RANK_BLOCK = 24  # int64 slots per rank
RANK_BASE = 32
MAX_RANKS = (HEADER_BYTES // 8 - RANK_BASE) // RANK_BLOCK

# Per-rank slots (offset inside a rank block).
R_DONE_SEQ = 0  # the publish sequence whose result this rank wrote to `local`
R_INNER_STEP = 1  # global inner step the rank has reached
R_TRAIN_LOSS = 2  # float64 bits: mean training loss over the last sequence
R_EVAL_SEQ = 3  # the publish sequence whose theta was evaluated
R_EVAL_LOSS = 4  # float64 bits: held-out loss of the published theta
R_TOKENS = 5  # tokens processed by this rank since it started
R_STEP_MICROS = 6  # mean inner-step time over the last sequence, microseconds
R_PID = 7
R_HEARTBEAT_NS = 8  # time.time_ns() of the last update
R_INNER_DONE = 9  # the inner-state request (SLOT_INNER_SEQ) this rank served last
R_INNER_RESULT = 10  # INNER_OK / INNER_FRESH / INNER_FAILED for that request
R_OPT_STEP = 11  # optimizer step count after that request (saved or loaded): a fresh optimizer has 0
R_OPT_FINGERPRINT = 12  # float64 bits: sum of |first moment| over the node's shards after that request
R_SEQ_STEPS = (
    13  # inner steps the rank ran in the sequence it reported done (fewer than asked when cut short)
)
R_DONE_NS = 14  # time.time_ns() when the rank reported that sequence done (then it waits for the agent)
R_INNER_LR = 15  # float64 bits: the inner learning rate of that sequence's last step (run.lr_schedule)
# node.log_every_steps: the last whole interval of inner steps (`mark_interval`; R_LOG_STEP written last).
R_LOG_STEP = 16  # the global inner step that ended it
R_LOG_LOSS = 17  # float64 bits: this rank's mean training loss over its steps
R_LOG_SECONDS = 18  # float64 bits: the time its steps took
R_LOG_TOKENS = 19  # tokens this rank trained on in it
R_PEAK_FLOPS = 20  # float64 bits: the rank's device peak FLOP/s (node.peak_tflops or known GPUs; 0: unknown)


def _f2i(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _i2f(value: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", value))[0])


def default_handoff_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")


@dataclass(frozen=True)
class RankReport:
    """What one rank last wrote into its header block."""

    rank: int
    done_seq: int
    inner_step: int
    train_loss: float
    eval_seq: int
    eval_loss: float
    tokens: int
    step_seconds: float
    pid: int
    inner_done: int = 0
    inner_result: int = 0
    optimizer_step: int = 0
    optimizer_fingerprint: float = 0.0
    seq_steps: int = 0
    inner_lr: float = 0.0
    done_ns: int = 0
    log_step: int = 0
    log_loss: float = 0.0
    log_seconds: float = 0.0
    log_tokens: int = 0
    peak_flops: float = 0.0


STALE_NAME = re.compile(r"farloco-handoff-(\d+)-[0-9a-f]{8}\.bin(\.inner)?")


def sweep_stale(directory: Path) -> list[Path]:
    """Remove the hand-off files (and their sidecars) of agents that died without unlinking them: a SIGKILLed or
    OOM-killed agent leaves 8 bytes per parameter in /dev/shm (8 GB at 1B parameters), and a node restarted
    by systemd or Slurm after each crash would fill the host's memory. A file is stale when it is ours (same
    uid) and the pid in its name is not a live process. (This assumes the directory is not shared with agents in
    another pid namespace, which is what a container's own /dev/shm gives.) Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = STALE_NAME.fullmatch(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            if pid == os.getpid() or path.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        except OSError:
            continue  # alive under another user, or the file went away meanwhile
    if removed:
        log.warning(
            "removed %d hand-off files of agents that died: %s", len(removed), [p.name for p in removed]
        )
    return removed


class Handoff:
    """A mapped hand-off file. The agent `create`s it; ranks `attach` to it by path."""

    def __init__(self, path: Path, num_params: int, world_size: int, *, owner: bool) -> None:
        self.path = path
        self.num_params = num_params
        self.world_size = world_size
        self.owner = owner
        nbytes = HEADER_BYTES + 8 * num_params
        self._buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        self.header = self._buffer[:HEADER_BYTES].view(torch.int64)
        self.theta = self._buffer[HEADER_BYTES : HEADER_BYTES + 4 * num_params].view(torch.float32)
        self.local = self._buffer[HEADER_BYTES + 4 * num_params :].view(torch.float32)

    @classmethod
    def create(cls, num_params: int, world_size: int, directory: Path | None = None) -> Handoff:
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"hand-off: expected 1..{MAX_RANKS} ranks, got {world_size}")
        directory = directory or default_handoff_dir()
        sweep_stale(directory)
        path = directory / f"farloco-handoff-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        with open(path, "wb") as handle:
            handle.truncate(HEADER_BYTES + 8 * num_params)
        handoff = cls(path, num_params, world_size, owner=True)
        handoff.header.zero_()
        handoff.header[SLOT_MAGIC] = MAGIC
        handoff.header[SLOT_VERSION] = VERSION
        handoff.header[SLOT_NUM_PARAMS] = num_params
        handoff.header[SLOT_WORLD_SIZE] = world_size
        handoff.header[SLOT_PUBLISH_SEQ] = 0
        for rank in range(world_size):
            handoff.header[RANK_BASE + rank * RANK_BLOCK + R_DONE_SEQ] = 0
            handoff.header[RANK_BASE + rank * RANK_BLOCK + R_EVAL_SEQ] = 0
        return handoff

    @classmethod
    def attach(cls, path: Path) -> Handoff:
        size = path.stat().st_size
        if size < HEADER_BYTES:
            raise ValueError(f"hand-off {path}: expected at least {HEADER_BYTES} bytes, found {size}")
        header = torch.from_file(str(path), shared=True, size=HEADER_BYTES, dtype=torch.uint8).view(
            torch.int64
        )
        if int(header[SLOT_MAGIC]) != MAGIC or int(header[SLOT_VERSION]) != VERSION:
            raise ValueError(f"hand-off {path}: not a farloco v{VERSION} hand-off file")
        num_params = int(header[SLOT_NUM_PARAMS])
        world_size = int(header[SLOT_WORLD_SIZE])
        expected = HEADER_BYTES + 8 * num_params
        if size != expected:
            raise ValueError(
                f"hand-off {path}: expected {expected} bytes for {num_params} params, found {size}"
            )
        return cls(path, num_params, world_size, owner=False)

    # --- agent side -------------------------------------------------------------------------------------------
    def publish(self, theta: torch.Tensor | None, *, round_id: int, step_base: int, inner_steps: int) -> int:
        """Hand the ranks their next sequence of work. `theta` None: keep local weights (the round aborted)."""
        if theta is not None:
            if theta.shape != (self.num_params,) or theta.dtype != torch.float32:
                raise ValueError(
                    f"hand-off publish: expected float32[{self.num_params}], got {theta.dtype}{list(theta.shape)}"
                )
            if theta.data_ptr() != self.theta.data_ptr():  # built in place (OuterRound.merged): no copy
                self.theta.copy_(theta)
        self.header[SLOT_RELOAD] = 1 if theta is not None else 0
        self.header[SLOT_ROUND_ID] = round_id
        self.header[SLOT_STEP_BASE] = step_base
        self.header[SLOT_INNER_STEPS] = inner_steps
        seq = int(self.header[SLOT_PUBLISH_SEQ]) + 1
        self.header[SLOT_PUBLISH_SEQ] = seq  # written last: ranks read the fields above only after seeing it
        return seq

    def stop(self) -> None:
        self.header[SLOT_COMMAND] = COMMAND_STOP

    def cut(self, seq: int) -> None:
        """Ask the ranks to end sequence `seq` after the inner step they are in (all ranks agree on which, see
        the trainer's `step_signals`); their report's `seq_steps` then says how many they ran."""
        self.header[SLOT_CUT_SEQ] = seq

    def all_done(self, seq: int) -> bool:
        return all(self.report(rank).done_seq >= seq for rank in range(self.world_size))

    def report(self, rank: int) -> RankReport:
        block = self.header[RANK_BASE + rank * RANK_BLOCK : RANK_BASE + (rank + 1) * RANK_BLOCK].tolist()
        return RankReport(
            rank=rank,
            done_seq=block[R_DONE_SEQ],
            inner_step=block[R_INNER_STEP],
            train_loss=_i2f(block[R_TRAIN_LOSS]),
            eval_seq=block[R_EVAL_SEQ],
            eval_loss=_i2f(block[R_EVAL_LOSS]),
            tokens=block[R_TOKENS],
            step_seconds=block[R_STEP_MICROS] / 1e6,
            pid=block[R_PID],
            inner_done=block[R_INNER_DONE],
            inner_result=block[R_INNER_RESULT],
            optimizer_step=block[R_OPT_STEP],
            optimizer_fingerprint=_i2f(block[R_OPT_FINGERPRINT]),
            seq_steps=block[R_SEQ_STEPS],
            done_ns=block[R_DONE_NS],
            inner_lr=_i2f(block[R_INNER_LR]),
            log_step=block[R_LOG_STEP],
            log_loss=_i2f(block[R_LOG_LOSS]),
            log_seconds=_i2f(block[R_LOG_SECONDS]),
            log_tokens=block[R_LOG_TOKENS],
            peak_flops=_i2f(block[R_PEAK_FLOPS]),
        )

    @property
    def inner_path(self) -> Path:
        """Sidecar file holding the directory of the pending inner-state request (a path fits no int64 slot)."""
        return self.path.with_name(self.path.name + ".inner")

    def request_inner(self, op: int, directory: Path) -> int:
        """Ask the ranks to save (INNER_SAVE) or load (INNER_LOAD) their inner state in `directory`; returns
        the request's sequence number. Ranks serve it before their next sequence (see `inner_all_done`)."""
        if op not in (INNER_SAVE, INNER_LOAD):
            raise ValueError(f"hand-off request_inner: expected INNER_SAVE or INNER_LOAD, got {op}")
        write_atomic(self.inner_path, str(Path(directory).resolve()))
        self.header[SLOT_INNER_OP] = op
        seq = int(self.header[SLOT_INNER_SEQ]) + 1
        self.header[SLOT_INNER_SEQ] = seq  # written last: ranks read the op and the sidecar after seeing it
        return seq

    def inner_all_done(self, seq: int) -> bool:
        return all(self.report(rank).inner_done >= seq for rank in range(self.world_size))

    def close(self) -> None:
        """Drop the mapping; the owner also removes the file."""
        del self.header, self.theta, self.local, self._buffer
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.inner_path.unlink(missing_ok=True)

    # --- rank side --------------------------------------------------------------------------------------------
    @property
    def mapped(self) -> torch.Tensor:
        """The whole mapping (header, theta, local) as bytes: what a CUDA rank page-locks (HostStaging)."""
        return self._buffer

    @property
    def publish_seq(self) -> int:
        return int(self.header[SLOT_PUBLISH_SEQ])

    @property
    def command(self) -> int:
        return int(self.header[SLOT_COMMAND])

    def work(self) -> tuple[bool, int, int, int]:
        """(reload, round_id, step_base, inner_steps) of the current sequence."""
        return (
            bool(self.header[SLOT_RELOAD]),
            int(self.header[SLOT_ROUND_ID]),
            int(self.header[SLOT_STEP_BASE]),
            int(self.header[SLOT_INNER_STEPS]),
        )

    @property
    def inner_seq(self) -> int:
        return int(self.header[SLOT_INNER_SEQ])

    @property
    def cut_seq(self) -> int:
        return int(self.header[SLOT_CUT_SEQ])

    def inner_request(self) -> tuple[int, Path]:
        """(op, directory) of the pending inner-state request; read only after seeing `inner_seq` move."""
        return int(self.header[SLOT_INNER_OP]), Path(self.inner_path.read_text())

    def mark_inner_done(
        self, rank: int, seq: int, *, result: int, optimizer_step: int, optimizer_fingerprint: float
    ) -> None:
        self._set(rank, R_INNER_RESULT, result)
        self._set(rank, R_OPT_STEP, optimizer_step)
        self._set(rank, R_OPT_FINGERPRINT, _f2i(optimizer_fingerprint))
        self._set(rank, R_INNER_DONE, seq)  # written last: the agent reads the fields above after seeing it

    def _set(self, rank: int, slot: int, value: int) -> None:
        self.header[RANK_BASE + rank * RANK_BLOCK + slot] = value

    def mark_progress(self, rank: int, *, inner_step: int, tokens: int, pid: int, now_ns: int) -> None:
        self._set(rank, R_INNER_STEP, inner_step)
        self._set(rank, R_TOKENS, tokens)
        self._set(rank, R_PID, pid)
        self._set(rank, R_HEARTBEAT_NS, now_ns)

    def mark_interval(self, rank: int, *, step: int, loss: float, seconds: float, tokens: int) -> None:
        """One whole interval of node.log_every_steps inner steps, ended at global step `step`."""
        self._set(rank, R_LOG_LOSS, _f2i(loss))
        self._set(rank, R_LOG_SECONDS, _f2i(seconds))
        self._set(rank, R_LOG_TOKENS, tokens)
        self._set(rank, R_LOG_STEP, step)  # written last: the agent reads the fields above after seeing it

    def mark_peak_flops(self, rank: int, peak_flops: float) -> None:
        self._set(rank, R_PEAK_FLOPS, _f2i(peak_flops))

    def mark_eval(self, rank: int, seq: int, loss: float) -> None:
        self._set(rank, R_EVAL_LOSS, _f2i(loss))
        self._set(rank, R_EVAL_SEQ, seq)

    def mark_done(
        self,
        rank: int,
        seq: int,
        *,
        train_loss: float,
        step_seconds: float,
        steps: int,
        inner_lr: float = 0.0,
    ) -> None:
        self._set(rank, R_TRAIN_LOSS, _f2i(train_loss))
        self._set(rank, R_INNER_LR, _f2i(inner_lr))
        self._set(rank, R_STEP_MICROS, int(step_seconds * 1e6))
        self._set(rank, R_SEQ_STEPS, steps)
        self._set(rank, R_DONE_NS, time.time_ns())
        self._set(rank, R_DONE_SEQ, seq)  # written last: the agent reads `local` only after seeing it


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the canonical flat vector."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


def canonical_layout(named_shapes: dict[str, tuple[int, ...]]) -> list[ParamSlot]:
    """Parameters sorted by fully-qualified name, packed back to back, row-major."""
    slots = []
    offset = 0
    for name in sorted(named_shapes):
        slot = ParamSlot(name, offset, tuple(named_shapes[name]))
        slots.append(slot)
        offset += slot.numel
    return slots


def layout_of(model: torch.nn.Module) -> list[ParamSlot]:
    """The canonical layout of a (non-sharded) model; tied parameters appear once, under their first name."""
    return canonical_layout({name: tuple(p.shape) for name, p in model.named_parameters()})


def flatten(model: torch.nn.Module, layout: list[ParamSlot]) -> torch.Tensor:
    """The model's parameters as one float32 vector in canonical order (a copy, on CPU)."""
    params = dict(model.named_parameters())
    total = layout[-1].offset + layout[-1].numel if layout else 0
    flat = torch.empty(total, dtype=torch.float32)
    for slot in layout:
        flat[slot.offset : slot.offset + slot.numel].copy_(params[slot.name].detach().reshape(-1))
    return flat


def unflatten(flat: torch.Tensor, layout: list[ParamSlot]) -> dict[str, torch.Tensor]:
    """Views of `flat` shaped like the model's parameters."""
    return {slot.name: flat[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in layout}
