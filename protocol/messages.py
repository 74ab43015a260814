"""Field checks for every typed message on farloco's wire, with one error type.

Each message class (exchange frame headers, ready and group records and the matchmaking link messages, member
records and departures, state-sync manifests and requests) is a frozen dataclass with `encode()` or `to_wire()`
and one classmethod decoder. The decoder reads the raw msgpack value through `Fields(data, where)` (or the
`check_*` functions, for items of lists) and returns the message, or raises `WireError` naming the field, what
was expected and what came ("ready record.round_id: expected an int >= 0, got -1").

The checks never coerce: an int field refuses a bool and a float, a float field refuses an int, a str field
refuses bytes. `WireError` is a ValueError, so a module that refuses bad records with ValueError keeps doing
so; the exchange turns it into a `Reject` with its own reason code at each decoder (`farloco.protocol.exchange.
wire`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

_HEX = frozenset("0123456789abcdef")
Scalar = str | int | float | bool


class WireError(ValueError):
    """A message field that is not what the protocol says: `field` (with where it was found), `expected`, `got`."""

    def __init__(self, field: str, expected: str, got: object, *, shown: str | None = None) -> None:
        super().__init__(f"{field}: expected {expected}, got {_show(got) if shown is None else shown}")
        self.field = field
        self.expected = expected
        self.got = got


def _show(value: object) -> str:
    return f"{value!r:.120}"


def check_str(value: object, where: str, *, min_len: int = 0, max_len: int = 256) -> str:
    """A str of `min_len` to `max_len` characters."""
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        size = f"at most {max_len}" if min_len == 0 else f"{min_len} to {max_len}"
        raise WireError(where, f"a str of {size} chars", value)
    return value


def check_choice(value: object, where: str, choices: Collection[str]) -> str:
    """One of the str `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise WireError(where, f"one of {tuple(choices)}", value)
    return value


def check_int(value: object, where: str, *, low: int = 0, high: int | None = None) -> int:
    """An int (not a bool) in [low, high] (no upper bound when `high` is None)."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise WireError(where, f"an int {bound}", value)
    return value


def check_float(
    value: object, where: str, *, finite: bool = False, low: float | None = None, high: float | None = None
) -> float:
    """A float (not an int); finite when `finite`; in [low, high] where those are given (NaN is then refused)."""
    if (
        not isinstance(value, float)
        or (finite and not math.isfinite(value))
        or (low is not None and not value >= low)
        or (high is not None and not value <= high)
    ):
        what = "a finite float" if finite else "a float"
        if low is not None or high is not None:
            what += f" in [{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}]"
        raise WireError(where, what, value)
    return value


def check_bool(value: object, where: str) -> bool:
    """A bool."""
    if not isinstance(value, bool):
        raise WireError(where, "a bool", value)
    return value


def check_hex(value: object, where: str, *, max_len: int = 128, exact: int | None = None) -> str:
    """Lowercase hex of at most `max_len` chars ("" allowed), or of exactly `exact` chars."""
    if (
        not isinstance(value, str)
        or not (len(value) == exact if exact is not None else len(value) <= max_len)
        or not all(c in _HEX for c in value)
    ):
        size = f"{exact}" if exact is not None else f"at most {max_len}"
        raise WireError(where, f"a lowercase hex str of {size} chars", value)
    return value


def check_list(
    value: object, where: str, item: Callable[[object, str], T], *, min_len: int = 0, max_len: int
) -> list[T]:
    """A list of `min_len` to `max_len` items, each checked by `item(value, where[i])`."""
    if not isinstance(value, list) or not min_len <= len(value) <= max_len:
        raise WireError(where, f"a list of {min_len} to {max_len} items", value)
    return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]


def check_scalar(value: object, where: str, *, max_len: int = 256) -> Scalar:
    """A str (at most `max_len` chars), int, float or bool."""
    if isinstance(value, str):
        return check_str(value, where, max_len=max_len)
    if not isinstance(value, int | float):  # bool is an int
        raise WireError(where, "a str, int, float or bool", value)
    return value


def check_scalar_map(value: object, where: str, *, max_keys: int, max_len: int = 256) -> dict[str, Scalar]:
    """A map of at most `max_keys` str keys (at most `max_len` chars) to scalars (`check_scalar`)."""
    if not isinstance(value, dict) or len(value) > max_keys:
        raise WireError(where, f"a map of at most {max_keys} keys", value)
    return {
        check_str(k, f"{where} key", max_len=max_len): check_scalar(v, f"{where}[{k!r}]", max_len=max_len)
        for k, v in value.items()
    }


class Fields:
    """A raw message being decoded: a map that must have exactly `keys` (plus any of `optional`), read field by
    field with the checks above; every error names `where.field`."""

    def __init__(
        self, data: object, where: str, keys: Collection[str], *, optional: Collection[str] = ()
    ) -> None:
        self.where = where
        if not isinstance(data, dict):
            raise WireError(where, f"a map with fields {sorted(keys)}" if keys else "a map", data)
        present = set(data)
        missing, unexpected = set(keys) - present, present - set(keys) - set(optional)
        if missing or unexpected:
            raise WireError(
                where,
                f"fields {sorted(keys)}" + (f" (optional {sorted(optional)})" if optional else ""),
                sorted(map(str, present)),
                shown=f"missing {sorted(missing)}, unexpected {sorted(map(str, unexpected))}",
            )
        self.data: Mapping[str, Any] = data

    @classmethod
    def loose(cls, data: object, where: str) -> Fields:
        """A map whose fields are read one by one, with no fixed key set (frame headers of a stream)."""
        return cls(data, where, (), optional=data if isinstance(data, dict) else ())

    def at(self, name: str) -> str:
        return f"{self.where}.{name}"

    def raw(self, name: str, default: object = None) -> object:
        return self.data.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.data

    def text(self, name: str, *, min_len: int = 0, max_len: int = 256, default: str | None = None) -> str:
        """A str field; `default` stands in for an absent one (None: the field is required)."""
        if default is not None and name not in self.data:
            return default
        return check_str(self.data.get(name), self.at(name), min_len=min_len, max_len=max_len)

    def choice(self, name: str, choices: Collection[str]) -> str:
        return check_choice(self.data.get(name), self.at(name), choices)

    def integer(self, name: str, *, low: int = 0, high: int | None = None, default: int | None = None) -> int:
        """An int field; `default` stands in for an absent one (None: the field is required)."""
        if default is not None and name not in self.data:
            return default
        return check_int(self.data.get(name), self.at(name), low=low, high=high)

    def real(
        self, name: str, *, finite: bool = False, low: float | None = None, high: float | None = None
    ) -> float:
        return check_float(self.data.get(name), self.at(name), finite=finite, low=low, high=high)

    def flag(self, name: str, *, default: bool | None = None) -> bool:
        """A bool field; `default` stands in for an absent one (None: the field is required)."""
        if default is not None and name not in self.data:
            return default
        return check_bool(self.data.get(name), self.at(name))

    def hex(self, name: str, *, max_len: int = 128, exact: int | None = None) -> str:
        return check_hex(self.data.get(name), self.at(name), max_len=max_len, exact=exact)

    def items(
        self, name: str, item: Callable[[object, str], T], *, min_len: int = 0, max_len: int
    ) -> list[T]:
        return check_list(self.data.get(name), self.at(name), item, min_len=min_len, max_len=max_len)

    def scalars(self, name: str, *, max_keys: int, max_len: int = 256) -> dict[str, Scalar]:
        return check_scalar_map(self.data.get(name), self.at(name), max_keys=max_keys, max_len=max_len)
