"""The node's control endpoint (node/daemon/control.py) over real HTTP on 127.0.0.1: calls without its token or
with a wrong one never steer the node, malformed requests get a clear 4xx, and connections that never send a
request are cut after CLIENT_TIMEOUT and bounded in number (the chaos runner's `control-api` row does the same
to a running node)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import farloco.node.daemon.control as control
from farloco.node.daemon.control import ControlClient, ControlError, ControlServer


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ControlServer, list[str]]]:
    monkeypatch.setattr(control, "CLIENT_TIMEOUT", 2.0)
    monkeypatch.setattr(control, "MAX_CLIENTS", 8)
    left: list[str] = []
    made = ControlServer(
        tmp_path,
        "127.0.0.1",
        0,
        status=lambda: {"round_id": 3},
        peers=lambda: [],
        leave=left.append,
        metrics=lambda: "farloco_up 1\n",
        ready=lambda: True,
    )
    made.start()
    try:
        yield made, left
    finally:
        made.stop()


def call(made: ControlServer, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> Any:
    host, port = made.httpd.server_address[:2]
    connection = http.client.HTTPConnection(str(host), int(port), timeout=10)
    try:
        connection.putrequest(method, path)
        for key, value in headers.items():
            connection.putheader(key, value)
        if "Content-Length" not in headers:
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def test_calls_without_the_token_or_malformed_are_refused_and_never_steer_the_node(
    server: tuple[ControlServer, list[str]],
) -> None:
    made, left = server
    wrong = {"Authorization": "Bearer " + "0" * len(made.token)}
    right = {"Authorization": f"Bearer {made.token}"}
    assert call(made, "GET", "/status", {})[0] == 401
    assert call(made, "GET", "/status", wrong)[0] == 401
    assert call(made, "POST", "/leave", {}, b'{"mode": "now"}')[0] == 401
    assert call(made, "POST", "/leave", wrong, b'{"mode": "now"}')[0] == 401
    code, body = call(made, "POST", "/leave", right, b'{"mode": "explode"}')
    assert code == 400 and "expected graceful, now or drain, got 'explode'" in body["error"]
    code, body = call(made, "POST", "/leave", {**right, "Content-Length": "-1"})
    assert code == 400 and "Content-Length: expected a whole number, got '-1'" in body["error"]
    code, body = call(made, "POST", "/leave", right, b" " * (control.MAX_BODY + 1))
    assert code == 413 and f"exceeds {control.MAX_BODY}" in body["error"]
    code, body = call(made, "POST", "/leave", right, b"{mode: now")
    assert code == 400 and "body is not JSON" in body["error"]
    assert call(made, "GET", "/admin", right)[0] == 404
    assert left == []  # nothing above made the node leave
    assert call(made, "GET", "/status", right) == (200, {"round_id": 3})
    assert call(made, "POST", "/leave", right, b'{"mode": "drain"}')[0] == 202 and left == ["drain"]


def test_connections_that_send_nothing_are_bounded_and_cut(server: tuple[ControlServer, list[str]]) -> None:
    made, _ = server
    host, port = made.httpd.server_address[:2]
    idle = [
        socket.create_connection((str(host), int(port)), timeout=5) for _ in range(control.MAX_CLIENTS + 4)
    ]
    try:
        # Beyond MAX_CLIENTS a connection is closed unanswered: reading it ends at once.
        assert idle[-1].recv(1) == b""
        deadline = time.monotonic() + 5
        while made.httpd.turned_away < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert made.httpd.turned_away == 4
        # The others are cut after CLIENT_TIMEOUT (2 s here), which frees their slots for a real call.
        started = time.monotonic()
        assert idle[0].recv(1) == b""
        assert time.monotonic() - started < 5
        time.sleep(0.3)
        assert ControlClient(made.run_dir).status() == {"round_id": 3}
    finally:
        for connection in idle:
            connection.close()


def test_a_stopped_endpoint_says_so(server: tuple[ControlServer, list[str]]) -> None:
    made, _ = server
    client = ControlClient(made.run_dir, timeout=2)
    made.stop()
    made.start = lambda: None  # type: ignore[method-assign]  # the fixture's stop runs again: harmless
    with pytest.raises(ControlError):
        client.status()


def test_a_burst_of_connections_is_taken_at_once(server: tuple[ControlServer, list[str]]) -> None:
    """100 connections at once complete without waiting for SYN retries (socketserver's listen backlog of 5 made
    the chaos runner's 200 connections take 25 s; the backlog is 128 now), and the node still answers."""
    made, _ = server
    host, port = made.httpd.server_address[:2]
    started = time.monotonic()
    burst = [socket.create_connection((str(host), int(port)), timeout=10) for _ in range(100)]
    try:
        assert time.monotonic() - started < 5.0
    finally:
        for connection in burst:
            connection.close()
    time.sleep(0.2)
    assert ControlClient(made.run_dir).status() == {"round_id": 3}
