"""Their model trained by real `farloco join` nodes of different layouts (FSDP over 2 ranks, tensor parallelism
over 2 ranks, 1 rank) with agreeing hashes, exported and loaded back; a joiner whose model differs is refused.
run.model is a Hugging Face config.json (a tiny Qwen2) or the entry point of tests/fixtures/custom_lm.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FIXTURES
from helpers.swarm import Swarm, rounds_of, together_after, wait_for
from helpers.usermodel import custom_lm, qwen2_config  # noqa: F401  (custom_lm: a fixture)

from farloco.node.handoff import layout_of, unflatten
from farloco.node.training.models import build_spec


def _swarm(tmp_path: Path, model: str, rounds: int = 3):  # type: ignore[no-untyped-def]
    return Swarm(
        tmp_path, [f"run.max_rounds={rounds}", "run.inner_steps=4", f"run.model={json.dumps(model)}"]
    )


def _agree(peers: list, rounds: int) -> dict:  # type: ignore[type-arg]
    by_peer = {p.name: {e["round_id"]: e for e in rounds_of(p)} for p in peers}
    for round_id in range(1, rounds + 1):
        hashes = {name: done[round_id]["outer_hash"] for name, done in by_peer.items() if round_id in done}
        assert len(hashes) == len(peers) and len(set(hashes.values())) == 1, f"round {round_id}: {hashes}"
    assert any(len(e["contributors"]) == len(peers) for e in next(iter(by_peer.values())).values()), by_peer
    return by_peer


@pytest.mark.multiprocess
@pytest.mark.dht
@pytest.mark.timeout(600)
def test_nodes_train_an_hf_config_together_and_the_export_loads_in_transformers(tmp_path: Path) -> None:
    path = str(qwen2_config(tmp_path / "qwen2.json"))
    swarm = _swarm(tmp_path, path)
    every = ("--set", "checkpoint.every_rounds=1")
    try:
        peers = [swarm.add("fsdp2", ranks=2, extra=every), swarm.add("one", ranks=1, extra=every)]
        wait_for(lambda: all(p.process.poll() == 0 for p in peers), 500, "2 nodes to train 3 rounds", peers)
        by_peer = _agree(peers, 3)
    finally:
        swarm.close()
    losses = [by_peer["one"][r]["eval_loss"] for r in (1, 3)]
    assert losses[1] < losses[0], losses

    out = tmp_path / "hf"
    export = subprocess.run(
        [sys.executable, "-m", "farloco.node.tools.cli", "export", "--run-dir", str(peers[1].run_dir), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    # The exported weights are the checkpoint's theta: the same logits as our own build with theta loaded.
    from farloco.node.checkpoint import checkpoints_dir, latest_checkpoint, load_checkpoint

    _, tensors = load_checkpoint(latest_checkpoint(checkpoints_dir(peers[1].run_dir)))  # type: ignore[arg-type]
    ours = build_spec(path, 0).module
    with torch.no_grad():
        for name, value in unflatten(tensors["theta"], layout_of(ours)).items():
            dict(ours.named_parameters())[name].copy_(value)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, ours(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
@pytest.mark.dht
@pytest.mark.timeout(600)
def test_nodes_train_an_entry_point_model_with_tp_and_a_different_architecture_is_refused(
    tmp_path: Path,
    custom_lm: str,  # noqa: F811  (the fixture imported above)
) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
    swarm = _swarm(tmp_path, custom_lm, rounds=0)  # until stopped: they are still there when `wider` comes
    try:
        peers = [
            swarm.add("tp2", ranks=2, extra=("--set", "node.tp=2"), env=env),
            swarm.add("one", ranks=1, env=env),
        ]
        wait_for(lambda: len(together_after(peers, 0)) >= 3, 300, "2 nodes to train 3 rounds together", peers)
        wider = swarm.add("wider", env={**env, "FARLOCO_TEST_WIDTH": "96"})
        assert wider.process.wait(timeout=120) != 0
        said = wider.log_path.read_text()
        assert "refusing to join" in said and "run.model_architecture: 'entry:TinyLM:" in said, said[-3000:]
        assert "run.model:" not in said  # the same entry point: only the architecture differs
        assert all(p.process.poll() is None for p in peers), "the swarm must keep training"
        by_peer = _agree(peers, 3)
    finally:
        swarm.close()
    losses = [by_peer["tp2"][r].get("train_loss") for r in sorted(by_peer["tp2"])]
    assert all(loss is not None and math.isfinite(loss) for loss in losses), losses
