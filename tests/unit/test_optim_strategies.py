"""Outer strategies: the math against hand computations, error-feedback commit/rollback, state round trips,
hyper-parameter checks, and bit-identical outer steps across simulated peers."""

from __future__ import annotations

import itertools
import re

import pytest
import safetensors.torch
import torch
from helpers.memory import CAN_MEASURE, peak_growth_mib

from farloco.optim import (
    Codec,
    OuterStrategy,
    StrategyError,
    available_strategies,
    get_codec,
    make_strategy,
    mean_of,
)

STRATEGY_CODECS: dict[str, tuple[str, dict[str, int]]] = {
    "diloco": ("int8", {"block_size": 32}),
    "sparseloco": ("topk", {"k": 8, "chunk": 64, "value_bits": 2}),
    "streaming-diloco": ("int4", {"block_size": 32}),
    "demo": ("dct-topk", {"k": 8, "chunk": 32}),
}


def build(name: str, num_params: int, **hparams: float | int | bool) -> OuterStrategy:
    codec_name, options = STRATEGY_CODECS[name]
    return make_strategy(name, num_params, get_codec(codec_name, **options), **hparams)


def round_trip(codec: Codec, tensor: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(tensor))


def swarm_round(
    strategies: dict[str, OuterStrategy], thetas: dict[str, torch.Tensor], locals_: dict[str, torch.Tensor]
) -> None:
    """One committed round, as the node and exchange drive it: contributions travel through the codec, every
    peer averages the same transmitted tensors sorted by peer id, then applies and commits."""
    contributions = {p: s.make_contribution(thetas[p], locals_[p]) for p, s in strategies.items()}
    transmitted = {p: round_trip(strategies[p].codec, c) for p, c in contributions.items()}
    averaged = mean_of([transmitted[p] for p in sorted(transmitted)])
    for peer, strategy in strategies.items():
        strategy.propose(contributions[peer], transmitted[peer])
        strategy.apply(thetas[peer], averaged.clone())
        strategy.commit()
        strategy.merge_into_local(thetas[peer], locals_[peer])


def test_registry() -> None:
    assert available_strategies() == ["diloco", "sparseloco", "streaming-diloco", "demo"]
    with pytest.raises(StrategyError, match=r"expected one of \['diloco', .*\], got 'adam'"):
        make_strategy("adam", 10, get_codec("fp32"))


def test_diloco_outer_step_matches_a_hand_computation() -> None:
    strategy = make_strategy("diloco", 3, get_codec("fp32"))
    assert strategy.hparams == {  # fp32 is lossless
        "lr": 0.7,
        "momentum": 0.9,
        "error_feedback": False,
        "feedback_bf16": True,
    }
    theta = torch.tensor([1.0, 2.0, 3.0])
    local = torch.tensor([0.5, 2.5, 3.0])
    contribution = strategy.make_contribution(theta, local)
    assert contribution.tolist() == [0.5, -0.5, 0.0]
    strategy.propose(contribution, contribution)
    strategy.apply(theta, contribution)
    strategy.commit()
    # b = g; theta -= 0.7 * (g + 0.9 b) = 1.33 g
    assert theta.tolist() == pytest.approx([1 - 0.665, 2 + 0.665, 3.0], abs=1e-6)
    gradient = torch.tensor([0.1, 0.1, 0.1])
    strategy.propose(gradient, gradient)
    strategy.apply(theta, gradient)
    strategy.commit()
    # b = 0.9 * [0.5, -0.5, 0] + 0.1 = [0.55, -0.35, 0.1]; step = 0.1 + 0.9 b = [0.595, -0.215, 0.19]
    assert theta.tolist() == pytest.approx([0.335 - 0.4165, 2.665 + 0.1505, 3 - 0.133], abs=1e-6)
    assert strategy.state_dict()["momentum_buffer"].tolist() == pytest.approx([0.55, -0.35, 0.1], abs=1e-7)
    assert int(strategy.state_dict()["num_rounds"]) == 2


