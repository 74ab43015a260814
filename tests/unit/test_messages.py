"""The field checks every wire message's decoder is built on (farloco.protocol.messages)."""

from __future__ import annotations

import math

import pytest

from farloco.protocol.messages import (
    Fields,
    WireError,
    check_float,
    check_hex,
    check_int,
    check_list,
    check_scalar_map,
    check_str,
)


def test_a_wire_error_names_the_field_what_was_expected_and_what_came() -> None:
    with pytest.raises(WireError) as error:
        Fields({"round_id": -1}, "ready record", ("round_id",)).integer("round_id")
    assert str(error.value) == "ready record.round_id: expected an int >= 0, got -1"
    assert (error.value.field, error.value.expected, error.value.got) == (
        "ready record.round_id",
        "an int >= 0",
        -1,
    )
    assert isinstance(error.value, ValueError)  # callers that refuse bad records with ValueError keep working


def test_fields_want_exactly_the_key_set() -> None:
    assert Fields({"a": 1, "b": 2}, "m", ("a", "b")).integer("b") == 2
    assert Fields({"a": 1}, "m", ("a",), optional=("b",)).data == {"a": 1}
    with pytest.raises(
        WireError, match=r"m: expected fields \['a', 'b'\], got missing \['b'\], unexpected \[\]"
    ):
        Fields({"a": 1}, "m", ("a", "b"))
    with pytest.raises(WireError, match=r"unexpected \['c'\]"):
        Fields({"a": 1, "c": 2}, "m", ("a",))
    for data in (None, [("a", 1)], "a"):
        with pytest.raises(WireError, match="m: expected a map"):
            Fields(data, "m", ("a",))
    assert Fields.loose({"x": 1, "y": "z"}, "h").text("y") == "z"


def test_numbers_are_never_coerced() -> None:
    assert check_int(0, "n") == 0 and check_int(-1, "n", low=-1) == -1 and check_int(5, "n", high=5) == 5
    for bad in (True, False, 1.0, "1", None, -1):
        with pytest.raises(WireError, match="n: expected an int >= 0"):
            check_int(bad, "n")
    with pytest.raises(WireError, match=r"expected an int in \[0, 5\], got 6"):
        check_int(6, "n", high=5)
    assert check_float(1.5, "x") == 1.5 and math.isnan(check_float(math.nan, "x"))
    for bad in (1, True, "1.0", None):
        with pytest.raises(WireError, match="x: expected a float"):
            check_float(bad, "x")
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(WireError, match="expected a finite float"):
            check_float(bad, "x", finite=True)
    for bad in (-0.5, 11.0, math.nan):
        with pytest.raises(WireError, match=r"expected a float in \[0, 10\]"):
            check_float(bad, "x", low=0.0, high=10.0)


def test_strings_hashes_lists_and_maps() -> None:
    assert check_str("", "s") == "" and check_str("a" * 256, "s") == "a" * 256
    for bad in ("a" * 257, b"a", 1, None):
        with pytest.raises(WireError, match="s: expected a str of at most 256 chars"):
            check_str(bad, "s")
    with pytest.raises(WireError, match="expected a str of 1 to 128 chars"):
        check_str("", "s", min_len=1, max_len=128)
    assert check_hex("", "h") == "" and check_hex("ab" * 32, "h", exact=64) == "ab" * 32
    for bad in ("AB", "xyz", "a" * 129, 5):
        with pytest.raises(WireError, match="h: expected a lowercase hex str of at most 128 chars"):
            check_hex(bad, "h")
    with pytest.raises(WireError, match="expected a lowercase hex str of 64 chars"):
        check_hex("ab", "h", exact=64)
    assert check_list(["a", "b"], "l", check_str, max_len=2) == ["a", "b"]
    with pytest.raises(WireError, match=r"l\[1\]: expected a str"):
        check_list(["a", 1], "l", check_str, max_len=2)
    for bad in (("a",), ["a"] * 3, "ab"):
        with pytest.raises(WireError, match="l: expected a list of 0 to 2 items"):
            check_list(bad, "l", check_str, max_len=2)
    config = {"s": "x", "i": 1, "f": 1.5, "b": True}
    assert check_scalar_map(config, "c", max_keys=4) == config
    for bad in ({"k": None}, {"k": [1]}, {"k": b"x"}, {1: 1}, {"k": "v" * 257}, {"a": 1, "b": 2}, [("k", 1)]):
        with pytest.raises(WireError, match=r"^c"):
            check_scalar_map(bad, "c", max_keys=1)
