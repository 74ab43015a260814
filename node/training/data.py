"""Token shards on disk, the bundled offline corpus, and deterministic, disjoint batch sampling.

This file owns farloco's training data path:
- ``prepare_dataset`` tokenizes .txt/.jsonl files into flat binary shards plus a ``dataset.json`` manifest;
- ``open_dataset`` validates a manifest and memory-maps its shards read-only;
- ``builtin_dataset`` builds the demo/test corpus from CPython's own ``pydoc_data.topics`` (no download);
- ``BatchSampler`` gives every (slot, rank) of the swarm its own disjoint, seeded, resumable stream of batches;
- ``eval_batches`` gives a fixed set of validation batches.

On-disk format (version 1). A dataset directory holds ``train_000.bin``, ``train_001.bin``, ... and
``val_000.bin``, ...: raw little-endian token ids (uint16 when vocab_size <= 65535, else uint32), each
document followed by the tokenizer's EOS id, documents concatenated. Every file is written to a temporary name,
fsynced and renamed, and the manifest is written last, so a directory with a manifest is always complete.

Input conventions:
- ``.txt``: the whole file is one document. Splitting on blank lines would cut code, poems and tables into
  meaningless pieces; a corpus of many small documents should come as several files or as .jsonl.
- ``.jsonl``: one JSON object per non-empty line, with a string field ``"text"``.
- A directory stands for the .txt and .jsonl files below it, in sorted path order.
Validation split: whole documents (no train/val leakage inside a document), chosen without randomness as the
text streams by: a document goes to "val" when the characters already in val are fewer than ``val_fraction``
of all characters before it, so val holds about ``val_fraction`` of the text, spread over the corpus, and the
choice does not depend on the tokenizer. (Counting documents instead would make val's share of the text hostage
to document lengths.) The first document always goes to "train", the second to "val" when val_fraction > 0.

Sampling: the train split is cut into non-overlapping windows of ``seq_len + 1`` tokens, each inside one shard
(the few tokens after a shard's last full window are not used). Window ``g`` belongs to slot ``g % num_slots``;
the slot's windows, in order, are dealt to its ranks round-robin. The split depends only on ``num_slots`` at the
first level, so nodes with different numbers of trainer ranks still never read each other's windows.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor

from farloco.node.fsutil import write_atomic
from farloco.node.training.tokenize_worker import TokenizerPool, encode_document
from farloco.node.training.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

MANIFEST_NAME = "dataset.json"
TOKENIZER_NAME = "tokenizer.json"  # a copy of the Hugging Face tokenizer the shards were made with, if any
FORMAT_NAME = "farloco-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class DatasetError(ValueError):
    """A dataset cannot be prepared or opened: bad input file, bad manifest, missing or damaged shard."""


@dataclass(frozen=True)
class ShardInfo:
    """One binary shard file of a split."""

    name: str
    """File name inside the dataset directory, e.g. ``train_000.bin``."""
    num_tokens: int
    """Number of token ids in the file (file size / dtype size)."""
    sha256: str
    """Hex sha256 of the file's bytes."""


