"""Checkpoints of a node: the outer state (atomic on disk, verified on load, pruned to the newest K) and the
trainer ranks' sharded inner state inside it.

Owns the on-disk format under `<run_dir>/checkpoints/` (the `root` of every function here):

    round-00000042/
        outer.safetensors   "theta" (float32, flat, canonical order) and "strategy.<name>" for each tensor of
                            the outer strategy's state; safetensors metadata (str -> str): format_version,
                            round_id, run_hash, outer_hash (theta's digest, protocol/digest.py), inner_step (data
                            position), time (unix seconds), and with inner state `inner_sha256` (JSON: file
                            path under inner/ -> sha256 hex)
        inner/              optional: the ranks' FSDP2 model and optimizer state (DTensor shards), written by
                            the ranks themselves with torch.distributed.checkpoint (`save_inner_state`):
            .metadata       JSON (format "farloco-dcp-json"): every tensor's dtype, size and chunks, and the
                            byte range in a data file of every chunk
            __<rank>_0.distcp   that rank's shards as raw bytes, back to back
        COMMITTED           written last; its content is the outer_hash

How a checkpoint becomes durable: everything is written into `round-<id>.tmp-<pid>-<random>/` (the agent
`stage_checkpoint`s it first when the ranks are to write `inner/` into it), every file is fsynced, then the
directory itself, then it is renamed to `round-<id>/` and the parent directory is fsynced. A crash at any point
leaves either the complete new checkpoint or only a `.tmp-` directory, which is never loaded and is removed by
`prune_checkpoints`. `COMMITTED` and the theta hash still guard against what the rename cannot (a file system
that lost data, a disk that flipped a bit, a hand-copied directory); `inner_sha256` does the same for inner/.

Nothing here is ever pickled or unpickled. The outer state is safetensors. inner/ keeps
torch.distributed.checkpoint (sharded saves, loads that reshard) but replaces its file layer, which would pickle
`.metadata` and torch.save every tensor and non-tensor (param_groups): only tensors are saved (hyper-parameters
come from the config), the metadata is JSON, parsed back field by field with schema checks, the data is raw
bytes, and a pickled `.metadata` (torch's default writer) is refused unread. The node loads inner/ only after
every file matched the sha256 recorded in the committed outer metadata (`verify_inner`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from farloco.node.fsutil import fsync_dir, fsync_file, write_atomic
from farloco.protocol import digest
from farloco.protocol.types import DTYPES

log = logging.getLogger("farloco.checkpoint")

FORMAT_VERSION = "2"
# format_version 1 recorded theta's plain sha256 as outer_hash; 2 the tree hash (farloco.protocol.digest). Both
# load; a version-1 checkpoint's theta is verified with the hash it recorded.
_THETA_SCHEME = {"1": "sha256", FORMAT_VERSION: digest.SCHEME}
STATE_FILE = "outer.safetensors"
COMMITTED_FILE = "COMMITTED"
THETA = "theta"
STRATEGY_PREFIX = "strategy."
INNER_DIR = "inner"
INNER_META = "inner_sha256"
# inner/'s JSON metadata, written (by rank 0, renamed into place) once every rank's data file is complete.
DCP_METADATA = ".metadata"
# Metadata keys the caller must give (the rest is computed here).
REQUIRED_META = ("run_hash", "inner_step")

_FINAL_NAME = re.compile(r"^round-(\d{8,})$")
_TMP_NAME = re.compile(r"^round-(\d{8,})\.tmp-(\d+)-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or must not be loaded; the message names the path and what is wrong."""


def checkpoints_dir(run_dir: Path) -> Path:
    """Where a run directory keeps its checkpoints (the `root` of the other functions)."""
    return Path(run_dir) / "checkpoints"


def theta_digest(theta: torch.Tensor, *, scheme: str = digest.SCHEME) -> str:
    """Hex digest of theta's float32 bytes (`farloco.protocol.digest`: a sha256 tree hash over the agent's
    threads): the same value as the agent's `outer_hash`. `scheme` "sha256" is the plain sha256 that checkpoints of
    format_version 1 recorded (read only to verify them)."""
    array = theta.detach().cpu().contiguous().numpy()
    # Hash the buffer in place: a 1B-parameter theta is 4 GB, a `.tobytes()` copy would double that.
    if scheme == "sha256":
        return hashlib.sha256(array.data).hexdigest()
    if scheme != digest.SCHEME:
        raise ValueError(f"theta_digest: expected scheme {digest.SCHEME!r} or 'sha256', got {scheme!r}")
    return digest.digest(array.data)


