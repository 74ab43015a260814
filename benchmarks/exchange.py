"""Benchmark of the collective exchange: farloco (fp32, int8) vs torch.distributed gloo all_reduce vs hivemind's
DecentralizedAverager, each peer in its own process on 127.0.0.1.

    python benchmarks/exchange.py                       # every impl, 2 and 4 peers, 4 / 64 / 256 MiB fp32
    python benchmarks/exchange.py --impl farloco --peers 2 --mib 64 --codec int8 --markdown
    python benchmarks/exchange.py --impl farloco --impl farloco-tls --impl gloo --peers 2 --mib 256 \
        --codec fp32 --codec int8 --markdown            # what encryption costs (TLS 1.3 beyond loopback)
    python benchmarks/exchange.py --impl farloco --impl gloo --peers 2 --mib 1024 --codec int8 \
        --codec-threads 0 --codec-threads 1 --codec-threads 8 --markdown   # the codec's threads (a many-core host)
    python benchmarks/exchange.py --wan 1gbit:100 --impl farloco --impl gloo --streams 1 --streams 4 \
        --peers 2 --mib 64 --codec fp32 --markdown     # each peer in its own namespace: 1 Gbit/s, 100 ms RTT

With `--wan RATE:RTT_MS` (root: node/tools/netns.py) every peer runs in a network namespace of its own behind a
link shaped to RATE, with RTT_MS round-trip time through the netem relay, gloo's ranks too (GLOO_SOCKET_IFNAME
names the uplink). `--streams N` (repeatable) runs farloco with network.streams_per_peer = N: the chunks of a
part spread over N TCP streams per peer pair, each with its own window.

Every peer checks its result against the exact average (tolerance per codec): a wrong farloco or gloo result
fails the run; a wrong hivemind result (its averager can return a partial average as success) is reported in
its row as `wrong_result`.
One JSON line per configuration: impl, peers, mib, codec, seconds_median, algbw_gbps (= payload MiB as GB / s,
the usual all-reduce "algorithm bandwidth"). Peers talk only through stdin/stdout JSON and their own sockets;
nothing is pickled across processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

# glibc malloc tuning for every peer process: keep freed chunk-sized buffers in the heap instead of returning
# them to the kernel after every message (each fresh 1-2 MiB mmap costs page faults on first touch).
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(2 << 30),
    "MALLOC_TOP_PAD_": str(64 << 20),
}
DEFAULT_CONFIGS = [
    # (impl, codec): farloco fp32 and int8, gloo fp32, hivemind fp32
    ("farloco", "fp32"),
    ("farloco", "int8"),
    ("gloo", "fp32"),
    ("hivemind", "fp32"),
]


def reps_for(mib: int, impl: str) -> int:
    if impl == "hivemind":
        return 3 if mib <= 64 else 2
    return 7 if mib <= 4 else (5 if mib <= 64 else 3)


# -- inputs and checks (each peer computes them itself, from the rank) --------------------------------------


def make_input(rank: int, numel: int) -> torch.Tensor:
    base = torch.randn(numel, generator=torch.Generator().manual_seed(1234))
    return base.mul_(rank + 1).add_(0.01 * rank)


def exact_mean(peers: int, numel: int) -> torch.Tensor:
    base = torch.randn(numel, generator=torch.Generator().manual_seed(1234))
    return base.mul_((peers + 1) / 2).add_(0.01 * (peers - 1) / 2)


def tolerance(codec: str, peers: int, exact: torch.Tensor) -> float:
    scale = float(exact.abs().max()) * 2 * peers / (peers + 1)  # the largest input magnitude
    if codec.startswith("int8"):
        return 2 * scale / 127  # two blockwise quantizations (contribution, mean), half a step each
    return 1e-5 * scale


class RawFp32:
    """Diagnostic codec (`--codec fp32-raw`): the bare float32 bytes, no header, checksum or finiteness check.
    It shows what the transport alone costs, next to optim's validating fp32 codec."""

    name = "fp32-raw"
    dense = True
    lossless = True

    def encode(self, tensor: torch.Tensor) -> bytes:
        return tensor.contiguous().numpy().tobytes()

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        return torch.frombuffer(data, dtype=torch.float32).clone()


