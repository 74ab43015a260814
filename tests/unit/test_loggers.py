"""node.loggers: the per-round figures of logs/agent.jsonl also go to TensorBoard and wandb (offline), read back
from what each wrote."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from farloco.node.config import ConfigError, build_config
from farloco.node.daemon.core import EventLog
from farloco.node.daemon.loggers import ExperimentLoggers, round_values

ROUND = {
    "round_id": 3,
    "train_loss": 2.5,
    "eval_loss": math.nan,  # not evaluated: left out, never logged as NaN
    "bytes_sent": 1024,
    "contributors": ["a", "b", "c"],
    "outer_hash": "abc",
    "overlap_steps": 0,
    "isolated": True,  # a bool is not a figure
}


def test_round_values_are_the_events_numeric_figures() -> None:
    assert round_values(ROUND) == {
        "round/train_loss": 2.5,
        "round/bytes_sent": 1024.0,
        "round/overlap_steps": 0.0,
        "round/contributors": 3.0,
    }


@pytest.mark.parametrize(
    ("loggers", "message"),
    [
        (["mlflow"], "node.loggers: expected distinct names of ('tensorboard', 'wandb'), got ['mlflow']"),
        (["wandb", "wandb"], "got ['wandb', 'wandb']"),
    ],
)
def test_bad_logger_names_are_config_errors(loggers: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config({"node": {"loggers": loggers}})
    assert message in str(caught.value)


def test_tensorboard_gets_every_round_event_the_event_log_writes(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = build_config({"node": {"loggers": ["tensorboard"]}})
    events = EventLog(tmp_path / "logs" / "agent.jsonl", ExperimentLoggers(config, tmp_path, name="a"))
    for round_id, loss in ((1, 4.0), (2, 3.5), (3, 3.25)):
        events.write("round", **{**ROUND, "round_id": round_id, "train_loss": loss})
    events.write("joined", peers=2)  # not a round: not logged
    events.close()
    accumulator = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("round/train_loss")] == [
        (1, 4.0),
        (2, 3.5),
        (3, 3.25),
    ]
    assert [e.value for e in accumulator.Scalars("round/contributors")] == [3.0, 3.0, 3.0]
    assert "round/eval_loss" not in accumulator.Tags()["scalars"]


WANDB_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from farloco.node.config import build_config
    from farloco.node.daemon.loggers import ExperimentLoggers
    config = build_config({"node": {"loggers": ["wandb"]}, "run": {"name": "wandb-test"}})
    loggers = ExperimentLoggers(config, Path(sys.argv[1]), name="node-a")
    for round_id in (1, 2, 3):
        loggers.event("round", {"round_id": round_id, "train_loss": 5.0 - round_id, "contributors": ["a"]})
    loggers.close()
    """
)


def test_wandb_offline_records_every_round(tmp_path: Path) -> None:
    """In a process of its own: wandb's service process lives as long as the process that started it."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    done = subprocess.run(
        [sys.executable, "-c", WANDB_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "logs" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    data = runs[0].read_bytes()
    # The run file holds one history record per round (plus the summary), each naming its keys.
    assert data.count(b"round/train_loss") >= 3 and data.count(b"round/contributors") >= 3
