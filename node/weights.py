"""`run.init_from`: the pretrained weights a run starts from, found, checked and digested without torch.

A run may start from a local model folder instead of its seeded init: a Hugging Face folder (``config.json`` and
``model.safetensors``, or ``model.safetensors.index.json`` and the shards it names) or a `farloco export`. This
module reads the safetensors files' headers itself (8 bytes of little-endian header length, then a JSON table of
name -> dtype, shape and byte range), so that the config, which imports no torch, can name what is wrong and
digest the weights for the run hash:

- `weights_index(folder)`: every tensor of the folder, with the file and byte range it lives in. A missing
  folder, no safetensors, a shard the index names but the folder lacks, a tensor the index places in a shard that
  does not hold it, a header that does not parse, a byte range that does not match its dtype and shape, or a file
  shorter than its header says (a partial download) is a `WeightsError` that names the file and what was expected.
- `weights_digest(folder)`: ``sha256:<hex>`` over the tensors in name order (name, dtype, shape and bytes), not
  over the files: the same weights saved by `transformers` or exported by farloco, in one file or in shards, with
  other metadata, digest the same. The run hash carries it as ``run.init_from``, so a node with other weights is
  refused naming that key. Digesting reads every byte once (0.9 s for 512 MiB on a busy 2-core machine); the digest is kept per
  process and in FARLOCO_CACHE (default ~/.cache/farloco) under the files' paths, sizes and mtimes.

node/training/models.py loads the tensors into the model (`load_init_from`); pytorch_model.bin files are never
read (loading them unpickles).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from farloco.node.config import ConfigError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own bound on the JSON header
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
DIGEST_CHUNK = 64 * 2**20
CACHE_ENTRIES = 64


class WeightsError(ConfigError):
    """run.init_from cannot be read as asked; the message names the file and what was expected."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets in `file`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, checked against the file's size (WeightsError otherwise)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            raw_length = file.read(8)
            if len(raw_length) != 8:
                raise WeightsError(f"{path}: expected a safetensors file, found {size} bytes")
            (length,) = struct.unpack("<Q", raw_length)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise WeightsError(
                    f"{path}: expected a safetensors header of at most {min(MAX_HEADER_BYTES, size - 8)} bytes, "
                    f"its length field says {length} (not a safetensors file, or a partial one)"
                )
            header = json.loads(file.read(length))
    except OSError as exc:
        raise WeightsError(f"{path}: cannot read it: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{path}: the safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: expected a JSON object as the safetensors header")
    base = 8 + length
    entries: dict[str, TensorEntry] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _entry(path, name, info, base)
        entries[name] = entry
        data_end = max(data_end, entry.end)
    if size < max(data_end, base):
        raise WeightsError(
            f"{path}: expected at least {data_end} bytes (its header places tensors up to there), found {size}: "
            f"a partial file"
        )
    return entries


def _entry(path: Path, name: str, info: Any, base: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise WeightsError(f"{path}: tensor {name!r}: expected {{dtype, shape, data_offsets}}, got {info!r}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise WeightsError(
            f"{path}: tensor {name!r}: expected a dtype of {sorted(DTYPE_BYTES)}, got {dtype!r}"
        )
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WeightsError(f"{path}: tensor {name!r}: expected a shape of non-negative ints, got {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
    ):
        raise WeightsError(f"{path}: tensor {name!r}: expected data_offsets [begin, end], got {offsets!r}")
    numel = 1
    for dim in shape:
        numel *= dim
    if offsets[1] - offsets[0] != numel * DTYPE_BYTES[dtype]:
        raise WeightsError(
            f"{path}: tensor {name!r}: {dtype}{shape} takes {numel * DTYPE_BYTES[dtype]} bytes, its data_offsets "
            f"{offsets} span {offsets[1] - offsets[0]}"
        )
    return TensorEntry(name, dtype, tuple(shape), path, base + offsets[0], base + offsets[1])


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a model folder and, for a sharded one, its index's name -> shard map."""
    folder = Path(folder)
    if not folder.is_dir():
        raise WeightsError(
            f"run.init_from: expected a local model folder at {folder}, found nothing there (nothing is fetched "
            f"from a hub: download the model first, e.g. `huggingface-cli download NAME --local-dir DIR`)"
        )
    index_path = folder / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{index_path}: not a readable JSON file: {exc}") from exc
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
        ):
            raise WeightsError(
                f"{index_path}: expected a non-empty 'weight_map' of tensor name -> shard file"
            )
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if Path(shard).name != shard:
                raise WeightsError(f"{index_path}: shard {shard!r}: expected a file name inside {folder}")
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            raise WeightsError(
                f"run.init_from: {index_path} names {len(shards)} shards, {len(missing)} missing from {folder}: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (a partial download?)"
            )
        return [folder / shard for shard in shards], weight_map
    single = folder / SAFETENSORS_FILE
    if single.is_file():
        return [single], None
    found = sorted(p.name for p in folder.iterdir())
    raise WeightsError(
        f"run.init_from: expected {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {folder}, found "
        f"{', '.join(found[:10]) or 'an empty folder'}"
        + (
            " (pytorch_model.bin is never read: save the model with safe_serialization)"
            if "pytorch_model.bin" in found
            else ""
        )
    )


