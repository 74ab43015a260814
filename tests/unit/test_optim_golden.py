"""Golden fixtures pinning the codec wire format and a few rounds of every outer strategy.

The fixtures live in tests/fixtures/optim/*.safetensors (inputs stored with the outputs, so an RNG change cannot
move them). Decoding the stored payloads must give the stored tensors bit for bit on every machine: that is the
cross-machine determinism the swarm relies on. A deliberate change of format or math regenerates them with
`FARLOCO_REGEN_GOLDEN=1 .venv/bin/pytest tests/test_optim_golden.py` — and a wire change bumps FORMAT_VERSION.
"""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch
from helpers import FIXTURES

from farloco.optim import get_codec, make_strategy, mean_of
from farloco.optim.wire import FORMAT_VERSION

GOLDEN = FIXTURES / "optim"
REGENERATE = os.environ.get("FARLOCO_REGEN_GOLDEN") == "1"

CODEC_CASES: dict[str, tuple[str, dict[str, int]]] = {
    "fp32": ("fp32", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "int8": ("int8", {"block_size": 64}),
    "int4": ("int4", {"block_size": 32}),
    "topk16": ("topk", {"k": 16, "chunk": 256, "value_bits": 16}),
    "topk2": ("topk", {"k": 16, "chunk": 256, "value_bits": 2}),
    "dct-topk": ("dct-topk", {"k": 8, "chunk": 64}),
}
# The dct-topk encoder runs a float32 matmul whose rounding may differ between BLAS builds; its decoder is exact.
ENCODER_EXACT = {case for case in CODEC_CASES if case != "dct-topk"}

# case -> (strategy, codec, codec options, hyper-parameters); `-feedback-fp32`: the error-feedback residual in
# float32 instead of the default bfloat16.
STRATEGY_CASES: dict[str, tuple[str, str, dict[str, int], dict[str, float | int | bool]]] = {
    "diloco": ("diloco", "int8", {"block_size": 64}, {}),
    "diloco-feedback-fp32": ("diloco", "int8", {"block_size": 64}, {"feedback_bf16": False}),
    "sparseloco": ("sparseloco", "topk", {"k": 16, "chunk": 256, "value_bits": 2}, {}),
    "streaming-diloco": ("streaming-diloco", "int4", {"block_size": 32}, {"num_fragments": 3}),
    "streaming-diloco-feedback-fp32": (
        "streaming-diloco",
        "int4",
        {"block_size": 32},
        {"num_fragments": 3, "feedback_bf16": False},
    ),
    "demo": ("demo", "dct-topk", {"k": 8, "chunk": 64}, {"lr": 0.01, "beta": 0.9}),
}
NUM_PARAMS = 1001  # ragged against every block and chunk size above
NUM_PEERS = 3
NUM_ROUNDS = 4


def codec_input() -> torch.Tensor:
    generator = torch.Generator().manual_seed(2024)
    x = torch.randn(NUM_PARAMS, generator=generator)
    x[::97] *= 50.0  # a few outliers per block, as real pseudo-gradients have
    x[500:520] = 0.0
    return x


def load_or_write(
    name: str, produce: dict[str, torch.Tensor], metadata: dict[str, str]
) -> dict[str, torch.Tensor]:
    path = GOLDEN / f"{name}.safetensors"
    if REGENERATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file(produce, str(path), metadata=metadata)
    if not path.exists():
        pytest.fail(f"missing golden fixture {path}; generate it with FARLOCO_REGEN_GOLDEN=1")
    return safetensors.torch.load_file(str(path))


@pytest.mark.parametrize("case", sorted(CODEC_CASES))
def test_codec_golden(case: str) -> None:
    name, options = CODEC_CASES[case]
    codec = get_codec(name, **options)
    x = codec_input()
    payload = codec.encode(x)
    produced = {
        "input": x,
        "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8),
        "decoded": codec.decode(payload),
    }
    meta = {"codec": name, "options": repr(sorted(options.items())), "format_version": str(FORMAT_VERSION)}
    golden = load_or_write(f"codec_{case}", produced, meta)
    stored_payload = golden["payload"].numpy().tobytes()
    # The promise to every peer: these bytes decode to these bits, here and on any other machine.
    decoded = codec.decode(stored_payload)
    assert decoded.view(torch.int32).tolist() == golden["decoded"].view(torch.int32).tolist()
    if case in ENCODER_EXACT:
        assert codec.encode(golden["input"]) == stored_payload
    else:
        torch.testing.assert_close(
            codec.decode(codec.encode(golden["input"])), golden["decoded"], rtol=0, atol=1e-4
        )


def run_strategy(case: str, theta0: torch.Tensor, drifts: torch.Tensor) -> dict[str, torch.Tensor]:
    """NUM_PEERS peers, NUM_ROUNDS committed rounds; returns theta after every round and the final state."""
    strategy_name, codec_name, options, hparams = STRATEGY_CASES[case]
    codec = get_codec(codec_name, **options)
    peers = [make_strategy(strategy_name, NUM_PARAMS, codec, **hparams) for _ in range(NUM_PEERS)]
    theta = theta0.clone()
    locals_ = [theta0.clone() for _ in range(NUM_PEERS)]
    out: dict[str, torch.Tensor] = {}
    for round_index in range(NUM_ROUNDS):
        thetas = [theta.clone() for _ in range(NUM_PEERS)]
        contributions = []
        for peer, strategy in enumerate(peers):
            locals_[peer].sub_(drifts[round_index, peer])
            contributions.append(strategy.make_contribution(thetas[peer], locals_[peer]))
        transmitted = [codec.decode(codec.encode(c)) for c in contributions]
        averaged = mean_of(transmitted)
        for peer, strategy in enumerate(peers):
            strategy.propose(contributions[peer], transmitted[peer])
            strategy.apply(thetas[peer], averaged)
            strategy.commit()
            strategy.merge_into_local(thetas[peer], locals_[peer])
        assert all(torch.equal(t, thetas[0]) for t in thetas)
        theta = thetas[0]
        out[f"theta.{round_index}"] = theta.clone()
        out[f"contribution.{round_index}"] = contributions[0]
    for key, tensor in peers[0].state_dict().items():
        out[f"state.{key}"] = tensor
    return out


@pytest.mark.parametrize("case", sorted(STRATEGY_CASES))
def test_strategy_golden(case: str) -> None:
    generator = torch.Generator().manual_seed(99)
    theta0 = torch.randn(NUM_PARAMS, generator=generator)
    drifts = 0.01 * torch.randn(NUM_ROUNDS, NUM_PEERS, NUM_PARAMS, generator=generator)
    produced = {"theta0": theta0, "drifts": drifts, **run_strategy(case, theta0, drifts)}
    strategy_name, codec_name, options, hparams = STRATEGY_CASES[case]
    meta = {
        "strategy": strategy_name,
        "codec": codec_name,
        "options": repr(sorted(options.items())),
        "hparams": repr(sorted(hparams.items())),
    }
    golden = load_or_write(f"strategy_{case}", produced, meta)
    replayed = run_strategy(case, golden["theta0"], golden["drifts"])
    assert set(replayed) == set(golden) - {"theta0", "drifts"}
    for key, tensor in replayed.items():
        if case == "demo":
            torch.testing.assert_close(
                tensor, golden[key], rtol=0, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
            )
        else:
            assert torch.equal(tensor, golden[key]), key
