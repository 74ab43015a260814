"""Exchange tests: real RpcServers on 127.0.0.1, every member in this process (tests/helpers/exchange.py has the
test codecs and the member; tests/integration/test_exchange_processes.py runs members as separate processes
and kills them)."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from helpers.exchange import (
    CHUNK,
    CODECS,
    Fp32Codec,
    Node,
    RawFp32Codec,
    SlowCodec,
    TopKCodec,
    make_input,
    run,
    skip_own_check,
    start_nodes,
    tolerance,
)

from farloco.protocol.exchange import AverageResult, ExchangeAborted, OnDemand
from farloco.protocol.types import Group, GroupMember


def check_dense_mean(count: int, numel: int, codec_name: str, plane: str | None = None) -> None:
    """`count` members average `numel` values: the same bits everywhere, within the codec's tolerance of the
    exact mean, and each member's `transmitted` what the codec made of its input."""

    async def body() -> None:
        nodes, group = await start_nodes(count, plane)
        try:
            inputs = [make_input(i, numel) for i in range(count)]
            codec = CODECS[codec_name]()
            results = await asyncio.gather(
                *(node.exchange.average(group, inputs[i], codec, timeout=30) for i, node in enumerate(nodes))
            )
            exact = torch.stack(inputs).mean(0)
            for result in results:
                assert torch.equal(result.averaged, results[0].averaged)  # bit-identical everywhere
                assert result.contributors == tuple(n.peer_id for n in nodes)
                assert result.bytes_sent > 0 and result.bytes_received > 0
            err = float((results[0].averaged - exact).abs().max())
            assert err <= tolerance(codec_name, inputs), err
            for i, result in enumerate(results):
                # `transmitted` is exactly what the codec made of our input.
                assert torch.equal(
                    result.transmitted,
                    torch.cat([codec.decode(codec.encode(c)) for c in chunks_of(group, i, inputs[i])]),
                )
        finally:
            for node in nodes:
                await node.stop()

    run(body())


@pytest.mark.parametrize("plane", ["tcp", "grpc"])
@pytest.mark.parametrize("codec_name", ["fp32", "raw", "int8"])
@pytest.mark.parametrize("count", [2, 3, 4])
def test_dense_mean_in_one_process(count: int, codec_name: str, plane: str) -> None:
    check_dense_mean(
        count, 100_003, codec_name, plane
    )  # not a multiple of anything: uneven parts, a short chunk


@pytest.mark.parametrize("codec_name", ["fp32", "raw", "int8"])
@pytest.mark.parametrize(("count", "numel"), [(2, 1), (3, 1), (3, 2), (4, 3)])
def test_a_tensor_with_fewer_values_than_members_is_averaged(count: int, numel: int, codec_name: str) -> None:
    """Some members own an empty part: they reduce nothing and still get every mean (a 1-value barrier between
    two members, as benchmarks/exchange.py sends, failed on the empty part's chunk plan)."""
    check_dense_mean(count, numel, codec_name)


def test_raw_path_with_optim_fp32_is_exact_and_never_calls_the_codec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from farloco.optim import get_codec

    codec = get_codec("fp32")
    assert getattr(codec, "raw_float32", False) is True

    def forbidden(*_: Any) -> Any:
        raise AssertionError("the raw float32 path must not encode or decode")

    async def body() -> None:
        nodes, group = await start_nodes(3)
        try:
            inputs = [make_input(i, 70_001) for i in range(3)]
            weights = [1.0, 2.0, 0.5]
            results = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], codec, timeout=30, weight=weights[i])
                    for i, node in enumerate(nodes)
                )
            )
            assert all(torch.equal(r.averaged, results[0].averaged) for r in results)
            assert all(torch.equal(r.transmitted, inputs[i]) for i, r in enumerate(results))
            # The owner's arithmetic, spelled out: sum in member order, then divide by the weight total.
            exact = (inputs[0] * 1.0 + inputs[1] * 2.0 + inputs[2] * 0.5) / 3.5
            assert float((results[0].averaged - exact).abs().max()) <= 1e-6
            # Raw chunks: no codec header or CRC, exactly 4 bytes per value sent (contributions + means), plus
            # each frame's small msgpack header: the fp32 baseline is exact and the ratio just under 1.
            assert sum(r.fp32_bytes for r in results) == 2 * 2 * 4 * 70_001
            for r in results:
                assert r.fp32_bytes < r.bytes_sent < 1.001 * r.fp32_bytes
                assert r.fp32_bytes < r.bytes_received < 1.001 * r.fp32_bytes
        finally:
            for node in nodes:
                await node.stop()

    monkeypatch.setattr(type(codec), "encode", forbidden)
    monkeypatch.setattr(type(codec), "decode", forbidden)
    run(body())


@pytest.mark.parametrize("name", ["int8", "fp16"])
def test_optim_lossy_codec_through_the_exchange(name: str) -> None:
    """farloco.optim's lossy codecs take the encode_decoded path: still bit-identical everywhere, and
    `transmitted` is exactly decode(encode(.)) of each chunk."""
    from farloco.optim import get_codec

    codec = get_codec(name)

    async def body() -> None:
        nodes, group = await start_nodes(3)
        try:
            inputs = [make_input(i, 90_001) for i in range(3)]
            results = await asyncio.gather(
                *(node.exchange.average(group, inputs[i], codec, timeout=30) for i, node in enumerate(nodes))
            )
            assert all(torch.equal(r.averaged, results[0].averaged) for r in results)
            for i, result in enumerate(results):
                sent = torch.cat([codec.decode(codec.encode(c)) for c in chunks_of(group, i, inputs[i])])
                assert torch.equal(result.transmitted, sent)
            err = float((results[0].averaged - torch.stack(inputs).mean(0)).abs().max())
            assert err <= tolerance("int8", inputs), err
            # Again into caller-owned buffers (as the agent does): the same values, written in place.
            outs = [torch.full((90_001,), float("nan")) for _ in nodes]
            sents = [torch.full((90_001,), float("nan")) for _ in nodes]
            again = await asyncio.gather(
                *(
                    node.exchange.average(
                        group, inputs[i], codec, timeout=30, out=outs[i], transmitted_out=sents[i]
                    )
                    for i, node in enumerate(nodes)
                )
            )
            for i, result in enumerate(again):
                assert result.averaged.data_ptr() == outs[i].data_ptr()
                assert result.transmitted.data_ptr() == sents[i].data_ptr()
                assert torch.equal(outs[i], results[0].averaged)
                assert torch.equal(sents[i], results[i].transmitted)
            with pytest.raises(
                ValueError, match="transmitted_out: expected memory apart from the input and from out"
            ):
                await nodes[0].exchange.average(
                    group, inputs[0], codec, timeout=30, out=outs[0], transmitted_out=outs[0]
                )
        finally:
            for node in nodes:
                await node.stop()

    run(body())