@dataclass(frozen=True)
class DatasetInfo:
    """The content of a ``dataset.json`` manifest, plus where it lives."""

    path: Path
    """The dataset directory (holds the manifest and the shards)."""
    tokenizer: str
    """``Tokenizer.name`` of the tokenizer the shards were written with."""
    vocab_size: int
    """Every token id is below this."""
    eos_id: int
    """Id that ends every document."""
    dtype: str
    """``"uint16"`` or ``"uint32"``, little-endian."""
    shards: dict[str, tuple[ShardInfo, ...]]
    """Split name (``"train"``, ``"val"``) -> its shards in order."""
    num_documents: dict[str, int]
    """Split name -> number of documents in it."""
    source: dict[str, Any]
    """Where the text came from (free-form, JSON-serialisable)."""

    def num_tokens(self, split: str) -> int:
        """Total tokens of ``split``."""
        return sum(shard.num_tokens for shard in self.shards[_check_split(split)])

    @property
    def fingerprint(self) -> str:
        """sha256 over tokenizer, dtype and every shard's name and hash: equal fingerprints, equal data."""
        digest = hashlib.sha256(f"{self.tokenizer}|{self.vocab_size}|{self.eos_id}|{self.dtype}".encode())
        for split in SPLITS:
            for shard in self.shards[split]:
                digest.update(f"|{shard.name}:{shard.num_tokens}:{shard.sha256}".encode())
        return digest.hexdigest()

    def __str__(self) -> str:
        splits = ", ".join(
            f"{split} {self.num_tokens(split):,} tokens / {self.num_documents[split]:,} docs / "
            f"{len(self.shards[split])} shard(s)"
            for split in SPLITS
        )
        return f"{self.path} ({self.tokenizer}, vocab {self.vocab_size}, {self.dtype}): {splits}"

    def to_manifest(self) -> dict[str, Any]:
        """The JSON object stored in ``dataset.json``."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "dtype": self.dtype,
            "byte_order": "little",
            "splits": {
                split: {
                    "num_tokens": self.num_tokens(split),
                    "num_documents": self.num_documents[split],
                    "shards": [dataclasses.asdict(shard) for shard in self.shards[split]],
                }
                for split in SPLITS
            },
            "source": self.source,
        }


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    return split


def token_dtype(vocab_size: int) -> str:
    """Storage dtype for a vocabulary: uint16 when every id fits in 16 bits (vocab <= 65535), else uint32."""
    return "uint16" if vocab_size <= 65535 else "uint32"


# --------------------------------------------------------------------------------------------- writing


class _SplitWriter:
    """Appends token arrays to ``{split}_NNN.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype[Any], shard_tokens: int) -> None:
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.shards: list[ShardInfo] = []
        self.num_documents = 0
        self._handle: BinaryIO | None = None
        self._temp: Path | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def _open(self) -> BinaryIO:
        if self._handle is None:
            name = f"{self.split}_{len(self.shards):03d}.bin"
            self._temp = self.out_dir / f".{name}.{os.getpid()}.tmp"
            self._handle = open(self._temp, "wb")  # noqa: SIM115 - kept open across many appends
            self._hash, self._count = hashlib.sha256(), 0
        return self._handle

    def append(self, tokens: np.ndarray[Any, Any]) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        while len(tokens):
            handle = self._open()
            take = min(len(tokens), self.shard_tokens - self._count)
            chunk = tokens[:take].tobytes()
            handle.write(chunk)
            self._hash.update(chunk)
            self._count += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self._handle is not None and self._temp is not None
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        name = f"{self.split}_{len(self.shards):03d}.bin"
        os.replace(self._temp, self.out_dir / name)
        self.shards.append(ShardInfo(name=name, num_tokens=self._count, sha256=self._hash.hexdigest()))
        self._handle, self._temp = None, None

    def finish(self) -> tuple[ShardInfo, ...]:
        # An empty trailing shard is never written: np.memmap cannot map a zero-length file.
        if self._handle is not None and self._count > 0:
            self._close_shard()
        self.abort()
        return tuple(self.shards)

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._temp is not None:
            self._temp.unlink(missing_ok=True)
            self._temp = None


INPUT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow")
ARROW_SUFFIXES = (".parquet", ".arrow")


