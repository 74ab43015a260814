"""A userspace netem: the relay on every path of a namespace WAN (node/tools/netns.py, `NamespaceWAN(relay=True)`).

The kernels this project runs on have no `netem` qdisc (and no iptables), so delay, jitter, loss, stalls and
partitions are made here. The WAN's hub namespace routes every packet that arrives from a host's uplink into a TUN
device (policy routing on the input interface); this process, running inside the hub namespace, reads each IPv4
packet, decides from its source and destination hosts what happens to it, and writes it back into the TUN device
at its release time, from where the hub routes it on to the destination host. Per path (source host, destination
host):

- `delay_ms`: one-way delay added to every packet (RTT = the two directions' delays; tbf on the uplinks still sets
  the rate);
- `jitter_ms`: a uniform extra delay in [0, jitter_ms] per packet, packets of one path never reordered (as a
  real link's queue);
- `loss`: each packet dropped with this probability (real packet loss: TCP retransmits);
- `stalled`: every packet dropped, and no FIN or RST sent: both ends see a silent peer (a half-open link);
- `partition`: groups of hosts; packets between hosts of different groups are dropped.

The rules live in a JSON file the harness rewrites (atomically); this process re-reads it when its mtime changes
(every 50 ms), so a test can change a path while traffic flows. Format::

    {"default": {"delay_ms": 25, "jitter_ms": 0, "loss": 0.0},
     "paths": {"1>3": {"delay_ms": 100}},          # overrides per path, "src>dst" host numbers
     "stalled": ["2>1"], "partition": [[1, 2], [3, 4]]}

Run as `python -m farloco.node.tools.netem --tun NAME --rules FILE --net NET` inside the hub namespace (the
harness does it); it ends on SIGTERM and when its parent dies. Packets are addressed 10.NET.<host>.x (the third
octet names the host).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import heapq
import json
import os
import random
import selectors
import signal
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farloco.node.fsutil import write_atomic

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_SIZE = 65536
RULES_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class PathRule:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"delay_ms and jitter_ms must be >= 0, got {self.delay_ms}, {self.jitter_ms}")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss must be in [0, 1], got {self.loss}")


class Rules:
    """The parsed rules file: what happens to a packet from host `src` to host `dst`."""

    def __init__(self, data: dict[str, Any]) -> None:
        known = {"default", "paths", "stalled", "partition"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"netem rules: unknown keys {unknown}, expected some of {sorted(known)}")
        self.default = PathRule(**data.get("default", {}))
        self.paths = {
            _path(key): PathRule(**{**vars(self.default), **value})
            for key, value in data.get("paths", {}).items()
        }
        self.stalled = {_path(key) for key in data.get("stalled", [])}
        self.group = {
            host: index for index, hosts in enumerate(data.get("partition") or []) for host in hosts
        }

    def rule(self, src: int, dst: int) -> PathRule | None:
        """The path's rule, or None if its packets are all dropped (stalled, or across a partition)."""
        if (src, dst) in self.stalled:
            return None
        if self.group and self.group.get(src, -1) != self.group.get(dst, -2):
            return None
        return self.paths.get((src, dst), self.default)


def _path(key: str) -> tuple[int, int]:
    src, sep, dst = key.partition(">")
    if not sep or not src.isdigit() or not dst.isdigit():
        raise ValueError(f"netem rules: a path is 'src>dst' host numbers, got {key!r}")
    return int(src), int(dst)


def write_rules(path: Path, data: dict[str, Any]) -> None:
    """Replace the rules file atomically (the relay never reads half a file); validates first."""
    Rules(data)
    write_atomic(path, json.dumps(data))


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


class Relay:
    """The packet loop (see the module docstring)."""

    def __init__(self, fd: int, rules_path: Path, net: int, seed: int = 0) -> None:
        self.fd, self.rules_path, self.net = fd, rules_path, net
        self.random = random.Random(seed)
        self.queue: list[tuple[float, int, bytes]] = []
        self.last_release: dict[tuple[int, int], float] = {}
        self.sequence = 0
        self.rules = Rules({})
        self.rules_mtime = -1
        self.counts = {"relayed": 0, "dropped": 0}

    def reload(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            mtime = self.rules_path.stat().st_mtime_ns
            if mtime != self.rules_mtime:
                self.rules = Rules(json.loads(self.rules_path.read_text()))
                self.rules_mtime = mtime

    def take(self, packet: bytes, now: float) -> None:
        ours = bytes((10, self.net))
        if len(packet) < 20 or packet[0] >> 4 != 4 or packet[12:14] != ours or packet[16:18] != ours:
            return  # not IPv4 between hosts of this WAN (IPv6 router solicitations and the like)
        src, dst = packet[14], packet[18]
        rule = self.rules.rule(src, dst)
        if rule is None or (rule.loss and self.random.random() < rule.loss):
            self.counts["dropped"] += 1
            return
        delay = rule.delay_ms + (self.random.uniform(0.0, rule.jitter_ms) if rule.jitter_ms else 0.0)
        release = max(now + delay / 1000.0, self.last_release.get((src, dst), 0.0))
        self.last_release[(src, dst)] = release
        self.sequence += 1
        heapq.heappush(self.queue, (release, self.sequence, packet))

    def release_due(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, _, packet = heapq.heappop(self.queue)
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self.fd, packet)
                self.counts["relayed"] += 1

    def run(self, stop: list[bool]) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.fd, selectors.EVENT_READ)
        next_reload = 0.0
        while not stop:
            now = time.monotonic()
            if now >= next_reload:
                self.reload()
                next_reload = now + RULES_POLL_SECONDS
            timeout = RULES_POLL_SECONDS if not self.queue else max(0.0, self.queue[0][0] - now)
            if selector.select(min(timeout, RULES_POLL_SECONDS)):
                now = time.monotonic()
                while True:
                    try:
                        packet = os.read(self.fd, READ_SIZE)
                    except BlockingIOError:
                        break
                    self.take(packet, now)
            self.release_due(time.monotonic())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tun", required=True)
    parser.add_argument("--rules", required=True, type=Path)
    parser.add_argument("--net", required=True, type=int)
    parser.add_argument("--ready", type=Path, help="a file written once the TUN device exists")
    args = parser.parse_args()
    from farloco.node.daemon.dhtnode import _set_parent_death_signal

    _set_parent_death_signal(signal.SIGTERM)
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    relay = Relay(open_tun(args.tun), args.rules, args.net)
    if args.ready is not None:
        args.ready.write_text(str(os.getpid()))
    relay.run(stop)


if __name__ == "__main__":
    main()
