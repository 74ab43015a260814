"""Benchmark of round matchmaking: farloco's DHTMatchmaker (ready and group messages over the links to the
members, the DHT in the background, the adaptive straggler wait) against hivemind's DecentralizedAverager matchmaking, the
same number of peers on 127.0.0.1, each peer in its own process.

    python benchmarks/matchmaking.py                         # 2, 4, 8 peers; rounds of ~0.1 s and ~1 s of work
    python benchmarks/matchmaking.py --peers 4 --work 0.1 --rounds 300 --impl farloco
    python benchmarks/matchmaking.py --peers 4 --work 0.1 1.0 --hog              # a busy process on every core
    python benchmarks/matchmaking.py --peers 4 --work 0.1 1.0 --netns 100mbit    # a namespace per peer (root)

Every round each peer "works" for `work` seconds (uniform +-20%: peers are never exactly in step), then forms its
round's group and averages a 4 KiB tensor with it (a farloco peer late for a round then goes on with the newest
round another peer announced, as a node takes the swarm's state and joins its round): farloco runs `DHTMatchmaker.form_group` then
`Exchange.average` (what the daemon runs, minus the trainer ranks); hivemind runs `DecentralizedAverager.step`
(its own matchmaking and all-reduce; `target_group_size` = all peers, `min_matchmaking_time` = 2 s, as
farloco's `match_timeout_min`). Reported per configuration:

- `all_share`: fraction of rounds whose group held every peer (goal >= 99.5%);
- `longest_gap_rounds` / `longest_gap_s`: the longest run of consecutive rounds one peer spent outside the group;
- `match_p50_ms` / `match_p99_ms`: from the last member ready to the group known by all its members
  (farloco: max over members of group-known time minus max over members of ready time; hivemind: the same with
  the step's start and end, matchmaking and its 4 KiB all-reduce together);
- `split_rounds`: round ids in which two different groups formed (farloco only: hivemind's steps carry no id);
- `one_hop_share`, `push_first_p50_ms`, `push_last_p50_ms` (farloco only): the share of rounds frozen in one hop,
  and when the last member's pushed ready record was filed at the first and at the last other member, after it
  was ready (where the freeze's milliseconds go), and `filed_to_known_p50_ms` / `_p90_ms`, at a member that had
  every other member's ready record pushed, from the last of them filed to the group known there; `--no-ready-dht-copy` keeps ready records out of the DHT, an
  unsafe ablation that shows what their stores cost the freeze; `--no-links` sends the round's messages as gRPC
  calls instead of on the kept-open links (protocol/links.py), and `--dht-niceness N` schedules farloco's DHT
  child and p2pd N below the worker (default: the daemon's `network.dht_niceness`), for A/Bs in one window;
- `p2pd_bytes_per_round`: bytes each peer's libp2p daemon sent per round (farloco: its DHT traffic, since its
  round messages and exchange go over its own links, gRPC and data plane; hivemind: all of its traffic, matchmaking and
  all-reduce included).

`--netns RATE` puts each peer in a network namespace of its own (farloco.node.tools.netns: a bridge, both directions of
every link shaped by `tc tbf`; no added delay, since this kernel has no netem).

Peers talk to the driver through stdin/stdout JSON only; nothing is pickled across processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

import torch
from exchange import read_peer, receive, send, write_peer  # benchmarks/exchange.py: the same stdio protocol

from farloco.node.tools import netns
from farloco.node.tools.netns import NamespaceWAN

RUN = "bench-mm"
NUMEL = 1024  # 4 KiB of fp32: the exchange is a formality, the matchmaking is measured
# Each run stops starting rounds after this long (hivemind's failed steps take seconds each); the rounds every
# peer reached are the ones counted.
MAX_SECONDS = float(os.environ.get("BENCH_MAX_SECONDS", "150"))


# -- peer workers -------------------------------------------------------------------------------------------


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def p2pd_bytes_sent(pids: set[int] | None = None) -> int:
    """Bytes the libp2p daemons `pids` (default: this peer's p2pd, hivemind's DHT transport) have sent on their
    open TCP connections.

    farloco's own round traffic goes over its gRPC and TCP sockets, never through p2pd, so for a farloco peer this
    is its DHT traffic (member records, heartbeats, matchmaking fallbacks); a hivemind peer's averager sends all
    of its matchmaking and all-reduce through p2pd too. Read with `ss -tinp` in this peer's network namespace;
    connections closed in between are not counted (libp2p keeps its connections open).
    """
    if pids is None:
        pids = {pid for pid in _descendants(os.getpid()) if _comm(pid) == "p2pd"}
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    total, owned = 0, False
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):  # a socket line; its details follow on the next line
            owned = any(f"pid={pid}," in line for pid in pids)
        elif owned:
            for field in line.split():
                if field.startswith("bytes_sent:"):
                    total += int(field.split(":", 1)[1])
    return total


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def worker_farloco(rank: int, peers: int, rounds: int, work: float, host: str) -> dict[str, Any]:
    from farloco.node.daemon.dhtnode import make_dht
    from farloco.optim.registry import get_codec
    from farloco.protocol.auth import Authenticator
    from farloco.protocol.exchange import Exchange, ExchangeAborted
    from farloco.protocol.matchmaking import DHTMatchmaker, LateForRound, MatchmakingError
    from farloco.protocol.membership import (
        DHTMembership,
        HeartbeatPacer,
        MemberRecord,
        make_record_validators,
    )
    from farloco.protocol.rpc import RpcClient, RpcServer
    from farloco.protocol.types import GroupMember

    no_ready_copy = bool(os.environ.get("BENCH_NO_READY_DHT_COPY"))
    no_links = bool(os.environ.get("BENCH_NO_LINKS"))

    class TimedMatchmaker(DHTMatchmaker):
        """The daemon's driver, plus the time each pushed ready record was filed here; with
        --no-ready-dht-copy, an ablation that keeps our ready record out of the DHT (unsafe: measurement only)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.arrivals: dict[tuple[int, str], float] = {}
            self.over_links = not no_links

        async def _on_ready(self, ctx: Any, frame: Any) -> Any:
            answer = await super()._on_ready(ctx, frame)
            self.arrivals[ctx.round_id, ctx.sender] = time.time()
            return answer

        async def _store_ready(self, key: str, mine: Any, expiration: float) -> bool:
            return True if no_ready_copy else await super()._store_ready(key, mine, expiration)

    initial = [] if rank == 0 else receive()["maddrs"]
    dht = make_dht(
        host_maddrs=[f"/ip4/{host}/tcp/0"],
        initial_peers=initial,
        record_validators=make_record_validators(RUN),
        niceness=int(os.environ["BENCH_DHT_NICENESS"]),  # the daemon's network.dht_niceness unless told
        start=True,
    )
    if rank == 0:
        send({"maddrs": [str(m) for m in dht.get_visible_maddrs()]})
    peer_id = dht.peer_id.to_base58()
    rng = random.Random(rank)

    async def main() -> dict[str, Any]:
        auth = Authenticator(f"{RUN}:h", b"bench-secret", peer_id)
        server, client = (
            RpcServer(auth, host=host, data_port=0),
            RpcClient(auth),
        )  # as the daemon: a data plane
        exchange = Exchange(server, client, peer_id)
        # as the agent's: records stored near the members key, the table read every member_ttl/4
        membership = DHTMembership(
            dht, RUN, "h", {}, ttl=8.0, heartbeat_interval=1.0, auth=auth, replan_every=8.0
        )
        pacer = HeartbeatPacer(1.0, 8.0)
        matchmaker = TimedMatchmaker(dht, RUN, membership, server=server, client=client)
        address = await server.start()
        me = GroupMember(peer_id, address)
        state = {"round": 0}

        def record() -> MemberRecord:
            return MemberRecord(
                peer_id=peer_id, address=address, state="training", round_id=state["round"], inner_step=0,
                slot=rank, run_hash="h", run_config={}, outer_hash="", loss=0.0, heartbeat=0.0, maddrs=(),
                version="bench",
            )  # fmt: skip

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(1.0)
                try:
                    await membership.publish(record(), retry_seconds=0.0)
                    if pacer.read_due(time.monotonic()):
                        await membership.refresh()
                except Exception:
                    pass

        await membership.publish(record())
        # Heartbeats from the start: with many peers on few cores the table fills more slowly than a record's
        # TTL (8 s), and a record published once would expire before the last peer saw it.
        beats = asyncio.create_task(heartbeat())
        await fill_table(membership, peers, rank)
        codec = get_codec("fp32")
        tensor = torch.full((NUMEL,), float(rank))
        log: list[dict[str, Any]] = []
        # a shared start: every peer begins round 0 at the same wall-clock second
        send({"ready": True})
        start_at = receive()["start_at"]
        await asyncio.sleep(max(0.0, start_at - time.time()))
        dht_sent = p2pd_bytes_sent()
        try:
            round_id = 0
            while round_id < rounds:
                if time.time() > start_at + MAX_SECONDS:
                    break
                state["round"] = round_id
                matchmaker.announce(round_id, peer_id)
                await asyncio.sleep(work * rng.uniform(0.8, 1.2))
                ready_at = time.time()
                entry: dict[str, Any] = {"round": round_id, "ready": ready_at}
                try:
                    group = await matchmaker.form_group(
                        round_id, me, match_timeout=30.0, leader_timeout=5.0, match_timeout_min=2.0
                    )
                    entry.update(
                        known=time.time(), group=group.group_id, members=[m.peer_id for m in group.members]
                    )
                    entry["one_hop"] = matchmaker.last_one_hop
                    # when each member's pushed ready record was filed here (the freeze's breakdown)
                    entry["arrivals"] = {
                        p: t for (r, p), t in matchmaker.arrivals.items() if r == round_id
                    }  # fmt: skip
                    matchmaker.arrivals = {k: t for k, t in matchmaker.arrivals.items() if k[0] > round_id}
                    if len(group.members) > 1:
                        result = await exchange.average(group, tensor, codec, timeout=60.0)
                        entry["contributors"] = list(result.contributors)
                    else:
                        entry["contributors"] = [peer_id]
                except LateForRound as exc:
                    entry.update(late=exc.reason)
                except (MatchmakingError, ExchangeAborted) as exc:
                    entry.update(failed=str(exc))
                log.append(entry)
                # Late, a node fetches the swarm's state and joins the swarm's round (the rounds between are
                # rounds it was not in); here: the newest round a peer announced.
                late = "late" in entry
                round_id = max(round_id + 1, matchmaker.newest_announced()) if late else round_id + 1
            dht_sent = p2pd_bytes_sent() - dht_sent
        finally:
            beats.cancel()
            await matchmaker.close()
            await server.stop(0.5)
        return {"peer": peer_id, "log": log, "wait": matchmaker.last_wait, "p2pd_sent": dht_sent}

    try:
        return asyncio.run(main())
    finally:
        dht.shutdown()


