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
