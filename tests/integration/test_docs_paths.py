"""The command paths of the docs, run as written: docs/data.md's "From a Parquet corpus to a trained model, from
pretrained weights, on a cosine schedule" block, line by line through bash, on a small Llama saved by
`transformers` (with its tokenizer), a Parquet file and 127.0.0.1.

What is changed on the way is said here and nothing else: `pip install` is skipped (the test environment has the
extras), `0.0.0.0` becomes 127.0.0.1 (tests never listen beyond loopback) and port 31337 a free port, the
`/ip4/…/p2p/…` placeholder becomes the bootstrap's printed multiaddr, `max_rounds=100` becomes 3, and the join
line runs twice (runs/a and runs/b: "each node")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers.net import free_port
from helpers.usermodel import save_pretrained
from safetensors.torch import load_file

from farloco.node.tools.demo import read_events, stop_process

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")


def _block(doc: Path, heading: str) -> list[str]:
    text = doc.read_text()
    section = text[text.index(heading) :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, f"{doc}: no sh block under {heading!r}"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _tokenizer(path: Path, texts: list[str]) -> None:
    import tokenizers

    made = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    made.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(vocab_size=256, special_tokens=["<unk>", "</s>"])
    made.train_from_iterator(texts, trainer)
    assert made.get_vocab_size() <= 256  # the model's vocab_size
    made.save(str(path))


@pytest.mark.multiprocess
@pytest.mark.dht
@pytest.mark.timeout(600)
def test_data_md_parquet_to_a_trained_model_from_pretrained_weights(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = _block(ROOT / "docs" / "data.md", "## From a Parquet corpus to a trained model, from pretrained")
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "swarm",
        "round",
        "outer",
        "inner",
        "model",
        "node",
        "peer",
        "hash",
    ]
    generator = torch.Generator().manual_seed(0)
    texts = [
        " ".join(words[i] for i in torch.randint(0, len(words), (60,), generator=generator).tolist())
        for _ in range(2000)  # the val split needs 4 eval batches of 8 x 129 tokens
    ]
    (tmp_path / "corpus").mkdir()
    pq.write_table(pa.table({"text": texts}), tmp_path / "corpus" / "part-0.parquet")
    saved = save_pretrained(tmp_path / "pretrained", "llama")
    _tokenizer(tmp_path / "pretrained" / "tokenizer.json", texts)

    bin_dir = str(Path(sys.executable).parent)  # the environment's `farloco` and `python`
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "FARLOCO_CACHE": str(tmp_path / "cache"),
    }
    port = free_port()

    def command(line: str) -> str:
        line = line.split("   #")[0].split("  # ")[0].strip()  # the trailing comments
        line = (
            line.replace("0.0.0.0", "127.0.0.1")
            .replace("31337", str(port))
            .replace("max_rounds=100", "max_rounds=3")
        )
        return line

    def run(line: str) -> None:
        done = subprocess.run(
            ["bash", "-c", command(line)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"

    processes: list[subprocess.Popen[bytes]] = []
    try:
        for line in lines:
            if line.startswith("pip install"):
                continue
            if line.startswith("farloco bootstrap"):
                out = open(tmp_path / "bootstrap.out", "wb")  # noqa: SIM115 - closed with the process
                processes.append(
                    subprocess.Popen(
                        ["bash", "-c", "exec " + command(line)],
                        cwd=tmp_path,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
                deadline = time.monotonic() + 60
                while not (
                    maddr := re.search(r"^(/ip4/\S+)$", (tmp_path / "bootstrap.out").read_text(), re.M)
                ):
                    assert processes[-1].poll() is None and time.monotonic() < deadline, (
                        tmp_path / "bootstrap.out"
                    ).read_text()
                    time.sleep(0.2)
                continue
            if line.startswith("farloco join"):
                joins = []
                for name in ("a", "b"):
                    joined = command(line).replace("runs/a", f"runs/{name}")
                    joined = re.sub(r"/ip4/…/tcp/\d+/p2p/…", maddr.group(1), joined)
                    log = open(tmp_path / f"join-{name}.log", "wb")  # noqa: SIM115 - closed with the process
                    joins.append(
                        subprocess.Popen(
                            ["bash", "-c", "exec " + joined],
                            cwd=tmp_path,
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
                processes.extend(joins)
                for name, process in zip(("a", "b"), joins, strict=True):
                    assert process.wait(timeout=400) == 0, (tmp_path / f"join-{name}.log").read_text()[-3000:]
                continue
            run(line)
    finally:
        stop_process(*processes)

    # Both nodes trained the pretrained weights together, on a decaying rate, to the same bits.
    rounds = {
        name: [e for e in read_events(tmp_path / "runs" / name) if e["event"] == "round"] for name in "ab"
    }
    assert [e["round_id"] for e in rounds["a"]] == [1, 2, 3], rounds["a"]
    assert [e["outer_hash"] for e in rounds["a"]] == [e["outer_hash"] for e in rounds["b"]]
    rates = [e["inner_lr"] for e in rounds["a"]]
    assert rates[2] < rates[1], rates
    config = (tmp_path / "node.toml").read_text()
    assert 'init_from = "pretrained/"' in config and 'lr_schedule = "cosine"' in config
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(set(saved) - {"lm_head.weight"})  # tied, as transformers saved it
    assert all(not torch.equal(exported[name], saved[name]) for name in exported), "every tensor trained"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
