"""Benchmark of the agent's side of one outer round, phase by phase, in ns per parameter and host bytes per
parameter, with a plain memcpy of the same bytes in the same process as the yardstick.

    python benchmarks/round_overhead.py                                   # 128M and 350M, fp32 and int8, every strategy
    python benchmarks/round_overhead.py --params 128e6 --strategy diloco --codec int8 --rounds 5

What runs is the agent's own code (farloco.node.daemon.outer.OuterRound, the hand-off, the strategy and codec), on a
flat theta of `--params` float32 values; the network is left out. Each round, as `RoundRunner._round` does it:

- `read`: the ranks' weights from the shared-memory hand-off (a view; a copy for streaming-diloco, whose ranks
  train on during the exchange);
- `contribution`: pseudo-gradient + error feedback into the reused work buffer, checked finite;
- `encode`: what the exchange does with our own contribution (`encode_decoded` into the transmitted buffer;
  nothing for fp32, whose raw bytes go out as they are);
- `decode+sum`: one peer's contribution of the same length decoded into the mean buffer and summed with ours,
  then halved (a group of two, every value: each member decodes and sums half the vector and decodes the other
  half of the mean, the same count);
- `stage`, `step`, `install`, `hash`: error feedback staged in place, the outer step on theta, the staged state
  swapped in, theta's digest (the sha256 tree hash: protocol/digest.py);

The agent's synchronous loop makes its contribution on demand (`OuterRound.on_demand`), and so
does this benchmark unless `--whole` (the path of an island's node and of run.outer_update delayed/eager):
`contribution` is then the finiteness check, chunk by chunk, with nothing written; `encode` makes each of the
exchange's chunks (1 MiB of float32) as it goes out, encodes it with its decoded values, and sums those with the
peer's decoded chunk already in the mean buffer (`decode+sum` is then only the peer's decode); `stage` makes each
chunk once more and writes the error feedback straight into the state (`install` has nothing to swap).
`--mean-per-round` allocates the mean afresh each round, as an agent whose ranks train on the host does (its
page faults land in `decode+sum`). A sparse codec's contribution is made on demand too: `encode` makes it piece by
piece as the codec chooses each chunk's top values (the payload, small, is all that is kept of it); `decode+sum`
is the exchange's own `sparse_mean` over the two parsed payloads, piece by piece in member order; `stage` makes
each piece once more and subtracts what our payload decodes to there.
- `publish`: what the ranks load next (theta, or the merged weights for streaming-diloco) into the hand-off.

Reported apart, because they do not happen every round: `snapshot` (the copies a donor serves, built on a
joiner's first request) and `checkpoint` (the same copies, written atomically by `save_checkpoint` in a worker
thread every `checkpoint.every_rounds`), and `prefault` (the round's buffers written once, as a joining agent
does before its first round; `--no-prefault` leaves their page faults to the first round, `first_round`).

Memory: the peak of the process's private memory (the kernel's high-water mark VmHWM, reset before the rounds,
less the file-backed and shared pages) above what it held after imports (RssAnon), less the stand-in peer's
payload (a real exchange streams it in chunks), per parameter. The hand-off is shared with a stand-in rank
process that maps it and touches every page, as the trainer ranks do, so it counts as shared, not private. Each configuration runs in a fresh process, with the agent's threads (`--threads`, as
`node.agent_threads` and torch's intra-op threads; default: what a 2-core node with one rank of one thread
leaves the agent, 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

STRATEGIES = ("diloco", "streaming-diloco", "sparseloco", "demo")
PHASES = ("read", "contribution", "encode", "decode+sum", "stage", "step", "install", "hash", "publish")


def _status_kib() -> dict[str, int]:
    """VmHWM, RssAnon, RssFile and RssShmem of /proc/self/status, in KiB."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                found[key] = int(value.split()[0])
    return found


def private_bytes() -> int:
    """This process's anonymous resident memory (RssAnon), in bytes."""
    return _status_kib()["RssAnon"] * 1024


class PeakPrivate:
    """The peak of `private_bytes()` between `start()` and `stop()`, from the kernel's own high-water mark:
    `start` resets VmHWM to the current RSS (/proc/self/clear_refs), `stop` takes VmHWM less the file-backed and
    shared-memory pages, which stay as they were meanwhile (libraries; the hand-off, touched before). No sampling
    thread: reading smaps_rollup takes ~20 ms at a few GB, so a 2 ms sampler kept a core busy and took it from the
    passes it measured (their times with 2 threads were off by up to 2x)."""

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def stop(self) -> int:
        status = _status_kib()
        return (status["VmHWM"] - status["RssFile"] - status["RssShmem"]) * 1024