def checkpoint_name(round_id: int) -> str:
    return f"round-{round_id:08d}"


def stage_checkpoint(root: Path, round_id: int) -> Path:
    """Create the temporary directory of `round_id`'s checkpoint, for the ranks to write `inner/` into before
    `save_checkpoint(..., staged=...)` completes it. Until then it is a `.tmp-` directory: never loaded, and
    removed by `prune_checkpoints` once this process is gone."""
    if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
        raise CheckpointError(f"stage_checkpoint: expected a round_id int >= 0, got {round_id!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{checkpoint_name(round_id)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def save_checkpoint(
    root: Path,
    round_id: int,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str],
    *,
    staged: Path | None = None,
    durable: Callable[[], None] | None = None,
) -> Path:
    """Write the outer state of `round_id` durably and atomically; returns the final checkpoint directory.

    `tensors` holds "theta" (1-D float32) and "strategy.<name>" tensors; `meta` must give `run_hash` and
    `inner_step` and may add other string fields. `format_version`, `round_id`, `outer_hash`, `time` and
    `inner_sha256` are filled in here (a given `outer_hash` or `round_id` must match what they really are).
    `staged`: the directory `stage_checkpoint` made for this round, possibly holding `inner/`; it becomes the
    checkpoint (or is removed if this fails). `durable`: called once every file and the temporary directory are
    fsynced, before the rename (the fault injector's `save` phase: a crash there must leave the previous
    checkpoint the newest).
    """
    root = Path(root)
    try:
        _check_inputs(round_id, tensors, meta)
        if staged is not None:
            _check_staged(root, round_id, Path(staged))
    except CheckpointError:
        if staged is not None and _TMP_NAME.match(Path(staged).name):
            shutil.rmtree(staged, ignore_errors=True)
        raise
    theta = tensors[THETA]
    outer_hash = theta_digest(theta)
    if "outer_hash" in meta and meta["outer_hash"] != outer_hash:
        raise CheckpointError(
            f"save_checkpoint round {round_id}: meta outer_hash {meta['outer_hash']} does not match "
            f"theta, whose digest is {outer_hash}"
        )
    metadata = {
        **meta,
        "format_version": FORMAT_VERSION,
        "round_id": str(round_id),
        "outer_hash": outer_hash,
        "time": meta.get("time", f"{time.time():.3f}"),
    }
    final = root / checkpoint_name(round_id)
    tmp = Path(staged) if staged is not None else stage_checkpoint(root, round_id)
    try:
        if (tmp / INNER_DIR).is_dir():
            # Hashing reads every file back once more; torch.distributed.checkpoint fsynced them already.
            metadata[INNER_META] = json.dumps(_durable_manifest(tmp / INNER_DIR), sort_keys=True)
        state_path = tmp / STATE_FILE
        # save_file streams from the tensors' memory; `save` to bytes would first build a second in-RAM copy of
        # the whole state (8 GB for a 1B model with momentum).
        save_file(_owned(tensors), str(state_path), metadata=metadata)
        fsync_file(state_path)
        _write_durably(tmp / COMMITTED_FILE, outer_hash.encode() + b"\n")
        fsync_dir(tmp)
        if durable is not None:
            durable()
        if final.exists():
            # Same round written again (e.g. after a restart resumed from it): move the old one aside under a
            # .tmp- name. A crash between the two renames loses this round's checkpoint (older ones stay
            # loadable) but never leaves a half-written one under a final name.
            aside = root / f"{checkpoint_name(round_id)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            final.rename(aside)
            tmp.rename(final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            tmp.rename(final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_checkpoint(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Read a committed checkpoint directory: (metadata, tensors). Refuses anything not provably intact."""
    path = Path(path)
    meta = _read_meta(path)
    tensors = _read_tensors(path, None)
    _check_theta(path, meta, tensors.get(THETA))
    return meta, tensors


def read_metadata(path: Path) -> dict[str, str]:
    """A committed checkpoint's metadata only (checked for form, theta not read: `latest_checkpoint` verified it)."""
    return _read_meta(Path(path))


def verify_checkpoint(path: Path) -> dict[str, str]:
    """Check a checkpoint like `load_checkpoint` does, reading only theta; returns its metadata."""
    path = Path(path)
    meta = _read_meta(path)
    _check_theta(path, meta, _read_tensors(path, THETA).get(THETA))
    return meta


def verify_inner(path: Path) -> Path:
    """The `inner/` directory of a committed checkpoint, after checking every file against the sha256 its
    metadata recorded; CheckpointError if the checkpoint has no inner state or any file is missing or differs."""
    path = Path(path)
    meta = _read_meta(path)
    if INNER_META not in meta:
        raise CheckpointError(f"checkpoint {path}: holds no inner state (no {INNER_META} in its metadata)")
    try:
        expected = json.loads(meta[INNER_META])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {path}: {INNER_META} is not JSON: {exc}") from exc
    inner = path / INNER_DIR
    found = _manifest(inner) if inner.is_dir() else {}
    if found != expected:
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        differ = sorted(name for name in set(found) & set(expected) if found[name] != expected[name])
        raise CheckpointError(
            f"checkpoint {path}: inner state does not match its recorded sha256: missing {missing}, "
            f"unexpected {extra}, different {differ}"
        )
    return inner


def newest_committed(root: Path) -> Path | None:
    """The newest committed checkpoint directory, theta not read or verified (for a hint such as its data slot;
    what is loaded goes through `latest_checkpoint`)."""
    found = _committed(Path(root))
    return found[0][1] if found else None


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint that loads (committed, hash verified), or None. Broken ones are skipped."""
    for _, path in _committed(Path(root)):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
            continue
        return path
    return None


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Remove all but the `keep` newest committed checkpoints, plus broken and stale `.tmp-` directories.

    The newest *loadable* checkpoint is never removed, even when newer but broken ones would otherwise fill the
    `keep` slots. A `.tmp-` directory is stale unless its writer (the pid in its name) is another live process.
    Returns the removed paths.
    """
    if keep < 1:
        raise CheckpointError(f"prune_checkpoints: expected keep >= 1, got {keep}")
    root = Path(root)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    for entry in sorted(root.iterdir()):
        tmp = _TMP_NAME.match(entry.name)
        final = _FINAL_NAME.match(entry.name)
        stale_tmp = tmp is not None and not _writer_alive(int(tmp.group(2)))
        uncommitted = final is not None and not (entry / COMMITTED_FILE).is_file()
        if entry.is_dir() and (stale_tmp or uncommitted):
            _remove(entry, removed)
    committed = [path for _, path in _committed(root)]
    # Verify newest first until one loads: everything newer that fails is corrupt and goes, and that one
    # survives whatever `keep` says. Usually this hashes only the checkpoint that was just written.
    anchor: Path | None = None
    for path in committed:
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            log.warning("removing broken checkpoint: %s", exc)
            _remove(path, removed)
            continue
        anchor = path
        break
    survivors = [path for path in committed if path not in removed]
    for path in survivors[keep:]:
        if path != anchor:
            _remove(path, removed)
    return removed


# ---- the ranks' inner state (collective: every rank of the node's process group calls these) --------------------
def save_inner_state(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Write this node's sharded model and optimizer state (FSDP2 DTensors) to `directory`, each rank its own
    shards, with torch.distributed.checkpoint in farloco's pickle-free layout (see `DCP_METADATA`; every file is
    fsynced). False if it failed (e.g. a full disk): training goes on, the checkpoint is written without inner
    state."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    writer_class, _ = _dcp_storage()
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # Only tensors are written: param_groups (lr, betas, ...) would be torch.save'd as pickles, and the
        # loading optimizer has them already, from the config.
        state = {"model": _tensors_only(model_state, "model"), "optim": _optimizer_tensors(optimizer_state)}
        save(state, storage_writer=writer_class(Path(directory)))
    except (Exception, CheckpointException) as exc:  # raised on every rank alike, see load_inner_state
        log.error("saving the inner state to %s failed: %s", directory, exc)
        return False
    return True


def load_inner_state(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Load the optimizer state saved by `save_inner_state` into `optimizer`; True if every rank did.

    The model weights saved next to it are not loaded: after a checkpoint the ranks always start from theta_outer,
    which the agent publishes. The optimizer keeps its own hyper-parameters (param_groups come from the config,
    they are not saved). torch.distributed.checkpoint reshards, so a node restarted with another number of ranks
    loads too. Anything missing, not matching (another optimizer, other shapes) or not in farloco's JSON layout
    (a pickled `.metadata` is refused unread) leaves *every* rank with a fresh optimizer state and returns False:
    a half-loaded optimizer would be worse than a fresh one."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    _, reader_class = _dcp_storage()
    device = next(model.parameters()).device
    # Agree on the directory first: one rank entering the collective load alone would wait forever.
    present = _all_ranks(device, (Path(directory) / DCP_METADATA).is_file())
    loaded = False
    if present:
        try:
            state = get_optimizer_state_dict(model, optimizer)
            tensors = _optimizer_tensors(state)
            # Loaded in place: the tensors in `tensors` are those of `state`, which then goes to the optimizer.
            load({"optim": tensors}, storage_reader=reader_class(Path(directory)))
            set_optimizer_state_dict(model, optimizer, state)
            loaded = True
        # torch.distributed.checkpoint gathers a failure and raises it on every rank, as CheckpointException,
        # which derives from BaseException.
        except (Exception, CheckpointException) as exc:
            log.warning("inner state in %s does not fit this model/optimizer: %s", directory, exc)
    else:
        log.warning("no inner state in %s (expected %s)", directory, DCP_METADATA)
    if not _all_ranks(device, loaded):
        optimizer.state.clear()  # the optimizer initialises its state afresh at its next step
        return False
    return True


def read_inner_metadata(directory: Path) -> Any:
    """The torch.distributed.checkpoint `Metadata` of an inner/ directory written by `save_inner_state`, parsed
    from its JSON `.metadata` with every field checked; CheckpointError naming what was expected otherwise (a
    pickled `.metadata`, as torch's own writer makes, is refused without being unpickled)."""
    path = Path(directory) / DCP_METADATA
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"inner state {directory}: cannot read {DCP_METADATA}: {exc}") from exc
    return _metadata_from_json(raw, str(path))


def _optimizer_tensors(optimizer_state: Any) -> dict[str, Any]:
    """The per-parameter part of an optimizer state dict ({"state": {fqn: {name: tensor}}}), tensors only."""
    if not isinstance(optimizer_state, dict) or not isinstance(optimizer_state.get("state"), dict):
        raise CheckpointError(
            f"inner state: expected an optimizer state dict with a 'state' dict, got {type(optimizer_state)}"
        )
    return {"state": _tensors_only(optimizer_state["state"], "optim.state")}


def _tensors_only(tree: dict[str, Any], where: str) -> dict[str, Any]:
    """`tree`'s nested dicts with their tensor leaves, the same tensor objects (loads fill them in place).

    None leaves mean "no state" (SGD without momentum) and are left out; anything else that is not a tensor
    could only be saved as a pickle, so it is refused."""
    kept: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            kept[key] = value
        elif isinstance(value, dict):
            kept[key] = _tensors_only(value, f"{where}.{key}")
        elif value is not None:
            raise CheckpointError(
                f"inner state: expected only tensors, got {type(value).__name__} at {where}.{key}"
            )
    return kept


# ---- the pickle-free storage layout of inner/ ------------------------------------------------------------------
# torch.distributed.checkpoint's FileSystemWriter pickles its `.metadata` and torch.save()s every tensor (a zip
# holding a pickle, read back with torch.load). Here `.metadata` is JSON, parsed field by field, and each
# rank's `__<rank>_0.distcp` holds its shards' raw bytes back to back (C order, native byte order), located by
# that JSON.
_METADATA_FORMAT = "farloco-dcp-json"
_METADATA_VERSION = 1
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
# The same plain numeric dtypes, by the same names, as state transfer puts on the wire.
_DTYPES: dict[str, torch.dtype] = DTYPES
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_PICKLE_PROTOCOL_BYTE = 0x80  # every pickle of protocol >= 2 starts with it; JSON never does


@functools.cache
def _dcp_storage() -> tuple[type[Any], type[Any]]:
    """(writer class, reader class) of the pickle-free layout. Built on first use: importing
    torch.distributed.checkpoint costs seconds, which the agent and the CLI, which never call it, should not pay."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.filesystem import (
        CURRENT_DCP_VERSION,
        FileSystemReader,
        FileSystemWriter,
        _StorageInfo,
    )
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import (
        LoadPlan,
        LoadPlanner,
        SavePlan,
        SavePlanner,
        WriteItemType,
    )
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class JsonFileSystemWriter(FileSystemWriter):
        """Raw tensor bytes and a JSON `.metadata`; refuses anything that is not a tensor."""

        def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
            name = f"{plan.storage_data.prefix}0.distcp"  # prefix "__<rank>_", set by prepare_global_plan
            results = []
            with open(Path(self.path) / name, "wb") as stream:
                for item in plan.items:
                    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                        raise CheckpointError(
                            f"inner state: expected only tensors, got a non-tensor item {item.index.fqn}"
                        )
                    tensor = planner.resolve_data(item)
                    if not isinstance(tensor, torch.Tensor):
                        raise CheckpointError(
                            f"inner state: expected a tensor for {item.index.fqn}, got {type(tensor).__name__}"
                        )
                    # reshape(-1) makes 0-d tensors viewable as bytes; contiguous() gives C order.
                    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                    offset = stream.tell()
                    stream.write(data.data)
                    results.append(
                        WriteResult(
                            index=item.index,
                            size_in_bytes=data.nbytes,
                            storage_data=_StorageInfo(name, offset, data.nbytes),
                        )
                    )
                stream.flush()
                if self.sync_files:
                    os.fsync(stream.fileno())
            future: Future[list[WriteResult]] = Future()
            future.set_result(results)
            return future

        def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
            metadata.version = CURRENT_DCP_VERSION
            metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
            metadata.storage_meta = self.storage_meta()
            path = Path(self.path)
            # Written aside and renamed, like torch does: a `.metadata` exists only once it is complete.
            write_atomic(path / DCP_METADATA, _metadata_to_json(metadata), durable=True)

    class JsonFileSystemReader(FileSystemReader):
        """Reads what JsonFileSystemWriter wrote, checking the JSON and every byte range against it."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            metadata = read_inner_metadata(Path(self.path))
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata  # type: ignore[no-any-return]

        def set_up_storage_reader(
            self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
        ) -> None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            # The dtype and shape of each stored chunk, by its storage index (fqn, chunk offsets).
            self.chunk_layout = {
                (fqn, tuple(chunk.offsets)): (tensor.properties.dtype, tuple(chunk.sizes))
                for fqn, tensor in metadata.state_dict_metadata.items()
                if isinstance(tensor, TensorStorageMetadata)  # always: read_inner_metadata admits no other
                for chunk in tensor.chunks
            }

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            by_file: dict[str, list[Any]] = {}
            for item in plan.items:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in by_file.items():
                with open(Path(self.path) / name, "rb") as stream:
                    for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                        info = self.storage_data[item.storage_index]
                        dtype, sizes = self.chunk_layout[
                            (item.storage_index.fqn, tuple(item.storage_index.offset))
                        ]
                        stream.seek(info.offset)
                        # Read straight into the buffer the tensor will view: no second copy of a large shard.
                        data = bytearray(info.length)
                        found = stream.readinto(data)
                        if found != info.length:
                            raise CheckpointError(
                                f"inner state {self.path}: {name} is truncated: expected {info.length} bytes of "
                                f"{item.storage_index.fqn} at offset {info.offset}, found {found}"
                            )
                        stored = (
                            torch.frombuffer(data, dtype=dtype).reshape(sizes)
                            if data
                            else torch.empty(sizes, dtype=dtype)
                        )
                        wanted = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
                        target = planner.resolve_tensor(item).detach()
                        if target.size() != wanted.size():
                            raise CheckpointError(
                                f"inner state {self.path}: {item.storage_index.fqn}: expected a slice of "
                                f"{list(target.size())}, the checkpoint gives {list(wanted.size())}"
                            )
                        target.copy_(wanted)
                        planner.commit_tensor(item, target)
            future: Future[None] = Future()
            future.set_result(None)
            return future

    return JsonFileSystemWriter, JsonFileSystemReader


def _metadata_to_json(metadata: Any) -> bytes:
    """torch.distributed.checkpoint's `Metadata`, field by field, as JSON bytes (see `_metadata_from_json`)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            # BytesStorageMetadata: a torch.save'd object, which only a pickle can read back.
            raise CheckpointError(f"inner state: expected only tensors, got {type(entry).__name__} for {fqn}")
        dtype = entry.properties.dtype
        if dtype not in _DTYPE_NAMES or entry.properties.layout != torch.strided:
            raise CheckpointError(
                f"inner state: expected a strided tensor of {sorted(_DTYPES)} for {fqn}, got "
                f"{dtype} {entry.properties.layout}"
            )
        tensors[fqn] = {
            "dtype": _DTYPE_NAMES[dtype],
            "size": list(entry.size),
            "chunks": [
                {"offsets": list(chunk.offsets), "sizes": list(chunk.sizes)} for chunk in entry.chunks
            ],
        }
    storage = []
    for index, info in metadata.storage_data.items():
        if info.transform_descriptors:
            raise CheckpointError(
                f"inner state: expected untransformed data, {index.fqn} has {info.transform_descriptors}"
            )
        storage.append(
            {
                "fqn": index.fqn,
                "offsets": list(index.offset),
                "file": info.relative_path,
                "start": info.offset,
                "length": info.length,
            }
        )
    storage.sort(key=lambda entry: (entry["file"], entry["start"]))
    planner_data = metadata.planner_data
    storage_meta = metadata.storage_meta
    document = {
        "format": _METADATA_FORMAT,
        "format_version": _METADATA_VERSION,
        "dcp_version": metadata.version,
        "tensors": tensors,
        "storage": storage,
        # The save planner's map of flattened keys to their path in the nested state dict ("optim.state.w.step"
        # -> ["optim", "state", "w", "step"]).
        "planner_data": None
        if planner_data is None
        else {key: list(path) for key, path in planner_data.items()},
        "storage_meta": None
        if storage_meta is None
        else {
            "checkpoint_id": None if storage_meta.checkpoint_id is None else str(storage_meta.checkpoint_id),
            "save_id": storage_meta.save_id,
            "modules": list(storage_meta.modules),
        },
    }
    return json.dumps(document, sort_keys=True, indent=1).encode()


def _metadata_from_json(raw: bytes, where: str) -> Any:
    """Parse `_metadata_to_json`'s output back into a `Metadata`, checking every field: the byte range of every
    chunk must be in a data file of this directory and have exactly the chunk's size."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if raw[:1] == bytes([_PICKLE_PROTOCOL_BYTE]):
        raise CheckpointError(
            f"{where}: is a pickle (torch.distributed.checkpoint's own format), which farloco never unpickles: "
            f"expected the JSON metadata save_inner_state writes"
        )
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: expected JSON metadata, cannot parse it: {exc}") from exc
    top = _json_dict(
        document,
        where,
        {"format", "format_version", "dcp_version", "tensors", "storage", "planner_data", "storage_meta"},
    )
    if top["format"] != _METADATA_FORMAT or top["format_version"] != _METADATA_VERSION:
        raise CheckpointError(
            f"{where}: expected format {_METADATA_FORMAT!r} version {_METADATA_VERSION}, got "
            f"{top['format']!r} version {top['format_version']!r}"
        )
    version = _json_type(top["dcp_version"], (str, type(None)), f"{where}: dcp_version")

    state_dict_metadata: dict[str, Any] = {}
    chunk_bytes: dict[tuple[str, tuple[int, ...]], int] = {}
    for fqn, entry in _json_type(top["tensors"], dict, f"{where}: tensors").items():
        here = f"{where}: tensors[{fqn!r}]"
        fields = _json_dict(entry, here, {"dtype", "size", "chunks"})
        dtype = _DTYPES.get(fields["dtype"]) if isinstance(fields["dtype"], str) else None
        if dtype is None:
            raise CheckpointError(f"{here}: expected a dtype in {sorted(_DTYPES)}, got {fields['dtype']!r}")
        size = _json_ints(fields["size"], f"{here}.size")
        chunks = []
        for number, chunk in enumerate(_json_type(fields["chunks"], list, f"{here}.chunks")):
            there = f"{here}.chunks[{number}]"
            chunk_fields = _json_dict(chunk, there, {"offsets", "sizes"})
            offsets = _json_ints(chunk_fields["offsets"], f"{there}.offsets")
            sizes = _json_ints(chunk_fields["sizes"], f"{there}.sizes")
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(o + s > whole for o, s, whole in zip(offsets, sizes, size, strict=True))
            ):
                raise CheckpointError(
                    f"{there}: expected a chunk inside the tensor's size {size}, got offsets {offsets} "
                    f"sizes {sizes}"
                )
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            chunk_bytes[(fqn, tuple(offsets))] = math.prod(sizes) * dtype.itemsize
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=chunks
        )

    storage_data = {}
    for number, entry in enumerate(_json_type(top["storage"], list, f"{where}: storage")):
        here = f"{where}: storage[{number}]"
        fields = _json_dict(entry, here, {"fqn", "offsets", "file", "start", "length"})
        fqn = _json_type(fields["fqn"], str, f"{here}.fqn")
        stored_at = tuple(_json_ints(fields["offsets"], f"{here}.offsets"))
        name = _json_type(fields["file"], str, f"{here}.file")
        start, length = _json_ints([fields["start"], fields["length"]], f"{here}.start/length")
        if not _DATA_FILE.match(name):
            raise CheckpointError(f"{here}: expected a data file named __<rank>_<n>.distcp, got {name!r}")
        if (fqn, stored_at) not in chunk_bytes:
            raise CheckpointError(
                f"{here}: names no chunk of the tensors above: {fqn!r} at {list(stored_at)}"
            )
        if length != chunk_bytes[(fqn, stored_at)]:
            raise CheckpointError(
                f"{here}: expected {chunk_bytes[(fqn, stored_at)]} bytes for {fqn!r} at {list(stored_at)}, "
                f"got {length}"
            )
        index = MetadataIndex(fqn, stored_at)
        if index in storage_data:
            raise CheckpointError(f"{here}: a second byte range for {fqn!r} at {list(stored_at)}")
        storage_data[index] = _StorageInfo(name, start, length)
    unstored = sorted(
        f"{fqn} at {list(stored_at)}"
        for fqn, stored_at in chunk_bytes
        if MetadataIndex(fqn, stored_at) not in storage_data
    )
    if unstored:
        raise CheckpointError(f"{where}: expected a byte range for every chunk, none for {unstored[:5]}")

    planner_data = None
    if top["planner_data"] is not None:
        planner_data = {}
        for key, path in _json_type(top["planner_data"], dict, f"{where}: planner_data").items():
            parts = _json_type(path, list, f"{where}: planner_data[{key!r}]")
            if not parts or not all(
                isinstance(part, (str, int)) and not isinstance(part, bool) for part in parts
            ):
                raise CheckpointError(
                    f"{where}: planner_data[{key!r}]: expected a list of str/int, got {parts!r}"
                )
            planner_data[key] = tuple(parts)

    storage_meta = None
    if top["storage_meta"] is not None:
        here = f"{where}: storage_meta"
        fields = _json_dict(top["storage_meta"], here, {"checkpoint_id", "save_id", "modules"})
        modules = _json_type(fields["modules"], list, f"{here}.modules")
        storage_meta = StorageMeta(
            checkpoint_id=_json_type(fields["checkpoint_id"], (str, type(None)), f"{here}.checkpoint_id"),
            save_id=_json_type(fields["save_id"], (str, type(None)), f"{here}.save_id"),
            modules=[_json_type(module, str, f"{here}.modules[]") for module in modules],
        )
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_data=storage_data,
        storage_meta=storage_meta,
        version=version,
    )


