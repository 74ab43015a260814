"""Starting a hivemind DHT node that never outlives the process that started it."""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Any


def _set_parent_death_signal(sig: signal.Signals) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)


def make_dht(**kwargs: Any) -> Any:
    """A started hivemind.DHT whose forked child dies with its parent: a SIGKILLed agent or bootstrap must not
    leave its DHT node (and the port it holds) behind, or it could not be restarted on the same address."""
    import hivemind

    class _DHT(hivemind.DHT):  # type: ignore[misc]
        def run(self) -> None:
            _set_parent_death_signal(signal.SIGKILL)
            super().run()

    # hivemind waits 3 s for a peer's answer; on a loaded machine a store then fails for want of replies, so
    # give DHT requests more room (a dead peer still costs at most this long per request).
    kwargs.setdefault("wait_timeout", 8.0)
    return _DHT(**kwargs)