def _saved_dataset_files(path: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face dataset saved with `save_to_disk` (None if `path` is not one)."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DatasetError(
            f"{path} is a saved DatasetDict: expected one of its splits, e.g. {path / (splits[0] if splits else 'train')}"
        )
    state = path / "state.json"
    if not state.is_file():
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DatasetError(
            f"{state}: expected a Hugging Face dataset state with _data_files ({exc})"
        ) from exc
    files = [path / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DatasetError(f"{path}: the saved dataset's files {missing} are missing")
    return files


def _expand_inputs(inputs: Sequence[Path]) -> list[Path]:
    if isinstance(inputs, (str, Path)):
        raise DatasetError(f"inputs: expected a sequence of paths, got a single path {str(inputs)!r}")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            saved = _saved_dataset_files(path)
            found = (
                saved
                if saved is not None
                else sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in INPUT_SUFFIXES)
            )
            if not found:
                raise DatasetError(
                    f"input directory {str(path)!r} contains no {', '.join(INPUT_SUFFIXES)} files"
                )
            files.extend(found)
        elif not path.is_file():
            raise DatasetError(f"input {str(path)!r} does not exist")
        elif path.suffix not in INPUT_SUFFIXES:
            raise DatasetError(
                f"input {str(path)!r}: expected a {', '.join(INPUT_SUFFIXES)} file, got suffix {path.suffix!r}"
            )
        else:
            files.append(path)
    if not files:
        raise DatasetError(f"inputs: expected at least one {', '.join(INPUT_SUFFIXES)} file, got none")
    return files


