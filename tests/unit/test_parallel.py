"""The node's own parallelism (node.tp, FSDP over node.num_ranks) in this process: config keys, the precision,
Muon. tests/integration/test_parallel_ranks.py runs tensor parallelism x FSDP2 on real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from farloco.node.config import ConfigError, build_config
from farloco.node.training.muon import MuonAdamW, build_inner_optimizer, is_muon_matrix, orthogonalize
from farloco.node.training.parallel import check_node_layout, compute_dtype


@pytest.mark.parametrize(
    ("node", "run", "message"),
    [
        ({"num_ranks": 3, "tp": 2}, {}, "node.tp=2: expected a divisor of node.num_ranks=3"),
        ({"tp": 0}, {}, "node.tp: expected a positive number, got 0"),
        ({"precision": "fp8"}, {}, "node.precision: expected one of ('auto', 'fp32', 'bf16'), got 'fp8'"),
        (
            {"micro_batches": 3},
            {"batch_size": 8},
            "node.micro_batches=3: expected a divisor of the per-rank batch",
        ),
        ({"num_ranks": 2, "tp": 2}, {"seq_len": 127}, "node.tp=2: expected a divisor of run.seq_len=127"),
        (
            {"num_ranks": 4},
            {"batch_size": 2},
            "run.batch_size=2: expected at least one sequence per data-parallel",
        ),
        ({"compile": "yes"}, {}, "node.compile: expected true or false, got 'yes'"),
        (
            {},
            {"inner_optimizer": "lion"},
            "run.inner_optimizer: expected one of ('adamw', 'muon'), got 'lion'",
        ),
    ],
)
def test_bad_trainer_options_name_the_key(
    node: dict[str, object], run: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config({"node": node, "run": run})
    assert message in str(caught.value)


def test_tp_is_checked_against_the_models_heads_at_config_load() -> None:
    # tiny: n_heads 4, n_kv_heads 2, ffn_dim 512
    check_node_layout(build_config({"node": {"num_ranks": 2, "tp": 2}}))
    config = build_config({"node": {"num_ranks": 4, "tp": 4}, "run": {"batch_size": 8}})
    with pytest.raises(ConfigError, match=r"node.tp=4: the model's n_kv_heads=2 is not a multiple of it"):
        check_node_layout(config)


def test_config_check_refuses_a_tp_the_model_cannot_split(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from farloco.node.tools.cli import main

    path = tmp_path / "node.toml"
    path.write_text("[node]\nnum_ranks = 3\ntp = 3\n[run]\nbatch_size = 3\nseq_len = 129\n")
    result = CliRunner().invoke(main, ["config", "check", str(path)])
    assert result.exit_code != 0
    assert "node.tp=3: the model's n_heads=4 is not a multiple of it" in result.output


def test_precision_auto_is_bf16_on_cuda_and_fp32_on_cpu() -> None:
    config = build_config({})
    assert compute_dtype(config, torch.device("cpu")) == torch.float32
    assert compute_dtype(config, torch.device("cuda")) == torch.bfloat16
    assert compute_dtype(build_config({"node": {"precision": "bf16"}}), torch.device("cpu")) == torch.bfloat16


def test_newton_schulz_flattens_the_spectrum() -> None:
    matrix = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3.0
    singular = torch.linalg.svdvals(orthogonalize(matrix).float())
    # Muon's quintic iteration does not converge to 1 exactly; it maps every singular value into about [0.5, 1.5].
    assert singular.min() > 0.3 and singular.max() < 1.5
    assert torch.linalg.svdvals(matrix).max() > 10  # it did change something


def test_muon_trains_the_blocks_matrices_and_adamw_the_rest() -> None:
    from farloco.node.training.model import build_model, lm_loss, model_config

    model = build_model(model_config("tiny"), seed=0)
    optimizer = build_inner_optimizer(model, "muon", lr=3e-3, weight_decay=0.0, fused=False)
    assert isinstance(optimizer, MuonAdamW)
    groups = {group["algorithm"]: group["params"] for group in optimizer.param_groups}
    named = dict(model.named_parameters())
    muon = {name for name, param in named.items() if any(param is p for p in groups["muon"])}
    assert muon == {name for name, param in named.items() if is_muon_matrix(name, param)}
    assert "tok_embeddings.weight" not in muon and "layers.0.attention.wq.weight" in muon
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(8):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5, losses
    state = optimizer.state[named["layers.0.attention.wq.weight"]]
    assert set(state) == {"step", "momentum_buffer"} and int(state["step"]) == 8


def test_muon_refuses_what_is_not_a_matrix() -> None:
    with pytest.raises(ValueError, match=r"Muon takes 2-D matrices, got a parameter of shape \(4,\)"):
        MuonAdamW([torch.nn.Parameter(torch.ones(4))], [], lr=1e-3, weight_decay=0.0)


def test_a_single_cpu_rank_trains_the_plain_module_in_the_handoffs_local_region(tmp_path: Path) -> None:
    """One rank computing in float32 is not wrapped in FSDP2 (it would shard and cast nothing), and on CPU its
    weights live in the hand-off's local region: loading theta writes them there, the optimizer trains them in
    place, and storing them copies nothing."""
    import dataclasses

    from farloco.node.handoff import Handoff, flatten, layout_of
    from farloco.node.training.model import build_model, lm_loss, model_config
    from farloco.node.training.parallel import NodeMesh, ShardView, shards
    from farloco.node.training.trainer import HostStaging

    one = NodeMesh(None, None, None, 0, 1, 0, 1)  # type: ignore[arg-type]
    assert not shards(one, torch.float32)
    assert shards(one, torch.bfloat16) and shards(dataclasses.replace(one, dp_size=2), torch.float32)

    model = build_model(model_config("tiny"), seed=0)
    layout = layout_of(model)
    handoff = Handoff.create(layout[-1].offset + layout[-1].numel, 1, directory=tmp_path)
    try:
        handoff.theta.copy_(flatten(model, layout).mul_(0.5))
        params = dict(model.named_parameters())
        staging = HostStaging(
            [ShardView(params[s.name], s) for s in layout], torch.device("cpu"), shared=handoff.local
        )
        assert staging.shared is not None
        for slot in layout:
            assert params[slot.name].data_ptr() == handoff.local[slot.offset :].data_ptr(), slot.name
        staging.load(handoff.theta)
        assert torch.equal(handoff.local, handoff.theta)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        trained = flatten(model, layout)
        assert torch.equal(handoff.local, trained) and not torch.equal(trained, handoff.theta)
        staging.store(handoff.local)
        assert torch.equal(handoff.local, trained)
        staging.load(handoff.theta)  # the next round's start
        assert torch.equal(flatten(model, layout), handoff.theta)
    finally:
        handoff.close()
