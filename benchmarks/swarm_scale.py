"""Many real nodes on one machine: healthy swarms of 2, 4, 8 and 16 nodes, and 16 nodes through faults (4 of them
SIGKILLed and restarted, 2 joining mid-run), each node the whole daemon (`farloco join`: agent, rank, DHT child,
p2pd) on 127.0.0.1, the tiny preset.

    python benchmarks/swarm_scale.py --markdown                          # 2, 4, 8, 16 healthy, then 16 with faults
    python benchmarks/swarm_scale.py --nodes 4 --rounds 10 --no-faults   # one quick row
    python benchmarks/swarm_scale.py --nodes 16 --rounds 10 --no-faults --group-size 4   # bounded groups
    python benchmarks/swarm_scale.py --nodes --group-size 4 --kill-in exchange   # the kills inside exchanges

Swarms run through benchmarks/chaos_runner.py (the chaos table's harness: its invariants are checked here too: one
outer hash per round among the nodes that committed it, no NaN, no node that no fault touched exiting other than
cleanly, nothing left behind). Figures per row, from the nodes' own round events:

- `rounds`: round ids the swarm committed; `round_s` p50 / p90: the gap between consecutive commits of each node;
- `all live`: the share of (node, round) commits whose contributors hold every *live* node of that round, a node
  being live from its first commit on (at the latest from two rounds' time after its `joined` event), except
  from each fault done to it until its first commit after that fault (a node joining, killed, restarting or
  catching up is not expected), over the whole span from the commit of round r - 1 to that of r + 1; `worst node`: the lowest share of one node (the goal: every node >= 99%);
  `missed`: per node, the commits that left it out while it was live; `never in`: nodes that joined and were in
  no round at all (a row with one does not hold);
- `freeze_ms` p50 / p99: per round, the largest over its members of `freeze_ms` (the round event's time from the
  last member's ready record to the group known there: last ready -> group known by all); `one hop`: the share
  of rounds frozen in one hop;
- `KB/round`: exchange bytes one node sent per round (its round events' `bytes_sent`, aborted attempts
  included); the DHT's own traffic is measured by benchmarks/matchmaking.py;
- `forks`: round ids committed with two outer hashes (must be 0);
- `exchange`: how the commits' means were made (flat; with `--group-size`, rows, or rows then flat where a
  grouped round fell back); `partial_rounds`: rounds in rows whose mean left some contributors out of a slice
  (a carrier lost), `withheld_commits` / `withheld_share`: the commits (and share of the contributions' values)
  whose node's own values reached no mean there, kept whole by its error feedback for its next round.

Timeouts are the loopback demo's (node/tools/demo.py) widened for many processes on few cores: `--member-ttl`
(default 15 s) and `--heartbeat` (default 2 s), match_timeout 60 s, isolation_timeout 60 s. Each node runs
`--inner-steps` (default 8) inner steps a round.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from chaos_runner import Fault, Scenario, run, verdict

from farloco.node.tools.demo import read_events


def overrides(args: argparse.Namespace, nodes: int) -> tuple[str, ...]:
    return (
        f"run.data_slots={max(8, nodes)}",  # node i asks for data slot i
        f"timeouts.member_ttl={args.member_ttl}",
        f"timeouts.heartbeat_interval={args.heartbeat}",
        "timeouts.match_timeout=60.0",
        "timeouts.isolation_timeout=60.0",
        f"run.inner_steps={args.inner_steps}",
        'run.codec="int8"',
        f"run.exchange_group_size={args.group_size}",
    )


def healthy(nodes: int, args: argparse.Namespace) -> Scenario:
    return Scenario(
        f"healthy-{nodes}",
        f"{nodes} nodes, {args.rounds} rounds, nothing goes wrong",
        peers=nodes,
        rounds=args.rounds,
        overrides=overrides(args, nodes),
        timeout=args.timeout,
    )


def with_faults(args: argparse.Namespace) -> Scenario:
    """16 nodes: nodes 3, 7, 11 and 13 SIGKILLed (ranks and DHT child with them) at rounds 4, 8, 12 and 16 and
    restarted 1 s later from their checkpoints; nodes 14 and 15 join at rounds 6 and 10. The kills come from
    outside once the swarm committed the round before (they fall wherever the node is then), or, with
    `--kill-in exchange`, from the node itself `--kill-offset` seconds into that round's exchange (the chaos
    fault crash@exchange)."""
    kills = tuple(
        Fault(
            f"SIGKILL node {peer} at round {at}",
            peer,
            at,
            signal="sigkill",
            restart_after=1.0,
            checks=("back",),
        )
        if args.kill_in == "between"
        else Fault(
            f"SIGKILL node {peer} {args.kill_offset:g} s into its round-{at} exchange",
            peer,
            at,
            plan=f"crash@exchange+{args.kill_offset:g}:{at}",
            restart_after=1.0,
            checks=("back",),
        )
        for peer, at in ((3, 4), (7, 8), (11, 12), (13, 16))
    )
    joins = tuple(
        Fault(f"node {peer} joins at round {at}", peer, at, signal="join", checks=("back",))
        for peer, at in ((14, 6), (15, 10))
    )
    return Scenario(
        "faults-16",
        "16 nodes: 4 SIGKILLed and restarted, 2 join mid-run",
        (*kills, *joins),
        peers=16,
        rounds=max(args.rounds, 24),
        late_peers=(14, 15),
        overrides=overrides(args, 16),
        timeout=args.timeout,
    )


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# A node that joined is expected in the rounds from this many rounds' time after its `joined` event, if it was in
# none before: its ranks start and it catches up first (a node that never gets in is then counted as missed).
JOIN_GRACE_ROUNDS = 2


def down_intervals(
    work: Path, nodes: int, faults: list[tuple[int, float]]
) -> dict[int, list[tuple[float, float]]]:
    """Per node, when it was not a live member: until `JOIN_GRACE_ROUNDS` rounds after it joined (a joiner's
    ranks start and it catches up first) or its first round committed, whichever is first; and from each fault
    done to it (`faults`: (node, when)) until its first round committed after it (for ever if none)."""
    down: dict[int, list[tuple[float, float]]] = defaultdict(list)
    logs = {index: read_events(work / f"p{index}") for index in range(nodes)}
    stamps = sorted(float(e["time"]) for log in logs.values() for e in log if e["event"] == "round")
    period = (
        statistics.median(b - a for a, b in itertools.pairwise(stamps)) * nodes if len(stamps) > 1 else 0.0
    )
    for index, log in logs.items():
        commits = sorted(float(e["time"]) for e in log if e["event"] == "round")
        joined = [float(e["time"]) for e in log if e["event"] == "joined"]
        grace = joined[0] + JOIN_GRACE_ROUNDS * period if joined else math.inf
        down[index].append((-math.inf, min(commits[0] if commits else math.inf, grace)))
        starts = sorted(float(e["time"]) for e in log if e["event"] == "started")
        for node, at in faults:
            if node == index:
                # A node started again after the fault is back at its first commit after that start.
                since = next((t for t in starts if t > at), at)
                back = next((t for t in commits if t > since), math.inf)
                down[index].append((at, back))
    return down


def figures(work: Path, nodes: int, faults: list[tuple[int, float]]) -> dict[str, Any]:
    """The row's figures from every node's round events (see the module docstring)."""
    events = {i: [e for e in read_events(work / f"p{i}") if e["event"] == "round"] for i in range(nodes)}
    hashes: dict[int, set[str]] = defaultdict(set)
    times: dict[int, list[float]] = defaultdict(list)  # round id -> when its members committed it
    freeze: dict[int, list[float]] = defaultdict(list)
    one_hop: dict[int, bool] = {}
    gaps: list[float] = []
    sent: list[int] = []
    for rounds in events.values():
        for event in rounds:
            r = event["round_id"]
            hashes[r].add(event["outer_hash"])
            times[r].append(float(event["time"]))
            sent.append(int(event.get("bytes_sent", 0)))
            if event.get("freeze_ms") is not None:
                freeze[r].append(float(event["freeze_ms"]))
            one_hop[r] = one_hop.get(r, False) or bool(event.get("one_hop"))
        stamps = [float(e["time"]) for e in rounds]
        gaps += [b - a for a, b in itertools.pairwise(stamps)]
    at = {r: statistics.median(t) for r, t in times.items()}
    peer_of = _peer_ids(work, nodes)
    down = down_intervals(work, nodes, faults)

    def live(r: int) -> set[int]:
        """Nodes live from the commit of round r - 1 to that of r + 1 (the first and last rounds: their own)."""
        lo, hi = at.get(r - 1, at[r]), at.get(r + 1, at[r])
        return {j for j in range(nodes) if not any(a <= hi and lo <= b for a, b in down[j])}

    all_live = total = 0
    worst: dict[int, list[bool]] = defaultdict(list)
    missed: Counter[int] = Counter()
    for index, rounds in events.items():
        for event in rounds:
            present = {peer_of.get(p) for p in event.get("contributors", [])}
            absent = live(event["round_id"]) - present
            missed.update(absent)
            all_live += not absent
            total += 1
            worst[index].append(not absent)
    shares = [sum(v) / len(v) for v in worst.values() if v]
    # Nodes that joined and were in no round at all (never live by the rule above, yet running).
    never_in = [
        f"p{j}"
        for j in range(nodes)
        if not events[j] and any(e["event"] == "joined" for e in read_events(work / f"p{j}"))
    ]
    per_round_freeze = [max(v) for v in freeze.values() if v]
    return {
        "nodes": nodes,
        "rounds": len(hashes),
        "round_s_p50": _percentile(gaps, 0.5),
        "round_s_p90": _percentile(gaps, 0.9),
        "all_live_share": all_live / total if total else None,
        "worst_node_share": min(shares) if shares else None,
        # node -> commits (of others) that missed it while it was live
        "missed": {f"p{j}": n for j, n in sorted(missed.items())},
        "never_in": never_in,
        "freeze_ms_p50": _percentile(per_round_freeze, 0.5),
        "freeze_ms_p99": _percentile(per_round_freeze, 0.99),
        "one_hop_share": sum(one_hop.values()) / len(one_hop) if one_hop else None,
        "kb_per_round": statistics.mean(sent) / 1000 if sent else None,
        "forks": sorted(r for r, h in hashes.items() if len(h) > 1),
        # how the commits' means were made (round events' `exchange`): flat, rows, rows then flat
        "exchange": dict(Counter(str(e.get("exchange", "?")) for rounds in events.values() for e in rounds)),
        # rows: the rounds whose mean left some contributors out of some slices (a carrier lost)
        "partial_rounds": sorted(
            {e["round_id"] for rounds in events.values() for e in rounds if e.get("partial")}
        ),
        # ... and of the contributions' values, the share in no mean (round events' `withheld` over `synced`):
        # what the partial members' error feedback carried to their next round
        "withheld_commits": sum(bool(e.get("withheld")) for rounds in events.values() for e in rounds),
        "withheld_share": _withheld_share([e for rounds in events.values() for e in rounds]),
    }


def _withheld_share(commits: list[dict[str, Any]]) -> float | None:
    values = sum(int(e["synced"][1]) - int(e["synced"][0]) for e in commits if e.get("synced"))
    return sum(int(e.get("withheld") or 0) for e in commits) / values if values else None


def _peer_ids(work: Path, nodes: int) -> dict[str, int]:
    """peer id -> node index, from each node's events (any event naming its own peer id)."""
    found: dict[str, int] = {}
    for index in range(nodes):
        for event in read_events(work / f"p{index}"):
            peer = event.get("peer_id")
            if isinstance(peer, str) and peer:
                found[peer] = index
                break
    return found