def _arrow_batches(path: Path, text_field: str) -> Iterator[tuple[Any, int]]:
    """(a column of texts, its share of the file's bytes) per record batch: Parquet through
    pyarrow.parquet's batch reader, a saved dataset's Arrow stream memory-mapped; never the whole file."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: pip install 'farloco[data]'"
        ) from exc
    size = path.stat().st_size
    if path.suffix == ".parquet":
        try:
            reader = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{path}: not a readable Parquet file ({exc})") from exc
        schema, rows = reader.schema_arrow, reader.metadata.num_rows
        batches: Iterable[Any] = (
            reader.iter_batches(batch_size=1024, columns=[text_field]) if text_field in schema.names else ()
        )
    else:
        try:
            stream = pa.ipc.open_stream(pa.memory_map(str(path)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{path}: not an Arrow stream (a `save_to_disk` data file) ({exc})") from exc
        schema, rows, batches = stream.schema, 0, stream
    if text_field not in schema.names:
        raise DatasetError(f"{path}: expected a text field {text_field!r}, the columns are {schema.names}")
    if not pa.types.is_string(schema.field(text_field).type) and not pa.types.is_large_string(
        schema.field(text_field).type
    ):
        raise DatasetError(
            f"{path}: expected {text_field!r} to hold strings, it holds {schema.field(text_field).type}"
        )
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(text_field))
        share = size * batch.num_rows // rows if rows else 0
        yield column, share
    if not rows:
        yield [], size  # an Arrow stream does not say its row count up front: its bytes count at the end


def _read_documents(files: Sequence[Path], text_field: str = "text") -> Iterator[tuple[str, int]]:
    """(document text, input bytes consumed) in input order; `text_field` names the field of .jsonl objects and
    the column of Parquet files and saved datasets."""
    for path in files:
        if path.suffix == ".txt":
            raw = path.read_bytes()
            try:
                yield raw.decode("utf-8"), len(raw)
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}: not valid UTF-8 ({exc})") from exc
            continue
        if path.suffix in ARROW_SUFFIXES:
            row = 0
            for column, share in _arrow_batches(path, text_field):
                texts = column.to_pylist() if hasattr(column, "to_pylist") else column
                for index, text in enumerate(texts):
                    if text is None:
                        raise DatasetError(
                            f"{path}: row {row + index}: expected a string in {text_field!r}, got null"
                        )
                    yield text, share if index == 0 else 0
                if not texts:
                    yield "", share
                row += len(texts)
            continue
        with open(path, "rb") as handle:
            for line_number, raw_line in enumerate(handle, start=1):
                if not raw_line.strip():
                    yield "", len(raw_line)  # progress only; empty documents are skipped by the caller
                    continue
                try:
                    record = json.loads(raw_line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise DatasetError(
                        f"{path}:{line_number}: expected a JSON object, got invalid JSON ({exc})"
                    ) from exc
                if not isinstance(record, dict) or text_field not in record:
                    got = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
                    raise DatasetError(
                        f"{path}:{line_number}: expected an object with a {text_field!r} field, got {got}"
                    )
                if not isinstance(record[text_field], str):
                    raise DatasetError(
                        f"{path}:{line_number}: expected {text_field!r} to be a string, "
                        f"got {type(record[text_field]).__name__}"
                    )
                yield record[text_field], len(raw_line)


# Text per chunk sent to a tokenizer worker: big enough that the pipe and msgpack cost little, small enough that
# workers x depth chunks in flight stay a few MB.
CHUNK_CHARS = 1 << 20


def _chunks(documents: Iterable[tuple[str, int]]) -> Iterator[list[tuple[str, int]]]:
    chunk: list[tuple[str, int]] = []
    chars = 0
    for text, consumed in documents:
        chunk.append((text, consumed))
        chars += len(text)
        if chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encoded(
    documents: Iterable[tuple[str, int]],
    tokenizer: Tokenizer,
    spec: str | None,
    dtype_name: str,
    workers: int,
) -> Iterator[tuple[int, int, np.ndarray[Any, Any] | None]]:
    """(characters, input bytes consumed, token ids or None for an empty document), in input order; tokenized
    in `workers` processes (farloco.node.training.tokenize_worker) when more than one and a spec is known."""
    dtype = _DTYPES[dtype_name]
    if workers <= 1 or spec is None:
        for text, consumed in documents:
            yield len(text), consumed, encode_document(tokenizer, text, dtype) if text else None
        return
    chunks = _chunks(documents)
    sent: deque[list[tuple[str, int]]] = deque()

    def texts() -> Iterator[list[str]]:
        for chunk in chunks:
            sent.append(chunk)
            yield [text for text, _ in chunk if text]

    with TokenizerPool(spec, dtype.str, workers) as pool:
        for encoded in pool.map(texts()):
            chunk = sent.popleft()
            replies = iter(encoded)
            for text, consumed in chunk:
                yield len(text), consumed, np.frombuffer(next(replies), dtype=dtype) if text else None


def _write_dataset(
    documents: Iterable[tuple[str, int]],
    out_dir: Path,
    tokenizer: Tokenizer,
    *,
    spec: str | None = None,
    workers: int = 1,
    shard_tokens: int,
    val_fraction: float,
    source: dict[str, Any],
    progress_total: int,
    progress: bool,
) -> DatasetInfo:
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise DatasetError(f"shard_tokens: expected a positive int, got {shard_tokens!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise DatasetError(f"val_fraction: expected a number in [0, 1), got {val_fraction!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Drop the old manifest first: until the new one is written, the directory is "not a dataset" rather
    # than an old manifest pointing at half-replaced shards.
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    dtype_name = token_dtype(tokenizer.vocab_size)
    writers = {split: _SplitWriter(out_dir, split, _DTYPES[dtype_name], shard_tokens) for split in SPLITS}

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, disable=not progress, transient=True) as bar:
            task = bar.add_task("tokenizing", total=progress_total)
            num_chars = {split: 0 for split in SPLITS}
            for chars, consumed, tokens in _encoded(documents, tokenizer, spec, dtype_name, workers):
                bar.advance(task, consumed)
                if tokens is None:
                    continue
                seen = num_chars["train"] + num_chars["val"]
                split = "val" if num_chars["val"] < val_fraction * seen else "train"
                writers[split].append(tokens)
                writers[split].num_documents += 1
                num_chars[split] += chars
        shards = {split: writer.finish() for split, writer in writers.items()}
    finally:
        for writer in writers.values():
            writer.abort()

    if not shards["train"]:
        raise DatasetError("the inputs hold no non-empty document")
    if val_fraction > 0 and not shards["val"]:
        raise DatasetError(
            f"val_fraction={val_fraction} needs at least 2 non-empty documents (the first always goes to train), "
            f"got {writers['train'].num_documents}; pass several files or .jsonl lines, or val_fraction=0"
        )
    info = DatasetInfo(
        path=out_dir,
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        dtype=dtype_name,
        shards=shards,
        num_documents={split: writers[split].num_documents for split in SPLITS},
        source=source,
    )
    _remove_stale_shards(info)
    # The tokenizer travels with its tokens: `farloco export` ships it with the model.
    if isinstance(tokenizer, HFTokenizer):
        write_atomic(out_dir / TOKENIZER_NAME, tokenizer.content, durable=True)
    else:
        (out_dir / TOKENIZER_NAME).unlink(missing_ok=True)
    write_atomic(out_dir / MANIFEST_NAME, json.dumps(info.to_manifest(), indent=2) + "\n", durable=True)
    return info


def _remove_stale_shards(info: DatasetInfo) -> None:
    # A previous, larger preparation in the same directory may have left train_007.bin etc. behind.
    current = {shard.name for split in SPLITS for shard in info.shards[split]}
    for split in SPLITS:
        for path in info.path.glob(f"{split}_*.bin"):
            if path.name not in current:
                path.unlink()


def prepare_dataset(
    inputs: Sequence[Path],
    out_dir: Path,
    tokenizer: str = "bytes",
    *,
    text_field: str = "text",
    workers: int = 1,
    shard_tokens: int = 2**24,
    val_fraction: float = 0.05,
    progress: bool = True,
) -> DatasetInfo:
    """Tokenize ``inputs`` (.txt, .jsonl, .parquet files, Hugging Face datasets saved with ``save_to_disk``, or
    directories of them) into shards under ``out_dir``, streaming: memory stays bounded whatever the corpus size.

    ``tokenizer`` is a :func:`load_tokenizer` spec; ``text_field`` the .jsonl field or the Arrow column holding
    the text; ``workers`` > 1 tokenizes in that many processes (the shards are the same as with one). See the
    module docstring for the document conventions and the validation split rule. Replaces any dataset already in
    ``out_dir``.
    """
    if not isinstance(workers, int) or workers < 1:
        raise DatasetError(f"workers: expected a positive int, got {workers!r}")
    files = _expand_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    spec = tokenizer if tokenizer == "bytes" else str(Path(tokenizer).resolve())
    return _write_dataset(
        _read_documents(files, text_field),
        Path(out_dir),
        tok,
        spec=spec,
        workers=workers,
        shard_tokens=shard_tokens,
        val_fraction=val_fraction,
        source={"kind": "files", "inputs": [str(path) for path in files]},
        progress_total=sum(path.stat().st_size for path in files),
        progress=progress,
    )


# --------------------------------------------------------------------------------------------- reading


def _field(manifest: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    value = manifest.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DatasetError(f"{where}: field {key!r}: expected {kind.__name__}, got {value!r}")
    return value


def _parse_manifest(manifest_path: Path) -> DatasetInfo:
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(
            f"{manifest_path.parent} is not a prepared dataset: {MANIFEST_NAME} is missing "
            "(create one with prepare_dataset / `farloco data prepare`)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{manifest_path}: expected a JSON manifest, got invalid JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise DatasetError(f"{manifest_path}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise DatasetError(
            f"{manifest_path}: expected format {FORMAT_NAME!r} version {FORMAT_VERSION}, "
            f"got format {manifest.get('format')!r} version {manifest.get('version')!r}"
        )
    vocab_size = _field(manifest, "vocab_size", int, manifest_path)
    eos_id = _field(manifest, "eos_id", int, manifest_path)
    dtype = _field(manifest, "dtype", str, manifest_path)
    if vocab_size < 1 or not 0 <= eos_id < vocab_size:
        raise DatasetError(
            f"{manifest_path}: expected 0 <= eos_id < vocab_size, got {eos_id} and {vocab_size}"
        )
    if dtype != token_dtype(vocab_size):
        raise DatasetError(
            f"{manifest_path}: vocab_size {vocab_size} is stored as {token_dtype(vocab_size)}, manifest says {dtype!r}"
        )
    if manifest.get("byte_order") != "little":
        raise DatasetError(
            f"{manifest_path}: expected byte_order 'little', got {manifest.get('byte_order')!r}"
        )
    splits = _field(manifest, "splits", dict, manifest_path)
    shards: dict[str, tuple[ShardInfo, ...]] = {}
    num_documents: dict[str, int] = {}
    for split in SPLITS:
        entry = splits.get(split)
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
            raise DatasetError(f"{manifest_path}: splits.{split}: expected an object with a 'shards' list")
        num_documents[split] = _field(entry, "num_documents", int, manifest_path)
        parsed: list[ShardInfo] = []
        for shard in entry["shards"]:
            if not isinstance(shard, dict) or set(shard) != {"name", "num_tokens", "sha256"}:
                raise DatasetError(
                    f"{manifest_path}: splits.{split}.shards: expected objects with name, num_tokens, sha256, got {shard!r}"
                )
            name, num_tokens, sha = shard["name"], shard["num_tokens"], shard["sha256"]
            if not (
                isinstance(name, str)
                and name.startswith(f"{split}_")
                and "/" not in name
                and name.endswith(".bin")
            ):
                raise DatasetError(f"{manifest_path}: splits.{split}: bad shard name {name!r}")
            if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
                raise DatasetError(
                    f"{manifest_path}: shard {name}: expected num_tokens >= 1, got {num_tokens!r}"
                )
            if not isinstance(sha, str) or len(sha) != 64:
                raise DatasetError(f"{manifest_path}: shard {name}: expected a 64-hex sha256, got {sha!r}")
            parsed.append(ShardInfo(name=name, num_tokens=num_tokens, sha256=sha))
        shards[split] = tuple(parsed)
        if entry.get("num_tokens") != sum(s.num_tokens for s in parsed):
            raise DatasetError(
                f"{manifest_path}: splits.{split}.num_tokens is {entry.get('num_tokens')!r}, "
                f"but its shards hold {sum(s.num_tokens for s in parsed)}"
            )
    if not shards["train"]:
        raise DatasetError(f"{manifest_path}: the train split has no shards")
    source = manifest.get("source", {})
    return DatasetInfo(
        path=manifest_path.parent,
        tokenizer=_field(manifest, "tokenizer", str, manifest_path),
        vocab_size=vocab_size,
        eos_id=eos_id,
        dtype=dtype,
        shards=shards,
        num_documents=num_documents,
        source=source if isinstance(source, dict) else {},
    )


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class TokenDataset:
    """A prepared dataset, its shards memory-mapped read-only (nothing is loaded until read)."""

    def __init__(self, info: DatasetInfo) -> None:
        self.info = info
        dtype = _DTYPES[info.dtype]
        self._shards: dict[str, tuple[np.memmap[Any, Any], ...]] = {}
        for split in SPLITS:
            maps = []
            for shard in info.shards[split]:
                path = info.path / shard.name
                if not path.is_file():
                    raise DatasetError(
                        f"{info.path}: shard {shard.name} listed in {MANIFEST_NAME} is missing"
                    )
                expected = shard.num_tokens * dtype.itemsize
                if path.stat().st_size != expected:
                    raise DatasetError(
                        f"{path}: expected {expected} bytes ({shard.num_tokens} {info.dtype} tokens), "
                        f"got {path.stat().st_size} bytes"
                    )
                maps.append(np.memmap(path, dtype=dtype, mode="r"))
            self._shards[split] = tuple(maps)

    @property
    def path(self) -> Path:
        """The dataset directory."""
        return self.info.path

    @property
    def vocab_size(self) -> int:
        """Every token id is below this; a model trained on the dataset needs at least this vocab."""
        return self.info.vocab_size

    def num_tokens(self, split: str) -> int:
        """Total tokens of ``split`` ("train" or "val")."""
        return self.info.num_tokens(split)

    def shards(self, split: str) -> tuple[np.memmap[Any, Any], ...]:
        """The read-only memory maps of ``split``'s shards, in order."""
        return self._shards[_check_split(split)]

    def verify(self) -> None:
        """Re-hash every shard and compare with the manifest (reads the whole dataset)."""
        for split in SPLITS:
            for shard in self.info.shards[split]:
                actual = _sha256_file(self.info.path / shard.name)
                if actual != shard.sha256:
                    raise DatasetError(
                        f"{self.info.path / shard.name}: sha256 {actual} does not match the manifest's {shard.sha256}"
                    )


