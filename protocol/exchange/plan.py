"""How the flat tensor is cut: one part per member, parts into chunks, chunks onto lanes, and the ids of attempts.

Parts and chunks. The flat tensor is cut into one contiguous part per member (in member order) and each part
into chunks of `chunk_bytes // 4` elements. Member j owns part j: every other member sends it its chunks of part
j, and j sends back the mean of each chunk. A member nobody can dial (behind NAT) owns an empty part: it sends
its chunks to the owners like everyone and takes the means back on the streams it opened (`Plan.owners`).

Lanes. A link with a large bandwidth-delay product (1 Gbit/s x 100 ms: 12.5 MB in flight) is more than one
TCP stream's window can fill. With `streams_per_peer` = L > 1 a member opens up to L streams to each owner
instead of one, lane l carrying the chunks k of the part with k % L == l (and their means back): the chunks of a
part travel side by side over L connections, each with its own window (PCCL does the same). Each sender picks
its own L (said in every hello); a part of n chunks uses max(1, min(L, n)) lanes, computed alike on both sides.

Spans (islands). A member may contribute to a contiguous range of the tensor only (`average(span=(g0, g1))`, in
*slices*: the tensor is cut into `slices` equal ranges, the exchange's `slices`, and a span covers slices g0 to
g1 - 1). Chunks are then also cut at every slice boundary, so a chunk lies wholly inside or outside a span, and
for a chunk outside its span a member sends an *absent* frame (its header says `x`, no payload) instead of data.
The owner reduces each chunk over the members present on it (weights of the present members only, in member
order) and answers an absent member with an absent frame instead of the mean. Every stream still carries one
frame per chunk each way, so the completion rules are the same as without spans. A member's result is defined on
its span only. This is how the nodes of an island (node/daemon/island.py) each carry their slice of the island's
mean across the slow network: the matching slices of the other islands meet at the same owners.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from farloco.protocol.types import Group, group_id_of

# Most streams one member opens to one owner for one part (network.streams_per_peer).
MAX_LANES = 16
# Most slices a tensor may be cut into for spans (see Spans).
MAX_SLICES = 4096


def attempt_key(group: Group, attempt_no: int, member_ids: list[str]) -> str:
    """The id every member gives attempt `attempt_no` of `group`'s exchange among `member_ids`: the group id for
    the first, then one per (members, attempt number): no two attempts of a round ever share an id."""
    if attempt_no == 0:
        return group.group_id
    members = group_id_of(group.round_id, member_ids)
    digest = hashlib.sha256(f"{group.group_id}/{members}/attempt={attempt_no}".encode())
    return digest.hexdigest()


def lanes_for(lanes: int, num_chunks: int) -> int:
    """Lanes a part of `num_chunks` chunks travels in when its sender asks for `lanes` (at least one stream, so
    an empty part is still confirmed)."""
    return max(1, min(lanes, num_chunks))


@dataclass(frozen=True)
class Plan:
    """Which contiguous range of the flat tensor each member owns, and how a part is cut into chunks."""

    numel: int
    num_parts: int
    chunk_elems: int
    slices: int = 0  # also cut at the boundaries of this many equal slices (see Spans); 0: no such cuts
    # Which members own a part (None: all). A member that cannot be dialled (behind NAT) owns an empty part:
    # nobody could push to it; it pushes its chunks to the owners and takes the means back on its own streams.
    owners: tuple[bool, ...] | None = None
    _chunks: dict[int, list[tuple[int, int]]] = field(default_factory=dict, compare=False, repr=False)

    def part(self, index: int) -> tuple[int, int]:
        rank, count = index, self.num_parts
        if (
            self.owners is not None
        ):  # the parts are the owners'; a non-owner's is empty, where the next begins
            rank, count = sum(self.owners[:index]), sum(self.owners)
        base, extra = divmod(self.numel, count)
        start = rank * base + min(rank, extra)
        if self.owners is not None and not self.owners[index]:
            return start, start
        return start, start + base + (1 if rank < extra else 0)

    def chunks(self, index: int) -> list[tuple[int, int]]:
        """Chunk ranges of part `index` (computed once: the reducer asks for them per chunk)."""
        cached = self._chunks.get(index)
        if cached is None:
            start, end = self.part(index)
            cuts = sorted(
                {*range(start, end, self.chunk_elems)}
                | {b for g in range(1, self.slices) if start < (b := self.slice_start(g)) < end}
            )
            # An empty part (fewer elements than members) has no chunks.
            cached = list(zip(cuts, [*cuts[1:], end], strict=True)) if cuts else []
            self._chunks[index] = cached
        return cached

    def slice_start(self, g: int) -> int:
        """Where slice g (0 <= g <= slices) starts: slice_start(slices) is numel."""
        return g * self.numel // self.slices


def slice_bounds(numel: int, slices: int, span: tuple[int, int]) -> tuple[int, int]:
    """The element range [lo, hi) that slices span[0] .. span[1] - 1 of a `numel` tensor cover (see Spans)."""
    g0, g1 = span
    return g0 * numel // slices, g1 * numel // slices


def max_chunk_payload(num_elems: int) -> int:
    """The most bytes a chunk of `num_elems` values may take on the wire: no codec worth using sends more than
    twice fp32 plus a small header, so anything bigger is refused unread."""
    return 8 * num_elems + 4096
