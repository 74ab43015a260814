"""protocol/exchange/groups.py: bounded-size averaging plans. Deterministic and alike on every member, every
member in exactly one group per level, groups of at most G, the tree's mean exact (also re-routed past gone
members), the representative's load rotating with the round id, Moshpit's full grid mixing to the exact mean
in d rounds, and bad arguments refused with what was expected and what came. Plus a small run of
benchmarks/group_sim.py."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
import torch
from helpers.scripts import BENCHMARKS, load_script

from farloco.protocol.exchange.groups import (
    flat_plan,
    grid_sides,
    hierarchical_plan,
    moshpit_plan,
    moshpit_round,
    tree_mean,
    tree_transfers,
)


def ids(n: int) -> list[str]:
    return sorted(f"peer-{i:04d}" for i in range(n))


def ceil_log(n: int, g: int) -> int:
    depth = 0
    while g**depth < n:
        depth += 1
    return depth


@pytest.mark.parametrize(("n", "g"), [(1, 2), (2, 2), (3, 2), (7, 3), (16, 16), (17, 16), (100, 8), (250, 4)])
def test_hierarchical_plan_is_deterministic_covers_everyone_once_and_bounds_groups(n: int, g: int) -> None:
    members = ids(n)
    plan = hierarchical_plan(members, 7, g)
    again = hierarchical_plan(tuple(members), 7, g)  # another member, another container: the same plan
    assert plan == again and plan.levels == again.levels and plan.transfers == again.transfers
    assert plan.depth == ceil_log(n, g) and plan.hops == 2 * plan.depth
    level0 = [m for group in plan.levels[0] for m in group.members]
    assert sorted(level0) == members  # each member exactly once
    for below, level in itertools.pairwise(plan.levels):
        assert sorted(m for group in level for m in group.members) == sorted(h.representative for h in below)
    for level in plan.levels:
        sizes = [len(group.members) for group in level]
        assert max(sizes) <= g and max(sizes) - min(sizes) <= 1
    assert len(plan.levels[-1]) == 1
    # every member's view of the messages agrees with its peers': whom it sends to take from it, and back
    for t in plan.transfers:
        assert t.dst in plan.load(t.src).sends_to and t.src in plan.load(t.dst).receives_from
    # one up and one down per member but the root; the root represents every level
    assert sum(plan.load(m).messages_sent for m in members) == 2 * (n - 1)
    assert plan.represents(plan.root) == plan.depth and plan.parent(plan.root) is None
    for m in members:
        if m != plan.root:
            assert plan.parent(m) is not None and plan.load(m).connections <= plan.represents(m) * (g - 1) + 1


@pytest.mark.parametrize("g", [2, 4, 16])
@pytest.mark.parametrize("n_of_g", ["1", "2", "3", "G", "G+1", "100"])
def test_hierarchical_mean_is_the_exact_weighted_mean(g: int, n_of_g: str) -> None:
    n = {"1": 1, "2": 2, "3": 3, "G": g, "G+1": g + 1, "100": 100}[n_of_g]
    members = ids(n)
    rng = torch.Generator().manual_seed(n * 31 + g)
    values = {m: torch.randn(257, generator=rng) * 3 + 1 for m in members}
    weights = {m: 0.25 + float(torch.rand((), generator=rng)) for m in members}
    plan = hierarchical_plan(members, 3, g)
    mean, total = tree_mean(plan.levels, values, weights)
    exact = sum(values[m].double() * weights[m] for m in members) / sum(weights.values())
    assert isinstance(exact, torch.Tensor)
    assert mean.dtype == torch.float32 and total == pytest.approx(sum(weights.values()))
    assert float((mean.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    # unweighted, and a lossy transmit applied on each message (every member still ends with the same bytes)
    plain, _ = tree_mean(plan.levels, values)
    assert torch.allclose(
        plain.double(), torch.stack([v.double() for v in values.values()]).mean(0), atol=1e-5
    )
    rounded, _ = tree_mean(plan.levels, values, transmit=lambda v: v.half().float())
    assert float((rounded.double() - plain.double()).abs().max()) < 0.05


def test_a_rerouted_tree_keeps_everyone_left_and_its_mean_is_theirs() -> None:
    members = ids(60)
    plan = hierarchical_plan(members, 11, 4)
    gone = {plan.root, *(g.representative for g in plan.levels[0][:3]), members[5]}
    tree = plan.rerouted(gone)
    left = sorted(set(members) - gone)
    assert sorted(m for g in tree[0] for m in g.members) == left
    for below, level in itertools.pairwise(tree):
        assert sorted(m for g in level for m in g.members) == sorted(h.representative for h in below)
    assert len(tree[-1]) == 1 and tree[-1][0].representative not in gone
    assert all(len(g.members) <= 4 for level in tree for g in level)
    assert not {t.src for t in tree_transfers(tree)} & gone
    values = {m: torch.tensor([float(i), 1.0]) for i, m in enumerate(members)}
    mean, total = tree_mean(tree, values)
    assert total == len(left)
    assert mean[0].item() == pytest.approx(sum(members.index(m) for m in left) / len(left), rel=1e-6)
    assert plan.rerouted(()) == plan.levels


def test_the_representatives_load_rotates_with_the_round_id() -> None:
    members = ids(40)
    rounds = 200
    reps: Counter[str] = Counter()
    roots: Counter[str] = Counter()
    for round_id in range(rounds):
        plan = hierarchical_plan(members, round_id, 4)
        reps.update(g.representative for g in plan.levels[0])
        roots[plan.root] += 1
    assert hierarchical_plan(members, 0, 4).levels != hierarchical_plan(members, 1, 4).levels
    # 10 level-0 representatives of 40 a round: each member's fair share is 50 of 200 rounds
    assert set(reps) == set(members)
    assert min(reps.values()) >= 25 and max(reps.values()) <= 80
    assert len(roots) >= 30 and max(roots.values()) <= 15  # a fair share: 5 rounds as root each


@pytest.mark.parametrize(("n", "g"), [(1, 2), (2, 2), (17, 16), (64, 8), (100, 8), (1000, 16), (37, 3)])
def test_moshpit_grid_is_round_independent_bounded_and_rotates_its_dimension(n: int, g: int) -> None:
    members = ids(n)
    sides = grid_sides(n, g)
    assert len(sides) == max(1, ceil_log(n, g)) and max(sides) <= g and math.prod(sides) >= n
    plans = [moshpit_plan(members, r, g) for r in range(len(sides) + 1)]
    assert plans[0] == moshpit_plan(list(members), 0, g)
    assert all(p.coords == plans[0].coords for p in plans)  # the grid does not move with the round
    assert len(set(plans[0].coords.values())) == n  # one member a cell
    for r, plan in enumerate(plans):
        assert plan.dim == r % len(sides)
        assert sorted(m for group in plan.groups for m in group.members) == members
        assert all(len(group.members) <= g for group in plan.groups)
        for group in plan.groups:  # a line: all coordinates alike but the round's dimension
            keys = {plan.coords[m][: plan.dim] + plan.coords[m][plan.dim + 1 :] for m in group.members}
            assert len(keys) == 1
            assert plan.load(group.members[0]).connections == len(group.members) - 1


def test_moshpit_on_a_full_grid_gives_everyone_the_exact_mean_after_d_rounds() -> None:
    members = ids(64)
    rng = random.Random(4)
    start = {m: rng.uniform(-10, 10) for m in members}
    exact = sum(start.values()) / len(start)
    replicas = dict(start)
    spreads = []
    d = moshpit_plan(members, 0, 8).dimensions
    assert d == 2
    for round_id in range(d):
        replicas = moshpit_round(moshpit_plan(members, round_id, 8), replicas)
        spreads.append(max(replicas.values()) - min(replicas.values()))
    assert spreads[0] > 1.0  # after one round the lines differ
    assert all(v == pytest.approx(exact, abs=1e-12) for v in replicas.values())


def test_bytes_and_messages_per_member() -> None:
    members = ids(10)
    numel, bpv = 1000, 1 + 4 / 128
    flat = flat_plan(members)
    assert flat.hops == 2 and all(flat.load(m).messages_sent == 18 for m in members)
    # every value once to its owner and every slice's mean to the 9 others: 2 (N - 1) numel in all
    assert sum(flat.bytes_sent(m, numel, 4.0) for m in members) == 2 * 9 * numel * 4.0
    assert flat.bytes_sent(members[0], numel, 4.0, per_message=32) == (900 + 9 * 100) * 4.0 + 18 * 32
    tree = hierarchical_plan(members, 0, 4)
    root = tree.load(tree.root)
    assert tree.bytes_sent(tree.root, numel, bpv, 32) == pytest.approx(
        root.messages_sent * (numel * bpv + 32)
    )
    leaf = next(m for m in members if tree.represents(m) == 0)
    assert tree.load(leaf).messages_sent == 1 and tree.bytes_sent(leaf, numel, 4.0) == numel * 4.0
    mosh = moshpit_plan(members, 0, 4)
    group = mosh.group_of(members[0])
    k = len(group.members)
    expected = sum(numel // k + (j < numel % k) for j in range(k) if group.members[j] != members[0])
    own = numel // k + (group.members.index(members[0]) < numel % k)
    assert mosh.bytes_sent(members[0], numel, 1.0) == expected + (k - 1) * own
    with pytest.raises(KeyError):
        tree.load("nobody")


@pytest.mark.parametrize(
    ("members", "round_id", "group_size", "message"),
    [
        (["a", "b"], 0, 1, r"group_size: expected an int >= 2, got 1"),
        (["a", "b"], 0, 0, r"group_size: expected an int >= 2, got 0"),
        (["a", "b"], 0, 2.5, r"group_size: expected an int >= 2, got 2.5"),
        (["a", "b"], 0, True, r"group_size: expected an int >= 2, got True"),
        ([], 0, 4, r"members: expected at least one peer id, got an empty list"),
        (["a", "b", "b"], 0, 4, r"members: expected distinct peer ids, got 'b' twice"),
        (["b", "a"], 0, 4, r"members: expected the frozen group's sorted peer ids, got 'b' before 'a'"),
        (["a", ""], 0, 4, r"members: expected non-empty str peer ids, got ''"),
        ("ab", 0, 4, r"members: expected a sequence of peer ids, got the string 'ab'"),
        (["a", "b"], -1, 4, r"round_id: expected an int >= 0, got -1"),
    ],
)
def test_bad_arguments_are_refused_with_what_was_expected(
    members: list[str], round_id: int, group_size: int, message: str
) -> None:
    for build in (hierarchical_plan, moshpit_plan):
        with pytest.raises(ValueError, match=message):
            build(members, round_id, group_size)


def test_group_sim_runs_and_its_figures_hold() -> None:
    sim = load_script(BENCHMARKS / "group_sim.py", "group_sim")
    rows = {
        r["plan"]: r
        for r in sim.simulate(sim.Settings(peers=27, group_size=3, rounds=2, codec="fp32", model_params=1e6))
    }
    assert rows["flat"]["msgs_max"] == 2 * 26 and rows["flat"]["conns_max"] == 26
    assert rows["tree"]["hops"] == 6 and rows["tree"]["conns_max"] <= 3 * 2 and rows["tree"]["msgs_mean"] < 2
    assert rows["tree"]["err"] < 1e-6 and rows["flat"]["err"] < 1e-6
    moshpit = rows["moshpit"]
    assert moshpit["sides"] == [3, 3, 3] and moshpit["msgs_max"] == 4 and len(moshpit["spread"]) == 3
    assert moshpit["spread"][0] > 0.1 and moshpit["spread"][-1] < 1e-6 and moshpit["err"] < 1e-6
    churned = sim.simulate(sim.Settings(peers=27, group_size=3, rounds=2, churn=0.2, codec="int8", seed=2))
    by_plan = {r["plan"]: r for r in churned}
    assert by_plan["flat"]["msgs_max"] > 2 * 26  # a retry
    assert by_plan["tree"]["err"] < 0.2 and by_plan["tree"]["hops"] == 6
    # nested columns (9 rows of 3) carry the drops too: every round commits in rows, nobody talks to more than
    # its row and its nested column's row and column (and their retries), and some live members miss a range
    assert by_plan["rows"]["fell_back"] == 0 and by_plan["rows"]["committed"] == 1
    assert by_plan["rows"]["conns_max"] <= 6 and 0 < by_plan["rows"]["partial"] < 1


def test_group_sim_rows_are_the_exchanges_layout_nested_and_exact() -> None:
    """27 peers in rows of 3: 9 rows, slices of 3, each column of 9 in rows and columns of its own; fp32 gives
    the exact mean, and nobody talks to more than its row and its nested column's rows and columns."""
    sim = load_script(BENCHMARKS / "group_sim.py", "group_sim")
    rows = {
        r["plan"]: r
        for r in sim.simulate(sim.Settings(peers=27, group_size=3, rounds=2, codec="fp32", model_params=1e6))
    }["rows"]
    assert rows["err"] < 1e-6 and rows["committed"] == 1
    # row (2) + the nested column's row (2) and column (2): 6 peers, not 26
    assert rows["conns_max"] <= 6 and rows["msgs_max"] < 2 * 26
    assert rows["kb_max"] < 2 * 4096 * 4 * 2 / 1e3  # under twice what the flat exchange sends
    int8 = {r["plan"]: r for r in sim.simulate(sim.Settings(peers=27, group_size=3, rounds=2, codec="int8"))}
    assert int8["rows"]["err"] < 3 * int8["flat"]["err"]


def test_group_sim_carries_drops_through_rows_of_a_group_without_nesting() -> None:
    """36 peers in 6 rows of 6 (no nesting): a drop is carried through the round instead of a fallback, so every
    round commits in rows, nobody talks to more than its row and its column (and their retries), and a lost
    carrier's row-mates are counted as partial."""
    sim = load_script(BENCHMARKS / "group_sim.py", "group_sim")
    churned = sim.simulate(sim.Settings(peers=36, group_size=6, rounds=4, churn=0.1, codec="fp32", seed=3))
    rows = {r["plan"]: r for r in churned}["rows"]
    assert rows["committed"] == 1 and rows["fell_back"] == 0
    assert rows["conns_max"] <= 2 * 5
    assert 0 < rows["partial"] < 0.5
    assert rows["err"] < 0.2
