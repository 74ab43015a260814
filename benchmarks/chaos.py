"""The chaos table: every scenario of benchmarks/chaos_scenarios.py (or those named), one after the other, each a
fresh local swarm of real `farloco join` processes on 127.0.0.1 (tiny preset, H = 8), and what each fault cost.

    python benchmarks/chaos.py --out benchmarks/results [--scenarios healthy sigkill-exchange ...]
    python benchmarks/chaos.py --out /tmp/discard --scenarios sigstop-straggler --override run.late_work=discard

Writes <out>/chaos.json and <out>/chaos.md (the table RELIABILITY.md carries) and prints the table. Exits 1 if
any scenario broke an invariant or missed its expected outcome."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos_runner import FaultFigures, Outcome, run, verdict
from chaos_scenarios import SCENARIOS


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


SUMMARY_OVER = 4  # a scenario with more faults than this gets one summary line


def row(name: str, outcome: Outcome, problems: list[str], healthy: Outcome | None) -> list[str]:
    scenario = SCENARIOS[name]
    rejected = ", ".join(f"{reason} {int(n)}" for reason, n in sorted(outcome.rejected.items())) or "-"
    if outcome.ignored:  # DHT records the survivors did not believe
        ignored = ", ".join(f"{reason} {int(n)}" for reason, n in sorted(outcome.ignored.items()))
        rejected = f"{rejected}; DHT records ignored: {ignored}"
    loss = "-"
    if outcome.final_loss is not None:
        loss = f"{outcome.final_loss:.3f}"
        if healthy is not None and healthy.final_loss is not None and outcome is not healthy:
            loss += f" ({outcome.final_loss - healthy.final_loss:+.3f})"
    steps = (
        f"{outcome.steps_reached / outcome.steps_trained:.1%}" if outcome.steps_trained > 0 else "-"
    )  # of the inner steps trained in rounds that closed, those in an outer update (run.late_work)
    held = "yes" if not problems else "**no**: " + "; ".join(problems)
    for split in outcome.splits:  # which way a partition went: who committed apart, who took whose state
        sides = " | ".join(",".join(side) for side in split["sides"])
        apart = " | ".join(str(n) for n in split["rounds_apart"])
        met = split["met_again_after_heal_s"]
        held += (
            f" (sides {sides} committed {apart} rounds apart; after the heal "
            f"{', '.join(split['synced_after_heal']) or 'nobody'} took the other side's state, one swarm again "
            f"{'never' if met is None else f'{met:.1f} s after the heal'})"
        )
    lines = []
    faults = scenario.faults or ()
    if not faults:
        lines.append(
            f"| {name} | {scenario.setup} | - | every round commits with all | {held} | - | "
            f"{_seconds(outcome.round_period_s)} | - | 0 / 0 | {rejected} | {loss} | {outcome.memory_growth:+.0%} | {steps} |"
        )
    if len(faults) > SUMMARY_OVER:
        # A long timeline (churn): one line of its figures over all faults.
        def spread(values: list[float]) -> str:
            found = sorted(v for v in values if v is not None)
            if not found:
                return "-"
            return f"median {found[len(found) // 2]:.1f} s, max {found[-1]:.1f} s"

        figures_ = outcome.faults
        lines.append(
            f"| {name} | {scenario.setup} | {len(faults)} faults | every kind handled as in its own row; the "
            f"untouched node trains throughout | {held} | {spread([f.detection_s for f in figures_])} | "
            f"{spread([f.degraded_round_s for f in figures_])} | {spread([f.rejoin_s for f in figures_])} | "
            f"{sum(f.rounds_aborted for f in figures_)} / {sum(f.rounds_missed for f in figures_)} | {rejected} | "
            f"{loss} | {outcome.memory_growth:+.0%} | {steps} |"
        )
        return lines
    for fault, figures in zip(faults, outcome.faults, strict=True):
        lines.append(
            f"| {name} | {scenario.setup} | {fault.name} | {fault.expected} | {held} | "
            f"{_seconds(figures.detection_s)} | {_seconds(figures.degraded_round_s)} | {_seconds(figures.rejoin_s)} | "
            f"{figures.rounds_aborted} / {figures.rounds_missed} | {rejected} | {loss} | {outcome.memory_growth:+.0%} | {steps} |"
        )
    return lines


HEADER = [
    "| scenario | setup | fault | expected | held | detection | degraded round | rejoin | rounds aborted / missed "
    "by the node | refused (survivors, by reason) | held-out loss (vs healthy) | memory growth | inner steps "
    "in an update |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def render(out: Path) -> int:
    """chaos.md from an earlier run's chaos.json (the scenarios' texts as the code has them now)."""
    lines = list(HEADER)
    outcomes: dict[str, Outcome] = {}
    for data in json.loads((out / "chaos.json").read_text()):
        fields = {k: v for k, v in data.items() if k not in ("faults", "problems", "seconds")}
        outcome = Outcome(**fields)
        outcome.faults = [FaultFigures(**f) for f in data["faults"]]
        outcomes[outcome.scenario] = outcome
        lines += row(outcome.scenario, outcome, data["problems"], outcomes.get("healthy"))
    (out / "chaos.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=Path("chaos-results"))
    parser.add_argument(
        "--render", action="store_true", help="only write chaos.md again from <out>/chaos.json (no run)"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config override for every scenario's swarm, after the scenario's own (e.g. run.late_work=discard)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other scenarios of an earlier <out>/chaos.json (its healthy run is the reference)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        return render(args.out)
    work = Path(tempfile.mkdtemp(prefix="farloco-chaos-"))
    outcomes: dict[str, Outcome] = {}
    results: list[dict[str, Any]] = []
    earlier: list[dict[str, Any]] = []
    if args.merge and (args.out / "chaos.json").exists():
        earlier = [
            d
            for d in json.loads((args.out / "chaos.json").read_text())
            if d["scenario"] not in args.scenarios
        ]
        for data in earlier:
            if data["scenario"] == "healthy":
                fields = {k: v for k, v in data.items() if k not in ("faults", "problems", "seconds")}
                outcomes["healthy"] = Outcome(**fields)
    lines = list(HEADER)
    failed = False
    for name in args.scenarios:
        started = time.monotonic()
        scenario = SCENARIOS[name]
        if args.override:
            scenario = dataclasses.replace(scenario, overrides=(*scenario.overrides, *args.override))
        outcome = run(scenario, work / name, progress=lambda line: print(line, flush=True))
        outcomes[name] = outcome
        healthy = outcomes.get("healthy")
        problems = verdict(SCENARIOS[name], outcome, healthy)
        failed = failed or bool(problems)
        lines += row(name, outcome, problems, healthy)
        results.append({**outcome.to_json(), "problems": problems, "seconds": time.monotonic() - started})
        print(f"{name}: {problems if problems else 'held'} ({time.monotonic() - started:.0f} s)", flush=True)
        # Written after every scenario: a table of 30 rows takes 1.5 hours, and nothing of it is lost to a stop.
        (args.out / "chaos.partial.json").write_text(json.dumps([*earlier, *results], indent=1))
    if earlier:
        order = list(SCENARIOS)
        merged = sorted(
            [*earlier, *results], key=lambda d: order.index(d["scenario"]) if d["scenario"] in order else 99
        )
        (args.out / "chaos.json").write_text(json.dumps(merged, indent=1))
        (args.out / "chaos.partial.json").unlink(missing_ok=True)
        render(args.out)
        return 1 if failed else 0
    (args.out / "chaos.json").write_text(json.dumps(results, indent=1))
    (args.out / "chaos.partial.json").unlink(missing_ok=True)
    table = "\n".join(lines)
    (args.out / "chaos.md").write_text(table + "\n")
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
