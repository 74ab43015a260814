"""Config from the environment (FARLOCO__SECTION__KEY: file < environment < --set) and the config's JSON
Schema (`farloco config schema`)."""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing

import pytest
from click.testing import CliRunner

from farloco.node.config import (
    SECTIONS,
    Config,
    ConfigError,
    build_config,
    config_schema,
    environment_overrides,
    example_config,
)
from farloco.node.tools.cli import main


def test_the_environment_sits_between_the_file_and_set() -> None:
    data = {"run": {"inner_steps": 5, "outer_lr": 0.5}, "network": {"host": "127.0.0.1"}}
    environ = {
        "FARLOCO__RUN__INNER_STEPS": "7",
        "farloco__network__host": "::1",  # names in any case
        "FARLOCO__RUN__CODEC": "int8",  # a bare word: a string, as --set reads it
        "FARLOCO__RUN__STRATEGY_OPTIONS": "{beta = 0.5}",  # a TOML inline table
        "FARLOCO_CACHE": "/elsewhere",  # another prefix: not the config's
    }
    config = build_config(data, ["run.inner_steps=9"], environ)
    assert config.run.inner_steps == 9  # --set wins
    assert config.run.outer_lr == 0.5  # the file where nothing else says
    assert config.network.host == "::1" and config.run.codec == "int8"
    assert config.run.strategy_options == {"beta": 0.5}
    assert build_config(data, [], environ).run.inner_steps == 7
    assert build_config(data, []).run.inner_steps == 5  # no environ: the file alone


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("FARLOCO__RUN", "expected FARLOCO__SECTION__KEY"),
        ("FARLOCO__RUN__INNER__STEPS", "expected FARLOCO__SECTION__KEY"),
        ("FARLOCO__RUNS__INNER_STEPS", "unknown section 'runs'"),
        ("FARLOCO__RUN__INNER_STEPZ", r"unknown key run\.inner_stepz"),
    ],
)
def test_a_variable_that_names_no_key_is_an_error_naming_it(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        build_config({}, [], {name: "1"})
    assert name in str(error.value)


def test_a_bad_value_from_the_environment_reads_as_from_set() -> None:
    with pytest.raises(ConfigError) as from_env:
        build_config({}, [], {"FARLOCO__RUN__INNER_STEPS": "many"})
    with pytest.raises(ConfigError) as from_set:
        build_config({}, ["run.inner_steps=many"])
    assert str(from_env.value) == str(from_set.value) == "run.inner_steps: expected an integer, got 'many'"
    with pytest.raises(ConfigError, match=r"run\.outer_lr"):  # the dataclasses' own checks run too
        build_config({}, [], {"FARLOCO__RUN__OUTER_LR": "-1.0"})


def test_environment_overrides_lists_only_the_prefix() -> None:
    assert environment_overrides({"FARLOCO_FAULTS": "x", "PATH": "/bin"}) == []
    assert environment_overrides({"FARLOCO__NODE__NUM_RANKS": "2"}) == [
        ("FARLOCO__NODE__NUM_RANKS", "node", "num_ranks", 2)
    ]


def _matches(value: object, schema: dict[str, typing.Any]) -> bool:
    """Whether `value` has the schema's type (the subset config_schema uses)."""
    if "anyOf" in schema:
        return any(_matches(value, option) for option in schema["anyOf"])
    kind = schema["type"]
    checks = {
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "null": lambda v: v is None,
        "array": lambda v: isinstance(v, list) and all(_matches(i, schema["items"]) for i in v),
        "object": lambda v: isinstance(v, dict),
    }
    return checks[kind](value)


def test_the_schema_names_every_key_with_its_type_default_and_meaning() -> None:
    schema = config_schema()
    json.dumps(schema)  # serializable as printed
    assert schema["additionalProperties"] is False and set(schema["properties"]) == set(SECTIONS)
    defaults = Config()
    for name, cls in SECTIONS.items():
        section = schema["properties"][name]
        assert section["additionalProperties"] is False
        assert set(section["properties"]) == {f.name for f in dataclasses.fields(cls)}
        for key, entry in section["properties"].items():
            default = getattr(getattr(defaults, name), key)
            assert entry["default"] == default and _matches(default, entry), (name, key, entry)
            assert entry.get("description"), f"{name}.{key} has no description"
    assert schema["properties"]["run"]["properties"]["inner_steps"]["type"] == "integer"
    assert schema["properties"]["run"]["properties"]["outer_lr"]["type"] == "number"
    # Every value of the documented example has its key's type.
    example = tomllib.loads(example_config("tiny"))
    for name, values in example.items():
        for key, value in values.items():
            assert _matches(value, schema["properties"][name]["properties"][key]), (name, key, value)


def test_farloco_config_schema_prints_it() -> None:
    result = CliRunner().invoke(main, ["config", "schema"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == json.loads(json.dumps(config_schema()))