def open_dataset(path: Path, *, verify: bool = False) -> TokenDataset:
    """Open a prepared dataset (its directory or its dataset.json). ``verify`` re-hashes every shard."""
    path = Path(path)
    manifest_path = path if path.name == MANIFEST_NAME else path / MANIFEST_NAME
    dataset = TokenDataset(_parse_manifest(manifest_path))
    if verify:
        dataset.verify()
    return dataset


# --------------------------------------------------------------------------------------------- builtin


def _builtin_documents() -> tuple[list[str], str]:
    import pydoc_data.topics

    topics: dict[str, str] = pydoc_data.topics.topics
    # Sorted topic names fix the order independently of dict insertion order in a given CPython release.
    names = sorted(topics)
    digest = hashlib.sha256()
    for name in names:
        digest.update(f"{name}\0{topics[name]}\0".encode())
    return [topics[name] for name in names], digest.hexdigest()


def builtin_dataset(cache_dir: Path) -> Path:
    """The bundled demo/test corpus, prepared with the byte tokenizer under ``cache_dir``; returns its directory.

    The text is CPython's ``pydoc_data.topics`` (the help() pages, ~460 KB), one document per topic in sorted
    topic order. It ships with Python, so nothing is downloaded; it differs between CPython releases, which
    ``DatasetInfo.fingerprint`` reveals. Idempotent and safe to call from several processes at once: an existing
    copy is reused when its manifest matches this Python's text and its shards check out.
    """
    documents, source_sha = _builtin_documents()
    out_dir = Path(cache_dir) / "pydoc-topics"
    out_dir.mkdir(parents=True, exist_ok=True)
    source = {
        "kind": "pydoc_data.topics",
        "python": ".".join(map(str, sys.version_info[:3])),
        "sha256": source_sha,
    }
    with _FileLock(out_dir / ".lock"):
        try:
            existing = open_dataset(out_dir, verify=True)
            if existing.info.source == source and existing.info.tokenizer == ByteTokenizer.name:
                return out_dir
        except DatasetError:
            pass  # missing or stale: rebuild below
        _write_dataset(
            ((text, 1) for text in documents),
            out_dir,
            ByteTokenizer(),
            shard_tokens=2**24,
            val_fraction=0.05,
            source=source,
            progress_total=len(documents),
            progress=False,
        )
    return out_dir