def worker_hivemind(rank: int, peers: int, rounds: int, work: float, host: str) -> dict[str, Any]:
    import hivemind

    from farloco.node.daemon.dhtnode import make_dht

    initial = [] if rank == 0 else receive()["maddrs"]
    dht = make_dht(host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=initial, start=True)
    if rank == 0:
        send({"maddrs": [str(m) for m in dht.get_visible_maddrs()]})
    peer_id = dht.peer_id.to_base58()
    rng = random.Random(rank)
    averager = hivemind.averaging.DecentralizedAverager(
        [torch.full((NUMEL,), float(rank))],
        dht,
        prefix=RUN,
        target_group_size=peers,
        min_group_size=2,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        start=True,
    )
    log: list[dict[str, Any]] = []
    try:
        send({"ready": True})
        start_at = receive()["start_at"]
        time.sleep(max(0.0, start_at - time.time()))
        p2pd_sent = p2pd_bytes_sent()
        for round_id in range(rounds):
            if time.time() > start_at + MAX_SECONDS:
                break
            time.sleep(work * rng.uniform(0.8, 1.2))
            ready_at = time.time()
            entry: dict[str, Any] = {"round": round_id, "ready": ready_at}
            control = averager.step(timeout=20.0, wait=False)
            try:
                # Bounded here: hivemind's own timeout did not end a step whose partner had left (seen: a step
                # waiting for ever after the other peer finished its rounds).
                gathered = control.result(timeout=30.0)
            except Exception as exc:  # a failed or hung step is a round outside any group
                control.cancel()
                gathered = None
                entry["failed"] = (str(exc) or type(exc).__name__)[:200]
            entry["known"] = time.time()
            entry["members"] = sorted(str(p) for p in gathered) if gathered else [peer_id]
            log.append(entry)
        p2pd_sent = p2pd_bytes_sent() - p2pd_sent
    finally:
        averager.shutdown()
        dht.shutdown()
    return {"peer": peer_id, "log": log, "p2pd_sent": p2pd_sent}


