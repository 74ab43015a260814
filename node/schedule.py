"""The inner learning rate at a step of the swarm (`run.lr_schedule`), a pure function of the [run] section.

The step is the swarm's position, round id x run.inner_steps + the step inside the round, which the agent hands
the ranks (`step_base` of each sequence): a joiner, a resumed node and a node whose sequence was cut short all
apply the rate the swarm is at. Every schedule warms up linearly over run.warmup_steps (the rate of step s < W is
peak x (s + 1) / W), then, over the total T (run.total_inner_steps, or run.max_rounds x run.inner_steps), with
peak = run.inner_lr, floor = peak x run.min_lr_ratio and p = (s - W) / (T - W) clipped to [0, 1]:

- constant: peak (T unused);
- cosine: floor + (peak - floor) x (1 + cos(pi p)) / 2;
- linear: peak - (peak - floor) x p;
- wsd (warmup-stable-decay): peak until the last run.wsd_decay_fraction of T, then linear down to floor at T.

Past T every schedule but constant stays at the floor.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from farloco.node.config import RunConfig

LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
OUTER_LR_SCHEDULES = ("constant", "cosine", "linear")


def total_inner_steps(run: RunConfig) -> int:
    """T: run.total_inner_steps, else run.max_rounds x run.inner_steps (0: unbounded)."""
    return run.total_inner_steps or run.max_rounds * run.inner_steps


def inner_learning_rate(run: RunConfig, step: int) -> float:
    """The inner rate of swarm step `step` (see the module docstring)."""
    peak, warmup = run.inner_lr, run.warmup_steps
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if run.lr_schedule == "constant":
        return peak
    total = total_inner_steps(run)
    floor = peak * run.min_lr_ratio
    if run.lr_schedule == "wsd":
        decay_start = total - run.wsd_decay_fraction * total
        if step < decay_start:
            return peak
        progress = min(1.0, (step - decay_start) / max(total - decay_start, 1e-12))
        return peak - (peak - floor) * progress
    progress = min(1.0, max(0.0, (step - warmup) / max(total - warmup, 1)))
    if run.lr_schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak - (peak - floor) * progress  # linear


def outer_lr_factor(run: RunConfig, round_id: int) -> float:
    """run.outer_lr_schedule: the factor on the strategy's own outer rate for the outer step that commits round
    `round_id` (0-based). Over R = T / inner_steps rounds (T as above), with p = round_id / (R - 1) clipped to
    [0, 1] and floor = run.min_lr_ratio: constant 1; cosine floor + (1 - floor) x (1 + cos(pi p)) / 2; linear
    1 - (1 - floor) x p. No warm-up: the outer step's first rounds are already small (the pseudo-gradient of a
    few inner steps)."""
    if run.outer_lr_schedule == "constant":
        return 1.0
    rounds = max(1, total_inner_steps(run) // run.inner_steps)
    progress = min(1.0, max(0.0, round_id / max(rounds - 1, 1)))
    floor = run.min_lr_ratio
    if run.outer_lr_schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - floor) * progress