class _FileLock:
    """An exclusive flock on a file: serialises builders of one cache directory across processes."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None

    def __enter__(self) -> None:
        self._fd = os.open(self._path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


# --------------------------------------------------------------------------------------------- sampling


class _Windows:
    """Non-overlapping windows of ``window`` tokens over a split's shards, addressed by a global index."""

    def __init__(self, dataset: TokenDataset, split: str, window: int) -> None:
        self.shards = dataset.shards(split)
        self.window = window
        self.per_shard = np.array([len(shard) // window for shard in self.shards], dtype=np.int64)
        self.ends = np.cumsum(self.per_shard)
        self.count = int(self.ends[-1]) if len(self.ends) else 0

    def read(self, indices: np.ndarray[Any, Any]) -> Tensor:
        """Windows ``indices`` as an int64 tensor [len(indices), window]."""
        out = np.empty((len(indices), self.window), dtype=np.int64)
        shard_ids = np.searchsorted(self.ends, indices, side="right")
        for row, (index, shard_id) in enumerate(zip(indices.tolist(), shard_ids.tolist(), strict=True)):
            offset = (index - int(self.ends[shard_id] - self.per_shard[shard_id])) * self.window
            out[row] = self.shards[shard_id][offset : offset + self.window]
        return torch.from_numpy(out)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


class BatchSampler:
    """Batches of the train split for one trainer rank of one swarm slot; disjoint from every other (slot, rank).

    Window ``g`` of the train split belongs to slot ``g % num_slots``; the slot's windows in order are dealt
    round-robin to its ``world_size`` ranks. A rank's share is read as an endless sequence of epochs, each a
    permutation of the share seeded by (seed, slot, num_slots, rank, world_size, epoch); batch ``step`` is
    positions ``[step*B, (step+1)*B)`` of that sequence (a batch may straddle two epochs, so every window of the
    share is read exactly once per epoch). ``batch(step)`` is a pure function of ``step``: resuming at step s
    gives the batches an uninterrupted run would have seen.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        split: str,
        seq_len: int,
        batch_size: int,
        *,
        slot: int,
        num_slots: int,
        rank: int,
        world_size: int,
        seed: int,
    ) -> None:
        for name, value in (
            ("seq_len", seq_len),
            ("batch_size", batch_size),
            ("num_slots", num_slots),
            ("world_size", world_size),
        ):
            _check_positive(name, value)
        if not isinstance(slot, int) or not 0 <= slot < num_slots:
            raise ValueError(f"slot: expected an int in [0, num_slots={num_slots}), got {slot!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank: expected an int in [0, world_size={world_size}), got {rank!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
        self.split = _check_split(split)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.slot, self.num_slots, self.rank, self.world_size, self.seed = (
            slot,
            num_slots,
            rank,
            world_size,
            seed,
        )
        self._windows = _Windows(dataset, split, seq_len + 1)
        total = self._windows.count
        slot_share = max(0, -(-(total - slot) // num_slots))
        # Windows in this rank's share: one epoch of this sampler.
        self.samples_per_epoch = max(0, -(-(slot_share - rank) // world_size))
        if self.samples_per_epoch < batch_size:
            raise ValueError(
                f"slot {slot} of num_slots={num_slots}, rank {rank} of world_size={world_size} gets "
                f"{self.samples_per_epoch} sample(s) of seq_len+1={seq_len + 1} tokens (the {split} split has "
                f"{total} samples from {dataset.num_tokens(split)} tokens), fewer than batch_size={batch_size}"
            )
        self._permutations: dict[int, np.ndarray[Any, Any]] = {}

    def _permutation(self, epoch: int) -> np.ndarray[Any, Any]:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a batch spans at most two epochs
                self._permutations.pop(min(self._permutations))
            key = [self.seed, self.slot, self.num_slots, self.rank, self.world_size, epoch]
            generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence(key)))
            self._permutations[epoch] = generator.permutation(self.samples_per_epoch)
        return self._permutations[epoch]

    def sample_indices(self, step: int) -> np.ndarray[Any, Any]:
        """Global indices (in the split's window numbering) of the samples of batch ``step``."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step: expected a non-negative int, got {step!r}")
        positions = np.arange(step * self.batch_size, (step + 1) * self.batch_size, dtype=np.int64)
        epochs, within = np.divmod(positions, self.samples_per_epoch)
        share_index = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            share_index[mask] = self._permutation(epoch)[within[mask]]
        return (share_index * self.world_size + self.rank) * self.num_slots + self.slot

    def epoch(self, step: int) -> float:
        """How many epochs of this rank's share were read before batch ``step``."""
        return step * self.batch_size / self.samples_per_epoch

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets), int64 [batch_size, seq_len]; targets are inputs shifted by one token."""
        windows = self._windows.read(self.sample_indices(step))
        return windows[:, :-1], windows[:, 1:]


def eval_batches(
    dataset: TokenDataset, seq_len: int, batch_size: int, num_batches: int
) -> list[tuple[Tensor, Tensor]]:
    """``num_batches`` fixed (inputs, targets) batches of the val split: windows evenly spread over it."""
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("num_batches", num_batches)):
        _check_positive(name, value)
    windows = _Windows(dataset, "val", seq_len + 1)
    wanted = num_batches * batch_size
    if wanted > windows.count:
        raise ValueError(
            f"eval_batches: {num_batches} batches x {batch_size} need {wanted} samples of seq_len+1={seq_len + 1} "
            f"tokens, but the val split has {windows.count} ({dataset.num_tokens('val')} tokens)"
        )
    indices = np.arange(wanted, dtype=np.int64) * windows.count // wanted
    batches = []
    for start in range(0, wanted, batch_size):
        tokens = windows.read(indices[start : start + batch_size])
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches
