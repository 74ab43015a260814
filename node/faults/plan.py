"""The fault plan: what FARLOCO_FAULTS (and `farloco join --fault`) asks a node to do wrong, parsed and checked
in one place. Nothing here acts; the wrappers (node/faults/wrappers.py) and the injector
(node/faults/injector.py) do, and only in a node whose plan is not empty.

The DHT entries make a real DHT refuse or never answer some calls (`FlakyDHT`):

- `dht-refuse-stores=N`: the next N stores are refused (the answer hivemind gives when no replica took them);
- `dht-refuse-stores-for=S`: every store is refused during the first S seconds;
- `dht-silent-after=S`: after S seconds, no store and no get ever answers (a DHT process that hangs).

The phase entries (`ACTION[=VALUE]@PHASE[+OFFSET][:ROUNDS]`, `PHASES`, `PHASE_ACTIONS`) act where a round stands;
the rest (`slow-steps`, `die-serving-state@N`, `corrupt-theta@R`, `poison-state`, `poison-strategy-state`,
`byzantine=ATTACK`) as `FAULT_GRAMMAR` says.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any


def parse_dht_faults(spec: str) -> dict[str, Any]:
    """FlakyDHT keyword arguments from a FARLOCO_FAULTS value ('' when none asks for a flaky DHT).

    ValueError naming the entry for a malformed dht-* entry; entries of other kinds are left to their readers.
    """
    options: dict[str, Any] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        kind, sep, value = entry.partition("=")
        if not kind.startswith("dht-"):
            continue
        try:
            if kind == "dht-refuse-stores" and sep:
                options["refuse_stores"] = int(value)
            elif kind == "dht-refuse-stores-for" and sep:
                options["refuse_stores_for"] = float(value)
            elif kind == "dht-silent-after" and sep:
                options["silent_after"] = float(value)
            else:
                raise ValueError(kind)
        except ValueError:
            raise ValueError(
                f"FARLOCO_FAULTS entry {entry!r}: expected dht-refuse-stores=N, dht-refuse-stores-for=SECONDS "
                "or dht-silent-after=SECONDS"
            ) from None
    return options


# -- the fault plan: every FARLOCO_FAULTS entry, parsed and checked in one place ----------------------------

PHASES = ("train", "match", "heal", "exchange", "commit", "save")
"""Where in a round a phase fault fires: `train` once the ranks were handed the round's inner steps, `match` as
group forming starts, `heal` as the hash check starts, `exchange` as the exchange starts, `commit` right after
the round committed, `save` when the round's checkpoint is durable in its temporary directory (every file and
the directory fsynced) and not yet renamed to its final name (only rounds that write a checkpoint have one; crash,
hang and delay act there, in the checkpoint's writer thread)."""

PHASE_ACTIONS = ("crash", "hang", "drop", "delay", "corrupt", "wrong")
"""crash: SIGKILL the node (its process group: agent, ranks, DHT daemon). hang=S: SIGSTOP the node for S seconds
(a frozen machine; a helper outside it sends SIGCONT). drop: shut every open connection of the node down (its
gRPC channels and data-plane sockets: the peers see them reset mid-call). delay=S: the agent sleeps S seconds
where it stands (a slow phase). corrupt[=MODE]: the round's outgoing exchange payloads are overwritten with 0xFF bytes
(NaN floats, out-of-range indices: what the receivers must refuse). wrong=KIND: a wrong-but-valid update
(farloco.optim.ATTACKS) in place of the node's own."""

_VALUED = {"hang": "seconds", "delay": "seconds", "wrong": "attack"}
CORRUPT_MODES = ("bytes", "inf", "huge", "short")
"""corrupt's payloads: `bytes` (the default) all 0xFF (NaN floats, out-of-range indices), `inf` float32 +Inf, `huge`
float32 1e38 (finite: a valid, wrong value), `short` the first half of each payload only (a size mismatch)."""


@dataclass(frozen=True)
class PhaseFault:
    """`ACTION[=VALUE]@PHASE[+OFFSET][:ROUNDS]`: `action` at `offset` seconds into `phase` of the rounds
    `first`..`last` (None: no end)."""

    action: str
    phase: str
    value: float | str | None = None
    offset: float = 0.0
    first: int = 0
    last: int | None = None
    spec: str = ""

    def applies(self, phase: str, round_id: int) -> bool:
        return phase == self.phase and round_id >= self.first and (self.last is None or round_id <= self.last)


@dataclass
class FaultPlan:
    """Every fault one node was asked for (FARLOCO_FAULTS, `farloco join --fault`)."""

    dht: dict[str, Any] = field(default_factory=dict)  # FlakyDHT keyword arguments
    phase: list[PhaseFault] = field(default_factory=list)
    slow_steps: float = 0.0  # seconds added to every inner step
    die_serving_state: int | None = None  # SIGKILL once this many bytes of state were served
    corrupt_theta: set[int] = field(default_factory=set)  # nudge theta_outer after committing these rounds
    poison_state: bool = False  # serve joiners a wrong theta under a manifest consistent with it
    poison_strategy: bool = False  # serve joiners the right theta beside a NaN strategy state, consistently

    def at(self, phase: str, round_id: int) -> list[PhaseFault]:
        return [f for f in self.phase if f.applies(phase, round_id)]

    def __bool__(self) -> bool:
        return bool(
            self.dht
            or self.phase
            or self.slow_steps
            or self.corrupt_theta
            or self.poison_state
            or self.poison_strategy
        ) or (self.die_serving_state is not None)


FAULT_GRAMMAR = (
    "ACTION[=VALUE]@PHASE[+SECONDS][:ROUNDS] with ACTION one of crash, hang=SECONDS, drop, delay=SECONDS, "
    "corrupt[=bytes|inf|huge|short], wrong=ATTACK; PHASE one of "
    + ", ".join(PHASES)
    + "; ROUNDS N, N-M or N+ (default: every round); "
    "or dht-refuse-stores=N, dht-refuse-stores-for=SECONDS, dht-silent-after=SECONDS, slow-steps=SECONDS, "
    "die-serving-state@BYTES, corrupt-theta@ROUND, poison-state, poison-strategy-state, byzantine=ATTACK "
    "(wrong=ATTACK@exchange)"
)


def _seconds(text: str, entry: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"FARLOCO_FAULTS entry {entry!r}: expected seconds >= 0, got {text!r}")
    return value


def _rounds(text: str, entry: str) -> tuple[int, int | None]:
    first, dash, last = text.partition("-")
    try:
        if text.endswith("+") and text[:-1].isdigit():
            return int(text[:-1]), None
        if dash and first.isdigit() and last.isdigit() and int(first) <= int(last):
            return int(first), int(last)
        if not dash and text.isdigit():
            return int(text), int(text)
    except ValueError:
        pass
    raise ValueError(f"FARLOCO_FAULTS entry {entry!r}: expected rounds N, N-M (N <= M) or N+, got {text!r}")


def _phase_fault(entry: str, attacks: Collection[str] | None) -> PhaseFault:
    head, _, where = entry.partition("@")
    action, has_value, raw = head.partition("=")
    if action not in PHASE_ACTIONS:
        raise ValueError(
            f"FARLOCO_FAULTS entry {entry!r}: unknown fault {action!r}; expected {FAULT_GRAMMAR}"
        )
    if action == "corrupt" and has_value:
        if raw not in CORRUPT_MODES:
            raise ValueError(
                f"FARLOCO_FAULTS entry {entry!r}: expected corrupt or corrupt=MODE with MODE one of "
                f"{list(CORRUPT_MODES)}, got {raw!r}"
            )
    elif bool(has_value) != (action in _VALUED):
        wanted = f"{action}={_VALUED[action].upper()}" if action in _VALUED else f"{action} without a value"
        raise ValueError(f"FARLOCO_FAULTS entry {entry!r}: expected {wanted}")
    value: float | str | None = None
    if action == "corrupt":
        value = raw or "bytes"
    elif action == "wrong":
        if attacks is not None and raw not in attacks:
            raise ValueError(
                f"FARLOCO_FAULTS entry {entry!r}: expected an attack of {list(attacks)}, got {raw!r}"
            )
        value = raw
    elif has_value:
        value = _seconds(raw, entry)
    where, colon, rounds = where.partition(":")
    phase, plus, offset = where.partition("+")
    if phase not in PHASES:
        raise ValueError(f"FARLOCO_FAULTS entry {entry!r}: expected a phase of {list(PHASES)}, got {phase!r}")
    if phase == "save" and action not in ("crash", "hang", "delay"):
        raise ValueError(
            f"FARLOCO_FAULTS entry {entry!r}: the save phase takes crash, hang or delay, got {action!r}"
        )
    first, last = _rounds(rounds, entry) if colon else (0, None)
    return PhaseFault(action, phase, value, _seconds(offset, entry) if plus else 0.0, first, last, spec=entry)


def parse_faults(spec: str, attacks: Collection[str] | None = None) -> FaultPlan:
    """The FaultPlan of a FARLOCO_FAULTS value (comma-separated entries); ValueError naming the entry and what
    was expected for anything it does not know. `attacks`: the names `wrong=` may take (farloco.optim.ATTACKS,
    given by the node: protocol does not import optim); None checks no name."""
    plan = FaultPlan()
    plan.dht = parse_dht_faults(spec)
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rest = entry.partition("=")
        if name.startswith("dht-"):
            continue
        if entry == "poison-state":
            plan.poison_state = True
        elif entry == "poison-strategy-state":
            plan.poison_strategy = True
        elif name == "slow-steps":
            plan.slow_steps = _seconds(rest, entry)
        elif name == "byzantine":
            plan.phase.append(_phase_fault(f"wrong={rest}@exchange", attacks))
        elif entry.startswith(("die-serving-state@", "corrupt-theta@")):
            kind, _, at = entry.partition("@")
            if not at.isdigit():
                raise ValueError(f"FARLOCO_FAULTS entry {entry!r}: expected {kind}@N with N a whole number")
            if kind == "die-serving-state":
                plan.die_serving_state = int(at)
            else:
                plan.corrupt_theta.add(int(at))
        else:
            plan.phase.append(_phase_fault(entry, attacks))
    return plan
