"""What one Byzantine member does to training, per aggregator: the held-out loss table in BENCHMARKS.md.

k workers (4, and 8) train the `tiny` built-in model (1.02M parameters) with DiLoCo in one process, the way
benchmarks/convergence.py simulates a swarm (its Setup, Learner, evaluation and bundled pydoc corpus; batch 8 x
128 tokens per worker, AdamW, each worker its own disjoint data slot, its own strategy and error feedback, its
own copy of theta_outer). One worker of the k (the last) is Byzantine: it trains like the others, but from the
first round on it sends `farloco.optim.byzantine_update(attack, ...)` in place of its pseudo-gradient, encoded
with the run's codec like any valid update (what `FARLOCO_FAULTS=byzantine=ATTACK` makes a real node do):

- ``sign_flip_x1000``: its update negated and scaled 1000x;
- ``constant``: every value 50;
- ``noise``: random noise, std 100;
- ``stale``: its update of the round before (its first round: its own).

Aggregation follows the daemon's exchange (protocol/exchange/): the flat vector is cut into k contiguous parts
(one per member) and each part into chunks of 262144 values (`chunk_bytes` 1 MiB), and the chunk's owner applies
`run.aggregator` to every member's decoded copy of the chunk, in member order: the plain mean (the control),
coordinate-wise trimmed mean, coordinate median, norm clipping, CenteredClip (farloco.optim.aggregate); for the
lossy int8 codec the owner re-encodes each chunk's result and everyone uses the decoded bytes. Every worker's
theta_outer must stay bit-identical (checked at each report): "honest peers agree" is part of the result.

The table gives, per (workers, attack, aggregator), the held-out loss of theta_outer at the last step, its change
against the attack-free plain mean of the same k, and the seconds the aggregation itself took per round beside
the plain mean's (the whole exchange's cost of a rule, over gRPC at 64 MiB, is BENCHMARKS.md's "What a robust
aggregator costs the exchange", benchmarks/exchange.py). A run whose theta_outer turns non-finite stops there and
is reported as diverged (a real node stops with an error naming the non-finite parameters).

    .venv/bin/python benchmarks/byzantine.py                    # 4 and 8 workers, 300 steps, H = 10
    .venv/bin/python benchmarks/byzantine.py --workers 4 --steps 100 --attacks sign_flip_x1000
    .venv/bin/python benchmarks/byzantine.py --quick            # a few steps of every code path (smoke run)
    .venv/bin/python benchmarks/byzantine.py --render benchmarks/results/byzantine.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # benchmarks/ (convergence.py), when imported by a test

from convergence import (
    EVAL_BATCH_SIZE,
    SEQ_LEN,
    Learner,
    Setup,
    evaluate,
    flat_parameters,
    load_flat,
    slot_samplers,
)

from farloco.node.training.data import builtin_dataset, eval_batches, open_dataset
from farloco.node.training.model import build_model, model_config, num_parameters
from farloco.optim import AGGREGATORS, ATTACKS, aggregate, byzantine_update, get_codec, make_strategy

CHUNK_ELEMS = (1 << 20) // 4  # the exchange's default chunk_bytes (1 MiB of fp32)
NO_ATTACK = "none"
DILOCO = {"lr": 0.5, "momentum": 0.9}  # the reference's outer optimizer (convergence.py's)


@dataclass
class Row:
    workers: int
    attack: str
    aggregator: str
    loss: float | None = None
    """Held-out loss of theta_outer at the last step (None: diverged)."""
    diverged_at: int | None = None
    """Step at which theta_outer turned non-finite."""
    aggregate_seconds: float = 0.0
    """Mean seconds per round spent in the aggregation rule (all chunks, one owner's view summed)."""
    seconds: float = 0.0
    losses: dict[int, float] = field(default_factory=dict)


def parts(numel: int, members: int) -> list[tuple[int, int]]:
    """The exchange's chunk ranges: k contiguous parts (sizes differ by at most one), each cut into chunks."""
    base, extra = divmod(numel, members)
    ranges = []
    for index in range(members):
        start = index * base + min(index, extra)
        end = start + base + (1 if index < extra else 0)
        ranges.extend((a, min(a + CHUNK_ELEMS, end)) for a in range(start, end, CHUNK_ELEMS))
    return ranges


class Swarm:
    """k simulated workers of one run with one Byzantine member (the last), on `codec`, H = `sync_every`."""

    def __init__(self, setup: Setup, workers: int, codec: str, sync_every: int, cache_dir: Path) -> None:
        self.setup, self.workers, self.codec_name, self.sync_every = setup, workers, codec, sync_every
        dataset = open_dataset(builtin_dataset(cache_dir))
        self.samplers = slot_samplers(dataset, setup.seed, workers)
        self.held_out = eval_batches(dataset, SEQ_LEN, EVAL_BATCH_SIZE, setup.num_eval_batches)
        self.initial = build_model(model_config("tiny", max_seq_len=SEQ_LEN), seed=setup.seed)
        self.num_params = num_parameters(self.initial)

    def run(self, attack: str, aggregator: str, log: Callable[[str], None]) -> Row:
        import copy

        started = time.perf_counter()
        row = Row(self.workers, attack, aggregator)
        k = self.workers
        strategies = [
            make_strategy("diloco", self.num_params, get_codec(self.codec_name), **DILOCO) for _ in range(k)
        ]
        codec = strategies[0].codec
        theta0 = flat_parameters(self.initial)
        thetas = [theta0.clone() for _ in range(k)]
        learners = [Learner(copy.deepcopy(self.initial), self.setup) for _ in range(k)]
        chunks = parts(self.num_params, k)
        stale: torch.Tensor | None = None
        rounds, aggregate_seconds = 0, 0.0
        for step in range(1, self.setup.steps + 1):
            for learner, sampler in zip(learners, self.samplers, strict=True):
                learner.step(step - 1, sampler.batch(step - 1))
            if step % self.sync_every == 0 or step == self.setup.steps:
                locals_ = [flat_parameters(learner.model) for learner in learners]
                contributions = [
                    s.make_contribution(t, x) for s, t, x in zip(strategies, thetas, locals_, strict=True)
                ]
                if not all(bool(torch.isfinite(c).all()) for c in contributions):
                    # The honest workers trained into NaN/Inf from the theta the round before gave them: a node
                    # stops there, naming the non-finite parameters.
                    row.diverged_at = step
                    log(f"  k={k} {attack} {aggregator}: non-finite weights at step {step}: diverged")
                    break
                sent = list(contributions)
                if attack != NO_ATTACK:
                    sent[-1] = byzantine_update(attack, contributions[-1], stale)
                    stale = contributions[-1].clone()
                transmitted = [codec.decode(s.codec.encode(c)) for s, c in zip(strategies, sent, strict=True)]
                averaged = torch.empty_like(theta0)
                clock = time.perf_counter()
                for a, b in chunks:
                    averaged[a:b] = aggregate(aggregator, [t[a:b] for t in transmitted])
                aggregate_seconds += time.perf_counter() - clock
                rounds += 1
                if codec.dense and not codec.lossless:
                    for a, b in chunks:  # each owner re-encodes its chunk's result for the all-gather
                        averaged[a:b] = codec.decode(codec.encode(averaged[a:b].clone()))
                for w, (s, theta, learner) in enumerate(zip(strategies, thetas, learners, strict=True)):
                    s.propose(
                        sent[w], transmitted[w]
                    )  # the Byzantine member's error feedback is that of what it sent
                    s.apply(theta, averaged)
                    s.commit()
                    s.merge_into_local(theta, locals_[w])
                    load_flat(learner.model, locals_[w])
                if any(not torch.equal(thetas[0], theta) for theta in thetas[1:]):
                    raise RuntimeError(
                        f"{k} workers, {attack}, {aggregator}: theta_outer diverged between workers"
                    )
                if not bool(torch.isfinite(thetas[0]).all()):
                    row.diverged_at = step
                    log(f"  k={k} {attack} {aggregator}: theta_outer non-finite at step {step}: diverged")
                    break
            if step in self.setup.report_steps:
                model = copy.deepcopy(self.initial)
                load_flat(model, thetas[0])
                loss = evaluate(model, self.held_out)
                row.losses[step] = loss
                if not math.isfinite(loss):
                    row.diverged_at = step
                    break
                log(f"  k={k} {attack} {aggregator} step {step}: held-out loss {loss:.4f}")
        if row.diverged_at is None:
            row.loss = row.losses[self.setup.steps]
        row.aggregate_seconds = aggregate_seconds / max(1, rounds)
        row.seconds = time.perf_counter() - started
        return row


def table(rows: Sequence[Row]) -> str:
    """Markdown: one block per worker count, a line per attack, a column per aggregator (loss and change)."""
    out = []
    for k in sorted({r.workers for r in rows}):
        mine = [r for r in rows if r.workers == k]
        aggregators = [a for a in AGGREGATORS if any(r.aggregator == a for r in mine)]
        attacks = [a for a in (NO_ATTACK, *ATTACKS) if any(r.attack == a for r in mine)]
        base = next((r.loss for r in mine if r.attack == NO_ATTACK and r.aggregator == "mean"), None)
        out.append(
            f"**1 Byzantine member of {k}** (held-out loss at the last step; change against the "
            f"attack-free mean{f', {base:.3f}' if base is not None else ''})\n"
        )
        out.append("| attack | " + " | ".join(aggregators) + " |")
        out.append("|---|" + "---|" * len(aggregators))
        for attack in attacks:
            cells = []
            for aggregator in aggregators:
                row = next((r for r in mine if r.attack == attack and r.aggregator == aggregator), None)
                if row is None:
                    cells.append("-")
                elif row.loss is None:
                    cells.append(f"diverged (step {row.diverged_at})")
                elif base is None:
                    cells.append(f"{row.loss:.3f}")
                else:
                    cells.append(f"{row.loss:.3f} ({row.loss - base:+.3f})")
            out.append(f"| {attack} | " + " | ".join(cells) + " |")
        cost = {a: [r.aggregate_seconds for r in mine if r.aggregator == a] for a in aggregators}
        mean_cost = sum(cost.get("mean", [0.0])) / max(1, len(cost.get("mean", [])))
        out.append(
            "| aggregation per round (ms; x mean) | "
            + " | ".join(
                f"{1e3 * sum(c) / len(c):.1f} ({(sum(c) / len(c)) / mean_cost:.1f}x)" if mean_cost else "-"
                for c in cost.values()
            )
            + " |"
        )
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[4, 8], help="swarm sizes (one Byzantine each)"
    )
    parser.add_argument(
        "--steps", type=int, default=300, help="inner steps per worker (the fixed step count)"
    )
    parser.add_argument("--sync-every", type=int, default=10, help="H: inner steps per outer round")
    parser.add_argument("--codec", default="int8", help="the exchange's codec (int8, fp32, ...)")
    parser.add_argument("--attacks", nargs="+", default=[NO_ATTACK, *ATTACKS], choices=[NO_ATTACK, *ATTACKS])
    parser.add_argument("--aggregators", nargs="+", default=list(AGGREGATORS), choices=list(AGGREGATORS))
    parser.add_argument("--out", type=Path, help="write the rows as JSON here (and the table beside it, .md)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 workers, 4 steps, H = 2")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "farloco-bench",
        help="tokenized corpus cache",
    )
    parser.add_argument("--render", type=Path, help="print the table of a JSON written by --out, run nothing")
    args = parser.parse_args(argv)
    if args.render is not None:
        data = json.loads(args.render.read_text())
        rows = [Row(**{**r, "losses": {int(s): v for s, v in r["losses"].items()}}) for r in data["rows"]]
        print(table(rows))
        return 0
    if args.quick:
        args.workers, args.steps, args.sync_every = [4], 4, 2
    for k in args.workers:
        if k < 3:
            parser.error(f"--workers: expected at least 3 (a robust rule needs an honest majority), got {k}")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    setup = Setup(steps=args.steps, report_steps=(args.steps,))
    command = "python benchmarks/byzantine.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rows: list[Row] = []

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            payload = {
                "command": command,
                "setup": setup.describe(),
                "codec": args.codec,
                "sync_every": args.sync_every,
                "rows": [asdict(r) for r in rows],
            }
            args.out.write_text(json.dumps(payload, indent=1))
            args.out.with_suffix(".md").write_text(f"`{command}`\n\n{table(rows)}\n")

    for k in args.workers:
        swarm = Swarm(setup, k, args.codec, args.sync_every, args.cache_dir)
        log(
            f"{k} workers, tiny model ({swarm.num_params} parameters), diloco-{args.codec}, H = {args.sync_every}, "
            f"{args.steps} steps; worker {k - 1} Byzantine"
        )
        for attack in args.attacks:
            for aggregator in args.aggregators:
                rows.append(swarm.run(attack, aggregator, log))
                save()
    print(f"`{command}`\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
