"""The exchange in bounded groups, simulated: the rows and columns of `farloco.protocol.exchange.grouped` (what
the exchange runs with `run.exchange_group_size`), the hierarchical and the Moshpit plans of
`farloco.protocol.exchange.groups` beside the flat all-to-all, at up to 1,000 peers, with real codec
arithmetic and the WAN model of benchmarks/swarm_sim.py.

    python benchmarks/group_sim.py --peers 16 64 256 1000 --group-size 16 --rounds 5 --markdown
    python benchmarks/group_sim.py --peers 256 1000 --churn 0.01 --codec fp32 --json groups.json
    python benchmarks/group_sim.py --peers 16 64 256 1000 --group-size 8 --rounds 3 --markdown

Every round the whole swarm is the frozen group (sorted peer ids p0000..); each member contributes a synthetic
vector of `--numel` values (a direction shared by all plus each peer's own noise: x_i = g + e_i, both standard
normal), fresh each round. Per N and plan the table gives, over the members that stayed for the round:
messages and connections (distinct peers talked to) per peer per round, mean and max; KB sent per peer per
round at `--numel` values; sequential hops; the round's latency estimate, propagation only (`prop ms`) and
with a contribution of `--model-params` values over `--bandwidth-mbps` links (`round s`, median over rounds);
and `err`, the relative L2 distance of a member's result from the exact (float64) mean of the contributions of
the members that stayed.

The plans:

- **flat**: the current exchange. Member j owns slice j of N; each member pushes its slices to their owners
  and takes each slice's mean back. Arithmetic as the exchange's owners do it: every slice of every
  contribution coded on its own (int8: blockwise absmax, blocks starting at the slice's start), summed in fp32
  in member order, scaled by 1/N, the mean coded once and decoded by everyone. int8 here is a vectorised
  replica of farloco.optim's codec (per slice: scale = absmax/127, round(x/scale), times scale), checked bit
  for bit against the codec itself on every member's slices of one owner each round (the codec's own calls
  would cost a million per round at 1,000 peers).
- **tree**: `hierarchical_plan` (the exact mean in one round, 2 * depth hops); arithmetic `tree_mean` with
  farloco.optim's codec on every message (each member's contribution, each partial mean, the root's mean).
- **rows**: the exchange's `GroupedExchange` (`farloco.protocol.exchange.grouped`, `run.exchange_group_size`),
  with its own layout and nesting: rows of at most G average the whole contributions (the flat arithmetic),
  column i averages slice i of the row means weighted by each row's weight (a column of more than G: in rows
  and columns itself, one level down), each carrier sends its slice to its row. One hash per round. A drop is
  carried through the round at any depth (a row or column goes on without the lost member; a lost carrier's
  slice, or one level down part of it, is the other rows' mean: `partial`, the share of live members missing
  from some range of the mean, and in brackets the share of the live members' contributed values missing
  from it, which their error feedback keeps for the next round).
- **moshpit**: `moshpit_plan`; each round a reduce-scatter and all-gather inside each line of the grid, with
  farloco.optim's codec on every slice. Its replicas differ after a round, so its `err` is after d rounds over
  the same vectors (d = the grid's dimensions: the rounds it takes to mix), and `spread` gives the RMS
  distance of the replicas from their own mean after 1..d rounds (relative to the exact mean's norm). Its
  costs are per round: a mixed mean costs d of them.

Latency (store and forward, a hop's whole payload before the next hop starts; the exchange's chunk pipelining
would overlap them): the one-way latency of a pair is half an RTT drawn once per pair from a log-normal
(median `--rtt-ms`, `--rtt-sigma`), each message +-10% jitter, and with probability `--loss` a lost packet
waits for TCP's retransmission (at least 200 ms), as in swarm_sim.py; a member's link carries
`--bandwidth-mbps` each way, shared by the messages it sends (or takes) at once.

Churn (`--churn` p): each round each member drops with probability p at a uniform time of the round (for the
tree: at a uniform hop of its 2 * depth, doing nothing from that hop on); it is back (a fresh member) next
round. A drop is noticed after `--detect-ms` (GONE_SILENCE_SECONDS: 2 s of silence).
- flat: the attempt fails and the survivors retry (exact mean of the survivors; the round costs the first
  attempt until the drop is noticed, then a whole second attempt, whose messages are counted too). A drop
  during the retry is not simulated.
- tree: re-routed (`HierarchicalPlan.rerouted`): a member that drops before it sent its partial up loses only
  its own contribution; its seat passes to the next member of its group, its children (those that had sent
  to it send again) deliver there, each re-routed group costing `--detect-ms`. A member that drops after its
  partial went up stays in the mean (the mean then differs from the survivors' exact mean: it shows in `err`);
  the mean is sent down the tree of the members left, again re-routing past the gone ones. Nobody live is left
  without the mean, and no live contribution is lost.
- rows: see that plan above (`rows_round`): with at most G rows a row or a column that loses a member notices
  it after `--detect-ms` and retries among the rest, the round goes on; with nesting the round falls back.
- moshpit: a line with a drop retries among its survivors (like flat, within the line); a member that drops
  leaves the run (its replica is gone) and the grid is derived again from the members left.

Messages are data messages (a contribution, a partial or a mean between two peers, whatever number of frames
it travels in); the flat exchange also sends a vote to every other member per attempt, not counted here.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from farloco.optim.registry import get_codec
from farloco.protocol.exchange.grouped import MAX_DEPTH, layout
from farloco.protocol.exchange.groups import (
    AveragingGroup,
    HierarchicalPlan,
    MoshpitPlan,
    flat_plan,
    hierarchical_plan,
    moshpit_plan,
    part_size,
    tree_mean,
    tree_transfers,
)
from farloco.protocol.types import Group, GroupMember

HEADER_BYTES = 32  # farloco.optim's codec header, on every coded message (raw fp32 frames carry none)


@dataclass(frozen=True)
class Settings:
    peers: int
    group_size: int = 16
    rounds: int = 5
    churn: float = 0.0
    codec: str = "int8"
    numel: int = 4096
    seed: int = 1
    rtt_ms: float = 60.0
    rtt_sigma: float = 0.6
    loss: float = 0.01
    model_params: float = 1e8
    bandwidth_mbps: float = 1000.0
    detect_ms: float = 2000.0


class Coding:
    """farloco.optim's codec as the exchange uses it; fp32 is the raw path (the bytes as they are)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.codec = get_codec(name)
        self.lossless = name == "fp32"
        block = getattr(self.codec, "block_size", 0)
        self.block = block
        # bytes on the wire per value, and per message
        self.bytes_per_value = 4.0 if self.lossless else 1.0 + 4.0 / block
        self.per_message = 0 if self.lossless else HEADER_BYTES
        if name not in ("fp32", "int8"):
            raise ValueError(f"codec: expected 'int8' or 'fp32', got {name!r}")

    def transmit(self, value: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes of `value` (the sender's encode_decoded: the same values)."""
        if self.lossless:
            return value
        return self.codec.encode_decoded(value.contiguous(), checksum=False)[1]

    def transmit_slices(self, rows: torch.Tensor, cuts: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Every row's slices [a, b) coded on their own, vectorised: the int8 codec's arithmetic (see the
        module docstring), blocks starting at each slice's start."""
        if self.lossless:
            return rows
        numel = rows.shape[1]
        segment = torch.full((numel,), -1, dtype=torch.long)
        first = 0
        for a, b in cuts:
            count = -(-(b - a) // self.block)
            segment[a:b] = first + torch.arange(b - a) // self.block
            first += count
        if bool((segment < 0).any()):
            raise ValueError(f"cuts: expected slices covering all {numel} values, got {list(cuts)}")
        absmax = torch.zeros(rows.shape[0], first, dtype=torch.float32)
        absmax.scatter_reduce_(1, segment.expand(rows.shape[0], -1), rows.abs(), "amax", include_self=True)
        scales = absmax.div_(127)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.div(rows, safe[:, segment]).round_().clamp_(-127, 127)
        return codes.mul_(scales[:, segment])


class Wan:
    """swarm_sim.py's WAN: one RTT per pair (log-normal), jitter, lost packets; plus links of a bandwidth."""

    def __init__(self, s: Settings, rng: np.random.Generator) -> None:
        self.rng = rng
        n = s.peers
        upper = s.rtt_ms / 1e3 * np.exp(rng.normal(0.0, s.rtt_sigma, size=(n, n)))
        self.rtt = np.triu(upper, 1) + np.triu(upper, 1).T
        self.loss = s.loss
        self.bandwidth = s.bandwidth_mbps * 1e6 / 8  # bytes per second each way

    def owd(self, src: np.ndarray | int, dst: np.ndarray | int) -> np.ndarray:
        base = self.rtt[src, dst] / 2
        delay = base * self.rng.uniform(0.9, 1.1, size=np.shape(base))
        lost = self.rng.random(np.shape(base)) < self.loss
        return np.asarray(np.where(lost, delay + np.maximum(0.2, 4 * delay), delay))


def index(peer: str) -> int:
    return int(peer[1:])


def names(n: int) -> list[str]:
    return [f"p{i:04d}" for i in range(n)]


def rel_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return float((value.double() - exact).norm() / exact.norm())


# -- the flat all-to-all and a Moshpit line (the same all-reduce) --------------------------------------------


def allreduce_latency(wan: Wan, members: Sequence[int], payload: float) -> float:
    """Reduce-scatter then all-gather among `members`: each owner has its slice once every member's slice
    came, each member has the mean once every owner's slice mean came."""
    k = len(members)
    if k < 2:
        return 0.0
    idx = np.asarray(members)
    share = payload * (k - 1) / k / wan.bandwidth
    push = wan.owd(idx[:, None], idx[None, :])
    np.fill_diagonal(push, 0.0)
    owner_done = push.max(axis=0) + share
    back = wan.owd(idx[:, None], idx[None, :])
    np.fill_diagonal(back, 0.0)
    member_done = (owner_done[:, None] + back).max(axis=0) + share
    return float(member_done.max())


def allreduce_mean(
    coding: Coding, rows: torch.Tensor, weights: Sequence[float] | None = None
) -> torch.Tensor:
    """The flat exchange's arithmetic among the members of `rows` (one row each, in member order): slices
    coded on their own, summed in order (weighted, if `weights`), scaled by 1/total weight, each slice's mean
    coded once. The mean everyone decodes."""
    k, numel = rows.shape
    cuts, start = [], 0
    for j in range(k):
        size = part_size(numel, k, j)
        if size:
            cuts.append((start, start + size))
        start += size
    sent = coding.transmit_slices(rows, cuts)
    if weights is None:
        total = sent[0].clone()
        for i in range(1, k):
            total += sent[i]
        total.mul_(1.0 / k)
    else:
        total = sent[0] * weights[0]
        for i in range(1, k):
            total += sent[i] * weights[i]
        total.mul_(1.0 / math.fsum(weights))
    return coding.transmit_slices(total[None, :], cuts)[0]


def check_replica(coding: Coding, rows: torch.Tensor, rng: random.Random) -> None:
    """The vectorised int8 against farloco.optim's codec, bit for bit, on one owner's slice of every
    member."""
    if coding.lossless:
        return
    k, numel = rows.shape
    j = rng.randrange(k)
    a = sum(part_size(numel, k, i) for i in range(j))
    b = a + part_size(numel, k, j)
    if b == a:
        return
    replica = coding.transmit_slices(rows[:, a:b].contiguous(), [(0, b - a)])
    for i in range(k):
        real = coding.codec.encode_decoded(rows[i, a:b].contiguous(), checksum=False)[1]
        if not torch.equal(real, replica[i]):
            raise AssertionError(f"int8 replica differs from the codec on member {i}'s slice [{a}, {b})")


def flat_round(sim: Sim, round_id: int, x: torch.Tensor, drops: dict[str, float]) -> dict[str, Any]:
    ids = sim.ids
    survivors = [m for m in ids if m not in drops]
    attempts = [ids, survivors] if drops else [ids]
    msgs: dict[str, int] = defaultdict(int)
    conns: dict[str, int] = defaultdict(int)
    sent: dict[str, float] = defaultdict(float)
    for members in attempts:
        plan = flat_plan(members)
        for m in survivors:
            load = plan.load(m)
            msgs[m] += load.messages_sent
            conns[m] = max(conns[m], load.connections)
            sent[m] += plan.bytes_sent(m, sim.s.numel, sim.coding.bytes_per_value, sim.coding.per_message)
    rows = x[[index(m) for m in survivors]]
    check_replica(sim.coding, rows, sim.rng)
    mean = allreduce_mean(sim.coding, rows)
    payload = sim.s.model_params * sim.coding.bytes_per_value
    idx = [index(m) for m in ids]
    first = allreduce_latency(sim.wan, idx, payload)
    prop_first = allreduce_latency(sim.wan, idx, 0.0)
    if drops:
        noticed = min(drops.values()) * first + sim.detect
        prop_noticed = min(drops.values()) * prop_first + sim.detect
        retry_idx = [index(m) for m in survivors]
        latency = noticed + allreduce_latency(sim.wan, retry_idx, payload)
        prop = prop_noticed + allreduce_latency(sim.wan, retry_idx, 0.0)
    else:
        latency, prop = first, prop_first
    exact = x[[index(m) for m in survivors]].double().mean(dim=0)
    return sim.summary(survivors, msgs, conns, sent, 2, latency, prop, rel_error(mean, exact))


# -- the tree ---------------------------------------------------------------------------------------------


def tree_latency(
    sim: Sim,
    plan: HierarchicalPlan,
    up: Sequence[Sequence[AveragingGroup]],
    down: Sequence[Sequence[AveragingGroup]],
    payload: float,
) -> float:
    """Up: a representative has its group's partial once every member's came (its link takes them one after
    another); down: it sends the mean to its members at once over its link, the groups of its higher level
    first. A group whose seat moved (its representative dropped) waits `detect` first."""
    wan, transfer = sim.wan, payload / sim.wan.bandwidth
    ready: dict[str, float] = defaultdict(float)
    for level_no, level in enumerate(up):
        original = {g.representative for g in plan.levels[level_no]}
        for g in level:
            rep = g.representative
            if len(g.members) == 1:
                continue
            others = np.asarray([index(m) for m in g.members[1:]])
            arrive = np.asarray([ready[m] for m in g.members[1:]]) + wan.owd(others, index(rep))
            penalty = sim.detect if rep not in original else 0.0
            ready[rep] = max(float(arrive.max()), ready[rep]) + penalty + (len(g.members) - 1) * transfer
    root = up[-1][0].representative
    down_root = down[-1][0].representative if down and down[-1] else root
    have: dict[str, float] = {down_root: ready[root] + (sim.detect if down_root != root else 0.0)}
    free: dict[str, float] = {}
    for level_no in reversed(range(len(down))):
        original = {g.representative for g in plan.levels[level_no]}
        for g in down[level_no]:
            rep = g.representative
            if len(g.members) == 1:
                continue
            start = free.get(rep, have[rep])
            others = np.asarray([index(m) for m in g.members[1:]])
            penalty = sim.detect if rep not in original else 0.0
            arrive = start + penalty + wan.owd(index(rep), others) + (len(g.members) - 1) * transfer
            free[rep] = start + (len(g.members) - 1) * transfer
            for m, t in zip(g.members[1:], arrive, strict=True):
                have[m] = float(t)
    return max(have.values())


def tree_round(sim: Sim, round_id: int, x: torch.Tensor, drops: dict[str, float]) -> dict[str, Any]:
    plan = hierarchical_plan(sim.ids, round_id, sim.s.group_size)
    represents = {m: plan.represents(m) for m in sim.ids}
    drop_hop = {m: int(u * plan.hops) for m, u in drops.items()}
    # a member sends its partial up at the hop of the first level it does not represent (the root: its mean
    # down at hop depth); dropped at or before that hop, its partial never went
    gone_up = {m for m, h in drop_hop.items() if h <= represents[m]}
    up = plan.rerouted(gone_up)
    down = plan.rerouted(drops)
    survivors = [m for m in sim.ids if m not in drops]
    msgs: dict[str, int] = defaultdict(int)
    peers: dict[str, set[str]] = defaultdict(set)
    for t in tree_transfers(up):
        if t.kind == "partial":
            msgs[t.src] += 1
            peers[t.src].add(t.dst)
            peers[t.dst].add(t.src)
    for t in tree_transfers(down):
        if t.kind == "mean":
            msgs[t.src] += 1
            peers[t.src].add(t.dst)
            peers[t.dst].add(t.src)
    for m in gone_up:  # children that had sent their partial to m before it dropped send it again
        for level_no in range(min(represents[m], drop_hop[m])):
            for g in plan.levels[level_no]:
                if g.representative == m:
                    for child in g.members[1:]:
                        if child not in drops:
                            msgs[child] += 1
                            peers[child].add(m)
    contributions = {m: x[index(m)] for m in sim.ids}
    mean, _ = tree_mean(up, contributions, transmit=sim.coding.transmit)
    per_message = sim.s.numel * sim.coding.bytes_per_value + sim.coding.per_message
    sent = {m: msgs[m] * per_message for m in survivors}
    conns = {m: len(peers[m]) for m in survivors}
    payload = sim.s.model_params * sim.coding.bytes_per_value
    latency = tree_latency(sim, plan, up, down, payload)
    prop = tree_latency(sim, plan, up, down, 0.0)
    exact = x[[index(m) for m in survivors]].double().mean(dim=0)
    row = sim.summary(survivors, msgs, conns, sent, plan.hops, latency, prop, rel_error(mean, exact))
    row["stale_in_mean"] = len(set(drops) - gone_up)
    row["root"] = plan.root
    return row


# -- rows and columns (the exchange's GroupedExchange) ----------------------------------------------------


@dataclass
class RowsCost:
    """What a grouped average costs its members: messages and bytes sent, and whom each talks to."""

    msgs: dict[str, int]
    sent: dict[str, float]
    peers: dict[str, set[str]]


@dataclass
class Carried:
    """One grouped average as the sim runs it: the mean every member decodes; by range of it, the round's
    members not in it; and when it ended, with a payload of the model's size and propagation only."""

    mean: torch.Tensor
    lost: list[tuple[int, int, set[str]]]
    end: float
    prop: float


def carried(
    sim: Sim,
    group: Group,
    values: dict[str, torch.Tensor],
    weights: dict[str, float],
    lost_in: dict[str, set[str]],
    cover: dict[str, set[str]],
    drop_at: dict[str, float],
    start: tuple[float, float],
    depth: int,
    cost: RowsCost | None,
) -> Carried:
    """grouped.py's average of `values` (by member of `group`: its contribution at this depth, weighted) from
    `start` (with a payload, propagation only), with its layout, its nesting and its losses (see rows_round):
    `lost_in` and `cover`, by member, the round's members its contribution lacks and brings; `drop_at`, by
    member, when it drops (with a payload). `cost` gathers each member's messages, bytes and peers (None: the
    latency alone, no arithmetic: the round's length without drops, to place the drops in it)."""
    s, coding = sim.s, sim.coding
    numel = next(iter(values.values())).numel()
    payload = s.model_params * coding.bytes_per_value * numel / s.numel
    plan = layout(group, s.group_size)

    def charge(ids: Sequence[str], n: int) -> None:
        if len(ids) < 2 or cost is None:
            return
        ids = sorted(ids)
        flat = flat_plan(ids)
        for m in ids:
            cost.msgs[m] += flat.load(m).messages_sent
            cost.sent[m] += flat.bytes_sent(m, n, coding.bytes_per_value, coding.per_message)
            cost.peers[m] |= set(ids) - {m}

    def mean_of(ids: Sequence[str], a: int, b: int, by: dict[str, float]) -> torch.Tensor:
        rows = torch.stack([values[m][a:b] for m in ids]) if cost is not None else None
        return allreduce_mean(coding, rows, [by[m] for m in ids]) if rows is not None else values[ids[0]][a:b]

    def allreduce(ids: Sequence[str], load: float) -> tuple[float, float]:
        idx = [index(m) for m in ids]
        return allreduce_latency(sim.wan, idx, load), allreduce_latency(sim.wan, idx, 0.0)

    rows = [[m.peer_id for m in row] for row in plan.rows]
    # Rows: a member dropped by the rows' end without drops is lost to its row, which notices it after `detect`
    # and retries among the rest.
    nominal = start[0] + max(allreduce(row, payload)[0] for row in rows)
    row_means: list[torch.Tensor | None] = []
    row_weights: list[float] = []
    row_lost: list[set[str]] = []
    rows_end = start
    for row in rows:
        kept = [m for m in row if drop_at.get(m, math.inf) >= nominal]
        charge(row, numel)
        lat, prop = allreduce(row, payload)
        if len(kept) < len(row):
            charge(kept, numel)
            again, again_prop = allreduce(kept, payload)
            lat, prop = lat + sim.detect + again, prop + sim.detect + again_prop
        rows_end = (max(rows_end[0], start[0] + lat), max(rows_end[1], start[1] + prop))
        row_lost.append(set().union(*(cover[m] for m in row if m not in kept), *(lost_in[m] for m in kept)))
        row_weights.append(math.fsum(weights[m] for m in kept))
        row_means.append(mean_of(kept, 0, numel, weights) if kept else None)
    mean = torch.empty(numel)
    lost: list[tuple[int, int, set[str]]] = []
    columns_end = rows_end
    for i in range(plan.slices):
        lo, hi = plan.bounds(numel, i)
        column = [row[i] for row in rows]
        brings = {c: set().union(*(cover[m] for m in rows[r])) for r, c in enumerate(column)}
        if len(column) > s.group_size and depth < MAX_DEPTH and hi - lo >= s.group_size:
            sub = carried(
                sim,
                Group.make(group.round_id, [GroupMember(c, "127.0.0.1:1") for c in column]),
                {
                    c: row_means[r][lo:hi] if row_means[r] is not None else values[c][lo:hi]
                    for r, c in enumerate(column)
                },  # type: ignore[index]
                {c: row_weights[r] for r, c in enumerate(column)},
                {c: row_lost[r] for r, c in enumerate(column)},
                brings,
                drop_at,
                rows_end,
                depth + 1,
                cost,
            )
            mean[lo:hi] = sub.mean
            lost.extend((lo + a, lo + b, gone) for a, b, gone in sub.lost)
            end = (sub.end, sub.prop)
        else:
            # A carrier dropped by the column's end without drops is lost to it (noticed after `detect`); so
            # is one whose row was lost whole. That slice is then its other rows' mean.
            lat, prop = allreduce(column, payload * (hi - lo) / numel)
            present = [
                r
                for r, c in enumerate(column)
                if drop_at.get(c, math.inf) >= rows_end[0] + lat and row_means[r] is not None
            ]
            charge(column, hi - lo)
            if len(present) < len(column):
                ids = [column[r] for r in present]
                charge(ids, hi - lo)
                again, again_prop = allreduce(ids, payload * (hi - lo) / numel)
                lat, prop = lat + sim.detect + again, prop + sim.detect + again_prop
            end = (rows_end[0] + lat, rows_end[1] + prop)
            if cost is not None:
                part = torch.stack([row_means[r][lo:hi] for r in present])  # type: ignore[index]
                mean[lo:hi] = allreduce_mean(coding, part, [row_weights[r] for r in present])
            gone = set().union(
                *(row_lost[r] for r in present),
                *(brings[c] for r, c in enumerate(column) if r not in present),
            )
            lost.append((lo, hi, gone))
        columns_end = (max(columns_end[0], end[0]), max(columns_end[1], end[1]))
        for r, row in enumerate(rows):  # the slice to each member of each row (from another row if need be)
            if cost is not None:
                others = len(row) - 1
                cost.msgs[column[r]] += others
                cost.sent[column[r]] += others * ((hi - lo) * coding.bytes_per_value + coding.per_message)
    gather, gather_prop = 0.0, 0.0
    for row in rows:
        for i, carrier in enumerate(row[: plan.slices]):
            others = np.asarray([index(m) for m in row if m != carrier])
            if len(others):
                lo, hi = plan.bounds(numel, i)
                owd = float(sim.wan.owd(index(carrier), others).max())
                link = len(others) * payload * (hi - lo) / numel / sim.wan.bandwidth
                gather, gather_prop = max(gather, owd + link), max(gather_prop, owd)
    return Carried(mean, lost, columns_end[0] + gather, columns_end[1] + gather_prop)


def rows_round(sim: Sim, round_id: int, x: torch.Tensor, drops: dict[str, float]) -> dict[str, Any]:
    """A round through GroupedExchange, its drops carried through at every depth (grouped.py, "A member
    lost"): a member lost in a row stage is left out of its row's mean, the row goes on (its flat exchange
    notices the drop after `detect` and retries among the rest) and its carriers tell their columns; a carrier
    lost by its column stage leaves that slice (or, one level down, that part of it) to the other rows (the
    column notices and retries likewise; a drop is a crash, whose address refuses connections, which is what
    grouped.py needs of a carrier that reached its column); a drop in the gather changes nothing (the slice
    comes from another row's carrier). Each range of the mean is then the weighted mean of what its column
    kept, alike on every member; `partial` counts the live members missing from some range. A drop at time u
    (a fraction of the round) falls in the stage the round without drops is in at that time."""
    group = Group.make(round_id, [GroupMember(m, "127.0.0.1:1") for m in sim.ids])
    cost = RowsCost(defaultdict(int), defaultdict(float), defaultdict(set))
    values = {m: x[index(m)] for m in sim.ids}
    hops = 5 * (1 + max(0, math.ceil(math.log(len(sim.ids), sim.s.group_size)) - 2))
    survivors = [m for m in sim.ids if m not in drops]
    exact = x[[index(m) for m in survivors]].double().mean(dim=0)
    ones, nobody, own = dict.fromkeys(sim.ids, 1.0), {m: set() for m in sim.ids}, {m: {m} for m in sim.ids}
    length = carried(sim, group, values, ones, nobody, own, {}, (0.0, 0.0), 0, None).end
    drop_at = {m: u * length for m, u in drops.items()}
    result = carried(sim, group, values, ones, nobody, own, drop_at, (0.0, 0.0), 0, cost)
    everywhere = set.intersection(*(gone for _, _, gone in result.lost))
    somewhere = set().union(*(gone for _, _, gone in result.lost))
    partial = {m for m in somewhere - everywhere if m not in drops}
    numel = result.mean.numel()
    withheld = sum((b - a) * len(gone - drops.keys()) for a, b, gone in result.lost) / (
        numel * len(survivors)
    )
    conns = {m: len(cost.peers[m]) for m in sim.ids}
    row = sim.summary(
        survivors, cost.msgs, conns, cost.sent, hops, result.end, result.prop, rel_error(result.mean, exact)
    )
    row["fell_back"] = 0.0
    row["partial"] = len(partial) / max(1, len(survivors))
    row["withheld"] = withheld
    return row


# -- Moshpit ----------------------------------------------------------------------------------------------


def moshpit_run(sim: Sim, x: torch.Tensor) -> dict[str, Any]:
    """Rounds 0.. over the same vectors (round 0's): d rounds at least, `rounds` if more."""
    s, coding = sim.s, sim.coding
    live = list(sim.ids)
    replicas = {m: x[index(m)].clone() for m in live}
    dims = moshpit_plan(live, 0, s.group_size).dimensions
    rows, spreads = [], []
    error_at_d = math.nan
    payload = s.model_params * coding.bytes_per_value
    for round_id in range(max(dims, s.rounds)):
        plan: MoshpitPlan = moshpit_plan(live, round_id, s.group_size)
        drops = sim.drops(live)
        msgs: dict[str, int] = defaultdict(int)
        conns: dict[str, int] = defaultdict(int)
        sent: dict[str, float] = defaultdict(float)
        latencies, props = [], []
        for g in plan.groups:
            left = [m for m in g.members if m not in drops]
            attempts = [g.members, tuple(left)] if len(left) < len(g.members) else [g.members]
            for members in attempts:
                if len(members) < 2:
                    continue
                line = flat_plan(sorted(members))
                for m in left:
                    load = line.load(m)
                    msgs[m] += load.messages_sent
                    conns[m] = max(conns[m], load.connections)
                    sent[m] += line.bytes_sent(m, s.numel, coding.bytes_per_value, coding.per_message)
            idx = [index(m) for m in g.members]
            first, prop_first = sim_allreduce(sim, idx, payload)
            if len(left) < len(g.members):
                u = min(drops[m] for m in g.members if m in drops)
                retry, prop_retry = sim_allreduce(sim, [index(m) for m in left], payload)
                latencies.append(u * first + sim.detect + retry)
                props.append(u * prop_first + sim.detect + prop_retry)
            else:
                latencies.append(first)
                props.append(prop_first)
            if len(left) >= 2:
                mean = allreduce_mean(coding, torch.stack([replicas[m] for m in left]))
                for m in left:
                    replicas[m] = mean
        live = [m for m in live if m not in drops]
        for m in drops:
            del replicas[m]
        exact = x[[index(m) for m in live]].double().mean(dim=0)
        stacked = torch.stack([replicas[m] for m in live]).double()
        centre = stacked.mean(dim=0)
        spread = float(((stacked - centre).norm(dim=1) ** 2).mean().sqrt() / exact.norm())
        error = float(((stacked - exact).norm(dim=1) ** 2).mean().sqrt() / exact.norm())
        if round_id < dims:
            spreads.append(spread)
        if round_id == dims - 1:
            error_at_d = error
        rows.append(sim.summary(live, msgs, conns, sent, plan.hops, max(latencies), max(props), error))
    out = combine(rows)
    out.update(
        err=error_at_d, spread=spreads, dims=dims, sides=list(moshpit_plan(sim.ids, 0, s.group_size).sides)
    )
    return out


def sim_allreduce(sim: Sim, idx: list[int], payload: float) -> tuple[float, float]:
    return allreduce_latency(sim.wan, idx, payload), allreduce_latency(sim.wan, idx, 0.0)


# -- the simulation ---------------------------------------------------------------------------------------


class Sim:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.rng = random.Random(s.seed)
        self.wan = Wan(s, np.random.default_rng(s.seed))
        self.coding = Coding(s.codec)
        self.ids = names(s.peers)
        self.detect = s.detect_ms / 1e3
        self.gen = torch.Generator().manual_seed(s.seed)

    def contributions(self) -> torch.Tensor:
        shared = torch.randn(self.s.numel, generator=self.gen)
        return shared + torch.randn(self.s.peers, self.s.numel, generator=self.gen)

    def drops(self, members: Sequence[str]) -> dict[str, float]:
        """Who drops this round, and when (a fraction of the round)."""
        return {m: self.rng.random() for m in members if self.rng.random() < self.s.churn}

    def summary(
        self,
        members: Sequence[str],
        msgs: dict[str, int],
        conns: dict[str, int],
        sent: dict[str, float],
        hops: int,
        latency: float,
        prop: float,
        error: float,
    ) -> dict[str, Any]:
        m_values = [msgs.get(m, 0) for m in members]
        c_values = [conns.get(m, 0) for m in members]
        b_values = [sent.get(m, 0.0) for m in members]
        return {
            "msgs_mean": statistics.fmean(m_values),
            "msgs_max": max(m_values),
            "conns_mean": statistics.fmean(c_values),
            "conns_max": max(c_values),
            "kb_mean": statistics.fmean(b_values) / 1e3,
            "kb_max": max(b_values) / 1e3,
            "hops": hops,
            "latency_s": latency,
            "prop_ms": prop * 1e3,
            "err": error,
        }

    def run(self) -> list[dict[str, Any]]:
        per_plan: dict[str, list[dict[str, Any]]] = defaultdict(list)
        roots: list[str] = []
        first = None
        for round_id in range(self.s.rounds):
            x = self.contributions()
            first = x if first is None else first
            drops = self.drops(self.ids)
            per_plan["flat"].append(flat_round(self, round_id, x, drops))
            row = tree_round(self, round_id, x, drops)
            roots.append(row.pop("root"))
            per_plan["tree"].append(row)
            if self.s.peers > self.s.group_size:
                per_plan["rows"].append(rows_round(self, round_id, x, drops))
        assert first is not None
        out = []
        for plan in ("flat", "tree", "rows"):
            if not per_plan[plan]:
                continue
            row = combine(per_plan[plan])
            row["plan"] = plan
            out.append(row)
        out[1]["roots"] = len(set(roots))
        out[1]["depth"] = hierarchical_plan(self.ids, 0, self.s.group_size).depth
        moshpit = moshpit_run(self, first)
        moshpit["plan"] = "moshpit"
        out.append(moshpit)
        for row in out:
            row.update(
                peers=self.s.peers, group_size=self.s.group_size, codec=self.s.codec, churn=self.s.churn
            )
        return out


def combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds together: means of the means, maxima of the maxima, the median latency, the mean error."""
    out: dict[str, Any] = {}
    for key in ("msgs_mean", "conns_mean", "kb_mean", "prop_ms"):
        out[key] = statistics.fmean(r[key] for r in rows)
    errors = [r["err"] for r in rows if not math.isnan(r["err"])]  # over the rounds that committed
    out["err"] = statistics.fmean(errors) if errors else math.nan
    out["committed"] = statistics.fmean(r.get("committed", 1.0) for r in rows)
    out["fell_back"] = statistics.fmean(r.get("fell_back", 0.0) for r in rows)
    out["partial"] = statistics.fmean(r.get("partial", 0.0) for r in rows)
    if "withheld" in rows[0]:
        out["withheld"] = statistics.fmean(r["withheld"] for r in rows)
    for key in ("msgs_max", "conns_max", "kb_max", "hops"):
        out[key] = max(r[key] for r in rows)
    out["latency_s"] = statistics.median(r["latency_s"] for r in rows)
    out["latency_max_s"] = max(r["latency_s"] for r in rows)
    if "stale_in_mean" in rows[0]:
        out["stale_in_mean"] = statistics.fmean(r["stale_in_mean"] for r in rows)
    out["rounds"] = len(rows)
    return out


def simulate(settings: Settings) -> list[dict[str, Any]]:
    started = time.perf_counter()
    rows = Sim(settings).run()
    for row in rows:
        row["sim_seconds"] = time.perf_counter() - started
    return rows


def markdown(rows: list[dict[str, Any]], s: Settings) -> str:
    lines = [
        f"G = {s.group_size}, codec {s.codec}, {s.numel} values per contribution, {s.rounds} rounds, churn "
        f"{s.churn:.1%} of peers per round; RTT median {s.rtt_ms:g} ms (log-normal sigma {s.rtt_sigma}), "
        f"packets lost {s.loss:.0%}, links {s.bandwidth_mbps:g} Mbit/s, "
        f"round s for {s.model_params:.3g} values, "
        f"drops noticed after {s.detect_ms:g} ms",
        "",
        "| peers | plan | msgs/peer mean | max | conns/peer mean | max | KB sent/peer mean | max | hops "
        "| prop ms | round s | committed | fell back | partial | err | moshpit spread after 1..d |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hops = f"{r['hops']}" + (f" (x{r['dims']} to mix)" if r["plan"] == "moshpit" else "")
        spread = " / ".join(f"{v:.2g}" for v in r.get("spread", [])) or ""
        withheld = f" ({r['withheld']:.2%})" if r.get("withheld") else ""
        lines.append(
            f"| {r['peers']} | {r['plan']} | {r['msgs_mean']:.1f} | {r['msgs_max']} | "
            f"{r['conns_mean']:.1f} | "
            f"{r['conns_max']} | {r['kb_mean']:.1f} | {r['kb_max']:.1f} | {hops} | {r['prop_ms']:.0f} | "
            f"{r['latency_s']:.2f} | {r.get('committed', 1.0):.0%} | {r.get('fell_back', 0.0):.0%} | "
            f"{r.get('partial', 0.0):.1%}{withheld} | "
            f"{r['err']:.2g} | {spread} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Settings(peers=0)
    parser.add_argument("--peers", type=int, nargs="+", default=[16, 64, 256, 1000])
    parser.add_argument(
        "--group-size", type=int, default=defaults.group_size, help="G, the most members a group"
    )
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument(
        "--churn", type=float, default=defaults.churn, help="fraction of peers dropped per round"
    )
    parser.add_argument("--codec", choices=["int8", "fp32"], default=defaults.codec)
    parser.add_argument("--numel", type=int, default=defaults.numel, help="values per synthetic contribution")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    for name in ("rtt-ms", "rtt-sigma", "loss", "model-params", "bandwidth-mbps", "detect-ms"):
        attr = name.replace("-", "_")
        parser.add_argument(f"--{name}", type=float, default=getattr(defaults, attr))
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    if args.group_size < 2:
        parser.error(f"--group-size: expected an int >= 2, got {args.group_size}")
    if not 0.0 <= args.churn < 1.0:
        parser.error(f"--churn: expected a fraction in [0, 1), got {args.churn}")
    rows: list[dict[str, Any]] = []
    settings = defaults
    for n in args.peers:
        settings = Settings(
            peers=n,
            group_size=args.group_size,
            rounds=args.rounds,
            churn=args.churn,
            codec=args.codec,
            numel=args.numel,
            seed=args.seed,
            rtt_ms=args.rtt_ms,
            rtt_sigma=args.rtt_sigma,
            loss=args.loss,
            model_params=args.model_params,
            bandwidth_mbps=args.bandwidth_mbps,
            detect_ms=args.detect_ms,
        )
        for row in simulate(settings):
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    print(markdown(rows, settings) if args.markdown else "\n".join(json.dumps(r) for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
