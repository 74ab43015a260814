"""run.lr_schedule: the inner rate at each swarm step against the closed forms, and the config's checks."""

from __future__ import annotations

import math

import pytest

from farloco.node.config import ConfigError, build_config
from farloco.node.schedule import inner_learning_rate, total_inner_steps
from farloco.node.training.trainer import learning_rate

PEAK, WARMUP, TOTAL, RATIO = 1e-3, 10, 110, 0.1
FLOOR = PEAK * RATIO


def _run(schedule: str, **extra: object) -> object:
    run = {"lr_schedule": schedule, "inner_lr": PEAK, "warmup_steps": WARMUP, "min_lr_ratio": RATIO,
           "total_inner_steps": TOTAL, **extra}  # fmt: skip
    return build_config({"run": run}).run


def _closed_form(schedule: str, step: int, decay_fraction: float = 0.1) -> float:
    if step < WARMUP:
        return PEAK * (step + 1) / WARMUP
    if schedule == "constant":
        return PEAK
    p = min(1.0, (step - WARMUP) / (TOTAL - WARMUP))
    if schedule == "cosine":
        return FLOOR + (PEAK - FLOOR) * (1 + math.cos(math.pi * p)) / 2
    if schedule == "linear":
        return PEAK - (PEAK - FLOOR) * p
    start = TOTAL * (1 - decay_fraction)  # wsd
    return PEAK if step < start else PEAK - (PEAK - FLOOR) * min(1.0, (step - start) / (TOTAL - start))


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_every_step_follows_the_closed_form(schedule: str) -> None:
    run = _run(schedule)
    for step in range(0, TOTAL + 30):
        assert inner_learning_rate(run, step) == pytest.approx(_closed_form(schedule, step), rel=1e-12), step


def test_the_schedules_landmarks() -> None:
    cosine, linear, wsd = _run("cosine"), _run("linear"), _run("wsd", wsd_decay_fraction=0.5)
    assert inner_learning_rate(cosine, WARMUP) == pytest.approx(PEAK)  # the peak right after the warm-up
    assert inner_learning_rate(cosine, (WARMUP + TOTAL) // 2) == pytest.approx((PEAK + FLOOR) / 2)
    assert inner_learning_rate(linear, TOTAL) == pytest.approx(FLOOR)
    assert inner_learning_rate(cosine, 10 * TOTAL) == pytest.approx(FLOOR)  # past the total: the floor
    assert inner_learning_rate(wsd, 54) == PEAK and inner_learning_rate(wsd, 55) == pytest.approx(PEAK)
    assert inner_learning_rate(wsd, 82) == pytest.approx(PEAK - (PEAK - FLOOR) * 27 / 55)
    assert inner_learning_rate(_run("constant"), 10**6) == PEAK


def test_the_total_comes_from_max_rounds_without_total_inner_steps() -> None:
    run = build_config({"run": {"lr_schedule": "linear", "max_rounds": 11, "inner_steps": 10, "warmup_steps": 10,
                                "inner_lr": PEAK, "min_lr_ratio": RATIO}}).run  # fmt: skip
    assert total_inner_steps(run) == 110
    assert inner_learning_rate(run, 60) == pytest.approx(_closed_form("linear", 60))


def test_the_trainer_applies_the_schedule_and_demo_its_plain_step() -> None:
    config = build_config({"run": {"lr_schedule": "cosine", "total_inner_steps": 100, "warmup_steps": 0}})
    assert learning_rate(config, 50) == inner_learning_rate(config.run, 50) < config.run.inner_lr
    demo = build_config(
        {"run": {"strategy": "demo", "inner_steps": 1, "lr_schedule": "cosine", "max_rounds": 90}}
    )
    assert learning_rate(demo, 5) == 1.0


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"lr_schedule": "step"}, "run.lr_schedule: expected one of"),
        ({"lr_schedule": "cosine"}, "decays over a total"),
        (
            {"lr_schedule": "cosine", "total_inner_steps": 20, "warmup_steps": 20},
            "must exceed run.warmup_steps",
        ),
        ({"min_lr_ratio": 1.5}, "run.min_lr_ratio: expected 0..1"),
        ({"wsd_decay_fraction": 0.0}, "run.wsd_decay_fraction"),
        ({"total_inner_steps": -1}, "run.total_inner_steps"),
    ],
)
def test_bad_schedules_are_config_errors(run: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config({"run": run})


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_the_outer_rate_follows_the_round_and_every_state_change_sets_it(schedule: str) -> None:
    """run.outer_lr_schedule against its closed form, as OuterState applies it to the strategy: at the start,
    after a commit, after a round closed without a step and after an installed state (a joiner's, a resumed
    node's), the strategy's lr is the rate of the round it now works on."""
    import asyncio

    import torch

    from farloco.node.config import run_hash
    from farloco.node.daemon.outerstate import OuterState
    from farloco.node.schedule import outer_lr_factor

    config = build_config(
        {"run": {"outer_lr_schedule": schedule, "max_rounds": 6, "inner_steps": 4, "min_lr_ratio": 0.1}}
    )
    run = config.run

    def closed_form(r: int) -> float:
        p = min(1.0, r / 5)
        if schedule == "cosine":
            return 0.7 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        return 0.7 * (1 - 0.9 * p) if schedule == "linear" else 0.7

    assert [outer_lr_factor(run, r) * 0.7 for r in range(8)] == pytest.approx(
        [closed_form(r) for r in range(8)]
    )
    outer = OuterState(config, run_hash(config))
    try:
        assert outer.outer_lr == pytest.approx(closed_form(0))
        theta = outer.theta.clone()
        contribution = outer.contribution(theta - 0.01)

        async def commit() -> None:
            transmitted, mean = outer.round.alone(contribution)  # a group of one
            await outer.commit(contribution, transmitted, mean)

        asyncio.run(commit())
        assert outer.round_id == 1 and outer.outer_lr == pytest.approx(closed_form(1))
        outer.advance()
        assert outer.outer_lr == pytest.approx(closed_form(2))
        meta = {"run_hash": outer.run_hash, "round_id": 4}
        state = {f"strategy.{k}": v for k, v in outer.strategy.state_dict().items()}
        asyncio.run(outer.install(meta, {"theta": torch.zeros_like(theta), **state}))
        assert outer.round_id == 4 and outer.outer_lr == pytest.approx(closed_form(4))
    finally:
        outer.close()


def test_a_decaying_outer_schedule_needs_a_total() -> None:
    with pytest.raises(ConfigError, match=r"run.outer_lr_schedule = 'cosine' decays over a total"):
        build_config({"run": {"outer_lr_schedule": "cosine"}})
    with pytest.raises(ConfigError, match=r"run.outer_lr_schedule: expected one of"):
        build_config({"run": {"outer_lr_schedule": "wsd", "max_rounds": 4}})