def get_codec(name: str) -> Any:
    if name == "fp32-raw":
        return RawFp32()
    try:
        from farloco.optim import get_codec as optim_codec
    except ImportError:  # optim not there yet: a minimal fp32 codec only
        optim_codec = None
    if optim_codec is not None:
        return optim_codec(name)
    if name != "fp32":
        raise SystemExit(f"codec {name!r} needs farloco.optim.get_codec, which is not importable")
    return RawFp32()


def send(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def receive() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("parent closed stdin")
    message: dict[str, Any] = json.loads(line)
    return message


def read_peer(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    """The driver's side of `send`: one JSON line from a peer process."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} peer exited with {proc.wait()} before answering")
    message: dict[str, Any] = json.loads(line)
    return message


def write_peer(proc: subprocess.Popen[str], message: dict[str, Any]) -> None:
    """The driver's side of `receive`: one JSON line to a peer process."""
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(message) + "\n")
    proc.stdin.flush()


# -- peer workers -------------------------------------------------------------------------------------------


def worker_farloco(rank: int, peers: int, numel: int, codec_name: str, reps: int) -> dict[str, Any]:
    import gc

    from farloco.protocol.auth import Authenticator
    from farloco.protocol.exchange import Exchange
    from farloco.protocol.rpc import RpcClient, RpcServer
    from farloco.protocol.tcpstream import tune_malloc
    from farloco.protocol.transport import run_credentials
    from farloco.protocol.types import Group, GroupMember

    # What the daemon's agent does at start (node/daemon/agent.py Agent.run).
    tune_malloc()
    gc.freeze()

    async def main() -> dict[str, Any]:
        peer_id = f"peer-{rank}"
        auth = Authenticator("bench", b"bench-secret", peer_id)
        # The daemon's default: streams on the TCP data plane; BENCH_DATA_PLANE=grpc keeps them on gRPC.
        data_port = 0 if os.environ.get("BENCH_DATA_PLANE", "tcp") == "tcp" else None
        # farloco-tls: TLS 1.3 on gRPC and the data plane, as beyond loopback (the run secret's certificates).
        tls = (
            run_credentials(b"bench-secret", "bench", peer_id) if os.environ.get("BENCH_TLS") == "1" else None
        )
        server = RpcServer(auth, host=os.environ.get("BENCH_HOST", "127.0.0.1"), data_port=data_port, tls=tls)
        client = RpcClient(auth, tls=tls)
        exchange = Exchange(
            server,
            client,
            peer_id,
            chunk_bytes=int(os.environ.get("BENCH_CHUNK_BYTES", 1 << 20)),
            streams_per_peer=int(os.environ.get("BENCH_STREAMS", 1)),
            codec_threads=int(os.environ.get("BENCH_CODEC_THREADS", 0)),
        )
        send({"address": await server.start()})
        spec = await asyncio.get_running_loop().run_in_executor(None, receive)
        members = [GroupMember(p, a) for p, a in spec["members"]]
        codec = get_codec(codec_name)
        from farloco.optim import Aggregator

        name = os.environ.get("BENCH_AGGREGATOR", "mean")
        rule = Aggregator(name) if name != "mean" else None
        tensor = make_input(rank, numel)
        out = torch.empty(numel)
        sent = torch.empty(numel)  # what the others saw of ours (lossy codecs), reused like `out`
        times: list[float] = []
        cpu: list[float] = []
        result = None
        try:
            for rep in range(reps + 1):  # the first one warms up channels and allocator
                barrier = Group.make(2 * rep, members)
                await exchange.average(barrier, torch.zeros(1), codec, timeout=60)
                group = Group.make(2 * rep + 1, members)
                start, cpu_start = time.perf_counter(), time.process_time()
                # Like the daemon: the same result and transmitted buffers every round (fresh pages cost ~10%).
                result = await exchange.average(
                    group, tensor, codec, timeout=600, out=out, transmitted_out=sent, rule=rule
                )
                if rep:
                    times.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - cpu_start)
        finally:
            await client.close()
            await server.stop(0.5)
        assert result is not None
        return {"times": times, "cpu": cpu, "averaged": result.averaged}

    out = asyncio.run(main())
    aggregator = os.environ.get("BENCH_AGGREGATOR", "mean")
    return {
        "times": out["times"],
        "cpu": out["cpu"],
        "max_err": check(out["averaged"], peers, codec_name, aggregator),
    }


