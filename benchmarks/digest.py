"""Benchmark of theta's digest: the sha256 tree hash (farloco.protocol.digest) on 1..N threads against the plain
sequential sha256 it replaced and a memcpy of the same bytes, in one process.

    python benchmarks/digest.py                          # 1 GiB (268M float32 values), 1 and all cores
    python benchmarks/digest.py --gib 4 --threads 1 2 4 8 16

Each figure is the median of `--repeats` passes over one buffer that was written once before (resident, no page
faults); `x sha256` is the plain sha256's time over this one's, `x memcpy` this one's time over a copy's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from collections.abc import Callable

import torch

from farloco.protocol.digest import digest


def timed(work: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB")
    cores = len(os.sched_getaffinity(0))
    parser.add_argument("--threads", type=int, nargs="*", default=sorted({1, cores}))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    numel = int(args.gib * (1 << 30)) // 4
    theta = torch.randn(numel)
    other = torch.empty_like(theta)
    data = theta.numpy().data
    torch.set_num_threads(1)
    memcpy = timed(lambda: other.copy_(theta), args.repeats)
    plain = timed(lambda: hashlib.sha256(data).hexdigest(), args.repeats)
    print(
        f"{numel / 1e6:.0f}M float32 values ({numel * 4 / 2**30:.2f} GiB), {cores} cores, load {os.getloadavg()[0]:.1f}"
    )
    print("| what | threads | seconds | ns/param | GB/s | x sha256 | x memcpy |")
    print("|---|---|---|---|---|---|---|")
    rows = [
        ("memcpy (torch copy_, one thread)", 1, memcpy),
        ("sha256, sequential (0.1's outer_hash)", 1, plain),
    ]
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows.append(
            (
                "tree hash (0.2's outer_hash)",
                threads,
                timed(lambda t=threads: digest(data, threads=t), args.repeats),
            )
        )
    for what, threads, seconds in rows:
        print(
            f"| {what} | {threads} | {seconds:.3f} | {seconds / numel * 1e9:.2f} | {numel * 4 / seconds / 1e9:.1f} "
            f"| {plain / seconds:.2f} | {seconds / memcpy:.1f} |"
        )


if __name__ == "__main__":
    main()
