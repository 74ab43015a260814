"""`farloco data prepare` throughput: one tokenizer process against several, on a generated Parquet corpus.

    python benchmarks/data_prepare.py                       # 1 GB of text, a BPE tokenizer of 16k, 1 vs all cores
    python benchmarks/data_prepare.py --gigabytes 0.05 --workers 1 2

The corpus is generated (nothing downloaded): documents of 50-2000 words drawn from a Zipf distribution over a
fixed vocabulary of made-up words, seeded, written as Parquet files of 64 MB with a `content` column. A
byte-level BPE tokenizer (the `tokenizers` library) is trained on the first 20 MB. Each setting prepares the whole
corpus into a fresh folder (`prepare_dataset`, the CLI's code path: the Parquet read batch by batch, the
validation split, the shard writes), and the shards of every setting are checked equal to the first's. Reported:
input MB/s and tokens/s, and the speed-up over one process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from farloco.node.training.data import open_dataset, prepare_dataset

FILE_BYTES = 64 << 20


def make_corpus(folder: Path, gigabytes: float, seed: int = 0) -> tuple[list[Path], int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(50_000)]
    target = int(gigabytes * (1 << 30))
    files, total, docs, size = [], 0, [], 0
    while total < target:
        words = rng.zipf(1.2, size=int(rng.integers(50, 2000))) % len(vocabulary)
        doc = " ".join(vocabulary[w] for w in words) + "."
        docs.append(doc)
        size += len(doc)
        total += len(doc)
        if size >= FILE_BYTES or total >= target:
            path = folder / f"part-{len(files):04d}.parquet"
            pq.write_table(pa.table({"content": docs}), path, row_group_size=1024)
            files.append(path)
            docs, size = [], 0
    return files, total


def train_tokenizer(sample: Path, out: Path, vocab_size: int) -> Path:
    import pyarrow.parquet as pq
    import tokenizers

    texts = pq.read_table(sample, columns=["content"]).column("content").to_pylist()
    budget, chosen = 20 << 20, []
    for text in texts:
        chosen.append(text)
        budget -= len(text)
        if budget <= 0:
            break
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(chosen, trainer)
    tokenizer.save(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gigabytes", type=float, default=1.0, help="text in the generated corpus")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--vocab-size", type=int, default=16_000)
    parser.add_argument("--keep", type=Path, default=None, help="generate the corpus here and keep it")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="farloco-prepare-") as tmp:
        corpus = args.keep or Path(tmp) / "corpus"
        corpus.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        files = sorted(corpus.glob("*.parquet"))
        text_bytes = 0
        if not files:
            files, text_bytes = make_corpus(corpus, args.gigabytes)
        on_disk = sum(f.stat().st_size for f in files)
        print(
            f"corpus: {len(files)} Parquet files, {text_bytes / 1e9:.2f} GB of text ({on_disk / 1e9:.2f} GB on "
            f"disk), made in {time.perf_counter() - started:.0f} s",
            file=sys.stderr,
        )
        tokenizer = train_tokenizer(files[0], Path(tmp) / "tokenizer.json", args.vocab_size)
        rows, first = [], None
        for workers in args.workers:
            out = Path(tmp) / f"prepared-{workers}"
            started = time.perf_counter()
            info = prepare_dataset(
                files,
                out,
                str(tokenizer),
                text_field="content",
                workers=workers,
                progress=sys.stderr.isatty(),
            )
            seconds = time.perf_counter() - started
            tokens = info.num_tokens("train") + info.num_tokens("val")
            shards = [s.sha256 for split in ("train", "val") for s in info.shards[split]]
            if first is None:
                first = shards
            elif shards != first:
                raise SystemExit(f"workers={workers}: the shards differ from workers={args.workers[0]}'s")
            open_dataset(out)  # the manifest and every shard check out
            rows.append((workers, seconds, tokens))
            print(f"workers {workers}: {seconds:.0f} s, {tokens / seconds:,.0f} tokens/s", file=sys.stderr)
            shutil.rmtree(out)
    size = text_bytes or on_disk
    print(
        f"Command: `python benchmarks/data_prepare.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
    )
    print(
        f"{size / 1e9:.2f} GB of generated text in {len(files)} Parquet files, byte-level BPE of "
        f"{args.vocab_size} tokens, {os.cpu_count()} cores:\n"
    )
    print("| workers | seconds | input MB/s | tokens/s | speed-up |")
    print("|---|---|---|---|---|")
    base = rows[0][1]
    for workers, seconds, tokens in rows:
        print(
            f"| {workers} | {seconds:.0f} | {size / 1e6 / seconds:.1f} | {tokens / seconds:,.0f} | "
            f"{base / seconds:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
