"""What a node behind NAT costs the swarm: the same swarm with every node public, then with some behind NAT.

    sudo .venv/bin/python benchmarks/nat.py                       # 3 nodes, node 3 behind NAT, 12 rounds each
    sudo .venv/bin/python benchmarks/nat.py --nodes 4 --nat 3 4 --rounds 12 --rate 100mbit

Every node in its own network namespace on one bridge (node/tools/netns.py), its uplink shaped to `--rate`; the
NAT'd ones behind a masquerading router namespace of their own, started with `network.reachability =
"private"`. One `farloco join` per node (tiny preset, diloco-int8, H = 4, TLS as beyond loopback). From the
nodes' round events (the first round left out): the round period (time between commits on node 1), each
node's share of rounds it contributed to, the matchmaking phase of a public and of a NAT'd node, and the
exchange bytes each sent and received per round. A node behind NAT relays nothing through anyone: its bytes
are its own share, sent and received on the connections it opened.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run(nodes: int, nat: tuple[int, ...], rounds: int, rate: str, work: Path) -> dict[str, Any]:
    from farloco.node.tools.demo import demo_config, read_events, start_bootstrap, start_peer, stop_process
    from farloco.node.tools.netns import NamespaceWAN

    config = work / "swarm.toml"
    config.write_text(demo_config(rounds, ["run.inner_steps=4", "node.eval_batches=0"]))
    processes = []
    with NamespaceWAN(nodes, rate, nat=nat) as wan:
        try:
            bootstrap, maddr = start_bootstrap(work, host=wan.address(1), prefix=wan.prefix_command(1))
            processes.append(bootstrap)
            peers = [
                start_peer(
                    f"n{i}",
                    work,
                    config,
                    maddr,
                    1,
                    ["--set", 'network.reachability="private"'] if i in nat else [],
                    host=wan.address(i),
                    prefix=wan.prefix_command(i),
                )
                for i in range(1, nodes + 1)
            ]
            processes += [p.process for p in peers]
            deadline = time.monotonic() + 120 + 20 * rounds
            while any(p.process.poll() is None for p in peers):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the swarm did not finish {rounds} rounds in time")
                time.sleep(0.5)
        finally:
            stop_process(*processes)
    events = {p.name: read_events(p.run_dir) for p in peers}
    ids = {n: next(e["peer_id"] for e in ev if e["event"] == "started") for n, ev in events.items()}
    commits = {n: [e for e in ev if e["event"] == "round" and e["round_id"] > 1] for n, ev in events.items()}
    times = [e["time"] for e in commits["n1"]]
    periods = [b - a for a, b in itertools.pairwise(times)]
    hashes = {(e["round_id"], e["outer_hash"]) for ev in commits.values() for e in ev}
    public = f"n{next(i for i in range(1, nodes + 1) if i not in nat)}"
    row: dict[str, Any] = {
        "nodes": nodes,
        "nat": list(nat),
        "rate": rate,
        "rounds": len(commits["n1"]),
        "period_median_s": round(statistics.median(periods), 3),
        "forked_rounds": len(hashes) - len({r for r, _ in hashes}),
        "contributed": {
            n: sum(ids[n] in e["contributors"] for e in c) / max(1, len(c)) for n, c in commits.items()
        },
        "match_median_s": {
            kind: round(statistics.median(e["phases"]["match"] for e in commits[name]), 3)
            for kind, name in (("public", public), *((("nat", f"n{nat[0]}"),) if nat else ()))
        },
        "exchange_median_s": round(statistics.median(e["phases"]["exchange"] for e in commits[public]), 3),
        "bytes_per_round": {
            n: [round(statistics.median(e[k] for e in c)) for k in ("bytes_sent", "bytes_received")]
            for n, c in commits.items()
        },
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--nat", type=int, nargs="+", default=[3], help="the nodes behind NAT (1-based)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--rate", default="1gbit")
    args = parser.parse_args()
    from farloco.node.tools.netns import nat_unavailable

    reason = nat_unavailable()
    if reason is not None:
        raise SystemExit(f"benchmarks/nat.py: {reason}")
    rows = []
    for nat in ((), tuple(args.nat)):
        with tempfile.TemporaryDirectory(prefix="farloco-nat-") as work:
            row = run(args.nodes, nat, args.rounds, args.rate, Path(work))
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(
        "| nodes behind NAT | round period (median) | vs all public | match, public / NAT'd node | exchange | "
        "rounds each node contributed to | forked rounds |"
    )
    print("|---|---|---|---|---|---|---|")
    base = rows[0]["period_median_s"]
    for r in rows:
        match = " / ".join(f"{v:.2f} s" for v in r["match_median_s"].values())
        shares = ", ".join(f"{n} {v:.0%}" for n, v in r["contributed"].items())
        print(
            f"| {r['nat'] or 'none'} | {r['period_median_s']:.2f} s | {r['period_median_s'] / base:.2f}x | "
            f"{match} | {r['exchange_median_s']:.2f} s | {shares} | {r['forked_rounds']} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
