"""Optional experiment loggers (`[node] loggers = ["tensorboard", "wandb"]`): the per-round figures of
`logs/agent.jsonl` (and, with node.log_every_steps, the per-inner-step ones) also go to TensorBoard or Weights &
Biases.

Every numeric field of a `round` event (train and held-out loss, bytes sent and received, the fp32 bytes and the
DDP bytes of the same steps, round seconds, inner step time, the ranks' idle seconds, the inner rate...) is
logged under `round/<field>` against the round id, plus `round/contributors`, the group's contributors. A `steps`
event (node.log_every_steps) gives `step/loss`, `step/tokens_per_second` and `step/mfu` (where the device's peak
is known) against the swarm's inner step.

A swarm is one experiment, each node one run in it, named node.name or its peer id, which the node's
identity.key keeps across restarts; both loggers start once the node knows its peer id (the `started` event):
- TensorBoard writes under `<run-dir>/logs/tensorboard/<run.name>/<node>`: point `tensorboard --logdir` at a
  folder holding every node's `logs/tensorboard` (copied or mounted) and the nodes are runs of one experiment; a
  restarted node appends to its own.
- wandb runs in `<run-dir>/logs/wandb`: one wandb run per node, in group = run.name, with an id derived from the
  run name and the peer id, so a restarted node resumes its own run. project = run.name unless WANDB_PROJECT is
  set; wandb's own environment applies (`WANDB_MODE=offline`, `WANDB_API_KEY`, ...).

Each logger is an optional extra (`pip install 'farloco[tensorboard]'`, `'farloco[wandb]'`); naming one that is
not installed is a config error at start, naming the extra. A logger that fails while the node trains is logged
once and dropped: an experiment tracker never stops training.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

from farloco.node.config import Config, ConfigError

log = logging.getLogger(__name__)


class ExperimentLogger(Protocol):
    def start(self, peer_id: str) -> None: ...

    def log(self, axis: str, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


# The x axis of each family of figures: round/* against the round id, step/* against the swarm's inner step.
AXES = {"round": "round", "step": "inner_step"}


def node_name(config: Config, peer_id: str) -> str:
    """A node's name in the trackers: node.name, or the first 16 characters of its peer id."""
    return config.node.name or peer_id[:16]


class TensorBoardLogger:
    def __init__(self, directory: Path, config: Config) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "node.loggers: 'tensorboard' needs the tensorboard package: pip install 'farloco[tensorboard]'"
            ) from exc
        self.writer_class, self.directory, self.config = SummaryWriter, directory, config
        self.writer: Any = None

    def start(self, peer_id: str) -> None:
        if self.writer is None:
            where = self.directory / self.config.run.name / node_name(self.config, peer_id)
            self.writer = self.writer_class(log_dir=str(where))

    def log(self, axis: str, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def wandb_run_id(run_name: str, peer_id: str) -> str:
    """A node's wandb run id: the same for the same run and peer id (a restart), different across nodes."""
    return hashlib.sha256(f"farloco\0{run_name}\0{peer_id}".encode()).hexdigest()[:32]


class WandbLogger:
    """One wandb run per node (see the module docstring); it starts at `start`, once the peer id is known."""

    def __init__(self, directory: Path, config: Config) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                "node.loggers: 'wandb' needs the wandb package: pip install 'farloco[wandb]'"
            ) from exc
        self.wandb, self.directory, self.config = wandb, directory, config
        self.run: Any = None

    def start(self, peer_id: str) -> None:
        if self.run is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.config
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT") or config.run.name,
            group=config.run.name,
            name=node_name(config, peer_id),
            id=wandb_run_id(config.run.name, peer_id),
            resume="allow",
            dir=str(self.directory),
            config=config.to_dict(),
        )
        # Two x axes in one run: wandb's own step must only grow, so each family names its own.
        for family, axis in AXES.items():
            self.run.define_metric(axis)
            self.run.define_metric(f"{family}/*", step_metric=axis)

    def log(self, axis: str, step: int, values: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log({**values, axis: step})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def round_values(fields: dict[str, Any]) -> dict[str, float]:
    """The numeric figures of a round event, as `round/<field>`."""
    values = {
        f"round/{key}": float(value)
        for key, value in fields.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "round_id"
    }
    if isinstance(fields.get("contributors"), list):
        values["round/contributors"] = float(len(fields["contributors"]))
    return {key: value for key, value in values.items() if math.isfinite(value)}


def step_values(fields: dict[str, Any]) -> dict[str, float]:
    """The figures of a `steps` event, as `step/<field>`."""
    values = {
        f"step/{key}": float(fields[key])
        for key in ("loss", "tokens_per_second", "mfu")
        if isinstance(fields.get(key), (int, float)) and not isinstance(fields.get(key), bool)
    }
    return {key: value for key, value in values.items() if math.isfinite(value)}


class ExperimentLoggers:
    """The node's configured loggers; `event` takes every event the EventLog writes."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        self.loggers: dict[str, ExperimentLogger] = {}
        try:
            for kind in config.node.loggers:
                if kind == "tensorboard":
                    self.loggers[kind] = TensorBoardLogger(run_dir / "logs" / "tensorboard", config)
                elif kind == "wandb":
                    self.loggers[kind] = WandbLogger(run_dir / "logs" / "wandb", config)
        except BaseException:
            self.close()
            raise

    def event(self, event: str, fields: dict[str, Any]) -> None:
        if event == "started" and isinstance(fields.get("peer_id"), str):
            for kind, logger in list(self.loggers.items()):
                try:
                    logger.start(fields["peer_id"])
                except Exception as exc:  # a tracker's failure must not stop training
                    log.error("experiment logger %s failed to start, dropped: %s", kind, exc)
                    self.loggers.pop(kind)
            return
        if not self.loggers:
            return
        if event == "round" and isinstance(fields.get("round_id"), int):
            axis, step, values = AXES["round"], fields["round_id"], round_values(fields)
        elif event == "steps" and isinstance(fields.get("inner_step"), int):
            axis, step, values = AXES["step"], fields["inner_step"], step_values(fields)
        else:
            return
        for kind, logger in list(self.loggers.items()):
            try:
                logger.log(axis, step, values)
            except Exception as exc:  # a tracker's failure must not stop training
                log.error("experiment logger %s failed, dropped: %s", kind, exc)
                self.loggers.pop(kind)

    def close(self) -> None:
        for kind, logger in list(self.loggers.items()):
            try:
                logger.close()
            except Exception as exc:
                log.warning("closing experiment logger %s: %s", kind, exc)
        self.loggers.clear()
