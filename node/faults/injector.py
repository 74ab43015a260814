"""A node's side of its fault plan (node/faults/plan.py): made by the agent only when FARLOCO_FAULTS (or
`farloco join --fault`) asks for something, and acting only through what the agent hands it: the wrappers it puts
in front of the node's collaborators (node/faults/wrappers.py), the phase hook the round runner calls as each
phase of a round begins, the checkpoint writer's `durable` callback, and the state server's snapshot and
`on_served` callbacks. A node with no plan has none of these in its path."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from farloco.node.faults.plan import FaultPlan, PhaseFault
from farloco.node.faults.wrappers import ByzantineExchange, CorruptingClient, CorruptingOuter, FlakyDHT

log = logging.getLogger("farloco.agent")

Snapshot = tuple[dict[str, Any], dict[str, torch.Tensor]]


class FaultInjector:
    """The faults of `plan` acted on in one node. `events` is the node's event log (each fault is written as a
    `fault` event before it acts, so a scenario can measure from it)."""

    def __init__(self, plan: FaultPlan, events: Any) -> None:
        self.plan = plan
        self.events = events
        self._client: Any = None  # the real RPC client (`drop` closes every channel of it)
        self._corrupting: CorruptingClient | None = None
        self._drop_task: asyncio.Future[None] | None = None
        self._poisoned_round: int | None = None
        self._warned_wrong = False

    # -- the wrappers -------------------------------------------------------------------------------------------

    def wrap_dht(self, dht: Any) -> Any:
        """A DHT that misbehaves as the plan's dht-* entries say (or `dht` itself)."""
        if not self.plan.dht:
            return dht
        log.warning("fault injected: the DHT misbehaves on purpose (%s)", self.plan.dht)
        return FlakyDHT(dht, **self.plan.dht)

    def wrap_exchange_client(self, client: Any, push_method: str) -> Any:
        """The RPC client the exchange pushes through: one that corrupts the pushes of the rounds a `corrupt`
        phase fault armed. `client` is also the one `drop` closes."""
        self._client = client
        if not any(f.action == "corrupt" for f in self.plan.phase):
            return client
        self._corrupting = CorruptingClient(client, push_method)
        return self._corrupting

    def wrap_exchange(self, exchange: Any) -> Any:
        """An exchange that sends a Byzantine update in the rounds a `wrong` fault names (or `exchange`)."""
        if not any(f.action == "wrong" for f in self.plan.phase):
            return exchange
        return ByzantineExchange(exchange, self._attack, self._sent_wrong)

    def wrap_outer(self, outer: Any, round_id: Callable[[], int]) -> Any:
        """Outer state nudged after the commits `corrupt-theta@R` names (or `outer`)."""
        if not self.plan.corrupt_theta:
            return outer
        return CorruptingOuter(outer, round_id, lambda r: r in self.plan.corrupt_theta)

    def wrap_served_state(
        self, served: Callable[[], Awaitable[Snapshot]]
    ) -> Callable[[], Awaitable[Snapshot]]:
        """What donors serve: `poison-state`, a wrong theta (its own, nudged) under a manifest and meta consistent
        with it while the node's own rounds, records and checkpoints stay honest (what the joiner's check against
        the hashes the swarm vouches for must refuse); `poison-strategy-state`, the swarm's theta beside a
        strategy state with a NaN (the same NaN on every such donor, so their manifests agree: what the joiner's
        check of what it would install must refuse)."""
        plan = self.plan
        if not (plan.poison_state or plan.poison_strategy):
            return served

        async def poisoned() -> Snapshot:
            from farloco.node.daemon.outer import theta_hash

            meta, tensors = await served()
            fault = "poison-state" if plan.poison_state else "poison-strategy-state"
            if self._poisoned_round != meta["round_id"]:
                self._poisoned_round = meta["round_id"]
                self.events.write("fault", round_id=meta["round_id"], phase="serve", fault=fault)
                log.warning(
                    "fault injected: serving a poisoned state of round %d (%s)", meta["round_id"], fault
                )
            if plan.poison_strategy:
                name = next(
                    k for k, t in tensors.items() if k.startswith("strategy.") and t.is_floating_point()
                )
                bad = tensors[name].clone()
                bad.view(-1)[0] = float("nan")
                return meta, {**tensors, name: bad}
            theta = tensors["theta"].clone()
            theta += 1e-2
            return {**meta, "outer_hash": theta_hash(theta)}, {**tensors, "theta": theta}

        return poisoned

    def on_served(self) -> Callable[[int], None] | None:
        """`die-serving-state@N`: SIGKILL this node once it has served N bytes of state (a donor that dies in the
        middle of a joiner's transfer); None when the plan has no such entry."""
        limit = self.plan.die_serving_state
        if limit is None:
            return None

        def die(served: int) -> None:
            if served >= limit:
                log.warning("fault injected: dying after serving %d bytes of state", served)
                os.kill(os.getpid(), signal.SIGKILL)

        return die

    def durable(self, round_id: int) -> Callable[[], None] | None:
        """The `save` phase faults of `round_id` (crash, hang, delay), as the callback the checkpoint writer calls
        once the checkpoint is durable under its temporary name and not yet renamed; None when there are none.
        It runs in the checkpoint's writer thread: a delay stalls the save, not the rounds."""
        faults = self.plan.at("save", round_id)
        if not faults:
            return None

        def fire() -> None:
            for fault in faults:
                if fault.action == "delay":
                    self._announce(fault, round_id)
                    time.sleep(fault.offset + float(fault.value or 0.0))
                elif fault.action in ("crash", "hang"):
                    time.sleep(fault.offset)
                    self._fire(fault, round_id)

        return fire

    # -- the phase hook -----------------------------------------------------------------------------------------

    async def phase(self, phase: str, round_id: int) -> None:
        """Act on every fault of `phase` in `round_id`: at once, or `+offset` seconds into the phase from a timer
        (the phase goes on meanwhile)."""
        for fault in self.plan.at(phase, round_id):
            if fault.action == "wrong":
                continue  # in the exchange's update (`wrap_exchange`)
            if fault.action == "corrupt" and self._corrupting is not None:
                self._corrupting.arm(round_id, str(fault.value or "bytes"))
            if fault.offset and fault.action in ("crash", "hang", "drop"):
                asyncio.get_running_loop().call_later(fault.offset, self._fire, fault, round_id)
            elif fault.action == "delay":
                self._announce(fault, round_id)
                await asyncio.sleep(fault.offset + float(fault.value or 0.0))
            else:
                self._fire(fault, round_id)

    def _announce(self, fault: PhaseFault, round_id: int) -> None:
        self.events.write("fault", round_id=round_id, phase=fault.phase, fault=fault.spec)
        log.warning("fault injected: %s (round %d)", fault.spec, round_id)

    def _fire(self, fault: PhaseFault, round_id: int) -> None:
        self._announce(fault, round_id)
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
            if self._client is not None:
                self._drop_task = asyncio.ensure_future(
                    self._client.close()
                )  # every gRPC channel: calls fail
            log.warning("fault injected: dropped %d data-plane connections and every gRPC channel", dropped)

    # -- the Byzantine insider ----------------------------------------------------------------------------------

    def _attack(self, round_id: int) -> str | None:
        wrong = [f for f in self.plan.at("exchange", round_id) if f.action == "wrong"]
        return str(wrong[0].value) if wrong else None

    def _sent_wrong(self, round_id: int, attack: str) -> None:
        wrong = next(f for f in self.plan.at("exchange", round_id) if f.action == "wrong")
        if not self._warned_wrong:
            self._warned_wrong = True
            log.warning("fault injected: a Byzantine update (%s) goes out", attack)
        self.events.write("fault", round_id=round_id, phase="exchange", fault=wrong.spec)
