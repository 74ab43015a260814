"""Bounded-size averaging plans for a round's group (planned). Sans-IO: no I/O, no clock, no randomness but
sha256 of the inputs.

The flat exchange (plan.py) has every member push a part of its contribution to every other member and take
the part's mean back: N - 1 peers per member and about N^2 streams and handshakes across the group each round.
The plans here bound the peers a member talks to in a round by the group size bound G, whatever N. Every
member derives the same plan from the same inputs: the frozen group's sorted peer ids, the round id and G.

`HierarchicalPlan` (the exact mean). The members, in an order drawn from the round id (sha256 of round and
peer id), are cut into groups of balanced sizes (they differ by one at most, and are the same at every level:
about N^(1/depth), at most G); the first member of a group in that order is its representative. Each member
sends its weighted contribution to its representative, which reduces the group to a weighted partial mean
carrying the group's total weight; the representatives form groups at the next level the same way, up to one
root after depth = ceil(log_G N) levels. The root's mean is encoded once and sent back down the same tree, so
every member decodes the same bytes: one theta hash per round. Being a representative costs up to (G - 1)
whole contributions in and out per level represented; the order changes with the round id, so that load
rotates.

`MoshpitPlan` (Moshpit averaging, Ryabinin et al. 2021). The members sit on a grid of d = ceil(log_G N)
dimensions, each side at most G, by a round-independent order (sha256 of the peer id), filled cell by cell.
Round r averages only within the lines along dimension r mod d (a reduce-scatter and all-gather inside each
line). Replicas then differ between lines; on a full grid d consecutive rounds over the same vectors give
every member the global mean (each round mixes one more dimension), on a grid with empty cells only close to
it.

`FlatPlan` is the current exchange in the same terms, for comparisons.

A plan reports per member whom it sends to and receives from, the messages it sends and takes (a message: one
peer's payload to another, whatever number of frames it travels in) and its bytes (`bytes_sent`, a function of
the contribution's size and the codec's bytes per value), and the number of sequential hops of a round.

What a member that drops mid-round costs is the caller's: `HierarchicalPlan.rerouted(gone)` gives the tree in
which each gone member's seat passes to the next member of its group in the plan's order (its children send
there instead), so nobody else's contribution is lost with it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, Self, TypeVar

Kind = Literal["partial", "mean", "push", "part_mean"]

MIN_GROUP_SIZE = 2


@dataclass(frozen=True)
class Transfer:
    """One message of a round: `src` sends `dst` slice `part` of `parts` balanced slices of a
    contribution-sized vector (parts = 1: all of it) at sequential hop `hop` (0-based)."""

    hop: int
    src: str
    dst: str
    kind: Kind
    part: int = 0
    parts: int = 1

    def numel(self, total: int) -> int:
        """How many values this message carries of a contribution of `total` values."""
        return part_size(total, self.parts, self.part)


@dataclass(frozen=True)
class AveragingGroup:
    """Members averaged together at one `level` (tree level, or grid dimension), in the plan's order: in a
    hierarchical plan the first is the group's representative."""

    level: int
    members: tuple[str, ...]

    @property
    def representative(self) -> str:
        return self.members[0]


@dataclass(frozen=True)
class MemberLoad:
    """What one member does in a round."""

    peer_id: str
    sends_to: tuple[str, ...]  # distinct peers, sorted
    receives_from: tuple[str, ...]  # distinct peers, sorted
    messages_sent: int
    messages_received: int

    @property
    def connections(self) -> int:
        """Distinct peers it exchanges messages with (each one a stream to open or accept, and its hello)."""
        return len(set(self.sends_to) | set(self.receives_from))


def part_size(total: int, parts: int, part: int) -> int:
    """Values of slice `part` when `total` values are cut into `parts` balanced contiguous slices (plan.py's
    cut)."""
    base, extra = divmod(total, parts)
    return base + (1 if part < extra else 0)


