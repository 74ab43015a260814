"""Tests for farloco.node.training.model: shapes, causality, deterministic init, presets, training, HF names, FSDP2."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from farloco.node.training.model import (
    MODEL_PRESETS,
    ModelConfig,
    Transformer,
    build_model,
    export_hf_config,
    hf_state_dict_names,
    lm_loss,
    model_config,
    num_parameters,
)

# A model small enough that every test here runs in well under a second.
MICRO = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
# sha256 over (name, float32 bytes) of build_model(MICRO, seed=0)'s parameters.
GOLDEN_MICRO_SHA256 = "1c570dbb9be8608e31316a851d94c59d62ece5a68913ca3ae78fc705db072c8b"


def test_forward_shape_and_dtype() -> None:
    model = build_model(MICRO, seed=0)
    tokens = torch.randint(0, MICRO.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, MICRO.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_bf16_parameters_give_float32_logits() -> None:
    # FSDP2 mixed precision runs blocks with bf16 parameters; the fp32 rotary tables must not upcast q/k.
    model = build_model(MICRO, seed=0)
    tokens = torch.randint(0, MICRO.vocab_size, (2, 9))
    reference = model(tokens)
    for param in model.parameters():  # parameters only: like FSDP2's param_dtype, buffers stay float32
        param.data = param.data.to(torch.bfloat16)
    assert model.rope_cos.dtype == torch.float32
    logits = model(tokens)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, reference, atol=0.05)


def test_forward_refuses_bad_input() -> None:
    model = build_model(MICRO, seed=0)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"integer tokens of shape \[batch, seq_len\]"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"shape=\[4\]"):
        model(torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("tie", [True, False])
def test_causality(tie: bool) -> None:
    model = build_model(dataclasses.replace(MICRO, tie_embeddings=tie), seed=1)
    tokens = torch.randint(0, MICRO.vocab_size, (2, 20))
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % MICRO.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :12], after[:, :12])
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_init_is_deterministic_per_seed() -> None:
    first, second, other = build_model(MICRO, 7), build_model(MICRO, 7), build_model(MICRO, 8)
    for (name, a), (_, b), (_, c) in zip(
        first.named_parameters(), second.named_parameters(), other.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(a, c), name


def test_init_golden_values() -> None:
    # Golden numbers: a change here means nodes built with another farloco version, torch version or CPU
    # would start round 0 from a different theta. Sampling in float64 keeps them CPU-independent.
    model = build_model(MICRO, seed=0)
    assert model.tok_embeddings.weight[0, :3].tolist() == [
        -0.015176482498645782,
        -0.03746868297457695,
        0.008212595246732235,
    ]
    assert model.layers[1].feed_forward.w2.weight[0, :2].tolist() == [
        0.018431218340992928,
        0.009579401463270187,
    ]
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().numpy().tobytes())
    assert digest.hexdigest() == GOLDEN_MICRO_SHA256


def test_init_does_not_depend_on_cpu_kernels() -> None:
    # torch picks vectorised CPU kernels at run time (AVX2/AVX512 or none); ATEN_CPU_CAPABILITY=default
    # forces the portable ones, standing in for a machine without AVX. The parameters must not change.
    script = (
        "import hashlib, torch\n"
        "from farloco.node.training.model import ModelConfig, build_model\n"
        f"model = build_model(ModelConfig(**{dataclasses.asdict(MICRO)!r}), seed=0)\n"
        "digest = hashlib.sha256()\n"
        "for name, param in model.named_parameters():\n"
        "    digest.update(name.encode()); digest.update(param.detach().numpy().tobytes())\n"
        "print(torch.backends.cpu.get_cpu_capability(), digest.hexdigest())\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["DEFAULT", GOLDEN_MICRO_SHA256]


def test_init_statistics() -> None:
    config = model_config("tiny")
    model = build_model(config, seed=0)
    residual_std = 0.02 / (2 * config.n_layers) ** 0.5
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            assert param.std().item() == pytest.approx(residual_std, rel=0.05), name
        else:
            assert param.std().item() == pytest.approx(0.02, rel=0.05), name


def test_preset_parameter_counts() -> None:
    # Shapes only (no init) keeps this fast even for the 1B preset; the meta device allocates nothing.
    expected = {
        "tiny": (0.8e6, 1.3e6),
        "small": (8e6, 12e6),
        "125m": (110e6, 140e6),
        "350m": (320e6, 380e6),
        "1b": (1.0e9, 1.3e9),
    }
    assert set(MODEL_PRESETS) == set(expected)
    for preset, (low, high) in expected.items():
        with torch.device("meta"):
            model = Transformer(model_config(preset))
        assert low <= num_parameters(model) <= high, (preset, num_parameters(model))
    assert model_config("tiny").vocab_size == 256 and model_config("small").vocab_size >= 256
    assert all(model_config(p).vocab_size == 32000 for p in ("125m", "350m", "1b"))


def test_model_config_overrides_and_errors() -> None:
    assert model_config("tiny", max_seq_len=128).max_seq_len == 128
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*'tiny'"):
        model_config("huge")
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['layers'\]"):
        model_config("tiny", layers=3)
    with pytest.raises(ValueError, match="dim=30 must be a multiple of n_heads=4"):
        dataclasses.replace(MICRO, dim=30)
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_kv_heads=3"):
        dataclasses.replace(MICRO, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_layers: expected a positive int, got 0"):
        dataclasses.replace(MICRO, n_layers=0)
    with pytest.raises(ValueError, match="head_dim=dim/n_heads=3 must be even"):
        dataclasses.replace(MICRO, dim=12, n_heads=4)


def test_loss_falls_when_overfitting_one_batch() -> None:
    torch.manual_seed(0)
    model = build_model(MICRO, seed=0)
    tokens = torch.randint(0, MICRO.vocab_size, (4, 33))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = lm_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Starts near ln(64) = 4.16 (uniform), and memorising 128 random tokens must cut that substantially.
    assert losses[0] == pytest.approx(4.16, abs=0.2)
    assert losses[-1] < 0.6 * losses[0]


def test_lm_loss_matches_definition_and_checks_shapes() -> None:
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    manual = -torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).mean()
    assert lm_loss(logits, targets).item() == pytest.approx(manual.item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"got logits \[2, 5, 11\] and targets \[2, 4\]"):
        lm_loss(logits, targets[:, :4])


def test_tied_embeddings_share_storage() -> None:
    tied = build_model(MICRO, seed=0)
    untied = build_model(dataclasses.replace(MICRO, tie_embeddings=False), seed=0)
    assert tied.output is None
    assert "output.weight" not in tied.state_dict()
    assert num_parameters(untied) - num_parameters(tied) == MICRO.vocab_size * MICRO.dim
    # The output projection reads the embedding matrix itself: editing the row of a token that is not in the
    # input changes that token's logit column and nothing else.
    tokens = torch.randint(6, MICRO.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = tied(tokens)
        tied.tok_embeddings.weight[5].mul_(3.0)
        after = tied(tokens)
    changed_columns = (before - after).abs().amax(dim=(0, 1)) > 0
    assert changed_columns.nonzero().flatten().tolist() == [5]
    # Both uses accumulate into one gradient.
    tied.zero_grad()
    lm_loss(tied(tokens), tokens).backward()
    grad = tied.tok_embeddings.weight.grad
    assert grad is not None and grad.abs().sum(dim=1).gt(0).sum() > len(tokens.unique())


@pytest.mark.parametrize("tie", [True, False])
def test_hf_names_cover_every_parameter_once(tie: bool) -> None:
    config = dataclasses.replace(MICRO, tie_embeddings=tie)
    model = build_model(config, seed=0)
    mapping = hf_state_dict_names(model)
    assert list(mapping) == [name for name, _ in model.named_parameters()]
    assert len(set(mapping.values())) == len(mapping)
    assert set(mapping) == set(model.state_dict())
    pattern = re.compile(
        r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|model\.layers\.\d+\."
        r"(input_layernorm|post_attention_layernorm|self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
    )
    assert all(pattern.fullmatch(hf) for hf in mapping.values())
    assert ("lm_head.weight" in mapping.values()) is not tie
    assert mapping["layers.1.attention.wk.weight"] == "model.layers.1.self_attn.k_proj.weight"
    assert mapping["layers.0.feed_forward.w1.weight"] == "model.layers.0.mlp.gate_proj.weight"
    hf = export_hf_config(config)
    assert hf["architectures"] == ["LlamaForCausalLM"]
    assert (hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]) == (32, 64, 2)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["vocab_size"]) == (4, 2, 64)
    assert hf["tie_word_embeddings"] is tie and hf["max_position_embeddings"] == 32


def _hf_llama_reference_logits(
    hf_config: dict, weights: dict[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    """A plain re-implementation of Hugging Face LlamaForCausalLM's forward (eager attention), reading the
    exported config and HF-named weights only: explicit mask, repeat_kv by expand, rotate_half RoPE."""
    hidden, n_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    n_kv, eps = hf_config["num_key_value_heads"], hf_config["rms_norm_eps"]
    head_dim = hidden // n_heads
    seq_len = tokens.shape[1]

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., head_dim // 2 :], x[..., : head_dim // 2]), dim=-1)

    def repeat_kv(x: torch.Tensor) -> torch.Tensor:
        b, heads, t, d = x.shape
        return x[:, :, None].expand(b, heads, n_heads // n_kv, t, d).reshape(b, n_heads, t, d)

    inv_freq = 1.0 / (hf_config["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)

    h = weights["model.embed_tokens.weight"][tokens]
    for i in range(hf_config["num_hidden_layers"]):
        w = {
            k.removeprefix(f"model.layers.{i}."): v
            for k, v in weights.items()
            if k.startswith(f"model.layers.{i}.")
        }
        x = rms_norm(h, w["input_layernorm.weight"])
        b = x.shape[0]
        q = (x @ w["self_attn.q_proj.weight"].T).view(b, seq_len, n_heads, head_dim).transpose(1, 2)
        k = (x @ w["self_attn.k_proj.weight"].T).view(b, seq_len, n_kv, head_dim).transpose(1, 2)
        v = (x @ w["self_attn.v_proj.weight"].T).view(b, seq_len, n_kv, head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k), repeat_kv(v)
        scores = (q @ k.transpose(-1, -2)) / head_dim**0.5 + mask
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, seq_len, hidden)
        h = h + attn @ w["self_attn.o_proj.weight"].T
        x = rms_norm(h, w["post_attention_layernorm.weight"])
        gate, up = x @ w["mlp.gate_proj.weight"].T, x @ w["mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    h = rms_norm(h, weights["model.norm.weight"])
    lm_head = (
        weights["model.embed_tokens.weight"]
        if hf_config["tie_word_embeddings"]
        else weights["lm_head.weight"]
    )
    return h @ lm_head.T


@pytest.mark.parametrize("tie", [True, False])
def test_hf_export_reproduces_logits(tie: bool) -> None:
    config = dataclasses.replace(MICRO, tie_embeddings=tie)  # 4 query heads share 2 kv heads
    model = build_model(config, seed=2)
    names = hf_state_dict_names(model)
    weights = {names[name]: param.detach() for name, param in model.named_parameters()}
    tokens = torch.randint(0, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
    reference = _hf_llama_reference_logits(export_hf_config(config), weights, tokens)
    assert torch.allclose(ours, reference, atol=1e-5, rtol=1e-4), (ours - reference).abs().max()


def test_rotary_matches_complex_rotation() -> None:
    # rotate_half pairs dimension i with i + head_dim/2; as complex numbers (x_i + i*x_{i+d/2}) the
    # embedding must be a rotation by position * inv_freq_i. This is the layout HF's Llama expects.
    from farloco.node.training.model import apply_rotary, rotary_tables

    head_dim, seq_len = 8, 6
    cos, sin = rotary_tables(head_dim, seq_len, 10000.0)
    x = torch.randn(1, 1, seq_len, head_dim, dtype=torch.float64)
    rotated = apply_rotary(x, cos.double(), sin.double())
    half = head_dim // 2
    as_complex = torch.complex(x[..., :half], x[..., half:])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    expected = as_complex * torch.polar(torch.ones_like(angles), angles)
    assert torch.allclose(rotated[..., :half], expected.real, atol=1e-6)
    assert torch.allclose(rotated[..., half:], expected.imag, atol=1e-6)


def _fsdp_worker(rank: int, world_size: int, store_path: str, result_dir: str) -> None:
    # Runs in a spawned process: a real gloo group on CPU, FSDP2 on each block and then the root.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # bind 127.0.0.1 only
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        results = {}
        for tie in (True, False):
            config = dataclasses.replace(MICRO, tie_embeddings=tie)
            reference = build_model(config, seed=3)
            sharded = build_model(config, seed=3)
            for block in sharded.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(sharded, mesh=mesh)

            generator = torch.Generator().manual_seed(11)
            all_tokens = torch.randint(0, config.vocab_size, (world_size * 2, 17), generator=generator)
            mine = all_tokens[rank * 2 : (rank + 1) * 2]

            loss = lm_loss(sharded(mine[:, :-1]), mine[:, 1:])
            loss.backward()
            # Unsharded: this rank's batch for the loss; the global batch for the gradient, since FSDP
            # averages gradients over ranks and every rank's batch has the same size.
            local_loss = lm_loss(reference(mine[:, :-1]), mine[:, 1:])
            lm_loss(reference(all_tokens[:, :-1]), all_tokens[:, 1:]).backward()

            max_grad_error = 0.0
            sharded_params = dict(sharded.named_parameters())
            for name, ref_param in reference.named_parameters():
                param = sharded_params[name]
                assert isinstance(param, DTensor), name
                assert param.to_local().numel() < ref_param.numel(), name  # really sharded
                assert param.grad is not None and ref_param.grad is not None, name
                grad = param.grad.full_tensor()
                max_grad_error = max(max_grad_error, (grad - ref_param.grad).abs().max().item())
            results[f"tie={tie}"] = {
                "loss_error": abs(loss.item() - local_loss.item()),
                "max_grad_error": max_grad_error,
                "names": sorted(sharded_params),
            }
        (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(results))
        # Both ranks done with every collective before either tears the group down: without it the rank that
        # destroyed first closed gloo's pairs under the other one's last op, which aborted ("terminate called
        # without an active exception") in ~3 runs of 10. A collective barrier alone still lets the rank that
        # leaves it first close the pairs while the other is still taking the barrier's last message in (the
        # same abort, once in a loaded full suite); so each rank then says on the store that it is out of every
        # collective, and waits for the other to say the same.
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        store.add("out-of-collectives", 1)
        while store.add("out-of-collectives", 0) < world_size:
            time.sleep(0.01)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_fsdp2_two_rank_gloo_matches_unsharded(tmp_path: Path) -> None:
    world_size = 2
    mp.start_processes(
        _fsdp_worker,
        args=(world_size, str(tmp_path / "store"), str(tmp_path)),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
    for rank in range(world_size):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for tie in (True, False):
            result = results[f"tie={tie}"]
            model = build_model(dataclasses.replace(MICRO, tie_embeddings=tie), 0)
            assert result["names"] == sorted(name for name, _ in model.named_parameters())
            assert result["loss_error"] < 1e-5, result
            assert result["max_grad_error"] < 1e-5, result