@pytest.mark.parametrize("mode", ["bytes", "inf", "short", "huge"])
def test_a_member_whose_chunks_go_out_corrupted_is_refused_or_outvoted(mode: str) -> None:
    """The chaos fault `corrupt=MODE`: a member's outgoing payloads as 0xFF bytes (NaN), +Inf or half their size
    are refused by every owner (the others retry without it and agree); 1e38 is a valid float, so the mean takes
    it (the control) and the coordinate median of three does not."""
    from farloco.optim import Aggregator

    async def body() -> None:
        nodes, group = await start_nodes(3, corrupting=[1])
        assert nodes[1].corrupting is not None
        nodes[1].corrupting.arm(group.round_id, mode)
        inputs = [make_input(i, 50_000) for i in range(3)]
        rule = Aggregator("median") if mode == "huge" else None
        try:
            outcomes = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], RawFp32Codec(), timeout=30, rule=rule)
                    for i, node in enumerate(nodes)
                ),
                return_exceptions=True,
            )
        finally:
            for node in nodes:
                await node.stop()
        good = [outcomes[0], outcomes[2]]
        assert all(isinstance(r, AverageResult) for r in good), outcomes
        assert torch.equal(good[0].averaged, good[1].averaged)
        if mode == "huge":
            # all three contributed; the median of (x0, 1e38, x2) per coordinate is the larger honest value
            assert good[0].contributors == ("peer-0", "peer-1", "peer-2")
            assert torch.equal(good[0].averaged, torch.maximum(inputs[0], inputs[2]))
        else:
            assert good[0].contributors == good[1].contributors == ("peer-0", "peer-2")
            assert torch.allclose(good[0].averaged, (inputs[0] + inputs[2]) / 2, atol=1e-6)


def test_a_member_that_moved_on_to_a_later_round_is_not_waited_for() -> None:
    """A member grouped for round 11 that has already started round 12 (it thawed after the others grouped it and
    closed round 11 without them) refuses round 11's streams and vote at once (ATTEMPT_OVER): the others retry
    without it in a moment instead of waiting for their data deadline (18 s here) and its vote."""

    async def body() -> None:
        nodes, group = await start_nodes(3)
        try:
            later = Group.make(group.round_id + 1, [GroupMember(nodes[1].peer_id, nodes[1].address)])
            await nodes[1].exchange.average(later, make_input(9, 50_000), RawFp32Codec(), timeout=30)
            inputs = [make_input(i, 50_000) for i in range(3)]
            started = time.monotonic()
            results = await asyncio.gather(
                *(nodes[i].exchange.average(group, inputs[i], RawFp32Codec(), timeout=30) for i in (0, 2))
            )
            assert time.monotonic() - started < 8.0
        finally:
            for node in nodes:
                await node.stop()
        assert all(r.contributors == ("peer-0", "peer-2") for r in results)
        assert torch.equal(results[0].averaged, results[1].averaged)

    run(body())


def test_a_vote_call_that_times_out_before_we_vote_leaves_our_vote_to_cast() -> None:
    """A member asks for our vote while we are still in the data phase, and its call's deadline passes (a loaded
    machine): gRPC cancels the handler waiting for our vote, and that must not cancel the vote itself. It did:
    the handler awaited the vote's future bare, so our own vote could no longer be cast and the exchange
    failed with InvalidStateError instead of averaging (seen with 64 protocol peers on 2 cores)."""
    from farloco.protocol.exchange.wire import VOTE_METHOD, AttemptRef, Vote, VoteRequest
    from farloco.protocol.rpc import Frame, RpcError

    numel = 16 * CHUNK // 4  # 16 chunks a part: 0.1 s each to encode (SlowCodec), so the data phase lasts

    async def body() -> None:
        nodes, group = await start_nodes(2)
        try:
            inputs = [make_input(i, numel) for i in range(2)]
            slow = asyncio.ensure_future(nodes[0].exchange.average(group, inputs[0], SlowCodec(), timeout=60))
            await asyncio.sleep(0.3)  # node 0 is encoding
            early = VoteRequest(AttemptRef(group.group_id, 0), Vote(True, (), numel, SlowCodec().name))
            with pytest.raises(RpcError):
                await nodes[1].client.unary(
                    nodes[0].address, VOTE_METHOD, Frame(early.encode()), round_id=group.round_id, timeout=0.2
                )
            other = nodes[1].exchange.average(group, inputs[1], SlowCodec(), timeout=60)
            results = await asyncio.gather(slow, other)
        finally:
            for node in nodes:
                await node.stop()
        assert all(r.contributors == ("peer-0", "peer-1") for r in results)
        assert torch.equal(results[0].averaged, results[1].averaged)

    run(body())


