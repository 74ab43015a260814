"""The daemon's own logging: text or JSON lines on stderr, JSON lines in `<run-dir>/logs/daemon.jsonl`; the
progress of a state sync; and the trainer failures the elastic launcher reports.

One JSON line per record: `ts` (UTC, ISO 8601 with milliseconds), `level`, `logger`, `msg`, then every extra
field given with `log.info(..., extra={...})`, and `exc` (the formatted traceback) when there is one. This is
the daemon's diagnostic log; `logs/agent.jsonl` (farloco.node.daemon.agent.EventLog) stays the record of what the node
did, which `farloco report` reads.
"""

from __future__ import annotations

import datetime
import json
import logging
import logging.handlers
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DAEMON_LOG = Path("logs") / "daemon.jsonl"
# A node runs for months: the file rotates at 64 MiB and keeps 4 old ones (daemon.jsonl.1 ... .4).
DAEMON_LOG_BYTES = 64 * 1024 * 1024
DAEMON_LOG_BACKUPS = 4
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")
NOISY_LOGGERS = ("hivemind", "torch.distributed", "asyncio")

# Attributes every LogRecord has: anything else on a record came from `extra=` and goes into the JSON line.
_RECORD_FIELDS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_LEVEL_NAMES = {
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARNING",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "CRITICAL",
}
_console_format = "text"

log = logging.getLogger("farloco.logs")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, the record's extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        entry: dict[str, Any] = {
            "ts": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            # Standard names: hivemind renames WARNING to "WARN" process-wide.
            "level": _LEVEL_NAMES.get(record.levelno, record.levelname),
            "logger": record.name,
            "msg": record.getMessage().rstrip("\n"),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_FIELDS and not key.startswith("_") and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # default=str: an extra field that JSON cannot hold (a Path, an enum) is logged as its text, not lost.
        return json.dumps(entry, default=str)


def default_log_format() -> str:
    """'text' when stderr is a terminal (a person reads it), 'json' otherwise (journald, docker, kubectl)."""
    return "text" if sys.stderr.isatty() else "json"


def console_format() -> str:
    """The format `setup_logging` chose for stderr ('text' before it ran)."""
    return _console_format


def setup_logging(log_format: str | None, *, verbose: bool = False, run_dir: Path | None = None) -> None:
    """Send every log record (farloco's, hivemind's, torch's warnings) to stderr in `log_format` ('text' or
    'json'; None: `default_log_format()`) and, with `run_dir`, as JSON lines to `<run_dir>/logs/daemon.jsonl`."""
    global _console_format
    chosen = log_format or default_log_format()
    if chosen not in LOG_FORMATS:
        raise ValueError(f"log format: expected one of {list(LOG_FORMATS)}, got {log_format!r}")
    _console_format = chosen
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(JsonFormatter() if chosen == "json" else logging.Formatter(TEXT_FORMAT))
    handlers: list[logging.Handler] = [console]
    if run_dir is not None:
        path = Path(run_dir) / DAEMON_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        file = logging.handlers.RotatingFileHandler(
            path, maxBytes=DAEMON_LOG_BYTES, backupCount=DAEMON_LOG_BACKUPS, encoding="utf-8"
        )
        file.setFormatter(JsonFormatter())
        handlers.append(file)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=handlers, force=True)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(True)
    # hivemind installs its own stderr handler on its loggers by default; "nowhere" removes it and lets their
    # records reach ours, so a JSON stderr holds JSON lines only and daemon.jsonl has the DHT's warnings too.
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_drop_p2pd_closing_noise)
    # torch (torch._logging, at import) does the same on "torch", "torch.distributed" and a few more, in its own
    # glog-like format: imported here so that its stderr handlers exist to be removed now, not added later.
    import torch  # noqa: F401

    for name, candidate in list(logging.root.manager.loggerDict.items()):
        if isinstance(candidate, logging.Logger) and (name == "torch" or name.startswith("torch.")):
            own = [
                h for h in candidate.handlers if type(h) is logging.StreamHandler and h.stream is sys.stderr
            ]
            for handler in own:
                candidate.removeHandler(handler)
            if own:
                candidate.propagate = True


