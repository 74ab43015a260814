"""`farloco export` (HF Llama folder from a run's checkpoint) and `farloco report` (PNG plots of a run's log)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from farloco.node.checkpoint import checkpoints_dir, save_checkpoint
from farloco.node.config import load_config, run_hash, to_toml
from farloco.node.handoff import flatten, layout_of, unflatten
from farloco.node.tools.export import ExportError, export_run, export_theta
from farloco.node.tools.report import ReportError, make_report, read_run_log
from farloco.node.training.model import (
    ModelConfig,
    Transformer,
    build_model,
    hf_state_dict_names,
    model_config,
)

# ---- export -----------------------------------------------------------------------------------------------------


def _trained_theta(config: ModelConfig, seed: int = 0) -> torch.Tensor:
    """theta of a real model, moved away from its init so that every parameter (norms too) is distinctive."""
    model = build_model(config, seed=seed)
    theta = flatten(model, layout_of(model))
    return theta + 0.01 * torch.randn(theta.shape, generator=torch.Generator().manual_seed(1))


def _model_with(config: ModelConfig, theta: torch.Tensor) -> Transformer:
    model = Transformer(config)
    model.load_state_dict(unflatten(theta, layout_of(model)), strict=True)
    return model.eval()


def _make_run_dir(tmp_path: Path, theta: torch.Tensor | None = None) -> tuple[Path, torch.Tensor]:
    run_dir = tmp_path / "run"
    config = load_config(None, ['run.name="exp"', "run.model=tiny", "run.seed=3"])
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(config))
    theta = _trained_theta(model_config("tiny"), seed=3) if theta is None else theta
    root = checkpoints_dir(run_dir)
    meta = {"run_hash": run_hash(config), "inner_step": "100"}
    save_checkpoint(root, 4, {"theta": torch.zeros_like(theta)}, meta)  # older: must not be the one exported
    save_checkpoint(root, 5, {"theta": theta, "strategy.momentum": torch.ones_like(theta)}, meta)
    return run_dir, theta


def _expected_hf_shapes(config: ModelConfig) -> dict[str, list[int]]:
    """Written from the HF Llama layout (not from our mapping), so a wrong name or transposition shows up."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": [config.vocab_size, config.dim], "model.norm.weight": [config.dim]}
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": [config.dim],
            p + "post_attention_layernorm.weight": [config.dim],
            p + "self_attn.q_proj.weight": [q, config.dim],
            p + "self_attn.k_proj.weight": [kv, config.dim],
            p + "self_attn.v_proj.weight": [kv, config.dim],
            p + "self_attn.o_proj.weight": [config.dim, q],
            p + "mlp.gate_proj.weight": [config.ffn_dim, config.dim],
            p + "mlp.up_proj.weight": [config.ffn_dim, config.dim],
            p + "mlp.down_proj.weight": [config.dim, config.ffn_dim],
        }
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = [config.vocab_size, config.dim]
    return shapes


def _read_export(out_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, str]]:
    hf_config = json.loads((out_dir / "config.json").read_text())
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        metadata = dict(handle.metadata() or {})
    return hf_config, tensors, metadata


def _reference_llama_logits(
    hf: dict[str, Any], sd: dict[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    """A from-scratch Llama forward that knows only HF names and config.json (as LlamaForCausalLM does)."""
    heads, kv_heads, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    batch, seq_len = tokens.shape

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf["rms_norm_eps"]) * weight

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    inv_freq = 1.0 / hf["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos().float(), torch.cat([freqs, freqs], -1).sin().float()
    causal = torch.full((seq_len, seq_len), float("-inf")).triu(1)

    h = sd["model.embed_tokens.weight"][tokens]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(batch, seq_len, heads, head_dim).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # HF repeat_kv
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(head_dim) + causal, dim=-1)
        attended = (weights @ v).transpose(1, 2).reshape(batch, seq_len, heads * head_dim)
        h = h + attended @ sd[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, sd[p + "post_attention_layernorm.weight"])
        gate, up = x @ sd[p + "mlp.gate_proj.weight"].T, x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, sd["model.norm.weight"])
    head = sd["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else sd["lm_head.weight"]
    return h @ head.T


def _tokens(config: ModelConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))


