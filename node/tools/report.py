"""`farloco report`: PNG plots of what one or more nodes did, read from their event logs.

Owns the reading of `<run_dir>/logs/agent.jsonl` (the `EventLog` of `farloco.node.daemon.agent`) for reporting and the
plots drawn from its `round` events: loss per round (train and eval), cumulative bytes sent against what plain
data-parallel training would have sent (log scale), round time, and peers per round. Several run directories
(one per peer) are overlaid on the same axes.

Plots are drawn on `matplotlib.figure.Figure` objects rendered by the Agg canvas: no pyplot global state, no
display needed, safe to call from any thread.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

LOG_FILE = Path("logs") / "agent.jsonl"
ROUND_FIELDS = ("round_id", "train_loss", "eval_loss", "bytes_sent", "ddp_bytes", "seconds", "contributors")
PLOTS = ("loss.png", "bytes.png", "round_time.png", "peers.png")


class ReportError(RuntimeError):
    """A run directory cannot be reported on; the message names the file and what was expected."""


@dataclass
class RunLog:
    """The events of one node that the report draws."""

    label: str
    round_ids: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    bytes_received: list[int] = field(default_factory=list)
    ddp_bytes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    num_contributors: list[int] = field(default_factory=list)
    aborted: list[tuple[int, int]] = field(default_factory=list)
    """(round_id the commit would have had, num_peers) of each aborted round."""


def read_run_log(run_dir: Path) -> RunLog:
    """Parse `<run_dir>/logs/agent.jsonl`. A torn last line (the node was killed mid-write) is ignored."""
    path = Path(run_dir) / LOG_FILE
    if not path.is_file():
        raise ReportError(
            f"{run_dir}: expected an event log at {path}, found none (is it a farloco run dir?)"
        )
    lines = path.read_text().splitlines()
    log = RunLog(label=Path(run_dir).resolve().name)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ReportError(f"{path}:{number}: expected a JSON object per line: {exc}") from exc
        if not isinstance(event, dict):
            raise ReportError(f"{path}:{number}: expected a JSON object, got {type(event).__name__}")
        kind = event.get("event")
        if kind == "started" and isinstance(event.get("peer_id"), str):
            log.label = f"{Path(run_dir).resolve().name} ({event['peer_id'][-6:]})"
        elif kind == "round":
            _add_round(log, event, f"{path}:{number}")
        elif kind == "aborted":
            # A 'round' event carries the round id *after* its commit, an 'aborted' one the id the attempt
            # started from: +1 puts the failed attempt where its commit would have been plotted.
            log.aborted.append((int(event.get("round_id", 0)) + 1, int(event.get("num_peers", 0))))
    if not log.round_ids:
        raise ReportError(f"{path}: no 'round' events yet: the node has not committed an outer round")
    return log


def _add_round(log: RunLog, event: dict[str, Any], where: str) -> None:
    missing = [key for key in ROUND_FIELDS if key not in event]
    if missing:
        raise ReportError(f"{where}: 'round' event is missing {missing}; it has {sorted(event)}")
    try:
        log.round_ids.append(int(event["round_id"]))
        log.train_loss.append(_number(event["train_loss"]))
        log.eval_loss.append(_number(event["eval_loss"]))
        log.bytes_sent.append(int(event["bytes_sent"]))
        log.bytes_received.append(int(event.get("bytes_received", 0)))
        log.ddp_bytes.append(int(event["ddp_bytes"]))
        log.seconds.append(float(event["seconds"]))
        log.num_contributors.append(len(event["contributors"]))
    except (TypeError, ValueError) as exc:
        raise ReportError(f"{where}: 'round' event has a value of the wrong type: {exc}") from exc


def _number(value: Any) -> float:
    # The agent writes NaN for a loss it has not measured (e.g. eval disabled); JSON null means the same.
    return math.nan if value is None else float(value)


def make_report(run_dirs: Sequence[Path], out_dir: Path) -> list[Path]:
    """Draw the report of `run_dirs` (overlaid) into `out_dir`; returns the PNG paths."""
    if not run_dirs:
        raise ReportError("make_report: expected at least one run directory, got none")
    logs = [read_run_log(Path(d)) for d in run_dirs]
    _dedupe_labels(logs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawers = {
        "loss.png": _draw_loss,
        "bytes.png": _draw_bytes,
        "round_time.png": _draw_round_time,
        "peers.png": _draw_peers,
    }
    written = []
    for name in PLOTS:
        figure = Figure(figsize=(8, 4.5), dpi=120, layout="constrained")
        FigureCanvasAgg(figure)
        drawers[name](figure, logs)
        path = out_dir / name
        figure.savefig(path, format="png")
        written.append(path)
    return written


def _dedupe_labels(logs: list[RunLog]) -> None:
    seen: dict[str, int] = {}
    for log in logs:
        seen[log.label] = seen.get(log.label, 0) + 1
        if seen[log.label] > 1:
            log.label = f"{log.label} #{seen[log.label]}"


def _colors(count: int) -> list[Any]:
    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(count)]


def _draw_loss(figure: Figure, logs: list[RunLog]) -> None:
    axes = figure.add_subplot()
    for log, color in zip(logs, _colors(len(logs)), strict=True):
        axes.plot(log.round_ids, log.train_loss, "-o", color=color, markersize=3, label=f"{log.label} train")
        if any(not math.isnan(v) for v in log.eval_loss):
            axes.plot(
                log.round_ids, log.eval_loss, "--s", color=color, markersize=3, label=f"{log.label} eval"
            )
    axes.set_title("Loss per outer round (train: mean over the round's inner steps; eval: theta_outer)")
    axes.set_xlabel("outer round")
    axes.set_ylabel("cross-entropy (nats/token)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")


def _cumulative(values: list[int]) -> list[int]:
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out


def _draw_bytes(figure: Figure, logs: list[RunLog]) -> None:
    axes = figure.add_subplot()
    positive = False
    for log, color in zip(logs, _colors(len(logs)), strict=True):
        sent, ddp = _cumulative(log.bytes_sent), _cumulative(log.ddp_bytes)
        ratio = f", DDP / sent = {ddp[-1] / sent[-1]:.0f}x" if sent[-1] else ""
        axes.plot(log.round_ids, sent, "-o", color=color, markersize=3, label=f"{log.label} sent{ratio}")
        axes.plot(log.round_ids, ddp, ":", color=color, label=f"{log.label} DDP would send")
        positive = positive or any(v > 0 for v in [*sent, *ddp])
    if positive:  # a log axis cannot show a swarm of one, which sends nothing
        axes.set_yscale("log")
    axes.set_title("Cumulative bytes sent vs. plain data-parallel (ring all-reduce of fp32 grads every step)")
    axes.set_xlabel("outer round")
    axes.set_ylabel("bytes (cumulative)")
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize="small")


def _draw_round_time(figure: Figure, logs: list[RunLog]) -> None:
    axes = figure.add_subplot()
    for log, color in zip(logs, _colors(len(logs)), strict=True):
        axes.plot(log.round_ids, log.seconds, "-o", color=color, markersize=3, label=log.label)
    axes.set_title("Outer round time (round boundary to commit: exchange and outer step)")
    axes.set_xlabel("outer round")
    axes.set_ylabel("seconds")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")


def _draw_peers(figure: Figure, logs: list[RunLog]) -> None:
    axes = figure.add_subplot()
    for index, (log, color) in enumerate(zip(logs, _colors(len(logs)), strict=True)):
        # Peers of one swarm mostly agree on the count: nudge each run a little so no line hides another.
        nudge = (index - (len(logs) - 1) / 2) * 0.04
        counts = [count + nudge for count in log.num_contributors]
        axes.step(log.round_ids, counts, where="mid", color=color, label=f"{log.label} contributors")
        for round_id, num_peers in log.aborted:
            axes.plot(round_id, num_peers + nudge, "x", color=color, markersize=8)
    if any(log.aborted for log in logs):
        axes.plot([], [], "x", color="gray", markersize=8, label="aborted round (peers in its group)")
    axes.set_title("Peers that contributed to each committed round")
    axes.set_xlabel("outer round")
    axes.set_ylabel("peers")
    axes.set_ylim(bottom=0)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
