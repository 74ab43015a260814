"""Config: TOML loading, --set overrides, validation messages, run_hash, documented examples."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from farloco.node.config import (
    PRESETS,
    ConfigError,
    build_config,
    diff_run,
    example_config,
    load_config,
    run_hash,
    run_section,
    to_toml,
)


def test_defaults_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        '[run]\ninner_steps = 7\nname = "exp"\n[network]\ninitial_peers = ["/ip4/127.0.0.1/tcp/1"]\n'
    )
    config = load_config(path, ["run.outer_lr=0.5", "run.codec=int8", 'node.device="cpu"'])
    assert config.run.inner_steps == 7
    assert config.run.outer_lr == 0.5
    assert config.run.codec == "int8"  # bare words fall back to strings
    assert config.node.device == "cpu"
    assert config.network.initial_peers == ["/ip4/127.0.0.1/tcp/1"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.inner_steps=0", "run.inner_steps: expected a positive number, got 0"),
        ("run.inner_steps=1.5", "run.inner_steps: expected an integer, got 1.5"),
        ("run.outer_lr=fast", "run.outer_lr: expected a number, got 'fast'"),
        ("run.outer_momentum=1.0", "run.outer_momentum: expected a number in [0, 1), got 1.0"),
        ("run.bogus=1", "unknown key run.bogus: expected one of"),
        ("nope.key=1", "unknown section 'nope'"),
        ("network.grpc_port=70000", "network.grpc_port: expected a port in 0..65535, got 70000"),
        ("network.streams_per_peer=0", "network.streams_per_peer: expected 1..16, got 0"),
        ("network.codec_threads=65", "network.codec_threads: expected 0..64, got 65"),
        ("network.codec_threads=-1", "network.codec_threads: expected 0..64, got -1"),
        ("network.socket_buffer_bytes=-2", "network.socket_buffer_bytes: expected -1, 0 or a size in bytes"),
        ("node.device=tpu", "node.device: expected one of 'auto', 'cpu', 'cuda', got 'tpu'"),
        ("node.agent_threads=-1", "node.agent_threads: expected a number >= 0, got -1"),
        ("node.data_slot=-2", "node.data_slot: expected -1 (any) or a slot >= 0, got -2"),
        ("node.data_slot=8", "node.data_slot=8: expected -1 (any) or a slot below run.data_slots=8"),
        ("run.name=a/b", "run.name: expected a non-empty name without '/'"),
        ("inner_steps", "expected section.key=value"),
        ("timeouts.heartbeat_interval=-1", "timeouts.heartbeat_interval: expected a number >= 0, got -1"),
        (
            "timeouts.heartbeat_interval=8",
            "timeouts.heartbeat_interval must be shorter than timeouts.member_ttl",
        ),
    ],
)
def test_bad_values_name_key_value_and_expectation(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_run_hash_covers_run_section_only() -> None:
    base = load_config(None)
    assert run_hash(base) == run_hash(load_config(None, ["network.grpc_port=1234", "node.num_ranks=2"]))
    changed = load_config(None, ["run.inner_steps=21"])
    assert run_hash(base) != run_hash(changed)
    assert run_hash(base) != run_hash(load_config(None, ["run.codec_options={block_size = 64}"]))
    diff = diff_run(run_section(base), run_section(changed))
    assert diff == ["run.inner_steps: 20 here, 21 there"]


def test_resolved_config_round_trips() -> None:
    config = load_config(None, ["run.codec_options={block_size = 64}", "run.inner_steps=3"])
    again = build_config(tomllib.loads(to_toml(config)))
    assert again == config


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_examples_are_documented_and_valid(preset: str) -> None:
    text = example_config(preset)
    parsed = build_config(tomllib.loads(text))
    assert parsed.run.model == PRESETS[preset]["run"]["model"]
    # every key carries its docstring as a comment line right above it
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if " = " in line and not line.startswith("#"):
            assert lines[index - 1].startswith("# "), f"undocumented key: {line}"
    with pytest.raises(ConfigError, match="unknown preset"):
        example_config("huge")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.codec=int9", "run.codec / run.codec_options: codec name: expected one of"),
        ("run.codec_options={bogus = 1}", "expected a subset of ['block_size'], got ['bogus']"),
        (
            "run.strategy=adam",
            "run.strategy: expected one of ['diloco', 'streaming-diloco', 'demo', 'sparseloco']",
        ),
        ("run.strategy=demo", "takes exactly 1 inner step per round"),
        ("run.strategy_options={nonsense = 2}", "run.strategy / run.strategy_options"),
    ],
)
def test_outer_names_and_options_are_config_errors(override: str, message: str) -> None:
    from farloco.node.daemon.agent import build_outer

    config = load_config(None, ["run.codec=int8", override] if "codec_options" in override else [override])
    with pytest.raises(ConfigError) as info:
        build_outer(config, num_params=4096)
    assert message in str(info.value)


def test_config_get_prints_one_resolved_value_for_scripts(tmp_path: Path) -> None:
    """What deploy/slurm/farloco.sbatch reads its leave margin with; defaults are filled in."""
    from click.testing import CliRunner

    from farloco.node.tools.cli import main

    path = tmp_path / "node.toml"
    path.write_text('[run]\nname = "x"\n[timeouts]\nleave_timeout = 12.5\n')
    runner = CliRunner()
    assert runner.invoke(main, ["config", "get", str(path), "timeouts.leave_timeout"]).output == "12.5\n"
    assert runner.invoke(main, ["config", "get", str(path), "run.name"]).output == "x\n"
    assert runner.invoke(main, ["config", "get", str(path), "timeouts.member_ttl"]).output == "8.0\n"
    wrong = runner.invoke(main, ["config", "get", str(path), "timeouts.nope"])
    assert (
        wrong.exit_code != 0 and "expected a key of [timeouts]" in wrong.output and "'nope'" in wrong.output
    )
    wrong = runner.invoke(main, ["config", "get", str(path), "nope"])
    assert wrong.exit_code != 0 and "SECTION.KEY" in wrong.output


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.island_slices=1"], "run.island_slices: expected 0 (no islands) or 2..4096, got 1"),
        (['node.island="a"'], "node.island_endpoint: expected host:port of the island's rendezvous"),
        (['node.island="a b"', 'node.island_endpoint="h:1"'], "node.island: expected 1-64 letters"),
        (
            ['node.island="a"', 'node.island_endpoint="h:1"'],
            "node.island='a': this run has no islands (run.island_slices = 0)",
        ),
        (
            ['node.island="a"', 'node.island_endpoint="h:1"', "run.island_slices=4", 'run.codec="topk"'],
            "expected a dense codec",
        ),
        (
            ['node.island="a"', 'node.island_endpoint="h:1"', "run.island_slices=4", "node.island_size=5"],
            "node.island_size=5: expected at most run.island_slices=4",
        ),
        (['node.island_backend="mpi"'], "node.island_backend: expected 'gloo' or 'nccl', got 'mpi'"),
        (['node.island_backend="nccl"', 'node.device="cpu"'], "expected a GPU node, got node.device='cpu'"),
    ],
)
def test_island_settings_are_checked(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_an_island_node_config_loads() -> None:
    config = load_config(
        None, ['node.island="rack-7"', 'node.island_endpoint="10.0.0.1:31339"', "run.island_slices=16"]
    )
    assert (config.node.island, config.node.island_endpoint, config.run.island_slices) == (
        "rack-7",
        "10.0.0.1:31339",
        16,
    )


def test_the_agent_takes_the_cores_its_ranks_leave_unless_told() -> None:
    import os

    from farloco.node.daemon.core import agent_threads

    cores = len(os.sched_getaffinity(0))
    assert agent_threads(load_config(None, ["node.agent_threads=7"])) == 7
    cpu = load_config(None, ["node.device=cpu", "node.num_ranks=1", "node.threads_per_rank=1"])
    assert agent_threads(cpu) == max(1, cores - 1)
    assert (
        agent_threads(load_config(None, ["node.device=cpu", "node.threads_per_rank=64"])) == 1
    )  # at least 1
    gpu = load_config(None, ["node.device=cuda", "node.num_ranks=1", "node.threads_per_rank=8"])
    assert agent_threads(gpu) == max(
        1, cores - 1
    )  # a GPU rank takes one core, whatever threads_per_rank says


def test_the_heartbeat_follows_the_member_ttl_unless_set() -> None:
    """A quarter of member_ttl by default (four stores before a record expires, whatever the ttl); a value set
    is kept."""
    assert load_config(None).timeouts.heartbeat == 2.0
    assert load_config(None, ["timeouts.member_ttl=30"]).timeouts.heartbeat == 7.5
    assert load_config(None, ["timeouts.heartbeat_interval=0.5"]).timeouts.heartbeat == 0.5
