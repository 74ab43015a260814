"""node.loggers: the per-round figures of logs/agent.jsonl also go to TensorBoard and wandb (offline), read back
from what each wrote."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from farloco.node.config import ConfigError, build_config
from farloco.node.daemon.core import EventLog
from farloco.node.daemon.loggers import ExperimentLoggers, round_values, step_values, wandb_run_id

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


def test_tensorboard_one_run_per_node_gets_every_round_and_steps_event(tmp_path: Path) -> None:
    """A node's TensorBoard run is <run-dir>/logs/tensorboard/<run.name>/<node>, opened once its peer id is
    known; round/* against the round id, step/* (node.log_every_steps) against the inner step. A restarted
    node appends to the same run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = build_config({"node": {"loggers": ["tensorboard"]}, "run": {"name": "tb-test"}})
    peer = "QmNodeAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    events = EventLog(tmp_path / "logs" / "agent.jsonl", ExperimentLoggers(config, tmp_path))
    events.write("round", **{**ROUND, "round_id": 0})  # before `started`: no run to log to yet
    events.write("started", peer_id=peer)
    for round_id, loss in ((1, 4.0), (2, 3.5)):
        events.write("round", **{**ROUND, "round_id": round_id, "train_loss": loss})
    events.write("steps", inner_step=10, loss=4.5, tokens_per_second=1000.0, seconds=0.5, round_id=1)
    events.write(
        "steps", inner_step=20, loss=4.25, tokens_per_second=1100.0, mfu=0.4, seconds=0.5, round_id=1
    )
    events.write("joined", peers=2)  # neither a round nor steps: not logged
    events.close()
    restarted = EventLog(tmp_path / "logs" / "agent.jsonl", ExperimentLoggers(config, tmp_path))
    restarted.write("started", peer_id=peer)
    restarted.write("round", **{**ROUND, "round_id": 3, "train_loss": 3.25})
    restarted.close()
    runs = [p for p in (tmp_path / "logs" / "tensorboard").glob("*/*") if p.is_dir()]
    assert runs == [tmp_path / "logs" / "tensorboard" / "tb-test" / peer[:16]], runs
    accumulator = EventAccumulator(str(runs[0]))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("round/train_loss")] == [
        (1, 4.0),
        (2, 3.5),
        (3, 3.25),
    ]
    assert [e.value for e in accumulator.Scalars("round/contributors")] == [3.0, 3.0, 3.0]
    assert "round/eval_loss" not in accumulator.Tags()["scalars"]
    assert [(e.step, e.value) for e in accumulator.Scalars("step/loss")] == [(10, 4.5), (20, 4.25)]
    assert [(e.step, e.value) for e in accumulator.Scalars("step/tokens_per_second")] == [
        (10, 1000.0),
        (20, 1100.0),
    ]
    assert [(e.step, round(e.value, 6)) for e in accumulator.Scalars("step/mfu")] == [(20, 0.4)]


def test_step_values_are_the_figures_of_a_steps_event() -> None:
    fields = {"inner_step": 40, "loss": 2.0, "tokens_per_second": 10.0, "mfu": math.nan, "round_id": 2}
    assert step_values(fields) == {"step/loss": 2.0, "step/tokens_per_second": 10.0}


WANDB_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from farloco.node.config import build_config
    from farloco.node.daemon.loggers import ExperimentLoggers
    config = build_config({"node": {"loggers": ["wandb"]}, "run": {"name": "wandb-test"}})
    loggers = ExperimentLoggers(config, Path(sys.argv[1]))
    loggers.event("round", {"round_id": 0, "train_loss": 9.0})  # before the peer id is known: not a run yet
    loggers.event("started", {"peer_id": sys.argv[2]})
    first = int(sys.argv[3])
    for round_id in range(first, first + 3):
        loggers.event("round", {"round_id": round_id, "train_loss": 5.0 - round_id, "contributors": ["a"]})
        loggers.event("steps", {"inner_step": 10 * round_id, "loss": 4.0, "tokens_per_second": 99.0})
    loggers.close()
    """
)


def _wandb_node(run_dir: Path, peer_id: str, first_round: int) -> None:
    """One node's process: wandb's service process lives as long as the process that started it."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    env.pop("WANDB_PROJECT", None)
    done = subprocess.run(
        [sys.executable, "-c", WANDB_SCRIPT, str(run_dir), peer_id, str(first_round)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_wandb_offline_one_run_per_node_in_the_swarms_group_resumed_after_a_restart(tmp_path: Path) -> None:
    """Two nodes of one run, the first restarted: each node is one wandb run with a stable id (resumed after
    the restart), named by its peer id, in group = run.name; every round is recorded."""
    a, b = tmp_path / "a", tmp_path / "b"
    _wandb_node(a, "QmNodeAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", 1)
    _wandb_node(a, "QmNodeAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", 4)  # the restart, same identity
    _wandb_node(b, "QmNodeBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB", 1)
    id_a = wandb_run_id("wandb-test", "QmNodeAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA")
    id_b = wandb_run_id("wandb-test", "QmNodeBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB")
    assert id_a != id_b
    runs_a = sorted((a / "logs" / "wandb" / "wandb").glob("offline-run-*"))
    runs_b = sorted((b / "logs" / "wandb" / "wandb").glob("offline-run-*"))

    # wandb's offline folders are named by the run id (offline-run-TIME-ID, and -N after it when a run of the same
    # id started within the same second: wandb.init's x_sync_dir_suffix, as a fast restart does), and each holds
    # run-ID.wandb: the restart wrote to the same run, the other node its own
    def named(run: Path, run_id: str) -> bool:
        return (
            re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", run.name) is not None
            and (run / f"run-{run_id}.wandb").is_file()
        )

    assert len(runs_a) == 2 and all(named(r, id_a) for r in runs_a), runs_a
    assert len(runs_b) == 1 and named(runs_b[0], id_b), runs_b
    data = b"".join(f.read_bytes() for r in runs_a for f in r.glob("run-*.wandb"))
    # one history record per round (plus the summary), each naming its keys; the round before `started` is not
    assert data.count(b"round/train_loss") >= 6 and data.count(b"round/contributors") >= 6
    # per-inner-step figures on their own x axis (inner_step), beside the rounds' (round)
    assert (
        data.count(b"step/loss") >= 6 and b"inner_step" in data and data.count(b"step/tokens_per_second") >= 6
    )
    assert b"wandb-test" in data and b"QmNodeAAAAAAAAAA" in data  # the group (run.name) and the node's name