def _drop_p2pd_closing_noise(record: logging.LogRecord) -> bool:
    """p2pd logs an ERROR each time it closes its control socket on a normal stop ("error accepting connection:
    accept unix ...: use of closed network connection"): every leave under Slurm or systemd, which signal p2pd
    too, would print one. Only that line is dropped; p2pd's other errors pass."""
    message = record.getMessage()
    return not ("error accepting connection" in message and "use of closed network connection" in message)


class SyncProgress:
    """Progress of one state sync (bytes of the donor's state fetched): a rich progress bar when stderr is a
    terminal read as text, else a log line every `interval` seconds; `snapshot()` feeds `farloco status`.

    `update(done, total)` is `fetch_state`'s `on_progress`: called from the event loop, so it stays cheap."""

    def __init__(
        self,
        description: str,
        *,
        bar: bool | None = None,
        interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.description = description
        self.interval = interval
        self._clock = clock
        self.started = clock()
        self.bytes_done = 0
        self.bytes_total = 0
        self._last_line = self.started
        self._bar: Any = None
        self._task: Any = None
        if bar if bar is not None else (console_format() == "text" and sys.stderr.isatty()):
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(description, total=None)

    def update(self, done: int, total: int) -> None:
        self.bytes_done, self.bytes_total = done, total
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)
            return
        now = self._clock()
        if now - self._last_line >= self.interval:
            self._last_line = now
            log.info(
                "%s: %s of %s (%.0f%%)",
                self.description,
                _size(done),
                _size(total),
                100 * done / total if total else 0,
                extra={"bytes_done": done, "bytes_total": total},
            )

    def snapshot(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "fraction": self.bytes_done / self.bytes_total if self.bytes_total else None,
            "seconds": self._clock() - self.started,
        }

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def describe_exit(exitcode: int) -> str:
    """A process exit code as the launcher reports it (negative: killed by that signal), in words."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class LauncherFailures(logging.Handler):
    """Counts the trainer rank-group failures torch's elastic launcher reports, and keeps the last one's reason.

    The launcher restarts the group itself and exposes no callback for it; what it does give is one ERROR record
    per failed group, "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", from
    `torch.distributed.elastic.multiprocessing.api`. Attached there (`install`), this handler reads that
    record's arguments. Each failure while restarts remain is a restart; the one after them ends the trainers.
    """

    LOGGER = "torch.distributed.elastic.multiprocessing.api"
    MESSAGE_PREFIX = "failed (exitcode"

    def __init__(self, max_restarts: int, on_failure: Callable[[str], None] | None = None) -> None:
        super().__init__(level=logging.ERROR)
        self.max_restarts = max_restarts
        self.on_failure = on_failure
        self.failures = 0
        self.last_exit: str | None = None
        self.last_exit_code: int | None = None
        self._count_lock = threading.Lock()

    @property
    def restarts(self) -> int:
        return min(self.failures, self.max_restarts)

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if not (isinstance(record.msg, str) and record.msg.startswith(self.MESSAGE_PREFIX)) or len(args) < 3:
            return
        exitcode, local_rank, pid = args[:3]
        try:
            code = int(exitcode)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return
        reason = f"local rank {local_rank} (pid {pid}) {describe_exit(code)}"
        with self._count_lock:
            self.failures += 1
            self.last_exit, self.last_exit_code = reason, code
        if self.on_failure is not None:
            self.on_failure(reason)

    def install(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.addHandler(self)
        logger.addFilter(_drop_orphan_warning)

    def uninstall(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.removeFilter(_drop_orphan_warning)


def _drop_orphan_warning(record: logging.LogRecord) -> bool:
    """The launcher runs in the agent's supervisor thread, where it cannot install signal handlers, and warns on
    every start that its ranks could be orphaned. They cannot: each rank exits as soon as its parent changes
    (node/training/trainer.py) and the agent's signal handlers stop them on a leave; tests/integration/test_node_leave.py SIGKILLs the
    agent and checks that no rank (nor the DHT process) outlives it. So the warning is kept out of the logs."""
    return not (isinstance(record.msg, str) and record.msg.startswith("Failed to register signal handlers"))
