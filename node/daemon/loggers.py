"""Optional experiment loggers (`[node] loggers = ["tensorboard", "wandb"]`): the per-round figures of
`logs/agent.jsonl` also go to TensorBoard or Weights & Biases.

Every numeric field of a `round` event (train and held-out loss, bytes sent and received, the fp32 bytes and the
DDP bytes of the same steps, round seconds, inner step time, the ranks' idle seconds, ...) is logged under
`round/<field>` at step = the round id, plus `round/contributors`, the group's contributors. Each logger is an
optional extra (`pip install 'farloco[tensorboard]'`, `'farloco[wandb]'`); naming one that is not installed is a
config error at start, naming the extra. TensorBoard writes under `<run-dir>/logs/tensorboard`; wandb runs in the
run directory (`<run-dir>/logs/wandb`), project = run.name, and honours its own environment (`WANDB_MODE=offline`,
`WANDB_API_KEY`, ...). A logger that fails while the node trains is logged once and dropped: an experiment
tracker never stops training.
"""

from __future__ import annotations

import logging
import math
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


class WandbLogger:
    def __init__(self, directory: Path, config: Config, name: str) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                "node.loggers: 'wandb' needs the wandb package: pip install 'farloco[wandb]'"
            ) from exc
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.run.name,
            name=name,
            dir=str(directory),
            config=config.to_dict(),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
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

    def __init__(self, config: Config, run_dir: Path, name: str) -> None:
        self.loggers: dict[str, ExperimentLogger] = {}
        try:
            for kind in config.node.loggers:
                if kind == "tensorboard":
                    self.loggers[kind] = TensorBoardLogger(run_dir / "logs" / "tensorboard")
                elif kind == "wandb":
                    self.loggers[kind] = WandbLogger(run_dir / "logs" / "wandb", config, name)
        except BaseException:
            self.close()
            raise

    def event(self, event: str, fields: dict[str, Any]) -> None:
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
