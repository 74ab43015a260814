"""Their model (run.model) in tests: a tiny Hugging Face Qwen2 config.json and the entry point of
tests/fixtures/custom_lm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from farloco.node.handoff import flatten, layout_of
from farloco.node.training.models import build_spec
from helpers import FIXTURES

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


# The same shapes as QWEN2, as a Llama with tied embeddings.
LLAMA = {**{k: v for k, v in QWEN2.items() if k != "model_type"}, "tie_word_embeddings": True}


def save_pretrained(
    folder: Path,
    kind: str = "llama",
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
    shard: str | None = None,
) -> dict[str, torch.Tensor]:
    """A small "pretrained" model saved by `transformers` itself (a Llama with tied embeddings, or the Qwen2 of
    QWEN2 with its own head), in `dtype`, sharded when `shard` (e.g. "40KB") is given; returns its state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**LLAMA))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in QWEN2.items() if k != "model_type"}))
    model = model.to(dtype)
    with torch.no_grad():  # norm scales of 1.0 and zero biases would hide a loader that skips them
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, dtype=torch.float32).to(dtype) * 0.1)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(folder), **kwargs)  # type: ignore[operator]
    return {name: value.clone() for name, value in model.state_dict().items()}
