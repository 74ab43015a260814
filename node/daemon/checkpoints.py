"""Checkpoints of a node: the committed outer state with the ranks' inner state beside it, written off the event
loop, pruned, and resumed from.

Rules:
- A checkpoint is written from the copies donors would be served (`OuterState.snapshot`), one at a time and in
  round order; an unfinished one stays a `.tmp-` directory, which is never loaded.
- Its inner/ (the ranks' sharded model and optimizer state) is there only when every rank saved it; otherwise
  the checkpoint holds the outer state alone and a resume starts the ranks with a fresh optimizer.
- A restarted node asks for the data slot its newest checkpoint trained, and resumes from its own checkpoint
  only when no member is ahead, or when that checkpoint holds the very state the swarm's members publish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from farloco.node.daemon.core import AgentError, NodeState, log
from farloco.node.daemon.outerstate import OuterState
from farloco.node.daemon.ranks import Ranks


class Checkpoints:
    """The node's checkpoints (see the module docstring). `durable(round_id)`: the callback the checkpoint writer
    calls once round `round_id`'s checkpoint is durable under its temporary name (the fault injector's), or
    None."""

    def __init__(
        self,
        state: NodeState,
        outer: OuterState,
        ranks: Ranks,
        durable: Callable[[int], Callable[[], None] | None] | None = None,
    ) -> None:
        self.state = state
        self.outer = outer
        self.ranks = ranks
        self.config = state.config
        self._durable = durable
        self.task: asyncio.Task[None] | None = None  # the checkpoint being written
        self.last: str | None = None  # the path of the last one written or resumed from
        self._inner_resume: Path | None = None  # verified inner/ of the checkpoint resumed from
        self.inner_load_task: asyncio.Task[None] | None = None

    async def save(self) -> None:
        """Write the checkpoint of the round just committed (`outer.round_id`), in the background: stage it and
        ask the ranks for their inner state now, copy the outer state, write both once the ranks saved theirs."""
        if self.task is not None:
            await self.task  # one at a time, in round order (and its prune before staging)
        staged, inner_seq = self._stage_inner()
        # The copies donors would be served: later rounds never touch them while the write goes on.
        _, tensors = await self.outer.snapshot()
        self.task = asyncio.create_task(self._write(tensors, staged, inner_seq))

    async def finish(self, timeout: float) -> None:
        """At shutdown: the checkpoint still being written gets `timeout` seconds; an unfinished one stays a
        .tmp- directory, which is never loaded."""
        if self.task is None:
            return
        done, _ = await asyncio.wait({self.task}, timeout=timeout)
        if not done:
            log.warning("the checkpoint in progress did not finish before leaving; it is discarded")
            from farloco.util.tasks import cancel_and_wait

            await cancel_and_wait(self.task, timeout=1.0)

    def _stage_inner(self) -> tuple[Path | None, int]:
        """Stage this round's checkpoint directory and ask the ranks to save their inner state into its inner/;
        they do it at their next sequence boundary. Returns (staged directory, request seq), or (None, 0)."""
        from farloco.node.checkpoint import INNER_DIR, CheckpointError, checkpoints_dir, stage_checkpoint
        from farloco.node.handoff import INNER_SAVE

        try:
            staged = stage_checkpoint(checkpoints_dir(self.state.run_dir), self.outer.round_id)
        except (CheckpointError, OSError) as exc:
            log.error("cannot stage the checkpoint of round %d: %s", self.outer.round_id, exc)
            return None, 0
        return staged, self.ranks.handoff.request_inner(INNER_SAVE, staged / INNER_DIR)

    async def _wait_inner(self, seq: int) -> dict[str, Any] | None:
        """Wait for every rank to serve inner-state request `seq`: its outcome, or None if the ranks are gone."""
        from farloco.node.handoff import INNER_FAILED, INNER_FRESH, INNER_OK

        while not self.ranks.handoff.inner_all_done(seq):
            if self.ranks.exited.is_set():
                return None
            await asyncio.sleep(0.05)
        reports = [self.ranks.handoff.report(r) for r in range(self.ranks.handoff.world_size)]
        names = {INNER_OK: "ok", INNER_FRESH: "fresh", INNER_FAILED: "failed"}
        return {
            "result": names.get(max(r.inner_result for r in reports), "?"),
            "optimizer_step": reports[0].optimizer_step,
            "optimizer_fingerprint": reports[0].optimizer_fingerprint,
        }

    def request_inner_load(self) -> None:
        """Resumed from a checkpoint with inner state: the ranks load it before their first sequence."""
        from farloco.node.handoff import INNER_LOAD

        if self._inner_resume is None:
            return
        seq = self.ranks.handoff.request_inner(INNER_LOAD, self._inner_resume)
        self.inner_load_task = asyncio.create_task(self._report_inner_load(seq, self._inner_resume))

    async def _report_inner_load(self, seq: int, directory: Path) -> None:
        outcome = await self._wait_inner(seq)
        if outcome is None:
            return
        if outcome["result"] != "ok":
            log.warning("the ranks could not load %s: they start with a fresh optimizer state", directory)
        self.state.events.write("inner_resumed", path=str(directory), **outcome)

    async def _write(
        self, tensors: dict[str, torch.Tensor], staged: Path | None = None, inner_seq: int = 0
    ) -> None:
        """Write the committed outer state `tensors` (the snapshot donors serve, taken at commit) off the event
        loop, then prune. With `staged`, first wait for the ranks to write their inner state into it (request
        `inner_seq`)."""
        import shutil

        from farloco.node.checkpoint import (
            INNER_DIR,
            CheckpointError,
            checkpoints_dir,
            prune_checkpoints,
            save_checkpoint,
        )

        round_id = self.outer.round_id
        waited = time.monotonic()
        inner = await self._wait_inner(inner_seq) if staged is not None else None
        if inner is not None:
            inner["seconds"] = time.monotonic() - waited  # the ranks' save, from request (commit) to done
        if staged is not None and (inner is None or inner["result"] != "ok"):
            # Never commit a partial inner/: the checkpoint holds the outer state alone, resuming uses fresh AdamW.
            if inner is None and self.state.leave_mode not in (None, "drain"):
                log.info(
                    "round %d's checkpoint holds the outer state only: the ranks stopped for the leave",
                    round_id,
                )
            else:
                log.error("the ranks did not save their inner state for round %d (%s)", round_id, inner)
            await asyncio.to_thread(shutil.rmtree, staged / INNER_DIR, True)
        meta = {
            "run_hash": self.state.run_hash,
            "inner_step": str(round_id * self.config.run.inner_steps),
            "run_name": self.config.run.name,
            # Where this node's data stands: its slot, and the next batch step of the slot's sampler (a pure
            # function of the step: a node resumed from this checkpoint reclaims the slot and goes on from there).
            "data_slot": str(self.state.slot),
            "data_step": str(round_id * self.config.run.inner_steps),
        }
        if inner is not None and inner["result"] == "ok":
            # What the inner/ holds, on disk with it (the checkpoint event below can be lost to a SIGKILL).
            meta["optimizer_step"] = str(inner["optimizer_step"])
            meta["optimizer_fingerprint"] = repr(float(inner["optimizer_fingerprint"]))
        root = checkpoints_dir(self.state.run_dir)
        started = time.monotonic()
        try:
            path = await asyncio.to_thread(
                save_checkpoint,
                root,
                round_id,
                tensors,
                meta,
                staged=staged,
                durable=self._durable(round_id) if self._durable is not None else None,
            )
            removed = await asyncio.to_thread(prune_checkpoints, root, self.config.checkpoint.keep)
        except (CheckpointError, OSError) as exc:  # a full disk must not stop training
            log.error("checkpoint of round %d failed: %s", round_id, exc)
            self.state.events.write("checkpoint_failed", round_id=round_id, error=str(exc))
            return
        self.last = str(path)
        self.state.events.write(
            "checkpoint",
            round_id=round_id,
            path=str(path),
            seconds=time.monotonic() - started,
            pruned=len(removed),
            inner=inner,
        )

    def saved_slot(self) -> int:
        """The data slot our newest checkpoint of this run trained (the slot our first claim asks for: a resumed
        node keeps its data while nobody else holds it), else node.data_slot (-1, NO_SLOT: any). Its metadata only:
        theta is read and verified once, when the node resumes (a broken newest checkpoint then falls back to an
        older one, whose node keeps the slot it claimed and goes on from that checkpoint's step)."""
        from farloco.node.checkpoint import CheckpointError, checkpoints_dir, newest_committed, read_metadata

        asked = self.config.node.data_slot  # -1 (any) when not set
        path = newest_committed(checkpoints_dir(self.state.run_dir))
        if path is None:
            return asked
        try:
            meta = read_metadata(path)
        except CheckpointError:
            return asked
        saved = meta.get("data_slot", "")
        if meta.get("run_hash") != self.state.run_hash or not saved.isdigit():
            return asked
        return int(saved) if int(saved) < self.config.run.data_slots else asked

    def holding(self, round_id: int, hashes: set[str]) -> Path | None:
        """Our newest loadable checkpoint if it holds round `round_id` with one of `hashes` (the outer hashes the
        swarm's members of that round publish): the swarm's very state, so a restarted node resumes it from disk
        instead of fetching it over the network (and keeps its own inner state and data position). Reads and
        hashes the checkpoint's theta: call it off the event loop."""
        from farloco.node.checkpoint import checkpoints_dir, latest_checkpoint, read_metadata

        path = latest_checkpoint(checkpoints_dir(self.state.run_dir))  # verified: theta read and hashed once
        if path is None:
            return None
        meta = read_metadata(path)
        if (
            int(meta["round_id"]) == round_id
            and meta["outer_hash"] in hashes
            and meta["run_hash"] == self.state.run_hash
        ):
            return path
        return None

    async def resume(self, path: Path | None = None) -> None:
        """Continue from `path`, or else from this run directory's newest loadable checkpoint, if any (no peer is
        ahead, or `holding` found ours holds the swarm's state). Read and installed off the event
        loop."""
        from farloco.node.checkpoint import (
            CheckpointError,
            checkpoints_dir,
            latest_checkpoint,
            load_checkpoint,
            verify_inner,
        )

        path = path or await asyncio.to_thread(latest_checkpoint, checkpoints_dir(self.state.run_dir))
        if path is None:
            return
        meta, tensors = await asyncio.to_thread(load_checkpoint, path)
        if meta["run_hash"] != self.state.run_hash:
            raise AgentError(
                f"{path} was written by run_hash {meta['run_hash'][:12]}, this config has "
                f"{self.state.run_hash[:12]}: use a new --run-dir for a new run"
            )
        await self.outer.install({"round_id": meta["round_id"], "run_hash": meta["run_hash"]}, tensors)
        self.last = str(path)
        # The slot was claimed before this (the claim started from the checkpoint's slot, `saved_slot`) and the
        # ranks already read it: it stays. A node that had to move goes on in its new slot from the same step.
        saved_slot = meta.get("data_slot", "")
        if saved_slot != str(self.state.slot):
            log.info(
                "resuming in data slot %d (the checkpoint trained slot %s, held by another member now)",
                self.state.slot,
                saved_slot or "?",
            )
        try:
            self._inner_resume = await asyncio.to_thread(verify_inner, path)
        except CheckpointError as exc:
            log.warning("%s: the ranks start with a fresh optimizer state", exc)
        self.state.events.write(
            "resumed",
            round_id=self.outer.round_id,
            checkpoint=str(path),
            data_slot=self.state.slot,
            data_step=self.outer.round_id * self.config.run.inner_steps,
        )