def _json_type(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise CheckpointError(f"{where}: expected {names}, got {type(value).__name__} {value!r:.80}")
    return value


def _json_dict(value: Any, where: str, keys: set[str]) -> dict[str, Any]:
    found = _json_type(value, dict, where)
    if set(found) != keys:
        raise CheckpointError(f"{where}: expected the keys {sorted(keys)}, got {sorted(found)}")
    return found  # type: ignore[no-any-return]


def _json_ints(value: Any, where: str) -> list[int]:
    """A list of ints >= 0 (sizes, offsets, byte positions)."""
    items = _json_type(value, list, where)
    if not all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in items):
        raise CheckpointError(f"{where}: expected a list of ints >= 0, got {items!r:.80}")
    return items  # type: ignore[no-any-return]


def optimizer_fingerprint(optimizer: torch.optim.Optimizer, device: torch.device) -> tuple[int, float]:
    """(step count, sum of |first moment| over the whole node) of an optimizer: (0, 0.0) when fresh. Collective:
    the ranks' shards are disjoint, so the all-reduced sum is the node's, whatever its number of ranks."""
    import torch.distributed as dist

    step = 0
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for state in optimizer.state.values():
        if "step" in state:
            step = max(step, int(state["step"]))
        moment = state.get("exp_avg", state.get("momentum_buffer"))
        if isinstance(moment, torch.Tensor):
            local = moment.to_local() if hasattr(moment, "to_local") else moment
            total += local.detach().double().abs().sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return step, float(total.item())


