"""A swarm of real `farloco join` nodes started from a model saved by `transformers` (run.init_from): a small
Llama (one file, tied embeddings) and a small Qwen2 (sharded, its own head). With the inner rate at 0 (the
outer step, whose rate must be > 0, then applies exact zeros through the int8 codec) the export after several
rounds holds the folder's tensors bit for bit: theta at round 0 is exactly the weights, and nothing on the way
(hand-off, ranks, codec, outer step, checkpoint, export) changes a bit.
tests/integration/test_docs_paths.py trains pretrained weights with rates (on a cosine schedule)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.swarm import Swarm, rounds_of, wait_for_exit
from helpers.usermodel import save_pretrained
from safetensors.torch import load_file

pytest.importorskip("transformers")

EVERY = ("--set", "checkpoint.every_rounds=1")


def _train(tmp_path: Path, folder: Path, rounds: int, *overrides: str) -> list:  # type: ignore[type-arg]
    swarm = Swarm(
        tmp_path,
        [
            f"run.max_rounds={rounds}",
            "run.inner_steps=4",
            f"run.model={json.dumps(str(folder))}",
            f"run.init_from={json.dumps(str(folder))}",
            *overrides,
        ],
    )
    try:
        peers = [swarm.add("a", extra=EVERY), swarm.add("b", extra=EVERY)]
        wait_for_exit(peers, 500, f"2 nodes to train {rounds} rounds")
    finally:
        swarm.close()
    by_peer = {p.name: {e["round_id"]: e for e in rounds_of(p)} for p in peers}
    for round_id in range(1, rounds + 1):
        hashes = {name: done[round_id]["outer_hash"] for name, done in by_peer.items() if round_id in done}
        assert len(set(hashes.values())) == 1 and len(hashes) == 2, f"round {round_id}: {hashes}"
    return peers


def _export(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    done = subprocess.run(
        [sys.executable, "-m", "farloco.node.tools.cli", "export", "--run-dir", str(run_dir), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return load_file(str(out / "model.safetensors"))


@pytest.mark.multiprocess
@pytest.mark.dht
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,shard", [("llama", None), ("qwen2", "40KB")])
def test_at_learning_rate_0_the_export_is_the_folder_bit_for_bit(
    tmp_path: Path, kind: str, shard: str | None
) -> None:
    folder = tmp_path / "pretrained"
    saved = save_pretrained(folder, kind, shard=shard)
    peers = _train(tmp_path, folder, 3, "run.inner_lr=0", 'run.codec="int8"')
    exported = _export(peers[1].run_dir, tmp_path / "export")
    # transformers saves tied embeddings once (no lm_head.weight for the Llama), and so does the export.
    assert sorted(exported) == sorted(saved) or sorted(exported) == sorted(set(saved) - {"lm_head.weight"})
    for name, value in exported.items():
        assert value.dtype == saved[name].dtype and torch.equal(
            value.view(torch.int32), saved[name].view(torch.int32)
        ), name
