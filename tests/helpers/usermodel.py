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
