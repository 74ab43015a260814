"""What the exchange's codec threads buy (protocol/exchange/codecpool.py): the same exchange with its codec work on
the event loop (0 threads) and on 1, 2, ... threads per member.

    python benchmarks/codec_threads.py                        # 2 members x 256 MiB, int8, 0/1/2 threads
    python benchmarks/codec_threads.py --members 2 --mib 1024 --threads 0 1 4 8 15 --codec int8 fp32

Every member runs in this one process on one event loop (real RpcServers and the TCP data plane on 127.0.0.1),
so with 0 threads all the members' codec work shares one core: that is one node's exchange on one core, against
the same work spread over the threads. (benchmarks/exchange.py runs each member in its own process: on a 2-core
machine its two members already have a core each, and a thread per member only adds a hand-off per chunk.) Each
configuration: one warm-up exchange, then `--reps` timed, the median reported; every member's mean is checked
bit-identical to the 0-thread run's (the threads never change a result). One JSON line per configuration,
`--markdown` a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import torch

from farloco.optim import get_codec
from farloco.protocol.auth import Authenticator
from farloco.protocol.exchange import Exchange
from farloco.protocol.rpc import RpcClient, RpcServer
from farloco.protocol.tcpstream import tune_malloc
from farloco.protocol.types import Group, GroupMember


def make_input(member: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1234 + member))


async def measure(
    members: int, numel: int, codec_name: str, threads: int, reps: int
) -> tuple[list[float], float, list[torch.Tensor]]:
    """Seconds of each timed exchange, CPU seconds per exchange (the process: every member), the means."""
    servers, exchanges, group_members = [], [], []
    for i in range(members):
        auth = Authenticator("bench-codec-threads", b"bench-secret", f"peer-{i}")
        server = RpcServer(auth, host="127.0.0.1", data_port=0)
        client = RpcClient(auth)
        exchanges.append((Exchange(server, client, f"peer-{i}", codec_threads=threads), client))
        group_members.append(GroupMember(f"peer-{i}", await server.start()))
        servers.append(server)
    inputs = [make_input(i, numel) for i in range(members)]
    outs = [torch.empty(numel) for _ in range(members)]
    sent = [torch.empty(numel) for _ in range(members)]
    codec = get_codec(codec_name)
    times: list[float] = []
    cpu = 0.0
    try:
        for rep in range(reps + 1):  # the first warms up channels, pages and threads
            group = Group.make(rep, group_members)
            start, cpu_start = time.perf_counter(), time.process_time()
            await asyncio.gather(
                *(
                    exchange.average(
                        group, inputs[i], codec, timeout=600, out=outs[i], transmitted_out=sent[i]
                    )
                    for i, (exchange, _) in enumerate(exchanges)
                )
            )
            if rep:
                times.append(time.perf_counter() - start)
                cpu += time.process_time() - cpu_start
    finally:
        for (exchange, client), server in zip(exchanges, servers, strict=True):
            await client.close()
            await server.stop(0)
            exchange.close()
    return times, cpu / reps, outs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--mib", type=int, default=256, help="fp32 size of each member's tensor")
    parser.add_argument("--codec", nargs="+", default=["int8"])
    parser.add_argument("--threads", type=int, nargs="+", default=[0, 1, 2], help="codec threads per member")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if 0 not in args.threads:
        args.threads = [0, *args.threads]  # the reference every row is compared with
    tune_malloc()
    numel = args.mib * (1 << 20) // 4
    rows: list[dict[str, Any]] = []
    for codec_name in args.codec:
        reference: list[torch.Tensor] | None = None
        base = 0.0
        for threads in args.threads:
            times, cpu, means = asyncio.run(measure(args.members, numel, codec_name, threads, args.reps))
            if reference is None:
                reference = means
            elif not all(torch.equal(m, r) for m, r in zip(means, reference, strict=True)):
                raise SystemExit(f"{codec_name}, {threads} threads: a mean differs from the event loop's")
            seconds = statistics.median(times)
            base = base or seconds
            row = {
                "members": args.members,
                "mib": args.mib,
                "codec": codec_name,
                "codec_threads": threads,
                "seconds_median": round(seconds, 4),
                "x_event_loop": round(base / seconds, 2),
                "cpu_seconds": round(cpu, 4),
                "cores": len(os.sched_getaffinity(0)),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.markdown:
        print("| codec | members | MiB | codec threads | median s | x event loop | CPU s |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['codec']} | {r['members']} | {r['mib']} | {r['codec_threads']} | {r['seconds_median']:.3f} "
                f"| {r['x_event_loop']:.2f}x | {r['cpu_seconds']:.3f} |"
            )


if __name__ == "__main__":
    main()
