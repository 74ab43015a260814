"""The node's local control endpoint: a small HTTP server on loopback.

`farloco status`, `peers`, `leave` and `drain` talk to the running agent through it. Control calls carry the
token written (mode 0600) in the run directory, so only users who can read the run directory can steer the node.
`/metrics` (Prometheus text), `/healthz` and `/readyz` are open: they reveal nothing that steers the node.
The run directory holds `control.json` with the URL, so clients need only `--run-dir`.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from farloco.node.fsutil import write_atomic

CONTROL_FILE = "control.json"
TOKEN_FILE = "control.token"
MAX_BODY = 64 * 1024
MAX_CLIENTS = 256  # connections served at once (a thread each); more are closed unanswered
CLIENT_TIMEOUT = (
    10.0  # seconds a connection may take to send its request (a client that sends nothing is cut)
)


class ControlError(RuntimeError):
    """The control endpoint of a run directory cannot be reached or refused the call."""


class ControlServer:
    """Serves the agent's status and takes leave/drain requests; runs in its own daemon thread."""

    def __init__(
        self,
        run_dir: Path,
        host: str,
        port: int,
        *,
        status: Callable[[], dict[str, Any]],
        peers: Callable[[], list[dict[str, Any]]],
        leave: Callable[[str], None],
        metrics: Callable[[], str],
        ready: Callable[[], bool],
    ) -> None:
        self.run_dir = run_dir
        self.token = secrets.token_hex(16)
        token_path = run_dir / TOKEN_FILE
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(self.token)
        handler = _make_handler(self.token, status, peers, leave, metrics, ready)
        self.httpd = _BoundedServer((host, port), handler)
        bound_host, bound_port = self.httpd.server_address[:2]
        self.url = f"http://{bound_host!s}:{bound_port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="farloco-control", daemon=True)

    def start(self) -> None:
        self._thread.start()
        write_atomic(self.run_dir / CONTROL_FILE, json.dumps({"url": self.url, "pid": os.getpid()}))

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        (self.run_dir / CONTROL_FILE).unlink(missing_ok=True)


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CLIENTS at once: beyond that a new connection is closed unanswered
    (counted in `turned_away`), so a flood of connections cannot grow the node's threads without bound; a
    connection that sends nothing is cut after CLIENT_TIMEOUT, freeing its slot."""

    daemon_threads = True
    block_on_close = False  # stopping the node never waits for a client that is still sending
    request_queue_size = (
        128  # the listen backlog (socketserver's 5 made a burst of connections wait on SYN retries)
    )

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)  # read at construction (tests lower it)
        self.turned_away = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.turned_away += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _make_handler(
    token: str,
    status: Callable[[], dict[str, Any]],
    peers: Callable[[], list[dict[str, Any]]],
    leave: Callable[[str], None],
    metrics: Callable[[], str],
    ready: Callable[[], bool],
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "farloco-control"
        timeout = CLIENT_TIMEOUT  # on the connection's socket: a request that never comes ends the thread

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, code: int, body: str, content_type: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if hmac.compare_digest(given.encode(), token.encode()):
                return True
            self._send(401, json.dumps({"error": "missing or wrong control token (see control.token)"}))
            return False

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(200, "ok\n", "text/plain")
            elif path == "/readyz":
                self._send(200 if ready() else 503, ("ready\n" if ready() else "not ready\n"), "text/plain")
            elif path == "/metrics":
                self._send(200, metrics(), "text/plain; version=0.0.4")
            elif path == "/status":
                if self._authorized():
                    self._send(200, json.dumps(status()))
            elif path == "/peers":
                if self._authorized():
                    self._send(200, json.dumps(peers()))
            else:
                self._send(404, json.dumps({"error": f"no such endpoint {path}"}))

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if not self._authorized():
                return
            raw_length = self.headers.get("Content-Length", "0") or "0"
            if not raw_length.strip().isdigit():
                self._send(
                    400,
                    json.dumps({"error": f"Content-Length: expected a whole number, got {raw_length!r:.40}"}),
                )
                return
            length = int(raw_length)
            if length > MAX_BODY:
                self._send(413, json.dumps({"error": f"body of {length} bytes exceeds {MAX_BODY}"}))
                return
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError as exc:
                self._send(400, json.dumps({"error": f"body is not JSON: {exc}"}))
                return
            if path == "/leave":
                mode = body.get("mode", "graceful")
                if mode not in ("graceful", "now", "drain"):
                    self._send(
                        400, json.dumps({"error": f"mode: expected graceful, now or drain, got {mode!r}"})
                    )
                    return
                leave(mode)
                self._send(202, json.dumps({"leaving": mode}))
            else:
                self._send(404, json.dumps({"error": f"no such endpoint {path}"}))

    return Handler


class ControlClient:
    """Talks to the agent of a run directory."""

    def __init__(self, run_dir: Path, timeout: float = 10.0) -> None:
        self.run_dir = Path(run_dir)
        self.timeout = timeout
        control = self.run_dir / CONTROL_FILE
        if not control.exists():
            raise ControlError(f"no running node in {self.run_dir}: {control} does not exist")
        info = json.loads(control.read_text())
        self.url: str = info["url"]
        self.pid: int = int(info["pid"])
        self.token = (self.run_dir / TOKEN_FILE).read_text().strip()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise ControlError(
                f"{method} {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}"
            ) from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise ControlError(f"node in {self.run_dir} does not answer at {self.url}: {exc}") from exc

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/status")
        return result

    def metrics(self) -> str:
        """The node's Prometheus text (the open /metrics endpoint)."""
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=self.timeout) as response:
                return str(response.read().decode())
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise ControlError(f"node in {self.run_dir} does not answer at {self.url}: {exc}") from exc

    def peers(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/peers")
        return result

    def leave(self, mode: str = "graceful") -> None:
        self._call("POST", "/leave", {"mode": mode})

    def alive(self) -> bool:
        """Whether the agent process still runs (a zombie its parent has not reaped yet counts as gone)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return True  # no procfs: trust kill(0)
        # Field 3, after the parenthesised command name, is the state; Z = exited, waiting to be reaped.
        return stat.rsplit(")", 1)[-1].split()[0] != "Z"