def check(averaged: torch.Tensor, peers: int, codec: str, aggregator: str = "mean") -> tuple[float, float]:
    """(max error, tolerance) against the exact result: the mean, or a coordinate-wise robust rule of every
    peer's input. The norm-based rules depend on the chunking; they are checked to stay within the inputs'
    range per coordinate (CenteredClip moves by convex combinations from the median; norm clipping scales inputs
    toward 0, so 0 joins its range)."""
    if aggregator in ("mean", "trimmed_mean", "median"):
        if aggregator == "mean":
            exact = exact_mean(peers, averaged.numel())
        else:
            from farloco.optim import aggregate

            exact = aggregate(aggregator, [make_input(r, averaged.numel()) for r in range(peers)])
        return float((averaged - exact).abs().max()), tolerance(codec, peers, exact)
    inputs = torch.stack([make_input(r, averaged.numel()) for r in range(peers)])
    if aggregator == "norm_clip":
        inputs = torch.cat([inputs, torch.zeros_like(inputs[:1])])
    low, high = inputs.min(0).values, inputs.max(0).values
    outside = torch.clamp(low - averaged, min=0) + torch.clamp(averaged - high, min=0)
    return float(outside.max()), tolerance(codec, peers, exact_mean(peers, averaged.numel()))


def worker_gloo(rank: int, peers: int, numel: int, reps: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    master = os.environ.get("BENCH_MASTER", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=peers)
    tensor = make_input(rank, numel)
    work = torch.empty_like(tensor)
    times, cpu = [], []
    for rep in range(reps + 1):
        work.copy_(tensor)
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        dist.all_reduce(work)
        work.div_(peers)
        if rep:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
    dist.barrier()
    dist.destroy_process_group()
    return {"times": times, "cpu": cpu, "max_err": check(work, peers, "fp32")}


def worker_hivemind(rank: int, peers: int, numel: int, reps: int) -> dict[str, Any]:
    import hivemind

    from farloco.node.daemon.dhtnode import make_dht

    if rank == 0:
        dht = make_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        send({"maddrs": [str(a) for a in dht.get_visible_maddrs()]})
        receive()
    else:
        send({"ready": True})
        spec = receive()
        dht = make_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=spec["maddrs"], start=True)
    tensor = make_input(rank, numel)
    averager = hivemind.averaging.DecentralizedAverager(
        [tensor.clone()],
        dht,
        prefix="farloco-bench",
        target_group_size=peers,
        min_group_size=peers,
        min_matchmaking_time=2.0,  # an upper bound here: the group forms as soon as all `peers` have joined
        request_timeout=1.0,
        start=True,
    )
    times, cpu = [], []
    try:
        for rep in range(reps + 1):
            with averager.get_tensors() as tensors:
                tensors[0].copy_(tensor)
            start, cpu_start = time.perf_counter(), time.process_time()
            outcome = averager.step(timeout=600)
            if outcome is None or len(outcome) != peers:
                raise RuntimeError(
                    f"hivemind step {rep} averaged over {outcome and len(outcome)} peers, not {peers}"
                )
            if rep:
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - cpu_start)
        with averager.get_tensors() as tensors:
            averaged = tensors[0].clone()
    finally:
        averager.shutdown()
        dht.shutdown()
    return {"times": times, "cpu": cpu, "max_err": check(averaged, peers, "fp32")}


def worker_main(argv: list[str]) -> None:
    impl, rank, peers, numel, codec, reps, port = argv
    # Every impl alike: one compute thread per peer process. With >= 2 peers on 2 cores, torch's intra-op
    # threads only fight each other (measured here: a 1 MiB clone went from 0.5 ms to 9 ms with 2 threads).
    torch.set_num_threads(1)
    if impl.startswith("farloco"):
        report = worker_farloco(int(rank), int(peers), int(numel), codec, int(reps))
    elif impl == "gloo":
        report = worker_gloo(int(rank), int(peers), int(numel), int(reps), int(port))
    else:
        report = worker_hivemind(int(rank), int(peers), int(numel), int(reps))
    send({"report": report})


