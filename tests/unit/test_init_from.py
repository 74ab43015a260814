"""run.init_from: a run starts from a model folder's weights exactly (Hugging Face single-file and sharded, a
farloco export of a preset), the run hash covers the weights' digest and not the path, and every broken folder
is a clear error naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.usermodel import save_pretrained
from safetensors.torch import save_file

from farloco.node.config import ConfigError, build_config, diff_run, run_hash, run_section
from farloco.node.handoff import flatten, layout_of
from farloco.node.tools.export import export_theta
from farloco.node.training.model import build_model, model_config
from farloco.node.training.models import ModelError, build_spec, check_init_from, meta_spec
from farloco.node.weights import WeightsError, weights_digest, weights_index

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FARLOCO_CACHE", str(tmp_path_factory.mktemp("cache")))


def _params(folder: Path) -> dict[str, torch.Tensor]:
    spec = build_spec(str(folder), 0, init_from=str(folder))
    return {name: p.detach() for name, p in spec.module.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_starts_exactly_from_the_folder(tmp_path: Path, kind: str, dtype: torch.dtype) -> None:
    saved = save_pretrained(tmp_path, kind, dtype=dtype)
    params = _params(tmp_path)
    assert params and all(p.dtype == torch.float32 for p in params.values())
    for name, value in params.items():
        assert torch.equal(value.to(dtype), saved[name]), name
        assert torch.equal(value, saved[name].to(torch.float32)), name  # the upcast is exact
    # The seeded init is something else entirely: the folder's weights are what was loaded.
    seeded = dict(build_spec(str(tmp_path), 0).module.named_parameters())
    assert not torch.equal(seeded["model.embed_tokens.weight"], params["model.embed_tokens.weight"])


def test_run_model_defaults_to_the_folder_and_the_hash_covers_the_weights_not_the_path(
    tmp_path: Path,
) -> None:
    save_pretrained(tmp_path / "a", "llama")
    config = build_config({"run": {"init_from": str(tmp_path / "a")}})
    assert config.run.model == str(tmp_path / "a")  # its config.json is the architecture
    section = run_section(config)
    assert section["init_from"] == weights_digest(tmp_path / "a") and section["init_from"].startswith(
        "sha256:"
    )
    assert section["model"] == "hf-config" and str(section["model_architecture"]).startswith("hf:llama:")

    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")  # another machine's path, the same weights
    assert run_hash(build_config({"run": {"init_from": str(tmp_path / "elsewhere")}})) == run_hash(config)

    save_pretrained(tmp_path / "b", "llama", seed=2)  # the same architecture, other weights
    other = build_config({"run": {"init_from": str(tmp_path / "b")}})
    assert run_hash(other) != run_hash(config)
    assert [line.split(":")[0] for line in diff_run(section, run_section(other))] == ["run.init_from"]

    # No init_from: the key is absent, and a preset run's hash does not depend on this feature existing.
    assert "init_from" not in run_section(build_config({}))


def test_the_digest_is_of_the_tensors_not_the_files(tmp_path: Path) -> None:
    saved = save_pretrained(tmp_path / "one", "qwen2")
    save_pretrained(tmp_path / "sharded", "qwen2", shard="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 3
    assert weights_digest(tmp_path / "sharded") == weights_digest(tmp_path / "one")
    # Other metadata, the same tensors: the same digest; one value changed: another.
    save_file({n: v.contiguous() for n, v in saved.items()}, str(tmp_path / "meta.safetensors"), {"x": "y"})
    (tmp_path / "meta").mkdir()
    shutil.move(tmp_path / "meta.safetensors", tmp_path / "meta" / "model.safetensors")
    assert weights_digest(tmp_path / "meta") == weights_digest(tmp_path / "one")
    changed = dict(saved)
    changed["lm_head.weight"] = changed["lm_head.weight"].clone()
    changed["lm_head.weight"][0, 0] += 1e-3
    (tmp_path / "changed").mkdir()
    save_file(
        {n: v.contiguous() for n, v in changed.items()}, str(tmp_path / "changed" / "model.safetensors")
    )
    assert weights_digest(tmp_path / "changed") != weights_digest(tmp_path / "one")
    # The digest is kept across processes, keyed by the files' paths, sizes and mtimes.
    from farloco.node import weights

    weights._digest_cached.cache_clear()
    kept = json.loads(weights._cache_file().read_text())
    assert weights_digest(tmp_path / "one") in kept.values() and len(kept) == 4
    # Sharded weights load tensor for tensor like one file.
    one, sharded = _params(tmp_path / "one"), _params(tmp_path / "sharded")
    assert all(torch.equal(one[n], sharded[n]) for n in one)


def test_a_preset_starts_from_a_farloco_export_of_that_preset(tmp_path: Path) -> None:
    model = build_model(model_config("tiny"), seed=7)
    export_theta(model_config("tiny"), flatten(model, layout_of(model)), tmp_path / "export")
    spec = build_spec("tiny", 0, init_from=str(tmp_path / "export"))
    assert torch.equal(flatten(spec.module, layout_of(spec.module)), flatten(model, layout_of(model)))
    config = build_config({"run": {"model": "tiny", "init_from": str(tmp_path / "export")}})
    assert config.run.model == "tiny"  # set explicitly: the preset stays, the export's names are mapped
    with pytest.raises(
        ModelError, match=r"not this preset's architecture: .*hidden_size 128 \(the preset: 384\)"
    ):
        build_spec("small", 0, init_from=str(tmp_path / "export"))
    # `farloco config check` finds the same from the headers alone, on a meta-device model: no weight is read.
    with pytest.raises(ModelError, match=r"export/config.json is not this preset's architecture"):
        check_init_from(meta_spec("small"), str(tmp_path / "export"))
    index, names = check_init_from(meta_spec("tiny"), str(tmp_path / "export"))
    assert set(names.values()) <= set(index)


def _expect(error: type[Exception], pattern: str, folder: Path, model: str | None = None) -> None:
    with pytest.raises(error, match=pattern):
        build_spec(model or str(folder), 0, init_from=str(folder))


def test_broken_folders_are_clear_errors_that_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nothing"
    with pytest.raises(
        WeightsError, match=r"expected a local model folder at .*nothing.*download the model first"
    ):
        run_section(build_config({"run": {"init_from": str(missing), "model": "tiny"}}))

    sharded = tmp_path / "sharded"
    save_pretrained(sharded, "qwen2", shard="40KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[2]
    shard.unlink()
    _expect(
        WeightsError, rf"names 12 shards, 1 missing from .*: {shard.name} \(a partial download\?\)", sharded
    )

    partial = tmp_path / "partial"
    save_pretrained(partial, "llama")
    data = (partial / "model.safetensors").read_bytes()
    (partial / "model.safetensors").write_bytes(data[: len(data) - 1000])
    _expect(
        WeightsError,
        rf"model.safetensors: expected at least {len(data)} bytes .* found {len(data) - 1000}",
        partial,
    )

    garbage = tmp_path / "garbage"
    save_pretrained(garbage, "llama")
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    _expect(WeightsError, "model.safetensors: the safetensors header is not JSON", garbage)

    pickled = tmp_path / "pickled"
    save_pretrained(pickled, "llama")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    _expect(WeightsError, "expected model.safetensors or .*pytorch_model.bin is never read", pickled)

    # Another architecture's weights: the shapes, named.
    llama = tmp_path / "llama"
    save_pretrained(llama, "llama")
    config = json.loads((llama / "config.json").read_text())
    wider = tmp_path / "wider.json"
    wider.write_text(json.dumps({**config, "intermediate_size": 192}))
    _expect(
        ModelError,
        r"of another shape: model.layers.0.mlp.gate_proj.weight \[128, 64\] \(expected \[192, 64\]\)",
        llama,
        str(wider),
    )
    qwen = tmp_path / "qwen.json"
    qwen.write_text(json.dumps({**config, "model_type": "qwen2"}))
    _expect(ModelError, "holds a 'llama' model, run.model is a 'qwen2' one", llama, str(qwen))

    # A tensor missing from the file, a foreign one in it, a NaN in it.
    state = save_pretrained(tmp_path / "full", "qwen2")
    for case, change in {
        "lost": lambda s: s.pop("model.norm.weight"),
        "foreign": lambda s: s.update({"model.vision_tower.weight": torch.zeros(2)}),
        "nan": lambda s: s["model.norm.weight"].__setitem__(0, float("nan")),
    }.items():
        tensors = {n: v.clone().contiguous() for n, v in state.items()}
        change(tensors)
        (tmp_path / case).mkdir()
        shutil.copy(tmp_path / "full" / "config.json", tmp_path / case / "config.json")
        save_file(tensors, str(tmp_path / case / "model.safetensors"))
    _expect(ModelError, "1 missing: model.norm.weight", tmp_path / "lost")
    _expect(ModelError, "1 the model does not have: model.vision_tower.weight", tmp_path / "foreign")
    _expect(ModelError, "model.norm.weight holds NaN or Inf", tmp_path / "nan")
    assert issubclass(WeightsError, ConfigError) and issubclass(
        ModelError, ConfigError
    )  # `join` reports both


def test_the_index_checks_what_it_places(tmp_path: Path) -> None:
    save_pretrained(tmp_path, "qwen2", shard="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = sorted(set(index["weight_map"].values()))[-1]  # a shard that lacks it
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=rf"places 1 tensors in shards that do not hold them: {first}"):
        weights_index(tmp_path)
