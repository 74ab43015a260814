"""Spans: members that contribute to a range of slices only (the nodes of an island, node/daemon/island.py), with
members that contribute everything, in one exchange over real RpcServers on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers.exchange import CODECS, Node, make_input, run, tolerance

from farloco.protocol.exchange import Exchange, ExchangeAborted, slice_bounds
from farloco.protocol.types import Group

SLICES = 8
# Two islands of two (each node one half of the slices, weighted by its island's size) and a lone node.
LAYOUT = [
    ("a0", (0, 4), 2.0),
    ("a1", (4, 8), 2.0),
    ("b0", (0, 4), 2.0),
    ("b1", (4, 8), 2.0),
    ("lone", None, 1.0),
]


async def start(layout: list[tuple[str, tuple[int, int] | None, float]], slices: int = SLICES) -> tuple:
    nodes = [Node(name, slices=slices) for name, _, _ in layout]
    members = [await node.start() for node in nodes]
    return nodes, Group.make(5, members)


@pytest.mark.parametrize("codec_name", ["raw", "fp32", "int8"])
def test_islands_slices_meet_the_lone_node_at_the_same_owners(codec_name: str) -> None:
    numel = 100_003

    async def body() -> None:
        nodes, group = await start(LAYOUT)
        try:
            # Island a's nodes carry the island's mean (both halves alike), as do island b's.
            island_a, island_b, lone = make_input(1, numel), make_input(2, numel), make_input(3, numel)
            inputs = [island_a, island_a, island_b, island_b, lone]
            codec = CODECS[codec_name]()
            results = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], codec, timeout=30, weight=w, span=span)
                    for i, (node, (_, span, w)) in enumerate(zip(nodes, LAYOUT, strict=True))
                )
            )
            # The mean every node would get from a flat exchange of the five nodes' own contributions.
            exact = (2 * island_a + 2 * island_b + lone) / 5
            full = results[4].averaged
            assert float((full - exact).abs().max()) <= tolerance(codec_name, inputs)
            for (name, span, _), result in zip(LAYOUT, results, strict=True):
                lo, hi = (0, numel) if span is None else slice_bounds(numel, SLICES, span)
                # Bit-identical with the lone node's result wherever the node takes part.
                assert torch.equal(result.averaged[lo:hi], full[lo:hi]), name
                assert result.contributors == tuple(sorted(n for n, _, _ in LAYOUT))
            # An island node sends about half of what the lone node sends, and counts only what it sent.
            a0, lone_result = results[0], results[4]
            assert a0.fp32_bytes < 0.6 * lone_result.fp32_bytes
            assert a0.bytes_sent < 0.6 * lone_result.bytes_sent
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_spans_with_a_robust_rule_aggregate_the_present_members_only() -> None:
    from farloco.optim.aggregate import Aggregator

    async def body() -> None:
        nodes, group = await start(LAYOUT)
        try:
            numel = 40_000
            inputs = [make_input(10 + i, numel) for i in range(5)]
            rule = Aggregator("median")
            codec = CODECS["raw"]()
            results = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], codec, timeout=30, weight=w, span=span, rule=rule)
                    for i, (node, (_, span, w)) in enumerate(zip(nodes, LAYOUT, strict=True))
                )
            )
            lo, hi = slice_bounds(numel, SLICES, (0, 4))
            # Slices 0-3: a0, b0 and the lone node take part; the median of three is the middle value.
            expected = torch.stack([inputs[0], inputs[2], inputs[4]]).median(0).values
            assert torch.equal(results[4].averaged[lo:hi], expected[lo:hi])
            assert torch.equal(results[0].averaged[lo:hi], expected[lo:hi])
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_a_member_cut_at_other_slices_is_refused_by_name() -> None:
    async def body() -> None:
        spans = [(0, 4), None]
        nodes = [Node("a0", slices=SLICES), Node("a1", slices=4)]
        members = [await node.start() for node in nodes]
        group = Group.make(5, members)
        try:
            codec = CODECS["raw"]()
            results = await asyncio.gather(
                *(
                    node.exchange.average(group, make_input(i, 50_000), codec, timeout=10, span=span)
                    for i, (node, span) in enumerate(zip(nodes, spans, strict=True))
                ),
                return_exceptions=True,
            )
            assert all(isinstance(r, ExchangeAborted) for r in results), results
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_span_arguments_are_checked() -> None:
    async def body() -> None:
        plain, sliced = Node("p"), Node("q", slices=SLICES)
        members = [await plain.start(), await sliced.start()]
        group = Group.make(1, members)
        try:
            tensor = make_input(0, 1000)
            with pytest.raises(ValueError, match="without slices"):
                await plain.exchange.average(group, tensor, CODECS["raw"](), timeout=5, span=(0, 1))
            with pytest.raises(ValueError, match="0 <= g0 < g1 <= 8"):
                await sliced.exchange.average(group, tensor, CODECS["raw"](), timeout=5, span=(3, 3))
            with pytest.raises(ValueError, match="dense codec"):
                await sliced.exchange.average(group, tensor, CODECS["topk"](), timeout=5, span=(0, 4))
        finally:
            await plain.stop()
            await sliced.stop()

    run(body())
    with pytest.raises(ValueError, match="slices must be 0 or in 2"):
        Exchange(None, None, "x", slices=1)  # type: ignore[arg-type]
