"""Faults on purpose, beside a node's path rather than in it: the plan FARLOCO_FAULTS describes (plan.py), the
wrappers that make a real collaborator misbehave (wrappers.py), and the injector that puts them in place in a
node whose plan asks for them (injector.py). The chaos scenarios that use them live in benchmarks/chaos/."""

from farloco.node.faults.injector import FaultInjector
from farloco.node.faults.plan import (
    CORRUPT_MODES,
    FAULT_GRAMMAR,
    PHASE_ACTIONS,
    PHASES,
    FaultPlan,
    PhaseFault,
    parse_dht_faults,
    parse_faults,
)
from farloco.node.faults.wrappers import FlakyDHT

__all__ = [
    "CORRUPT_MODES",
    "FAULT_GRAMMAR",
    "PHASES",
    "PHASE_ACTIONS",
    "FaultInjector",
    "FaultPlan",
    "FlakyDHT",
    "PhaseFault",
    "parse_dht_faults",
    "parse_faults",
]