def test_raw_path_own_nonfinite_input_excludes_itself() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(3)
        try:
            inputs = [make_input(i, 50_000) for i in range(3)]
            inputs[1][100] = float("nan")
            outcomes = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], RawFp32Codec(), timeout=30)
                    for i, node in enumerate(nodes)
                ),
                return_exceptions=True,
            )
            good = [outcomes[0], outcomes[2]]
            assert all(isinstance(r, AverageResult) for r in good), outcomes
            assert good[0].contributors == good[1].contributors == ("peer-0", "peer-2")
            assert torch.equal(good[0].averaged, good[1].averaged)
            assert torch.allclose(good[0].averaged, (inputs[0] + inputs[2]) / 2, atol=1e-6)
            # The codec's own error reaches the caller whose input was bad.
            assert isinstance(outcomes[1], ValueError) and "finite" in str(outcomes[1]), outcomes[1]
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_raw_path_blames_a_member_that_sends_nonfinite_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """peer-1 skips its own check (as a buggy or hostile peer would) and sends NaN into peer-0's part: the
    owner refuses the chunk, blames peer-1, and the retry goes on without it."""
    skip_own_check(monkeypatch)

    async def body() -> None:
        nodes, group = await start_nodes(2)
        try:
            inputs = [make_input(i, 50_000) for i in range(2)]
            inputs[1][100] = float("nan")  # in peer-0's part
            outcomes = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], RawFp32Codec(), timeout=30)
                    for i, node in enumerate(nodes)
                ),
                return_exceptions=True,
            )
            assert isinstance(outcomes[0], AverageResult), outcomes
            assert outcomes[0].contributors == ("peer-0",)
            assert torch.equal(outcomes[0].averaged, inputs[0])
            assert isinstance(outcomes[1], ExchangeAborted) and outcomes[1].reason == "EXCLUDED", outcomes
            assert nodes[0].server.rejections["BAD_PAYLOAD"] == 1
        finally:
            for node in nodes:
                await node.stop()

    run(body())


@pytest.mark.parametrize("plane", ["tcp", "grpc"])
@pytest.mark.parametrize("codec_name", ["raw", "int8", "fp32"])
def test_lanes_give_the_same_bits_as_one_stream(codec_name: str, plane: str) -> None:
    """Members with 1, 3, 4 and 2 streams per peer (each its own): every lane stream carries its chunks, and the mean
    is bit-identical to the one-stream exchange of the same inputs (a chunk's mean does not depend on the lane it
    came by). A part of fewer chunks than lanes uses one lane per chunk."""
    numel = 100_003  # 4 parts of ~25_000 values: 2 chunks of 16384 values (CHUNK) each, the last one short
    counts = [1, 3, 4, 2]  # so peer-1 and peer-2 open 2 streams per owner, one per chunk

    async def mean(lanes: Sequence[int]) -> tuple[list[AverageResult], list[Counter[str]]]:
        nodes, group = await start_nodes(4, plane, lanes)
        opened: list[Counter[str]] = [Counter() for _ in nodes]
        for node, calls in zip(nodes, opened, strict=True):
            stream = node.client.stream

            def counted(
                address: str, method: str, *args: Any, _s: Any = stream, _c: Any = calls, **kw: Any
            ) -> Any:
                _c[address] += method == "ExchangePush"
                return _s(address, method, *args, **kw)

            node.client.stream = counted  # type: ignore[method-assign]
        try:
            inputs = [make_input(i, numel) for i in range(4)]
            results = await asyncio.gather(
                *(node.exchange.average(group, inputs[i], CODECS[codec_name](), timeout=30)
                  for i, node in enumerate(nodes))
            )  # fmt: skip
            return list(results), opened
        finally:
            for node in nodes:
                await node.stop()

    async def body() -> None:
        one, _ = await mean([1, 1, 1, 1])
        several, opened = await mean(counts)
        for single, laned in zip(one, several, strict=True):
            assert torch.equal(single.averaged, laned.averaged)
            assert torch.equal(single.transmitted, laned.transmitted)
        chunks = -(-(numel // 4 + 1) // (CHUNK // 4))
        for i, calls in enumerate(opened):
            assert sorted(calls.values()) == [min(counts[i], chunks)] * 3, (i, calls)

    run(body())


@pytest.mark.parametrize("target", ["one owner", "every owner"])
def test_nan_insider_in_a_group_of_three_never_splits_the_round(
    monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """peer-2 (an insider: it holds the secret) skips its own check and sends NaN. Every owner it reached names it
    on arrival, even after another member's abort (it checks what is still arriving before it votes). With both
    owners hit, the majority names it and peer-0 and peer-1 average without it; with one owner hit there is one
    report, which may come from a liar, and everyone aborts alike. Never a split, never a mean with the
    insider's data."""
    skip_own_check(monkeypatch)

    async def body() -> None:
        nodes, group = await start_nodes(3, lanes=[2, 3, 3])  # the NaN comes by one lane of several
        try:
            numel = 60_000  # three parts of 20_000
            inputs = [make_input(i, numel) for i in range(3)]
            inputs[2][100] = float("nan")  # peer-0's part
            if target == "every owner":
                inputs[2][20_100] = float("nan")  # peer-1's part
            outcomes = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], RawFp32Codec(), timeout=30)
                    for i, node in enumerate(nodes)
                ),
                return_exceptions=True,
            )
            assert isinstance(outcomes[2], ExchangeAborted), outcomes
            assert sum(node.server.rejections["BAD_PAYLOAD"] for node in nodes[:2]) >= 1
            honest = outcomes[:2]
            if all(isinstance(o, AverageResult) for o in honest):
                assert outcomes[2].reason == "EXCLUDED", outcomes
                assert honest[0].contributors == honest[1].contributors == ("peer-0", "peer-1")
                assert torch.equal(honest[0].averaged, honest[1].averaged)
                assert torch.allclose(honest[0].averaged, (inputs[0] + inputs[1]) / 2, atol=1e-6)
            else:
                assert all(isinstance(o, ExchangeAborted) for o in honest), outcomes
                assert {o.reason for o in honest} == {"NO_PROGRESS"}, outcomes
            if target == "one owner":
                # One accusation, which may come from a liar: nobody can be dropped.
                assert all(isinstance(o, ExchangeAborted) for o in honest), outcomes
            elif all(node.server.rejections["BAD_PAYLOAD"] for node in nodes[:2]) and not all(
                isinstance(o, AverageResult) for o in honest
            ):
                # Both owners refused the NaN, yet no mean: only if one refused it after it voted, i.e. the NaN
                # arrived past EVIDENCE_GRACE_SECONDS (a loaded machine). Otherwise the majority names peer-2
                # even when peer-0's abort reaches peer-1 first. (The insider cancels its pushes when it aborts,
                # so its second NaN may also never arrive: one accusation, an abort alike, as with one owner.)
                assert {o.reason for o in honest if isinstance(o, ExchangeAborted)} == {"NO_PROGRESS"}, (
                    outcomes
                )
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_exclusion_rule_needs_a_majority() -> None:
    from farloco.protocol.exchange.vote import excluded
    from farloco.protocol.exchange.wire import Vote

    members = [GroupMember(f"p{i}", f"127.0.0.1:{i + 1}") for i in range(4)]

    def vote(bad: list[str], n: int = 10) -> Vote:
        return Vote(ok=False, bad=tuple(bad), numel=n, codec="fp32")

    # A strict majority of the others names p3: only p3 goes.
    votes = {"p0": vote(["p3"]), "p1": vote(["p3"]), "p2": vote([]), "p3": vote([])}
    assert excluded(members, votes) == {"p3"}
    # One accusation, no majority: nobody can tell a true report from a lie, nobody goes.
    votes = {"p0": vote(["p3"]), "p1": vote([]), "p2": vote([]), "p3": vote([])}
    assert excluded(members, votes) == set()
    # A member whose tensor has another size than the majority's goes, whatever it reports of others.
    votes = {"p0": vote([]), "p1": vote([]), "p2": vote([]), "p3": vote(["p0"], n=11)}
    assert excluded(members, votes) == {"p3"}
    # Self-reports (our own NaN) drop only ourselves.
    votes = {"p0": vote([]), "p1": vote(["p1"]), "p2": vote([]), "p3": vote([])}
    assert excluded(members, votes) == {"p1"}


