"""Late work merged, not thrown away: a node late for round r keeps its pseudo-gradient and adds it, weighted by
the inner steps it carries, to its contribution to round r+1.

A node whose group formed without it (late for round r, or its matchmaking failed while the others went on)
takes the swarm's state after round r and trains round r+1 from it (ARCHITECTURE.md, "Round ids only move
forward"). Its steps of round r were measured from the theta round r started from; they are still progress on
the same objective, one round stale. As in Decoupled DiLoCo (Douillard et al., 2026), they reach the model in the
next outer update instead of being dropped:

    kept at the catch-up:    d = theta_r_start - local_r                       (w_late: its share of a round)
    merged in round r+1:     d' = s * (theta - local) + (1 - s) * d,   s = w / (w + w_late)
                             contribution made from local' = theta - d', weight w + w_late

so in the round's weighted mean (sum of w_i * c_i over sum of w_i) the node's late steps count with their own
weight, as a member of their own would, and the strategy (diloco's pseudo-gradient and error feedback, sparseloco's
and demo's compression) sees one pseudo-gradient as always. The staleness is bounded at one round: work kept for
round r merges into round r+1 or is dropped (a node late twice keeps only its newer work; a catch-up that skips
rounds drops it). Only the synchronous loop merges (run.late_work = merge): the overlapped loops already apply
every round late, and streaming-diloco keeps the ranks' progress in their weights.

Memory: one float32 vector of the model's size while work is kept, freed when it is merged or dropped. The merged
local' is written over the kept d, in place, so nothing more is allocated.
"""

from __future__ import annotations

import math

import torch

from farloco.optim.ranges import run_chunked


class LateWork:
    """The work a late node kept (at most one round's), and its merge into the next round's contribution. Weights
    are inner steps in rounds' worth (a full sequence is 1.0); each call returns what it dropped, for the events."""

    def __init__(self, num_params: int) -> None:
        self.num_params = num_params
        self._buffer: torch.Tensor | None = None
        self.round_id = -1  # the round the kept work was trained for
        self.weight = 0.0
        self.merged = False  # the buffer holds the merged local' of the round in flight

    @property
    def pending(self) -> bool:
        return self._buffer is not None and not self.merged

    def keep(self, round_id: int, theta: torch.Tensor, local: torch.Tensor, weight: float) -> float:
        """Round `round_id` went on without us: keep the ranks' pseudo-gradient of it, theta - local (theta: the
        theta_outer that round started from; local: the ranks' weights). Work kept or merged before is dropped
        (one round of staleness at most). Returns the weight dropped."""
        self._check(theta, local)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"late work: expected a weight > 0, got {weight}")
        dropped = self.weight if self._buffer is not None else 0.0  # older work: its buffer is reused
        if self._buffer is None:
            self._buffer = torch.empty(self.num_params, dtype=torch.float32)
        buffer = self._buffer

        def difference(part: slice, _scratch: torch.Tensor) -> None:
            torch.sub(theta[part], local[part], out=buffer[part])

        run_chunked(difference, self.num_params, 12)
        self.round_id, self.weight, self.merged = round_id, weight, False
        return dropped

    def merge(
        self, round_id: int, theta: torch.Tensor, local: torch.Tensor, weight: float
    ) -> tuple[torch.Tensor | None, float, float]:
        """(local', w_late, dropped): the weights to make round `round_id`'s contribution from with the kept
        work merged, local' = theta - (s (theta - local) + (1 - s) d), and the weight that work adds; (None, 0.0,
        dropped) when nothing is kept for this round. Work kept for an older round, or merged into a round that
        ended without settling (isolation, an error), is dropped here (`dropped`). `local` is not written."""
        if self.merged or (self._buffer is not None and round_id != self.round_id + 1):
            return None, 0.0, self._drop()
        if self._buffer is None:
            return None, 0.0, 0.0
        self._check(theta, local)
        buffer, late = self._buffer, self.weight
        s = weight / (weight + late)

        def blend(part: slice, scratch: torch.Tensor) -> None:
            d = scratch[: part.stop - part.start]
            torch.sub(theta[part], local[part], out=d)  # this round's own pseudo-gradient
            kept = buffer[part]
            kept.mul_(1.0 - s).add_(d, alpha=s)  # d' = s * own + (1 - s) * kept
            torch.sub(theta[part], kept, out=kept)  # local' = theta - d'

        run_chunked(blend, self.num_params, 12)
        self.merged = True
        return buffer, late, 0.0

    def round_closed(self) -> float:
        """The round in flight closed: work merged into it reached the model (the round committed) or is lost
        with it; either way it is gone, and its weight is returned (0.0 when none was merged). Work kept, not
        merged yet, stays for the next round."""
        return self._drop() if self.merged else 0.0

    def _drop(self) -> float:
        weight = self.weight if self._buffer is not None else 0.0
        self._buffer, self.round_id, self.weight, self.merged = None, -1, 0.0, False
        return weight

    def _check(self, theta: torch.Tensor, local: torch.Tensor) -> None:
        for name, tensor in (("theta", theta), ("local", local)):
            if tensor.dtype != torch.float32 or tensor.shape != (self.num_params,):
                raise ValueError(
                    f"late work: expected {name} float32[{self.num_params}], got {tensor.dtype}{list(tensor.shape)}"
                )
