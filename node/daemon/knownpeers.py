"""The peers a node last saw live, kept in its run directory so a restart can find the swarm without the bootstrap.

A swarm's initial peers (`network.initial_peers`, usually one bootstrap node) are only needed to enter the DHT;
once in, every member's record carries its multiaddrs. If the bootstrap is gone (its host lost, its process
stopped) the running swarm does not notice, but a node that restarts could not get back in through it. So the agent
writes the multiaddrs of the members it sees (`known-peers.json`, atomically, only when they change) and dials
them beside the initial peers at start (node/daemon/agent.py): the DHT starts if any of them answers. The file holds addresses only:
what it names is dialled and then checked like any peer (run hash, run secret), so a stale or edited file can
cost a failed dial, never trust.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from farloco.node.fsutil import write_atomic

log = logging.getLogger("farloco.agent")

FILE_NAME = "known-peers.json"
MAX_PEERS = 16  # enough to find a live one after heavy churn; few enough that dialling them all stays quick


def dialable(peer_id: str, maddrs: Sequence[str]) -> list[str]:
    """`maddrs` of `peer_id` as dialable multiaddrs (each ending in /p2p/<peer id>)."""
    return [m if "/p2p/" in m else f"{m}/p2p/{peer_id}" for m in maddrs]


class KnownPeers:
    """`run_dir/known-peers.json`: {"run_hash": ..., "peers": {peer id: [multiaddr, ...]}}."""

    def __init__(self, run_dir: Path, run_hash: str) -> None:
        self.path = Path(run_dir) / FILE_NAME
        self.run_hash = run_hash
        self._written: dict[str, list[str]] | None = None

    def remember(self, peers: Mapping[str, Sequence[str]]) -> None:
        """Write the live peers' multiaddrs (our own excluded by the caller) if they differ from the last write.
        An empty view is not written: the file keeps the last peers we knew (what a restart after an isolation
        needs). Errors are logged, never raised: the file is a convenience."""
        current = {p: dialable(p, m) for p, m in sorted(peers.items()) if m}
        current = dict(list(current.items())[:MAX_PEERS])
        if not current or current == self._written:
            return
        try:
            write_atomic(
                self.path, json.dumps({"run_hash": self.run_hash, "peers": current}, indent=1) + "\n"
            )
        except OSError as exc:
            log.warning("could not write %s: %s", self.path, exc)
            return
        self._written = current

    def load(self) -> list[str]:
        """The multiaddrs to dial, from the last run of this run hash in this directory ([] if none or unreadable)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", self.path, exc)
            return []
        peers = data.get("peers") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("run_hash") != self.run_hash or not isinstance(peers, dict):
            return []
        found: list[str] = []
        for peer_id, maddrs in peers.items():
            if isinstance(peer_id, str) and isinstance(maddrs, list):
                found += [m for m in maddrs if isinstance(m, str) and m.startswith("/")]
        return found[: MAX_PEERS * 4]
