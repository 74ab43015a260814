"""Issue 14 point 1, their model: run.model as a Hugging Face config.json (a tiny Qwen2) or as an entry point
package.module:factory (tests/fixtures/custom_lm.py). Built identically from the run seed, hashed by
architecture, trained by real `farloco join` nodes of different layouts (FSDP over 2 ranks, tensor parallelism
over 2 ranks, 1 rank) with agreeing hashes, exported and loaded back; a joiner whose model differs is refused."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from farloco.node.config import MODEL_PRESET_NAMES, ConfigError, build_config, diff_run, run_hash, run_section
from farloco.node.handoff import flatten, layout_of, unflatten
from farloco.node.training.model import MODEL_PRESETS
from farloco.node.training.models import architecture, build_spec, meta_spec
from farloco.node.training.parallel import check_node_layout

FIXTURES = Path(__file__).parent / "fixtures"
QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def qwen2_config(path: Path, **changes: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**QWEN2, **changes}))
    return path


def theta_of(run_model: str, seed: int) -> torch.Tensor:
    module = build_spec(run_model, seed).module
    return flatten(module, layout_of(module))


@pytest.fixture
def custom_lm(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.syspath_prepend(str(FIXTURES))
    return "custom_lm:build"


def test_the_config_knows_the_presets_and_names_what_run_model_accepts() -> None:
    assert tuple(MODEL_PRESETS) == MODEL_PRESET_NAMES
    for bad in ("gpt5", "module:", "a b:c", ":factory"):
        with pytest.raises(ConfigError, match=r"run.model: expected a preset .* got"):
            build_config({"run": {"model": bad}})
    # A preset's run hash has no architecture key: every existing run keeps its hash.
    assert "model_architecture" not in run_section(build_config({}))


def test_an_hf_config_builds_from_the_seed_alone_and_its_architecture_is_hashed(tmp_path: Path) -> None:
    path = str(qwen2_config(tmp_path / "qwen2" / "config.json"))
    first, again, other_seed = theta_of(path, 7), theta_of(path, 7), theta_of(path, 8)
    assert torch.equal(first, again) and not torch.equal(first, other_seed)
    spec = meta_spec(path)
    assert spec.kind == "hf" and [type(u).__name__ for u in spec.units()] == ["Qwen2DecoderLayer"] * 2
    assert spec.tp_plan and "model.layers.*.self_attn.q_proj" in spec.tp_plan
    # The folder and the file are the same model; the digest follows the file's content, not its name.
    assert architecture(path) == architecture(str(tmp_path / "qwen2")) and architecture(path).startswith(
        "hf:qwen2:"
    )
    wider = str(qwen2_config(tmp_path / "wider.json", hidden_size=128))
    mine, theirs = build_config({"run": {"model": path}}), build_config({"run": {"model": wider}})
    assert run_hash(mine) != run_hash(theirs)
    assert any(
        line.startswith("run.model_architecture: 'hf:qwen2:")
        for line in diff_run(run_section(mine), run_section(theirs))
    )
    # Its heads split over 2 tp ranks, not over 3; a config that is not a causal LM is named.
    check_node_layout(
        build_config({"run": {"model": path, "seq_len": 64}, "node": {"num_ranks": 2, "tp": 2}})
    )
    odd = build_config({"run": {"model": path, "seq_len": 63}, "node": {"num_ranks": 3, "tp": 3}})
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not a multiple of it"):
        check_node_layout(odd)
    with pytest.raises(ConfigError, match=r"expected a Hugging Face config\.json at .*missing\.json"):
        run_hash(build_config({"run": {"model": str(tmp_path / "missing.json")}}))


def test_an_entry_point_builds_from_the_seed_with_its_units_plan_and_loss(custom_lm: str) -> None:
    first, again = theta_of(custom_lm, 3), theta_of(custom_lm, 3)
    assert torch.equal(first, again)
    spec = build_spec(custom_lm, 3)
    assert spec.kind == "entry" and [type(u).__name__ for u in spec.units()] == ["Block", "Block"]
    biases = [p for n, p in spec.module.named_parameters() if n.endswith("bias")]
    assert biases and all(not p.any() for p in biases)  # seeded init: biases 0, matrices from the seed
    tokens = torch.randint(0, 256, (2, 16))
    loss = spec.compute_loss(tokens, tokens)
    assert loss.dim() == 0 and 4.0 < float(loss.detach()) < 7.0  # about ln(256) = 5.5 at init
    muon = sorted(n for n, p in spec.module.named_parameters() if spec.is_muon_matrix(n, p))
    assert muon == [f"blocks.{i}.{fc}.weight" for i in range(2) for fc in ("fc1", "fc2")]
    assert architecture(custom_lm).startswith("entry:TinyLM:")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        run_hash(build_config({"run": {"model": "no_such_module:build"}}))


# -- real nodes ---------------------------------------------------------------------------------------------


def _swarm(tmp_path: Path, model: str, rounds: int = 3):  # type: ignore[no-untyped-def]
    from test_swarm import Swarm

    return Swarm(
        tmp_path, [f"run.max_rounds={rounds}", "run.inner_steps=4", f"run.model={json.dumps(model)}"]
    )


def _agree(peers: list, rounds: int) -> dict:  # type: ignore[type-arg]
    from test_swarm import rounds_of

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
    from test_swarm import wait_for

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
    tmp_path: Path, custom_lm: str
) -> None:
    from test_swarm import together_after, wait_for

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
