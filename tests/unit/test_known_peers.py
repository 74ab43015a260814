"""node/daemon/knownpeers.py: the peers a node last saw live, written atomically and read back only for its run."""

from __future__ import annotations

import json
from pathlib import Path

from farloco.node.daemon.knownpeers import FILE_NAME, MAX_PEERS, KnownPeers


def test_known_peers_are_written_when_they_change_and_read_back_for_the_same_run_only(tmp_path: Path) -> None:
    known = KnownPeers(tmp_path, "hash-a")
    assert known.load() == []
    known.remember(
        {"QmB": ["/ip4/127.0.0.1/tcp/4002"], "QmA": ["/ip4/127.0.0.1/tcp/4001/p2p/QmA"], "QmC": []}
    )
    assert known.load() == ["/ip4/127.0.0.1/tcp/4001/p2p/QmA", "/ip4/127.0.0.1/tcp/4002/p2p/QmB"]
    written = (tmp_path / FILE_NAME).stat().st_mtime_ns
    known.remember({"QmA": ["/ip4/127.0.0.1/tcp/4001"], "QmB": ["/ip4/127.0.0.1/tcp/4002"]})  # the same view
    assert (tmp_path / FILE_NAME).stat().st_mtime_ns == written
    known.remember({})  # alone (isolated): the last peers we knew stay
    assert len(known.load()) == 2
    assert KnownPeers(tmp_path, "hash-b").load() == [], "another run's peers are not ours to dial"
    assert not list(tmp_path.glob(".*.tmp")), "written through a temporary file, renamed into place"


def test_a_damaged_or_foreign_file_is_ignored_and_the_view_is_bounded(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_text("{not json")
    assert KnownPeers(tmp_path, "h").load() == []
    (tmp_path / FILE_NAME).write_text(
        json.dumps({"run_hash": "h", "peers": {"QmA": "not a list", "QmB": [1, "x"]}})
    )
    assert KnownPeers(tmp_path, "h").load() == []
    many = {f"Qm{i:03d}": [f"/ip4/127.0.0.1/tcp/{5000 + i}"] for i in range(3 * MAX_PEERS)}
    known = KnownPeers(tmp_path, "h")
    known.remember(many)
    assert len(known.load()) == MAX_PEERS
