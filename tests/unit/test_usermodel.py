"""Their model: run.model as a Hugging Face config.json (a tiny Qwen2) or as an entry point package.module:factory
(tests/fixtures/custom_lm.py), built identically from the run seed and hashed by architecture.
tests/integration/test_usermodel_swarm.py trains both with real nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.usermodel import custom_lm, qwen2_config, theta_of  # noqa: F401  (custom_lm: a fixture)

from farloco.node.config import MODEL_PRESET_NAMES, ConfigError, build_config, diff_run, run_hash, run_section
from farloco.node.training.model import MODEL_PRESETS
from farloco.node.training.models import architecture, build_spec, meta_spec
from farloco.node.training.parallel import check_node_layout


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


def test_an_entry_point_builds_from_the_seed_with_its_units_plan_and_loss(custom_lm: str) -> None:  # noqa: F811
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