# -- the driver ---------------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_config(
    impl: str,
    peers: int,
    mib: int,
    codec: str,
    malloc_tuning: bool,
    chunk_bytes: int = 1 << 20,
    *,
    streams: int = 1,
    wan: Any = None,
    aggregator: str = "mean",
    codec_threads: int = 0,
) -> dict[str, Any]:
    numel = mib * (1 << 20) // 4
    reps = reps_for(mib, impl) if wan is None else 3
    port = free_port()
    env = {
        **os.environ,
        **(MALLOC_ENV if malloc_tuning else {}),
        "BENCH_CHUNK_BYTES": str(chunk_bytes),
        "BENCH_DATA_PLANE": "grpc" if impl == "farloco-grpc" else "tcp",
        "BENCH_TLS": "1" if impl == "farloco-tls" else "0",
        "BENCH_STREAMS": str(streams),
        "BENCH_AGGREGATOR": aggregator,
        "BENCH_CODEC_THREADS": str(codec_threads),
    }

    def where(rank: int) -> tuple[list[str], dict[str, str]]:
        """The command prefix and environment of peer `rank`: its own namespace on a WAN."""
        if wan is None:
            return [], env
        host = rank + 1
        return list(wan.prefix_command(host)), {
            **env,
            "BENCH_HOST": wan.address(host),
            "BENCH_MASTER": wan.address(1),
            "GLOO_SOCKET_IFNAME": f"{wan.prefix}v{host}",
        }

    procs = [
        subprocess.Popen(
            [
                *where(rank)[0],
                sys.executable,
                __file__,
                "--worker",
                impl,
                str(rank),
                str(peers),
                str(numel),
                codec,
                str(reps),
                str(port),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=where(rank)[1],
        )
        for rank in range(peers)
    ]

    def read(proc: subprocess.Popen[str]) -> dict[str, Any]:
        return read_peer(proc, impl)

    write = write_peer

    try:
        if impl.startswith("farloco"):
            addresses = [read(p)["address"] for p in procs]
            members = [[f"peer-{i}", a] for i, a in enumerate(addresses)]
            for proc in procs:
                write(proc, {"members": members})
        elif impl == "hivemind":
            maddrs = read(procs[0])["maddrs"]
            for proc in procs[1:]:
                read(proc)
            for proc in procs:
                write(proc, {"maddrs": maddrs})
        reports = [read(p)["report"] for p in procs]
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wrong = ""
    for rank, report in enumerate(reports):
        err, tol = report["max_err"]
        if not err <= tol:
            wrong = f"peer {rank}: max error {err:.3g} exceeds tolerance {tol:.3g}"
            if impl != "hivemind":
                raise RuntimeError(f"{impl}/{codec} {wrong}")
            # hivemind's averager can return a partial average and call it success ("received 99.2% results");
            # that is a finding about the alternative, reported in its row, not a reason to lose the run.
    # A collective is done when its slowest peer is done.
    per_rep = [max(times) for times in zip(*(r["times"] for r in reports), strict=True)]
    seconds = statistics.median(per_rep)
    # CPU seconds of the busiest peer (all its threads): far less sensitive than wall time to other load.
    cpu_seconds = statistics.median(max(c) for c in zip(*(r["cpu"] for r in reports), strict=True))
    return {
        "impl": (impl if streams == 1 else f"{impl} x{streams} streams")
        + (f" {aggregator}" if aggregator != "mean" else "")
        + (f" {codec_threads} codec threads" if impl.startswith("farloco") and codec_threads else ""),
        "codec_threads": codec_threads if impl.startswith("farloco") else 0,
        "peers": peers,
        "mib": mib,
        "codec": codec,
        "seconds_median": round(seconds, 4),
        "algbw_gbps": round(mib * (1 << 20) / seconds / 1e9, 3),
        "cpu_seconds_median": round(cpu_seconds, 4),
        "reps": len(per_rep),
        "max_err": max(r["max_err"][0] for r in reports),
        **({"wrong_result": wrong} if wrong else {}),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| impl | codec | peers | MiB | median s | algbw GB/s | vs gloo fp32 | CPU s (busiest peer) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    gloo = {(r["peers"], r["mib"]): r["seconds_median"] for r in rows if r["impl"] == "gloo"}
    if any("link" in r for r in rows):
        lines[0] = lines[0].replace("| impl |", "| link | impl |")
        lines[1] = "|---" + lines[1]
    for r in rows:
        ref = gloo.get((r["peers"], r["mib"]))
        ratio = f"{ref / r['seconds_median']:.2f}x" if ref else "-"
        wrong = f" (WRONG RESULT: {r['wrong_result']})" if "wrong_result" in r else ""
        link = f"| {r['link']} " if "link" in r else ""
        lines.append(
            f"{link}| {r['impl']}{wrong} | {r['codec']} | {r['peers']} | {r['mib']} | {r['seconds_median']:.3f} | "
            f"{r['algbw_gbps']:.3f} | {ratio} | {r['cpu_seconds_median']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--impl",
        choices=["farloco", "farloco-tls", "farloco-grpc", "hivemind", "gloo"],
        action="append",
        help="default: farloco, gloo, hivemind (farloco-grpc: the exchange's streams kept on gRPC; farloco-tls: "
        "TLS 1.3 on gRPC and the data plane, as every node beyond loopback)",
    )
    parser.add_argument("--peers", type=int, action="append", help="default: 2 and 4")
    parser.add_argument("--mib", type=int, action="append", help="fp32 payload size; default: 4, 64, 256")
    parser.add_argument("--codec", action="append", help="farloco codec(s); default fp32 and int8")
    parser.add_argument(
        "--no-malloc-tuning", action="store_true", help="run peers with glibc's default malloc"
    )
    parser.add_argument(
        "--chunk-mib", type=float, default=1.0, help="farloco chunk size (fp32 MiB), default 1"
    )
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    parser.add_argument(
        "--wan", help="RATE:RTT_MS, e.g. 1gbit:100: every peer in its own namespace behind such a link (root)"
    )
    parser.add_argument(
        "--streams", type=int, action="append", help="farloco's streams per peer pair (default 1)"
    )
    parser.add_argument(
        "--aggregator",
        action="append",
        help="farloco's run.aggregator (repeatable; default mean): what a robust rule costs the exchange",
    )
    parser.add_argument(
        "--codec-threads",
        type=int,
        action="append",
        help="farloco's network.codec_threads per peer (repeatable; default 0: the codec on the event loop)",
    )
    args = parser.parse_args()
    configs = [(impl, codec) for impl, codec in DEFAULT_CONFIGS if not args.impl or impl in args.impl]
    if args.impl and "farloco-grpc" in args.impl and not args.codec:
        configs = [("farloco-grpc", "fp32"), ("farloco-grpc", "int8"), *configs]
    if args.codec:
        configs = [c for c in configs if not c[0].startswith("farloco")]
        farlocos = [i for i in args.impl or ["farloco"] if i.startswith("farloco")]
        configs = [(impl, codec) for impl in farlocos for codec in args.codec] + configs
    # farloco rows once per --streams value
    configs = [
        (impl, codec, streams, aggregator, threads)
        for impl, codec in configs
        for streams in (args.streams or [1] if impl.startswith("farloco") else [1])
        for aggregator in (args.aggregator or ["mean"] if impl.startswith("farloco") else ["mean"])
        for threads in (args.codec_threads or [0] if impl.startswith("farloco") else [0])
    ]
    rows = []
    with contextlib.ExitStack() as stack:
        for peers in args.peers or [2, 4]:
            wan = None
            if args.wan:
                from farloco.node.tools.netns import NamespaceWAN, relay_unavailable

                reason = relay_unavailable()
                if reason is not None:
                    raise SystemExit(f"--wan: {reason}")
                rate, _, rtt = args.wan.partition(":")
                wan = stack.enter_context(NamespaceWAN(peers, rate, delay_ms=float(rtt or 0) / 2))
            # Implementations take turns at each size, so they see the same background load (a shared box).
            for mib in args.mib or [4, 64, 256]:
                for impl, codec, streams, aggregator, threads in configs:
                    row = run_config(
                        impl, peers, mib, codec, not args.no_malloc_tuning, int(args.chunk_mib * (1 << 20)),
                        streams=streams, wan=wan, aggregator=aggregator, codec_threads=threads,
                    )  # fmt: skip
                    if args.wan:
                        row["link"] = args.wan
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            if wan is not None:
                stack.close()
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