def weights_index(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of a model folder (see the module docstring), each name once."""
    files, weight_map = weight_files(folder)
    found: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in read_header(path).items():
            if weight_map is not None and weight_map.get(name) not in (None, path.name):
                continue  # the index places it elsewhere: that shard's copy is the one
            if name in found:
                raise WeightsError(
                    f"{folder}: tensor {name!r} is in both {found[name].file.name} and {path.name}"
                )
            found[name] = entry
    if weight_map is not None:
        lost = [f"{name} ({shard})" for name, shard in weight_map.items() if name not in found]
        if lost:
            raise WeightsError(
                f"{folder}: the index places {len(lost)} tensors in shards that do not hold them: "
                f"{', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''}"
            )
    if not found:
        raise WeightsError(f"run.init_from: {folder} holds no tensors")
    return found


def folder_config(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json, when it has one (a farloco export of an entry-point model has none)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{path}: not a readable JSON file: {exc}") from exc
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object")
    return data


def weights_digest(folder: Path | str) -> str:
    """sha256 over the folder's tensors in name order (see the module docstring)."""
    folder = Path(folder).resolve()
    files, _ = weight_files(folder)
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _digest_cached(folder, stamp)


@lru_cache(maxsize=8)
def _digest_cached(folder: Path, stamp: tuple[tuple[str, int, int], ...]) -> str:
    cache_file = _cache_file()
    key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()
    cached = _read_cache(cache_file).get(key)
    if isinstance(cached, str):
        return cached
    digest = hashlib.sha256(b"farloco-weights-v1")
    entries = weights_index(folder)
    maps: dict[Path, mmap.mmap] = {}
    try:
        for name in sorted(entries):
            entry = entries[name]
            digest.update(json.dumps([name, entry.dtype, list(entry.shape)]).encode())
            if entry.end == entry.start:
                continue
            if entry.file not in maps:
                with entry.file.open("rb") as file:
                    maps[entry.file] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(maps[entry.file])
            for offset in range(entry.start, entry.end, DIGEST_CHUNK):
                digest.update(view[offset : min(offset + DIGEST_CHUNK, entry.end)])
            view.release()
    finally:
        for mapped in maps.values():
            mapped.close()
    result = "sha256:" + digest.hexdigest()
    _write_cache(cache_file, key, result)
    return result


def _cache_file() -> Path:
    return Path(os.environ.get("FARLOCO_CACHE", Path.home() / ".cache" / "farloco")) / "weights-digests.json"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, digest: str) -> None:
    """Best effort (a read-only home still trains): the digest is recomputed when the cache cannot be kept."""
    from farloco.node.fsutil import write_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in _read_cache(path).items() if k != key}
        data[key] = digest  # newest last; the oldest go beyond CACHE_ENTRIES
        write_atomic(path, json.dumps(dict(list(data.items())[-CACHE_ENTRIES:]), indent=0))
    except OSError:
        pass


__all__ = [
    "CONFIG_FILE",
    "SAFETENSORS_FILE",
    "SAFETENSORS_INDEX",
    "TensorEntry",
    "WeightsError",
    "folder_config",
    "read_header",
    "weight_files",
    "weights_digest",
    "weights_index",
]