def balanced_sizes(count: int, bound: int) -> list[int]:
    """Sizes of ceil(count / bound) groups holding `count` items, each at most `bound`, differing by one at
    most."""
    groups = -(-count // bound)
    base, extra = divmod(count, groups)
    return [base + (1 if i < extra else 0) for i in range(groups)]


def check_inputs(members: Sequence[str], round_id: int, group_size: int) -> tuple[str, ...]:
    """The frozen member list as a tuple, or a ValueError naming what was expected and what came."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < MIN_GROUP_SIZE:
        raise ValueError(f"group_size: expected an int >= {MIN_GROUP_SIZE}, got {group_size!r}")
    if isinstance(round_id, bool) or not isinstance(round_id, int) or round_id < 0:
        raise ValueError(f"round_id: expected an int >= 0, got {round_id!r}")
    if isinstance(members, str):
        raise ValueError(f"members: expected a sequence of peer ids, got the string {members!r}")
    ids = tuple(members)
    if not ids:
        raise ValueError("members: expected at least one peer id, got an empty list")
    for peer in ids:
        if not isinstance(peer, str) or not peer:
            raise ValueError(f"members: expected non-empty str peer ids, got {peer!r}")
    for before, after in itertools.pairwise(ids):
        if before == after:
            raise ValueError(f"members: expected distinct peer ids, got {before!r} twice")
        if before > after:
            raise ValueError(
                f"members: expected the frozen group's sorted peer ids, got {before!r} before {after!r}"
            )
    return ids


def _rank_key(salt: str, peer: str) -> tuple[bytes, str]:
    return hashlib.sha256(f"farloco-groups/{salt}/{peer}".encode()).digest(), peer


def _loads(members: tuple[str, ...], transfers: Sequence[Transfer]) -> dict[str, MemberLoad]:
    sends: dict[str, set[str]] = defaultdict(set)
    takes: dict[str, set[str]] = defaultdict(set)
    sent: dict[str, int] = defaultdict(int)
    received: dict[str, int] = defaultdict(int)
    for t in transfers:
        sends[t.src].add(t.dst)
        takes[t.dst].add(t.src)
        sent[t.src] += 1
        received[t.dst] += 1
    return {
        m: MemberLoad(m, tuple(sorted(sends[m])), tuple(sorted(takes[m])), sent[m], received[m])
        for m in members
    }


@dataclass(frozen=True)
class _TransferPlan:
    """A plan given as its transfers."""

    members: tuple[str, ...]
    round_id: int
    group_size: int
    transfers: tuple[Transfer, ...]
    hops: int
    _loads: dict[str, MemberLoad] = field(default_factory=dict, compare=False, repr=False)
    _by_src: dict[str, list[Transfer]] = field(default_factory=dict, compare=False, repr=False)

    def load(self, peer: str) -> MemberLoad:
        """What `peer` does this round (KeyError for a peer that is not a member)."""
        if not self._loads:
            self._loads.update(_loads(self.members, self.transfers))
        return self._loads[peer]

    def sent_by(self, peer: str) -> list[Transfer]:
        if not self._by_src:
            by_src: dict[str, list[Transfer]] = {m: [] for m in self.members}
            for t in self.transfers:
                by_src[t.src].append(t)
            self._by_src.update(by_src)
        return self._by_src[peer]

    def bytes_sent(self, peer: str, numel: int, bytes_per_value: float, per_message: float = 0.0) -> float:
        """Bytes `peer` sends in a round for a contribution of `numel` values, with a codec of
        `bytes_per_value` (int8 with 128-value blocks: 1 + 4/128; raw fp32: 4) and `per_message` bytes of
        framing per message."""
        return sum(t.numel(numel) * bytes_per_value + per_message for t in self.sent_by(peer))


@dataclass(frozen=True)
class HierarchicalPlan(_TransferPlan):
    """A tree of groups of at most `group_size` (see the module docstring). `levels[0]` holds every member
    once; `levels[l + 1]` groups the representatives of `levels[l]`."""

    levels: tuple[tuple[AveragingGroup, ...], ...] = ()
    order: tuple[str, ...] = ()  # this round's order of the members

    @property
    def depth(self) -> int:
        """Levels of reduction: ceil(log_G N), 0 for a group of one."""
        return 0 if len(self.members) == 1 else len(self.levels)

    @property
    def root(self) -> str:
        return self.levels[-1][0].representative

    def represents(self, peer: str) -> int:
        """How many levels `peer` represents a group at (0: none; the root: depth). It sends its partial up at
        that hop."""
        count = 0
        for level in self.levels:
            if any(g.representative == peer and len(g.members) > 1 for g in level):
                count += 1
            else:
                break
        return count

    def parent(self, peer: str) -> str | None:
        """Whom `peer` sends its partial to (None for the root)."""
        for level in self.levels:
            for g in level:
                if peer in g.members and g.representative != peer:
                    return g.representative
        return None

    def rerouted(self, gone: Collection[str]) -> tuple[tuple[AveragingGroup, ...], ...]:
        """The tree without the members in `gone`: each group keeps its members that are not gone, in order,
        and the seat a group holds at the next level passes to its first member left (a gone representative's
        children send there instead). Groups with nobody left vanish. Deterministic: every member that agrees
        on `gone` derives the same tree."""
        gone_set = set(gone)
        holder = {m: m for m in self.members if m not in gone_set}  # a seat of this level -> who holds it
        out: list[tuple[AveragingGroup, ...]] = []
        for level_no, level in enumerate(self.levels):
            acting: list[AveragingGroup] = []
            seats: dict[str, str] = {}
            for g in level:
                left = tuple(holder[m] for m in g.members if m in holder)
                if left:
                    acting.append(AveragingGroup(level_no, left))
                    seats[g.representative] = left[0]
            holder = seats
            out.append(tuple(acting))
        return tuple(out)


def tree_transfers(levels: Sequence[Sequence[AveragingGroup]]) -> tuple[Transfer, ...]:
    """The messages of a tree of groups (a plan's `levels`, or a `rerouted` one): at hop l each member of a
    level-l group sends its partial to the representative; on the way down, at hop 2 * depth - 1 - l, the
    representative sends the mean to each of them."""
    depth = len(levels)
    up = [
        Transfer(level_no, m, g.representative, "partial")
        for level_no, level in enumerate(levels)
        for g in level
        for m in g.members[1:]
    ]
    down = [
        Transfer(2 * depth - 1 - level_no, g.representative, m, "mean")
        for level_no in reversed(range(depth))
        for g in levels[level_no]
        for m in g.members[1:]
    ]
    return (*up, *down)


def hierarchical_plan(members: Sequence[str], round_id: int, group_size: int) -> HierarchicalPlan:
    """The round's tree (see the module docstring); ValueError for bad arguments."""
    ids = check_inputs(members, round_id, group_size)
    order = tuple(sorted(ids, key=lambda peer: _rank_key(f"round={round_id}", peer)))
    depth = 0
    while group_size**depth < len(ids):
        depth += 1
    levels: list[tuple[AveragingGroup, ...]] = []
    current = list(order)
    while len(current) > 1 or not levels:
        # The smallest bound that still reaches one root in the levels left (<= group_size): the same group
        # sizes at every level, so no representative carries more than it must (1,000 under G = 16: groups of
        # 10 at three levels, not 16, 16 and 4).
        bound = 1
        while bound ** max(depth - len(levels), 1) < len(current):
            bound += 1
        groups: list[AveragingGroup] = []
        start = 0
        for size in balanced_sizes(len(current), bound):
            groups.append(AveragingGroup(len(levels), tuple(current[start : start + size])))
            start += size
        levels.append(tuple(groups))
        current = [g.representative for g in groups]
    transfers = tree_transfers(levels) if len(ids) > 1 else ()
    hops = 2 * len(levels) if len(ids) > 1 else 0
    return HierarchicalPlan(ids, round_id, group_size, transfers, hops, levels=tuple(levels), order=order)


class Vector(Protocol):
    """What the reference arithmetic needs of a value: floats, numpy arrays and torch tensors all qualify."""

    def __add__(self, other: Self, /) -> Self: ...

    def __mul__(self, other: float, /) -> Self: ...


V = TypeVar("V", bound=Vector)


def _same(value: V) -> V:
    return value


def tree_mean(
    levels: Sequence[Sequence[AveragingGroup]],
    contributions: Mapping[str, V],
    weights: Mapping[str, float] | None = None,
    transmit: Callable[[V], V] = _same,
) -> tuple[V, float]:
    """The weighted mean a tree computes, and its total weight: what every member ends with.

    `transmit(v)` is what a receiver holds of a value sent to it (a lossy codec: decode(encode(v))). Each
    member enters with its transmitted contribution (the value its error feedback accounts for, as in the flat
    exchange); a representative sums its group's values times their weights in the group's order, scales by
    one over the total weight, and sends that partial mean up with the total (its own partial does not
    travel); the root's mean is transmitted once and everyone, the root included, holds those same decoded
    values."""
    partial: dict[str, tuple[V, float]] = {}
    for g in levels[0]:
        for m in g.members:
            weight = 1.0 if weights is None else float(weights[m])
            if not weight > 0:
                raise ValueError(f"weights[{m!r}]: expected a weight > 0, got {weight!r}")
            partial[m] = (transmit(contributions[m]), weight)
    for level_no, level in enumerate(levels):
        reduced: dict[str, tuple[V, float]] = {}
        for g in level:
            entries = [
                (value if level_no == 0 or m == g.representative else transmit(value), weight)
                for m in g.members
                for value, weight in [partial[m]]
            ]
            total = sum(weight for _, weight in entries)
            acc = entries[0][0] * entries[0][1]
            for value, weight in entries[1:]:
                acc = acc + value * weight
            reduced[g.representative] = (acc * (1.0 / total), total)
        partial = reduced
    (root_value, total_weight), *rest = partial.values()
    if rest:
        raise ValueError(f"levels: expected one root group at the last level, got {len(rest) + 1}")
    return transmit(root_value), total_weight


@dataclass(frozen=True)
class MoshpitPlan(_TransferPlan):
    """One round of Moshpit averaging (see the module docstring): the lines along dimension `dim` of the
    grid."""

    sides: tuple[int, ...] = ()
    coords: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    dim: int = 0
    groups: tuple[AveragingGroup, ...] = ()

    @property
    def dimensions(self) -> int:
        """d: consecutive rounds (one per dimension) after which a full grid holds the global mean
        everywhere."""
        return len(self.sides)

    def group_of(self, peer: str) -> AveragingGroup:
        for g in self.groups:
            if peer in g.members:
                return g
        raise KeyError(peer)


def grid_sides(count: int, group_size: int) -> tuple[int, ...]:
    """The grid for `count` members: d = ceil(log_G count) dimensions (1 at least), sides at most G, as equal
    as they come, with as few empty cells as shrinking one side at a time leaves."""
    dims = 1
    while group_size**dims < count:
        dims += 1
    side = 1
    while side**dims < count:
        side += 1
    sides = [side] * dims
    for i in range(dims):
        while sides[i] > 1:
            rest = 1
            for j, other in enumerate(sides):
                rest *= other if j != i else sides[i] - 1
            if rest < count:
                break
            sides[i] -= 1
    return tuple(sides)


def moshpit_plan(members: Sequence[str], round_id: int, group_size: int) -> MoshpitPlan:
    """Round `round_id`'s Moshpit groups: the members in a round-independent order (sha256 of the peer id)
    fill the grid cell by cell (dimension 0 fastest); the round averages along dimension round_id mod d, each
    line with a reduce-scatter (member i sends slice j of k to the line's j-th member, hop 0) and an
    all-gather (slice j's mean back, hop 1)."""
    ids = check_inputs(members, round_id, group_size)
    sides = grid_sides(len(ids), group_size)
    order = sorted(ids, key=lambda peer: _rank_key("grid", peer))
    coords: dict[str, tuple[int, ...]] = {}
    for rank, peer in enumerate(order):
        cell: list[int] = []
        rest = rank
        for side in sides:
            rest, c = divmod(rest, side)
            cell.append(c)
        coords[peer] = tuple(cell)
    dim = round_id % len(sides)
    lines: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for peer in order:
        lines[coords[peer][:dim] + coords[peer][dim + 1 :]].append(peer)
    groups = tuple(
        AveragingGroup(dim, tuple(sorted(line, key=lambda peer: coords[peer][dim])))
        for _, line in sorted(lines.items())
    )
    transfers: list[Transfer] = []
    for g in groups:
        k = len(g.members)
        for j, owner in enumerate(g.members):
            transfers += [Transfer(0, m, owner, "push", j, k) for m in g.members if m != owner]
            transfers += [Transfer(1, owner, m, "part_mean", j, k) for m in g.members if m != owner]
    hops = 2 if transfers else 0
    return MoshpitPlan(
        ids, round_id, group_size, tuple(transfers), hops, sides=sides, coords=coords, dim=dim, groups=groups
    )


def moshpit_round(plan: MoshpitPlan, replicas: Mapping[str, V]) -> dict[str, V]:
    """Each member's replica after `plan`'s round, in exact arithmetic terms: the plain mean of its line's
    replicas (summed in the line's order). Members of `replicas` outside the plan keep theirs."""
    out = dict(replicas)
    for g in plan.groups:
        acc = replicas[g.members[0]]
        for m in g.members[1:]:
            acc = acc + replicas[m]
        mean = acc * (1.0 / len(g.members))
        for m in g.members:
            out[m] = mean
    return out


@dataclass(frozen=True)
class FlatPlan:
    """The current exchange (plan.py) in the same terms: member j owns slice j of N; every member pushes slice
    j to member j (hop 0) and j sends the slice's mean back to every other member (hop 1). Computed, not
    listed: its transfers are N(N - 1) each way."""

    members: tuple[str, ...]
    hops: int

    def load(self, peer: str) -> MemberLoad:
        if peer not in self.members:
            raise KeyError(peer)
        others = tuple(m for m in self.members if m != peer)
        return MemberLoad(peer, others, others, 2 * len(others), 2 * len(others))

    def bytes_sent(self, peer: str, numel: int, bytes_per_value: float, per_message: float = 0.0) -> float:
        """As `HierarchicalPlan.bytes_sent`: the other slices once each, and our slice's mean to N - 1
        members."""
        n, own = len(self.members), self.members.index(peer)
        mine = part_size(numel, n, own)
        values = (numel - mine) + (n - 1) * mine
        return values * bytes_per_value + 2 * (n - 1) * per_message


def flat_plan(members: Sequence[str]) -> FlatPlan:
    """The flat exchange's plan for the frozen group `members` (sorted peer ids)."""
    ids = check_inputs(members, 0, MIN_GROUP_SIZE)
    return FlatPlan(ids, 2 if len(ids) > 1 else 0)
