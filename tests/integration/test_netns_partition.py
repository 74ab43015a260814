"""Isolation across hosts: two nodes in two network namespaces, a bootstrap DHT node in a third.
Cut one node's link: both nodes find their peer vanished without leaving, say so (status `isolated`, the
`farloco_isolated` metric, an `isolated` event, a warning) and commit no round alone; mend the link: both rejoin
through the initial peer and their last addresses and go on as one swarm, one hash per round. Needs root and
iproute2: skips with the reason elsewhere, and removes every namespace it made."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from farloco.node.tools.demo import (
    PeerProcess,
    demo_config,
    read_events,
    start_bootstrap,
    start_peer,
    stop_process,
)
from farloco.node.tools.netns import NamespaceWAN, unavailable

pytestmark = [pytest.mark.multiprocess, pytest.mark.dht]


def _events(peer: PeerProcess, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(peer.run_dir) if e["event"] == kind]


def _wait(what: str, check: Callable[[], bool], timeout: float, peers: list[PeerProcess]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for peer in peers:
            if peer.process.poll() is not None:
                pytest.fail(
                    f"{peer.name} exited while waiting for {what}: " + peer.log_path.read_text()[-3000:]
                )
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.3)


def _in_namespace(wan: NamespaceWAN, i: int, code: str, *args: str) -> str:
    result = subprocess.run(
        [*wan.prefix_command(i), sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


STATUS = "import json, sys; from farloco.node.daemon.control import ControlClient; print(json.dumps(ControlClient(sys.argv[1]).status()))"
METRICS = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


# ~60 s on 2 cores: `-m slow`, so that the default suite keeps under ~15 minutes. The default suite keeps
# isolation on loopback (tests/test_swarm.py::test_a_node_whose_only_peer_vanished_is_isolated_then_follows_min_peers)
# and a silent partition splitting groups across namespaces (tests/test_netns_wan.py).
@pytest.mark.slow
def test_a_partitioned_node_says_it_is_isolated_commits_nothing_alone_and_rejoins(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    config = tmp_path / "swarm.toml"
    config.write_text(demo_config(1000, ["run.inner_steps=8", "timeouts.isolation_timeout=90"]))
    processes = []
    with NamespaceWAN(3, "100mbit") as wan:
        try:
            bootstrap, maddr = start_bootstrap(tmp_path, host=wan.address(3), prefix=wan.prefix_command(3))
            processes.append(bootstrap)
            peers = [
                start_peer(
                    f"n{i}", tmp_path, config, maddr, 1, host=wan.address(i), prefix=wan.prefix_command(i)
                )
                for i in (1, 2)
            ]
            processes += [p.process for p in peers]

            def rounds_together(peer: PeerProcess) -> list[dict[str, Any]]:
                return [e for e in _events(peer, "round") if len(e["group"]) == 2]

            _wait(
                "3 rounds of both nodes together",
                lambda: all(len(rounds_together(p)) >= 3 for p in peers),
                120,
                peers,
            )
            wan.cut(2)
            cut_at = {p.name: len(_events(p, "round")) for p in peers}
            _wait("both nodes isolated", lambda: all(_events(p, "isolated") for p in peers), 60, peers)
            for i, peer in zip((1, 2), peers, strict=True):
                status = json.loads(_in_namespace(wan, i, STATUS, str(peer.run_dir)))
                assert status["state"] == "isolated" and status["isolated"], status
                assert status["vanished_peers"] and status["isolated_seconds"] >= 0
                metrics = _in_namespace(wan, i, METRICS, status["metrics_url"])
                assert "farloco_isolated 1" in metrics, metrics
                assert "isolated: the peers" in peer.log_path.read_text()
            time.sleep(8)  # several rounds' time: an isolated node commits none
            during = {p.name: len(_events(p, "round")) for p in peers}
            for peer in peers:
                # At most the round that was in flight when the link went down ends without the other node.
                assert during[peer.name] - cut_at[peer.name] <= 1, (peer.name, cut_at, during)
            wan.mend(2)
            _wait("both nodes rejoined", lambda: all(_events(p, "rejoined") for p in peers), 90, peers)
            after = {p.name: len(_events(p, "round")) for p in peers}
            _wait(
                "3 more rounds together",
                lambda: all(len(_events(p, "round")) >= after[p.name] + 3 for p in peers),
                120,
                peers,
            )
        finally:
            stop_process(*processes)
    by_round = [{e["round_id"]: e for e in _events(p, "round")} for p in peers]
    last = min(max(r) for r in by_round)
    for round_id in range(last - 2, last + 1):  # one swarm again: both in the group, one hash
        one, two = (r[round_id] for r in by_round)
        assert len(one["group"]) == 2 and one["outer_hash"] == two["outer_hash"], (round_id, one, two)
