"""Round-based outer strategies: DiLoCo, SparseLoCo, DeMo and Streaming DiLoCo, with their error feedback.

A round, as the node drives it::

    contribution = strategy.make_contribution(theta_outer, theta_local)   # pure: no state changes
    transmitted = codec.decode(codec.encode(contribution))                # what the swarm will see of it
    ... exchange: averaged = mean_of(every member's transmitted contribution) ...
    strategy.propose(contribution, transmitted)   # stage the new error-feedback state
    strategy.apply(theta_outer, averaged)         # only if the round committed: the outer step, in place
    strategy.commit()                             # or rollback() if the round aborted
    strategy.merge_into_local(theta_outer, theta_local)   # what the ranks continue from

Every update is built from separate elementwise multiplies and adds in a fixed order (no fused multiply-add,
no reductions), so the same inputs give bit-identical theta on every node. Strategy state is a flat dict of
tensors (0-d tensors for scalars) that safetensors can store; the staged, uncommitted state is never part of it,
so a checkpoint always holds a committed round.

At 100M+ parameters the round is bound by memory traffic, not arithmetic, so the agent's path allocates nothing
of the model's size: `make_contribution(..., out=buffer)` writes into a buffer the caller keeps,
`propose(..., reuse=True)` turns that buffer into the staged error-feedback state in place, and `commit()`
installs it by swapping buffers and hands back the one it replaced (the caller's next `out`). The elementwise
passes (contributions, outer steps, DeMo's sign step, the eager preview, the streaming merge) run in one pass
per range in the optional C kernels (`_in_one_pass`, optim/_kernels.c: no GIL held, so the agent's threads
scale); without them, multi-pass updates run in cache-sized chunks of torch ops. Both do the same operations in
the same order: the same bits.

On demand. A contribution is an elementwise function of theta_outer, theta_local and the strategy's state, and
its error-feedback state is `contribution - transmitted`, where `transmitted` is the codec's round trip of each
range the exchange encoded. So a node need not hold either: `contribution_range(...)` gives any range of it (the
exchange's chunks, as it sends them), and `stage_in_place(...)` writes the new state straight into its buffer,
range by range, once the round commits: the same bits as `make_contribution` + `propose` + `commit`, with no
vector of the model's size beside the state (the agent's memory: 10 bytes per parameter with int8 instead of 20).

The residual in bfloat16. DiLoCo's and Streaming DiLoCo's error-feedback residual (`feedback_bf16`, on by
default) is kept in bfloat16, 2 bytes per parameter instead of 4: what the codec lost, rounded to 8 significant
bits (a relative error of at most 2^-9 of each residual value, which is itself at most half a step of a lossy
codec). The contribution adds it back in float32, and both paths round the new residual once, from the same float32
difference: the same bits on demand as through `propose`. `feedback_bf16 = false` keeps it in float32.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from farloco.optim import dense
from farloco.optim.ranges import CHUNK, chunks, run_chunked, run_ranges, run_split
from farloco.optim.sparse import SparsePayload
from farloco.optim.wire import Codec, all_finite

HParam = float | int | bool

__all__ = ["CHUNK", "OuterStrategy", "StrategyError", "available_strategies", "chunks", "make_strategy"]


# The dtypes an error-feedback residual may be kept in (`feedback_bf16`).
_FEEDBACK_DTYPES = {torch.float32, torch.bfloat16}


class StrategyError(ValueError):
    """Bad hyper-parameters, tensors of the wrong shape/dtype, or a state dict that does not fit."""


class OuterStrategy(abc.ABC):
    """A round-based outer strategy: each round a node turns (theta_outer, theta_local) into a contribution,
    the swarm averages the codec-transmitted contributions, then every node applies the same outer step."""

    name: ClassVar[str]
    # merge_into_local keeps the ranks' own progress (only part of theta_local is replaced); False: the ranks
    # simply continue from theta_outer.
    keeps_local_progress: ClassVar[bool] = False
    # Allowed hyper-parameters and their types; defaults come from `_defaults` (some depend on the codec).
    hparam_types: ClassVar[Mapping[str, type]]

    def __init__(self, num_params: int, codec: Codec, **hparams: HParam) -> None:
        if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
            raise StrategyError(f"{self.name} num_params: expected an int >= 1, got {num_params!r}")
        if not isinstance(codec, Codec):
            raise StrategyError(
                f"{self.name} codec: expected a farloco.optim.Codec, got {type(codec).__name__}"
            )
        self.num_params = num_params
        self.codec = codec
        self.hparams = self._resolve(hparams)
        self._staged: dict[str, torch.Tensor] | None = None
        self._num_rounds = 0  # outer steps applied so far; schedules (Streaming DiLoCo) key on it
        self._configure()

    # ---- hyper-parameters -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def _defaults(self) -> dict[str, HParam]:
        """Default value of every allowed hyper-parameter."""

    @abc.abstractmethod
    def _configure(self) -> None:
        """Check hyper-parameter ranges and allocate state (called once, after `self.hparams` is set)."""

    def _resolve(self, given: Mapping[str, object]) -> dict[str, HParam]:
        unknown = sorted(set(given) - set(self.hparam_types))
        if unknown:
            raise StrategyError(
                f"{self.name} hyper-parameters: expected a subset of {sorted(self.hparam_types)}, got {unknown}"
            )
        resolved = self._defaults()
        for key, value in given.items():
            kind = self.hparam_types[key]
            if kind is bool:
                ok = isinstance(value, bool)
            elif kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:  # float: ints are fine (lr=1), bools are not
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok:
                raise StrategyError(
                    f"{self.name} hyper-parameter {key}: expected a finite {kind.__name__}, "
                    f"got {type(value).__name__} {value!r}"
                )
            assert isinstance(value, (bool, int, float))  # narrowed by `ok` above; tells the type checker
            resolved[key] = float(value) if kind is float else value
        return resolved

    def _require(self, key: str, ok: bool, expected: str) -> None:
        if not ok:
            raise StrategyError(
                f"{self.name} hyper-parameter {key}: expected {expected}, got {self.hparams[key]!r}"
            )

    def _float(self, key: str) -> float:
        return float(self.hparams[key])

    # ---- the round ------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def make_contribution(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The fp32 flat vector to encode this round, written into `out` when given (a float32 vector of
        `contribution_numel()` values, returned). Pure: the strategy state does not change."""

    @abc.abstractmethod
    def _stage(
        self, contribution: torch.Tensor, transmitted: torch.Tensor, reuse: bool
    ) -> dict[str, torch.Tensor]:
        """The error-feedback state to install if the round commits (`reuse`: computed in place in
        `contribution`, whose buffer the caller gave up)."""

    @abc.abstractmethod
    def _outer_step(self, theta_outer: torch.Tensor, averaged: torch.Tensor) -> None:
        """The outer update, in place on theta_outer."""

    @property
    def num_rounds(self) -> int:
        """Outer steps applied so far: part of the state (state_dict, so checkpoints and state sync carry it). A
        node that closed a round without an update holds one fewer than the members that applied it."""
        return self._num_rounds

    def contribution_numel(self) -> int:
        """Length of this round's contribution (all parameters, except for fragment-wise strategies)."""
        return self.num_params

    def propose(
        self,
        contribution: torch.Tensor,
        transmitted: torch.Tensor,
        *,
        reuse: bool = False,
        withheld: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Stage the new error-feedback state from what `contribution` became on the wire; do not apply it yet.

        `reuse=True`: the caller gives up `contribution` (typically the `out` of `make_contribution`): the staged
        state is computed in place in it, and `commit()` installs it without a copy (see the module docstring).
        `transmitted` may be `contribution` itself (a lossless codec: nothing was lost). `withheld`: ranges of
        the contribution that reached no mean (the exchange's `AverageResult.withheld`): nothing of them was
        transmitted, so the error feedback keeps them whole (a strategy without feedback loses them)."""
        expected = self.contribution_numel()
        self._check_vector("contribution", contribution, expected)
        self._check_vector("transmitted", transmitted, expected)
        ranges = self._withheld(withheld)
        if ranges and self._feedback() is not None:
            transmitted = transmitted.clone()  # the caller's (or the contribution itself): not written
            for a, b in ranges:
                transmitted[a:b] = 0.0
        self._staged = self._stage(contribution, transmitted, reuse)

    def _withheld(self, withheld: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """`withheld`, checked: non-empty ranges within the contribution, in order, not overlapping."""
        ranges = [(int(a), int(b)) for a, b in withheld]
        end = 0
        for a, b in ranges:
            if not end <= a < b <= self.contribution_numel():
                raise StrategyError(
                    f"{self.name}: expected withheld ranges in order within [0, {self.contribution_numel()}), "
                    f"not overlapping, got {ranges[:4]}{' ...' if len(ranges) > 4 else ''}"
                )
            end = b
        return ranges

    def commit(self) -> torch.Tensor | None:
        """The round committed: the staged error-feedback state becomes current. Returns the state buffer that a
        reused contribution buffer replaced (free for the caller's next `make_contribution(out=...)`), or None."""
        if self._staged is None:
            raise StrategyError(
                f"{self.name} commit: expected a proposed round, got none (call propose first)"
            )
        state = self._buffers()
        freed = None
        for key, tensor in self._staged.items():
            buffer = state[key]
            if (
                tensor.shape == buffer.shape
                and tensor.dtype == buffer.dtype
                and tensor.is_contiguous()
                and tensor.storage_offset() == 0
            ):
                # A whole-vector staged tensor of its own (never a view into live state): swap, no copy. A float32
                # residual staged for a bfloat16 one is copied in (rounded), and its buffer stays the caller's.
                setattr(self, key, tensor)
                freed = buffer
            else:
                self._install(buffer, tensor)
        self._staged = None
        return freed

    def _install(self, buffer: torch.Tensor, staged: torch.Tensor) -> None:
        """Copy one staged tensor into its state buffer (fragment-wise strategies stage only a slice)."""
        buffer.copy_(staged)

    def rollback(self) -> None:
        """The round aborted: drop the staged state, so the residual is carried into the next round untouched."""
        self._staged = None

    def apply(self, theta_outer: torch.Tensor, averaged: torch.Tensor) -> None:
        """The outer step, in place on theta_outer, from the swarm mean of transmitted contributions."""
        self._check_vector("theta_outer", theta_outer, self.num_params)
        self.check_averaged(averaged)
        self._outer_step(theta_outer, averaged)
        self._num_rounds += 1

    # ---- the contribution on demand (see the module docstring) ---------------------------------------------
    def _feedback(self) -> torch.Tensor | None:
        """The state buffer the stage sets to `contribution - transmitted` (full length), or None (no feedback)."""
        return None

    def _offset(self) -> int:
        """Where this round's contribution starts in the flat parameters (a fragment's start, else 0)."""
        return 0

    def _contribute(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, part: slice, out: torch.Tensor
    ) -> torch.Tensor:
        """`make_contribution`'s values on the flat range `part` (already offset), into `out`: the same bits."""
        raise NotImplementedError

    def contribution_range(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, a: int, b: int, out: torch.Tensor
    ) -> torch.Tensor:
        """Values [a, b) of `make_contribution(theta_outer, theta_local)` (this round's), into `out` (b - a
        float32 values, returned): the same bits, from any thread, as long as the inputs and the state stay put."""
        if not 0 <= a <= b <= self.contribution_numel():
            raise StrategyError(
                f"{self.name} contribution_range: expected 0 <= a <= b <= {self.contribution_numel()}, got {a}, {b}"
            )
        offset = self._offset()
        return self._contribute(theta_outer, theta_local, slice(offset + a, offset + b), out[: b - a])

    def stage_in_place(
        self,
        theta_outer: torch.Tensor,
        theta_local: torch.Tensor,
        encoded_in: Sequence[tuple[int, int]] | SparsePayload | None,
        withheld: Sequence[tuple[int, int]] = (),
    ) -> None:
        """`propose` for a contribution made on demand, written straight into the state buffer: for each range
        [a, b) the exchange encoded our contribution in (`encoded_in`, covering it in order), the state becomes
        c[a:b] - decode(encode(c[a:b])), c being `contribution_range`; for a sparse codec's payload (what the
        exchange sent of it, parsed: `encoded_in` a `SparsePayload`) it becomes c - decode(payload), range by
        range; with None (a lossless codec, or a group of one: nothing was lost) it becomes c - c. On the
        `withheld` ranges (dense codecs: in no mean, nothing of them transmitted) it becomes c. The same bits as
        `propose(make_contribution(...), transmitted, withheld=...)` then `commit()`, which must follow (it
        installs nothing more). Only once the round commits: the old state is gone (theta_outer must not have
        moved yet: the contribution is measured from it)."""
        self._check_vector("theta_outer", theta_outer, self.num_params)
        self._check_vector("theta_local", theta_local, self.num_params)
        numel = self.contribution_numel()
        kept = self._withheld(withheld)
        if kept and isinstance(encoded_in, SparsePayload):
            raise StrategyError(
                f"{self.name} stage_in_place: expected no withheld ranges with a sparse payload, got {kept[:4]}"
            )
        self._stage_started()
        self._staged = {}
        feedback = self._feedback()
        if feedback is None:
            return
        offset = self._offset()
        if isinstance(encoded_in, SparsePayload):
            self._stage_from_payload(theta_outer, theta_local, encoded_in, feedback, offset)
            return
        if encoded_in is None:  # nothing lost: c - c, zeros (c is finite: checked before it was sent)
            # The withheld ranges first: the zeros would overwrite the residual their contribution reads.
            self._keep_whole(theta_outer, theta_local, kept, feedback, offset)
            starts, ends = [0, *(b for _, b in kept)], [*(a for a, _ in kept), numel]
            for a, b in zip(starts, ends, strict=True):
                self._zero(feedback[offset + a : offset + b])
            return
        ranges = list(encoded_in)
        ends = [a for _, a in ranges]
        if [a for a, _ in ranges] != [0, *ends[:-1]] or (ends[-1] if ends else 0) != numel:
            raise StrategyError(
                f"{self.name} stage_in_place: expected ranges covering [0, {numel}) in order, got "
                f"{len(ranges)} ranges from {ranges[:1]} to {ranges[-1:]}"
            )
        longest = max(b - a for a, b in ranges)
        # A bfloat16 residual: rounded once, from the float32 difference.
        rounded = feedback.dtype != torch.float32

        def stage(first: int, last: int) -> None:
            scratch = torch.empty(longest)
            decoded = torch.empty(longest) if rounded else None
            for a, b in ranges[first:last]:
                contribution = self.contribution_range(theta_outer, theta_local, a, b, scratch)
                # Decoded in place over the contribution's copy would lose it: into the state's range first.
                piece = feedback[offset + a : offset + b]
                if decoded is None:
                    self.codec.encode_decoded(contribution, checksum=False, out=piece)
                    torch.sub(contribution, piece, out=piece)
                else:
                    _, lost = self.codec.encode_decoded(contribution, checksum=False, out=decoded[: b - a])
                    piece.copy_(torch.sub(contribution, lost, out=lost))
                for x, y in kept:  # in no mean: kept whole (the contribution is still in the scratch)
                    if x < b and y > a:
                        lo, hi = max(x, a), min(y, b)
                        piece[lo - a : hi - a].copy_(contribution[lo - a : hi - a])

        run_ranges(stage, len(ranges), 12 * numel)

    @staticmethod
    def _zero(span: torch.Tensor) -> None:
        run_split(lambda part: span[part].zero_(), span.numel(), 4)

    def _keep_whole(
        self,
        theta_outer: torch.Tensor,
        theta_local: torch.Tensor,
        ranges: Sequence[tuple[int, int]],
        feedback: torch.Tensor,
        offset: int,
    ) -> None:
        """The state on `ranges` becomes the contribution there (nothing of it transmitted), a chunk at a time."""
        scratch = torch.empty(min(CHUNK, self.contribution_numel()))
        for a, b in ranges:
            for x in range(a, b, CHUNK):
                y = min(x + CHUNK, b)
                feedback[offset + x : offset + y].copy_(
                    self.contribution_range(theta_outer, theta_local, x, y, scratch)
                )

    def _stage_from_payload(
        self,
        theta_outer: torch.Tensor,
        theta_local: torch.Tensor,
        payload: SparsePayload,
        feedback: torch.Tensor,
        offset: int,
    ) -> None:
        """The state of `stage_in_place` from the sparse payload we sent: c - decode(payload), a piece of whole
        codec chunks at a time (the same bits as `propose` with the payload decoded whole as `transmitted`)."""
        numel = self.contribution_numel()
        if payload.numel != numel:
            raise StrategyError(
                f"{self.name} stage_in_place: expected a payload of {numel} values, got {payload.numel}"
            )
        span = max(1, CHUNK // payload.unit) * payload.unit

        def stage(first: int, last: int) -> None:
            scratch = torch.empty(min(span, numel))
            decoded = torch.empty(min(span, numel))
            for piece in range(first, last):
                a, b = piece * span, min((piece + 1) * span, numel)
                contribution = self.contribution_range(theta_outer, theta_local, a, b, scratch)
                sent = payload.decode_into(a, b, decoded[: b - a])
                target = feedback[offset + a : offset + b]
                if target.dtype == torch.float32:
                    torch.sub(contribution, sent, out=target)
                else:  # a bfloat16 residual: rounded once, from the float32 difference
                    target.copy_(torch.sub(contribution, sent, out=sent))

        run_ranges(stage, -(-numel // span), 12 * numel)

    def _stage_started(self) -> None:
        """Hook: what a strategy remembers when a round's state is staged (the fragment, for streaming)."""
        return None

    def check_averaged(self, averaged: torch.Tensor) -> None:
        """Refuse a mean `apply` cannot take (its length, NaN/Inf), before anything changes."""
        self._check_vector("averaged", averaged, self.contribution_numel())
        if not all_finite(averaged):
            raise StrategyError(f"{self.name} averaged: expected only finite values, got NaN/Inf")

    def eager_scale(self) -> float:
        """c such that the outer step moves theta by -c * averaged plus what its state alone contributes: the
        step is linear in `averaged` (the eager update's local preview, `node/daemon/outer.py`, is built on that).
        Only strategies with a one-round-delayed form define it."""
        raise StrategyError(
            f"{self.name}: expected a strategy with a delayed outer update (diloco, sparseloco)"
        )

    def eager_preview(
        self, start: torch.Tensor, fresh: torch.Tensor, stale: torch.Tensor, group_size: int
    ) -> None:
        """The eager update's start point (Kale et al. 2025), in place on `start` (a copy of theta_outer just
        after the delayed step): theta_outer moved as if this node's `fresh` transmitted contribution had taken
        the place of its `stale` one in the mean of `group_size` members just applied. The step is linear in the
        mean, so that is -eager_scale() / group_size * (fresh - stale). Chunked, no temporary of model size."""
        for what, tensor in (("start", start), ("fresh", fresh), ("stale", stale)):
            self._check_vector(what, tensor, self.num_params)
        if group_size < 1:
            raise StrategyError(f"{self.name} eager_preview: expected group_size >= 1, got {group_size}")
        scale = self.eager_scale() / group_size
        if _in_one_pass(_Op.SUB_DIFF, (start, fresh, stale), (scale,)):
            return

        def preview(part: slice, scratch: torch.Tensor) -> None:
            delta = torch.sub(fresh[part], stale[part], out=scratch[: part.stop - part.start])
            start[part].sub_(delta.mul_(scale))

        run_chunked(preview, self.num_params, 12)

    def merge_into_local(self, theta_outer: torch.Tensor, theta_local: torch.Tensor) -> None:
        """After `apply`: set the local parameters the ranks continue from (default: replace by theta_outer)."""
        self._check_vector("theta_outer", theta_outer, self.num_params)
        self._check_vector("theta_local", theta_local, self.num_params)
        theta_local.copy_(theta_outer)

    # ---- state ----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _buffers(self) -> dict[str, torch.Tensor]:
        """The live state tensors by name (without num_rounds)."""

    def live_buffers(self) -> dict[str, torch.Tensor]:
        """The live state tensors by name, not copies (to place their memory, never to change them)."""
        return self._buffers()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Committed state as flat name -> tensor copies (safetensors-compatible; scalars as 0-d tensors)."""
        state = {key: tensor.clone() for key, tensor in self._buffers().items()}
        state["num_rounds"] = torch.tensor(self._num_rounds, dtype=torch.int64)
        return state

    def state_layout(self) -> dict[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]]:
        """Name -> (dtypes, shape) of every tensor `state_dict` returns: what a donor's state must hold. The
        first dtype is ours; an error-feedback residual may also come in the other precision (a donor with
        another `feedback_bf16`, or of the version before it): `load_state_dict` converts it."""
        layout: dict[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]] = {}
        for key, tensor in self._buffers().items():
            dtypes: tuple[torch.dtype, ...] = (tensor.dtype,)
            if key == "residual" and tensor.dtype in _FEEDBACK_DTYPES:
                dtypes += tuple(sorted(_FEEDBACK_DTYPES - {tensor.dtype}, key=str))
            layout[key] = (dtypes, tuple(tensor.shape))
        layout["num_rounds"] = ((torch.int64,), ())
        return layout

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Install a state from `state_dict` (e.g. a donor's); keys, shapes, dtypes and finiteness are checked
        first (`check_state_dict`): a state that fails them changes nothing."""
        self.check_state_dict(state)
        for key, live in self._buffers().items():
            live.copy_(state[key])
        self._num_rounds = int(state["num_rounds"])
        self._staged = None

    def check_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise StrategyError, naming what was expected and what came, unless `state` is one `load_state_dict`
        installs: its keys, dtypes and shapes those of `state_dict`, every value finite, num_rounds >= 0."""
        buffers = self._buffers()
        expected_keys = {*buffers, "num_rounds"}
        if set(state) != expected_keys:
            raise StrategyError(
                f"{self.name} state keys: expected {sorted(expected_keys)}, got {sorted(state)} "
                f"(missing {sorted(expected_keys - set(state))}, unexpected {sorted(set(state) - expected_keys)})"
            )
        rounds = state["num_rounds"]
        if (
            not isinstance(rounds, torch.Tensor)
            or rounds.dtype != torch.int64
            or rounds.ndim != 0
            or rounds < 0
        ):
            raise StrategyError(
                f"{self.name} state num_rounds: expected a 0-d int64 tensor >= 0, got {rounds!r}"
            )
        for key, live in buffers.items():
            value = state[key]
            # A residual saved in the other precision (a checkpoint from before `feedback_bf16` was switched, or
            # from an older version) is converted on load: rounded to bfloat16, or widened exactly to float32.
            convertible = key == "residual" and {value.dtype, live.dtype} <= _FEEDBACK_DTYPES
            if (
                not isinstance(value, torch.Tensor)
                or (value.dtype != live.dtype and not convertible)
                or value.shape != live.shape
            ):
                got = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
                raise StrategyError(
                    f"{self.name} state {key}: expected {live.dtype} {list(live.shape)}, got {got}"
                )
            if not all_finite(value):
                raise StrategyError(f"{self.name} state {key}: expected only finite values, got NaN/Inf")

    # ---- helpers --------------------------------------------------------------------------------------------
    def _check_vector(self, what: str, tensor: object, numel: int) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise StrategyError(f"{self.name} {what}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.float32 or tensor.shape != (numel,) or tensor.device.type != "cpu":
            raise StrategyError(
                f"{self.name} {what}: expected a 1-D float32 CPU tensor of {numel} values, "
                f"got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
            )

    def _pseudo_gradient(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        self._check_vector("theta_outer", theta_outer, self.num_params)
        self._check_vector("theta_local", theta_local, self.num_params)
        if out is None:
            return theta_outer - theta_local
        self._check_vector("out", out, self.contribution_numel())
        run_split(
            lambda part: torch.sub(theta_outer[part], theta_local[part], out=out[part]), out.numel(), 12
        )
        return out

    def _decayed_plus_gradient(
        self,
        state: torch.Tensor,
        decay: float,
        theta_outer: torch.Tensor,
        theta_local: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """state * decay + (theta_outer - theta_local), in that order (SparseLoCo's and DeMo's contribution), into
        `out` chunk by chunk (no temporary of the model's size) or a new tensor."""
        self._check_vector("theta_outer", theta_outer, self.num_params)
        self._check_vector("theta_local", theta_local, self.num_params)
        if out is None:
            contribution = state * decay
            return contribution.add_(theta_outer - theta_local)
        self._check_vector("out", out, self.num_params)
        if _in_one_pass(_Op.DECAY_ADD, (out, state, theta_outer, theta_local), (decay,)):
            return out

        def contribute(part: slice, scratch: torch.Tensor) -> None:
            delta = torch.sub(theta_outer[part], theta_local[part], out=scratch[: part.stop - part.start])
            torch.mul(state[part], decay, out=out[part]).add_(delta)

        run_chunked(contribute, self.num_params, 16)
        return out

    @staticmethod
    def _residual(contribution: torch.Tensor, transmitted: torch.Tensor, reuse: bool) -> torch.Tensor:
        """contribution - transmitted: what the codec lost (in place in a reused contribution)."""
        if not reuse:
            return contribution - transmitted
        if transmitted is contribution:  # a lossless codec: nothing lost (x - x, as sub_ would make it)
            return contribution.sub_(transmitted)
        run_split(lambda part: contribution[part].sub_(transmitted[part]), contribution.numel(), 8)
        return contribution

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in sorted(self.hparams.items()))
        return f"{type(self).__name__}(num_params={self.num_params}, codec={self.codec!r}, {options})"


class _Op(enum.IntEnum):
    """The C kernels' elementwise passes (optim/_kernels.c `OPS`): each is the torch path's operations, in its
    order, in one pass with no GIL held; the written buffers come first."""

    NESTEROV = 0  # theta, buf <- (theta, buf, grad; lr, mu)
    SUB_ADD = 1  # out <- (a - b) + c
    DECAY_ADD = 2  # out <- state*decay + (a - b)
    BLEND = 3  # x <- x*alpha + y*beta
    SUB_DIFF = 4  # x <- x - (a - b)*scale
    SUB_SCALED = 5  # x <- x - y*scale
    SIGN_STEP = 6  # x <- x*keep - sign(y)*lr


def _in_one_pass(op: _Op, tensors: tuple[torch.Tensor, ...], scalars: tuple[float, ...]) -> bool:
    """Run `op` over the vectors `tensors` in the C kernels, one call per range of the range runner, and say so;
    False where the kernels are not built or a tensor is not a contiguous float32 CPU vector outside autograd
    (the caller's torch ops then do it, with the same bits: tests/unit/test_kernels.py)."""
    kernels = dense.KERNELS
    if kernels is None:
        return False
    for tensor in tensors:
        if (
            tensor.dtype != torch.float32
            or tensor.device.type != "cpu"
            or tensor.dim() != 1
            or not tensor.is_contiguous()
            or tensor.requires_grad
        ):
            return False
    arrays = [tensor.numpy() for tensor in tensors]
    run_split(
        lambda part: kernels.elementwise(int(op), tuple(a[part] for a in arrays), scalars),
        tensors[0].numel(),
        4 * len(tensors),
    )
    return True


def _decayed_plus_gradient_range(
    state: torch.Tensor,
    decay: float,
    theta_outer: torch.Tensor,
    theta_local: torch.Tensor,
    part: slice,
    out: torch.Tensor,
) -> torch.Tensor:
    """`OuterStrategy._decayed_plus_gradient` on one range: state*decay + (outer - local), in that order."""
    delta = theta_outer[part] - theta_local[part]  # a range's worth (the exchange's chunk), not the model's
    return torch.mul(state[part], decay, out=out).add_(delta)


def _add_feedback(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """out += residual, in place. A bfloat16 residual is added a chunk at a time: torch converts an operand of
    another dtype whole before adding it (a float32 copy of the model's size, for a whole-range call)."""
    if residual.dtype == out.dtype:
        return out.add_(residual)
    for a in range(0, out.numel(), CHUNK):
        out[a : a + CHUNK].add_(residual[a : a + CHUNK])
    return out


def _residual_buffer(num_params: int, hparams: Mapping[str, HParam]) -> torch.Tensor | None:
    """The error-feedback residual of `error_feedback` / `feedback_bf16` (zeros), or None without feedback."""
    if not hparams["error_feedback"]:
        return None
    return torch.zeros(num_params, dtype=torch.bfloat16 if hparams["feedback_bf16"] else torch.float32)


def _nesterov_step(
    theta: torch.Tensor, momentum_buffer: torch.Tensor, gradient: torch.Tensor, lr: float, momentum: float
) -> None:
    """torch.optim.SGD(nesterov=True) semantics: b <- mu*b + g; theta <- theta - lr*(g + mu*b).

    Each operation is a separate IEEE multiply or add, in a fixed order, so every node gets the same bits. Run
    chunk by chunk: the five passes over a chunk stay in cache, and the step needs a chunk of scratch, not a
    vector of the model's size.
    """

    if _in_one_pass(_Op.NESTEROV, (theta, momentum_buffer, gradient), (lr, momentum)):
        return

    def step_chunk(part: slice, scratch: torch.Tensor) -> None:
        b, g = momentum_buffer[part], gradient[part]
        b.mul_(momentum).add_(g)
        step = torch.mul(b, momentum, out=scratch[: part.stop - part.start])
        step.add_(g).mul_(lr)
        theta[part].sub_(step)

    run_chunked(step_chunk, theta.numel(), 12)


class DiLoCo(OuterStrategy):
    """DiLoCo: Nesterov outer SGD on the mean pseudo-gradient theta_outer - theta_local.

    With `error_feedback` (default: on for lossy codecs) the part of the contribution the codec lost is kept as
    a residual and added to the next round's pseudo-gradient; in bfloat16 with `feedback_bf16` (default on; the
    module docstring).
    """

    name = "diloco"
    hparam_types: ClassVar[Mapping[str, type]] = {
        "lr": float,
        "momentum": float,
        "error_feedback": bool,
        "feedback_bf16": bool,
    }

    def _defaults(self) -> dict[str, HParam]:
        return {"lr": 0.7, "momentum": 0.9, "error_feedback": not self.codec.lossless, "feedback_bf16": True}

    def _configure(self) -> None:
        self._require("lr", self._float("lr") > 0, "> 0")
        self._require("momentum", 0 <= self._float("momentum") < 1, "0 <= momentum < 1")
        self.momentum_buffer = torch.zeros(self.num_params)
        self.residual = _residual_buffer(self.num_params, self.hparams)

    def make_contribution(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        residual = self.residual
        if out is None or residual is None:
            contribution = self._pseudo_gradient(theta_outer, theta_local, out)
            return contribution if residual is None else _add_feedback(contribution, residual)
        self._check_vector("theta_outer", theta_outer, self.num_params)
        self._check_vector("theta_local", theta_local, self.num_params)
        self._check_vector("out", out, self.num_params)

        if _in_one_pass(_Op.SUB_ADD, (out, theta_outer, theta_local, residual), ()):
            return out

        def contribute(part: slice, scratch: torch.Tensor) -> None:  # (outer - local) + residual, as above
            _add_feedback(torch.sub(theta_outer[part], theta_local[part], out=out[part]), residual[part])

        run_chunked(contribute, self.num_params, 16)
        return out

    def _stage(
        self, contribution: torch.Tensor, transmitted: torch.Tensor, reuse: bool
    ) -> dict[str, torch.Tensor]:
        return {} if self.residual is None else {"residual": self._residual(contribution, transmitted, reuse)}

    def _feedback(self) -> torch.Tensor | None:
        return self.residual

    def _contribute(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, part: slice, out: torch.Tensor
    ) -> torch.Tensor:
        torch.sub(theta_outer[part], theta_local[part], out=out)
        return out if self.residual is None else _add_feedback(out, self.residual[part])

    def _outer_step(self, theta_outer: torch.Tensor, averaged: torch.Tensor) -> None:
        _nesterov_step(
            theta_outer, self.momentum_buffer, averaged, self._float("lr"), self._float("momentum")
        )

    def eager_scale(self) -> float:
        # b' = mu*b + g; theta' = theta - lr*(g + mu*b') = theta - lr*(1 + mu)*g - lr*mu^2*b
        return self._float("lr") * (1.0 + self._float("momentum"))

    def _buffers(self) -> dict[str, torch.Tensor]:
        buffers = {"momentum_buffer": self.momentum_buffer}
        if self.residual is not None:
            buffers["residual"] = self.residual
        return buffers


class SparseLoCo(OuterStrategy):
    """SparseLoCo: error-feedback buffer e <- beta*e + delta replaces outer momentum; the codec (meant: topk with
    2-bit values) sends a sparse part of e, what was sent is subtracted, and theta <- theta - lr * mean."""

    name = "sparseloco"
    hparam_types: ClassVar[Mapping[str, type]] = {"lr": float, "beta": float}

    def _defaults(self) -> dict[str, HParam]:
        return {"lr": 1.0, "beta": 0.95}

    def _configure(self) -> None:
        self._require("lr", self._float("lr") > 0, "> 0")
        self._require("beta", 0 <= self._float("beta") <= 1, "0 <= beta <= 1")
        self.error_buffer = torch.zeros(self.num_params)

    def make_contribution(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._decayed_plus_gradient(
            self.error_buffer, self._float("beta"), theta_outer, theta_local, out
        )

    def _stage(
        self, contribution: torch.Tensor, transmitted: torch.Tensor, reuse: bool
    ) -> dict[str, torch.Tensor]:
        return {"error_buffer": self._residual(contribution, transmitted, reuse)}

    def _feedback(self) -> torch.Tensor | None:
        return self.error_buffer

    def _contribute(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, part: slice, out: torch.Tensor
    ) -> torch.Tensor:
        return _decayed_plus_gradient_range(
            self.error_buffer, self._float("beta"), theta_outer, theta_local, part, out
        )

    def _outer_step(self, theta_outer: torch.Tensor, averaged: torch.Tensor) -> None:
        lr = self._float("lr")
        if _in_one_pass(_Op.SUB_SCALED, (theta_outer, averaged), (lr,)):
            return

        def step(part: slice, scratch: torch.Tensor) -> None:
            theta_outer[part].sub_(torch.mul(averaged[part], lr, out=scratch[: part.stop - part.start]))

        run_chunked(step, self.num_params, 8)

    def eager_scale(self) -> float:
        return self._float("lr")

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {"error_buffer": self.error_buffer}


class DeMo(OuterStrategy):
    """DeMo (decoupled momentum) with one inner step per round: m <- beta*m + g, send the codec's (meant:
    dct-topk) part of m, subtract what was sent, and take a sign-SGD step with decoupled weight decay:
    theta <- theta * (1 - lr*weight_decay) - lr * sign(mean). The gradient g is theta_outer - theta_local,
    i.e. the node runs one inner step of plain SGD with learning rate 1 on the loss gradient."""

    name = "demo"
    hparam_types: ClassVar[Mapping[str, type]] = {"lr": float, "beta": float, "weight_decay": float}

    def _defaults(self) -> dict[str, HParam]:
        return {"lr": 1e-3, "beta": 0.999, "weight_decay": 0.0}

    def _configure(self) -> None:
        self._require("lr", self._float("lr") > 0, "> 0")
        self._require("beta", 0 <= self._float("beta") <= 1, "0 <= beta <= 1")
        self._require("weight_decay", self._float("weight_decay") >= 0, ">= 0")
        self.momentum = torch.zeros(self.num_params)

    def make_contribution(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._decayed_plus_gradient(self.momentum, self._float("beta"), theta_outer, theta_local, out)

    def _stage(
        self, contribution: torch.Tensor, transmitted: torch.Tensor, reuse: bool
    ) -> dict[str, torch.Tensor]:
        return {"momentum": self._residual(contribution, transmitted, reuse)}

    def _feedback(self) -> torch.Tensor | None:
        return self.momentum

    def _contribute(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, part: slice, out: torch.Tensor
    ) -> torch.Tensor:
        return _decayed_plus_gradient_range(
            self.momentum, self._float("beta"), theta_outer, theta_local, part, out
        )

    def _outer_step(self, theta_outer: torch.Tensor, averaged: torch.Tensor) -> None:
        lr, weight_decay = self._float("lr"), self._float("weight_decay")
        if _in_one_pass(_Op.SIGN_STEP, (theta_outer, averaged), (1.0 - lr * weight_decay, lr)):
            return

        def step_chunk(part: slice, scratch: torch.Tensor) -> None:
            if weight_decay:  # theta * (1 - lr * wd), then the sign step: per value, the same two operations
                theta_outer[part].mul_(1.0 - lr * weight_decay)
            step = torch.sign(averaged[part], out=scratch[: part.stop - part.start])
            theta_outer[part].sub_(step.mul_(lr))

        run_chunked(step_chunk, self.num_params, 8)

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {"momentum": self.momentum}


class StreamingDiLoCo(OuterStrategy):
    """Streaming DiLoCo: the parameters form `num_fragments` fragments; round r syncs only fragment
    r mod num_fragments (so each fragment syncs every num_fragments rounds, staggered), with DiLoCo's Nesterov
    step on that fragment, and the ranks merge it as theta_local <- alpha*theta_local + (1-alpha)*theta_outer.

    Fragments are contiguous, near-equal ranges of the canonical flat order (the first numel % P fragments get
    one extra value). The contribution, `averaged` and the transmitted tensor cover only the current fragment.
    """

    name = "streaming-diloco"
    keeps_local_progress = True
    hparam_types: ClassVar[Mapping[str, type]] = {
        "lr": float,
        "momentum": float,
        "error_feedback": bool,
        "feedback_bf16": bool,
        "num_fragments": int,
        "alpha": float,
    }

    def _defaults(self) -> dict[str, HParam]:
        return {
            "lr": 0.7,
            "momentum": 0.9,
            "error_feedback": not self.codec.lossless,
            "feedback_bf16": True,
            "num_fragments": 4,
            "alpha": 0.5,
        }

    def _configure(self) -> None:
        self._require("lr", self._float("lr") > 0, "> 0")
        self._require("momentum", 0 <= self._float("momentum") < 1, "0 <= momentum < 1")
        self._require("alpha", 0 <= self._float("alpha") <= 1, "0 <= alpha <= 1")
        num_fragments = int(self.hparams["num_fragments"])
        self._require(
            "num_fragments", 1 <= num_fragments <= self.num_params, f"1 <= num_fragments <= {self.num_params}"
        )
        base, extra = divmod(self.num_params, num_fragments)
        sizes = [base + (1 if p < extra else 0) for p in range(num_fragments)]
        starts = [sum(sizes[:p]) for p in range(num_fragments)]
        self.fragments = [slice(start, start + size) for start, size in zip(starts, sizes, strict=True)]
        self.momentum_buffer = torch.zeros(self.num_params)
        self.residual = _residual_buffer(self.num_params, self.hparams)
        self._merge_fragment: slice | None = None
        self._staged_fragment = self.fragments[0]

    def fragment(self, round_index: int) -> slice:
        """The flat range synced in the round after `round_index` applied outer steps."""
        return self.fragments[round_index % len(self.fragments)]

    def current_fragment(self) -> slice:
        return self.fragment(self._num_rounds)

    def contribution_numel(self) -> int:
        part = self.current_fragment()
        return int(part.stop) - int(part.start)

    def make_contribution(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._check_vector("theta_outer", theta_outer, self.num_params)
        self._check_vector("theta_local", theta_local, self.num_params)
        part = self.current_fragment()
        if out is None:
            contribution = theta_outer[part] - theta_local[part]
        else:
            self._check_vector("out", out, self.contribution_numel())
            contribution = torch.sub(theta_outer[part], theta_local[part], out=out)
        if self.residual is not None:
            _add_feedback(contribution, self.residual[part])
        return contribution

    def _stage(
        self, contribution: torch.Tensor, transmitted: torch.Tensor, reuse: bool
    ) -> dict[str, torch.Tensor]:
        self._stage_started()
        return {} if self.residual is None else {"residual": self._residual(contribution, transmitted, reuse)}

    def _stage_started(self) -> None:
        # Remember the fragment now: `apply` advances the schedule before the node calls `commit`.
        self._staged_fragment = self.current_fragment()

    def _feedback(self) -> torch.Tensor | None:
        return self.residual

    def _offset(self) -> int:
        return int(self.current_fragment().start)

    def _contribute(
        self, theta_outer: torch.Tensor, theta_local: torch.Tensor, part: slice, out: torch.Tensor
    ) -> torch.Tensor:  # make_contribution's order: (outer - local) + residual on the fragment's range
        torch.sub(theta_outer[part], theta_local[part], out=out)
        return out if self.residual is None else _add_feedback(out, self.residual[part])

    def _install(self, buffer: torch.Tensor, staged: torch.Tensor) -> None:
        buffer[self._staged_fragment].copy_(staged)

    def _outer_step(self, theta_outer: torch.Tensor, averaged: torch.Tensor) -> None:
        part = self.current_fragment()
        _nesterov_step(
            theta_outer[part],
            self.momentum_buffer[part],
            averaged,
            self._float("lr"),
            self._float("momentum"),
        )
        self._merge_fragment = part

    def merge_into_local(self, theta_outer: torch.Tensor, theta_local: torch.Tensor) -> None:
        """theta_local <- alpha*theta_local + (1-alpha)*theta_outer on the fragment the last `apply` updated;
        the other fragments keep their local progress."""
        self._check_vector("theta_outer", theta_outer, self.num_params)
        self._check_vector("theta_local", theta_local, self.num_params)
        if self._merge_fragment is None:
            raise StrategyError(f"{self.name} merge_into_local: expected a preceding apply, got none")
        part, alpha = self._merge_fragment, self._float("alpha")
        start = int(part.start)

        def merge(sub: slice, scratch: torch.Tensor) -> None:  # in place: local*alpha + outer*(1-alpha)
            piece = slice(start + sub.start, start + sub.stop)
            outer = torch.mul(theta_outer[piece], 1.0 - alpha, out=scratch[: sub.stop - sub.start])
            theta_local[piece].mul_(alpha).add_(outer)

        if not _in_one_pass(_Op.BLEND, (theta_local[part], theta_outer[part]), (alpha, 1.0 - alpha)):
            run_chunked(merge, int(part.stop) - start, 8)
        self._merge_fragment = None

    def _buffers(self) -> dict[str, torch.Tensor]:
        buffers = {"momentum_buffer": self.momentum_buffer}
        if self.residual is not None:
            buffers["residual"] = self.residual
        return buffers


_STRATEGIES: dict[str, type[OuterStrategy]] = {
    cls.name: cls for cls in (DiLoCo, SparseLoCo, StreamingDiLoCo, DeMo)
}


def available_strategies() -> list[str]:
    """Registered strategy names."""
    return list(_STRATEGIES)


def make_strategy(name: str, num_params: int, codec: Codec, **hparams: HParam) -> OuterStrategy:
    """Build strategy `name`; unknown names or hyper-parameters raise StrategyError naming the allowed ones."""
    if name not in _STRATEGIES:
        raise StrategyError(f"strategy name: expected one of {available_strategies()}, got {name!r}")
    return _STRATEGIES[name](num_params, codec, **hparams)
