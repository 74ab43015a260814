"""Aggregation of decoded contributions: the deterministic fp32 (weighted) mean every node computes alike."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def mean_of(decoded: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> torch.Tensor:
    """The fp32 mean of same-length 1-D float32 tensors, accumulated in the given order.

    Callers pass contributions sorted by peer id, so every node adds the same numbers in the same order and gets
    a bit-identical result. Only separate elementwise multiplies and adds are used (never a fused
    multiply-add, whose use varies with the CPU), and the division comes last. With `weights` (e.g. samples
    processed) the result is sum(w_i * x_i) / sum(w_i); weights must be finite and > 0.
    Being elementwise, the mean of a slice equals the slice of the mean, which is what lets dense codecs
    reduce part-wise. Returns a new tensor.
    """
    if len(decoded) == 0:
        raise ValueError("mean_of: expected at least one tensor, got none")
    first = decoded[0]
    for position, tensor in enumerate(decoded):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or tensor.ndim != 1:
            got = (
                f"{tensor.dtype} shape {list(tensor.shape)}"
                if isinstance(tensor, torch.Tensor)
                else type(tensor)
            )
            raise ValueError(f"mean_of input {position}: expected a 1-D float32 tensor, got {got}")
        if tensor.shape != first.shape:
            raise ValueError(
                f"mean_of input {position}: expected {first.numel()} values (like input 0), got {tensor.numel()}"
            )
    if weights is None:
        total = torch.zeros_like(first)
        for tensor in decoded:
            total.add_(tensor)
        return total.div_(len(decoded))
    if len(weights) != len(decoded):
        raise ValueError(f"mean_of weights: expected {len(decoded)} (one per tensor), got {len(weights)}")
    for position, weight in enumerate(weights):
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"mean_of weight {position}: expected a finite number > 0, got {weight!r}")
    total = torch.zeros_like(first)
    for tensor, weight in zip(decoded, weights, strict=True):
        total.add_(tensor * float(weight))
    return total.div_(math.fsum(float(w) for w in weights))


# -- robust aggregation (`run.aggregator`) ----------------------------------------------------------------------

AGGREGATORS = ("mean", "trimmed_mean", "median", "norm_clip", "centered_clip")
"""`run.aggregator`: the plain (weighted) mean, the control; and rules that bound what a minority of Byzantine
members can do to the result, each applied chunk by chunk by the chunk's owner (the exchange's reduce-scatter
gives the owner every member's decoded copy of its chunks): coordinate-wise trimmed mean (drops the
`trimmed_count` largest and smallest values of every coordinate), coordinate-wise median, norm clipping (each
member's chunk scaled down to at most the median of the members' chunk norms, then the mean) and CenteredClip
(Karimireddy, He & Jaggi 2021, the rule of hivemind's BTARD: from the coordinate median, a few steps of
v <- v + mean_i clip(x_i - v, tau), tau the median distance of the members from the start). The robust rules ignore
the members' weights (a Byzantine member could claim any weight)."""

CENTERED_CLIP_ITERATIONS = 3


