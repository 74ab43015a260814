"""The swarm tests' harness: real `farloco join` processes (agent + elastic-launched trainer ranks) on 127.0.0.1
around a bootstrap DHT node of their own, and readers of the events the nodes log."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from farloco.node.tools.demo import (
    PeerProcess,
    demo_config,
    read_events,
    start_bootstrap,
    start_peer,
    stop_process,
)


def rounds_of(peer: PeerProcess) -> list[dict]:
    return [e for e in read_events(peer.run_dir) if e["event"] == "round"]


def wait_for(predicate, timeout: float, what: str, peers: list[PeerProcess]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        for peer in peers:
            if peer.process.poll() not in (None, 0):
                log = peer.log_path.read_text(errors="replace")[-3000:]
                pytest.fail(
                    f"{peer.name} exited with {peer.process.returncode} while waiting for {what}:\n{log}"
                )
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.3)


def wait_for_exit(peers: list[PeerProcess], timeout: float, what: str) -> None:
    """Until every one of `peers` exited (a bound against a hang, not a timing), then each must have exited 0."""
    deadline = time.monotonic() + timeout
    while any(peer.process.poll() is None for peer in peers):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)
    for peer in peers:
        assert peer.process.returncode == 0, peer.log_path.read_text(errors="replace")[-3000:]


class Swarm:
    """A bootstrap node plus peers, all stopped when the test ends."""

    def __init__(self, root: Path, overrides: list[str]) -> None:
        self.root = root
        self.config_path = root / "swarm.toml"
        self.config_path.write_text(demo_config(0, overrides))
        self.bootstrap, self.maddr = start_bootstrap(root)
        self.peers: list[PeerProcess] = []

    def add(
        self, name: str, ranks: int = 1, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
    ) -> PeerProcess:
        peer = start_peer(name, self.root, self.config_path, self.maddr, ranks, extra, env)
        self.peers.append(peer)
        return peer

    def close(self) -> None:
        stop_process(*(peer.process for peer in self.peers))
        stop_process(self.bootstrap)


def forked_rounds(
    peers: list[PeerProcess], since: float = 0.0, until: float = math.inf
) -> dict[int, set[str]]:
    """Round ids for which two of `peers` committed different outer hashes (every process that ran on a run
    directory counts: its events stay in the directory's log), among the rounds committed in [since, until)."""
    hashes: dict[int, set[str]] = {}
    for peer in peers:
        for event in rounds_of(peer):
            if since <= event["time"] < until:
                hashes.setdefault(event["round_id"], set()).add(event["outer_hash"])
    return {r: h for r, h in hashes.items() if len(h) > 1}


def started_event(peer: PeerProcess) -> dict:
    return [e for e in read_events(peer.run_dir) if e["event"] == "started"][-1]


def together_after(peers: list[PeerProcess], round_id: int) -> list[int]:
    """Round ids past `round_id` that every one of `peers` committed in a group of all of them."""
    ids = None
    for peer in peers:
        mine = {
            e["round_id"]
            for e in rounds_of(peer)
            if e["round_id"] > round_id and len(e["group"]) == len(peers)
        }
        ids = mine if ids is None else ids & mine
    return sorted(ids or ())
