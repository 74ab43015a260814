"""The exchange in rows and columns (protocol/exchange/grouped.py): real RpcServers on 127.0.0.1, every member in
this process, the rounds' three stages over gRPC and the TCP data plane."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers.exchange import CODECS, Node, make_input, run, start_nodes

from farloco.protocol.exchange import AverageResult, ExchangeAborted, OnDemand
from farloco.protocol.exchange.grouped import SLICE_METHOD, GroupedExchange, SliceRequest, layout
from farloco.protocol.exchange.wire import MAX_TAG_ITEMS, AttemptRef, Hello
from farloco.protocol.rpc import Frame, Reject, RpcError
from farloco.protocol.types import Group, GroupMember


def members(count: int) -> list[GroupMember]:
    return [GroupMember(f"peer-{i:03d}", f"127.0.0.1:{1000 + i}") for i in range(count)]


@pytest.mark.parametrize(("count", "size"), [(3, 2), (7, 3), (16, 4), (17, 4), (64, 8), (1000, 16)])
def test_the_layout_cuts_balanced_rows_and_every_slice_has_a_column(count: int, size: int) -> None:
    group = Group.make(5, members(count))
    plan = layout(group, size)
    sizes = [len(row) for row in plan.rows]
    assert len(plan.rows) == -(-count // size) and max(sizes) <= size and max(sizes) - min(sizes) <= 1
    assert plan.slices == min(sizes)
    assert sorted(m.peer_id for row in plan.rows for m in row) == [m.peer_id for m in group.members]
    for i in range(plan.slices):
        assert len(plan.column(i)) == len(plan.rows)
    # Slices cover the tensor, in order, without a gap.
    bounds = [plan.bounds(10_001, i) for i in range(plan.slices)]
    assert bounds[0][0] == 0 and bounds[-1][1] == 10_001
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    # Everyone derives the same from the same group; the seats move with the round.
    assert layout(Group.make(5, list(reversed(members(count)))), size) == plan
    assert layout(Group.make(6, members(count)), size).rows != plan.rows
    # Whom a member talks to is bounded by its row, its column: not the N - 1 of the flat exchange.
    worst = max(len(plan.peers_of(m.peer_id)) for m in group.members)
    assert worst <= 2 * size + -(-count // size)
    if count >= 64:
        assert worst < (count - 1) / 2


def test_a_layout_refuses_a_group_size_below_two() -> None:
    with pytest.raises(ValueError, match="group_size: expected an int >= 2, got 1"):
        layout(Group.make(1, members(4)), 1)


def grouped(nodes: list[Node], size: int) -> list[GroupedExchange]:
    return [GroupedExchange(n.exchange, n.server, n.client, n.peer_id, size) for n in nodes]


def exact_mean(inputs: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    total = sum(w * x.double() for w, x in zip(weights, inputs, strict=True))
    assert isinstance(total, torch.Tensor)
    return (total / sum(weights)).float()


@pytest.mark.parametrize("codec_name", ["fp32", "raw", "int8"])
@pytest.mark.parametrize(("count", "size"), [(5, 2), (7, 3), (13, 3), (10, 2)])
def test_rows_and_columns_give_every_member_the_same_weighted_mean(
    count: int, size: int, codec_name: str
) -> None:
    numel = 50_003  # uneven slices and parts, short chunks

    async def body() -> None:
        nodes, group = await start_nodes(count)
        exchanges = grouped(nodes, size)
        try:
            inputs = [make_input(i, numel) for i in range(count)]
            weights = [1.0 + 0.5 * i for i in range(count)]
            codec = CODECS[codec_name]()
            results = await asyncio.gather(
                *(
                    ex.average(group, inputs[i], codec, timeout=30, weight=weights[i])
                    for i, ex in enumerate(exchanges)
                )
            )
            exact = exact_mean(inputs, weights)
            for result in results:
                assert torch.equal(result.averaged, results[0].averaged)  # one hash a round
                assert result.contributors == tuple(m.peer_id for m in group.members)
                assert result.bytes_sent > 0 and result.bytes_received > 0
            err = float((results[0].averaged - exact).abs().max())
            if codec_name == "int8":
                # Each contribution coded once (row), each row's mean once (column): three half-steps at most
                # of the largest scale a block can have (a row mean is no larger than the largest input).
                bound = 3 * max(float(x.abs().max()) for x in inputs) / 127
                assert err <= bound, (err, bound)
            else:
                assert err <= 1e-5, err
            # What the swarm saw of a member's contribution is the row stage's (error feedback).
            for i, result in enumerate(results):
                if codec_name == "int8":
                    assert result.transmitted is not None
                    assert (
                        float((result.transmitted - inputs[i]).abs().max())
                        <= float(inputs[i].abs().max()) / 127
                    )
                else:
                    assert torch.equal(result.transmitted, inputs[i])
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_each_member_talks_to_its_row_and_column_only() -> None:
    """Every call a member makes goes to a peer of its row or column: the pushes, the votes, the slices."""
    count, size = 9, 3

    async def body() -> None:
        nodes, group = await start_nodes(count)
        exchanges = grouped(nodes, size)
        called: dict[str, Counter[str]] = {n.peer_id: Counter() for n in nodes}
        by_address = {m.address: m.peer_id for m in group.members}
        for node in nodes:
            for name in ("stream", "unary"):
                original = getattr(node.client, name)

                def spy(
                    address: str, *args: Any, _orig: Any = original, _me: str = node.peer_id, **kw: Any
                ) -> Any:
                    called[_me][by_address[address]] += 1
                    return _orig(address, *args, **kw)

                setattr(node.client, name, spy)
        try:
            codec = CODECS["int8"]()
            await asyncio.gather(
                *(
                    ex.average(group, make_input(i, 30_000), codec, timeout=30)
                    for i, ex in enumerate(exchanges)
                )
            )
            plan = layout(group, size)
            for node in nodes:
                assert set(called[node.peer_id]) <= plan.peers_of(node.peer_id), node.peer_id
                assert len(plan.peers_of(node.peer_id)) < count - 1
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_an_on_demand_contribution_goes_through_the_rows() -> None:
    count, size, numel = 5, 2, 20_000

    async def body() -> None:
        nodes, group = await start_nodes(count)
        exchanges = grouped(nodes, size)
        try:
            inputs = [make_input(i, numel) for i in range(count)]
            codec = CODECS["int8"]()
            demands = [OnDemand(numel, lambda a, b, out, x=x: out.copy_(x[a:b])) for x in inputs]
            outs = [torch.empty(numel) for _ in range(count)]
            results = await asyncio.gather(
                *(
                    ex.average(group, demands[i], codec, timeout=30, out=outs[i])
                    for i, ex in enumerate(exchanges)
                )
            )
            for i, result in enumerate(results):
                assert result.averaged.data_ptr() == outs[i].data_ptr()
                assert torch.equal(result.averaged, results[0].averaged)
                assert (
                    result.transmitted is None and result.encoded_in
                )  # rebuilt by the caller from its ranges
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_small_groups_sparse_codecs_spans_and_rules_go_flat() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(4)
        flat_calls: list[str] = []
        exchanges = grouped(nodes, 4)  # 4 members: not more than the bound
        for ex in exchanges:
            original = ex.inner.average

            async def spy(*args: Any, _orig: Any = original, **kw: Any) -> Any:
                flat_calls.append(args[0].group_id)
                return await _orig(*args, **kw)

            ex.inner.average = spy
        try:
            for codec_name in ("int8", "topk"):
                await asyncio.gather(
                    *(
                        ex.average(group, make_input(i, 5_000), CODECS[codec_name](), timeout=30)
                        for i, ex in enumerate(exchanges)
                    )
                )
            assert set(flat_calls) == {group.group_id} and len(flat_calls) == 8
            many = Group.make(11, members(5))
            ex = exchanges[0]
            assert ex.applies(many, CODECS["int8"](), None, None)
            assert not ex.applies(many, CODECS["topk"](), None, None)
            assert not ex.applies(many, CODECS["int8"](), None, (0, 1))
            assert not ex.applies(many, CODECS["int8"](), lambda chunks: chunks[0], None)
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def sliced_mean(plan: Any, inputs: dict[str, torch.Tensor], lost: dict[int, set[str]]) -> torch.Tensor:
    """What a grouped round that lost members gives (raw float32, weights 1): each slice the mean of the
    contributions its column kept (`lost[j]`: the members not in slice j's mean)."""
    numel = next(iter(inputs.values())).numel()
    mean = torch.empty(numel)
    for j in range(plan.slices):
        lo, hi = plan.bounds(numel, j)
        kept = [x[lo:hi] for p, x in sorted(inputs.items()) if p not in lost.get(j, set())]
        mean[lo:hi] = torch.stack(kept).double().mean(0).float()
    return mean


@pytest.mark.parametrize(
    ("count", "position", "codec_name"),
    [(6, 0, "raw"), (7, 0, "raw"), (7, 2, "raw"), (6, 0, "int8"), (7, 2, "int8")],
)
def test_a_member_that_never_comes_is_left_out_and_the_rounds_goes_on_in_rows(
    count: int, position: int, codec_name: str
) -> None:
    """A member that never starts the round (crashed after the group froze): its row goes on without it, and so
    does the column it would have carried, so the round commits in rows, every member with the same bits. A
    carrier's slice is then the mean of the other rows (its row-mates are in every other slice: `partial`);
    a member that carries nothing (a row of 3 in 7 = 3 + 2 + 2 has one) is simply left out. Every member names
    the same contributors."""
    size = 3

    async def body() -> None:
        nodes, group = await start_nodes(count)
        exchanges = grouped(nodes, size)
        plan = layout(group, size)
        missing = plan.rows[0][position].peer_id
        assert len(plan.rows[0]) == 3 and plan.slices == (2 if count == 7 else 3)
        carrier = position < plan.slices
        try:
            codec = CODECS[codec_name]()
            inputs = {n.peer_id: make_input(i, 20_000) for i, n in enumerate(nodes)}
            started = time.monotonic()
            results = await asyncio.gather(
                *(
                    ex.average(group, inputs[nodes[i].peer_id], codec, timeout=10)
                    for i, ex in enumerate(exchanges)
                    if nodes[i].peer_id != missing
                )
            )
            assert time.monotonic() - started < 10 + 3
            survivors = tuple(m.peer_id for m in group.members if m.peer_id != missing)
            row0 = {m.peer_id for m in plan.rows[0]}
            lost = {
                j: ({missing} | (row0 if carrier and j == position else set())) for j in range(plan.slices)
            }
            expected = sliced_mean(plan, inputs, lost)
            went = [n.peer_id for n in nodes if n.peer_id != missing]
            for peer, result in zip(went, results, strict=True):
                assert result.contributors == survivors
                assert result.partial == (tuple(sorted(row0 - {missing})) if carrier else ())
                # The slice whose mean lacks our row: kept whole by our error feedback.
                assert result.withheld == (
                    (plan.bounds(20_000, position),) if carrier and peer in row0 else ()
                )
                assert result.path == "rows"
                assert torch.equal(result.averaged, results[0].averaged)
                assert result.bytes_sent > 0
            # int8: each contribution coded once (row), each row's mean once (column).
            bound = (
                3 * max(float(x.abs().max()) for x in inputs.values()) / 127 if codec_name == "int8" else 1e-6
            )
            assert float((results[0].averaged - expected).abs().max()) <= bound
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_a_hello_carries_its_tag_to_every_member_and_a_bad_one_is_refused() -> None:
    """`average(tag=)`: small ints each member's hello carries (grouped.py tells its column what its row lost
    this way); every member's result names every non-empty tag, its own too. A tag that is not a list of small
    ints is refused by name, on the wire and in the call."""
    ref = AttemptRef("ab" * 32, 0, 1)
    hello = Hello(ref, 10, 256, 0, "fp32", True, 1.0, False, 0, 1, "mean", tag=(3, 7))
    assert Hello.decode(hello.encode()).tag == (3, 7)
    assert (
        "tg" not in replace(hello, tag=()).encode()
        and Hello.decode(replace(hello, tag=()).encode()).tag == ()
    )
    for bad in ([True], [-1], ["3"], list(range(MAX_TAG_ITEMS + 1))):
        with pytest.raises(Reject, match="BAD_HEADER") as caught:
            Hello.decode({**hello.encode(), "tg": bad})
        assert "hello.tg" in str(caught.value)

    async def body() -> None:
        nodes, group = await start_nodes(3)
        try:
            tags = [(1, 2), (), (0,)]
            results = await asyncio.gather(
                *(
                    n.exchange.average(group, make_input(i, 5_000), CODECS["int8"](), timeout=10, tag=tags[i])
                    for i, n in enumerate(nodes)
                )
            )
            expected = {nodes[i].peer_id: tags[i] for i in (0, 2)}
            assert all(r.tags == expected for r in results), [r.tags for r in results]
            with pytest.raises(ValueError, match=r"tag: expected at most 4096 ints in 0\.\.1048575"):
                await nodes[0].exchange.average(
                    group, make_input(0, 10), CODECS["fp32"](), timeout=1, tag=(-1,)
                )
        finally:
            for node in nodes:
                await node.stop()

    run(body())


@pytest.mark.parametrize("timeout", [2.0, 3.0, 5.0])
def test_under_a_short_timeout_members_that_commit_hold_the_same_mean_and_the_rest_raise(
    timeout: float,
) -> None:
    """The same with little time: whether a member commits (the fallback fitted) or raises ExchangeAborted
    (it did not), none hangs, and every member that commits holds the same bits, without the missing one."""
    count, size = 6, 3

    async def body() -> None:
        nodes, group = await start_nodes(count)
        exchanges = grouped(nodes, size)
        try:
            started = time.monotonic()
            results = await asyncio.gather(
                *(
                    ex.average(group, make_input(i, 20_000), CODECS["int8"](), timeout=timeout)
                    for i, ex in enumerate(exchanges)
                    if i != 2
                ),
                return_exceptions=True,
            )
            assert time.monotonic() - started < timeout + 3
            committed = [r for r in results if isinstance(r, AverageResult)]
            assert all(isinstance(r, (AverageResult, ExchangeAborted)) for r in results), results
            for result in committed:
                assert torch.equal(result.averaged, committed[0].averaged)
                assert "peer-2" not in result.contributors
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_slice_requests_from_outside_the_group_or_malformed_are_refused() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(5)
        outsider = nodes.pop()
        group = Group.make(group.round_id, [m for m in group.members if m.peer_id != outsider.peer_id])
        exchanges = grouped(nodes, 2)
        try:
            codec = CODECS["raw"]()
            await asyncio.gather(
                *(
                    ex.average(group, make_input(i, 9_000), codec, timeout=30)
                    for i, ex in enumerate(exchanges)
                )
            )
            plan = layout(group, 2)
            carrier = plan.rows[0][0]

            async def ask(header: dict[str, Any], who: Node) -> list[Frame]:
                async def frames() -> Any:
                    yield Frame(header)

                return [
                    f
                    async for f in who.client.stream(
                        carrier.address, SLICE_METHOD, frames(), round_id=group.round_id, timeout=10
                    )
                ]

            with pytest.raises(RpcError) as refused:
                await ask(SliceRequest(group.group_id, 0).encode(), outsider)
            assert refused.value.reason == "NOT_A_MEMBER"
            member = next(n for n in nodes if n.peer_id == plan.rows[1][0].peer_id)
            with pytest.raises(RpcError) as malformed:
                await ask({"g": "not-hex", "s": 0}, member)
            assert malformed.value.reason == "BAD_HEADER"
            with pytest.raises(RpcError) as other:
                await ask(SliceRequest(group.group_id, 1).encode(), member)
            assert other.value.reason == "NOT_CARRIED"
            # Its own column's slice, once more (a late row-mate): the same values it holds.
            frames = await ask(SliceRequest(group.group_id, 0).encode(), member)
            lo, hi = plan.bounds(9_000, 0)
            assert frames[0].header["a"] == lo and frames[-1].header["b"] == hi
        finally:
            for node in [*nodes, outsider]:
                await node.stop()

    run(body())


def test_a_tensor_with_fewer_values_than_slices_goes_flat() -> None:
    """A 1-value barrier among 5 members in rows of 2 (2 slices): averaged flat, alike everywhere."""

    async def body() -> None:
        nodes, group = await start_nodes(5)
        exchanges = grouped(nodes, 2)
        try:
            inputs = [make_input(i, 1) for i in range(5)]
            results = await asyncio.gather(
                *(ex.average(group, inputs[i], CODECS["raw"](), timeout=30) for i, ex in enumerate(exchanges))
            )
            assert all(torch.equal(r.averaged, results[0].averaged) for r in results)
            assert float((results[0].averaged - torch.stack(inputs).mean(0)).abs().max()) <= 1e-6
        finally:
            for node in nodes:
                await node.stop()

    run(body())


@pytest.mark.parametrize("when", ["before its column", "in its column"])
def test_a_carrier_that_dies_after_its_row_leaves_its_slice_to_the_other_rows(when: str) -> None:
    """A member dies (its server and client closed) once its row finished: before its column (none of its
    hellos reach the column), or in it (its hellos went out, its chunks are held up, then it dies: the column's
    votes drop it and its address refuses connections, so it serves nothing). Either way its column goes on
    without it, so that slice is the other rows' mean, and the rest of the round holds its row's mean, the dead
    member's contribution in it: every other member commits the same bits, in rows."""
    count, size = 6, 3

    async def body() -> None:
        nodes, group = await start_nodes(count)
        exchanges = grouped(nodes, size)
        plan = layout(group, size)
        victim = plan.rows[0][0].peer_id  # a carrier (of slice 0)
        index = next(i for i, n in enumerate(nodes) if n.peer_id == victim)
        inner = exchanges[index].inner
        original = inner.average

        async def die() -> None:
            await nodes[index].client.close()
            await nodes[index].server.stop(0)

        async def dies_at_its_column(*args: Any, **kw: Any) -> Any:
            if kw.get("stage") != 1:
                return await original(*args, **kw)
            if when == "before its column":
                await die()
                raise RuntimeError("died")
            column, contribution, codec = args[:3]

            def held_up(a: int, b: int, into: torch.Tensor) -> torch.Tensor:
                time.sleep(1.5)  # in the codec thread: the hellos are out, the chunks wait
                return contribution.fill(a, b, into)  # type: ignore[no-any-return]

            task = asyncio.ensure_future(original(column, OnDemand(contribution.numel, held_up), codec, **kw))
            await asyncio.sleep(0.5)
            await die()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise RuntimeError("died")

        inner.average = dies_at_its_column
        try:
            codec = CODECS["int8" if when == "in its column" else "raw"]()
            inputs = [make_input(i, 20_000) for i in range(count)]
            results = await asyncio.gather(
                *(ex.average(group, inputs[i], codec, timeout=10) for i, ex in enumerate(exchanges)),
                return_exceptions=True,
            )
            assert isinstance(results[index], RuntimeError)
            rest = [r for i, r in enumerate(results) if i != index]
            assert all(isinstance(r, AverageResult) for r in rest), rest
            row0 = {m.peer_id for m in plan.rows[0]}
            expected = sliced_mean(plan, {n.peer_id: inputs[i] for i, n in enumerate(nodes)}, {0: row0})
            for node, result in zip([n for i, n in enumerate(nodes) if i != index], rest, strict=True):
                assert isinstance(result, AverageResult)
                assert result.contributors == tuple(n.peer_id for n in sorted(nodes, key=lambda n: n.peer_id))
                assert result.partial == tuple(sorted(row0)) and result.path == "rows"
                assert result.withheld == ((plan.bounds(20_000, 0),) if node.peer_id in row0 else ())
                assert torch.equal(result.averaged, rest[0].averaged)  # type: ignore[union-attr]
            # int8: each contribution coded once (row), each row's mean once (column).
            bound = 3 * max(float(x.abs().max()) for x in inputs) / 127 if when == "in its column" else 1e-6
            assert float((rest[0].averaged - expected).abs().max()) <= bound  # type: ignore[union-attr]
        finally:
            for i, node in enumerate(nodes):
                if i != index:
                    await node.stop()
            nodes[index].exchange.close()

    run(body())


@pytest.mark.parametrize(("position", "codec_name"), [(0, "raw"), (2, "int8")])
def test_a_member_lost_below_a_nested_column_is_carried_range_by_range(
    position: int, codec_name: str
) -> None:
    """12 members in rows of at most 3: 4 rows, so each column (4 carriers) is itself in rows and columns one
    level down (2 rows of 2). A carrier X that never comes: its row goes on without it, and in its nested column
    its row-mate there goes on alone, so of X's slice one sub-slice lacks X's row and that row-mate's row, the other
    X's row; every other slice lacks X alone. The round commits in rows, every member with the same bits, and
    every member names the same contributors, partial members and (its own) withheld ranges."""
    count, size, numel = 12, 3, 20_000

    async def body() -> None:
        nodes, group = await start_nodes(count)
        exchanges = grouped(nodes, size)
        plan = layout(group, size)
        assert len(plan.rows) == 4 and plan.slices == 3
        missing = plan.rows[0][position].peer_id
        column = Group.make(group.round_id, list(plan.column(position)))
        sub = layout(column, size)
        assert [len(row) for row in sub.rows] == [2, 2] and sub.slices == 2
        s, k = sub.row_of(missing)
        mate = sub.rows[s][1 - k].peer_id  # X's row-mate one level down: it goes on alone

        def row_of(peer: str) -> set[str]:
            return {m.peer_id for m in plan.rows[plan.row_of(peer)[0]]}

        row0, mates = row_of(missing), row_of(mate)
        lo, hi = plan.bounds(numel, position)
        inner = [(lo + a, lo + b) for a, b in (sub.bounds(hi - lo, j) for j in range(sub.slices))]
        lost: list[tuple[int, int, set[str]]] = []
        for j in range(plan.slices):
            if j != position:
                lost.append((*plan.bounds(numel, j), {missing}))
        lost.append((*inner[k], row0 | mates))  # X's sub-slice: its sub-row's column went on without X
        lost.append((*inner[1 - k], set(row0)))  # the mate's: its sub-row's mean lacks X's row
        try:
            codec = CODECS[codec_name]()
            inputs = {n.peer_id: make_input(i, numel) for i, n in enumerate(nodes)}
            went = [n.peer_id for n in nodes if n.peer_id != missing]
            results = await asyncio.gather(
                *(
                    ex.average(group, inputs[nodes[i].peer_id], codec, timeout=10)
                    for i, ex in enumerate(exchanges)
                    if nodes[i].peer_id != missing
                )
            )
            expected = torch.empty(numel)
            for a, b, gone in lost:
                kept = [x[a:b] for p, x in sorted(inputs.items()) if p not in gone]
                expected[a:b] = torch.stack(kept).double().mean(0).float()
            for peer, result in zip(went, results, strict=True):
                assert result.path == "rows"
                assert torch.equal(result.averaged, results[0].averaged)
                assert result.contributors == tuple(sorted(went))
                assert result.partial == tuple(sorted((row0 | mates) - {missing}))
                mine = sorted((a, b) for a, b, gone in lost if peer in gone)
                joined: list[tuple[int, int]] = []
                for a, b in mine:
                    joined = (
                        [*joined[:-1], (joined[-1][0], b)]
                        if joined and joined[-1][1] == a
                        else [*joined, (a, b)]
                    )
                assert result.withheld == tuple(joined), peer
            # int8: each contribution coded once (row), each row's mean once (the nested column's row), each
            # of those means once (its column).
            bound = (
                4 * max(float(x.abs().max()) for x in inputs.values()) / 127 if codec_name == "int8" else 1e-6
            )
            assert float((results[0].averaged - expected).abs().max()) <= bound
        finally:
            for node in nodes:
                await node.stop()

    run(body())
