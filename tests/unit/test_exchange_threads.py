"""The exchange's codec work on its own threads (protocol/exchange/codecpool.py): the same bits as on the event
loop, an event loop that keeps answering while a chunk is coded, and no job of an abandoned attempt that writes
after `average` returned. Real RpcServers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from helpers.exchange import CODECS, Fp32Codec, Int8Codec, Node, make_input, run, start_nodes, tolerance

from farloco.protocol.exchange import AverageResult, Exchange, ExchangeAborted
from farloco.protocol.types import Group


@pytest.mark.parametrize("codec_name", ["fp32", "raw", "int8", "topk"])
def test_codec_threads_give_the_bits_of_the_event_loop(codec_name: str) -> None:
    """Three members, weighted, averaged with the codec's work on the event loop (0 threads), on one thread and
    on four: every member's mean and `transmitted` are bit-identical across the three (an owner sums in member
    order whatever order its chunks came and were decoded in)."""
    numel = 200_003  # ~13 chunks of 16384 values per part, the last short
    weights = [1.0, 2.0, 0.5]

    async def mean(threads: int) -> list[AverageResult]:
        nodes, group = await start_nodes(3, codec_threads=threads)
        try:
            inputs = [make_input(20 + i, numel) for i in range(3)]
            results = await asyncio.gather(
                *(
                    node.exchange.average(
                        group, inputs[i], CODECS[codec_name](), timeout=60, weight=weights[i]
                    )
                    for i, node in enumerate(nodes)
                )
            )
            return list(results)
        finally:
            for node in nodes:
                await node.stop()

    async def body() -> None:
        on_loop = await mean(0)
        for threads in (1, 4):
            for inline, threaded in zip(on_loop, await mean(threads), strict=True):
                assert torch.equal(inline.averaged, threaded.averaged), threads
                assert torch.equal(inline.transmitted, threaded.transmitted), threads
                assert inline.contributors == threaded.contributors
        inputs = [make_input(20 + i, numel) for i in range(3)]
        if codec_name == "topk":  # the weighted mean of what each member's payload says
            codec = CODECS[codec_name]()
            inputs = [codec.decode(codec.encode(t)) for t in inputs]
        exact = sum(w * t for w, t in zip(weights, inputs, strict=True)) / sum(weights)
        assert float((on_loop[0].averaged - exact).abs().max()) <= tolerance(codec_name, inputs)

    run(body())


class SleepyCodec(Fp32Codec):
    """fp32 whose every encode takes `seconds` without the GIL (a slow codec, as a large chunk's is)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def encode(self, tensor: torch.Tensor) -> bytes:
        time.sleep(self.seconds)
        return super().encode(tensor)


@pytest.mark.parametrize("threads", [0, 1])
def test_the_event_loop_runs_while_a_chunk_is_coded(threads: int) -> None:
    """Two members, one chunk each way, every encode 0.6 s. With codec threads the event loop runs on meanwhile
    (a ticker's longest gap stays far under an encode); on the loop (0 threads) each encode holds it the whole
    0.6 s, which is what the threads are for."""
    encode_s = 0.6

    async def body() -> None:
        nodes, group = await start_nodes(2, codec_threads=threads)
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            loop = asyncio.get_running_loop()
            last = loop.time()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = loop.time()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        try:
            inputs = [make_input(i, 1000) for i in range(2)]
            results = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], SleepyCodec(encode_s), timeout=30)
                    for i, node in enumerate(nodes)
                )
            )
            diff = (results[0].averaged - (inputs[0] + inputs[1]) / 2).abs()
            assert float(diff.max()) < 1e-6, (float(diff.max()), int(diff.argmax()))
        finally:
            done.set()
            await tick
            for node in nodes:
                await node.stop()
        if threads:
            assert max(gaps) < encode_s / 2, max(gaps)
        else:
            assert max(gaps) >= encode_s * 0.9, max(gaps)

    run(body())


