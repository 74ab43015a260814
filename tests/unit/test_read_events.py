"""`read_events`: a node's events read while the node still writes them (the demo, the chaos harness, the tests'
swarm helpers all read a running node's agent.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farloco.node.tools.demo import read_events


def write(run_dir: Path, text: str) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / "agent.jsonl").write_text(text)


def test_a_line_still_being_written_is_not_an_event_yet(tmp_path: Path) -> None:
    first = json.dumps({"event": "started", "round": 0})
    long = json.dumps({"event": "round", "round": 1, "contributors": ["p" * 40] * 60})
    write(tmp_path, f"{first}\n{long[:2195]}")  # the writer's buffer went out in two writes, one so far
    assert read_events(tmp_path) == [{"event": "started", "round": 0}]
    write(tmp_path, f"{first}\n{long}\n")
    assert [e["event"] for e in read_events(tmp_path)] == ["started", "round"]


def test_no_file_is_no_events_and_a_broken_whole_line_is_an_error(tmp_path: Path) -> None:
    assert read_events(tmp_path) == []
    write(tmp_path, '{"event": "started"}\n{"event": \n{"event": "round"}\n')
    with pytest.raises(json.JSONDecodeError):
        read_events(tmp_path)
