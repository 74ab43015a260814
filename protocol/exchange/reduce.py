"""The arithmetic of the exchange, as codec jobs (codecpool.py) run it: our contribution encoded, an owner's chunk
reduced to its mean, the sparse mean, a group of one.

An owner sums the contributions present on a chunk in fp32 in member (= sorted peer id) order, weighted, and
scales by 1/total weight (two members of equal weight: one lerp pass), then re-encodes with the same codec; everyone
(the owner too) uses decode(those bytes), so the result is bit-identical on every member. Codecs that say
`raw_float32` (farloco.optim's fp32) skip the codec altogether: chunks travel as raw float32 bytes, the owner sums
straight from the received buffers and sends the mean's own bytes, which everyone copies as is. A robust rule
(`RobustRule`) takes the place of the weighted mean where the group chose one.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any, NoReturn

import torch

from farloco.protocol.exchange.api import RobustRule
from farloco.protocol.exchange.attempt import Attempt
from farloco.protocol.exchange.codec import (
    all_finite,
    decode,
    encode,
    encode_decoded,
    raw_bytes,
    take_payload,
)
from farloco.protocol.exchange.wire import Blamed
from farloco.util.parallel import map_ranges


def encode_chunk(attempt: Attempt, a: int, b: int) -> bytes:
    """Our contribution's chunk [a, b) for the wire (lossy codecs: what the others decode of it into
    `transmitted`)."""
    own = attempt.own(a, b)
    if attempt.lossless or attempt.transmitted is None:
        return encode(attempt.codec, own, attempt.fast)
    return encode_decoded(attempt.codec, own, attempt.fast, attempt.transmitted[a:b])[0]


class OwnChunkError(Exception):
    """Our own chunk could not be encoded (NaN/Inf in our contribution): `error` is the codec's."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# In an owner's contributions to a chunk: ours, to be encoded and decoded by the reduction's job (a lossy codec).
OWN_CHUNK = Marker("OWN_CHUNK")
# What `chunk_mean` returns when a member's contribution did not decode (refused where it was decoded).
UNDECODABLE = Marker("UNDECODABLE")


def chunk_mean(
    attempt: Attempt, a: int, b: int, contributions: list[Any], weights: list[float]
) -> bytes | memoryview | Marker | None:
    """An owner's chunk [a, b): the contributions present (in member order: a tensor, OWN_CHUNK, or a decode's
    job, waited for here: it was submitted before this job, so it ran first or runs now) reduced, the mean ready for
    the wire (and, lossy or lossless, what everyone decodes of it in the result). None: a raw chunk is not finite
    (the caller finds whose it was); UNDECODABLE: a contribution was refused."""
    codec = attempt.codec
    inputs: list[torch.Tensor] = []
    for contribution in contributions:
        if contribution is OWN_CHUNK:
            try:
                inputs.append(_own_decoded(attempt, a, b))
            except Exception as exc:
                raise OwnChunkError(exc) from None
        elif isinstance(contribution, Future):
            if contribution.cancelled() or contribution.exception() is not None:
                return UNDECODABLE
            inputs.append(contribution.result())
        else:
            inputs.append(contribution)
    # Lossless codecs: the mean is the result itself, so it is summed straight into place.
    total = attempt.result[a:b] if attempt.lossless else torch.empty(b - a, dtype=torch.float32)
    if attempt.rule is not None:
        # A robust rule instead of the mean (contributions in member order, unweighted). A NaN need not reach its
        # result (a median skips it), so every raw contribution is checked here first.
        if attempt.raw and not all(all_finite(c) for c in inputs):
            return None
        total.copy_(attempt.rule(inputs))
    else:
        if len(inputs) == 1:
            total.copy_(inputs[0])  # the weighted mean of one contribution is itself
        elif len(inputs) == 2 and weights[0] == weights[1]:
            # The mean of two in one pass instead of a sum and a scaling pass (these chunks are memory-bound).
            # Not bit-equal to (a + b) / 2, but within an ulp, and only the owner computes it. Of the inputs, not
            # the weighted terms: equal weights w != 1 (late work merged on both, two islands of one size) would
            # otherwise give w times the mean.
            torch.lerp(inputs[0], inputs[1], 0.5, out=total)
        else:
            terms = [c if w == 1.0 else c * w for c, w in zip(inputs, weights, strict=True)]
            torch.add(terms[0], terms[1], out=total)
            for term in terms[2:]:
                total.add_(term)
            total.mul_(1.0 / math.fsum(weights))
    if attempt.raw:
        # One finiteness pass over the mean covers every contribution (NaN/Inf propagate through the sum).
        return raw_bytes(total) if all_finite(total) else None
    if attempt.lossless:
        return encode(codec, total, attempt.fast)
    return encode_decoded(codec, total, attempt.fast, attempt.result[a:b])[0]


def sparse_mean(rule: RobustRule | None, terms: list[Any], weights: list[float], total: torch.Tensor) -> None:
    """Every member's payload, in member order, reduced into `total`: the robust rule over the whole decoded
    payloads, or the weighted mean (`sparse_sum` of every term at once)."""
    if rule is not None:
        # Every member applies the rule to every payload, in member order: a rule whose arithmetic could differ
        # between machines (a norm's reduction) must not be used with sparse codecs (the agent refuses it).
        total.copy_(rule([_whole(term, total.numel()) for term in terms]))
        return
    sparse_sum(terms, weights, total, True, math.fsum(weights))


