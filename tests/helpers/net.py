"""Network helpers for tests on 127.0.0.1."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now (another process may take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
