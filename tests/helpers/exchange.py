"""The exchange tests' harness: test codecs, an exchange member on a real RpcServer on 127.0.0.1, and the
worker processes of the multi-process tests.

The test codecs here have the structural shape of farloco.optim codecs (fp32, blockwise int8, top-k sparse),
so the exchange is tested without importing optim. Run as a script, this file is the worker of the
multi-process tests (tests/integration/test_exchange_processes.py): it serves, prints its address, reads the
group on stdin, averages, and writes the result as raw float32 bytes (never pickle across processes).
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
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from farloco.node.faults.wrappers import CorruptingClient
from farloco.protocol.auth import Authenticator
from farloco.protocol.exchange import PUSH_METHOD, Exchange, ExchangeAborted
from farloco.protocol.exchange import owner as owner_module
from farloco.protocol.exchange import push as push_module
from farloco.protocol.rpc import RpcClient, RpcServer
from farloco.protocol.types import NO_INBOUND, Group, GroupMember

if TYPE_CHECKING:
    import pytest


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
    them on gRPC; subprocess workers take it from EXCHANGE_TEST_PLANE. `corrupting`: the exchange pushes
    through `self.corrupting` (node/faults/wrappers.py), whose `arm(round_id, mode)` corrupts that round's
    payloads (the chaos fault `corrupt=MODE@exchange`)."""

    def __init__(
        self,
        peer_id: str,
        plane: str | None = None,
        lanes: int = 1,
        slices: int = 0,
        codec_threads: int = 1,
        corrupting: bool = False,
    ) -> None:
        auth = Authenticator(RUN, SECRET, peer_id)
        self.peer_id = peer_id
        plane = plane or os.environ.get("EXCHANGE_TEST_PLANE", "tcp")
        self.server = RpcServer(auth, data_port=0 if plane == "tcp" else None)
        self.client = RpcClient(auth)
        self.corrupting = CorruptingClient(self.client, PUSH_METHOD) if corrupting else None
        # Subprocess workers: the peers whose membership record "expired" (EXCHANGE_TEST_GONE), as the agent's
        # view of the DHT would say once a frozen member stopped heartbeating.
        gone = set(filter(None, os.environ.get("EXCHANGE_TEST_GONE", "").split(",")))
        self.exchange = Exchange(
            self.server,
            self.corrupting or self.client,
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
    count: int,
    plane: str | None = None,
    lanes: Sequence[int] = (),
    codec_threads: int = 1,
    corrupting: Sequence[int] = (),
    behind_nat: Sequence[int] = (),
) -> tuple[list[Node], Group]:
    """`count` members on servers of their own, grouped for round 11; those in `corrupting` push through a
    CorruptingClient (see Node); those in `behind_nat` are in the group by the address `NO_INBOUND` (nobody
    calls them: they call the others)."""
    nodes = [
        Node(
            f"peer-{i}",
            plane,
            lanes[i] if lanes else 1,
            codec_threads=codec_threads,
            corrupting=i in corrupting,
        )
        for i in range(count)
    ]
    members = [await node.start() for node in nodes]
    members = [replace(m, address=NO_INBOUND) if i in behind_nat else m for i, m in enumerate(members)]
    return nodes, Group.make(11, members)


def skip_own_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's members skip the check that stops an honest node from sending its own NaN/Inf (as a buggy or
    hostile peer would): on the way out (push.py) and into its own part's mean (owner.py)."""
    for module in (push_module, owner_module):
        monkeypatch.setattr(module, "own_chunk_error", lambda codec, chunk, offset: None)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


# -- separate processes -------------------------------------------------------------------------------------


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
