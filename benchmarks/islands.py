"""Islands against the flat exchange on the same nodes: bytes crossing between islands per round, and round time.

    sudo python benchmarks/islands.py                              # small (9.5M), 2 islands x 2 nodes, 100 Mbit/s
    sudo python benchmarks/islands.py --preset tiny --rate 1gbit --codec int8

Needs root (node/tools/netns.py). Each island is one network namespace (its fast fabric: the namespace's own
addresses, where the island's gloo traffic and its nodes' gRPC between each other stay), and the islands meet
through a hub over uplinks shaped with `tc tbf` to `--rate`: the WAN. Two nodes (`farloco join`, 1 rank each)
per island; the bootstrap on island 1. The same config for both variants but for the island flags:

- **flat**: four swarm members, each exchanging the whole pseudo-gradient with the other three;
- **islands**: `--island` and `--island-endpoint` on each node (run.island_slices 8): each island reduce-scatters
  inside, each node carries its half of the island's mean across the WAN, then an all-gather inside.

Measured once every node committed round `--warmup` (start-up, the DHT and the island rendezvous left out) until
every node committed the last round: the bytes that left each island on its uplink (the namespace's tx counter:
every protocol's real traffic, TCP/IP headers, DHT and gRPC included) per round, summed over the islands, and the
wall time per round. Results go to a JSON file and a markdown table (pasted into BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from wan import tx_bytes  # benchmarks/wan.py: an uplink's tx counter (this script's folder is on sys.path)

ISLANDS = 2
PER_ISLAND = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def committed(peer: Any, round_id: int) -> float | None:
    """When `peer` committed round `round_id` (its round event's time), or None."""
    from farloco.node.tools.demo import read_events

    return next(
        (e["time"] for e in read_events(peer.run_dir) if e["event"] == "round" and e["round_id"] == round_id),
        None,
    )


def run_variant(wan: Any, work: Path, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from farloco.node.tools.demo import demo_config, read_events, start_bootstrap, start_peer, stop_process

    work.mkdir(parents=True)
    config = work / "node.toml"
    overrides = [
        f'run.model="{args.preset}"',
        f'run.codec="{args.codec}"',
        f"run.inner_steps={args.inner_steps}",
        "run.batch_size=4",
        "run.seq_len=128",
        "run.island_slices=8",
        "run.data_slots=4",
        "timeouts.exchange_timeout=120.0",
        "timeouts.match_timeout=60.0",
    ]
    config.write_text(demo_config(args.rounds, overrides))
    processes: list[Any] = []
    peers = []
    try:
        bootstrap, maddr = start_bootstrap(work, host=wan.address(1), prefix=wan.prefix_command(1))
        processes.append(bootstrap)
        for i in range(1, ISLANDS + 1):
            # Chosen here, in the root namespace: any port is free inside a fresh namespace too.
            endpoint = f"{wan.address(i)}:{free_port()}"
            for j in range(PER_ISLAND):
                extra: tuple[str, ...] = ()
                if variant == "islands":
                    extra = (
                        "--island", f"i{i}",
                        "--island-endpoint", endpoint,
                        "--set", f"node.island_size={PER_ISLAND}",
                    )  # fmt: skip
                peer = start_peer(
                    f"i{i}n{j}",
                    work,
                    config,
                    maddr,
                    1,
                    extra,
                    host=wan.address(i),
                    prefix=wan.prefix_command(i),
                )
                peers.append(peer)
                processes.append(peer.process)
        deadline = time.monotonic() + args.timeout
        before: list[int] | None = None
        started = 0.0
        while time.monotonic() < deadline:
            for peer in peers:
                if peer.process.poll() not in (None, 0):
                    raise RuntimeError(f"{peer.name} failed: {peer.log_path.read_text()[-3000:]}")
            if before is None and all(committed(p, args.warmup) for p in peers):
                before = [tx_bytes(wan, i) for i in range(1, ISLANDS + 1)]
                started = time.monotonic()
            if before is not None and all(committed(p, args.rounds) for p in peers):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{variant}: the swarm did not reach round {args.rounds} in {args.timeout}s")
        assert before is not None
        sent = [tx_bytes(wan, i) - b for i, b in zip(range(1, ISLANDS + 1), before, strict=True)]
        elapsed = time.monotonic() - started
    finally:
        stop_process(*processes)
    rounds = args.rounds - args.warmup
    events = {p.name: [e for e in read_events(p.run_dir) if e["event"] == "round"] for p in peers}
    measured = {
        name: [e for e in ev if args.warmup < e["round_id"] <= args.rounds] for name, ev in events.items()
    }
    hashes = {
        r: {e["outer_hash"] for ev in measured.values() for e in ev if e["round_id"] == r}
        for r in range(args.warmup + 1, args.rounds + 1)
    }
    together = sum(
        1
        for r in range(args.warmup + 1, args.rounds + 1)
        if all(
            any(e["round_id"] == r and (e.get("island") or {}).get("size") == PER_ISLAND for e in ev)
            for ev in measured.values()
        )
    )
    full = sum(1 for e in measured[peers[0].name] if len(e["contributors"]) == ISLANDS * PER_ISLAND)
    num_params = next(e["num_params"] for e in read_events(peers[0].run_dir) if e["event"] == "started")
    return {
        "variant": variant,
        "num_params": num_params,
        "rounds": rounds,
        "cross_island_bytes_per_round": sum(sent) / rounds,
        "bytes_per_island_per_round": [s / rounds for s in sent],
        "seconds_per_round": elapsed / rounds,
        "median_round_event_seconds": statistics.median(e["seconds"] for e in measured[peers[0].name]),
        "rounds_with_all_four": full,
        "rounds_islands_together": together,
        "hashes_agree": all(len(h) == 1 for h in hashes.values()),
    }


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    flat = next(r for r in results if r["variant"] == "flat")
    lines = [
        f"{ISLANDS} islands x {PER_ISLAND} nodes, {args.preset} ({flat['num_params'] / 1e6:.2f}M parameters), "
        f"codec {args.codec}, {args.inner_steps} inner steps per round, islands joined by {args.rate} uplinks "
        f"(tc tbf); rounds {args.warmup + 1}-{args.rounds} measured",
        "",
        "| exchange | MB crossing between islands / round | ratio | s / round | ratio | rounds with all 4 | "
        "rounds each island together | hashes agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['variant']} | {r['cross_island_bytes_per_round'] / 1e6:.1f} | "
            f"{r['cross_island_bytes_per_round'] / flat['cross_island_bytes_per_round']:.2f} | "
            f"{r['seconds_per_round']:.2f} | {r['seconds_per_round'] / flat['seconds_per_round']:.2f} | "
            f"{r['rounds_with_all_four']}/{r['rounds']} | {r['rounds_islands_together']}/{r['rounds']} | "
            f"{'yes' if r['hashes_agree'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--codec", default="fp32")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--variants", nargs="+", default=["flat", "islands"])
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/islands.json"))
    args = parser.parse_args()
    from farloco.node.tools.netns import NamespaceWAN, unavailable

    reason = unavailable()
    if reason:
        sys.exit(f"islands benchmark: {reason}")
    import tempfile

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="farloco-islands-"))
    results = []
    load = os.getloadavg()
    with NamespaceWAN(ISLANDS, args.rate) as wan:
        for variant in args.variants:
            result = run_variant(wan, work / variant, variant, args)
            print(json.dumps(result), flush=True)
            results.append(result)
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "load_before": load,
        "load_after": os.getloadavg(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results, args))
    print(f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