def test_raw_and_codec_fp32_members_refuse_each_other() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(2)
        try:
            outcomes = await asyncio.gather(
                nodes[0].exchange.average(group, make_input(0, 1000), RawFp32Codec(), timeout=20),
                nodes[1].exchange.average(group, make_input(1, 1000), Fp32Codec(), timeout=20),
                return_exceptions=True,
            )
            assert all(isinstance(o, ExchangeAborted) for o in outcomes), outcomes
            assert sum(n.server.rejections["CODEC_MISMATCH"] for n in nodes) >= 1
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def chunks_of(group: Group, me: int, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The chunk boundaries the exchange uses: parts by member, then CHUNK // 4 elements."""
    numel, count, size = tensor.numel(), len(group.members), CHUNK // 4
    base, extra = divmod(numel, count)
    pieces = []
    for p in range(count):
        start = p * base + min(p, extra)
        end = start + base + (1 if p < extra else 0)
        pieces += [tensor[a : min(a + size, end)] for a in range(start, end, size)]
    return pieces


def test_sparse_all_gather_and_weights() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(3)
        try:
            inputs = [make_input(10 + i, 50_000) for i in range(3)]
            weights = [1.0, 2.0, 0.5]
            codec = TopKCodec(0.05)
            results = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], codec, timeout=30, weight=weights[i])
                    for i, node in enumerate(nodes)
                )
            )
            sent = [codec.decode(codec.encode(t)) for t in inputs]
            exact = sum(w * t for w, t in zip(weights, sent, strict=True)) / sum(weights)
            for i, result in enumerate(results):
                assert torch.equal(result.averaged, results[0].averaged)
                assert torch.equal(result.transmitted, sent[i])
            assert torch.allclose(results[0].averaged, exact, atol=1e-6)
            # Weighted dense mean too.
            dense = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], Fp32Codec(), timeout=30, weight=weights[i])
                    for i, node in enumerate(nodes)
                )
            )
            exact_dense = sum(w * t for w, t in zip(weights, inputs, strict=True)) / sum(weights)
            assert torch.allclose(dense[0].averaged, exact_dense, atol=1e-6)
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_wrong_shape_member_is_excluded() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(3)
        try:
            inputs = [make_input(i, 40_000) for i in range(2)] + [make_input(2, 39_999)]
            outcomes = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], Fp32Codec(), timeout=30)
                    for i, node in enumerate(nodes)
                ),
                return_exceptions=True,
            )
            good = outcomes[:2]
            assert all(isinstance(r, AverageResult) for r in good), good
            assert good[0].contributors == good[1].contributors == ("peer-0", "peer-1")
            assert torch.equal(good[0].averaged, good[1].averaged)
            assert torch.allclose(good[0].averaged, (inputs[0] + inputs[1]) / 2, atol=1e-6)
            assert isinstance(outcomes[2], ExchangeAborted) and outcomes[2].reason == "EXCLUDED"
            # The refusal carried a stable reason and was counted.
            assert sum(n.server.rejections["SHAPE_MISMATCH"] for n in nodes) >= 1
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_two_members_with_different_shapes_both_abort() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(2)
        try:
            outcomes = await asyncio.gather(
                nodes[0].exchange.average(group, make_input(0, 1000), Fp32Codec(), timeout=20),
                nodes[1].exchange.average(group, make_input(1, 1001), Fp32Codec(), timeout=20),
                return_exceptions=True,
            )
            assert all(isinstance(o, ExchangeAborted) and o.reason == "EXCLUDED" for o in outcomes), outcomes
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_wrong_group_id_refused() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(2)
        intruder = Node("peer-x")
        try:
            x_member = await intruder.start()
            # The intruder believes the round's group is {peer-0, peer-x}: another group id.
            wrong = Group.make(group.round_id, [group.members[0], x_member])
            stray = asyncio.create_task(
                intruder.exchange.average(wrong, make_input(5, 5000), Fp32Codec(), timeout=20)
            )
            # Wait until its stream is parked at peer-0, waiting for peer-0 to start that (wrong) group.
            while not any(not a.started.is_set() for a in nodes[0].exchange.attempts.values()):
                await asyncio.sleep(0.01)
            inputs = [make_input(i, 5000) for i in range(2)]
            results = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], Fp32Codec(), timeout=20)
                    for i, node in enumerate(nodes)
                )
            )
            assert torch.equal(results[0].averaged, results[1].averaged)
            assert torch.allclose(results[0].averaged, (inputs[0] + inputs[1]) / 2, atol=1e-6)
            with pytest.raises(ExchangeAborted) as info:
                await stray
            assert info.value.reason == "GROUP_MISMATCH"
            assert nodes[0].server.rejections["GROUP_MISMATCH"] >= 1
        finally:
            for node in [*nodes, intruder]:
                await node.stop()

    run(body())