def trimmed_count(members: int) -> int:
    """Values dropped at each end of a coordinate by `trimmed_mean`: a quarter of the members, at least one
    where 3 or more take part (so one Byzantine member of 4 is always cut off), never all but one."""
    if members < 3:
        return 0
    return max(1, min(members // 4, (members - 1) // 2))


def aggregate(
    name: str, decoded: Sequence[torch.Tensor], weights: Sequence[float] | None = None
) -> torch.Tensor:
    """`name` (one of AGGREGATORS) of same-length 1-D float32 tensors given in member (sorted peer id) order.

    Deterministic: the same inputs in the same order give the same bits on any node (sorts, sums and divisions
    in a fixed order; no fused multiply-add). "mean" is `mean_of` (weighted); the others are unweighted.
    Returns a new tensor."""
    if name == "mean":
        return mean_of(decoded, weights)
    if name not in AGGREGATORS:
        raise ValueError(f"aggregator: expected one of {list(AGGREGATORS)}, got {name!r}")
    mean_of(decoded[:1])  # the same input checks
    for position, tensor in enumerate(decoded):
        if tensor.dtype != torch.float32 or tensor.ndim != 1 or tensor.shape != decoded[0].shape:
            raise ValueError(
                f"aggregate input {position}: expected a 1-D float32 tensor of {decoded[0].numel()} values, got "
                f"{tensor.dtype} shape {list(tensor.shape)}"
            )
    members = len(decoded)
    if members == 1:
        return decoded[0].clone()
    stacked = torch.stack(list(decoded))  # [members, n]
    if name in ("trimmed_mean", "median"):
        ordered = torch.sort(stacked, dim=0).values
        if name == "median":
            low, high = (members - 1) // 2, members // 2 + 1  # one middle value, or the mean of two
        else:
            cut = trimmed_count(members)
            low, high = cut, members - cut
        return _mean_rows(ordered[low:high])
    norms = torch.linalg.vector_norm(stacked, dim=1)
    if name == "norm_clip":
        bound = _median_value(norms)
        scale = torch.where(norms > bound, bound / norms, torch.ones_like(norms))
        return _mean_rows(stacked * scale[:, None])
    # centered_clip
    center = _mean_rows(torch.sort(stacked, dim=0).values[(members - 1) // 2 : members // 2 + 1])
    tau = _median_value(torch.linalg.vector_norm(stacked - center, dim=1))
    for _ in range(CENTERED_CLIP_ITERATIONS):
        offsets = stacked - center
        distances = torch.linalg.vector_norm(offsets, dim=1)
        scale = torch.where(distances > tau, tau / distances, torch.ones_like(distances))
        center = center + _mean_rows(offsets * scale[:, None])
    return center


def _mean_rows(rows: torch.Tensor) -> torch.Tensor:
    """The mean of a [k, n] tensor's rows, summed in row order (not torch.mean's reduction tree)."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total.div_(rows.shape[0])


def _median_value(values: torch.Tensor) -> torch.Tensor:
    """The median of a 1-D tensor (the mean of the two middle values for an even count), as a 0-d tensor."""
    ordered = torch.sort(values).values
    count = ordered.numel()
    return _mean_rows(ordered[(count - 1) // 2 : count // 2 + 1, None])[0]


ATTACKS = ("sign_flip_x1000", "constant", "noise", "stale")
"""What a Byzantine member may send instead of its update (valid, finite, the right shape): its update negated and
scaled 1000x, a constant direction (every value 50), random noise (std 100, its own seed), or a stale update (its
update of an earlier round). Used by the daemon's `FARLOCO_FAULTS=byzantine=KIND` and by the tests."""


def byzantine_update(kind: str, update: torch.Tensor, stale: torch.Tensor | None = None) -> torch.Tensor:
    """The update a Byzantine member sends in place of `update` (see ATTACKS); `stale`: its earlier update (for
    "stale"; without one yet, the honest update goes out). Returns a new tensor."""
    if kind == "sign_flip_x1000":
        return update * -1000.0
    if kind == "constant":
        return torch.full_like(update, 50.0)
    if kind == "noise":
        return torch.randn(update.numel(), generator=torch.Generator().manual_seed(7)).mul_(100.0)
    if kind == "stale":
        return (stale if stale is not None else update).clone()
    raise ValueError(f"attack: expected one of {list(ATTACKS)}, got {kind!r}")


class Aggregator:
    """`aggregate(name, ...)` as a callable the exchange takes (protocol/exchange/api.py `RobustRule`): the chunk
    owner calls it on every member's decoded copy of a chunk, in member order."""

    def __init__(self, name: str) -> None:
        if name not in AGGREGATORS:
            raise ValueError(f"aggregator: expected one of {list(AGGREGATORS)}, got {name!r}")
        self.name = name

    def __call__(self, decoded: Sequence[torch.Tensor]) -> torch.Tensor:
        return aggregate(self.name, decoded)

    def __repr__(self) -> str:
        return f"Aggregator({self.name!r})"
