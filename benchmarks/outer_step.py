"""Benchmark of DiLoCo's two largest per-round passes, as the agent runs them: the contribution ((theta_outer -
theta_local) + residual) and the Nesterov outer step, and DeMo's sign step (theta*(1 - lr*wd) - lr*sign(mean)),
each with the torch ops chunk by chunk (optim's path
without the C kernels) and with the C kernels (one pass, no GIL held), on 1..N of the agent's threads
(farloco.util.parallel), beside a memcpy of theta on as many threads. In one process.

    python benchmarks/outer_step.py                          # 128M parameters, 1 and all cores
    python benchmarks/outer_step.py --params 1e9 --threads 1 4 8 15

Each figure is the median of `--repeats` passes, after one that is not counted, over buffers written once before
(resident, no page faults).
Both paths give the same bits (tests/unit/test_kernels.py); `x torch` is the torch path's time over the kernel's at
the same thread count.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
from digest import timed  # benchmarks/digest.py (this script's folder is on sys.path)

from farloco.optim import dense, get_codec, ranges
from farloco.optim.strategies import DeMo, DiLoCo, _nesterov_step
from farloco.util import parallel


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=128e6)
    cores = len(os.sched_getaffinity(0))
    parser.add_argument("--threads", type=int, nargs="*", default=sorted({1, cores}))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels = dense.KERNELS
    if kernels is None:
        raise SystemExit("the C kernels are not built (pip install -e . with a C compiler)")
    n = int(args.params)
    g = torch.Generator().manual_seed(0)
    theta, local, grad = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g)
    strategy = DiLoCo(n, get_codec("int8"))
    assert strategy.residual is not None
    strategy.residual.normal_(generator=g)
    momentum = torch.randn(n, generator=g)
    demo = DeMo(n, get_codec("fp32"), weight_decay=0.1)
    out, copy = torch.empty(n), torch.empty(n)
    ranges.set_range_runner(parallel.map_ranges)  # as the agent does
    torch.set_num_threads(1)
    print(
        f"{n / 1e6:.0f}M parameters (float32), {cores} cores, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}"
    )
    print("| pass | threads | torch ops (ns/param) | C kernel (ns/param) | x torch | memcpy (ns/param) |")
    print("|---|---|---|---|---|---|")
    passes: dict[str, Callable[[], object]] = {
        "contribution": lambda: strategy.make_contribution(theta, local, out=out),
        "outer step": lambda: _nesterov_step(theta, momentum, grad, 0.7, 0.9),
        "demo sign step": lambda: demo._outer_step(theta, grad),
    }
    for threads in args.threads:
        parallel.set_threads(threads)

        def copy_theta() -> None:
            ranges.run_split(lambda part: copy[part].copy_(theta[part]), n, 8)

        copy_theta()  # every pass runs once before it is timed: the pool's threads started, every page touched
        memcpy = timed(copy_theta, args.repeats)
        for name, work in passes.items():
            dense.KERNELS = None
            work()
            slow = timed(work, args.repeats)
            dense.KERNELS = kernels
            work()
            fast = timed(work, args.repeats)
            print(
                f"| {name} | {threads} | {slow / n * 1e9:.2f} | {fast / n * 1e9:.2f} | {slow / fast:.2f} "
                f"| {memcpy / n * 1e9:.2f} |"
            )


if __name__ == "__main__":
    main()
