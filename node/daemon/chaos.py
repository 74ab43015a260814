"""Faults on purpose, in a real node: the FARLOCO_FAULTS plan (protocol/faults.py `parse_faults`; also
`farloco join --fault`) acted on where the round stands. For tests, the chaos scenarios and manual chaos."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import torch

from farloco.node.daemon.core import log
from farloco.node.daemon.outer import theta_hash
from farloco.node.daemon.snapshots import SnapshotAgent
from farloco.protocol.faults import PhaseFault


class ChaosAgent(SnapshotAgent):
    """The node's side of the fault plan (`self.faults`)."""

    _drop_task: asyncio.Future[None] | None = None
    _poisoned_round: int | None = None

    async def _phase_faults(self, phase: str, round_id: int | None = None) -> None:
        """Act on every phase fault of `phase` in `round_id` (default: the current round): at once, or `+offset`
        seconds into the phase from a timer (the phase goes on meanwhile). Each is logged and written as a
        `fault` event first, so a scenario can measure from it."""
        round_id = self.round_id if round_id is None else round_id
        for fault in self.faults.at(phase, round_id):
            if fault.action == "wrong":
                continue  # applied to the round's contribution (`_byzantine`)
            if fault.action == "corrupt":
                self.exchange.corrupt_rounds[round_id] = str(fault.value or "bytes")
                self.exchange.corrupt_rounds.pop(round_id - 8, None)
            if fault.offset and fault.action in ("crash", "hang", "drop"):
                asyncio.get_running_loop().call_later(fault.offset, self._fire, fault, round_id)
            elif fault.action == "delay":
                self.events.write("fault", round_id=round_id, phase=phase, fault=fault.spec)
                log.warning("fault injected: %s (round %d)", fault.spec, round_id)
                await asyncio.sleep(fault.offset + float(fault.value or 0.0))
            else:
                self._fire(fault, round_id)

    def _fire(self, fault: PhaseFault, round_id: int) -> None:
        self.events.write("fault", round_id=round_id, phase=fault.phase, fault=fault.spec)
        log.warning("fault injected: %s (round %d)", fault.spec, round_id)
        # The whole node when it leads its own process group (`farloco join` under a test, systemd, Slurm): the
        # ranks and the DHT daemon crash or freeze with the agent, as on a machine that dies or stalls.
        group = os.getpgid(0) == os.getpid()
        if fault.action == "crash":
            if group:
                os.killpg(os.getpid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "hang":
            # The SIGCONT comes from a process outside the frozen group (its own session). Python, not sh: dash's
            # kill takes neither `--` nor a process group reliably.
            resume = (
                "import os, signal, sys, time; time.sleep(float(sys.argv[1])); "
                "pid = int(sys.argv[2]); (os.killpg if sys.argv[3] == 'group' else os.kill)(pid, signal.SIGCONT)"
            )
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    resume,
                    str(float(fault.value or 0.0)),
                    str(os.getpid()),
                    "group" if group else "process",
                ],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if group:
                os.killpg(os.getpid(), signal.SIGSTOP)
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.action == "drop":
            from farloco.protocol.tcpstream import drop_all

            dropped = drop_all()
            self._drop_task = asyncio.ensure_future(self.client.close())  # every gRPC channel: calls fail
            log.warning("fault injected: dropped %d data-plane connections and every gRPC channel", dropped)

    async def _served_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The committed state donors serve (`_state_snapshot`: copies made under `_outer_lock`, never from a
        state half-way through a commit or an install). FARLOCO_FAULTS 'poison-state': a donor that serves joiners
        a wrong theta (its own, nudged) under a manifest and meta consistent with it, while its own rounds, records
        and checkpoints stay honest: what the joiner's check against the hashes the swarm vouches for must refuse.
        'poison-strategy-state': the swarm's theta beside a strategy state with a NaN (the same NaN on every such
        donor, so their manifests agree): what the joiner's check of what it would install must refuse."""
        meta, tensors = await self._state_snapshot()
        if not (self.faults.poison_state or self.faults.poison_strategy):
            return meta, tensors
        fault = "poison-state" if self.faults.poison_state else "poison-strategy-state"
        if self._poisoned_round != meta["round_id"]:
            self._poisoned_round = meta["round_id"]
            self.events.write("fault", round_id=meta["round_id"], phase="serve", fault=fault)
            log.warning("fault injected: serving a poisoned state of round %d (%s)", meta["round_id"], fault)
        if self.faults.poison_strategy:
            name = next(k for k, t in tensors.items() if k.startswith("strategy.") and t.is_floating_point())
            poisoned = tensors[name].clone()
            poisoned.view(-1)[0] = float("nan")
            return meta, {**tensors, name: poisoned}
        theta = tensors["theta"].clone()
        theta += 1e-2
        return {**meta, "outer_hash": theta_hash(theta)}, {**tensors, "theta": theta}

    def _save_fault(self, round_id: int) -> Any:
        """The `save` phase faults of `round_id` (crash, hang, delay), as the callback `save_checkpoint` calls once
        the checkpoint is durable under its temporary name and not yet renamed; None when there are none. It runs
        in the checkpoint's writer thread: a delay stalls the save, not the rounds."""
        faults = self.faults.at("save", round_id)
        if not faults:
            return None

        def fire() -> None:
            for fault in faults:
                if fault.action == "delay":
                    self.events.write("fault", round_id=round_id, phase="save", fault=fault.spec)
                    log.warning("fault injected: %s (round %d)", fault.spec, round_id)
                    time.sleep(fault.offset + float(fault.value or 0.0))
                elif fault.action in ("crash", "hang"):
                    time.sleep(fault.offset)
                    self._fire(fault, round_id)

        return fire

    def _state_fault(self) -> Any:
        """FARLOCO_FAULTS 'die-serving-state@N': SIGKILL this node once it has served N bytes of state, i.e. a
        donor that dies in the middle of a joiner's transfer."""
        limit = self.faults.die_serving_state
        if limit is None:
            return None

        def die(served: int) -> None:
            if served >= limit:
                log.warning("fault injected: dying after serving %d bytes of state", served)
                os.kill(os.getpid(), signal.SIGKILL)

        return die

    def _byzantine(self, contribution: torch.Tensor) -> torch.Tensor:
        """FARLOCO_FAULTS 'wrong=KIND@exchange[:ROUNDS]' (or 'byzantine=KIND': every round; farloco.optim
        ATTACKS): a Byzantine insider that sends a wrong-but-valid update in place of its own (what
        run.aggregator defends)."""
        wrong = [f for f in self.faults.at("exchange", self.round_id) if f.action == "wrong"]
        if not wrong:
            return contribution
        from farloco.optim import byzantine_update

        attack = str(wrong[0].value)
        sent = byzantine_update(attack, contribution, self._byzantine_stale)
        if self._byzantine_stale is None:
            log.warning("fault injected: a Byzantine update (%s) goes out", attack)
        self.events.write("fault", round_id=self.round_id, phase="exchange", fault=wrong[0].spec)
        self._byzantine_stale = contribution.clone()  # "stale" sends the round before's
        return sent

    def _honest_transmitted(self, contribution: torch.Tensor) -> torch.Tensor:
        """What the swarm would have seen of `contribution` had a Byzantine insider sent it (the codec's round
        trip): its error feedback is staged from that, so the wrong update stays in the rounds the fault plan
        names. From what it really sent, its residual carried about 1000 times its update into the rounds after
        and the attack went on there."""
        if self.codec.lossless:
            return contribution
        transmitted = torch.empty_like(contribution)
        self.codec.encode_decoded(contribution, checksum=False, out=transmitted)
        return transmitted

    async def _inject_faults(self) -> None:
        """FARLOCO_FAULTS 'corrupt-theta@R': after committing round R, nudge theta_outer so this node silently
        diverges and the hash check has to repair it."""
        if self.round_id not in self.faults.corrupt_theta:
            return
        async with self._outer_lock:  # never while a donor's snapshot copies theta
            self.theta[0] += 1e-3
            self.outer_hash = theta_hash(self.theta)
            self._snapshot = None
            log.warning("fault injected: theta_outer corrupted after round %d", self.round_id)
