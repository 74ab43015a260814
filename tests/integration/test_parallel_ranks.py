"""The node's own parallelism on real ranks: tensor parallelism x FSDP2 on gloo (tests/parallel_check.py spawns
the ranks), and NCCL, bf16 and compile on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import FIXTURES, TESTS


def run_checks(cwd: Path, *args: str, timeout: float) -> dict[str, dict[str, Any]]:
    """tests/parallel_check.py's results by check name (it spawns the ranks itself)."""
    done = subprocess.run(
        [sys.executable, str(TESTS / "parallel_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    return {result["check"]: result for result in lines}


@pytest.mark.multiprocess
def test_tensor_parallel_fsdp_ranks_train_as_one_plain_model(tmp_path: Path) -> None:
    """4 gloo ranks as a 2 x 2 (dp_shard x tp) mesh: the shards map onto the flat vector exactly, and one step
    of each trainer setting gives the plain model's parameters (the dp ranks splitting its batch)."""
    results = run_checks(tmp_path, "4", "2", timeout=280)
    assert set(results) == {
        "round_trip",
        "sgd",
        "sgd_clipped",
        "adamw",
        "muon",
        "micro_batches_and_checkpointing",
        "bf16",
    }
    # Every layout torch produced, FSDP's, TP's and FSDP over TP's strided one, maps exactly.
    assert results["round_trip"]["max_abs_diff"] == 0.0
    assert any("_StridedShard" in kind for kind in results["round_trip"]["placements"])
    assert any("Shard(dim=1)" in kind for kind in results["round_trip"]["placements"])
    # Row shards (FSDP over dp) are runs of the flat vector; TP's column shards are not.
    assert results["round_trip"]["wrong_runs"] == [], results["round_trip"]
    assert results["round_trip"]["direct_shards"] > 0 and results["round_trip"]["staged_shards"] > 0
    # Plain SGD with lr 1 moves each parameter by its gradient: equal to float rounding, clipped or not.
    assert results["sgd"]["max_abs_diff"] < 1e-5
    assert results["sgd_clipped"]["max_abs_diff"] < 1e-6
    # AdamW's and Muon's first steps are about lr (1e-3) in size: the sharded step matches to a few percent of it
    # (Adam divides by the root of a tiny second moment where gradients are near zero).
    for name in ("adamw", "muon", "micro_batches_and_checkpointing"):
        assert results[name]["max_abs_diff"] < 1e-4, results[name]
        assert results[name]["loss"] == pytest.approx(results[name]["plain_loss"], abs=1e-5)
    # bf16 compute: the loss within bf16's rounding, the step within a few lr of fp32's.
    assert results["bf16"]["loss"] == pytest.approx(results["bf16"]["plain_loss"], abs=2e-2)
    assert results["bf16"]["max_abs_diff"] < 5e-3


@pytest.mark.multiprocess
# The entry point's TP and FSDP run in tests/test_usermodel.py's swarm too (with agreeing hashes); its exact
# equality with the plain model is the `-m slow` half, to keep the default suite under ~15 minutes.
@pytest.mark.parametrize("which", ["qwen2", pytest.param("custom", marks=pytest.mark.slow)])
def test_models_of_ones_own_shard_over_tp_and_fsdp_as_one_plain_model(tmp_path: Path, which: str) -> None:
    """Their model (run.model): an HF config (a tiny Qwen2, split by its own base_model_tp_plan) and an entry point
    (tests/fixtures/custom_lm.py, its blocks as FSDP units and its MLP plan) on the 2 x 2 mesh: the shards map
    onto the flat vector exactly, and a plain-SGD step and a checkpointed, accumulated AdamW step give the plain
    model's parameters."""
    if which == "qwen2":
        config = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 64}  # fmt: skip
        model = tmp_path / "qwen2.json"
        model.write_text(json.dumps(config))
        run_model = str(model)
    else:
        run_model = "custom_lm:build"
    results = run_checks(
        tmp_path, "4", "2", "cpu", run_model, "round_trip,sgd,micro_batches_and_checkpointing", timeout=280
    )
    assert set(results) == {"round_trip", "sgd", "micro_batches_and_checkpointing"}
    assert results["round_trip"]["max_abs_diff"] == 0.0
    assert any("_StridedShard" in kind for kind in results["round_trip"]["placements"])
    assert results["sgd"]["max_abs_diff"] < 1e-5, results["sgd"]
    check = results["micro_batches_and_checkpointing"]
    assert check["max_abs_diff"] < 1e-4 and check["loss"] == pytest.approx(check["plain_loss"], abs=1e-5), (
        check
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: NCCL, bf16, compile and the pinned hand-off"
)
def test_on_a_gpu_nccl_bf16_compile_and_the_pinned_hand_off(tmp_path: Path) -> None:
    """One CUDA rank under NCCL (TP = 1): the pinned side-stream hand-off copies round-trip exactly, and the
    trainer's steps (fp32, bf16, bf16 compiled) match a plain model's on the same GPU."""
    results = run_checks(tmp_path, "1", "1", "cuda", timeout=600)
    assert results["round_trip"]["max_abs_diff"] == 0.0
    # The flat vector page-locked: every shard of a 1-rank node is one run of it, copied by DMA straight.
    assert results["round_trip"]["registered"] and results["round_trip"]["staged_shards"] == 0, results[
        "round_trip"
    ]
    assert results["round_trip"]["wrong_runs"] == []
    assert results["sgd"]["max_abs_diff"] < 1e-5
    for name in ("adamw", "muon", "micro_batches_and_checkpointing"):
        assert results[name]["max_abs_diff"] < 1e-4, results[name]
    for name in ("bf16", "compiled_bf16"):
        assert results[name]["loss"] == pytest.approx(results[name]["plain_loss"], abs=2e-2), results[name]
        assert results[name]["max_abs_diff"] < 5e-3, results[name]
