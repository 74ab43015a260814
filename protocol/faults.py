"""Faults on purpose: wrappers that make a real component misbehave, for tests and manual chaos.

`FlakyDHT` wraps a real `hivemind.DHT` and refuses or never answers some of its calls; everything it does not
refuse goes to the real DHT. The agent installs it when `FARLOCO_FAULTS` asks for it (see
`farloco.node.daemon.agent`), so a real node can be made to meet a DHT that refuses its stores for a while:

- `dht-refuse-stores=N`: the next N stores are refused (the answer hivemind gives when no replica took them);
- `dht-refuse-stores-for=S`: every store is refused during the first S seconds;
- `dht-silent-after=S`: after S seconds, no store and no get ever answers (a DHT process that hangs).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any


def _answered(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future


class FlakyDHT:
    """A real DHT whose stores are refused N times / for S seconds, or whose calls stop answering after S."""

    def __init__(
        self,
        dht: Any,
        *,
        refuse_stores: int = 0,
        refuse_stores_for: float = 0.0,
        silent_after: float | None = None,
    ) -> None:
        self._dht = dht
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.refuse_stores = refuse_stores
        self.refuse_stores_for = refuse_stores_for
        self.silent_after = silent_after
        self.refused = 0  # stores refused so far
        self.stores = 0  # stores asked for so far

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dht, name)

    def _silent(self) -> bool:
        return self.silent_after is not None and time.monotonic() - self._started >= self.silent_after

    def store(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
        with self._lock:
            self.stores += 1
            if self._silent():
                refused: Any = None  # never answers
            elif self.refuse_stores > 0 or time.monotonic() - self._started < self.refuse_stores_for:
                self.refuse_stores = max(0, self.refuse_stores - 1)
                self.refused += 1
                refused = False
            else:
                return self._dht.store(*args, return_future=return_future, **kwargs)
        if refused is None:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            return future if return_future else future.result()
        return _answered(False) if return_future else False

    def get(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
        if self._silent():
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            return future if return_future else future.result()
        return self._dht.get(*args, return_future=return_future, **kwargs)


def parse_dht_faults(spec: str) -> dict[str, Any]:
    """FlakyDHT keyword arguments from a FARLOCO_FAULTS value ('' when none asks for a flaky DHT).

    ValueError naming the entry for a malformed dht-* entry; entries of other kinds are left to their readers.
    """
    options: dict[str, Any] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        kind, sep, value = entry.partition("=")
        if not kind.startswith("dht-"):
            continue
        try:
            if kind == "dht-refuse-stores" and sep:
                options["refuse_stores"] = int(value)
            elif kind == "dht-refuse-stores-for" and sep:
                options["refuse_stores_for"] = float(value)
            elif kind == "dht-silent-after" and sep:
                options["silent_after"] = float(value)
            else:
                raise ValueError(kind)
        except ValueError:
            raise ValueError(
                f"FARLOCO_FAULTS entry {entry!r}: expected dht-refuse-stores=N, dht-refuse-stores-for=SECONDS "
                "or dht-silent-after=SECONDS"
            ) from None
    return options
