"""Every outer strategy in the daemon, in this process: the config rules (tau, demo's single inner step, the
demo's defaults, run.outer_update) and the fragment schedule travelling with the strategy state, so a joiner or
a resumed node syncs the fragment everyone does. tests/integration/test_strategies_swarm.py runs them in swarms.
"""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from farloco.node.checkpoint import checkpoint_name, checkpoints_dir, load_checkpoint, save_checkpoint
from farloco.node.config import Config, ConfigError, build_config, load_config
from farloco.node.daemon.agent import Agent, build_outer, overlap_steps, theta_hash
from farloco.node.tools.demo import (
    demo_config,
    demo_rounds,
)


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    # Building an Agent sizes the process's torch thread pool for a node; give the test process its own back.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def config_of(*overrides: str) -> Config:
    return load_config(None, list(overrides))


# ---- config rules ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["diloco", "streaming-diloco", "demo", "sparseloco"])
def test_the_daemon_builds_every_strategy(strategy: str) -> None:
    steps = "run.inner_steps=1" if strategy == "demo" else "run.inner_steps=20"
    _codec, built = build_outer(config_of(f'run.strategy="{strategy}"', steps), num_params=4096)
    assert built.name == strategy


def test_demo_takes_exactly_one_inner_step_per_round() -> None:
    with pytest.raises(ConfigError) as info:
        build_outer(config_of('run.strategy="demo"', "run.inner_steps=20"), num_params=4096)
    assert "run.strategy='demo'" in str(info.value)
    assert "run.inner_steps=20" in str(info.value)


@pytest.mark.parametrize("tau", ["8", "-1", "1.5", "true"])
def test_streaming_tau_must_be_an_int_below_inner_steps(tau: str) -> None:
    config = config_of(
        'run.strategy="streaming-diloco"', "run.inner_steps=8", f"run.strategy_options={{tau = {tau}}}"
    )
    with pytest.raises(ConfigError) as info:
        build_outer(config, num_params=4096)
    message = str(info.value)
    assert "run.strategy_options.tau" in message and "run.inner_steps=8" in message, message


def test_streaming_options_reach_the_strategy_and_tau_the_round_loop() -> None:
    config = config_of(
        'run.strategy="streaming-diloco"',
        "run.inner_steps=8",
        "run.strategy_options={num_fragments = 3, alpha = 0.25, tau = 3}",
    )
    _codec, strategy = build_outer(config, num_params=4096)
    assert overlap_steps(config) == 3
    assert strategy.hparams["num_fragments"] == 3 and strategy.hparams["alpha"] == 0.25
    assert "tau" not in strategy.hparams
    assert strategy.hparams["lr"] == config.run.outer_lr  # the [run] outer lr, as for diloco
    default = config_of('run.strategy="streaming-diloco"', "run.inner_steps=8")
    assert overlap_steps(default) == 1
    assert overlap_steps(config_of("run.strategy_options={tau = 3}")) == 0  # only streaming overlaps...
    with pytest.raises(ConfigError) as info:
        build_outer(config_of("run.strategy_options={tau = 3}"), num_params=4096)  # ...others refuse tau
    assert "run.strategy / run.strategy_options" in str(info.value) and "'tau'" in str(info.value)


def test_demo_command_picks_the_strategys_defaults_unless_given() -> None:
    def run_of(overrides: list[str]) -> Any:
        return build_config(tomllib.loads(demo_config(5, overrides))).run

    demo = run_of(['run.strategy="demo"'])
    assert (demo.codec, demo.inner_steps, demo.max_rounds) == ("dct-topk", 1, 5)
    assert run_of(['run.strategy="demo"', 'run.codec="topk"']).codec == "topk"
    assert run_of(["run.strategy=streaming-diloco"]).codec == "fp32"
    assert demo_rounds(['run.strategy="demo"']) == 30
    assert demo_rounds(['run.strategy="streaming-diloco"']) == 6


# ---- the fragment schedule travels with the state ------------------------------------------------------------
def committed_rounds(agent: Agent, num_rounds: int) -> None:
    """Drive `num_rounds` solo rounds through the strategy as `RoundRunner._round` does (no network needed)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(num_rounds):
        theta_local = agent.outer.theta + 1e-3 * torch.randn(agent.outer.theta.shape, generator=generator)
        contribution = agent.outer.contribution(theta_local)
        transmitted, mean = agent.outer.round.alone(contribution)  # a group of one, as `_average` makes it
        agent.outer.outer_hash = agent.outer.round.commit(contribution, transmitted, mean)
        agent.outer.round_id += 1
    assert agent.outer.outer_hash == theta_hash(agent.outer.theta)


def test_joiner_and_resumed_node_sync_the_same_fragment(tmp_path: Path) -> None:
    config = config_of(
        'run.strategy="streaming-diloco"', 'run.codec="int8"', "run.strategy_options={num_fragments = 3}"
    )
    donor = Agent(config, tmp_path / "donor")
    committed_rounds(donor, 5)
    expected = donor.outer.strategy.current_fragment()
    assert expected == donor.outer.strategy.fragments[5 % 3]

    # a joiner installs what a donor serves over state sync
    joiner = Agent(config, tmp_path / "joiner")
    assert joiner.outer.strategy.current_fragment() == joiner.outer.strategy.fragments[0]
    meta, tensors = asyncio.run(donor.outer.snapshot())
    asyncio.run(joiner.outer.install(meta, tensors))
    assert joiner.outer.strategy.current_fragment() == expected
    assert joiner.outer.outer_hash == donor.outer.outer_hash
    assert torch.equal(joiner.outer.strategy.residual, donor.outer.strategy.residual)

    # a node restarted on its run directory resumes the same schedule from its checkpoint
    resumed_dir = tmp_path / "resumed"
    root = checkpoints_dir(resumed_dir)
    save_checkpoint(
        root, donor.outer.round_id, tensors, {"run_hash": donor.state.run_hash, "inner_step": "0"}
    )
    assert load_checkpoint(root / checkpoint_name(donor.outer.round_id))[0]["round_id"] == str(
        donor.outer.round_id
    )
    resumed = Agent(config, resumed_dir)
    asyncio.run(resumed.checkpoints.resume())
    assert resumed.outer.round_id == 5
    assert resumed.outer.strategy.current_fragment() == expected
    assert torch.equal(resumed.outer.theta, donor.outer.theta)


def test_outer_update_is_checked_at_config_load() -> None:
    for bad, expected in (
        (['run.outer_update="later"'], "run.outer_update: expected one of"),
        (['run.outer_update="delayed"', 'run.strategy="streaming-diloco"'], "expected strategy diloco or"),
        (['run.outer_update="eager"', 'run.strategy="demo"', "run.inner_steps=1"], "got strategy 'demo'"),
    ):
        with pytest.raises(ConfigError) as info:
            config_of(*bad)
        assert expected in str(info.value), info.value
