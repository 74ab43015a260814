"""Checkpoints of a node: the outer state (atomic on disk, verified on load, pruned to the newest K) and the
trainer ranks' sharded inner state inside it.

Owns the on-disk format under `<run_dir>/checkpoints/` (the `root` of every function here):

    round-00000042/
        outer.safetensors   "theta" (float32, flat, canonical order) and "strategy.<name>" for each tensor of
                            the outer strategy's state; safetensors metadata (str -> str): format_version,
                            round_id, run_hash, outer_hash (sha256 hex of theta's bytes), inner_step (data
                            position), time (unix seconds), and with inner state `inner_sha256` (JSON: file
                            path under inner/ -> sha256 hex)
        inner/              optional: the ranks' FSDP2 model and optimizer state (DTensor shards), written by
                            the ranks themselves with torch.distributed.checkpoint (`save_inner_state`)
        COMMITTED           written last; its content is the outer_hash

How a checkpoint becomes durable: everything is written into `round-<id>.tmp-<pid>-<random>/` (the agent
`stage_checkpoint`s it first when the ranks are to write `inner/` into it), every file is fsynced, then the
directory itself, then it is renamed to `round-<id>/` and the parent directory is fsynced. A crash at any point
leaves either the complete new checkpoint or only a `.tmp-` directory, which is never loaded and is removed by
`prune_checkpoints`. `COMMITTED` and the theta hash still guard against what the rename cannot (a file system
that lost data, a disk that flipped a bit, a hand-copied directory); `inner_sha256` does the same for inner/.

The outer state is read and written with safetensors only. inner/ is torch.distributed.checkpoint's format,
whose `.metadata` file is a pickle: it is only ever read from the node's own run directory, and only after
every file of inner/ matched the sha256 recorded in the committed outer metadata (`verify_inner`), so what is
unpickled is exactly what this node's ranks wrote. Tensors in it are read as raw storage, never unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from farloco.node.fsutil import fsync_dir, fsync_file

log = logging.getLogger("farloco.checkpoint")

FORMAT_VERSION = "1"
STATE_FILE = "outer.safetensors"
COMMITTED_FILE = "COMMITTED"
THETA = "theta"
STRATEGY_PREFIX = "strategy."
INNER_DIR = "inner"
INNER_META = "inner_sha256"
# Written by torch.distributed.checkpoint once every rank's data file is complete.
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


def theta_sha256(theta: torch.Tensor) -> str:
    """sha256 hex of theta's float32 bytes: the same value as the agent's `outer_hash`."""
    array = theta.detach().cpu().contiguous().numpy()
    # Hash the buffer in place: a 1B-parameter theta is 4 GB, a `.tobytes()` copy would double that.
    return hashlib.sha256(array.data).hexdigest()


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
) -> Path:
    """Write the outer state of `round_id` durably and atomically; returns the final checkpoint directory.

    `tensors` holds "theta" (1-D float32) and "strategy.<name>" tensors; `meta` must give `run_hash` and
    `inner_step` and may add other string fields. `format_version`, `round_id`, `outer_hash`, `time` and
    `inner_sha256` are filled in here (a given `outer_hash` or `round_id` must match what they really are).
    `staged`: the directory `stage_checkpoint` made for this round, possibly holding `inner/`; it becomes the
    checkpoint (or is removed if this fails).
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
    outer_hash = theta_sha256(theta)
    if "outer_hash" in meta and meta["outer_hash"] != outer_hash:
        raise CheckpointError(
            f"save_checkpoint round {round_id}: meta outer_hash {meta['outer_hash']} does not match "
            f"theta, whose sha256 is {outer_hash}"
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
    shards, with torch.distributed.checkpoint (which fsyncs every file it writes). False if it failed (e.g. a
    full disk): training goes on, the checkpoint is written without inner state."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    try:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(directory))
    except (Exception, CheckpointException) as exc:  # raised on every rank alike, see load_inner_state
        log.error("saving the inner state to %s failed: %s", directory, exc)
        return False
    return True


def load_inner_state(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Load the optimizer state saved by `save_inner_state` into `optimizer`; True if every rank did.

    The model weights saved next to it are not loaded: after a checkpoint the ranks always start from theta_outer,
    which the agent publishes. torch.distributed.checkpoint reshards, so a node restarted with another number of
    ranks loads too. Anything missing or not matching (another optimizer, other shapes) leaves *every* rank with
    a fresh optimizer state and returns False: a half-loaded optimizer would be worse than a fresh one."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    device = next(model.parameters()).device
    # Agree on the directory first: one rank entering the collective load alone would wait forever.
    present = _all_ranks(device, (Path(directory) / DCP_METADATA).is_file())
    loaded = False
    if present:
        try:
            state = get_optimizer_state_dict(model, optimizer)
            load({"optim": state}, checkpoint_id=str(directory))
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
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: expected format_version {FORMAT_VERSION}, found {version!r}"
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
    found_hash = theta_sha256(theta)
    if found_hash != meta["outer_hash"]:
        raise CheckpointError(
            f"checkpoint {path}: theta is corrupt: expected sha256 {meta['outer_hash']} (from its metadata), "
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
