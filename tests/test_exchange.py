"""Exchange tests: real RpcServers on 127.0.0.1, in one process and in separate processes (SIGKILL faults).

The test codecs here have the structural shape of farloco.optim codecs (fp32, blockwise int8, top-k sparse),
so the exchange is tested without importing optim. Run as a script, this file is the worker of the
multi-process tests: it serves, prints its address, reads the group on stdin, averages, and writes the result
as raw float32 bytes (never pickle across processes).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from farloco.protocol.auth import Authenticator
from farloco.protocol.exchange import AverageResult, Exchange, ExchangeAborted
from farloco.protocol.rpc import RpcClient, RpcServer
from farloco.protocol.types import Group, GroupMember


class Fp32Codec:
    name = "fp32"
    dense = True
    lossless = True  # lets the exchange skip identity round trips; Int8Codec covers the lossy path

    def encode(self, tensor: torch.Tensor) -> bytes:
        return tensor.detach().contiguous().numpy().astype("<f4", copy=False).tobytes()

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        if len(data) % 4:
            raise ValueError(f"fp32 payload must be a multiple of 4 bytes, got {len(data)}")
        return torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())


class RawFp32Codec(Fp32Codec):
    """fp32 that also says `raw_float32` (like farloco.optim's): the exchange sends raw float32 chunks and
    never calls encode/decode except to let the codec refuse our own NaN/Inf."""

    raw_float32 = True

    def encode(self, tensor: torch.Tensor) -> bytes:
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError("fp32 encode input: expected only finite values")
        return super().encode(tensor)


class Int8Codec:
    """Blockwise absmax int8: u32 numel | fp32 scale per block | int8 values. Error <= scale/2 per value."""

    name = "int8"
    dense = True

    def __init__(self, block: int = 4096) -> None:
        self.block = block

    def encode(self, tensor: torch.Tensor) -> bytes:
        flat = tensor.detach().reshape(-1).contiguous()
        numel = flat.numel()
        pad = (-numel) % self.block
        padded = torch.nn.functional.pad(flat, (0, pad)).view(-1, self.block)
        scales = padded.abs().amax(dim=1) / 127.0
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(padded / scales[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:numel]
        return struct.pack("<I", numel) + scales.numpy().astype("<f4").tobytes() + q.numpy().tobytes()

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        (numel,) = struct.unpack_from("<I", data, 0)
        num_blocks = -(-numel // self.block)
        if len(data) != 4 + 4 * num_blocks + numel:
            raise ValueError(f"int8 payload of {len(data)} bytes does not match numel={numel}")
        scales = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=num_blocks, offset=4).copy())
        q = torch.from_numpy(
            np.frombuffer(data, dtype=np.int8, count=numel, offset=4 + 4 * num_blocks).copy()
        )
        pad = (-numel) % self.block
        values = torch.nn.functional.pad(q.to(torch.float32), (0, pad)).view(-1, self.block) * scales[:, None]
        return values.reshape(-1)[:numel].contiguous()


class TopKCodec:
    """Sparse: u32 numel | u32 k | int64 indices | fp32 values of the k largest magnitudes."""

    name = "topk"
    dense = False

    def __init__(self, fraction: float = 0.1) -> None:
        self.fraction = fraction

    def encode(self, tensor: torch.Tensor) -> bytes:
        flat = tensor.detach().reshape(-1)
        k = max(1, int(flat.numel() * self.fraction)) if flat.numel() else 0
        indices = (
            torch.topk(flat.abs(), k, sorted=False).indices.sort().values
            if k
            else torch.empty(0, dtype=torch.int64)
        )
        values = flat[indices]
        return (
            struct.pack("<II", flat.numel(), k)
            + indices.numpy().astype("<i8").tobytes()
            + values.numpy().astype("<f4").tobytes()
        )

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        numel, k = struct.unpack_from("<II", data, 0)
        if len(data) != 8 + 12 * k:
            raise ValueError(f"topk payload of {len(data)} bytes does not match k={k}")
        indices = torch.from_numpy(np.frombuffer(data, dtype="<i8", count=k, offset=8).copy())
        values = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=k, offset=8 + 8 * k).copy())
        if k and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise ValueError("topk index out of range")
        out = torch.zeros(numel, dtype=torch.float32)
        out[indices] = values
        return out


class SuicidalCodec:
    """Wraps a codec and SIGKILLs its own process on the `die_at`-th encode: a crash at an exact point.
    A negative `die_at` SIGSTOPs it instead: a hung peer whose sockets stay open."""

    def __init__(self, inner: Fp32Codec | Int8Codec, die_at: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.dense = inner.dense
        self.die_at = die_at
        self.calls = 0

    def encode(self, tensor: torch.Tensor) -> bytes:
        self.calls += 1
        if self.calls == abs(self.die_at):
            os.kill(os.getpid(), signal.SIGKILL if self.die_at > 0 else signal.SIGSTOP)
        return self.inner.encode(tensor)

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        return self.inner.decode(data)


CODECS: dict[str, Callable[[], Any]] = {
    "fp32": Fp32Codec,
    "raw": RawFp32Codec,
    "int8": Int8Codec,
    "topk": TopKCodec,
}
RUN = "run-exchange-test"
SECRET = b"exchange-secret"
CHUNK = 64 << 10  # small chunks so modest tensors still take many chunks


def make_input(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def tolerance(codec: str, tensors: list[torch.Tensor]) -> float:
    if codec == "int8":
        # Each contribution and the mean are quantized once: about two half-steps of the largest block scale.
        return 2.0 * max(float(t.abs().max()) for t in tensors) / 127.0
    return 1e-6


class Node:
    """One exchange member. `plane`: "tcp" streams on the TCP data plane (the daemon's default), "grpc" keeps
    them on gRPC; subprocess workers take it from EXCHANGE_TEST_PLANE."""

    def __init__(
        self, peer_id: str, plane: str | None = None, lanes: int = 1, slices: int = 0, codec_threads: int = 1
    ) -> None:
        auth = Authenticator(RUN, SECRET, peer_id)
        self.peer_id = peer_id
        plane = plane or os.environ.get("EXCHANGE_TEST_PLANE", "tcp")
        self.server = RpcServer(auth, data_port=0 if plane == "tcp" else None)
        self.client = RpcClient(auth)
        # Subprocess workers: the peers whose membership record "expired" (EXCHANGE_TEST_GONE), as the agent's
        # view of the DHT would say once a frozen member stopped heartbeating.
        gone = set(filter(None, os.environ.get("EXCHANGE_TEST_GONE", "").split(",")))
        self.exchange = Exchange(
            self.server,
            self.client,
            peer_id,
            chunk_bytes=CHUNK,
            streams_per_peer=lanes,
            slices=slices,
            gone=(lambda peer: peer in gone) if gone else None,
            codec_threads=codec_threads,
        )
        self.address = ""

    async def start(self) -> GroupMember:
        self.address = await self.server.start()
        return GroupMember(self.peer_id, self.address)

    async def stop(self) -> None:
        await self.client.close()
        await self.server.stop(0)
        self.exchange.close()


async def start_nodes(
    count: int, plane: str | None = None, lanes: Sequence[int] = (), codec_threads: int = 1
) -> tuple[list[Node], Group]:
    nodes = [
        Node(f"peer-{i}", plane, lanes[i] if lanes else 1, codec_threads=codec_threads) for i in range(count)
    ]
    members = [await node.start() for node in nodes]
    return nodes, Group.make(11, members)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


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
        nodes, group = await start_nodes(3)
        nodes[1].exchange.corrupt_rounds[group.round_id] = mode
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
    import farloco.protocol.exchange as exchange_module

    monkeypatch.setattr(exchange_module, "_own_chunk_error", lambda codec, chunk, offset: None)

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
    import farloco.protocol.exchange as exchange_module

    monkeypatch.setattr(exchange_module, "_own_chunk_error", lambda codec, chunk, offset: None)

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
            else:
                # Both owners saw the NaN: even when peer-0's abort reaches peer-1 first, peer-1 keeps checking
                # what is still arriving before it votes (EVIDENCE_GRACE_SECONDS), so the majority names peer-2.
                assert all(isinstance(o, AverageResult) for o in honest), outcomes
        finally:
            for node in nodes:
                await node.stop()

    run(body())


def test_exclusion_rule_needs_a_majority() -> None:
    from farloco.protocol.exchange import _excluded

    members = [GroupMember(f"p{i}", f"127.0.0.1:{i + 1}") for i in range(4)]

    def vote(bad: list[str], n: int = 10) -> dict[str, Any]:
        return {"ok": False, "bad": bad, "n": n, "c": "fp32"}

    # A strict majority of the others names p3: only p3 goes.
    votes = {"p0": vote(["p3"]), "p1": vote(["p3"]), "p2": vote([]), "p3": vote([])}
    assert _excluded(members, votes) == {"p3"}
    # One accusation, no majority: nobody can tell a true report from a lie, nobody goes.
    votes = {"p0": vote(["p3"]), "p1": vote([]), "p2": vote([]), "p3": vote([])}
    assert _excluded(members, votes) == set()
    # A member whose tensor has another size than the majority's goes, whatever it reports of others.
    votes = {"p0": vote([]), "p1": vote([]), "p2": vote([]), "p3": vote(["p0"], n=11)}
    assert _excluded(members, votes) == {"p3"}
    # Self-reports (our own NaN) drop only ourselves.
    votes = {"p0": vote([]), "p1": vote(["p1"]), "p2": vote([]), "p3": vote([])}
    assert _excluded(members, votes) == {"p1"}


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
            while not any(not a.started.is_set() for a in nodes[0].exchange._attempts.values()):
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


# -- separate processes ------------------------------------------------------------------------------------


def spawn_workers(
    count: int,
    numel: int,
    codec: str,
    die: dict[int, int],
    tmp_path: Path,
    codecs: dict[int, str] | None = None,
) -> list[subprocess.Popen[str]]:
    procs = []
    for i in range(count):
        args = [
            sys.executable,
            __file__,
            f"peer-{i}",
            str(i),
            str(numel),
            (codecs or {}).get(i, codec),
            str(die.get(i, 0)),
            str(tmp_path),
        ]
        procs.append(subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    return procs


def run_workers(
    count: int,
    numel: int,
    codec: str,
    tmp_path: Path,
    die: dict[int, int] | None = None,
    timeout: float = 60,
    collect: Sequence[int] | None = None,
) -> tuple[list[subprocess.Popen[str]], list[dict[str, Any]]]:
    """Start `count` workers as one group and return their reports, of the workers `collect` only if given (a
    frozen worker never reports: it is killed at the end with the others)."""
    procs = spawn_workers(count, numel, codec, die or {}, tmp_path)
    try:
        addresses = []
        for proc in procs:
            assert proc.stdout is not None
            addresses.append(proc.stdout.readline().strip())
        group = json.dumps({"round": 3, "members": [[f"peer-{i}", a] for i, a in enumerate(addresses)]})
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(group + "\n")
            proc.stdin.flush()
        reports = []
        for proc in procs if collect is None else [procs[i] for i in collect]:
            out, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                reports.append({"killed": proc.returncode})
            else:
                reports.append(json.loads(out.strip().splitlines()[-1]))
        return procs, reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def load_result(tmp_path: Path, index: int) -> torch.Tensor:
    data = (tmp_path / f"averaged-{index}.f32").read_bytes()
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("count", "codec"),
    [
        pytest.param(2, "int8", marks=pytest.mark.slow),
        (3, "fp32"),
        pytest.param(4, "topk", marks=pytest.mark.slow),
    ],
)
def test_mean_across_processes(count: int, codec: str, tmp_path: Path) -> None:
    numel = 300_007
    _, reports = run_workers(count, numel, codec, tmp_path)
    assert all(r.get("ok") for r in reports), reports
    results = [load_result(tmp_path, i) for i in range(count)]
    assert all(torch.equal(r, results[0]) for r in results)
    assert all(r["contributors"] == [f"peer-{i}" for i in range(count)] for r in reports)
    inputs = [make_input(i, numel) for i in range(count)]
    if codec == "topk":
        c = TopKCodec()
        inputs = [c.decode(c.encode(t)) for t in inputs]
    assert float((results[0] - torch.stack(inputs).mean(0)).abs().max()) <= tolerance(codec, inputs)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("codec", "die_at"),
    [
        ("fp32", 3),  # while sending its contributions (reduce-scatter)
        pytest.param(
            "int8", 14, marks=pytest.mark.slow
        ),  # while re-encoding the means of its part (all-gather)
        pytest.param("topk", 1, marks=pytest.mark.slow),  # before its sparse payload left
    ],
)
def test_sigkill_member_mid_exchange(codec: str, die_at: int, tmp_path: Path) -> None:
    numel = 600_000  # 2.3 MiB fp32 -> ~12 chunks per part with 3 members
    procs, reports = run_workers(3, numel, codec, tmp_path, die={1: die_at})
    assert procs[1].returncode == -signal.SIGKILL
    survivors = [reports[0], reports[2]]
    # Whatever happened, the bytes of the failed attempt are counted and never beat their fp32 equivalent
    # for fp32 (a member dropped mid-round once made the ratio 8/7).
    for report in survivors:
        assert report["bytes_sent"] > 0, report
        if codec == "fp32":
            assert report["fp32_bytes"] <= report["bytes_sent"], report
    if all(r.get("ok") for r in survivors):
        assert survivors[0]["contributors"] == survivors[1]["contributors"]
        assert torch.equal(load_result(tmp_path, 0), load_result(tmp_path, 2))
        contributors = survivors[0]["contributors"]
        # The victim died before its contribution reached every part, so the mean must exclude it everywhere.
        assert contributors == ["peer-0", "peer-2"], contributors
        inputs = [make_input(i, numel) for i in (0, 2)]
        if codec == "topk":
            c = TopKCodec()
            inputs = [c.decode(c.encode(t)) for t in inputs]
        err = float((load_result(tmp_path, 0) - torch.stack(inputs).mean(0)).abs().max())
        assert err <= tolerance(codec, inputs), err
    else:
        # Never one survivor with a mean and the other without.
        assert not any(r.get("ok") for r in survivors), survivors
        assert all(r.get("aborted") for r in survivors), survivors


@pytest.mark.multiprocess
def test_parent_sigkill_mid_exchange_keeps_survivors_consistent(tmp_path: Path) -> None:
    """The victim encodes slowly; the test process SIGKILLs it from outside while the exchange runs."""
    numel = 400_000
    procs = spawn_workers(3, numel, "fp32", {}, tmp_path, codecs={1: "slow-fp32"})
    try:
        addresses = [p.stdout.readline().strip() for p in procs if p.stdout]
        group = json.dumps({"round": 3, "members": [[f"peer-{i}", a] for i, a in enumerate(addresses)]})
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(group + "\n")
            proc.stdin.flush()
        assert procs[1].stdout is not None
        assert procs[1].stdout.readline().strip() == "averaging"
        time.sleep(0.5)  # slow-fp32 sleeps 0.1 s per encode (~36 encodes): well under way, far from done
        procs[1].send_signal(signal.SIGKILL)
        reports = []
        for proc in (procs[0], procs[2]):
            out, _ = proc.communicate(timeout=60)
            reports.append(json.loads(out.strip().splitlines()[-1]))
        procs[1].wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(r.get("ok") for r in reports), reports
    assert reports[0]["contributors"] == reports[1]["contributors"] == ["peer-0", "peer-2"]
    assert torch.equal(load_result(tmp_path, 0), load_result(tmp_path, 2))
    exact = (make_input(0, numel) + make_input(2, numel)) / 2
    assert torch.allclose(load_result(tmp_path, 0), exact, atol=1e-6)
    for report in reports:
        # Two attempts: the re-run among the two survivors alone sends 2 * 1/2 * 4 bytes per value (its part
        # out, the mean of its part back); the failed attempt of three came on top, and fp32 never beats itself.
        assert report["fp32_bytes"] > 4 * numel, report
        assert report["fp32_bytes"] <= report["bytes_sent"] < 1.001 * report["fp32_bytes"], report


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hung_member_is_dropped_after_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGSTOPped member keeps its sockets open: only the deadlines can drop it."""
    numel = 300_000
    # Data phase 7.2 s, votes 1.8 s, then a retry among the others.
    monkeypatch.setenv("EXCHANGE_TEST_TIMEOUT", "12")
    _, reports = run_workers(3, numel, "fp32", tmp_path, die={1: -3}, collect=(0, 2))
    assert all(r.get("ok") for r in reports), reports
    assert reports[0]["contributors"] == reports[1]["contributors"] == ["peer-0", "peer-2"]
    assert torch.equal(load_result(tmp_path, 0), load_result(tmp_path, 2))
    exact = (make_input(0, numel) + make_input(2, numel)) / 2
    assert torch.allclose(load_result(tmp_path, 0), exact, atol=1e-6)


@pytest.mark.multiprocess
def test_a_frozen_member_is_given_up_by_a_majority_before_the_data_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGSTOPped member whose membership record expired (the agent's view: no heartbeat for the member ttl)
    and that sent nothing for GONE_SILENCE_SECONDS is given up by the two others, a strict majority of the
    group, long before the data deadline (18 s here): they retry without it and agree bit for bit."""
    numel = 300_000
    monkeypatch.setenv("EXCHANGE_TEST_TIMEOUT", "30")
    monkeypatch.setenv("EXCHANGE_TEST_GONE", "peer-1")
    _, reports = run_workers(3, numel, "fp32", tmp_path, die={1: -1}, collect=(0, 2))
    assert all(r.get("ok") for r in reports), reports
    assert reports[0]["contributors"] == reports[1]["contributors"] == ["peer-0", "peer-2"]
    assert all(r["seconds"] < 12.0 for r in reports), reports  # the data deadline alone would be 18 s
    assert torch.equal(load_result(tmp_path, 0), load_result(tmp_path, 2))


@pytest.mark.multiprocess
def test_a_silent_member_that_answers_is_kept_even_when_its_record_expired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that starts its attempt 5 s late (silent meanwhile) and whose record the others see expired (a
    frozen member's DHT replica makes healthy members' heartbeats fail too): it answers their ping, so it is
    waited for and the mean has all three."""
    numel = 300_000
    monkeypatch.setenv("EXCHANGE_TEST_TIMEOUT", "30")
    monkeypatch.setenv("EXCHANGE_TEST_GONE", "peer-1")
    monkeypatch.setenv("EXCHANGE_TEST_LATE", "peer-1:5")
    _, reports = run_workers(3, numel, "fp32", tmp_path)
    assert all(r.get("ok") for r in reports), reports
    assert all(r["contributors"] == ["peer-0", "peer-1", "peer-2"] for r in reports), reports


@pytest.mark.multiprocess
def test_neither_side_of_a_one_one_split_gives_up_the_other_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two members, one frozen and gone from the other's view: one member is no strict majority of two (from
    one side a freeze and a partition look alike, and each side of a 1|1 partition would go on alone), so the
    survivor waits for the data deadline (3.6 s of a 6 s exchange) as it would without the callback."""
    monkeypatch.setenv("EXCHANGE_TEST_TIMEOUT", "6")
    monkeypatch.setenv("EXCHANGE_TEST_GONE", "peer-1")
    _, (report,) = run_workers(2, 300_000, "fp32", tmp_path, die={1: -1}, collect=(0,))
    elapsed = report.get("elapsed", report.get("seconds"))
    assert elapsed is not None and elapsed >= 3.5, report
    assert "MEMBER_GONE" not in json.dumps(report), report


class SlowCodec(Fp32Codec):
    def encode(self, tensor: torch.Tensor) -> bytes:
        time.sleep(0.1)
        return super().encode(tensor)


async def worker(
    peer_id: str, index: int, numel: int, codec_name: str, die_at: int, out_dir: Path
) -> dict[str, Any]:
    node = Node(peer_id)
    member = await node.start()
    print(member.address, flush=True)
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, sys.stdin.readline)
    spec = json.loads(line)
    group = Group.make(spec["round"], [GroupMember(p, a) for p, a in spec["members"]])
    codec: Any = SlowCodec() if codec_name == "slow-fp32" else CODECS[codec_name]()
    if die_at:
        codec = SuicidalCodec(codec, die_at)
    print("averaging", flush=True)
    late = dict(item.split(":") for item in filter(None, os.environ.get("EXCHANGE_TEST_LATE", "").split(",")))
    await asyncio.sleep(
        float(late.get(peer_id, 0))
    )  # a member that starts its attempt late: silent, not gone
    started = time.monotonic()
    try:
        timeout = float(os.environ.get("EXCHANGE_TEST_TIMEOUT", "40"))
        result = await node.exchange.average(group, make_input(index, numel), codec, timeout=timeout)
    except ExchangeAborted as exc:
        return {
            "aborted": exc.reason,
            "elapsed": time.monotonic() - started,
            "detail": exc.detail,
            "bytes_sent": exc.bytes_sent,
            "fp32_bytes": exc.fp32_bytes,
        }
    finally:
        await asyncio.sleep(0.5)  # keep serving a moment: peers may still be fetching our part's mean
        await node.stop()
    (out_dir / f"averaged-{index}.f32").write_bytes(result.averaged.numpy().astype("<f4").tobytes())
    return {
        "ok": True,
        "contributors": list(result.contributors),
        "seconds": result.seconds,
        "bytes_sent": result.bytes_sent,
        "fp32_bytes": result.fp32_bytes,
    }


if __name__ == "__main__":
    torch.set_num_threads(1)  # several peer processes share 2 cores; intra-op threads only contend
    name, idx, size, codec_arg, die, out = sys.argv[1:7]
    report = asyncio.run(worker(name, int(idx), int(size), codec_arg, int(die), Path(out)))
    print(json.dumps(report), flush=True)


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