def test_export_run_writes_a_llama_folder_with_the_same_logits(tmp_path: Path) -> None:
    run_dir, theta = _make_run_dir(tmp_path)
    out = export_run(run_dir, tmp_path / "hf", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    hf_config, tensors, metadata = _read_export(out)
    config = model_config("tiny")

    assert {name: list(t.shape) for name, t in tensors.items()} == _expected_hf_shapes(config)
    assert "lm_head.weight" not in tensors and hf_config["tie_word_embeddings"] is True
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert metadata["format"] == "pt"
    assert metadata["farloco.round_id"] == "5" and metadata["farloco.run_name"] == "exp"
    assert hf_config["model_type"] == "llama" and hf_config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["max_length"] == config.max_seq_len

    # Our Transformer rebuilt from the exported tensors gives the logits of the checkpointed theta, bit for bit.
    ours_to_hf = hf_state_dict_names(Transformer(config))
    rebuilt = Transformer(config)
    rebuilt.load_state_dict({ours: tensors[hf] for ours, hf in ours_to_hf.items()}, strict=True)
    tokens = _tokens(config)
    with torch.no_grad():
        expected = _model_with(config, theta)(tokens)
        assert torch.equal(rebuilt.eval()(tokens), expected)
        # And a Llama forward that knows nothing of our names agrees (catches swapped gate/up, wrong q/k...).
        torch.testing.assert_close(
            _reference_llama_logits(hf_config, tensors, tokens), expected, atol=2e-4, rtol=0
        )


def test_export_untied_writes_lm_head(tmp_path: Path) -> None:
    config = model_config("tiny", tie_embeddings=False, n_layers=2)
    theta = _trained_theta(config)
    export_theta(config, theta, tmp_path)
    hf_config, tensors, _ = _read_export(tmp_path)
    assert hf_config["tie_word_embeddings"] is False
    assert {name: list(t.shape) for name, t in tensors.items()} == _expected_hf_shapes(config)
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    tokens = _tokens(config)
    with torch.no_grad():
        expected = _model_with(config, theta)(tokens)
        torch.testing.assert_close(
            _reference_llama_logits(hf_config, tensors, tokens), expected, atol=2e-4, rtol=0
        )
    # Exactly the model folder: no temporary file of the atomic writes is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_export_loads_in_transformers(tmp_path: Path) -> None:
    """transformers is in the test extra: CI runs this, it does not skip."""
    import transformers

    run_dir, theta = _make_run_dir(tmp_path)
    out = export_run(run_dir, tmp_path / "hf", progress=False)
    model = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    config = model_config("tiny")
    tokens = _tokens(config)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens).logits, _model_with(config, theta)(tokens), atol=2e-4, rtol=0
        )


