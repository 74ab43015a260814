"""Late work merged into the next round's contribution (node/daemon/latework.py): the arithmetic, the one-round
staleness bound, what is counted each way, and bad input refused."""

from __future__ import annotations

import pytest
import torch

from farloco.node.config import ConfigError, build_config
from farloco.node.daemon.latework import LateWork
from farloco.optim import get_codec, make_strategy

N = 300_001  # several of the range runner's chunks, the last one partial


def _vectors(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    theta = torch.randn(N, generator=generator)
    return theta, theta - torch.randn(N, generator=generator).mul_(1e-2)


def test_kept_work_merges_into_the_next_round_weighted_by_its_steps() -> None:
    """The next round's contribution is made from local' = theta - (s d_now + (1 - s) d_late), with the weights
    summed: in the round's weighted mean the late steps count as a member of their own would."""
    late = LateWork(N)
    start, local_late = _vectors(0)
    assert late.keep(2, start, local_late, 0.5) == 0.0
    assert late.pending and late.round_id == 2
    theta, local = _vectors(1)  # the swarm's state after round 2, and what the ranks trained from it
    theta_before, local_before = theta.clone(), local.clone()
    local_merged, late_weight, dropped = late.merge(3, theta, local, 1.0)
    assert local_merged is not None and (late_weight, dropped) == (0.5, 0.0)
    weight = 1.0 + late_weight
    assert torch.equal(theta, theta_before) and torch.equal(local, local_before)  # inputs not written
    expected = (1.0 * (theta - local) + 0.5 * (start - local_late)) / 1.5
    torch.testing.assert_close(theta - local_merged, expected, rtol=0, atol=1e-6)

    # diloco (fp32, no error feedback to carry) sends exactly that pseudo-gradient: with another member's d_other
    # (weight 1), the mean is (d_other + d_now + 0.5 d_late) / 2.5.
    strategy = make_strategy("diloco", N, get_codec("fp32"))
    contribution = strategy.make_contribution(theta, local_merged)
    other = torch.randn(N, generator=torch.Generator().manual_seed(2)).mul_(1e-2)
    mean = (1.0 * other + weight * contribution) / (1.0 + weight)
    by_steps = (other + (theta - local) + 0.5 * (start - local_late)) / 2.5
    torch.testing.assert_close(mean, by_steps, rtol=0, atol=1e-6)

    assert late.round_closed() == 0.5
    assert late._buffer is None and not late.pending  # the buffer goes with the round
    assert late.round_closed() == 0.0


def test_staleness_is_bounded_at_one_round() -> None:
    late = LateWork(N)
    start, local = _vectors(0)
    late.keep(4, start, local, 1.0)
    assert late.merge(6, start, local, 1.0) == (
        None,
        0.0,
        1.0,
    )  # a catch-up skipped round 5: two rounds stale
    assert late._buffer is None

    # Late twice in a row: the merged round's work is dropped, the newer round's kept.
    late.keep(7, start, local, 1.0)
    assert late.merge(8, start, local, 0.25)[0] is not None
    assert late.keep(8, start, local, 0.25) == 1.0
    assert late.round_id == 8 and late.weight == 0.25 and late.pending
    # A round that merged and then closed without an update (aborted, no group) loses what it merged.
    assert late.merge(9, start, local, 1.0)[1] == 0.25
    assert late.round_closed() == 0.25
    assert late._buffer is None
    # Merged into a round that never closed (it ended by another path): dropped at the next merge.
    late.keep(10, start, local, 1.0)
    late.merge(11, start, local, 1.0)
    assert late.merge(12, start, local, 1.0) == (None, 0.0, 1.0) and late._buffer is None


def test_nothing_kept_changes_nothing() -> None:
    late = LateWork(N)
    theta, local = _vectors(0)
    assert late.merge(1, theta, local, 1.0) == (None, 0.0, 0.0)
    assert late.round_closed() == 0.0
    assert late._buffer is None


@pytest.mark.parametrize(
    ("theta", "local", "weight", "message"),
    [
        (
            torch.zeros(N - 1),
            torch.zeros(N),
            1.0,
            rf"expected theta float32\[{N}\], got torch.float32\[{N - 1}\]",
        ),
        (
            torch.zeros(N),
            torch.zeros(N, dtype=torch.float64),
            1.0,
            rf"expected local float32\[{N}\], got torch.float64\[{N}\]",
        ),
        (torch.zeros(N), torch.zeros(N), 0.0, "expected a weight > 0, got 0.0"),
        (torch.zeros(N), torch.zeros(N), float("nan"), "expected a weight > 0, got nan"),
    ],
)
def test_bad_input_is_refused_and_keeps_nothing(
    theta: torch.Tensor, local: torch.Tensor, weight: float, message: str
) -> None:
    late = LateWork(N)
    with pytest.raises(ValueError, match=message):
        late.keep(1, theta, local, weight)
    assert late._buffer is None and not late.pending


def test_run_late_work_is_checked() -> None:
    assert build_config({}).run.late_work == "merge"
    assert build_config({"run": {"late_work": "discard"}}).run.late_work == "discard"
    with pytest.raises(
        ConfigError, match=r"run.late_work: expected one of \('merge', 'discard'\), got 'keep'"
    ):
        build_config({"run": {"late_work": "keep"}})