def _nbytes(payload: Any) -> int:
    return payload.numel() * payload.element_size() if isinstance(payload, torch.Tensor) else len(payload)


def memcpy_ns_per_param(numel: int) -> float:
    """Best of 3 copies of `numel` float32 values between two warm buffers."""
    src, dst = torch.rand(numel), torch.empty(numel)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return best * 1e9 / numel


def one(args: argparse.Namespace) -> dict[str, Any]:
    from farloco.node.checkpoint import save_checkpoint
    from farloco.node.daemon.outer import OuterRound
    from farloco.node.handoff import Handoff
    from farloco.optim import get_codec, make_strategy
    from farloco.optim.strategies import CHUNK, chunks
    from farloco.protocol.exchange import OnDemand
    from farloco.protocol.exchange.reduce import sparse_mean
    from farloco.protocol.tcpstream import tune_malloc

    tune_malloc()  # as the agent does
    # As the agent does (node/daemon/core.py): torch's intra-op threads and the round's passes over `--threads`.
    from farloco.optim import ranges
    from farloco.util import parallel

    torch.set_num_threads(args.threads)
    parallel.set_threads(args.threads)
    ranges.set_range_runner(parallel.map_ranges)
    numel = int(float(args.params))
    baseline = private_bytes()
    codec = get_codec(args.codec)
    hparams: dict[str, Any] = {"lr": 0.7, "momentum": 0.9} if "diloco" in args.strategy else {}
    if "diloco" in args.strategy and args.feedback_fp32:
        hparams["feedback_bf16"] = False
    if args.strategy == "streaming-diloco":
        hparams["num_fragments"] = 4
    strategy = make_strategy(args.strategy, numel, codec, **hparams)
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(numel, generator=generator).mul_(0.02)
    outer = OuterRound(theta, strategy, codec)
    # as the agent's synchronous loop (OuterState)
    outer.on_demand = (bool(codec.dense) or hasattr(codec, "encode_on_demand")) and not args.whole
    outer.mean_per_round = (
        outer.on_demand and args.mean_per_round
    )  # as an agent whose ranks train on the host
    exchange_chunk = (1 << 20) // 4  # the exchange's default chunk_bytes, in float32 values
    handoff = Handoff.create(numel, 1)
    theta = outer.share_with(handoff.theta)  # as the agent does once its hand-off exists
    rank = subprocess.Popen(  # the stand-in rank: maps the hand-off and touches every page, then waits
        [sys.executable, "-c", "import sys, torch\nfrom farloco.node.handoff import Handoff\n"
         "from pathlib import Path\nh = Handoff.attach(Path(sys.argv[1])); h.theta.sum(); h.local.sum(); print('ok', flush=True)\n"
         "sys.stdin.read()", str(handoff.path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    peer_payloads: list[tuple[int, Any]] = []
    scratch = torch.empty(CHUNK)
    try:
        handoff.publish(theta, round_id=0, step_base=0, inner_steps=1)
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ok"
        overlap = args.strategy == "streaming-diloco"
        prefault_s = 0.0
        if args.prefault:  # as a joining agent does on its outer thread, before its first round
            started = time.perf_counter()
            outer.prefault(False)
            prefault_s = time.perf_counter() - started
        # The stand-in peer's contributions, one per length a round can have (fragments differ), made before the
        # peak is measured: they are the benchmark's, not the agent's (a real exchange streams them in chunks),
        # and making one takes a vector of the model's size. Their bytes are taken off the peak below.
        lengths = sorted({f.stop - f.start for f in getattr(strategy, "fragments", [])} or {numel})
        for n in lengths:
            other = torch.randn(n, generator=generator).mul_(1e-3)
            peer_payloads.append((n, other if codec.lossless else codec.encode(other, checksum=False)))
            del other
        payload_bytes = sum(_nbytes(payload) for _, payload in peer_payloads)
        samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
        sampler = PeakPrivate()
        sampler.start()
        for round_index in range(args.rounds):
            # The ranks' inner steps (not timed): local = theta_outer + a small step, chunk by chunk so that the
            # stand-in allocates nothing of the model's size.
            for part in chunks(numel):
                noise = torch.randn(
                    part.stop - part.start, generator=generator, out=scratch[: part.stop - part.start]
                )
                torch.add(handoff.theta[part], noise, alpha=1e-3, out=handoff.local[part])
            n = strategy.contribution_numel()
            timings: dict[str, float] = {}

            def timed(phase: str, started: float, timings: dict[str, float] = timings) -> float:
                now = time.perf_counter()
                timings[phase] = now - started
                return now

            t = time.perf_counter()
            theta_local = outer.read_local(handoff.local, copy=overlap)
            t = timed("read", t)
            contribution = outer.contribution(theta_local)
            t = timed("contribution", t)
            payload = next(p for length, p in peer_payloads if length == n)
            transmitted: Any
            if isinstance(contribution, OnDemand) and not codec.dense:
                # A sparse codec: our payload encoded piece by piece as the contribution is made, then the
                # mean summed piece by piece from the parsed payloads, in member order (the exchange's own
                # sparse_mean), and the error feedback staged from the payload we sent.
                sent = codec.encode_on_demand(n, contribution.fill, checksum=False)
                t = timed("encode", t)
                mean = outer.mean_buffer(n)
                terms = [codec.parse(sent, checksum=False), codec.parse(payload, checksum=False)]
                sparse_mean(None, terms, [1.0, 1.0], mean)
                del terms
                t = timed("decode+sum", t)
                outer.stage(contribution, sent, mean)
                t = timed("stage", t)
            elif isinstance(contribution, OnDemand):
                # The peer's chunks decoded into the mean buffer as they come in; ours made, encoded and
                # summed with them chunk by chunk as the exchange sends them.
                mean = outer.mean_buffer(n)
                if codec.lossless:
                    mean.copy_(payload)
                else:
                    codec.decode(payload, checksum=False, out=mean)
                t = timed("decode+sum", t)
                ranges = tuple((a, min(a + exchange_chunk, n)) for a in range(0, n, exchange_chunk))
                for a, b in ranges:
                    own = contribution.chunk(a, b)
                    if not codec.lossless:
                        own = codec.encode_decoded(own, checksum=False, out=own)[1]
                    mean[a:b].add_(own).mul_(0.5)
                transmitted = None if codec.lossless else ranges
                t = timed("encode", t)
                outer.stage(contribution, transmitted, mean)
                t = timed("stage", t)
            else:
                mean, sent = outer.exchange_buffers(n)
                if codec.lossless:  # raw float32 on the wire: no codec call
                    transmitted = contribution
                else:
                    transmitted = codec.encode_decoded(contribution, checksum=False, out=sent)[1]
                t = timed("encode", t)
                if codec.lossless:
                    torch.add(transmitted, payload, out=mean)
                else:
                    codec.decode(payload, checksum=False, out=mean)
                    mean.add_(transmitted)
                mean.mul_(0.5)
                t = timed("decode+sum", t)
                outer.stage(contribution, transmitted, mean)
                t = timed("stage", t)
            outer.step(mean)
            t = timed("step", t)
            outer.install()
            t = timed("install", t)
            outer.rehash()
            t = timed("hash", t)
            load = outer.merged(handoff.local, handoff.theta)
            handoff.publish(load, round_id=round_index + 1, step_base=0, inner_steps=1)
            timed("publish", t)
            del mean  # as the agent's round drops it (with --mean-per-round, its pages go with it)
            for phase, seconds in timings.items():
                samples[phase].append(seconds)
        peak = sampler.stop()
        # Not every round: a joiner's snapshot, and a checkpoint written from it.
        started = time.perf_counter()
        tensors = outer.snapshot()
        snapshot_s = time.perf_counter() - started
        with tempfile.TemporaryDirectory(dir=args.checkpoint_dir) as root:
            started = time.perf_counter()
            save_checkpoint(
                Path(root), 1, tensors, {"run_hash": "bench", "inner_step": "0", "run_name": "bench"}
            )
            checkpoint_s = time.perf_counter() - started
        del tensors
    finally:
        rank.kill()
        rank.wait()
        handoff.close()
    steady = {phase: statistics.median(values[1:] or values) for phase, values in samples.items()}
    ns = {phase: round(seconds * 1e9 / numel, 2) for phase, seconds in steady.items()}
    return {
        "params": numel,
        "strategy": args.strategy,
        "codec": args.codec,
        "contribution": ("on demand" + (", mean per round" if outer.mean_per_round else ""))
        if outer.on_demand
        else "whole",
        "threads": args.threads,
        "rounds": args.rounds,
        "ns_per_param": ns,
        "round_ns_per_param": round(sum(steady.values()) * 1e9 / numel, 2),
        "first_round_ns_per_param": round(sum(v[0] for v in samples.values()) * 1e9 / numel, 2),
        "prefault_ns_per_param": round(prefault_s * 1e9 / numel, 2),
        "snapshot_ns_per_param": round(snapshot_s * 1e9 / numel, 2),
        "checkpoint_ns_per_param": round(checkpoint_s * 1e9 / numel, 2),
        "memcpy_ns_per_param": round(memcpy_ns_per_param(numel), 2),
        "peak_private_bytes_per_param": round((peak - baseline - payload_bytes) / numel, 2),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    head = [
        "params",
        "strategy",
        "codec",
        "contribution",
        *PHASES,
        "round",
        "memcpy",
        "x memcpy",
        "snapshot",
        "checkpoint",
        "B/param",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        ns = row["ns_per_param"]
        lines.append(
            "| " + " | ".join([
                f"{row['params'] / 1e6:.0f}M", row["strategy"], row["codec"], row.get("contribution", "whole"),
                *(f"{ns[p]:.1f}" for p in PHASES),
                f"**{row['round_ns_per_param']:.1f}**", f"{row['memcpy_ns_per_param']:.2f}",
                f"{row['round_ns_per_param'] / row['memcpy_ns_per_param']:.0f}",
                f"{row['snapshot_ns_per_param']:.1f}", f"{row['checkpoint_ns_per_param']:.1f}",
                f"{row['peak_private_bytes_per_param']:.1f}",
            ]) + " |"
        )  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", nargs="*", default=["128e6", "350e6"], help="parameter counts")
    parser.add_argument("--strategy", nargs="*", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--codec", nargs="*", default=["fp32", "int8"])
    parser.add_argument(
        "--rounds", type=int, default=4, help="rounds per configuration (the first is warm-up)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the agent's threads (node.agent_threads, and torch's intra-op threads)",
    )
    parser.add_argument(
        "--checkpoint-dir", default=None, help="where the checkpoint is written (default: the temp dir)"
    )
    parser.add_argument("--markdown", action="store_true", help="also print a table for BENCHMARKS.md")
    parser.add_argument(
        "--no-prefault",
        dest="prefault",
        action="store_false",
        help="leave the round's buffers to be paged in by the first round (the agent writes them at join)",
    )
    parser.add_argument(
        "--whole",
        action="store_true",
        help="make the contribution whole (an island's node, run.outer_update delayed/eager), not on demand",
    )
    parser.add_argument(
        "--mean-per-round",
        action="store_true",
        help="on demand, a fresh mean each round, freed with it (an agent whose ranks train on the host)",
    )
    parser.add_argument(
        "--feedback-fp32",
        action="store_true",
        help="diloco, streaming-diloco: the error-feedback residual in float32 (feedback_bf16 = false)",
    )
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.params, args.strategy, args.codec = args.params[0], args.strategy[0], args.codec[0]
        print(json.dumps(one(args)), flush=True)
        return
    print(
        f"# load before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, torch {torch.__version__}",
        flush=True,
    )
    rows = []
    for params in args.params:
        for strategy in args.strategy:
            for codec in args.codec:
                command = [
                    sys.executable, __file__, "--one", "--params", params, "--strategy", strategy,
                    "--codec", codec, "--rounds", str(args.rounds), "--threads", str(args.threads),
                ]  # fmt: skip
                if not args.prefault:
                    command.append("--no-prefault")
                if args.whole:
                    command.append("--whole")
                if args.mean_per_round:
                    command.append("--mean-per-round")
                if args.feedback_fp32:
                    command.append("--feedback-fp32")
                if args.checkpoint_dir:
                    command += ["--checkpoint-dir", args.checkpoint_dir]
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    print(json.dumps({"params": params, "strategy": strategy, "codec": codec,
                                      "error": result.stderr.strip().splitlines()[-1:]}), flush=True)  # fmt: skip
                    continue
                row = json.loads(result.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.markdown and rows:
        print(markdown(rows))


if __name__ == "__main__":
    main()