def test_export_ships_the_tokenizer_the_shards_were_made_with(tmp_path: Path) -> None:
    """`farloco data prepare --tokenizer tokenizer.json` keeps a copy beside the shards; the export writes it with
    a tokenizer_config.json, and transformers' AutoTokenizer loads the folder and encodes as the run did."""
    import tokenizers
    import transformers

    from farloco.node.training.data import prepare_dataset
    from farloco.node.training.tokenizer import HFTokenizer

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "farloco": 4}
    made = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    made.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    made.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hello world"}\n{"text": "farloco world hello"}\n')
    dataset = tmp_path / "ds"
    info = prepare_dataset(
        [corpus], dataset, str(tmp_path / "tokenizer.json"), val_fraction=0, progress=False
    )
    assert (dataset / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()

    run_dir, _ = _make_run_dir(tmp_path)
    config = load_config(None, ['run.name="exp"', "run.model=tiny", "run.seed=3", f'run.dataset="{dataset}"'])
    (run_dir / "config.toml").write_text(to_toml(config))
    meta = {"run_hash": run_hash(config), "inner_step": "100"}
    save_checkpoint(
        checkpoints_dir(run_dir), 6, {"theta": _trained_theta(model_config("tiny"), seed=3)}, meta
    )
    out = export_run(run_dir, tmp_path / "hf", progress=False)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = HFTokenizer(tmp_path / "tokenizer.json")
    assert ours.name == info.tokenizer
    assert loaded("farloco hello world", add_special_tokens=False)["input_ids"] == ours.encode(
        "farloco hello world"
    )
    assert loaded.eos_token == "</s>" and loaded.eos_token_id == ours.eos_id == 1

    # A tokenizer.json swapped after the shards were made is refused, naming both hashes.
    made.add_tokens(["extra"])
    made.save(str(dataset / "tokenizer.json"))
    with pytest.raises(
        ExportError, match=r"expected the tokenizer hf:sha256=\w+ the shards were made with, found"
    ):
        export_run(run_dir, tmp_path / "hf2", progress=False)


def test_export_errors_name_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"expected a run directory with config\.toml"):
        export_run(tmp_path, tmp_path / "out", progress=False)
    config = load_config(None)
    (tmp_path / "config.toml").write_text(to_toml(config))
    with pytest.raises(ExportError, match="no loadable checkpoint"):
        export_run(tmp_path, tmp_path / "out", progress=False)
    theta = torch.zeros(10)
    save_checkpoint(checkpoints_dir(tmp_path), 1, {"theta": theta}, {"run_hash": "f" * 64, "inner_step": "0"})
    with pytest.raises(
        ExportError, match=f"expected a checkpoint of run_hash {run_hash(config)}.*found run_hash f+"
    ):
        export_run(tmp_path, tmp_path / "out", progress=False)
    with pytest.raises(ExportError, match=r"expected theta float32\[\d+\] .* got torch.float32\[10\]"):
        export_theta(model_config("tiny"), theta, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- report -----------------------------------------------------------------------------------------------------
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_log(run_dir: Path, peer_id: str, num_rounds: int, *, torn_tail: bool = False) -> None:
    """An event log shaped like the agent's: started, rounds (one aborted), a torn last line if asked."""
    events: list[dict[str, Any]] = [{"time": 0.0, "event": "started", "peer_id": peer_id, "num_params": 1000}]
    for r in range(1, num_rounds + 1):
        if r == 4:
            # The attempt that started from round 3 aborts; the retry commits as round 4.
            events.append({"time": r, "event": "aborted", "round_id": r - 1, "reason": "x", "num_peers": 1})
        contributors = ["a", "b", "c"][: 1 + r % 3]
        events.append(
            {
                "time": float(r),
                "event": "round",
                "round_id": r,
                "group_id": "g",
                "group": contributors,
                "contributors": contributors,
                "train_loss": 5.5 - 0.3 * r,
                "eval_loss": math.nan if r == 1 else 5.6 - 0.3 * r,
                "outer_hash": "h",
                "bytes_sent": 0 if len(contributors) == 1 else 4_000 * len(contributors),
                "bytes_received": 4_000,
                "ddp_bytes": 0 if len(contributors) == 1 else 600_000,
                "seconds": 1.5 + 0.1 * r,
            }
        )
    (run_dir / "logs").mkdir(parents=True)
    text = "".join(json.dumps(e) + "\n" for e in events)
    if torn_tail:
        text += '{"time": 9.0, "event": "rou'
    (run_dir / "logs" / "agent.jsonl").write_text(text)


def test_report_draws_every_plot_for_overlaid_runs(tmp_path: Path) -> None:
    for name, peer in (("a", "12D3KooWAAAAAA"), ("b", "12D3KooWBBBBBB")):
        _write_log(tmp_path / name, peer, 8, torn_tail=name == "b")
    paths = make_report([tmp_path / "a", tmp_path / "b"], tmp_path / "report")
    assert [p.name for p in paths] == ["loss.png", "bytes.png", "round_time.png", "peers.png"]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE, path
        assert len(data) > 20_000, f"{path} is only {len(data)} bytes: an empty plot?"
        width, height = struct.unpack(">II", data[16:24])  # IHDR
        assert (width, height) == (960, 540)


def test_read_run_log_fields(tmp_path: Path) -> None:
    _write_log(tmp_path, "12D3KooWXYZ123", 5)
    log = read_run_log(tmp_path)
    assert log.label.endswith("(XYZ123)")
    assert log.round_ids == [1, 2, 3, 4, 5]
    assert math.isnan(log.eval_loss[0]) and log.eval_loss[1] == pytest.approx(5.0)
    assert log.num_contributors == [2, 3, 1, 2, 3]
    assert log.aborted == [(4, 1)]  # plotted where the aborted attempt's commit would have been


def test_report_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"expected an event log at .*agent\.jsonl, found none"):
        make_report([tmp_path / "nowhere"], tmp_path / "out")
    with pytest.raises(ReportError, match="at least one run directory"):
        make_report([], tmp_path / "out")
    log = tmp_path / "logs" / "agent.jsonl"
    log.parent.mkdir()
    log.write_text("")
    with pytest.raises(ReportError, match="no 'round' events yet"):
        make_report([tmp_path], tmp_path / "out")
    log.write_text('{"event": "round", "round_id": 1}\n')
    with pytest.raises(ReportError, match=r"agent\.jsonl:1: 'round' event is missing \['train_loss'"):
        make_report([tmp_path], tmp_path / "out")
    log.write_text("not json\n{}\n")
    with pytest.raises(ReportError, match=r"agent\.jsonl:1: expected a JSON object per line"):
        make_report([tmp_path], tmp_path / "out")
    assert not (tmp_path / "out").exists()