def test_same_group_averages_twice() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(2)
        try:
            for seed in (1, 2):
                inputs = [make_input(seed * 10 + i, 3000) for i in range(2)]
                results = await asyncio.gather(
                    *(
                        node.exchange.average(group, inputs[i], Fp32Codec(), timeout=20)
                        for i, node in enumerate(nodes)
                    )
                )
                assert torch.allclose(results[0].averaged, (inputs[0] + inputs[1]) / 2, atol=1e-6)
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_bad_arguments() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(1)
        try:
            with pytest.raises(ValueError, match="float32"):
                await nodes[0].exchange.average(
                    group, torch.zeros(3, dtype=torch.float64), Fp32Codec(), timeout=5
                )
            with pytest.raises(ValueError, match="weight"):
                await nodes[0].exchange.average(group, torch.zeros(3), Fp32Codec(), timeout=5, weight=0.0)
            other = Group.make(1, [GroupMember("someone", "127.0.0.1:1")])
            with pytest.raises(ValueError, match="not in group"):
                await nodes[0].exchange.average(other, torch.zeros(3), Fp32Codec(), timeout=5)
            alone = await nodes[0].exchange.average(group, torch.ones(3), Fp32Codec(), timeout=5)
            assert alone.contributors == ("peer-0",) and torch.equal(alone.averaged, torch.ones(3))
        finally:
            await nodes[0].stop()

    run(body())


