"""Benchmark of one small message to many processes: farloco's authenticated unary call over gRPC and over a link
(protocol/links.py: one kept-open data-plane connection per peer, what carries a ready record to every member)
against a bare asyncio TCP line on an open connection, on 127.0.0.1.

    python benchmarks/fanout.py                    # 7 receivers, idle gaps of 0, 0.1 and 1 s
    python benchmarks/fanout.py --receivers 15 --calls 40

The sender sends one message to every receiver at once (`asyncio.gather`), waits `gap` seconds, and again. Each
receiver is its own process and answers with the wall-clock time at which its handler ran. Reported per
transport and gap (p50 and p90 over the calls, in ms): `first` and `last`, when the first and the last receiver's
handler ran after the send began, and `all`, when every answer was back. The gap matters: a receiver that slept
for a second wakes more slowly than one that was busy a moment ago, and a daemon's members sleep through the
inner steps before every round's freeze.

Receivers talk to the driver through stdout only (their address); nothing is pickled across processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

METHOD = "MatchReady"
SECRET = b"bench-fanout"


async def receiver(index: int) -> None:
    from farloco.protocol.auth import Authenticator
    from farloco.protocol.rpc import Frame, RpcServer

    server = RpcServer(Authenticator("fanout:h", SECRET, f"receiver-{index}"), host="127.0.0.1", data_port=0)

    async def on_call(ctx: Any, frame: Any) -> Any:
        return Frame({"at": time.time()})

    server.add_unary(METHOD, on_call)
    address = await server.start()

    async def on_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readline():
            writer.write(f"{time.time()!r}\n".encode())
            await writer.drain()

    tcp = await asyncio.start_server(on_line, "127.0.0.1", 0)
    print(json.dumps({"grpc": address, "tcp": tcp.sockets[0].getsockname()[1]}), flush=True)
    await asyncio.Event().wait()  # until the driver kills us


def quantiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {
        "p50": round(1000 * values[len(values) // 2], 2),
        "p90": round(1000 * values[min(len(values) - 1, 9 * len(values) // 10)], 2),
    }


async def measure(addresses: list[dict[str, Any]], calls: int, gaps: list[float]) -> list[dict[str, Any]]:
    from farloco.protocol.auth import Authenticator
    from farloco.protocol.rpc import Frame, RpcClient

    client = RpcClient(Authenticator("fanout:h", SECRET, "sender"))
    lines = [await asyncio.open_connection("127.0.0.1", a["tcp"]) for a in addresses]

    async def by_grpc() -> list[float]:
        answers = await asyncio.gather(
            *(
                client.unary(a["grpc"], METHOD, Frame({"ready": 1}), round_id=1, timeout=5.0)
                for a in addresses
            )
        )
        return [float(answer.header["at"]) for answer in answers]

    async def by_link() -> list[float]:
        answers = await asyncio.gather(
            *(
                client.unary(a["grpc"], METHOD, Frame({"ready": 1}), round_id=1, timeout=5.0, link=True)
                for a in addresses
            )
        )
        return [float(answer.header["at"]) for answer in answers]

    async def by_tcp() -> list[float]:
        for _, writer in lines:
            writer.write(b"ready\n")
        return [float(await reader.readline()) for reader, _ in lines]

    rows = []
    try:
        for gap in gaps:
            for name, send in (("grpc", by_grpc), ("link", by_link), ("tcp", by_tcp)):
                await send()  # channels and connections warm
                first, last, every = [], [], []
                for _ in range(calls):
                    await asyncio.sleep(gap)
                    started = time.time()
                    handled = await send()
                    every.append(time.time() - started)
                    first.append(min(handled) - started)
                    last.append(max(handled) - started)
                rows.append(
                    {
                        "transport": name,
                        "receivers": len(addresses),
                        "gap_s": gap,
                        "first_ms": quantiles(first),
                        "last_ms": quantiles(last),
                        "all_ms": quantiles(every),
                    }
                )
    finally:
        for _, writer in lines:
            writer.close()
        await client.close()
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--receiver":
        asyncio.run(receiver(int(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--receivers", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30, help="messages per transport and gap")
    parser.add_argument("--gaps", type=float, nargs="*", default=[0.0, 0.1, 1.0])
    args = parser.parse_args()
    print(f"# load before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores", flush=True)
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--receiver", str(i)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(args.receivers)
    ]
    try:
        addresses = [json.loads(proc.stdout.readline()) for proc in procs if proc.stdout is not None]
        for row in asyncio.run(measure(addresses, args.calls, args.gaps)):
            print(json.dumps(row), flush=True)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
