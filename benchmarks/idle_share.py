"""How much of the wall time a node's trainer ranks sit idle waiting for its agent, for each `run.outer_update`.

    python benchmarks/idle_share.py                       # 125m preset (128.4M params), H = 20, int8, 5 rounds
    python benchmarks/idle_share.py --model tiny --rounds 8 --modes sync delayed

One real node per mode (`farloco bootstrap` + `farloco join` on 127.0.0.1, an elastic-launched trainer rank,
the agent's real round): alone, so its group is itself and the network is left out (the target is the ranks'
idle time that the agent's own round causes, not the network's); what is measured is the agent's own work on
the ranks' path. The agent counts, in `ranks_idle_seconds` of its round events, the time between the ranks'
end of a sequence and the publish of their next one; the share is its growth between the first and the last
round event over the wall time between them (the start-up and the first round's ramp excluded). `sync`: the
ranks wait for the whole round (contribution, exchange, outer step, hash); `delayed`: they wait for the round
before the last one only if it outlasted their inner steps, plus the publish of theta; `eager`: also the
contribution and its pass through the codec (the preview needs it).

The inner step is shrunk to what a CPU does at that size (`--batch-size 1 --seq-len 64` by default: ~1-2 s per
step at 128M on one core of this machine kind); a GPU node's steps are shorter, so its share of sync's round is
larger and what the overlap saves matters more. Held-out evaluation and checkpoints are off (they would count as
the ranks' work or the agent's, not as waiting).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from farloco.node.tools.demo import read_events, run_lone_node

MODES = ("sync", "delayed", "eager")


def run_mode(mode: str, work: Path, args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """One node trains `args.rounds` rounds with run.outer_update=`mode`; its round events, summarised."""
    work.mkdir(parents=True)
    config = work / "node.toml"
    config.write_text(
        "\n".join(
            [
                "[run]",
                'name = "idle-share"',
                f'model = "{args.model}"',
                f"inner_steps = {args.inner_steps}",
                f"batch_size = {args.batch_size}",
                f"seq_len = {args.seq_len}",
                f'strategy = "{args.strategy}"',
                f'codec = "{args.codec}"',
                f'outer_update = "{mode}"',
                f"max_rounds = {args.rounds}",
                "[node]",
                "num_ranks = 1",
                "threads_per_rank = 1",
                "eval_batches = 0",
                "[checkpoint]",
                "every_rounds = 0",
                "",
            ]
        )
    )
    events, run_dir = run_lone_node(
        work,
        config,
        1,
        what=f"{mode}, {args.rounds} rounds",
        max_seconds=args.max_seconds,
        on_poll=lambda rounds, elapsed: log(f"  {mode}: round {len(rounds)}/{args.rounds} ({elapsed:.0f} s)"),
    )
    first, last = events[0], events[-1]
    wall = last["time"] - first["time"]
    idle = last["ranks_idle_seconds"] - first["ranks_idle_seconds"]
    spans = len(events) - 1
    return {
        "mode": mode,
        "rounds": len(events),
        "wall_seconds": wall,
        "idle_seconds": idle,
        "idle_share": idle / wall,
        "idle_per_round": idle / spans,
        "round_seconds": sum(e["seconds"] for e in events[1:]) / spans,
        "seconds_per_round": wall / spans,
        "num_params": read_num_params(run_dir),
    }


def read_num_params(run_dir: Path) -> int:
    started = [e for e in read_events(run_dir) if e["event"] == "started"]
    return int(started[0]["num_params"]) if started else 0


def markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    params = results[0]["num_params"] / 1e6 if results else 0.0
    lines = [
        f"One node alone, model {args.model} ({params:.1f}M params), H = {args.inner_steps}, batch "
        f"{args.batch_size} x {args.seq_len} tokens, {args.strategy} {args.codec}, 1 rank of 1 thread + the agent "
        f"on 2 cores, rounds 1..{args.rounds}:",
        "",
        "| run.outer_update | wall s per round | agent's round s | ranks idle s per round | idle share |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['seconds_per_round']:.2f} | {r['round_seconds']:.2f} | "
            f"{r['idle_per_round']:.3f} | {100 * r['idle_share']:.2f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="125m")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--strategy", default="diloco", choices=("diloco", "sparseloco"))
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--max-seconds", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="farloco-idle-") as tmp:
        for mode in args.modes:
            result = run_mode(mode, Path(tmp) / mode, args, log=lambda m: print(m, file=sys.stderr))
            print(json.dumps(result), file=sys.stderr)
            results.append(result)
    print(
        f"Command: `python benchmarks/idle_share.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
    )
    print(markdown(results, args))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