def test_byte_accounting_per_path() -> None:
    """bytes_sent / fp32_bytes on each path: dense lossless and lossy, sparse, a group of one, an abort."""

    async def body() -> None:
        nodes, group = await start_nodes(3)
        try:
            numel = 50_001
            inputs = [make_input(i, numel) for i in range(3)]
            for name, low, high in (("raw", 0.995, 1.0), ("fp32", 0.99, 1.0), ("int8", 3.5, 4.0)):
                results = await asyncio.gather(
                    *(
                        n.exchange.average(group, inputs[i], CODECS[name](), timeout=30)
                        for i, n in enumerate(nodes)
                    )
                )
                for r in results:
                    # Dense, 3 members: 2/3 of the values out as contributions, 2/3 back out as means.
                    assert r.fp32_bytes == pytest.approx(2 * 2 / 3 * 4 * numel, rel=1e-3), name
                    assert low <= r.fp32_bytes / r.bytes_sent <= high, (name, r.fp32_bytes, r.bytes_sent)
            sparse = await asyncio.gather(
                *(
                    n.exchange.average(group, inputs[i], TopKCodec(0.01), timeout=30)
                    for i, n in enumerate(nodes)
                )
            )
            for r in sparse:
                # A ring all-reduce's worth for the dense baseline; 1% top-k at 12 bytes per entry sent twice.
                assert r.fp32_bytes == pytest.approx(2 * 2 / 3 * 4 * numel, rel=1e-3)
                assert 2 * 12 * 500 < r.bytes_sent < 2 * 12 * 500 + 4096
            alone = Group.make(11, [group.members[0]])
            lone = await nodes[0].exchange.average(alone, inputs[0], CODECS["raw"](), timeout=30)
            assert (lone.bytes_sent, lone.bytes_received, lone.fp32_bytes) == (0, 0, 0)
            pair = Group.make(12, list(group.members[:2]))
            outcomes = await asyncio.gather(
                nodes[0].exchange.average(pair, inputs[0], CODECS["raw"](), timeout=30),
                nodes[1].exchange.average(pair, inputs[1][:1000], CODECS["raw"](), timeout=30),
                return_exceptions=True,
            )
            for outcome in outcomes:
                assert isinstance(outcome, ExchangeAborted), outcome
                assert outcome.bytes_sent >= outcome.fp32_bytes >= 0
                assert outcome.bytes_sent > 0  # its hello, at least, crossed the wire
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_connections_dropped_mid_exchange_end_the_attempt_at_once_alike_everywhere() -> None:
    """Data-plane connections reset while the chunks are in flight (what `FARLOCO_FAULTS=drop@exchange` does to a
    node). Two ways this used to hang an attempt until its data deadline (36 s of a 60 s exchange): a reset as
    a stream opened escaped its push as a raw OSError, and a stream cut before its hello named no attempt to
    fail. Now every member's attempt ends at once, and all three come out alike: the same mean of all three
    (the reset came before any data was lost) or the same abort."""
    from farloco.protocol import tcpstream

    numel = 4_000_000  # 16 MB each: the streams are still open when the connections drop

    async def body() -> None:
        nodes, group = await start_nodes(3, "tcp")
        try:
            inputs = [make_input(i, numel) for i in range(3)]
            before = set(tcpstream._OPEN)  # connections of earlier tests not yet collected are not ours
            loop = asyncio.get_running_loop()
            started = loop.time()
            averaging = asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], RawFp32Codec(), timeout=60)
                    for i, node in enumerate(nodes)
                ),
                return_exceptions=True,
            )
            while not set(tcpstream._OPEN) - before:
                await asyncio.sleep(0.001)
            assert tcpstream.drop_all() >= 1
            outcomes = await averaging
            assert loop.time() - started < 15, loop.time() - started
            if all(isinstance(o, AverageResult) for o in outcomes):
                assert all(torch.equal(o.averaged, outcomes[0].averaged) for o in outcomes)
            else:
                assert all(isinstance(o, ExchangeAborted) and o.reason == "NO_PROGRESS" for o in outcomes), (
                    outcomes
                )
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def on_demand(tensor: torch.Tensor, calls: list[tuple[int, int]] | None = None) -> OnDemand:
    """`tensor` as an OnDemand contribution (each fill counted in `calls`)."""

    def fill(a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        if calls is not None:
            calls.append((a, b))
        return out.copy_(tensor[a:b])

    return OnDemand(tensor.numel(), fill)


@pytest.mark.parametrize("name", ["int8", "fp32"])
def test_an_on_demand_contribution_gives_the_tensor_paths_bits(name: str) -> None:
    """A contribution made chunk by chunk as it is sent (OnDemand), over two codec threads: the same mean, bit
    for bit, as the tensor itself; nothing kept of `transmitted`, and `encoded_in` rebuilds it exactly; again
    after a member is dropped (the survivors' retry makes the chunks again, cut for two members)."""
    from farloco.optim import get_codec

    codec = get_codec(name)
    numel = 90_001

    async def body() -> None:
        nodes, group = await start_nodes(3, codec_threads=2)
        try:
            inputs = [make_input(i, numel) for i in range(3)]
            whole = await asyncio.gather(
                *(node.exchange.average(group, inputs[i], codec, timeout=30) for i, node in enumerate(nodes))
            )
            calls: list[list[tuple[int, int]]] = [[] for _ in nodes]
            made = await asyncio.gather(
                *(
                    node.exchange.average(group, on_demand(inputs[i], calls[i]), codec, timeout=30)
                    for i, node in enumerate(nodes)
                )
            )
            for i, (w, m) in enumerate(zip(whole, made, strict=True)):
                assert torch.equal(m.averaged, w.averaged)
                assert m.transmitted is None and m.contributors == w.contributors
                assert m.encoded_in == w.encoded_in
                assert [a for a, _ in m.encoded_in] == [0, *(b for _, b in m.encoded_in[:-1])]
                assert m.encoded_in[-1][1] == numel and len(m.encoded_in) == len(
                    chunks_of(group, i, inputs[i])
                )
                rebuilt = torch.cat([codec.encode_decoded(inputs[i][a:b])[1] for a, b in m.encoded_in])
                assert torch.equal(rebuilt, w.transmitted)
                # Every chunk was made when it was needed, none of them whole.
                assert sorted(set(calls[i])) == sorted(m.encoded_in)
            # A member of another shape is dropped: the survivors' retry cuts its chunks for two.
            odd = make_input(2, numel - 1)
            outcomes = await asyncio.gather(
                nodes[0].exchange.average(group, on_demand(inputs[0]), codec, timeout=30),
                nodes[1].exchange.average(group, inputs[1], codec, timeout=30),
                nodes[2].exchange.average(group, odd, codec, timeout=30),
                return_exceptions=True,
            )
            first, second = outcomes[0], outcomes[1]
            assert isinstance(first, AverageResult) and isinstance(second, AverageResult), outcomes
            assert first.contributors == ("peer-0", "peer-1") and torch.equal(first.averaged, second.averaged)
            pair = Group.make(group.round_id, list(group.members[:2]))
            assert len(first.encoded_in) == len(chunks_of(pair, 0, inputs[0]))
            rebuilt = torch.cat([codec.encode_decoded(inputs[0][a:b])[1] for a, b in first.encoded_in])
            assert torch.equal(
                rebuilt, torch.cat([codec.encode_decoded(c)[1] for c in chunks_of(pair, 0, inputs[0])])
            )
        finally:
            for node in nodes:
                await node.stop()

    run(body())


class WholeSparse:
    """A sparse codec that can only encode and decode whole vectors (no `parse`, no `encode_on_demand`)."""

    name = "topk"
    dense = False

    def __init__(self) -> None:
        self._codec = TopKCodec()

    def encode(self, tensor: torch.Tensor) -> bytes:
        return self._codec.encode(tensor)

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        return self._codec.decode(data)


@pytest.mark.parametrize(
    "name, options",
    [("topk", {"k": 5, "chunk": 64}), ("topk", {"k": 3, "chunk": 50, "value_bits": 2}), ("dct-topk", {})],
)
def test_a_sparse_on_demand_contribution_gives_the_tensor_paths_bits(
    name: str, options: dict[str, int]
) -> None:
    """A sparse codec's contribution made piece by piece as it is encoded (OnDemand), with weights: the same mean,
    bit for bit, as the tensor itself (every member's payload summed piece by piece, in member order), no
    `transmitted` kept, and `payload` decodes to the tensor path's `transmitted`; a codec that parses no payload
    (decoded whole) gives the same bits too; again after a member of another shape is dropped."""
    from farloco.optim import get_codec

    codec = get_codec(name, **options)
    numel = 300_007  # more than one piece of the sparse mean, and a short last chunk
    weights = [1.0, 2.5, 0.75]

    async def body() -> None:
        nodes, group = await start_nodes(3, codec_threads=2)
        try:
            inputs = [make_input(i, numel).mul_(0.01) for i in range(3)]

            async def average(tensors: Sequence[torch.Tensor | OnDemand]) -> list[AverageResult]:
                return list(
                    await asyncio.gather(
                        *(
                            node.exchange.average(group, tensors[i], codec, timeout=30, weight=weights[i])
                            for i, node in enumerate(nodes)
                        )
                    )
                )

            whole = await average(inputs)
            made = await average([on_demand(t) for t in inputs])
            mixed = await average([on_demand(inputs[0]), inputs[1], on_demand(inputs[2])])
            terms = [codec.decode(codec.encode(t)) for t in inputs]
            exact = sum(t * w for t, w in zip(terms, weights, strict=True)) / sum(weights)
            for w, m, x in zip(whole, made, mixed, strict=True):
                assert torch.equal(m.averaged, w.averaged) and torch.equal(x.averaged, w.averaged)
                assert m.transmitted is None and m.contributors == w.contributors and not w.payload
                assert torch.equal(codec.decode(m.payload, checksum=False), w.transmitted)
                assert float((w.averaged - exact).abs().max()) <= 1e-6
            # The decoded-whole path (a codec that cannot parse) agrees bit for bit.
            alike = WholeSparse() if name == "topk" and "value_bits" not in options else None
            if alike is not None:
                alike._codec = codec  # type: ignore[assignment]
                plain = await asyncio.gather(
                    *(
                        node.exchange.average(group, inputs[i], alike, timeout=30, weight=weights[i])
                        for i, node in enumerate(nodes)
                    )
                )
                assert all(torch.equal(p.averaged, whole[0].averaged) for p in plain)
            # A member of another shape is dropped: the survivors' retry encodes again, for two.
            outcomes = await asyncio.gather(
                nodes[0].exchange.average(group, on_demand(inputs[0]), codec, timeout=30),
                nodes[1].exchange.average(group, inputs[1], codec, timeout=30),
                nodes[2].exchange.average(group, make_input(2, numel - 1), codec, timeout=30),
                return_exceptions=True,
            )
            first, second = outcomes[0], outcomes[1]
            assert isinstance(first, AverageResult) and isinstance(second, AverageResult), outcomes
            assert first.contributors == ("peer-0", "peer-1") and torch.equal(first.averaged, second.averaged)
            assert torch.equal(codec.decode(first.payload, checksum=False), terms[0])
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_a_sparse_payload_cut_in_other_chunks_is_refused_and_its_sender_dropped() -> None:
    """A member whose payload's chunks differ from the round's codec is named by the others (BAD_PAYLOAD, the
    chunk sizes in the message) and the retry goes on without it."""
    from farloco.optim import get_codec

    async def body() -> None:
        nodes, group = await start_nodes(3)
        try:
            inputs = [make_input(i, 20_000) for i in range(3)]
            codecs = [
                get_codec("topk", chunk=1000),
                get_codec("topk", chunk=1000),
                get_codec("topk", chunk=500),
            ]
            outcomes = await asyncio.gather(
                *(
                    node.exchange.average(group, on_demand(inputs[i]), codecs[i], timeout=30)
                    for i, node in enumerate(nodes)
                ),
                return_exceptions=True,
            )
            first, second, odd = outcomes
            assert isinstance(first, AverageResult) and isinstance(second, AverageResult), outcomes
            assert first.contributors == ("peer-0", "peer-1") and torch.equal(first.averaged, second.averaged)
            assert isinstance(odd, ExchangeAborted), odd
        finally:
            for node in nodes:
                await node.stop()

    run(body())
    from farloco.protocol.exchange.codec import take_payload
    from farloco.protocol.rpc import Reject

    codec = get_codec("topk", chunk=1000)
    with pytest.raises(Reject, match="payload of peer-2: expected chunks of 1000 values, got 500"):
        take_payload(
            codec, get_codec("topk", chunk=500).encode(torch.ones(5000)), 5000, "payload of peer-2", False
        )


def test_a_sparse_mean_summed_as_payloads_come_in_is_the_same_whichever_comes_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The members' terms are summed in member order as they come in (a run of consecutive members at a time,
    owner.py): whichever member starts late (its payload last), every member gets the mean of the round where all
    started together, bit for bit, and it is the weighted mean of the decoded payloads. With the last member
    late (by a second), the others sum the first three terms before its payload comes."""
    from farloco.optim import get_codec
    from farloco.protocol.exchange import owner, reduce

    runs: list[tuple[int, bool, bool]] = []  # (terms, first, divided) of every run summed

    def counted(
        terms: list[Any], weights: list[float], total: torch.Tensor, first: bool, divisor: Any
    ) -> None:
        runs.append((len(terms), first, divisor is not None))
        reduce.sparse_sum(terms, weights, total, first, divisor)

    monkeypatch.setattr(owner, "sparse_sum", counted)

    codec = get_codec("dct-topk")
    numel = 300_001
    weights = [1.0, 0.5, 2.0, 1.25]

    async def body() -> None:
        nodes, group = await start_nodes(4, codec_threads=2)
        try:
            inputs = [make_input(i, numel).mul_(0.01) for i in range(4)]

            async def average(late: int | None) -> list[AverageResult]:
                rounds = Group.make(group.round_id + 1 + (-1 if late is None else late), list(group.members))

                async def one(i: int) -> AverageResult:
                    if i == late:
                        await asyncio.sleep(1.0)
                    return await nodes[i].exchange.average(
                        rounds, on_demand(inputs[i]), codec, timeout=30, weight=weights[i]
                    )

                return list(await asyncio.gather(*(one(i) for i in range(4))))

            together = await average(None)
            terms = [codec.decode(codec.encode(t)) for t in inputs]
            exact = sum(t * w for t, w in zip(terms, weights, strict=True)) / sum(weights)
            assert float((together[0].averaged - exact).abs().max()) <= 1e-6
            for late in range(4):
                runs.clear()
                results = await average(late)
                assert all(torch.equal(r.averaged, together[0].averaged) for r in results), late
                if late == 3:
                    # The three others summed the first three terms (in one run or several, as they came)
                    # before the fourth came: their last run holds it alone, with the division.
                    assert runs.count((1, False, True)) >= 3, runs
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_the_sparse_mean_piece_by_piece_is_the_sum_of_whole_terms() -> None:
    """reduce.sparse_sum over parsed payloads and decoded tensors, of chunk sizes whose pieces do not line up,
    with weights, the members cut into runs in every way (as their payloads come in): bit for bit the weighted
    sum of whole decoded terms in member order, over one thread or several."""
    from farloco.optim import get_codec
    from farloco.protocol.exchange.reduce import sparse_mean, sparse_sum
    from farloco.util import parallel

    numel = 700_001
    codecs = [get_codec("topk", k=7, chunk=1000), get_codec("dct-topk", k=4, chunk=96), get_codec("topk")]
    payloads = [c.encode(make_input(i, numel)) for i, c in enumerate(codecs)]
    decoded = [c.decode(p) for c, p in zip(codecs, payloads, strict=True)]
    weights = [1.0, 0.3, 2.0]
    expected = decoded[0].clone()
    for values, weight in zip(decoded[1:], weights[1:], strict=True):
        expected.add_(values * weight)
    expected.div_(math.fsum(weights))
    terms: list[Any] = [codecs[0].parse(payloads[0]), decoded[1], codecs[2].parse(payloads[2])]
    for threads in (1, 3):
        previous = parallel.get_threads()
        parallel.set_threads(threads)
        try:
            total = torch.full((numel,), float("nan"))
            sparse_mean(None, terms, weights, total)
            assert torch.equal(total, expected)
            for cuts in ([1], [2], [1, 2], [3]):  # runs [0, c1), [c1, c2), ...; then the division alone
                total = torch.full((numel,), float("nan"))
                runs = list(itertools.pairwise([0, *cuts, 3]))
                for index, (first, last) in enumerate(runs):
                    divisor = math.fsum(weights) if index == len(runs) - 1 else None
                    sparse_sum(terms[first:last], weights[first:last], total, first == 0, divisor)
                assert torch.equal(total, expected), cuts
        finally:
            parallel.set_threads(previous)


def test_an_on_demand_contribution_refuses_what_it_cannot_serve() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(1)
        try:
            source = on_demand(torch.ones(3))
            with pytest.raises(ValueError, match="OnDemand contribution needs a dense codec or a sparse one"):
                await nodes[0].exchange.average(group, source, WholeSparse(), timeout=5)
            with pytest.raises(ValueError, match="transmitted_out: expected None with an OnDemand"):
                await nodes[0].exchange.average(
                    group, source, Fp32Codec(), timeout=5, transmitted_out=torch.empty(3)
                )
            alone = await nodes[0].exchange.average(group, source, Fp32Codec(), timeout=5)
            assert torch.equal(alone.averaged, torch.ones(3)) and alone.encoded_in == ((0, 3),)
        finally:
            await nodes[0].stop()

    run(body())


@pytest.mark.parametrize("codec_name", ["fp32", "raw", "int8"])
@pytest.mark.parametrize("weight", [2.0, 0.5, 3.25])
def test_two_members_of_equal_weight_other_than_one_get_the_mean_not_a_multiple_of_it(
    codec_name: str, weight: float
) -> None:
    """Two contributions of the same weight w != 1 (both merged late work, two islands of the same size, a
    column of two rows of one size in grouped.py): the owner's one-pass mean of two is the mean of the
    contributions, not of the weighted terms (which is w times it)."""

    async def body() -> None:
        nodes, group = await start_nodes(2)
        try:
            inputs = [make_input(i, 30_001) for i in range(2)]
            codec = CODECS[codec_name]()
            results = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], codec, timeout=30, weight=weight)
                    for i, node in enumerate(nodes)
                )
            )
            exact = (inputs[0] + inputs[1]) / 2
            assert torch.equal(results[0].averaged, results[1].averaged)
            err = float((results[0].averaged - exact).abs().max())
            assert err <= tolerance(codec_name, inputs), err
            assert results[0].total_weight == 2 * weight
        finally:
            for node in nodes:
                await node.stop()

    run(body())


@pytest.mark.parametrize("codec_name", ["int8", "topk"])
def test_a_byzantine_member_on_demand_reports_what_the_swarm_saw_of_its_honest_update(
    codec_name: str,
) -> None:
    """The Byzantine fault (node/faults/wrappers.py) over a real exchange, with an OnDemand contribution: the
    wrong update goes out, and what the node stages its error feedback from is its honest update's round trip
    (dense: the ranges encoded in; sparse: the honest payload)."""
    from farloco.node.faults.wrappers import ByzantineExchange
    from farloco.optim import get_codec

    codec = get_codec(codec_name)
    numel = 20_000

    async def body() -> None:
        nodes, group = await start_nodes(2)
        try:
            inputs = [make_input(i, numel).mul_(0.01) for i in range(2)]
            sent: list[str] = []
            byzantine = ByzantineExchange(
                nodes[0].exchange, lambda _r: "constant", lambda _r, kind: sent.append(kind)
            )
            mine, theirs = await asyncio.gather(
                byzantine.average(group, on_demand(inputs[0]), codec, timeout=30),
                nodes[1].exchange.average(group, inputs[1], codec, timeout=30),
            )
            assert sent == ["constant"] and torch.equal(mine.averaged, theirs.averaged)
            assert mine.transmitted is None
            # Dense: the ranges cover the contribution, in order (the commit encodes the honest one again).
            if codec.dense:
                bounds = [0, *(b for _, b in mine.encoded_in)]
                assert [a for a, _ in mine.encoded_in] == bounds[:-1] and bounds[-1] == numel
                assert not mine.payload
            else:
                honest = codec.decode(codec.encode(inputs[0]))
                assert torch.equal(codec.decode(mine.payload, checksum=False), honest)
            # The mean holds the wrong update (every value 50 from member 0), not the honest one.
            assert float(mine.averaged.abs().max()) > 10
        finally:
            for node in nodes:
                await node.stop()

    run(body())