class GatedCodec(Int8Codec):
    """int8 whose encodes wait for `gate` (set by the test), each noting when it ended."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate
        self.ended: list[float] = []

    def encode(self, tensor: torch.Tensor) -> bytes:
        self.gate.wait(30)
        data = super().encode(tensor)
        self.ended.append(time.monotonic())
        return data


def test_an_abandoned_attempt_returns_only_once_its_codec_jobs_ended() -> None:
    """A member whose peer never starts the round: its data phase ends at the deadline while its first chunks'
    encodes still wait (they write `transmitted`, the caller's buffer). `average` raises only after every one of
    them ended: no job of the attempt writes into `transmitted_out` after the caller got it back."""

    async def body() -> None:
        nodes, group = await start_nodes(2, codec_threads=2)
        gate = threading.Event()
        codec = GatedCodec(gate)
        # Opened 2 s from now: well after the data phase's deadline (60% of the 1 s timeout).
        opener = threading.Timer(2.0, gate.set)
        opener.start()
        numel = 100_000
        sent = torch.empty(numel)
        try:
            with pytest.raises(ExchangeAborted):
                await nodes[0].exchange.average(
                    group, make_input(0, numel), codec, timeout=1.0, transmitted_out=sent
                )
            returned = time.monotonic()
            assert gate.is_set(), "average returned before its encodes could end"
            assert codec.ended and max(codec.ended) <= returned
        finally:
            opener.cancel()
            gate.set()
            for node in nodes:
                await node.stop()

    run(body())


def test_codec_threads_are_validated() -> None:
    for bad in (-1, 65, 1.5, True):
        with pytest.raises(ValueError, match="codec_threads"):
            Exchange(None, None, "x", codec_threads=bad)  # type: ignore[arg-type]


def test_a_group_of_one_and_a_sparse_group_of_one_on_threads() -> None:
    """Alone (every other member dropped): the dense mean goes through the codec twice, the sparse one is our own
    payload, both off the loop."""

    async def body() -> None:
        node = Node("solo", codec_threads=2)
        member = await node.start()
        try:
            group = Group.make(3, [member])
            values = make_input(5, 50_000)
            for codec_name in ("int8", "topk"):
                codec: Any = CODECS[codec_name]()
                result = await node.exchange.average(group, values, codec, timeout=10)
                once = codec.decode(codec.encode(values))
                expected = codec.decode(codec.encode(once)) if codec_name == "int8" else once
                assert torch.equal(result.averaged, expected), codec_name
                assert torch.equal(result.transmitted, once), codec_name
        finally:
            await node.stop()

    run(body())


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("mode", ["bytes", "short"])
def test_a_member_whose_coded_chunks_do_not_decode_is_named_by_every_owner(mode: str, threads: int) -> None:
    """peer-1's int8 chunks go out as 0xFF bytes or cut short (the chaos fault `corrupt`): each owner's decode
    refuses them (on a codec thread, reported from there, with threads) and names peer-1, so the other two retry
    without it and agree, bit for bit; peer-1 is told it was excluded. Decoded on the loop or on threads alike."""

    async def body() -> None:
        nodes, group = await start_nodes(3, codec_threads=threads, corrupting=[1])
        assert nodes[1].corrupting is not None
        nodes[1].corrupting.arm(group.round_id, mode)
        inputs = [make_input(i, 120_000) for i in range(3)]
        try:
            outcomes = await asyncio.gather(
                *(
                    node.exchange.average(group, inputs[i], Int8Codec(), timeout=30)
                    for i, node in enumerate(nodes)
                ),
                return_exceptions=True,
            )
            assert sum(node.server.rejections["BAD_PAYLOAD"] for node in (nodes[0], nodes[2])) >= 1
        finally:
            for node in nodes:
                await node.stop()
        honest = [outcomes[0], outcomes[2]]
        assert all(isinstance(r, AverageResult) for r in honest), outcomes
        assert honest[0].contributors == honest[1].contributors == ("peer-0", "peer-2")
        assert torch.equal(honest[0].averaged, honest[1].averaged)
        assert float((honest[0].averaged - (inputs[0] + inputs[2]) / 2).abs().max()) <= tolerance(
            "int8", [inputs[0], inputs[2]]
        )
        assert isinstance(outcomes[1], ExchangeAborted) and outcomes[1].reason == "EXCLUDED", outcomes[1]

    run(body())
