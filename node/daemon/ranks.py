"""The trainer ranks: launched and supervised by torch's elastic launcher in a thread, fed through the
shared-memory hand-off (node/handoff.py), waited for, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from farloco.node.daemon.core import (
    RANK_STOP_FLOOR,
    AgentCore,
    AgentError,
)
from farloco.node.handoff import Handoff
from farloco.node.logs import console_format
from farloco.protocol.tasks import wait_for


class RanksAgent(AgentCore):
    """The trainer ranks' side of the agent (launch, supervise, publish work, wait, stop)."""

    def _start_trainers(self) -> None:
        from farloco.node.training.data import builtin_dataset

        run = self.config.run
        if run.dataset == "builtin":
            dataset = builtin_dataset(
                Path(os.environ.get("FARLOCO_CACHE", Path.home() / ".cache" / "farloco"))
            )
        else:
            dataset = Path(run.dataset)
        self.handoff = Handoff.create(self.num_params, self.config.node.num_ranks)
        # theta_outer lives in the hand-off from now on where the ranks simply load it (OuterRound.share_with),
        # unless the ranks train from another theta while a round is in flight (run.outer_update delayed/eager):
        # there the hand-off's theta is the reference of their next contribution, theta_outer a private vector.
        if run.outer_update == "sync":
            self.theta = self.outer.share_with(self.handoff.theta)
        self._trainer_thread = threading.Thread(
            target=self._supervise_trainers, args=(dataset,), name="farloco-trainers", daemon=True
        )
        self._trainer_thread.start()

    def _supervise_trainers(self, dataset: Path) -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        node = self.config.node
        log_dir = self.run_dir / "logs" / "trainer"
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
            # The ranks' output always lands in logs/trainer/; echoed on stderr only for text logs (a JSON
            # stderr must hold JSON lines only).
            logs_specs=DefaultLogsSpecs(
                log_dir=str(log_dir), tee=Std.ALL if console_format() == "text" else Std.NONE
            ),
        )
        args = (
            "-m",
            "farloco.node.training.trainer",
            "--handoff",
            str(self.handoff.path),
            "--config",
            str(self.run_dir / "config.toml"),
            "--dataset",
            str(dataset),
            "--slot",
            str(self.slot),
        )
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(node.threads_per_rank)
        self.launcher_failures.install()
        try:
            elastic_launch(launch, entrypoint=sys.executable)(*args)
        except BaseException as exc:
            self._trainer_error = exc
        finally:
            self.launcher_failures.uninstall()
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            self._trainers_exited.set()
            if self._loop is not None and self._leave_event is not None:
                self._loop.call_soon_threadsafe(self._leave_event.set)

    def _stop_trainers(self, timeout: float = 30.0) -> None:
        """Tell the ranks to stop and wait up to `timeout` seconds for them (a rank stuck in a collective or in
        a long step is then SIGKILLed, and the launcher, with STOP set, restarts none)."""
        if getattr(self, "handoff", None) is None or self._trainer_thread is None:
            return
        self.handoff.stop()
        # The ranks were told STOP when the leave was asked for; whatever the round's wind-down left of the
        # budget, a rank finishing its inner step gets RANK_STOP_FLOOR seconds more before it is SIGKILLed.
        if not self._trainers_exited.wait(timeout=max(RANK_STOP_FLOOR, timeout)):
            for rank in range(self.handoff.world_size):
                pid = self.handoff.report(rank).pid
                if pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self._trainers_exited.wait(timeout=2.0)

    def _publish_work(
        self, load: torch.Tensor | None, *, round_id: int, step_base: int, inner_steps: int
    ) -> int:
        """Hand the ranks their next sequence (`Handoff.publish`), adding the time they waited for it since
        their last one ended to `counters.ranks_idle_seconds`."""
        seq = self.handoff.publish(load, round_id=round_id, step_base=step_base, inner_steps=inner_steps)
        self._seq_plans = {s: plan for s, plan in self._seq_plans.items() if s > seq - 4}
        self._seq_plans[seq] = (step_base, inner_steps)
        if self._idle_since is not None:  # the ranks start once the publish (and its copy of theta) is done
            idle = time.monotonic() - self._idle_since
            self.counters.ranks_idle_seconds += idle
            self.metrics.ranks_idle.observe(idle)
            self._idle_since = None
        return seq

    def _cut_short(self, seq: int) -> bool:
        """Ask the ranks to end sequence `seq` after their current inner step if every other member of the
        round is ready and waits for us, and the steps already run make at least node.partial_min_fraction of
        the round's. Returns whether it asked."""
        step_base, planned = self._seq_plans.get(seq, (0, 0))
        inner_steps = self.config.run.inner_steps
        ran = max(self.handoff.report(r).inner_step for r in range(self.handoff.world_size)) - step_base
        # The round's steps already run before this sequence (streaming-diloco's overlapped tau) count too.
        share = (inner_steps - planned + max(ran, 0)) / inner_steps
        if not 0 < ran < planned or share < self.config.node.partial_min_fraction:
            return False
        if not self.matchmaker.waiting_for(self.round_id, self.peer_id):
            return False
        self.handoff.cut(seq)
        self.counters.partial_contributions += 1
        self.events.write("cut_short", round_id=self.round_id, at_step=ran, of=planned)
        return True

    def _trainer_failure(self) -> str | None:
        if self._trainers_exited.is_set() and self.handoff.command == 0:
            return f"trainer ranks exited ({self._trainer_error or 'without error'})"
        return None

    async def _wait_ranks(self, seq: int, *, partial: bool = False) -> bool:
        """Wait until every rank finished sequence `seq`; False if the node must leave now.

        `partial`: `seq` carries this round's contribution and may be cut short when the round's other members
        all wait for us (node.partial_contributions, `_cut_short`)."""
        asked = not (partial and self.config.node.partial_contributions)  # True: no cut to ask for (any more)
        next_check = 0.0
        while not self.handoff.all_done(seq):
            if not asked and time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.05
                asked = self._cut_short(seq)
            failure = self._trainer_failure()
            if failure:
                raise AgentError(f"{failure}; leaving the swarm")
            if self.leave_mode in ("graceful", "now"):
                return False
            assert self._leave_event is not None
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._leave_event.wait(), timeout=0.01)
            self._leave_event.clear()
        if self._idle_since is None:
            # The ranks wait for us from when the last of them reported done to the next publish; we may see it
            # late (a pass of the round in flight holds the event loop), so the time is theirs.
            done_ns = max(self.handoff.report(r).done_ns for r in range(self.handoff.world_size))
            late = time.time() - done_ns / 1e9 if done_ns else 0.0
            self._idle_since = time.monotonic() - min(max(late, 0.0), 3600.0)
        return True