def worker_main(argv: list[str]) -> None:
    impl, rank, peers, rounds, work, host = argv
    if os.environ.get("BENCH_LOG"):  # the matchmaker's decisions on stderr, stamped
        import logging

        logging.basicConfig(level=logging.INFO, format=f"%(created).3f p{rank} %(name)s %(message)s")
    torch.set_num_threads(1)
    run = worker_farloco if impl == "farloco" else worker_hivemind
    send({"report": run(int(rank), int(peers), int(rounds), float(work), host)})


# -- the driver ---------------------------------------------------------------------------------------------


def summarize(reports: list[dict[str, Any]], peers: int, work: float) -> dict[str, Any]:
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    # rounds every peer got to (a peer late for a round skips to the swarm's: no entry for the rounds between)
    reached = min(max((e["round"] for e in report["log"]), default=-1) for report in reports)
    for report in reports:
        for entry in report["log"]:
            if entry["round"] <= reached:
                by_round.setdefault(entry["round"], {})[report["peer"]] = entry
    everyone = {report["peer"] for report in reports}
    full, splits, latencies = 0, 0, []
    one_hop: list[bool] = []
    push_first: list[float] = []
    push_last: list[float] = []
    filed_to_known: list[float] = []
    outside: dict[str, int] = dict.fromkeys(everyone, 0)
    longest = 0
    for _, entries in sorted(by_round.items()):
        groups = {tuple(e["members"]) for e in entries.values() if "members" in e and len(e["members"]) > 1}
        if len({e.get("group") for e in entries.values() if e.get("group")}) > 1:
            splits += 1
        biggest = max(groups, key=len, default=())
        # every peer in the group and in every contributor set, and none of them failed or late there (a member
        # whose own exchange failed after the others' committed counts as out)
        if set(biggest) == everyone and all(
            set(e.get("contributors", e.get("members", ()))) == everyone
            and "late" not in e
            and "failed" not in e
            for e in entries.values()
        ):
            full += 1
        for peer in everyone:
            entry = entries.get(peer, {})
            if peer in biggest and "late" not in entry and "failed" not in entry:
                outside[peer] = 0
            else:
                outside[peer] += 1
                longest = max(longest, outside[peer])
        members = [entries[p] for p in biggest if p in entries and "known" in entries[p]]
        if len(members) == len(biggest) and members:
            latencies.append(max(e["known"] for e in members) - max(e["ready"] for e in members))
            if all("one_hop" in e for e in members):  # farloco's
                one_hop.append(all(e["one_hop"] for e in members))
            # the last member ready: when its pushed record was filed at the first and at the last other member
            last = max(biggest, key=lambda p: entries[p]["ready"])
            filed = [entries[p]["arrivals"][last] for p in biggest if last in entries[p].get("arrivals", {})]
            if len(filed) == len(biggest) - 1 and filed:
                push_first.append(min(filed) - entries[last]["ready"])
                push_last.append(max(filed) - entries[last]["ready"])
            # at each member that had every other member's ready record pushed: from the last one filed to the
            # group known there (its event loop's turn and the decision)
            for p in biggest:
                got = entries[p].get("arrivals", {})
                if len(got) == len(biggest) - 1 and "known" in entries[p]:
                    filed_to_known.append(entries[p]["known"] - max(max(got.values()), entries[p]["ready"]))
    latencies.sort()

    def q(p: float, values: list[float] = latencies) -> float | None:
        values = sorted(values)
        return round(1000 * values[min(len(values) - 1, int(p * len(values)))], 1) if values else None

    return {
        "rounds": len(by_round),
        "all_share": round(full / max(1, len(by_round)), 4),
        "longest_gap_rounds": longest,
        "longest_gap_s": round(longest * work, 1),
        "match_p50_ms": q(0.5),
        "match_p99_ms": q(0.99),
        "split_rounds": splits,
        # farloco only: the share of rounds frozen in one hop, and when the last member's pushed ready record
        # was filed at the first and the last other member (p50, ms after it was ready)
        "one_hop_share": round(sum(one_hop) / len(one_hop), 3) if one_hop else None,
        "push_first_p50_ms": q(0.5, push_first),
        "push_last_p50_ms": q(0.5, push_last),
        "filed_to_known_p50_ms": q(0.5, filed_to_known),
        "filed_to_known_p90_ms": q(0.9, filed_to_known),
    }


