"""The agent's outer state and the arithmetic of one round, with the buffers it reuses.

A round on the agent, phase by phase (`benchmarks/round_overhead.py` times each one, as written here)::

    theta_local = outer.read_local(handoff, copy=overlapped)   # the ranks' weights: a view, or a copy if the
                                                               # ranks train on while we exchange
    contribution = outer.contribution(theta_local)   # pseudo-gradient + error feedback, checked finite
    mean, sent = outer.exchange_buffers(n)           # the exchange encodes, decodes, averages into these
    transmitted, averaged = outer.alone(contribution)    # (or this, in a group of one: nothing is encoded)
    outer_hash = outer.commit(contribution, transmitted, averaged)   # stage EF, outer step, install, hash
    load = outer.merged(handoff)                     # what the ranks load next round
    tensors = outer.snapshot()                       # only when a joiner asks, or a checkpoint is due

On demand (`on_demand`, the synchronous loop with no island: the agent sets it), nothing of the model's size is
written for the contribution at all: `contribution` checks it chunk by chunk and returns an `OnDemand` the
exchange fills each chunk from as it sends it (a sparse codec: as it encodes it, piece by piece); `commit` writes
the error feedback straight into its state range by range (`OuterStrategy.stage_in_place`, from the chunks
encoded again, or from the sparse payload we sent). That leaves the strategy's state and the mean: 12 bytes
per parameter with int8 and error feedback (momentum, residual, mean) instead of 22; with `mean_per_round` (ranks
training on the host) the mean is allocated for the round and freed with it, so while the ranks train the agent
holds 8. It needs the round's inputs to stay put until the commit: theta_outer, the ranks' weights (they wait
for us, or we read a copy) and the state.

Otherwise nothing of the model's size is allocated per round: the contribution is written into a work buffer that the
strategy turns into the new error-feedback state and swaps in at commit (handing back the buffer it replaced),
the exchange writes into two buffers kept across rounds, the finiteness check is one vectorised sum, the hash
reads theta in place. At 100M+ parameters a fresh buffer costs about as much as the arithmetic done in it (page
faults and zeroing), and a round that touches each value a few times is bound by memory bandwidth.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from farloco.node.checkpoint import theta_digest
from farloco.optim import Codec, OuterStrategy
from farloco.optim.ranges import CHUNK, run_ranges, run_split
from farloco.optim.wire import all_finite, nonfinite_error
from farloco.protocol.exchange import OnDemand

# What the swarm saw of our contribution, as `commit` takes it: a tensor; for an OnDemand contribution the
# ranges the exchange encoded it in (AverageResult.encoded_in: a dense codec) or the payload it sent
# (AverageResult.payload: a sparse codec), or None where nothing was lost (a lossless codec, a group of one).
Transmitted = torch.Tensor | tuple[tuple[int, int], ...] | bytes | None


class OuterError(RuntimeError):
    """The ranks handed over something the round cannot use (non-finite values); the message says what."""


# The digest of theta_outer's bytes (a sha256 tree hash over the agent's torch threads, protocol/digest.py), read
# in place: equal on every peer that holds a bit-identical model. One function for the agent's outer_hash, the
# state-sync manifest's theta and the checkpoint's integrity hash, so they can never disagree.
theta_hash = theta_digest


class OuterRound:
    """theta_outer, the outer strategy and codec, and the per-round buffers (allocated once, on first use)."""

    def __init__(self, theta: torch.Tensor, strategy: OuterStrategy, codec: Codec) -> None:
        if theta.dtype != torch.float32 or theta.ndim != 1 or theta.numel() != strategy.num_params:
            raise ValueError(
                f"theta: expected float32[{strategy.num_params}], got {theta.dtype}{list(theta.shape)}"
            )
        self.theta = theta
        self.strategy = strategy
        self.codec = codec
        fragments = getattr(strategy, "fragments", None)
        # The longest contribution any round makes (a fragment's, for fragment-wise strategies).
        self.max_numel = max(f.stop - f.start for f in fragments) if fragments else strategy.num_params
        self._work: torch.Tensor | None = None
        self._mean: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None
        self._local_copy: torch.Tensor | None = None
        self._reference: torch.Tensor | None = None
        self._fresh: torch.Tensor | None = None  # eager: what the swarm sees of this round's contribution
        self._stale: torch.Tensor | None = None  # ... and of the previous round's
        # Contributions made on demand (see the module docstring); the agent sets it where the inputs stay put.
        self.on_demand = False
        # A fresh mean each round, freed with it (`mean_buffer`); only on demand, whose round keeps nothing else.
        self.mean_per_round = False
        self._inputs: tuple[torch.Tensor, torch.Tensor] | None = (
            None  # (start, local) of the OnDemand given out
        )

    def share_with(self, publish_buffer: torch.Tensor) -> torch.Tensor:
        """Keep theta_outer in the hand-off's theta region itself (returned), when the ranks simply load theta
        after a round: one copy of theta on the host instead of two (4 bytes per parameter), and nothing to copy
        at publish. The ranks read that region only at the start of a sequence, and the agent changes theta only
        after every rank finished its sequence. Strategies that publish merged weights there (streaming-diloco)
        keep a private theta."""
        if self.strategy.keeps_local_progress:
            return self.theta
        publish_buffer.copy_(self.theta)
        self.theta = publish_buffer
        return publish_buffer

    def prefault(self, reference: bool) -> None:
        """Allocate the round's buffers now and write every page of them once (zeros, over the agent's threads):
        the work buffer, the exchange's mean and transmitted, and with `reference` (run.outer_update delayed or
        eager) the copy of where the ranks' sequence began. Their first write otherwise fell on the first round,
        page fault by page fault: 2.1 s of the first contribution at 1B on the H200 host. The agent runs this on
        its outer thread while a joining node waits for its ranks and the swarm's state; never during a round
        (it overwrites the buffers)."""
        buffers: list[torch.Tensor] = []
        if self.on_demand:  # no work buffer, and nothing kept of what the swarm saw
            if not self.mean_per_round:
                buffers.append(self.mean_buffer(self.max_numel))
        else:
            if self._work is None:
                self._work = torch.empty(self.max_numel, dtype=torch.float32)
            mean, sent = self.exchange_buffers(self.max_numel)
            # A lossless codec's transmitted is the contribution itself: its buffer is never written.
            buffers = [self._work, mean] if self.codec.lossless else [self._work, mean, sent]
        if reference:
            if self._reference is None:
                self._reference = torch.empty(self.strategy.num_params, dtype=torch.float32)
            buffers.append(self._reference)
        for buffer in buffers:
            run_split(functools.partial(_zero, buffer), buffer.numel(), 4)

    # ---- the round's phases -------------------------------------------------------------------------------------
    def read_local(self, local: torch.Tensor, *, copy: bool) -> torch.Tensor:
        """The ranks' weights after their inner steps. A view of the hand-off while the ranks wait for us; a copy
        when they train on during the exchange (streaming-diloco's overlap), which would change it under us (into
        a buffer kept across rounds: fresh pages every round cost several times the copy)."""
        if not copy:
            return local
        if self._local_copy is None or self._local_copy.numel() != local.numel():
            self._local_copy = torch.empty_like(local)
        return self._local_copy.copy_(local)

    def contribution(
        self, theta_local: torch.Tensor, reference: torch.Tensor | None = None
    ) -> torch.Tensor | OnDemand:
        """This round's contribution, in the work buffer (valid until `commit` or the next call), measured from
        `reference`, the weights the ranks' inner steps started from: theta_outer itself unless the ranks started
        elsewhere (run.outer_update = delayed or eager: one commit behind, or a preview). With `on_demand`, an
        `OnDemand` instead, checked finite chunk by chunk (valid until `commit`, while the inputs stay put)."""
        if self.on_demand:
            return self._on_demand(theta_local, self.theta if reference is None else reference)
        if self._work is None:
            self._work = torch.empty(self.max_numel, dtype=torch.float32)
        out = self._work[: self.strategy.contribution_numel()]
        start = self.theta if reference is None else reference
        contribution = self.strategy.make_contribution(start, theta_local, out=out)
        # theta_outer and the error-feedback state are finite (checked when they came in), so a non-finite
        # contribution means non-finite weights from the ranks (or an overflow as bad).
        if not all_finite(contribution):
            detail = nonfinite_error("theta_outer - theta_local", contribution)
            raise OuterError(f"the trainer ranks produced non-finite parameters: {detail}")
        return contribution

    def _on_demand(self, theta_local: torch.Tensor, start: torch.Tensor) -> OnDemand:
        strategy = self.strategy
        numel = strategy.contribution_numel()

        def fill(a: int, b: int, out: torch.Tensor) -> torch.Tensor:
            return strategy.contribution_range(start, theta_local, a, b, out)

        def first_bad(first: int, last: int) -> tuple[int, torch.Tensor] | None:
            scratch = torch.empty(min(CHUNK, numel))
            for index in range(first, last):
                a, b = index * CHUNK, min((index + 1) * CHUNK, numel)
                if not all_finite(piece := fill(a, b, scratch)):
                    return a, piece
            return None

        for bad in run_ranges(first_bad, -(-numel // CHUNK), 16 * numel):
            if bad is not None:
                detail = nonfinite_error(f"theta_outer - theta_local (values from {bad[0]})", bad[1])
                raise OuterError(f"the trainer ranks produced non-finite parameters: {detail}")
        self._inputs = (start, theta_local)
        return OnDemand(numel, fill)

    def mean_buffer(self, numel: int) -> torch.Tensor:
        """The mean's output for `Exchange.average(out=)`, `numel` long: reused, or with `mean_per_round` a
        fresh one each round, freed with the round. Then a node holds it only while its ranks wait for the round
        (on demand: the synchronous loop), never while they train, which is when a node whose ranks train on the
        host peaks: 4 bytes per parameter off that peak, for the page faults of writing it each round (1.1-1.2
        ns/param at 128M, benchmarks/round_overhead.py `--mean-per-round`)."""
        if self.mean_per_round:
            return torch.empty(numel, dtype=torch.float32)
        if self._mean is None:
            self._mean = torch.empty(self.max_numel, dtype=torch.float32)
        return self._mean[:numel]

    def exchange_buffers(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, transmitted) outputs for `Exchange.average(out=, transmitted_out=)`, `numel` long, reused."""
        if self._sent is None:
            self._sent = torch.empty(self.max_numel, dtype=torch.float32)
        return self.mean_buffer(numel), self._sent[:numel]

    def alone(self, contribution: torch.Tensor | OnDemand) -> tuple[Transmitted, torch.Tensor]:
        """(transmitted, averaged) for a group of one: nothing crosses a wire, so nothing is lost to a codec and
        nothing is encoded; the mean of one contribution is itself (a copy: `commit` consumes the contribution)."""
        if isinstance(contribution, OnDemand):
            mean = self.mean_buffer(contribution.numel)
            run_split(
                lambda part: contribution.fill(part.start, part.stop, mean[part]), contribution.numel, 16
            )
            return None, mean
        mean = self.mean_buffer(contribution.numel())
        mean.copy_(contribution)
        return contribution, mean

    def commit(
        self,
        contribution: torch.Tensor | OnDemand,
        transmitted: Transmitted,
        averaged: torch.Tensor,
        withheld: Sequence[tuple[int, int]] = (),
    ) -> str:
        """Stage the error feedback (in place in the contribution, or straight into the state for an OnDemand
        one; the `withheld` ranges, in no mean, kept whole), take the outer step on theta, install the staged
        state (a buffer swap) and return theta's new hash."""
        self.stage(contribution, transmitted, averaged, withheld)
        self.step(averaged)
        self.install()
        return self.rehash()

    # commit's phases, apart for benchmarks/round_overhead.py
    def stage(
        self,
        contribution: torch.Tensor | OnDemand,
        transmitted: Transmitted,
        averaged: torch.Tensor,
        withheld: Sequence[tuple[int, int]] = (),
    ) -> None:
        if not isinstance(contribution, OnDemand):
            assert isinstance(transmitted, torch.Tensor), "a contribution tensor's transmitted is a tensor"
            self.strategy.propose(contribution, transmitted, reuse=True, withheld=withheld)
            return
        if self._inputs is None or isinstance(transmitted, torch.Tensor):
            raise ValueError(
                "commit: an OnDemand contribution takes the ranges it was encoded in (or None), got "
                f"{type(transmitted).__name__}{' with no contribution made' if self._inputs is None else ''}"
            )
        # The state is written before the step: a mean the step refuses must find it whole.
        self.strategy.check_averaged(averaged)
        start, local = self._inputs
        if isinstance(transmitted, bytes):  # a sparse codec's payload, as the exchange sent it (no CRC)
            parse = getattr(self.codec, "parse", None)
            if parse is None:
                raise ValueError(f"commit: a payload for codec {self.codec.name!r}, which parses none")
            self.strategy.stage_in_place(start, local, parse(transmitted, checksum=False), withheld)
        else:
            encoded_in = None if self.codec.lossless else transmitted
            self.strategy.stage_in_place(start, local, encoded_in, withheld)
        self._inputs = None

    def step(self, averaged: torch.Tensor) -> None:
        self.strategy.apply(self.theta, averaged)

    def install(self) -> None:
        freed = self.strategy.commit()
        if freed is not None:
            self._work = freed  # the replaced state buffer is the next round's work buffer

    def rehash(self) -> str:
        return theta_hash(self.theta)

    def reference(self, start: torch.Tensor) -> torch.Tensor:
        """A buffer kept across rounds holding a copy of `start`: where the ranks' sequence began, what their
        contribution is measured from when theta_outer has moved on meanwhile (run.outer_update delayed/eager)."""
        if self._reference is None:
            self._reference = torch.empty(self.strategy.num_params, dtype=torch.float32)
        return self._reference.copy_(start)

    def eager_start(
        self, start: torch.Tensor, contribution: torch.Tensor, group_size: int, *, ours_applied: bool
    ) -> None:
        """run.outer_update = eager: theta_outer, written into `start` (the hand-off's theta region), with this
        node's fresh contribution previewed in it as the swarm will see it (through the codec) in place of the
        one it previewed last time, which the round just applied holds if `ours_applied` (else nothing of ours
        is taken out). The fresh one is kept for next time."""
        if self._fresh is None or self._stale is None:
            self._fresh = torch.empty(self.strategy.num_params, dtype=torch.float32)
            self._stale = torch.zeros(self.strategy.num_params, dtype=torch.float32)
        if not ours_applied:
            self._stale.zero_()
        self.codec.encode_decoded(contribution, checksum=False, out=self._fresh)
        start.copy_(self.theta)
        self.strategy.eager_preview(start, self._fresh, self._stale, group_size)
        self._fresh, self._stale = self._stale, self._fresh  # this round's is next round's stale

    def rollback(self) -> None:
        """The round did not commit: the error-feedback state stays as it was (the work buffer is scratch; an
        OnDemand contribution wrote nothing)."""
        self._inputs = None
        self.strategy.rollback()

    def merged(self, local: torch.Tensor, publish_buffer: torch.Tensor) -> torch.Tensor:
        """What the ranks load after a committed round: theta_outer itself, or for strategies that keep the
        ranks' local progress (streaming-diloco) their weights with the synced fragment merged in, built in
        `publish_buffer` (the hand-off's theta region: the publish then copies nothing)."""
        if not self.strategy.keeps_local_progress:
            return self.theta
        publish_buffer.copy_(local)
        self.strategy.merge_into_local(self.theta, publish_buffer)
        return publish_buffer

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of theta and the committed strategy state (a donor's served state, a checkpoint's tensors)."""
        tensors = {"theta": self.theta.clone()}
        for name, tensor in self.strategy.state_dict().items():  # state_dict() returns copies
            tensors[f"strategy.{name}"] = tensor
        return tensors


def _zero(buffer: torch.Tensor, part: slice) -> None:
    buffer[part].zero_()
