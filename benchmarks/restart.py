"""Benchmark of a SIGKILLed node coming back: real `farloco join` daemons (agent, DHT child, trainer rank) on
127.0.0.1, the tiny preset, a bootstrap node of their own.

    python benchmarks/restart.py                                  # 2 nodes, 1 and 40 inner steps per round
    python benchmarks/restart.py --peers 3 --inner-steps 1 --after 100 --kills 2

The nodes train together for `--warm` rounds; then the last node's whole session (agent, DHT child, trainer
ranks) gets SIGKILL and is started again at once on the same run directory (same identity, its checkpoints),
as systemd's `Restart=always` would. Reported per kill:

- `synced_s`: from the restart to the node holding the swarm's current round and state (its `synced` event:
  round id and every tensor's sha256 checked against the donor's manifest); `startup_s`: the part of it until the
  process wrote its first event (Python, torch and the DHT starting: not the protocol's doing);
- `back_s`: from the restart to its first committed round whose round id and outer hash equal a survivor's
  (`synced_s` plus the inner steps of the round it joined);
- `share_after`: of the survivors' next `--after` rounds, the fraction whose group held the restarted node,
  and `longest_gap`: the longest run of those rounds without it;
- `forks`: round ids for which two live nodes committed different outer hashes (must be 0).

`round_s` is the median time between two of a survivor's rounds before the kill. The machine's load is printed
first; every node, the bootstrap and their children are stopped at the end, also on error.

`--hivemind WORK` runs the same SIGKILL + restart on two peers of hivemind's own DecentralizedAverager
(benchmarks/matchmaking.py's worker: `WORK` seconds of sleep between steps, `min_matchmaking_time` 2 s), the
reference farloco is compared with. A restarted hivemind peer has a new peer id, so `back_s` is from the restart to its
first step averaged with the survivor, and `share_after` is the share of the survivor's later steps that
averaged with two peers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from farloco.node.tools.demo import (
    PeerProcess,
    demo_config,
    read_events,
    start_bootstrap,
    start_peer,
    stop_process,
)


def rounds(peer: PeerProcess) -> list[dict[str, Any]]:
    return [e for e in read_events(peer.run_dir) if e["event"] == "round"]


def wait(what: str, check: Any, timeout: float, peers: list[PeerProcess]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for peer in peers:
            if peer.process.poll() is not None:
                raise SystemExit(
                    f"{peer.name} exited while waiting for {what}: {peer.log_path.read_text()[-2000:]}"
                )
        if time.monotonic() > deadline:
            raise SystemExit(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)


def peer_id_of(peer: PeerProcess) -> str:
    for event in read_events(peer.run_dir):
        if event["event"] == "started" and event.get("peer_id"):
            return str(event["peer_id"])
    raise SystemExit(f"{peer.name} wrote no started event with its peer id")


def forks(peers: list[PeerProcess]) -> list[int]:
    hashes: dict[int, set[str]] = {}
    for peer in peers:
        for event in rounds(peer):
            hashes.setdefault(event["round_id"], set()).add(event["outer_hash"])
    return sorted(r for r, h in hashes.items() if len(h) > 1)


def in_step(survivor: PeerProcess, again: PeerProcess, since: float) -> dict[str, Any] | None:
    """The restarted node's first round since `since` whose round id and outer hash equal the survivor's."""
    theirs = {e["round_id"]: e["outer_hash"] for e in rounds(survivor)}
    for event in rounds(again):
        if event["time"] >= since and theirs.get(event["round_id"]) == event["outer_hash"]:
            return event
    return None


def kill_and_restart(
    nodes: list[PeerProcess], config: Path, maddr: str, warm: int, after: int
) -> tuple[PeerProcess, dict[str, Any]]:
    """SIGKILL the last node, start it again on its run directory; returns the new process and the figures."""
    survivor, victim = nodes[0], nodes[-1]
    victim_id = peer_id_of(victim)
    times = [e["time"] for e in rounds(survivor)[-warm:]]
    round_s = statistics.median(b - a for a, b in itertools.pairwise(times))
    os.killpg(victim.process.pid, signal.SIGKILL)
    victim.process.wait(timeout=30)
    events_before = len(read_events(victim.run_dir))
    restarted_at = time.time()
    again = start_peer(victim.name, victim.run_dir.parent, config, maddr, 1)
    nodes[-1] = again
    wait(
        "the restarted node in step with the survivor",
        lambda: in_step(survivor, again, restarted_at) is not None,
        300,
        nodes,
    )
    back = in_step(survivor, again, restarted_at)
    assert back is not None
    first_event = read_events(again.run_dir)[events_before]["time"]
    synced = [e["time"] for e in read_events(again.run_dir)[events_before:] if e["event"] == "synced"]
    start_round = back["round_id"]
    wait(
        f"{after} more rounds of the survivor",
        lambda: sum(e["round_id"] > start_round for e in rounds(survivor)) >= after,
        max(600.0, after * round_s * 10),
        nodes,
    )
    later = [e for e in rounds(survivor) if e["round_id"] > start_round][:after]
    with_it = [victim_id in e["group"] for e in later]
    gap = longest = 0
    for present in with_it:
        gap = 0 if present else gap + 1
        longest = max(longest, gap)
    return again, {
        "round_s": round(round_s, 3),
        "startup_s": round(first_event - restarted_at, 1),
        "synced_s": round(synced[0] - restarted_at, 1) if synced else None,
        "back_s": round(back["time"] - restarted_at, 1),
        "share_after": round(sum(with_it) / len(with_it), 4),
        "after_rounds": len(with_it),
        "longest_gap": longest,
        "forks": len(forks(nodes)),
    }


def run_config(
    peers: int, inner_steps: int, warm: int, after: int, kills: int, root: Path
) -> list[dict[str, Any]]:
    config = root / "swarm.toml"
    config.write_text(demo_config(0, [f"run.inner_steps={inner_steps}", "checkpoint.every_rounds=5"]))
    bootstrap, maddr = start_bootstrap(root)
    nodes = [start_peer(f"n{i}", root, config, maddr, 1) for i in range(peers)]
    everyone = list(nodes)
    rows = []
    try:
        wait(
            f"{warm} rounds of all {peers} nodes together",
            lambda: all(sum(len(e["group"]) == peers for e in rounds(n)) >= warm for n in nodes),
            600,
            nodes,
        )
        for kill in range(kills):
            again, figures = kill_and_restart(nodes, config, maddr, warm, after)
            everyone.append(again)
            rows.append({"peers": peers, "inner_steps": inner_steps, "kill": kill + 1, **figures})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_process(*(node.process for node in everyone))
        stop_process(bootstrap)
    return rows


def hivemind_restart(work: float, warm_s: float, after_s: float) -> dict[str, Any]:
    """Two hivemind averager peers; SIGKILL the second after `warm_s`, start a new one at once."""
    import subprocess

    from exchange import read_peer, write_peer  # benchmarks/exchange.py: the stdio protocol of the workers

    script = str(Path(__file__).with_name("matchmaking.py"))

    def worker(rank: int, seconds: float) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, script, "--worker", "hivemind", str(rank), "2", "1000000", str(work)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "BENCH_MAX_SECONDS": str(seconds)},
            start_new_session=True,
        )

    total = warm_s + after_s
    first, second = worker(0, total), worker(1, total)
    procs = [first, second]
    try:
        maddrs = read_peer(first, "hivemind")["maddrs"]
        write_peer(second, {"maddrs": maddrs})
        for proc in (first, second):
            read_peer(proc, "hivemind")  # ready
        start_at = time.time() + 2.0
        for proc in (first, second):
            write_peer(proc, {"start_at": start_at})
        time.sleep(max(0.0, start_at + warm_s - time.time()))
        os.killpg(second.pid, signal.SIGKILL)
        second.wait(timeout=30)
        restarted_at = time.time()
        again = worker(1, max(5.0, start_at + total - restarted_at))
        procs.append(again)
        write_peer(again, {"maddrs": maddrs})
        read_peer(again, "hivemind")
        write_peer(again, {"start_at": time.time()})
        survivor = read_peer(first, "hivemind")["report"]["log"]
        restarted = read_peer(again, "hivemind")["report"]["log"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    both = [e for e in restarted if len(e["members"]) == 2]
    if not both:
        return {"impl": "hivemind", "work_s": work, "back_s": None, "share_after": 0.0}
    back_at = both[0]["known"]
    later = [len(e["members"]) == 2 for e in survivor if e["ready"] > back_at]
    gap = longest = 0
    for present in later:
        gap = 0 if present else gap + 1
        longest = max(longest, gap)
    return {
        "impl": "hivemind",
        "work_s": work,
        "back_s": round(back_at - restarted_at, 1),
        "share_after": round(sum(later) / max(1, len(later)), 4),
        "after_rounds": len(later),
        "longest_gap": longest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, nargs="*", default=[1, 40])
    parser.add_argument("--warm", type=int, default=10, help="rounds all nodes train together before a kill")
    parser.add_argument(
        "--after", type=int, default=0, help="rounds counted after (default 100, 20 at >10 steps)"
    )
    parser.add_argument("--kills", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the nodes' run directories (printed)")
    parser.add_argument("--hivemind", type=float, nargs="*", default=[], help="also hivemind at these WORK s")
    parser.add_argument("--only-hivemind", action="store_true")
    args = parser.parse_args()
    print(f"# load before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores", flush=True)
    for work in args.hivemind:
        warm_s = max(20.0, 10 * work)
        after_s = max(60.0, (100 if work <= 1 else 20) * work)
        print(json.dumps(hivemind_restart(work, warm_s, after_s)), flush=True)
    if args.only_hivemind:
        return
    for steps in args.inner_steps:
        after = args.after or (100 if steps <= 10 else 20)
        root = Path(tempfile.mkdtemp(prefix="farloco-restart-"))
        run_config(args.peers, steps, args.warm, after, args.kills, root)
        if args.keep:
            print(f"# run directories: {root}", flush=True)
        else:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    print(f"# load after: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