TABLE_PATIENCE = 300.0  # seconds a peer waits for every member in its table before round 0


async def routing_view(dht: Any, node: Any) -> dict[str, Any]:
    """Run in the DHT's process: how many nodes its routing table holds, and whether each initial peer is one."""
    from farloco.protocol import dhtcall

    table = node.protocol.routing_table
    known = {peer for _, peer in table.get_nearest_neighbors(node.node_id, k=10_000, exclude=None)}
    initial = set(dhtcall.peers_of(getattr(dht, "initial_peers", None) or []))
    return {"routing_table": len(known), "initial_known": sorted(str(p)[-8:] for p in initial & known),
            "initial_missing": sorted(str(p)[-8:] for p in initial - known)}  # fmt: skip


async def fill_table(membership: Any, peers: int, rank: int) -> None:
    """Wait until `membership`'s table holds all `peers` members; what it holds (and what its DHT node's routing
    table holds) every 30 s, and a clear error past TABLE_PATIENCE (a peer that never sees another would
    otherwise hold the run for good)."""
    from farloco.protocol import dhtcall

    waited = told = time.monotonic()
    while True:
        seen = await membership.members()
        if len(seen) >= peers:
            return
        now = time.monotonic()
        if now - told > 30:
            told = now
            try:
                routing = await dhtcall.run_in_dht(membership.dht, routing_view, timeout=10.0)
            except Exception as exc:  # a diagnosis only
                routing = {"error": repr(exc)}
            print(
                f"peer {rank}: table holds {len(seen)} of {peers} members; DHT node: {routing}",
                file=sys.stderr,
                flush=True,
            )
        if now - waited > TABLE_PATIENCE:
            raise RuntimeError(
                f"peer {rank}: the member table held {len(seen)} of {peers} members after {TABLE_PATIENCE:.0f} s: "
                f"{sorted(r.peer_id[-8:] for r in seen)}"
            )
        await asyncio.sleep(0.2)


