"""The trainer ranks: launched and supervised by torch's elastic launcher in a thread, fed through the
shared-memory hand-off (node/handoff.py), waited for, read, stopped.

Rules:
- The ranks start once the node knows its data slot (`start`), and load theta_outer from the hand-off at the
  start of each sequence the agent publishes (`publish`); nothing else tells them what to train.
- The time the ranks wait for the agent between two sequences is counted (`counters.ranks_idle_seconds`).
- A sequence may be cut short only when the round's other members all wait for us and the steps already run
  make node.partial_min_fraction of the round's (`wait(cut=...)`); it then carries its share of the steps.
- Leaving tells the ranks STOP at once; a rank still running RANK_STOP_FLOOR seconds after the leave's budget is
  SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from farloco.node.daemon.core import RANK_STOP_FLOOR, AgentError, NodeState, log
from farloco.node.daemon.outerstate import OuterState
from farloco.node.handoff import COMMAND_STOP, Handoff, RankReport
from farloco.node.logs import LauncherFailures, console_format
from farloco.util.tasks import wait_for


class Ranks:
    """The node's trainer ranks (see the module docstring). `handoff` exists from `start` on."""

    def __init__(self, state: NodeState, outer: OuterState) -> None:
        self.state = state
        self.outer = outer
        self.config = state.config
        self._handoff: Handoff | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.exited = threading.Event()
        self.failures = LauncherFailures(self.config.node.max_restarts, on_failure=self._on_failure)
        # Published sequence -> (step_base, inner_steps asked); the share of the round's steps a sequence the
        # agent cut short carries (`seq_weight`, 1 when it ran in full) is read from the ranks' reports.
        self._seq_plans: dict[int, tuple[int, int]] = {}
        self.seq_weight = 1.0
        self.seq_inner_step = 0  # the ranks' inner steps at the end of the last sequence read
        self._interval_step = 0  # the last interval of node.log_every_steps returned by `interval`
        self._idle_since: float | None = (
            None  # when the ranks last finished a sequence we have not followed up
        )

    @property
    def handoff(self) -> Handoff:
        if self._handoff is None:
            raise AgentError("the trainer ranks have not started")
        return self._handoff

    def reports(self) -> list[RankReport]:
        """Every rank's last report (none before the ranks started)."""
        handoff = self._handoff
        return [handoff.report(r) for r in range(handoff.world_size)] if handoff is not None else []

    def tokens_per_second(self) -> float | None:
        """The node's training tokens/s in its last sequence's inner steps (None before one was timed): the
        ranks step in lockstep (FSDP collectives), so its batch per the slowest rank's mean step time."""
        step_seconds = max((r.step_seconds for r in self.reports()), default=0.0)
        run = self.config.run
        return run.batch_size * run.seq_len / step_seconds if step_seconds > 0 else None

    def interval(self, flops_per_token: float) -> dict[str, float | int] | None:
        """The ranks' last whole interval of node.log_every_steps inner steps (`IntervalLog` in the trainer),
        once every rank wrote the same one and it is newer than the last returned; None otherwise. The node's
        figures: mean loss over the ranks, tokens/s (tokens of the dp ranks over the slowest rank's time) and,
        where every rank knows its device's peak, MFU."""
        reports = self.reports()
        if not reports:
            return None
        steps = {r.log_step for r in reports}
        if len(steps) != 1 or (step := steps.pop()) <= self._interval_step:
            return None
        again = {r.log_step for r in self.reports()}
        if again != {step}:  # a rank wrote the next interval while we read: read it the next time
            return None
        self._interval_step = step
        seconds = max(r.log_seconds for r in reports)
        tokens = sum(r.log_tokens for r in reports) / self.config.node.tp  # tp ranks share their batches
        figures: dict[str, float | int] = {
            "inner_step": step,
            "loss": sum(r.log_loss for r in reports) / len(reports),
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "seconds": seconds,
        }
        peak = sum(r.peak_flops for r in reports)
        if seconds > 0 and flops_per_token > 0 and all(r.peak_flops > 0 for r in reports):
            figures["mfu"] = figures["tokens_per_second"] * flops_per_token / peak
        return figures

    async def watch_intervals(self, poll: float = 0.2) -> None:
        """node.log_every_steps: a 'steps' event (agent.jsonl and the experiment loggers) for each interval of
        inner steps the ranks finish, looked for every `poll` seconds until cancelled."""
        from farloco.node.training.flops import module_flops_per_token
        from farloco.node.training.models import meta_spec

        run = self.config.run
        flops_per_token = module_flops_per_token(meta_spec(run.model).module, run.seq_len)
        while True:
            figures = self.interval(flops_per_token)
            if figures is not None:
                self.state.events.write("steps", round_id=self.outer.round_id, **figures)
            await asyncio.sleep(poll)

    # -- start, supervise, stop -------------------------------------------------------------------------------

    def start(self, slot: int) -> None:
        """Create the hand-off and launch the ranks (in a thread) on data slot `slot`."""
        from farloco.node.training.data import builtin_dataset

        run = self.config.run
        if run.dataset == "builtin":
            dataset = builtin_dataset(
                Path(os.environ.get("FARLOCO_CACHE", Path.home() / ".cache" / "farloco"))
            )
        else:
            dataset = Path(run.dataset)
        self._handoff = Handoff.create(self.outer.num_params, self.config.node.num_ranks)
        # theta_outer lives in the hand-off from now on where the ranks simply load it (OuterRound.share_with),
        # unless the ranks train from another theta while a round is in flight (run.outer_update delayed/eager):
        # there the hand-off's theta is the reference of their next contribution, theta_outer a private vector.
        if run.outer_update == "sync":
            self.outer.round.share_with(self._handoff.theta)
        self._thread = threading.Thread(
            target=self._supervise, args=(dataset, slot), name="farloco-trainers", daemon=True
        )
        self._thread.start()

    def _supervise(self, dataset: Path, slot: int) -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        node = self.config.node
        log_dir = self.state.run_dir / "logs" / "trainer"
        log_dir.mkdir(parents=True, exist_ok=True)
        launch = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=node.num_ranks,
            run_id=f"farloco-{os.getpid()}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            rdzv_configs={"is_host": True},
            max_restarts=node.max_restarts,
            monitor_interval=0.2,
            start_method="spawn",
            local_addr="127.0.0.1",
            # The ranks' output always lands in logs/trainer/ (redirects); echoed on stderr only for text logs
            # (a JSON stderr must hold JSON lines only). Without the redirect torchelastic hands the ranks the
            # agent's own stderr, and a rank's last words (a traceback, "the agent is gone") broke the JSON.
            logs_specs=DefaultLogsSpecs(
                log_dir=str(log_dir),
                redirects=Std.ALL,
                tee=Std.ALL if console_format() == "text" else Std.NONE,
            ),
        )
        args = (
            "-m",
            "farloco.node.training.trainer",
            "--handoff",
            str(self.handoff.path),
            "--config",
            str(self.state.run_dir / "config.toml"),
            "--dataset",
            str(dataset),
            "--slot",
            str(slot),
            "--agent-pid",
            str(os.getpid()),
        )
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(node.threads_per_rank)
        self.failures.install()
        try:
            elastic_launch(launch, entrypoint=sys.executable)(*args)
        except BaseException as exc:
            self._error = exc
        finally:
            self.failures.uninstall()
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            self.exited.set()
            self.state.wake()

    def _on_failure(self, reason: str) -> None:
        """Called from the launcher's thread for each failed rank group."""
        if self._handoff is not None and self._handoff.command == COMMAND_STOP:
            # We told the ranks to stop (a leave): one that did not in time was ended by us, and the ranks the
            # launcher starts again see STOP and exit at once. Part of the leave, not a failure.
            log.info("trainer %s while the node stops its ranks", reason)
            self.state.events.write("trainer_stopped", reason=reason)
            return
        restarting = self.failures.failures <= self.failures.max_restarts
        log.warning(
            "trainer %s; %s", reason, "the launcher restarts the ranks" if restarting else "no restarts left"
        )
        self.state.events.write(
            "trainer_failed", reason=reason, restarts=self.failures.restarts, restarting=restarting
        )

    def request_stop(self) -> None:
        """Tell the ranks to stop after the step they are in (one write to the hand-off's header)."""
        if self._handoff is not None:
            self._handoff.stop()

    def stop(self, timeout: float = 30.0) -> None:
        """Tell the ranks to stop and wait up to `timeout` seconds for them (a rank stuck in a collective or in
        a long step is then SIGKILLed, and the launcher, with STOP set, restarts none)."""
        if self._handoff is None or self._thread is None:
            return
        self._handoff.stop()
        # The ranks were told STOP when the leave was asked for; whatever the round's wind-down left of the
        # budget, a rank finishing its inner step gets RANK_STOP_FLOOR seconds more before it is SIGKILLed.
        if not self.exited.wait(timeout=max(RANK_STOP_FLOOR, timeout)):
            for report in self.reports():
                if report.pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(report.pid, signal.SIGKILL)
            self.exited.wait(timeout=2.0)

    def close(self) -> None:
        if self._handoff is not None:
            self._handoff.close()

    def failure(self) -> str | None:
        if self.exited.is_set() and self.handoff.command == 0:
            return f"trainer ranks exited ({self._error or 'without error'})"
        return None

    # -- sequences --------------------------------------------------------------------------------------------

    def publish(self, load: torch.Tensor | None, *, round_id: int, step_base: int, inner_steps: int) -> int:
        """Hand the ranks their next sequence (`Handoff.publish`), adding the time they waited for it since
        their last one ended to `counters.ranks_idle_seconds`."""
        seq = self.handoff.publish(load, round_id=round_id, step_base=step_base, inner_steps=inner_steps)
        self._seq_plans = {s: plan for s, plan in self._seq_plans.items() if s > seq - 4}
        self._seq_plans[seq] = (step_base, inner_steps)
        if self._idle_since is not None:  # the ranks start once the publish (and its copy of theta) is done
            idle = time.monotonic() - self._idle_since
            self.state.counters.ranks_idle_seconds += idle
            self.state.metrics.ranks_idle.observe(idle)
            self._idle_since = None
        return seq

    def _cut_short(self, seq: int, round_id: int, others_wait: Callable[[], bool]) -> bool:
        """Ask the ranks to end sequence `seq` after their current inner step if every other member of the
        round waits for us (`others_wait()`), and the steps already run make at least
        node.partial_min_fraction of the round's. Returns whether it asked."""
        step_base, planned = self._seq_plans.get(seq, (0, 0))
        inner_steps = self.config.run.inner_steps
        ran = max(r.inner_step for r in self.reports()) - step_base
        # The round's steps already run before this sequence (streaming-diloco's overlapped tau) count too.
        share = (inner_steps - planned + max(ran, 0)) / inner_steps
        if not 0 < ran < planned or share < self.config.node.partial_min_fraction:
            return False
        if not others_wait():
            return False
        self.handoff.cut(seq)
        self.state.counters.partial_contributions += 1
        self.state.events.write("cut_short", round_id=round_id, at_step=ran, of=planned)
        return True

    async def wait(
        self, seq: int, *, round_id: int = 0, others_wait: Callable[[], bool] | None = None
    ) -> bool:
        """Wait until every rank finished sequence `seq`; False if the node must leave now.

        `others_wait`: `seq` carries round `round_id`'s contribution and may be cut short once that says the
        round's other members all wait for us (node.partial_contributions)."""
        state = self.state
        # True: no cut to ask for (any more)
        asked = others_wait is None or not self.config.node.partial_contributions
        next_check = 0.0
        while not self.handoff.all_done(seq):
            if not asked and time.monotonic() >= next_check:
                assert others_wait is not None
                next_check = time.monotonic() + 0.05
                asked = self._cut_short(seq, round_id, others_wait)
            failure = self.failure()
            if failure:
                raise AgentError(f"{failure}; leaving the swarm")
            if state.leave_mode in ("graceful", "now"):
                return False
            assert state.leave_event is not None
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(state.leave_event.wait(), timeout=0.01)
            state.leave_event.clear()
        if self._idle_since is None:
            # The ranks wait for us from when the last of them reported done to the next publish; we may see it
            # late (a pass of the round in flight holds the event loop), so the time is theirs.
            done_ns = max(r.done_ns for r in self.reports())
            late = time.time() - done_ns / 1e9 if done_ns else 0.0
            self._idle_since = time.monotonic() - min(max(late, 0.0), 3600.0)
        return True

    def read_reports(self, seq: int) -> None:
        """The ranks' train loss of sequence `seq` and the held-out loss of the theta it started from."""
        state = self.state
        reports = self.reports()
        state.train_loss = sum(r.train_loss for r in reports) / len(reports)
        state.inner_lr = max(r.inner_lr for r in reports)  # the same on every rank (the swarm's step)
        self.seq_inner_step = max(r.inner_step for r in reports)
        # A sequence cut short (a partial contribution) carries its share of the round's steps.
        _, planned = self._seq_plans.get(seq, (0, 0))
        ran = min(r.seq_steps for r in reports)
        inner_steps = self.config.run.inner_steps
        self.seq_weight = 1.0 if ran >= planned else (inner_steps - planned + ran) / inner_steps
        step_seconds = max(r.step_seconds for r in reports)
        # The ranks step in lockstep: the slowest rank's mean step time is the node's (0: none timed yet).
        state.inner_step_seconds = step_seconds
        if step_seconds > 0:
            state.metrics.inner_step_duration.observe(step_seconds)
        evals = [r.eval_loss for r in reports if r.eval_seq == seq]
        if evals:
            state.eval_loss = evals[0]
