"""Members behind NAT in the exchange (real RpcServers on 127.0.0.1, every member in this process): a member in
the group by the address NO_INBOUND is never called. It owns no part, pushes its chunks to the owners and takes
the means back on its own streams, and its vote travels with its own calls (relayed to the others behind NAT)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers.exchange import (
    CODECS,
    RawFp32Codec,
    TopKCodec,
    make_input,
    run,
    skip_own_check,
    start_nodes,
    tolerance,
)

from farloco.protocol.exchange import AverageResult, ExchangeAborted
from farloco.protocol.rpc import NOT_DIALLABLE, Frame, RpcClient, RpcError
from farloco.protocol.types import NO_INBOUND


@pytest.mark.parametrize("codec_name", ["fp32", "int8"])
@pytest.mark.parametrize(("count", "behind_nat"), [(2, (1,)), (3, (0,)), (4, (1, 3)), (5, (0, 2, 4))])
def test_members_behind_nat_contribute_and_get_the_same_mean(
    count: int, behind_nat: tuple[int, ...], codec_name: str
) -> None:
    async def body() -> None:
        nodes, group = await start_nodes(count, behind_nat=behind_nat)
        stranded = {nodes[i].peer_id for i in behind_nat}
        try:
            inputs = [make_input(i, 50_001) for i in range(count)]
            codec = CODECS[codec_name]()
            results = await asyncio.gather(
                *(node.exchange.average(group, inputs[i], codec, timeout=30) for i, node in enumerate(nodes))
            )
            for result in results:
                assert torch.equal(result.averaged, results[0].averaged)  # the same bits everywhere
                assert result.contributors == tuple(n.peer_id for n in nodes)  # everyone contributed
            err = float((results[0].averaged - torch.stack(inputs).mean(0)).abs().max())
            assert err <= tolerance(codec_name, inputs), err
            for node in nodes:  # nobody called a member behind NAT: its server saw no stream and no vote
                if node.peer_id in stranded:
                    assert not node.server.rejections
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_a_member_behind_nat_that_sends_bad_data_is_dropped_by_the_owners_votes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Member 2 (behind NAT) sends NaN into both owners' parts: each owner refuses it and names it in its vote;
    member 3, also behind NAT, learns member 2's vote by relay, and the retry goes on without member 2, the
    same on every survivor."""
    skip_own_check(monkeypatch)

    async def body() -> None:
        nodes, group = await start_nodes(4, behind_nat=(2, 3))
        try:
            inputs = [make_input(i, 20_000) for i in range(4)]
            inputs[2][100] = float("nan")  # in peer-0's part
            inputs[2][15_000] = float("nan")  # in peer-1's part
            codec = RawFp32Codec()
            results = await asyncio.gather(
                *(n.exchange.average(group, inputs[i], codec, timeout=30) for i, n in enumerate(nodes)),
                return_exceptions=True,
            )
            assert isinstance(results[2], ExchangeAborted), results[2]
            honest = [r for i, r in enumerate(results) if i != 2]
            # The insider stops pushing once told its data was refused, so its NaN may never reach the second
            # owner: then one accusation stands, and everyone aborts alike. Either way, never a split and never a
            # mean with its data.
            if all(isinstance(r, AverageResult) for r in honest):
                assert results[2].reason == "EXCLUDED", results[2]
                kept = tuple(nodes[i].peer_id for i in (0, 1, 3))
                assert all(r.contributors == kept for r in honest)  # type: ignore[union-attr]
                assert all(torch.equal(r.averaged, honest[0].averaged) for r in honest)  # type: ignore[union-attr]
                exact = torch.stack([inputs[i] for i in (0, 1, 3)]).mean(0)
                assert float((honest[0].averaged - exact).abs().max()) < 1e-5  # type: ignore[union-attr]
            else:
                assert {getattr(r, "reason", None) for r in honest} == {"NO_PROGRESS"}, results
            assert sum(n.server.rejections["BAD_PAYLOAD"] for n in nodes[:2]) >= 1
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_a_group_nobody_can_dial_or_a_sparse_codec_with_nat_aborts_naming_why() -> None:
    async def body() -> None:
        nodes, group = await start_nodes(2, behind_nat=(0, 1))
        try:
            with pytest.raises(ExchangeAborted, match="no member can be dialled"):
                await nodes[0].exchange.average(group, make_input(0, 100), CODECS["fp32"](), timeout=5)
        finally:
            for node in nodes:
                await node.stop()
        nodes, group = await start_nodes(2, behind_nat=(1,))
        try:
            with pytest.raises(ExchangeAborted, match="a sparse codec sends to every member"):
                await nodes[0].exchange.average(group, make_input(0, 100), TopKCodec(), timeout=5)
        finally:
            for node in nodes:
                await node.stop()
        client = RpcClient(nodes[0].server.auth)
        try:
            with pytest.raises(RpcError) as info:
                await client.unary(NO_INBOUND, "Anything", Frame({}), round_id=1, timeout=1)
            assert info.value.reason == NOT_DIALLABLE
            assert not await client.answers(NO_INBOUND, round_id=1, timeout=1)
        finally:
            await client.close()

    run(body())
