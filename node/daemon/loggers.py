"""Optional experiment loggers (`[node] loggers = ["tensorboard", "wandb"]`): the per-round figures of
`logs/agent.jsonl` also go to TensorBoard or Weights & Biases.

Every numeric field of a `round` event (train and held-out loss, bytes sent and received, the fp32 bytes and the
DDP bytes of the same steps, round seconds, inner step time, the ranks' idle seconds, ...) is logged under
`round/<field>` at step = the round id, plus `round/contributors`, the group's contributors. Each logger is an
optional extra (`pip install 'farloco[tensorboard]'`, `'farloco[wandb]'`); naming one that is not installed is a
config error at start, naming the extra. TensorBoard writes under `<run-dir>/logs/tensorboard`. wandb runs in the
run directory (`<run-dir>/logs/wandb`): one wandb run per node, started once the node knows its peer id (the
`started` event), in group = run.name (a swarm is one group), named node.name or its peer id, with an id derived
from the run name and the peer id, which the node's identity.key keeps: a restarted node resumes its own wandb
run. project = run.name unless WANDB_PROJECT is set; wandb's own environment applies (`WANDB_MODE=offline`,
`WANDB_API_KEY`, ...). A logger that fails while the node trains is logged once and dropped: an experiment
tracker never stops training.
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
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "node.loggers: 'tensorboard' needs the tensorboard package: pip install 'farloco[tensorboard]'"
            ) from exc
        self.writer = SummaryWriter(log_dir=str(directory))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
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
            name=config.node.name or peer_id[:16],
            id=wandb_run_id(config.run.name, peer_id),
            resume="allow",
            dir=str(self.directory),
            config=config.to_dict(),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log(values, step=step)

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


class ExperimentLoggers:
    """The node's configured loggers; `event` takes every event the EventLog writes."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        self.loggers: dict[str, ExperimentLogger] = {}
        try:
            for kind in config.node.loggers:
                if kind == "tensorboard":
                    self.loggers[kind] = TensorBoardLogger(run_dir / "logs" / "tensorboard")
                elif kind == "wandb":
                    self.loggers[kind] = WandbLogger(run_dir / "logs" / "wandb", config)
        except BaseException:
            self.close()
            raise

    def event(self, event: str, fields: dict[str, Any]) -> None:
        if event == "started" and isinstance(fields.get("peer_id"), str):
            wandb_logger = self.loggers.get("wandb")
            if isinstance(wandb_logger, WandbLogger):
                try:
                    wandb_logger.start(fields["peer_id"])
                except Exception as exc:  # a tracker's failure must not stop training
                    log.error("experiment logger wandb failed to start, dropped: %s", exc)
                    self.loggers.pop("wandb")
            return
        if event != "round" or not self.loggers or not isinstance(fields.get("round_id"), int):
            return
        values = round_values(fields)
        for kind, logger in list(self.loggers.items()):
            try:
                logger.log(fields["round_id"], values)
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
