"""The outer state at rest: the snapshot donors serve, installing a fetched one, checkpoints with the ranks'
inner state, and resuming from the newest checkpoint."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from farloco.node.config import diff_run, run_section
from farloco.node.daemon.core import (
    AgentError,
    log,
)
from farloco.node.daemon.outer import theta_hash
from farloco.node.daemon.ranks import RanksAgent
from farloco.optim.strategies import StrategyError


class SnapshotAgent(RanksAgent):
    """Snapshots, checkpoints and resume."""

    async def _state_snapshot(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The committed state as donors serve it and checkpoints write it: copies, made on the first request
        for this state (a joiner's, or a checkpoint due) and kept until the state changes. A node no joiner
        asks and no checkpoint is due costs no copy per round. The copies (12 bytes per parameter with
        diloco: 12 GB at 1B) are made on the outer thread under `_outer_lock`: the event loop serves the swarm
        meanwhile, and no commit or install changes the state half-way through them."""
        async with self._outer_lock:
            if self._snapshot is not None and self._snapshot[0]["round_id"] == self.round_id:
                return self._snapshot
            meta = {
                "round_id": self.round_id,
                "run_hash": self.run_hash,
                "outer_hash": self.outer_hash,
                "run_config": run_section(self.config),
            }
            tensors, cancelled = await self._on_outer_thread(self.outer.snapshot)
            snapshot = self._snapshot = (meta, tensors)
        if cancelled:
            raise asyncio.CancelledError
        return snapshot

    def _load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
        """Check a fetched or resumed state against our run and copy it into the outer state: theta's hash.
        Nothing is changed when a check fails. Runs on the outer thread (`_install`)."""
        if meta.get("run_hash") != self.run_hash:
            theirs = meta.get("run_config", {})
            raise AgentError(
                "donor serves another run: " + "; ".join(diff_run(run_section(self.config), theirs) or ["?"])
            )
        theta = tensors.get("theta")
        if theta is None or theta.shape != self.theta.shape or theta.dtype != torch.float32:
            got = None if theta is None else f"{theta.dtype}{list(theta.shape)}"
            raise AgentError(f"donor state: expected theta float32[{self.num_params}], got {got}")
        try:
            self.strategy.load_state_dict(_strategy_part(tensors))  # checks everything before it writes
        except StrategyError as exc:
            raise AgentError(f"donor state: {exc}") from None
        self.theta.copy_(theta)
        return theta_hash(self.theta)

    def _state_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Name -> (dtype, shape) of every tensor of the state we serve and install (`outer.snapshot`)."""
        layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            "theta": (torch.float32, (self.num_params,))
        }
        layout.update({f"strategy.{k}": v for k, v in self.strategy.state_layout().items()})
        return layout

    def _state_problem(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str | None:
        """What keeps a fetched state from being installed (`_load_state` would refuse it), or None: a donor's
        strategy state of the wrong layout, with NaN/Inf or a negative round count. Reads every value: called
        in a worker thread (statesync.fetch_state's `check`)."""
        try:
            self.strategy.check_state_dict(_strategy_part(tensors))
        except StrategyError as exc:
            return str(exc)
        return None

    async def _install(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Make `tensors` (a donor's, or a checkpoint's) our outer state at round `meta['round_id']`. The copies
        and the digest (seconds at 1B) run on the outer thread under `_outer_lock`, like a commit: the event
        loop serves meanwhile, and a donor's snapshot never copies a state half-way installed."""
        async with self._outer_lock:
            outer_hash, cancelled = await self._on_outer_thread(self._load_state, meta, tensors)
            self.round_id = int(meta["round_id"])
            # No exchange yet when a node resumes its checkpoint at start.
            exchange = getattr(self, "exchange", None)
            if exchange is not None:
                exchange.advance(self.round_id)
            self.outer_hash = outer_hash
            self._snapshot = None
        if cancelled:
            raise asyncio.CancelledError

    def _stage_inner(self) -> tuple[Path | None, int]:
        """Stage this round's checkpoint directory and ask the ranks to save their inner state into its inner/;
        they do it at their next sequence boundary. Returns (staged directory, request seq), or (None, 0)."""
        from farloco.node.checkpoint import INNER_DIR, CheckpointError, checkpoints_dir, stage_checkpoint
        from farloco.node.handoff import INNER_SAVE

        try:
            staged = stage_checkpoint(checkpoints_dir(self.run_dir), self.round_id)
        except (CheckpointError, OSError) as exc:
            log.error("cannot stage the checkpoint of round %d: %s", self.round_id, exc)
            return None, 0
        return staged, self.handoff.request_inner(INNER_SAVE, staged / INNER_DIR)

    async def _wait_inner(self, seq: int) -> dict[str, Any] | None:
        """Wait for every rank to serve inner-state request `seq`: its outcome, or None if the ranks are gone."""
        from farloco.node.handoff import INNER_FAILED, INNER_FRESH, INNER_OK

        while not self.handoff.inner_all_done(seq):
            if self._trainers_exited.is_set():
                return None
            await asyncio.sleep(0.05)
        reports = [self.handoff.report(r) for r in range(self.handoff.world_size)]
        names = {INNER_OK: "ok", INNER_FRESH: "fresh", INNER_FAILED: "failed"}
        return {
            "result": names.get(max(r.inner_result for r in reports), "?"),
            "optimizer_step": reports[0].optimizer_step,
            "optimizer_fingerprint": reports[0].optimizer_fingerprint,
        }

    def _request_inner_load(self) -> None:
        """Resumed from a checkpoint with inner state: the ranks load it before their first sequence."""
        from farloco.node.handoff import INNER_LOAD

        if self._inner_resume is None:
            return
        seq = self.handoff.request_inner(INNER_LOAD, self._inner_resume)
        self._inner_load_task = asyncio.create_task(self._report_inner_load(seq, self._inner_resume))

    async def _report_inner_load(self, seq: int, directory: Path) -> None:
        outcome = await self._wait_inner(seq)
        if outcome is None:
            return
        if outcome["result"] != "ok":
            log.warning("the ranks could not load %s: they start with a fresh optimizer state", directory)
        self.events.write("inner_resumed", path=str(directory), **outcome)

    async def _checkpoint(
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

        round_id = self.round_id
        waited = time.monotonic()
        inner = await self._wait_inner(inner_seq) if staged is not None else None
        if inner is not None:
            inner["seconds"] = time.monotonic() - waited  # the ranks' save, from request (commit) to done
        if staged is not None and (inner is None or inner["result"] != "ok"):
            # Never commit a partial inner/: the checkpoint holds the outer state alone, resuming uses fresh AdamW.
            if inner is None and self.leave_mode not in (None, "drain"):
                log.info(
                    "round %d's checkpoint holds the outer state only: the ranks stopped for the leave",
                    round_id,
                )
            else:
                log.error("the ranks did not save their inner state for round %d (%s)", round_id, inner)
            await asyncio.to_thread(shutil.rmtree, staged / INNER_DIR, True)
        meta = {
            "run_hash": self.run_hash,
            "inner_step": str(round_id * self.config.run.inner_steps),
            "run_name": self.config.run.name,
            # Where this node's data stands: its slot, and the next batch step of the slot's sampler (a pure
            # function of the step: a node resumed from this checkpoint reclaims the slot and goes on from there).
            "data_slot": str(self.slot),
            "data_step": str(round_id * self.config.run.inner_steps),
        }
        if inner is not None and inner["result"] == "ok":
            # What the inner/ holds, on disk with it (the checkpoint event below can be lost to a SIGKILL).
            meta["optimizer_step"] = str(inner["optimizer_step"])
            meta["optimizer_fingerprint"] = repr(float(inner["optimizer_fingerprint"]))
        root = checkpoints_dir(self.run_dir)
        started = time.monotonic()
        try:
            path = await asyncio.to_thread(
                save_checkpoint,
                root,
                round_id,
                tensors,
                meta,
                staged=staged,
                durable=self._on_durable(round_id) if self._on_durable is not None else None,
            )
            removed = await asyncio.to_thread(prune_checkpoints, root, self.config.checkpoint.keep)
        except (CheckpointError, OSError) as exc:  # a full disk must not stop training
            log.error("checkpoint of round %d failed: %s", round_id, exc)
            self.events.write("checkpoint_failed", round_id=round_id, error=str(exc))
            return
        self.last_checkpoint = str(path)
        self.events.write(
            "checkpoint",
            round_id=round_id,
            path=str(path),
            seconds=time.monotonic() - started,
            pruned=len(removed),
            inner=inner,
        )

    def _saved_slot(self) -> int:
        """The data slot our newest checkpoint of this run trained (the slot our first claim asks for: a resumed
        node keeps its data while nobody else holds it), else node.data_slot (-1, NO_SLOT: any). Its metadata only:
        theta is read and verified once, when the node resumes (a broken newest checkpoint then falls back to an
        older one, whose node keeps the slot it claimed and goes on from that checkpoint's step)."""
        from farloco.node.checkpoint import CheckpointError, checkpoints_dir, newest_committed, read_metadata

        asked = self.config.node.data_slot  # -1 (any) when not set
        path = newest_committed(checkpoints_dir(self.run_dir))
        if path is None:
            return asked
        try:
            meta = read_metadata(path)
        except CheckpointError:
            return asked
        saved = meta.get("data_slot", "")
        if meta.get("run_hash") != self.run_hash or not saved.isdigit():
            return asked
        return int(saved) if int(saved) < self.config.run.data_slots else asked

    def _checkpoint_holding(self, round_id: int, hashes: set[str]) -> Path | None:
        """Our newest loadable checkpoint if it holds round `round_id` with one of `hashes` (the outer hashes the
        swarm's members of that round publish): the swarm's very state, so a restarted node resumes it from disk
        instead of fetching it over the network (and keeps its own inner state and data position). Reads and
        hashes the checkpoint's theta: call it off the event loop."""
        from farloco.node.checkpoint import checkpoints_dir, latest_checkpoint, read_metadata

        path = latest_checkpoint(checkpoints_dir(self.run_dir))  # verified: theta read and hashed once
        if path is None:
            return None
        meta = read_metadata(path)
        if (
            int(meta["round_id"]) == round_id
            and meta["outer_hash"] in hashes
            and meta["run_hash"] == self.run_hash
        ):
            return path
        return None

    async def _resume_from_checkpoint(self, path: Path | None = None) -> None:
        """Continue from `path`, or else from this run directory's newest loadable checkpoint, if any (no peer is
        ahead, or `_checkpoint_holding` found ours holds the swarm's state). Read and installed off the event
        loop."""
        from farloco.node.checkpoint import (
            CheckpointError,
            checkpoints_dir,
            latest_checkpoint,
            load_checkpoint,
            verify_inner,
        )

        path = path or await asyncio.to_thread(latest_checkpoint, checkpoints_dir(self.run_dir))
        if path is None:
            return
        meta, tensors = await asyncio.to_thread(load_checkpoint, path)
        if meta["run_hash"] != self.run_hash:
            raise AgentError(
                f"{path} was written by run_hash {meta['run_hash'][:12]}, this config has "
                f"{self.run_hash[:12]}: use a new --run-dir for a new run"
            )
        await self._install({"round_id": meta["round_id"], "run_hash": meta["run_hash"]}, tensors)
        self.last_checkpoint = str(path)
        # The slot was claimed before this (the claim started from the checkpoint's slot, `_saved_slot`) and the
        # ranks already read it: it stays. A node that had to move goes on in its new slot from the same step.
        saved_slot = meta.get("data_slot", "")
        if saved_slot != str(self.slot):
            log.info(
                "resuming in data slot %d (the checkpoint trained slot %s, held by another member now)",
                self.slot,
                saved_slot or "?",
            )
        try:
            self._inner_resume = await asyncio.to_thread(verify_inner, path)
        except CheckpointError as exc:
            log.warning("%s: the ranks start with a fresh optimizer state", exc)
        self.events.write(
            "resumed",
            round_id=self.round_id,
            checkpoint=str(path),
            data_slot=self.slot,
            data_step=self.round_id * self.config.run.inner_steps,
        )


def _strategy_part(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The strategy's state in a served or saved state (its `strategy.` tensors, without the prefix)."""
    return {k.removeprefix("strategy."): v for k, v in tensors.items() if k.startswith("strategy.")}
