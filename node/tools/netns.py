"""A simulated WAN on one Linux machine: N network namespaces, one per "host", joined by a bridge.

Each host i gets its own namespace (`{prefix}{i}`) with one veth uplink and the address 10.{net}.0.i/24; the
uplinks meet on a bridge in a namespace of its own (`{prefix}br`), and both directions of every uplink are shaped
with `tc tbf` to `rate` (no netem in the kernels this project runs on, so delay and loss need a userspace relay).
The root namespace is never touched. Processes run inside host i through `prefix_command(i)` (`ip netns exec`).

Needs root and iproute2; `unavailable()` says why not, so tests can skip with a reason. Every namespace made is
removed by `down()` (and on leaving the context manager), also when `up()` fails half-way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from types import TracebackType


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip() or result.stdout.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"flprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
        _ip("netns", "del", probe)
    return None


class NamespaceWAN:
    """`hosts` namespaces on a shaped bridge (see the module docstring). Use as a context manager."""

    def __init__(
        self, hosts: int, rate: str = "100mbit", *, prefix: str | None = None, net: int = 77
    ) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be in 1..250, got {hosts}")
        if not 0 <= net <= 255:
            raise ValueError(f"net must be in 0..255, got {net}")
        # Short and unique per process: interface names are limited to 15 characters.
        self.prefix = prefix if prefix is not None else f"fl{os.getpid() % 100000}h"
        if len(self.prefix) > 9:
            raise ValueError(f"prefix must be at most 9 characters (interface names), got {self.prefix!r}")
        self.hosts, self.rate, self.net = hosts, rate, net
        self.made: list[str] = []

    def namespace(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def address(self, i: int) -> str:
        return f"10.{self.net}.0.{i}"

    def prefix_command(self, i: int) -> Sequence[str]:
        """Run a command inside host i: `[*prefix_command(i), *command]` (it execs, so the pid is the command's)."""
        return ("ip", "netns", "exec", self.namespace(i))

    def up(self) -> NamespaceWAN:
        bridge = f"{self.prefix}br"
        try:
            _ip("netns", "add", bridge)
            self.made.append(bridge)
            _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge, "link", "set", "br0", "up")
            for i in range(1, self.hosts + 1):
                host, inner, outer = self.namespace(i), f"{self.prefix}v{i}", f"{self.prefix}p{i}"
                _ip("netns", "add", host)
                self.made.append(host)
                _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
                _ip("link", "set", inner, "netns", host)
                _ip("link", "set", outer, "netns", bridge)
                _ip("-n", bridge, "link", "set", outer, "master", "br0")
                _ip("-n", bridge, "link", "set", outer, "up")
                _ip("-n", host, "addr", "add", f"{self.address(i)}/24", "dev", inner)
                _ip("-n", host, "link", "set", inner, "up")
                _ip("-n", host, "link", "set", "lo", "up")
                for ns, dev in ((host, inner), (bridge, outer)):  # both directions
                    subprocess.run(
                        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", self.rate, "burst", "256kb", "latency", "100ms"],
                        check=True, capture_output=True, timeout=30,
                    )  # fmt: skip
        except BaseException:
            self.down()
            raise
        return self

    def cut(self, i: int) -> None:
        """Partition host i from every other host (its uplink goes down on the bridge side): a network split
        that neither side can tell from the other's crash."""
        _ip("-n", f"{self.prefix}br", "link", "set", f"{self.prefix}p{i}", "down")

    def mend(self, i: int) -> None:
        """Undo `cut(i)`."""
        _ip("-n", f"{self.prefix}br", "link", "set", f"{self.prefix}p{i}", "up")

    def down(self) -> None:
        """Remove every namespace this WAN made (their veths go with them)."""
        errors = []
        for ns in reversed(self.made):
            try:
                _ip("netns", "del", ns)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        self.made.clear()
        if errors:
            raise RuntimeError("could not remove every namespace: " + "; ".join(errors))

    def __enter__(self) -> NamespaceWAN:
        return self.up()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.down()