def markdown(rows: list[dict[str, Any]]) -> str:
    def f(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        "| swarm | nodes | rounds | round_s p50 / p90 | all live | worst node | freeze_ms p50 / p99 | one hop | "
        "never in | KB/round | forks | held |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['scenario']} | {row['nodes']} | {row['rounds']} | {f(row['round_s_p50'], '.1f')} / "
            f"{f(row['round_s_p90'], '.1f')} | {f(row['all_live_share'], '.1%')} | {f(row['worst_node_share'], '.1%')} | "
            f"{f(row['freeze_ms_p50'], '.0f')} / {f(row['freeze_ms_p99'], '.0f')} | {f(row['one_hop_share'], '.0%')} | "
            f"{len(row['never_in'])} | {f(row['kb_per_round'], '.1f')} | {len(row['forks'])} | "
            f"{'yes' if not (row['problems'] or row['never_in'] or row['forks']) else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--member-ttl", type=float, default=15.0)
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=2400.0, help="seconds each swarm may take")
    parser.add_argument(
        "--no-faults", dest="faults", action="store_false", help="leave the 16-node fault row out"
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="run.exchange_group_size: the exchange in rows and columns of at most this many (0: flat)",
    )
    parser.add_argument(
        "--kill-in",
        choices=("between", "exchange"),
        default="between",
        help="the fault row's SIGKILLs: from outside after a round (between), or inside a round's exchange",
    )
    parser.add_argument(
        "--kill-offset", type=float, default=0.2, help="with --kill-in exchange: seconds into the exchange"
    )
    parser.add_argument("--out", type=Path, default=None, help="keep the swarms' directories here")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    print(f"# load before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores", flush=True)
    scenarios = [healthy(n, args) for n in args.nodes] + ([with_faults(args)] if args.faults else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="farloco-scale-") as tmp:
        root = args.out or Path(tmp)
        for scenario in scenarios:
            work = root / scenario.name
            started = time.monotonic()
            outcome = run(
                scenario, work, progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True)
            )
            done = [
                (fault.peer, figure.at)
                for fault, figure in zip(scenario.faults, outcome.faults, strict=True)
                if fault.signal != "join" and figure.at is not None
            ]
            row = {
                "scenario": scenario.name,
                **figures(work, scenario.peers, done),
                "seconds": round(time.monotonic() - started, 1),
                "load": round(os.getloadavg()[0], 2),
                "problems": verdict(scenario, outcome),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.markdown:
        print(markdown(rows))
    sys.exit(1 if any(row["problems"] or row["forks"] or row["never_in"] for row in rows) else 0)


if __name__ == "__main__":
    main()
