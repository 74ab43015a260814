"""Tests for farloco.node.training.data and farloco.node.training.tokenizer: shards, manifests, builtin corpus, sampling."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from farloco.node.training.data import (
    BatchSampler,
    DatasetError,
    builtin_dataset,
    eval_batches,
    open_dataset,
    prepare_dataset,
    token_dtype,
)
from farloco.node.training.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _stream(dataset_path: Path, split: str) -> np.ndarray:
    dataset = open_dataset(dataset_path)
    return np.concatenate([np.asarray(shard) for shard in dataset.shards(split)])


# --------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer() -> None:
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("bytes", 256, 0)
    assert tok.encode("hé!") == [104, 195, 169, 33]
    assert tok.decode(tok.encode("hé!")) == "hé!"
    assert tok.decode([104, 195]) == "h\ufffd"  # half a character decodes, it does not raise


def test_load_tokenizer_refuses_unknown_spec(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"expected 'bytes' or the path of a tokenizer.json file"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_hf_tokenizer_without_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    path = _write(tmp_path / "tokenizer.json", "{}")
    with pytest.raises(ImportError, match=r"pip install tokenizers"):
        load_tokenizer(str(path))


def test_hf_tokenizer_prepares_uint32_shards(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    # A word-level vocabulary larger than 65535 ids forces the uint32 storage path.
    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    vocab.update({f"w{i}": i for i in range(4, 70000)})
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))

    tok = HFTokenizer(tmp_path / "tokenizer.json")
    assert (tok.vocab_size, tok.eos_id) == (70000, 1)
    assert tok.name.startswith("hf:sha256=")
    assert tok.encode("hello world w69999") == [2, 3, 69999]

    corpus = _write(tmp_path / "c.jsonl", '{"text": "hello world"}\n{"text": "w69999 hello"}\n')
    info = prepare_dataset([corpus], tmp_path / "ds", str(tmp_path), val_fraction=0, progress=False)
    assert info.dtype == "uint32" and info.tokenizer == tok.name
    assert _stream(tmp_path / "ds", "train").tolist() == [2, 3, 1, 69999, 2, 1]
    assert (tmp_path / "ds" / "train_000.bin").read_bytes()[:8] == bytes([2, 0, 0, 0, 3, 0, 0, 0])


# --------------------------------------------------------------------------------------------- prepare


def test_prepare_txt_writes_exact_tokens_and_manifest(tmp_path: Path) -> None:
    first = _write(tmp_path / "a.txt", "Hello, world.\n\nSecond paragraph.")
    second = _write(tmp_path / "b.txt", "ünïcode")
    info = prepare_dataset([first, second], tmp_path / "out", val_fraction=0, progress=False)

    expected = [*first.read_bytes(), 0, *second.read_bytes(), 0]
    assert _stream(tmp_path / "out", "train").tolist() == expected
    assert info.num_tokens("train") == len(expected) and info.num_tokens("val") == 0
    assert info.num_documents == {"train": 2, "val": 0}
    assert str(info).endswith("val 0 tokens / 0 docs / 0 shard(s)")

    manifest = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert (
        manifest["tokenizer"] == "bytes" and manifest["vocab_size"] == 256 and manifest["dtype"] == "uint16"
    )
    (shard,) = manifest["splits"]["train"]["shards"]
    assert shard["name"] == "train_000.bin" and shard["num_tokens"] == len(expected)
    raw = (tmp_path / "out" / "train_000.bin").read_bytes()
    assert shard["sha256"] == hashlib.sha256(raw).hexdigest()
    assert raw == np.asarray(expected, dtype="<u2").tobytes()  # little-endian uint16 on disk
    assert manifest["splits"]["val"]["shards"] == []
    assert not list((tmp_path / "out").glob(".*tmp"))  # no temp files left behind


def test_prepare_jsonl_and_val_split(tmp_path: Path) -> None:
    texts = [f"document number {i} " * (1 + i % 3) for i in range(40)]
    lines = [json.dumps({"text": text, "id": i}) for i, text in enumerate(texts)]
    lines.insert(5, "")  # blank lines are skipped
    corpus = _write(tmp_path / "c.jsonl", "\n".join(lines) + "\n")
    info = prepare_dataset([tmp_path], tmp_path / "out", val_fraction=0.25, progress=False)  # a directory

    train, val = _stream(tmp_path / "out", "train"), _stream(tmp_path / "out", "val")
    assert corpus.exists()
    # Every document lands whole in exactly one split, in input order.
    docs_train = bytes(train.astype(np.uint8)).split(b"\0")[:-1]
    docs_val = bytes(val.astype(np.uint8)).split(b"\0")[:-1]
    assert sorted(docs_train + docs_val) == sorted(t.encode() for t in texts)
    assert docs_train[0] == texts[0].encode() and docs_val[0] == texts[1].encode()
    assert info.num_documents == {"train": len(docs_train), "val": len(docs_val)}
    val_share = sum(map(len, docs_val)) / sum(len(t) for t in texts)
    assert 0.2 < val_share < 0.3


def test_prepare_splits_into_shards_and_removes_stale_ones(tmp_path: Path) -> None:
    text = "abcdefghij" * 50
    corpus = _write(tmp_path / "c.txt", text)
    info = prepare_dataset([corpus], tmp_path / "out", shard_tokens=128, val_fraction=0, progress=False)
    names = [shard.name for shard in info.shards["train"]]
    assert names == ["train_000.bin", "train_001.bin", "train_002.bin", "train_003.bin"]
    assert [shard.num_tokens for shard in info.shards["train"]] == [128, 128, 128, 117]
    assert _stream(tmp_path / "out", "train").tolist() == [*text.encode(), 0]

    again = prepare_dataset([corpus], tmp_path / "out", shard_tokens=1000, val_fraction=0, progress=False)
    assert [shard.name for shard in again.shards["train"]] == ["train_000.bin"]
    assert sorted(p.name for p in (tmp_path / "out").glob("*.bin")) == ["train_000.bin"]


def test_prepare_input_errors(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(
        DatasetError, match=r"bad.jsonl:2: expected an object with a 'text' field, got keys \['body'\]"
    ):
        prepare_dataset([bad], tmp_path / "o1", progress=False)
    broken = _write(tmp_path / "broken.jsonl", '{"text": "ok"}\n{"text": \n')
    with pytest.raises(DatasetError, match=r"broken.jsonl:2: expected a JSON object, got invalid JSON"):
        prepare_dataset([broken], tmp_path / "o2", progress=False)
    typed = _write(tmp_path / "typed.jsonl", '{"text": 5}\n')
    with pytest.raises(DatasetError, match=r"typed.jsonl:1: expected 'text' to be a string, got int"):
        prepare_dataset([typed], tmp_path / "o3", progress=False)
    csv = _write(tmp_path / "x.csv", "a,b")
    with pytest.raises(
        DatasetError, match=r"expected a .txt, .jsonl, .parquet, .arrow file, got suffix '.csv'"
    ):
        prepare_dataset([csv], tmp_path / "o4", progress=False)
    single = _write(tmp_path / "one.txt", "just one document")
    with pytest.raises(DatasetError, match=r"val_fraction=0.05 needs at least 2 non-empty documents"):
        prepare_dataset([single], tmp_path / "o5", progress=False)
    with pytest.raises(DatasetError, match=r"val_fraction: expected a number in \[0, 1\), got 1.5"):
        prepare_dataset([single], tmp_path / "o6", val_fraction=1.5, progress=False)
    with pytest.raises(DatasetError, match=r"does not exist"):
        prepare_dataset([tmp_path / "missing.txt"], tmp_path / "o7", progress=False)


def test_token_dtype() -> None:
    assert token_dtype(256) == "uint16" and token_dtype(65535) == "uint16" and token_dtype(65536) == "uint32"


# --------------------------------------------------------------------------------------------- open


@pytest.fixture
def small_dataset(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    with open(corpus, "w") as handle:
        for _ in range(60):
            handle.write(json.dumps({"text": " ".join(rng.choice(words, size=40))}) + "\n")
    # Several small shards, so samples come from more than one file.
    prepare_dataset([corpus], tmp_path / "ds", shard_tokens=4096, val_fraction=0.1, progress=False)
    return tmp_path / "ds"


def test_open_dataset_memmaps_read_only(small_dataset: Path) -> None:
    dataset = open_dataset(small_dataset, verify=True)
    assert dataset.vocab_size == 256
    assert dataset.num_tokens("train") == sum(len(s) for s in dataset.shards("train")) > 10000
    shard = dataset.shards("train")[0]
    assert isinstance(shard, np.memmap) and shard.dtype == np.dtype("<u2")
    with pytest.raises(ValueError, match="read-only"):
        shard[0] = 1
    assert open_dataset(small_dataset / "dataset.json").num_tokens("val") == dataset.num_tokens("val") > 0
    with pytest.raises(ValueError, match=r"unknown split 'test'"):
        dataset.num_tokens("test")


def test_open_dataset_validation_errors(small_dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"is not a prepared dataset: dataset.json is missing"):
        open_dataset(tmp_path / "empty")
    manifest_path = small_dataset / "dataset.json"
    good = json.loads(manifest_path.read_text())

    def broken(change: dict) -> None:
        manifest_path.write_text(json.dumps({**good, **change}))

    broken({"version": 9})
    with pytest.raises(DatasetError, match=r"expected format 'farloco-tokens' version 1, got .* version 9"):
        open_dataset(small_dataset)
    broken({"dtype": "uint32"})
    with pytest.raises(DatasetError, match=r"vocab_size 256 is stored as uint16, manifest says 'uint32'"):
        open_dataset(small_dataset)
    broken({"vocab_size": "256"})
    with pytest.raises(DatasetError, match=r"field 'vocab_size': expected int, got '256'"):
        open_dataset(small_dataset)
    manifest_path.write_text("{not json")
    with pytest.raises(DatasetError, match=r"expected a JSON manifest, got invalid JSON"):
        open_dataset(small_dataset)

    broken({})
    shard_path = small_dataset / "train_001.bin"
    data = shard_path.read_bytes()
    shard_path.write_bytes(data[:-2])
    with pytest.raises(
        DatasetError, match=r"train_001.bin: expected 8192 bytes \(4096 uint16 tokens\), got 8190"
    ):
        open_dataset(small_dataset)
    shard_path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    open_dataset(small_dataset)  # sizes are right; only verify reads the bytes
    with pytest.raises(DatasetError, match=r"train_001.bin: sha256 [0-9a-f]{64} does not match"):
        open_dataset(small_dataset, verify=True)
    shard_path.unlink()
    with pytest.raises(DatasetError, match=r"shard train_001.bin listed in dataset.json is missing"):
        open_dataset(small_dataset)


# --------------------------------------------------------------------------------------------- sampling


def _epoch_indices(sampler: BatchSampler) -> np.ndarray:
    """The share's windows in the order of epoch 0 (its last batch may run into epoch 1)."""
    num_steps = -(-sampler.samples_per_epoch // sampler.batch_size)
    steps = [sampler.sample_indices(step) for step in range(num_steps)]
    return np.concatenate(steps)[: sampler.samples_per_epoch]


@pytest.mark.parametrize("num_slots, world_size", [(1, 1), (1, 3), (2, 2), (3, 1), (4, 3), (5, 2)])
def test_slices_are_disjoint_and_cover_the_epoch(
    small_dataset: Path, num_slots: int, world_size: int
) -> None:
    dataset = open_dataset(small_dataset)
    seq_len = 15
    num_windows = sum(len(shard) // (seq_len + 1) for shard in dataset.shards("train"))
    owner: dict[int, tuple[int, int]] = {}
    for slot in range(num_slots):
        for rank in range(world_size):
            sampler = BatchSampler(
                dataset, "train", seq_len, 4, slot=slot, num_slots=num_slots, rank=rank,
                world_size=world_size, seed=1,
            )  # fmt: skip
            indices = _epoch_indices(sampler).tolist()
            assert len(set(indices)) == len(indices) == sampler.samples_per_epoch
            for index in indices:
                assert owner.setdefault(index, (slot, rank)) == (slot, rank), f"window {index} read twice"
    assert sorted(owner) == list(range(num_windows))


def test_slots_with_different_world_sizes_stay_disjoint(small_dataset: Path) -> None:
    # A 1-rank node and a 3-rank node in one swarm of 2 slots.
    dataset = open_dataset(small_dataset)
    seen: list[set[int]] = []
    for slot, world_size in ((0, 1), (1, 3)):
        for rank in range(world_size):
            sampler = BatchSampler(
                dataset, "train", 15, 4, slot=slot, num_slots=2, rank=rank, world_size=world_size, seed=5
            )
            seen.append(set(_epoch_indices(sampler).tolist()))
    assert sum(map(len, seen)) == len(set().union(*seen))


def test_batches_hold_the_right_tokens(small_dataset: Path) -> None:
    dataset = open_dataset(small_dataset)
    seq_len = 31
    sampler = BatchSampler(dataset, "train", seq_len, 3, slot=1, num_slots=2, rank=0, world_size=2, seed=0)
    windows = np.concatenate(
        [
            np.asarray(shard[: len(shard) // (seq_len + 1) * (seq_len + 1)]).reshape(-1, seq_len + 1)
            for shard in dataset.shards("train")
        ]
    )
    for step in (0, 7, 1000):
        inputs, targets = sampler.batch(step)
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.shape == targets.shape == (3, seq_len)
        expected = torch.from_numpy(windows[sampler.sample_indices(step)].astype(np.int64))
        assert torch.equal(inputs, expected[:, :-1]) and torch.equal(targets, expected[:, 1:])
        assert all(index % 2 == 1 and (index // 2) % 2 == 0 for index in sampler.sample_indices(step))


def test_resume_is_deterministic_and_epochs_reshuffle(small_dataset: Path) -> None:
    dataset = open_dataset(small_dataset)

    def make(seed: int) -> BatchSampler:
        return BatchSampler(dataset, "train", 15, 4, slot=0, num_slots=1, rank=0, world_size=1, seed=seed)

    uninterrupted = make(3)
    run = [uninterrupted.batch(step) for step in range(60)]
    resumed = make(3)  # a fresh process resuming at step 40
    for step in range(40, 60):
        assert all(torch.equal(a, b) for a, b in zip(resumed.batch(step), run[step], strict=True))
    assert torch.equal(make(3).batch(1_000_000)[0], make(3).batch(1_000_000)[0])
    assert not torch.equal(make(4).batch(0)[0], run[0][0])

    per_epoch = uninterrupted.samples_per_epoch
    assert per_epoch % 4 != 0  # the fixture makes some batch straddle two epochs
    epoch0 = np.concatenate([uninterrupted.sample_indices(s) for s in range(3 * per_epoch // 4 + 4)])
    first, second = epoch0[:per_epoch], epoch0[per_epoch : 2 * per_epoch]
    assert sorted(first.tolist()) == sorted(second.tolist()) and not np.array_equal(first, second)
    assert uninterrupted.epoch(per_epoch) == pytest.approx(4.0)


def test_sampler_errors_name_the_numbers(small_dataset: Path) -> None:
    dataset = open_dataset(small_dataset)
    with pytest.raises(
        ValueError,
        match=r"slot 0 of num_slots=500, rank 1 of world_size=2 gets \d+ sample\(s\) of seq_len\+1=64 tokens "
        r"\(the train split has \d+ samples from \d+ tokens\), fewer than batch_size=8",
    ):
        BatchSampler(dataset, "train", 63, 8, slot=0, num_slots=500, rank=1, world_size=2, seed=0)
    with pytest.raises(ValueError, match=r"slot: expected an int in \[0, num_slots=2\), got 2"):
        BatchSampler(dataset, "train", 8, 1, slot=2, num_slots=2, rank=0, world_size=1, seed=0)
    with pytest.raises(ValueError, match=r"step: expected a non-negative int, got -1"):
        BatchSampler(dataset, "train", 8, 1, slot=0, num_slots=1, rank=0, world_size=1, seed=0).batch(-1)


def test_eval_batches_are_fixed_and_from_val(small_dataset: Path) -> None:
    dataset = open_dataset(small_dataset)
    first = eval_batches(dataset, 15, 4, 3)
    second = eval_batches(open_dataset(small_dataset), 15, 4, 3)
    assert len(first) == 3
    for (inputs, targets), (inputs2, targets2) in zip(first, second, strict=True):
        assert inputs.shape == (4, 15) and torch.equal(inputs, inputs2) and torch.equal(targets, targets2)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
    val = np.concatenate([np.asarray(s) for s in dataset.shards("val")])
    assert torch.equal(first[0][0][0], torch.from_numpy(val[:15].astype(np.int64)))
    with pytest.raises(ValueError, match=r"1000 batches x 4 need 4000 samples of seq_len\+1=16 tokens"):
        eval_batches(dataset, 15, 4, 1000)


# --------------------------------------------------------------------------------------------- builtin


def test_builtin_dataset_builds_offline_and_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pydoc_data.topics
    import socket

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("builtin_dataset tried to open a socket")

    with monkeypatch.context() as patch:
        patch.setattr(socket, "socket", no_network)
        path = builtin_dataset(tmp_path)
    dataset = open_dataset(path, verify=True)
    topics = pydoc_data.topics.topics
    total_bytes = sum(len(text.encode()) for text in topics.values())
    assert dataset.num_tokens("train") + dataset.num_tokens("val") == total_bytes + len(topics)
    assert dataset.info.num_documents["train"] + dataset.info.num_documents["val"] == len(topics)
    assert dataset.info.source["kind"] == "pydoc_data.topics"
    # Documents come in sorted-topic order; the first topic is the first document of train.
    first = topics[sorted(topics)[0]].encode()
    assert bytes(np.asarray(dataset.shards("train")[0][: len(first)]).astype(np.uint8)) == first
    BatchSampler(dataset, "train", 128, 8, slot=3, num_slots=4, rank=1, world_size=2, seed=0).batch(0)
    eval_batches(dataset, 128, 8, 4)

    shard = path / "train_000.bin"
    inode = shard.stat().st_ino
    assert builtin_dataset(tmp_path) == path and shard.stat().st_ino == inode  # reused, not rewritten
    shard.write_bytes(b"\0\0" + shard.read_bytes()[2:])  # damage: same size, wrong hash
    builtin_dataset(tmp_path)
    assert open_dataset(path, verify=True).info.fingerprint == dataset.info.fingerprint


# --------------------------------------------------------------------------------------------- Parquet, Arrow, workers
DOCS = [f"document {i}: " + "the swarm trains " * (i % 7 + 1) + f"end {i}" for i in range(300)]


def _parquet(path: Path, column: str = "content", docs: list[str] | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(docs or DOCS))), column: docs or DOCS})
    pq.write_table(table, path, row_group_size=64)  # several row groups: read batch by batch
    return path


def _saved_dataset(folder: Path, docs: list[str]) -> Path:
    """The layout of `datasets.Dataset.save_to_disk`: state.json naming Arrow stream files (written here with
    pyarrow, as the datasets library writes them)."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    names = []
    for index, part in enumerate((docs[: len(docs) // 2], docs[len(docs) // 2 :])):
        name = f"data-{index:05d}-of-00002.arrow"
        table = pa.table({"text": part, "label": [0] * len(part)})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=50):
                writer.write_batch(batch)
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names, "_fingerprint": "x"}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def _word_tokenizer(path: Path) -> Path:
    import tokenizers

    words = sorted({w for doc in DOCS for w in doc.replace(":", " :").split()})
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    made = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    made.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    made.save(str(path))
    return path


def test_parquet_and_a_saved_dataset_give_the_shards_the_same_texts_give_as_jsonl(tmp_path: Path) -> None:
    jsonl = _write(tmp_path / "c.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    reference = prepare_dataset([jsonl], tmp_path / "ref", val_fraction=0.1, progress=False)
    parquet = _parquet(tmp_path / "c.parquet")
    from_parquet = prepare_dataset(
        [parquet], tmp_path / "pq", text_field="content", val_fraction=0.1, progress=False
    )
    saved = _saved_dataset(tmp_path / "saved" / "train", DOCS)
    from_saved = prepare_dataset([saved], tmp_path / "hf", val_fraction=0.1, progress=False)
    for info in (from_parquet, from_saved):
        assert info.num_documents == reference.num_documents
        for split in ("train", "val"):
            assert np.array_equal(_stream(info.path, split), _stream(reference.path, split))


def test_several_tokenizer_workers_write_the_shards_one_process_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import farloco.node.training.data as data

    tokenizer = str(_word_tokenizer(tmp_path / "tokenizer.json"))
    parquet = _parquet(tmp_path / "c.parquet", column="text")
    monkeypatch.setattr(data, "CHUNK_CHARS", 500)  # many chunks, several in flight per worker
    one = prepare_dataset([parquet], tmp_path / "one", tokenizer, workers=1, progress=False)
    three = prepare_dataset([parquet], tmp_path / "three", tokenizer, workers=3, progress=False)
    assert one.num_documents == three.num_documents
    assert sum(one.num_documents.values()) == len(DOCS) and one.num_documents["val"] > 0
    for split in ("train", "val"):
        ones, threes = _stream(one.path, split), _stream(three.path, split)
        assert ones.dtype == threes.dtype and np.array_equal(ones, threes)
    assert 0 not in _stream(three.path, "train")  # every word known: no <unk>


def test_arrow_inputs_refuse_what_they_cannot_read_naming_it(tmp_path: Path) -> None:
    parquet = _parquet(tmp_path / "c.parquet")
    with pytest.raises(
        DatasetError, match=r"expected a text field 'text', the columns are \['id', 'content'\]"
    ):
        prepare_dataset([parquet], tmp_path / "out", progress=False)
    with pytest.raises(DatasetError, match=r"expected 'id' to hold strings, it holds int64"):
        prepare_dataset([parquet], tmp_path / "out", text_field="id", progress=False)
    nulls = _parquet(tmp_path / "n.parquet", column="text", docs=["a", None, "b"])  # type: ignore[list-item]
    with pytest.raises(DatasetError, match=r"n.parquet: row 1: expected a string in 'text', got null"):
        prepare_dataset([nulls], tmp_path / "out", progress=False)
    broken = _write(tmp_path / "broken.parquet", "not parquet at all")
    with pytest.raises(DatasetError, match=r"broken.parquet: not a readable Parquet file"):
        prepare_dataset([broken], tmp_path / "out", progress=False)
    saved = tmp_path / "dict"
    _saved_dataset(saved / "train", DOCS[:10])
    (saved / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(
        DatasetError, match=r"is a saved DatasetDict: expected one of its splits, e.g. .*dict/train"
    ):
        prepare_dataset([saved], tmp_path / "out", progress=False)


def test_data_prepare_cli_reads_parquet_with_workers(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from farloco.node.tools.cli import main

    tokenizer = _word_tokenizer(tmp_path / "tokenizer.json")
    parquet = _parquet(tmp_path / "c.parquet")
    result = CliRunner().invoke(
        main,
        ["data", "prepare", str(parquet), "--out", str(tmp_path / "ds"), "--tokenizer", str(tokenizer),
         "--text-field", "content", "--workers", "2"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    counts = open_dataset(tmp_path / "ds").info.num_documents
    assert sum(counts.values()) == len(DOCS) and counts["val"] > 0