def drive(procs: list[subprocess.Popen[str]], what: str) -> list[dict[str, Any]]:
    """The driver's side of a run: the first process's DHT addresses to the others, everyone ready, one shared
    start two seconds out, then each process's last answer; every process is stopped whatever happens."""
    try:
        maddrs = read_peer(procs[0], what)["maddrs"]
        for proc in procs[1:]:
            write_peer(proc, {"maddrs": maddrs})
        for proc in procs:
            read_peer(proc, what)  # ready
        start_at = time.time() + 2.0
        for proc in procs:
            write_peer(proc, {"start_at": start_at})
        return [read_peer(proc, what) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_config(
    impl: str, peers: int, rounds: int, work: float, wan: NamespaceWAN | None = None
) -> dict[str, Any]:
    def command(rank: int) -> list[str]:
        host = wan.address(rank + 1) if wan else "127.0.0.1"
        prefix = list(wan.prefix_command(rank + 1)) if wan else []
        script = os.path.abspath(__file__)
        return [
            *prefix,
            sys.executable,
            script,
            "--worker",
            impl,
            str(rank),
            str(peers),
            str(rounds),
            str(work),
            host,
        ]

    procs = [
        subprocess.Popen(command(rank), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for rank in range(peers)
    ]
    reports = [answer["report"] for answer in drive(procs, impl)]
    # bytes each peer's p2pd sent per round it took part in (farloco: its DHT traffic; hivemind: everything)
    per_round = [r["p2pd_sent"] / max(1, len(r["log"])) for r in reports]
    return {
        "impl": impl,
        "peers": peers,
        "work_s": work,
        **summarize(reports, peers, work),
        "p2pd_bytes_per_round": round(sum(per_round) / len(per_round)),
    }


class Hog:
    """One busy process per core at normal priority for as long as the context lasts: a machine whose every core
    has a neighbour that never sleeps."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Hog:
        if self.enabled:
            self.procs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 1)
            ]
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["farloco", "hivemind", "both"], default="both")
    parser.add_argument("--peers", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--work", type=float, nargs="*", default=[0.1, 1.0])
    parser.add_argument(
        "--rounds", type=int, default=0, help="rounds per run (default: 300 at 0.1 s, 60 at 1 s, 10 at 10 s)"
    )
    parser.add_argument("--hog", action="store_true", help="a busy process on every core during each run")
    parser.add_argument(
        "--no-ready-dht-copy",
        action="store_true",
        help="ablation (unsafe, measurement only): farloco keeps its ready records out of the DHT, to show what "
        "their stores cost the freeze",
    )
    parser.add_argument(
        "--no-links",
        action="store_true",
        help="farloco pushes each round message as a gRPC call instead of on the kept-open links (the code "
        "before links, for an A/B in one window)",
    )
    parser.add_argument(
        "--dht-niceness",
        type=int,
        default=None,
        help="farloco's DHT child and p2pd this much below the worker (default: the daemon's "
        "network.dht_niceness; hivemind's averager keeps its DHT at the worker's priority, as hivemind does)",
    )
    parser.add_argument(
        "--netns",
        metavar="RATE",
        help="each peer in a network namespace of its own, on a bridge whose links tc tbf shapes to RATE "
        "(e.g. 100mbit; needs root)",
    )
    args = parser.parse_args()
    if args.no_ready_dht_copy:
        os.environ["BENCH_NO_READY_DHT_COPY"] = "1"  # read by the workers, which inherit it
    if args.no_links:
        os.environ["BENCH_NO_LINKS"] = "1"
    from farloco.node.config import NetworkConfig

    niceness = NetworkConfig().dht_niceness if args.dht_niceness is None else args.dht_niceness
    os.environ["BENCH_DHT_NICENESS"] = str(niceness)
    impls = ["farloco", "hivemind"] if args.impl == "both" else [args.impl]
    if args.netns and (why := netns.unavailable()):
        parser.error(f"--netns: {why}")
    print(f"# load before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores", flush=True)
    for work in args.work:
        rounds = args.rounds or (300 if work <= 0.2 else 60 if work <= 2 else 10)
        for peers in args.peers:
            for impl in impls:
                started = time.time()
                wan = NamespaceWAN(peers, args.netns) if args.netns else None
                with wan or contextlib.nullcontext(), Hog(args.hog):
                    row = run_config(impl, peers, rounds, work, wan)
                row.update(
                    wall_s=round(time.time() - started, 1), hog=args.hog, link=args.netns or "loopback"
                )
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