def _all_ranks(device: torch.device, value: bool) -> bool:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    flag = torch.tensor([1 if value else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# ---- helpers ----------------------------------------------------------------------------------------------------
def _check_inputs(round_id: int, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
        raise CheckpointError(f"save_checkpoint: expected a round_id int >= 0, got {round_id!r}")
    theta = tensors.get(THETA)
    if theta is None or theta.dtype != torch.float32 or theta.dim() != 1:
        found = "nothing" if theta is None else f"{theta.dtype} {list(theta.shape)}"
        raise CheckpointError(f"save_checkpoint: expected tensors['theta'] 1-D float32, got {found}")
    strange = sorted(name for name in tensors if name != THETA and not name.startswith(STRATEGY_PREFIX))
    if strange:
        raise CheckpointError(
            f"save_checkpoint: expected tensor names 'theta' or 'strategy.<name>', got {strange}"
        )
    missing = [key for key in REQUIRED_META if key not in meta]
    if missing:
        raise CheckpointError(f"save_checkpoint: meta is missing {missing} (given keys: {sorted(meta)})")
    not_str = sorted(key for key, value in meta.items() if not isinstance(value, str))
    if not_str:
        raise CheckpointError(f"save_checkpoint: meta values must be str, not for {not_str}")
    if "round_id" in meta and meta["round_id"] != str(round_id):
        raise CheckpointError(f"save_checkpoint: meta round_id {meta['round_id']!r} but round_id={round_id}")


def _check_staged(root: Path, round_id: int, staged: Path) -> None:
    match = _TMP_NAME.match(staged.name)
    if staged.parent.resolve() != root.resolve() or match is None or int(match.group(1)) != round_id:
        raise CheckpointError(
            f"save_checkpoint: expected staged to be {root}/{checkpoint_name(round_id)}.tmp-<pid>-<hex> "
            f"(from stage_checkpoint), got {staged}"
        )
    if not staged.is_dir():
        raise CheckpointError(f"save_checkpoint: staged directory {staged} does not exist")


def _manifest(directory: Path) -> dict[str, str]:
    """sha256 hex of every file under `directory`, by path relative to it."""
    found = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        found[file.relative_to(directory).as_posix()] = digest.hexdigest()
    return found


def _durable_manifest(directory: Path) -> dict[str, str]:
    """`_manifest`, after fsyncing every file and directory under `directory` (their entries must survive too)."""
    for entry in sorted(directory.rglob("*"), reverse=True):
        if entry.is_file():
            fsync_file(entry)
        elif entry.is_dir():
            fsync_dir(entry)
    fsync_dir(directory)
    return _manifest(directory)


def _owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that each own their storage: safetensors refuses views that share memory."""
    owned = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.contiguous().clone()
        owned[name] = tensor
    return owned


def _read_meta(path: Path) -> dict[str, str]:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: expected a directory, found none")
    match = _FINAL_NAME.match(path.name)
    if match is None:
        # Covers `.tmp-` directories: whatever they hold, they were never renamed into place.
        raise CheckpointError(
            f"checkpoint {path}: expected a directory named round-<8 digits>, got {path.name!r}"
        )
    if not (path / COMMITTED_FILE).is_file():
        raise CheckpointError(f"checkpoint {path}: not committed (no {COMMITTED_FILE} file)")
    try:
        with safe_open(str(path / STATE_FILE), framework="pt") as handle:
            meta = dict(handle.metadata() or {})
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {STATE_FILE}: {exc}") from exc
    version = meta.get("format_version")
    if version not in _THETA_SCHEME:
        raise CheckpointError(
            f"checkpoint {path}: expected format_version {' or '.join(_THETA_SCHEME)}, found {version!r}"
        )
    missing = [key for key in ("round_id", "outer_hash", *REQUIRED_META) if key not in meta]
    if missing:
        raise CheckpointError(f"checkpoint {path}: metadata is missing {missing}")
    if int(match.group(1)) != int(meta["round_id"]):
        raise CheckpointError(
            f"checkpoint {path}: directory says round {int(match.group(1))}, metadata says {meta['round_id']}"
        )
    return meta


def _read_tensors(path: Path, only: str | None) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path / STATE_FILE), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if only is None or name == only:
                    tensors[name] = handle.get_tensor(name)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {STATE_FILE}: {exc}") from exc
    return tensors


def _check_theta(path: Path, meta: dict[str, str], theta: torch.Tensor | None) -> None:
    if theta is None or theta.dtype != torch.float32 or theta.dim() != 1:
        found = "nothing" if theta is None else f"{theta.dtype} {list(theta.shape)}"
        raise CheckpointError(f"checkpoint {path}: expected a 1-D float32 tensor 'theta', found {found}")
    scheme = _THETA_SCHEME[meta["format_version"]]
    found_hash = theta_digest(theta, scheme=scheme)
    if found_hash != meta["outer_hash"]:
        raise CheckpointError(
            f"checkpoint {path}: theta is corrupt: expected {scheme} {meta['outer_hash']} (from its metadata), "
            f"found {found_hash}"
        )


def _committed(root: Path) -> list[tuple[int, Path]]:
    """Final-named directories holding a COMMITTED file, newest round first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _FINAL_NAME.match(entry.name)
        if match and entry.is_dir() and (entry / COMMITTED_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def _writer_alive(pid: int) -> bool:
    # Our own pid counts as dead: saves are synchronous, so a .tmp- dir with our pid is from a previous process
    # that had the same pid (pid 1 in a restarted container) or from a save that failed.
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path, removed: list[Path]) -> None:
    shutil.rmtree(path, ignore_errors=True)
    removed.append(path)


def _write_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