def sparse_sum(
    terms: list[Any], weights: list[float], total: torch.Tensor, first: bool, divisor: float | None
) -> None:
    """Consecutive members' terms, in member order, weighted, added into `total` (`first`: the round's first
    term is among them and sets `total`), then with `divisor` every value divided by it (the weights' sum: the
    round's last run). A term is a decoded tensor, or a parsed payload (`payload_terms`) decoded here a piece at
    a time: each piece of `total` takes every term of the run before the next piece (one pass over `total`,
    nothing of its length per member). Every value goes through the same operations in the same order as in a
    sum of whole decoded tensors, however the members are cut into runs, so every member gets the same bits."""
    numel = total.numel()
    unit = math.lcm(1, *(term.unit for term in terms if not isinstance(term, torch.Tensor)))
    span = max(1, SPARSE_PIECE // unit) * unit

    def reduce_pieces(first_piece: int, last_piece: int) -> None:
        scratch = torch.empty(min(span, numel))
        for piece in range(first_piece, last_piece):
            a, b = piece * span, min((piece + 1) * span, numel)
            part = total[a:b]
            for index, (term, weight) in enumerate(zip(terms, weights, strict=True)):
                sets = first and index == 0
                into = part if sets else scratch[: b - a]
                if isinstance(term, torch.Tensor):
                    values = term[a:b]
                    if sets:
                        values = part.copy_(values)
                    elif weight != 1.0:
                        values = torch.mul(values, weight, out=into)
                        weight = 1.0
                else:
                    values = term.decode_into(a, b, into)
                if weight != 1.0:
                    values.mul_(weight)
                if not sets:
                    part.add_(values)
            if divisor is not None:
                part.div_(divisor)

    map_ranges(reduce_pieces, -(-numel // span), 8 * numel * max(1, len(terms)))


# Values per piece of the sparse mean (whole codec chunks): 1 MiB of float32, the piece and one term in cache.
SPARSE_PIECE = 1 << 18


def _whole(term: Any, numel: int) -> torch.Tensor:
    """A term of `sparse_mean` as one decoded tensor."""
    if isinstance(term, torch.Tensor):
        return term
    out = torch.empty(numel, dtype=torch.float32)
    term.decode_into(0, numel, out)
    return out


def _own_decoded(attempt: Attempt, a: int, b: int) -> torch.Tensor:
    """What the others decode of our chunk [a, b) (a lossy codec), into `transmitted` where it is kept."""
    own = attempt.own(a, b)
    # OnDemand: `own` is a fresh tensor of ours, which the decoded values may overwrite.
    out = own if attempt.transmitted is None else attempt.transmitted[a:b]
    return encode_decoded(attempt.codec, own, attempt.fast, out)[1]


def reduce_alone(attempt: Attempt) -> None:
    """A dense group of one (all others dropped): the mean is our own contribution, through the codec twice like
    every owner's mean."""
    codec = attempt.codec
    for a, b in attempt.plan.chunks(0):
        if not attempt.covers(a, b):
            continue
        own = attempt.own(a, b) if attempt.lossless else _own_decoded(attempt, a, b)
        data = encode_decoded(codec, own, attempt.fast, attempt.result[a:b])[0]
        if attempt.mean_chunks is not None:
            attempt.mean_chunks[a] = (b, bytes(data))


def encode_sparse(attempt: Attempt) -> tuple[bytes, Any]:
    """Our sparse payload, and our term of the mean: what the others will decode of it, decoded into
    `transmitted`, or for an OnDemand contribution (encoded piece by piece as it is made) the payload parsed."""
    codec, numel = attempt.codec, attempt.plan.numel
    if attempt.source is not None:
        source = attempt.source
        encode_pieces = codec.encode_on_demand
        payload = (
            encode_pieces(numel, source.fill, checksum=False)
            if attempt.fast
            else encode_pieces(numel, source.fill)
        )
        return payload, take_payload(codec, payload, numel, "own payload", attempt.fast)
    assert attempt.transmitted is not None, "a tensor contribution's transmitted is kept"
    payload = encode(codec, attempt.flat, attempt.fast)
    decode(codec, payload, numel, "own payload", attempt.fast, attempt.transmitted)
    return payload, attempt.transmitted


def blame_nonfinite(member_ids: list[str], contributions: dict[int, torch.Tensor | None]) -> NoReturn:
    """A reduced raw chunk is not finite: reject the first member whose contribution carries NaN/Inf."""
    for index in sorted(contributions):
        contribution = contributions[index]
        if contribution is not None and not all_finite(contribution):
            culprit = member_ids[index]
            raise Blamed(culprit, "BAD_PAYLOAD", f"contribution of {culprit}: expected finite float32")
    # Every input finite but the weighted sum overflowed float32: nobody lied.
    raise Blamed(None, "OVERFLOW", "the weighted mean of finite contributions overflowed float32")