def test_diloco_matches_torch_sgd_nesterov() -> None:
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(500, generator=generator)
    reference = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    strategy = make_strategy("diloco", 500, get_codec("fp32"))
    for _ in range(6):
        gradient = torch.randn(500, generator=generator)
        strategy.apply(theta, gradient)
        reference.grad = gradient.clone()
        sgd.step()
    torch.testing.assert_close(theta, reference.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_error_feedback_is_staged_committed_and_rolled_back(bf16: bool) -> None:
    codec = get_codec("int4", block_size=16)
    strategy = make_strategy("diloco", 100, codec, feedback_bf16=bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    assert strategy.state_dict()["residual"].dtype == dtype
    assert strategy.hparams["error_feedback"] is True  # lossy codec: on by default
    generator = torch.Generator().manual_seed(1)
    theta = torch.randn(100, generator=generator)
    local = theta - 0.01 * torch.randn(100, generator=generator)
    first = strategy.make_contribution(theta, local)
    assert torch.equal(first, theta - local)  # residual starts at zero
    assert torch.equal(strategy.make_contribution(theta, local), first)  # pure: no state change
    transmitted = round_trip(codec, first)
    lost = (first - transmitted).to(dtype)  # kept rounded to the residual's dtype
    assert float(lost.abs().max()) > 0

    strategy.propose(first, transmitted)
    strategy.rollback()  # aborted round: the residual is not eaten
    assert torch.equal(strategy.state_dict()["residual"], torch.zeros(100, dtype=dtype))
    with pytest.raises(StrategyError, match="expected a proposed round, got none"):
        strategy.commit()

    strategy.propose(first, transmitted)
    assert torch.equal(strategy.state_dict()["residual"], torch.zeros(100, dtype=dtype))  # staged only
    strategy.commit()
    assert torch.equal(strategy.state_dict()["residual"], lost)
    assert torch.equal(strategy.make_contribution(theta, local), (theta - local) + lost.float())
    with pytest.raises(StrategyError, match="call propose first"):
        strategy.commit()


def test_a_residual_saved_in_the_other_precision_loads_converted() -> None:
    """A checkpoint from before `feedback_bf16` was switched (or from an older version, float32) still loads:
    rounded to bfloat16, or widened exactly to float32; every other buffer keeps its strict dtype."""
    codec = get_codec("int8")
    values = torch.tensor([1.0, 1.0 + 2**-10, -3e-7, 0.0, 2.5])
    source = make_strategy("diloco", 5, codec, feedback_bf16=False)
    state = {**source.state_dict(), "residual": values.clone()}
    compact = make_strategy("diloco", 5, codec)
    compact.load_state_dict(state)
    assert torch.equal(compact.state_dict()["residual"], values.to(torch.bfloat16))
    wide = make_strategy("diloco", 5, codec, feedback_bf16=False)
    wide.load_state_dict(compact.state_dict())
    assert torch.equal(wide.state_dict()["residual"], values.to(torch.bfloat16).float())


def test_a_bf16_residual_costs_two_bytes_a_parameter_and_feeds_back_what_the_codec_lost() -> None:
    """The default residual is bfloat16; over rounds, a coarse codec's swarm still tracks the exact mean as
    closely as with a float32 residual (what error feedback is for)."""
    for name in ("diloco", "streaming-diloco"):
        strategy = make_strategy(name, 1000, get_codec("int8"))
        residual = strategy.live_buffers()["residual"]
        assert residual.dtype == torch.bfloat16 and residual.element_size() == 2
    codec = get_codec("int4", block_size=256)
    compact = toy_swarm_distance("diloco", codec, 40)  # about 0.0752 on this seed
    wide = toy_swarm_distance("diloco", codec, 40, feedback_bf16=False)  # about 0.0752
    without = toy_swarm_distance("diloco", codec, 40, error_feedback=False)  # about 0.094
    assert compact < 0.85 * without
    assert abs(compact - wide) < 0.01 * wide


def test_error_feedback_can_be_switched_off() -> None:
    strategy = make_strategy("diloco", 10, get_codec("int8"), error_feedback=False)
    assert set(strategy.state_dict()) == {"momentum_buffer", "num_rounds"}
    theta, local = torch.ones(10), torch.zeros(10)
    assert torch.equal(strategy.make_contribution(theta, local), torch.ones(10))


def test_sparseloco_error_buffer_and_step() -> None:
    codec = get_codec("topk", k=1, chunk=4, value_bits=16)
    strategy = make_strategy("sparseloco", 4, codec)
    assert strategy.hparams == {"lr": 1.0, "beta": 0.95}
    theta = torch.tensor([1.0, 1.0, 1.0, 1.0])
    local = torch.tensor([0.5, 1.25, 1.0, 1.0])  # delta = [0.5, -0.25, 0, 0]
    contribution = strategy.make_contribution(theta, local)
    transmitted = round_trip(codec, contribution)
    assert transmitted.tolist() == [0.5, 0.0, 0.0, 0.0]
    strategy.propose(contribution, transmitted)
    strategy.apply(theta, transmitted)
    strategy.commit()
    assert theta.tolist() == [0.5, 1.0, 1.0, 1.0]
    assert strategy.state_dict()["error_buffer"].tolist() == [0.0, -0.25, 0.0, 0.0]
    # e <- 0.95 e + delta: the unsent -0.25 decays into the next contribution
    local = theta - torch.tensor([0.0, 0.1, 0.0, 0.0])
    assert strategy.make_contribution(theta, local).tolist() == pytest.approx([0.0, -0.1375, 0.0, 0.0])


def test_demo_sign_step_with_decoupled_weight_decay() -> None:
    strategy = make_strategy("demo", 3, get_codec("fp32"), lr=0.1, weight_decay=0.5, beta=0.9)
    theta = torch.tensor([1.0, -1.0, 2.0])
    strategy.apply(theta, torch.tensor([0.3, -0.2, 0.0]))
    assert theta.tolist() == pytest.approx([0.85, -0.85, 1.9])
    # momentum accumulates the gradient and keeps what was not sent
    gradient_local = theta - torch.tensor([0.5, 0.0, 0.0])
    contribution = strategy.make_contribution(theta, gradient_local)
    assert contribution.tolist() == pytest.approx([0.5, 0.0, 0.0])
    strategy.propose(contribution, torch.tensor([0.25, 0.0, 0.0]))
    strategy.commit()
    assert strategy.make_contribution(theta, theta.clone()).tolist() == pytest.approx([0.225, 0.0, 0.0])


def test_streaming_diloco_syncs_one_fragment_per_round_and_merges_with_alpha() -> None:
    codec = get_codec("fp32")
    strategy = make_strategy("streaming-diloco", 10, codec, num_fragments=3, alpha=0.25, momentum=0.0, lr=1.0)
    assert [(f.start, f.stop) for f in strategy.fragments] == [(0, 4), (4, 7), (7, 10)]  # type: ignore[attr-defined]
    theta = torch.zeros(10)
    local = -torch.arange(1.0, 11.0)  # every fragment drifted
    seen = []
    for round_index in range(4):
        contribution = strategy.make_contribution(theta, local)
        seen.append(contribution.numel())
        before = theta.clone()
        strategy.propose(contribution, contribution)
        strategy.apply(theta, contribution)
        strategy.commit()
        part = strategy.fragments[round_index % 3]  # type: ignore[attr-defined]
        untouched = torch.ones(10, dtype=torch.bool)
        untouched[part] = False
        assert torch.equal(theta[untouched], before[untouched])
        # lr 1, no momentum: the fragment jumps to the local values; the ranks keep 25% of their own
        local_before = local.clone()
        strategy.merge_into_local(theta, local)
        assert torch.equal(theta[part], local_before[part])
        assert torch.equal(local[untouched], local_before[untouched])
    assert seen == [4, 3, 3, 4]
    assert int(strategy.state_dict()["num_rounds"]) == 4
    with pytest.raises(StrategyError, match="expected a preceding apply"):
        strategy.merge_into_local(theta, local)


def test_streaming_diloco_merge_formula() -> None:
    strategy = make_strategy("streaming-diloco", 4, get_codec("fp32"), num_fragments=2, alpha=0.5, lr=1.0)
    theta, local = torch.zeros(4), torch.full((4,), -2.0)
    contribution = strategy.make_contribution(theta, local)
    strategy.apply(theta, contribution)  # nesterov with momentum 0.9: theta[:2] = -(2 + 0.9 * 2) = -3.8
    assert theta.tolist() == pytest.approx([-3.8, -3.8, 0.0, 0.0])
    strategy.merge_into_local(theta, local)
    assert local.tolist() == pytest.approx([-2.9, -2.9, -2.0, -2.0])


@pytest.mark.parametrize("name", ["diloco", "sparseloco", "streaming-diloco", "demo"])
def test_peers_stay_bit_identical(name: str) -> None:
    generator = torch.Generator().manual_seed(7)
    num_params = 300
    start = torch.randn(num_params, generator=generator)
    peers = ["peer-c", "peer-a", "peer-b"]
    strategies = {p: build(name, num_params) for p in peers}
    thetas = {p: start.clone() for p in peers}
    locals_ = {p: start.clone() for p in peers}
    for _ in range(5):
        for p in peers:
            locals_[p].sub_(0.05 * torch.randn(num_params, generator=generator))
        swarm_round(strategies, thetas, locals_)
    bits = {p: thetas[p].view(torch.int32).tolist() for p in peers}
    assert bits["peer-a"] == bits["peer-b"] == bits["peer-c"]
    assert not torch.equal(thetas["peer-a"], start)


@pytest.mark.parametrize("name", ["diloco", "sparseloco", "streaming-diloco", "demo"])
def test_state_dict_round_trips_through_safetensors(name: str) -> None:
    generator = torch.Generator().manual_seed(11)
    num_params = 200
    original = build(name, num_params)
    theta = torch.randn(num_params, generator=generator)
    local = theta.clone()
    drifts = [0.05 * torch.randn(num_params, generator=generator) for _ in range(6)]
    for drift in drifts[:3]:
        local.sub_(drift)
        swarm_round({"p": original}, {"p": theta}, {"p": local})
    state = original.state_dict()
    assert all(t.ndim in (0, 1) for t in state.values()) and state["num_rounds"].ndim == 0
    restored = build(name, num_params)
    restored.load_state_dict(safetensors.torch.load(safetensors.torch.save(state)))
    theta_restored, local_restored = theta.clone(), local.clone()
    for drift in drifts[3:]:
        local.sub_(drift)
        local_restored.sub_(drift)
        swarm_round({"p": original}, {"p": theta}, {"p": local})
        swarm_round({"p": restored}, {"p": theta_restored}, {"p": local_restored})
    assert torch.equal(theta, theta_restored)
    # state_dict hands out copies: scribbling on them does not change the strategy
    snapshot = original.state_dict()
    for tensor in snapshot.values():
        tensor.zero_()
    assert any(bool(t.any()) for t in original.state_dict().values())


def test_load_state_dict_refuses_what_does_not_fit() -> None:
    strategy = build("diloco", 10)
    good = strategy.state_dict()
    missing = {k: v for k, v in good.items() if k != "residual"}
    with pytest.raises(StrategyError, match=re.escape("missing ['residual'], unexpected []")):
        strategy.load_state_dict(missing)
    with pytest.raises(
        StrategyError,
        match=re.escape("state momentum_buffer: expected torch.float32 [10], got torch.float32 [11]"),
    ):
        strategy.load_state_dict({**good, "momentum_buffer": torch.zeros(11)})
    with pytest.raises(StrategyError, match=r"residual: expected torch.bfloat16 .10., got torch.float64"):
        strategy.load_state_dict({**good, "residual": torch.zeros(10, dtype=torch.float64)})
    with pytest.raises(
        StrategyError, match=r"momentum_buffer: expected torch.float32 .10., got torch.bfloat16"
    ):
        strategy.load_state_dict({**good, "momentum_buffer": torch.zeros(10, dtype=torch.bfloat16)})
    with pytest.raises(StrategyError, match="residual: expected only finite values"):
        strategy.load_state_dict({**good, "residual": torch.full((10,), float("nan"))})
    with pytest.raises(StrategyError, match="num_rounds: expected a 0-d int64 tensor >= 0"):
        strategy.load_state_dict({**good, "num_rounds": torch.tensor(-1)})
    with pytest.raises(StrategyError, match="num_rounds: expected a 0-d int64 tensor"):
        strategy.load_state_dict({**good, "num_rounds": torch.tensor([1])})


def test_hyper_parameters_are_checked() -> None:
    codec = get_codec("int8")
    with pytest.raises(
        StrategyError,
        match=re.escape(
            "expected a subset of ['error_feedback', 'feedback_bf16', 'lr', 'momentum'], got ['beta']"
        ),
    ):
        make_strategy("diloco", 10, codec, beta=0.9)
    with pytest.raises(StrategyError, match="lr: expected a finite float, got bool True"):
        make_strategy("diloco", 10, codec, lr=True)
    with pytest.raises(StrategyError, match="error_feedback: expected a finite bool, got int 1"):
        make_strategy("diloco", 10, codec, error_feedback=1)
    with pytest.raises(StrategyError, match=r"momentum: expected 0 <= momentum < 1, got 1.0"):
        make_strategy("diloco", 10, codec, momentum=1)
    with pytest.raises(StrategyError, match=r"lr: expected > 0, got -0.5"):
        make_strategy("sparseloco", 10, codec, lr=-0.5)
    with pytest.raises(StrategyError, match="lr: expected a finite float, got float nan"):
        make_strategy("demo", 10, codec, lr=float("nan"))
    with pytest.raises(StrategyError, match="num_fragments: expected 1 <= num_fragments <= 10, got 11"):
        make_strategy("streaming-diloco", 10, codec, num_fragments=11)
    with pytest.raises(StrategyError, match=r"num_fragments: expected a finite int, got float 2.0"):
        make_strategy("streaming-diloco", 10, codec, num_fragments=2.0)
    with pytest.raises(StrategyError, match="num_params: expected an int >= 1, got 0"):
        make_strategy("diloco", 0, codec)
    with pytest.raises(StrategyError, match=r"codec: expected a farloco.optim.Codec, got str"):
        make_strategy("diloco", 10, "int8")  # type: ignore[arg-type]
    assert make_strategy("diloco", 10, codec, lr=1).hparams["lr"] == 1.0


def test_tensor_arguments_are_checked() -> None:
    strategy = build("diloco", 10)
    with pytest.raises(
        StrategyError,
        match=re.escape("theta_local: expected a 1-D float32 CPU tensor of 10 values, got torch.float32 [9]"),
    ):
        strategy.make_contribution(torch.zeros(10), torch.zeros(9))
    with pytest.raises(
        StrategyError, match=r"transmitted: expected a 1-D float32 CPU tensor of 10 values, got torch.float16"
    ):
        strategy.propose(torch.zeros(10), torch.zeros(10, dtype=torch.float16))
    with pytest.raises(StrategyError, match="averaged: expected only finite values"):
        strategy.apply(torch.zeros(10), torch.full((10,), float("inf")))
    theta = torch.zeros(10)
    with pytest.raises(StrategyError, match=r"averaged: expected .* of 10 values, got torch.float32 .2, 5."):
        strategy.apply(theta, torch.zeros(2, 5))
    assert torch.equal(theta, torch.zeros(10))


def toy_swarm_distance(
    name: str, codec: Codec, num_rounds: int, inner_steps: int = 10, **hparams: float | int | bool
) -> float:
    """4 peers, each pulled by SGD towards its own target with noisy gradients; the swarm optimum is the mean
    target. Returns |theta - optimum| / |theta0 - optimum| after `num_rounds` committed rounds."""
    generator = torch.Generator().manual_seed(0)
    num_params, num_peers = 1024, 4
    targets = torch.randn(num_peers, num_params, generator=generator)
    optimum = targets.mean(0)
    theta = torch.zeros(num_params)
    peers = {f"peer-{m}": make_strategy(name, num_params, codec, **hparams) for m in range(num_peers)}
    start = float((theta - optimum).norm())
    for _ in range(num_rounds):
        thetas = {p: theta.clone() for p in peers}
        locals_ = {p: theta.clone() for p in peers}
        for m, p in enumerate(peers):
            for _ in range(inner_steps):
                noise = 0.1 * torch.randn(num_params, generator=generator)
                locals_[p].sub_(0.05 * (locals_[p] - targets[m] + noise))
        swarm_round(peers, thetas, locals_)
        theta = thetas["peer-0"]
    return float((theta - optimum).norm()) / start


@pytest.mark.parametrize(
    ("name", "codec_name", "options", "num_rounds", "hparams", "at_most"),
    [
        ("diloco", "fp32", {}, 40, {}, 0.05),
        ("diloco", "int8", {}, 40, {}, 0.05),
        ("streaming-diloco", "int8", {}, 40, {"num_fragments": 2}, 0.05),
        # 25% density: at 1.6% and beta=0.95 this deterministic toy needs far more rounds (e grows ~20x per
        # unsent coordinate before it goes out), which is the algorithm, not the codec: fp16 values behave alike.
        ("sparseloco", "topk", {"k": 256, "chunk": 1024, "value_bits": 2}, 60, {}, 0.5),
        ("demo", "dct-topk", {}, 100, {"inner_steps": 1, "lr": 0.01, "beta": 0.9}, 0.8),
    ],
)
def test_strategies_make_progress_on_a_toy_swarm(
    name: str,
    codec_name: str,
    options: dict[str, int],
    num_rounds: int,
    hparams: dict[str, float],
    at_most: float,
) -> None:
    hparams = dict(hparams)
    inner_steps = int(hparams.pop("inner_steps", 10))
    codec = get_codec(codec_name, **options)
    assert toy_swarm_distance(name, codec, num_rounds, inner_steps, **hparams) < at_most


def test_error_feedback_recovers_what_a_coarse_codec_loses() -> None:
    codec = get_codec("int4", block_size=256)
    with_feedback = toy_swarm_distance("diloco", codec, 40)  # about 0.075 on this seed
    without = toy_swarm_distance("diloco", codec, 40, error_feedback=False)  # about 0.094
    assert with_feedback < 0.85 * without


def test_streaming_diloco_residual_lands_on_the_proposed_fragment_whatever_the_call_order() -> None:
    codec = get_codec("int4", block_size=4)
    generator = torch.Generator().manual_seed(4)
    theta = torch.randn(12, generator=generator)
    local = theta - torch.randn(12, generator=generator)
    for apply_first in (True, False):
        strategy = make_strategy("streaming-diloco", 12, codec, num_fragments=3)
        contribution = strategy.make_contribution(theta, local)
        transmitted = round_trip(codec, contribution)
        strategy.propose(contribution, transmitted)
        if apply_first:  # the node's order: the schedule advances in apply, before commit
            strategy.apply(theta.clone(), transmitted)
            strategy.commit()
        else:
            strategy.commit()
            strategy.apply(theta.clone(), transmitted)
        residual = strategy.state_dict()["residual"]
        assert torch.equal(residual[:4], (contribution - transmitted).to(torch.bfloat16))
        assert torch.equal(residual[4:], torch.zeros(8, dtype=torch.bfloat16))


def two_alike(
    name: str, feedback: str, numel: int, codec: Codec, *, seed: int
) -> tuple[OuterStrategy, OuterStrategy, torch.Tensor, torch.Tensor, torch.Generator]:
    """Two strategies of one config (one for the whole path, one on demand; streaming: three fragments;
    `feedback`: "bf16", "fp32" or "" for the strategy's default), a theta for each, alike, and the generator."""
    hparams: dict[str, float | int | bool] = {"num_fragments": 3} if name == "streaming-diloco" else {}
    if feedback:
        hparams.update(error_feedback=True, feedback_bf16=feedback == "bf16")
    whole, on_demand = (make_strategy(name, numel, codec, **hparams) for _ in range(2))
    generator = torch.Generator().manual_seed(seed)
    theta = torch.randn(numel, generator=generator)
    return whole, on_demand, theta, theta.clone(), generator


def ranges_of(numel: int, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = [0, *sorted({c for c in cuts if 0 < c < numel}), numel]
    return list(itertools.pairwise(bounds))


@pytest.mark.parametrize(
    ("name", "feedback"),
    [("diloco", "bf16"), ("diloco", "fp32"), ("sparseloco", ""), ("streaming-diloco", "bf16"),
     ("streaming-diloco", "fp32"), ("demo", "")],
)  # fmt: skip
@pytest.mark.parametrize("codec_name", ["int8", "int4", "bf16", "fp32"])
def test_a_contribution_on_demand_gives_the_same_bits_as_one_made_whole(
    name: str, feedback: str, codec_name: str
) -> None:
    """`contribution_range` is `make_contribution`'s values, and `stage_in_place` over the ranges an exchange
    encoded in leaves the state `propose` + `commit` would, bit for bit, over three rounds (streaming: three
    fragments) and after a round alone (None: nothing lost), with the residual in either precision. The outer
    steps then agree too."""
    numel = 3_001
    codec = get_codec(codec_name, **({"block_size": 32} if codec_name in ("int8", "int4") else {}))
    whole, on_demand, theta_w, theta_d, generator = two_alike(name, feedback, numel, codec, seed=7)
    for round_index in range(4):
        local = theta_w + torch.randn(numel, generator=generator) * 0.01
        contribution = whole.make_contribution(theta_w, local)
        n = contribution.numel()
        for a, b in [(0, n), (5, 17), (n - 3, n), (9, 9)]:
            piece = on_demand.contribution_range(theta_d, local, a, b, torch.empty(b - a))
            assert torch.equal(piece, contribution[a:b]), (a, b)
        alone = round_index == 3
        ranges = None if alone else ranges_of(n, [257 * (round_index + 1), 1000, 2049 - round_index])
        if ranges is None:
            transmitted = contribution
        else:
            transmitted = torch.cat([codec.encode_decoded(contribution[a:b])[1] for a, b in ranges])
        averaged = transmitted * 0.5 + 0.001
        whole.propose(contribution, transmitted)
        whole.apply(theta_w, averaged)
        whole.commit()
        on_demand.stage_in_place(theta_d, local, ranges)
        on_demand.apply(theta_d, averaged)
        assert on_demand.commit() is None
        assert torch.equal(theta_d, theta_w)
        for key, value in whole.state_dict().items():
            assert torch.equal(on_demand.state_dict()[key], value), (round_index, key)


@pytest.mark.parametrize(
    ("name", "feedback"),
    [("diloco", "bf16"), ("diloco", "fp32"), ("sparseloco", ""), ("streaming-diloco", "bf16"), ("demo", "")],
)  # fmt: skip
@pytest.mark.parametrize("codec_name", ["topk", "topk-2bit", "dct-topk"])
def test_a_sparse_contribution_on_demand_gives_the_same_bits_as_one_made_whole(
    name: str, feedback: str, codec_name: str
) -> None:
    """A sparse codec's payload encoded piece by piece from `contribution_range` (`encode_on_demand`) is the
    whole contribution's payload, and `stage_in_place` from that payload, parsed as the exchange sent it,
    leaves the state `propose` + `commit` with its decoded values would, bit for bit, over three rounds and a
    round alone; the outer steps then agree too."""
    numel = 70_003  # pieces of the stage and the encode that end inside and at the end of the vector
    options = {"k": 4, "chunk": 96} if codec_name == "dct-topk" else {"k": 5, "chunk": 300}
    if codec_name == "topk-2bit":
        options["value_bits"] = 2
    codec = get_codec(codec_name.removesuffix("-2bit"), **options)
    whole, on_demand, theta_w, theta_d, generator = two_alike(name, feedback, numel, codec, seed=11)
    for round_index in range(4):
        local = theta_w + torch.randn(numel, generator=generator) * 0.01
        contribution = whole.make_contribution(theta_w, local)
        n = contribution.numel()
        payload = codec.encode_on_demand(
            n,
            lambda a, b, out: on_demand.contribution_range(theta_d, local, a, b, out),  # noqa: B023
            checksum=False,
        )
        if codec_name != "dct-topk":  # whose float32 matmul may round otherwise over another row count
            assert payload == codec.encode(contribution, checksum=False)
        alone = round_index == 3
        transmitted = contribution if alone else codec.decode(payload, checksum=False)
        averaged = transmitted * 0.5 + 0.001
        whole.propose(contribution, transmitted)
        whole.apply(theta_w, averaged)
        whole.commit()
        on_demand.stage_in_place(theta_d, local, None if alone else codec.parse(payload, checksum=False))
        on_demand.apply(theta_d, averaged)
        assert on_demand.commit() is None
        assert torch.equal(theta_d, theta_w)
        for key, value in whole.state_dict().items():
            assert torch.equal(on_demand.state_dict()[key], value), (round_index, key)
    other = codec.encode(torch.ones(numel + 1), checksum=False)
    with pytest.raises(StrategyError, match=f"expected a payload of {on_demand.contribution_numel()} values"):
        on_demand.stage_in_place(theta_d, local, codec.parse(other, checksum=False))


@pytest.mark.parametrize(
    ("name", "feedback"),
    [("diloco", "bf16"), ("diloco", "fp32"), ("streaming-diloco", "bf16"), ("diloco", "")],
)  # fmt: skip
@pytest.mark.parametrize("codec_name", ["int8", "fp32"])
def test_withheld_ranges_stay_whole_in_the_error_feedback(name: str, feedback: str, codec_name: str) -> None:
    """Ranges of a contribution that reached no mean (`withheld`: a grouped round whose slice lost our row) are
    kept whole by the error feedback, on demand and whole alike, bit for bit: the residual there is the
    contribution (rounded once to the residual's dtype), elsewhere what the codec lost; the next round's
    contribution carries them. Without feedback (DiLoCo's default for a lossless codec) nothing is kept."""
    numel = 3_001
    codec = get_codec(codec_name, **({"block_size": 32} if codec_name == "int8" else {}))
    whole, on_demand, theta_w, theta_d, generator = two_alike(name, feedback, numel, codec, seed=5)
    for round_index in range(3):
        local = theta_w + torch.randn(numel, generator=generator) * 0.01
        contribution = whole.make_contribution(theta_w, local)
        n = contribution.numel()
        ranges = None if codec.lossless else ranges_of(n, [400, 1100, 2000])
        withheld = [(300, 700), (n - 50, n)] if round_index < 2 else [(0, n)]
        if ranges is None:
            transmitted = contribution
        else:
            transmitted = torch.cat([codec.encode_decoded(contribution[a:b])[1] for a, b in ranges])
        averaged = transmitted * 0.5 + 0.001
        kept = contribution.clone()
        whole.propose(contribution, transmitted, withheld=withheld)
        whole.apply(theta_w, averaged)
        whole.commit()
        on_demand.stage_in_place(theta_d, local, ranges, withheld)
        on_demand.apply(theta_d, averaged)
        on_demand.commit()
        assert torch.equal(theta_d, theta_w)
        for key, value in whole.state_dict().items():
            assert torch.equal(on_demand.state_dict()[key], value), (round_index, key)
        residual = whole.state_dict().get("residual")
        if residual is None:  # DiLoCo's default for a lossless codec: no feedback
            assert not feedback and codec.lossless
            continue
        offset = int(getattr(whole, "_staged_fragment", slice(0, n)).start) if name != "diloco" else 0
        lost = kept - transmitted
        for a, b in withheld:
            assert torch.equal(residual[offset + a : offset + b], kept[a:b].to(residual.dtype))
        if round_index < 2:  # the third round withheld it all
            assert torch.equal(residual[offset : offset + 300], lost[:300].to(residual.dtype))
            assert torch.equal(residual[offset + 700 : offset + 800], lost[700:800].to(residual.dtype))


def test_withheld_ranges_are_checked() -> None:
    strategy = make_strategy("diloco", 100, get_codec("int8"))
    theta, local = torch.zeros(100), torch.ones(100)
    for withheld in ([(50, 40)], [(0, 101)], [(10, 20), (15, 30)], [(5, 5)]):
        with pytest.raises(StrategyError, match=r"expected withheld ranges in order within \[0, 100\)"):
            strategy.stage_in_place(theta, local, [(0, 100)], withheld)
        with pytest.raises(StrategyError, match=r"expected withheld ranges in order"):
            strategy.propose(torch.ones(100), torch.ones(100), withheld=withheld)
    assert torch.equal(strategy.state_dict()["residual"], torch.zeros(100))  # nothing written


def test_stage_in_place_refuses_ranges_that_do_not_cover_the_contribution() -> None:
    strategy = make_strategy("diloco", 100, get_codec("int8"))
    theta, local = torch.zeros(100), torch.ones(100)
    for ranges in ([(0, 50)], [(0, 50), (60, 100)], [(0, 60), (50, 100)], []):
        with pytest.raises(StrategyError, match=r"expected ranges covering \[0, 100\) in order"):
            strategy.stage_in_place(theta, local, ranges)
    with pytest.raises(StrategyError, match=r"contribution_range: expected 0 <= a <= b <= 100, got 90, 101"):
        strategy.contribution_range(theta, local, 90, 101, torch.empty(11))
    assert torch.equal(strategy.state_dict()["residual"], torch.zeros(100))  # nothing written


@pytest.mark.skipif(not CAN_MEASURE, reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("name", ["diloco", "streaming-diloco"])
def test_a_bf16_residual_is_added_without_a_float32_copy_of_it(name: str) -> None:
    """torch converts an operand of another dtype whole before adding it: a whole-range contribution (a group of
    one's mean, the whole path) would hold a float32 copy of the residual beside it. It is added a chunk at a
    time instead."""
    numel = 8 << 20  # a float32 copy: 32 MiB
    hparams: dict[str, float | int | bool] = {"num_fragments": 1} if name == "streaming-diloco" else {}
    strategy = make_strategy(name, numel, get_codec("int8"), **hparams)
    theta, local, out = torch.ones(numel), torch.zeros(numel).fill_(0.0), torch.empty(numel).fill_(0.0)
    feedback = strategy.live_buffers()["residual"]
    feedback.fill_(0.5)
    assert feedback.dtype == torch.bfloat16
    grown = peak_growth_mib(lambda: strategy.contribution_range(theta, local, 0, numel, out))
    assert grown < 8, f"the peak grew {grown:.1f} MiB"
    assert torch.equal(out, torch.full((numel,), 1.5))
    grown = peak_growth_mib(lambda: strategy.make_contribution(theta, local, out))
    assert grown < 8, f"the peak grew {grown:.1f} MiB"
    assert torch.equal(out, torch.full((numel,), 1.5))
