"""Many protocol peers on one machine: farloco's real protocol stacks (a hivemind DHT node, the gRPC server and
client, DHTMembership with its heartbeats, DHTMatchmaker, Exchange), several peers per process, synthetic
contributions instead of trainer ranks (as hivemind's averaging benchmark runs many averagers per process).

    python benchmarks/protocol_scale.py --peers 8 16 32 64 --per-process 8 --work 1.0 --seconds 120
    python benchmarks/protocol_scale.py --peers 64 --per-process 8 --markdown
    python benchmarks/protocol_scale.py --peers 16 --group-size 4 --codec int8 --numel 262144 --markdown

Each peer is what an agent runs minus its ranks: a DHT node of its own (hivemind's DHTNode with its own libp2p
daemon and its own signing key, in the worker's event loop rather than in a forked child), its own gRPC server and
client, membership records under its own key, the matchmaker and the exchange. Every round each peer works `work`
seconds (+-20%), forms the round's group, and averages a 4 KiB fp32 tensor with it (`--numel`, `--codec`; the
flat exchange, or with `--group-size G` rows and columns of at most G, protocol/exchange/grouped.py). Each
contribution is a direction shared by the round plus the peer's own noise, made from the peer's id and the
round, so the group's first member makes the exact mean again and logs how far the exchange's is from it. Heartbeats run as the daemon's
do (`farloco.protocol.membership.HeartbeatPacer`): a record stored every `heartbeat_interval`, the member table
read at the pacer's interval.

Reported per swarm size:
- `all_share`: rounds whose group held every peer, and each of them in the exchange's contributors;
- `match_p50_ms` / `match_p99_ms`: from the last member ready to the group known by all;
- `dht_bytes_per_peer_s`: what each peer's libp2p daemon sent per second (the DHT: records, heartbeats, table
  reads; farloco's round messages and exchange never go through it);
- `control_bytes_per_peer_s`: the request and answer bytes of each peer's unary RPCs (ready, group, "at"
  announcements, data-plane addresses): the round's control traffic; the exchange's streams are not counted;
- `table_reads_per_peer_s`, `heartbeats_per_peer_s`;
- `groups_alike`: groups whose members all returned the same mean, bit for bit; `err_max` / `err_p50`: its
  relative L2 distance from the exact (float64) mean; `exchange_p50_s`, `exchange_sent_per_round` (bytes a
  member sent, every stage).

Peers talk to the driver through stdin/stdout JSON only; nothing is pickled across processes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import torch
from exchange import receive, send  # benchmarks/exchange.py: the same stdio protocol
from matchmaking import drive, p2pd_bytes_sent, summarize  # benchmarks/matchmaking.py: driver, bytes, logs

RUN = "bench-scale"
# --read-every-beat: the table read at every heartbeat (the cadence before HeartbeatPacer), else the pacer's
READ_INTERVAL: float | None = (
    float(os.environ["BENCH_READ_INTERVAL"]) if os.environ.get("BENCH_READ_INTERVAL") else None
)
# --walk-every-store: every member-record store walks the DHT (before store_near), else the agent's replan_every
REPLAN_EVERY: float | None = (
    float(os.environ["BENCH_REPLAN_EVERY"]) if os.environ.get("BENCH_REPLAN_EVERY") else None
)
# --leader-timeout: the matchmaking's leader_timeout (the daemon's default, 5 s, unless set)
LEADER_TIMEOUT = float(os.environ.get("BENCH_LEADER_TIMEOUT", "5.0"))
# 4 KiB of fp32 by default: the protocol is measured, not the exchange's bandwidth (--numel)
NUMEL = int(os.environ.get("BENCH_NUMEL", "1024"))
# --group-size: the exchange in rows and columns of at most this many (run.exchange_group_size); 0: flat
GROUP_SIZE = int(os.environ.get("BENCH_GROUP_SIZE", "0"))
CODEC = os.environ.get("BENCH_CODEC", "fp32")


def contribution(peer_id: str, round_id: int) -> torch.Tensor:
    """A peer's synthetic contribution to a round, which any peer can make again from its id: a direction
    shared by all (per round) plus the peer's own noise of the same size."""
    shared = torch.Generator().manual_seed(round_id)
    own = torch.Generator().manual_seed(
        int.from_bytes(hashlib.sha256(f"{peer_id}/{round_id}".encode()).digest()[:7])
    )
    return torch.randn(NUMEL, generator=shared) + torch.randn(NUMEL, generator=own)


def mean_error(averaged: torch.Tensor, contributors: list[str], round_id: int) -> float:
    """Relative L2 distance of `averaged` from the exact (float64) mean of the contributors' contributions."""
    exact = torch.stack([contribution(p, round_id).double() for p in contributors]).mean(0)
    return float((averaged.double() - exact).norm() / exact.norm())


class InProcessDHT:
    """A hivemind DHTNode in this process's event loop, with the calls farloco's protocol makes of a `hivemind.DHT`
    (`store`, `get` with `return_future=True`, `peer_id`): many peers fit in one process without a forked
    DHT child each. Its futures are asyncio futures of the running loop, which `dhtcall` awaits like hivemind's."""

    def __init__(self, node: Any, initial_peers: list[str]) -> None:
        self.node = node
        self.peer_id = node.peer_id
        self.initial_peers = initial_peers  # as hivemind.DHT's: dhtcall.rejoin_initial_peers reads them
        # "store near members", "get round", ...: what each peer asks of the DHT
        self.calls: Counter[str] = Counter()

    @staticmethod
    def _kind(key: str) -> str:
        parts = key.split("/")
        return parts[2] if len(parts) > 2 and parts[2] == "members" else "/".join(["round", *parts[4:]])

    @classmethod
    async def create(cls, *, host: str, initial_peers: list[str], run: str, private_key: Any) -> InProcessDHT:
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import CompositeValidator

        from farloco.protocol.dhtcall import DHT_NODE_OPTIONS
        from farloco.protocol.membership import make_record_validators

        # the agent's DHT options (make_dht's), unless BENCH_DHT_KWARGS says otherwise
        options = {**DHT_NODE_OPTIONS, **json.loads(os.environ.get("BENCH_DHT_KWARGS", "{}"))}
        node = await DHTNode.create(
            initial_peers=initial_peers,
            host_maddrs=[f"/ip4/{host}/tcp/0"],
            record_validator=CompositeValidator(make_record_validators(run, private_key=private_key)),
            wait_timeout=8.0,
            num_workers=4,
            **options,
        )
        return cls(node, initial_peers)

    def store(
        self, key: str, value: Any, expiration: float, *, subkey: Any = None, return_future: bool
    ) -> Any:
        assert return_future
        self.calls[f"store {self._kind(key)}"] += 1
        return asyncio.ensure_future(self.node.store(key, value, expiration, subkey=subkey))

    def get(self, key: str, *, latest: bool = False, return_future: bool, **kwargs: Any) -> Any:
        assert return_future
        self.calls[f"get {self._kind(key)}"] += 1
        return asyncio.ensure_future(self.node.get(key, latest=latest, **kwargs))

    def run_coroutine(self, coro: Any, *, return_future: bool) -> Any:
        assert return_future
        # farloco's membership runs two coroutines in the DHT: stores and reads near the members key
        name = getattr(getattr(coro, "func", coro), "__name__", "coroutine")
        self.calls[{"store_near": "store near members", "get_near": "get near members"}.get(name, name)] += 1
        return asyncio.ensure_future(coro(self, self.node))

    async def maddrs(self) -> list[str]:
        return [str(m) for m in await self.node.p2p.get_visible_maddrs()]

    def p2pd_pid(self) -> int:
        child = getattr(self.node.p2p, "_child", None)
        return int(child.pid) if child is not None else 0

    async def shutdown(self) -> None:
        await self.node.shutdown()


class Peer:
    """One peer's protocol stack."""

    def __init__(self, index: int, host: str, heartbeat: float, ttl: float) -> None:
        self.index = index
        self.host = host
        self.heartbeat = heartbeat
        self.ttl = ttl
        self.rng = random.Random(index)
        self.log: list[dict[str, Any]] = []
        self.round = 0

    async def start(self, initial: list[str]) -> None:
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.utils.crypto import RSAPrivateKey

        from farloco.protocol.auth import Authenticator
        from farloco.protocol.exchange import Exchange
        from farloco.protocol.matchmaking import DHTMatchmaker
        from farloco.protocol.membership import DHTMembership, HeartbeatPacer
        from farloco.protocol.rpc import RpcClient, RpcServer
        from farloco.protocol.types import GroupMember

        key = RSAPrivateKey()
        self.dht = await InProcessDHT.create(host=self.host, initial_peers=initial, run=RUN, private_key=key)
        self.peer_id = self.dht.peer_id.to_base58()
        auth = Authenticator(f"{RUN}:h", b"bench-secret-of-the-scale-run", self.peer_id)
        self.server, self.client = RpcServer(auth, host=self.host, data_port=0), RpcClient(auth)
        self.exchange: Any = Exchange(self.server, self.client, self.peer_id)
        if GROUP_SIZE:
            from farloco.protocol.exchange.grouped import GroupedExchange

            self.exchange = GroupedExchange(self.exchange, self.server, self.client, self.peer_id, GROUP_SIZE)
        self.membership = DHTMembership(
            self.dht,
            RUN,
            "h",
            {},
            ttl=self.ttl,
            heartbeat_interval=self.heartbeat,
            auth=auth,
            public_key=RSASignatureValidator(key).local_public_key,
            replan_every=REPLAN_EVERY if REPLAN_EVERY is not None else self.ttl,
            read_near=not os.environ.get("BENCH_READ_WALK"),
        )
        self.pacer = HeartbeatPacer(self.heartbeat, self.ttl, read_interval=READ_INTERVAL)
        self.matchmaker = DHTMatchmaker(
            self.dht, RUN, self.membership, server=self.server, client=self.client
        )
        self.address = await self.server.start()
        self.me = GroupMember(self.peer_id, self.address)
        await self.membership.publish(self.record())
        self.beats = asyncio.create_task(self.heartbeats())

    def record(self) -> Any:
        from farloco.protocol.membership import MemberRecord

        return MemberRecord(
            peer_id=self.peer_id, address=self.address, state="training", round_id=self.round, inner_step=0,
            slot=self.index, run_hash="h", run_config={}, outer_hash="", loss=0.0, heartbeat=0.0, maddrs=(),
            version="bench",
        )  # fmt: skip

    async def heartbeats(self) -> None:
        """What the agent's heartbeat loop does: store the record every beat, read the table when the pacer says."""
        while True:
            await asyncio.sleep(self.heartbeat)
            try:
                await self.membership.publish(self.record(), retry_seconds=0.0)
                if self.pacer.read_due(time.monotonic()):
                    await self.membership.refresh()
            except Exception:  # a missed beat; the next one retries (as the daemon does)
                pass

    async def run_round(self, round_id: int, work: float) -> None:
        from farloco.optim.registry import get_codec
        from farloco.protocol.exchange import ExchangeAborted
        from farloco.protocol.matchmaking import LateForRound, MatchmakingError

        self.round = round_id
        self.matchmaker.announce(round_id, self.peer_id)
        await asyncio.sleep(work * self.rng.uniform(0.8, 1.2))
        entry: dict[str, Any] = {"round": round_id, "ready": time.time()}
        try:
            group = await self.matchmaker.form_group(
                round_id,
                self.me,
                match_timeout=max(30.0, LEADER_TIMEOUT),
                leader_timeout=LEADER_TIMEOUT,
                match_timeout_min=2.0,
            )
            entry.update(known=time.time(), group=group.group_id, members=[m.peer_id for m in group.members])
            if len(group.members) > 1:
                tensor = contribution(self.peer_id, round_id)
                result = await self.exchange.average(group, tensor, get_codec(CODEC), timeout=60.0)
                entry["contributors"] = list(result.contributors)
                entry["digest"] = hashlib.sha256(result.averaged.numpy().tobytes()).hexdigest()[:16]
                entry["exchange_s"] = round(result.seconds, 4)
                entry["path"] = result.path  # flat, rows, or rows then flat
                entry["partial"] = list(result.partial)
                entry["exchange_sent"] = result.bytes_sent
                # the exact mean is made again from every contributor's id: done by the group's first member
                if self.peer_id == min(result.contributors):
                    entry["err"] = mean_error(result.averaged, entry["contributors"], round_id)
            else:
                entry["contributors"] = [self.peer_id]
        except LateForRound as exc:
            entry.update(late=exc.reason)
        except (MatchmakingError, ExchangeAborted) as exc:
            entry.update(failed=str(exc)[:300])
        # the round's end here (BENCH_DUMP's logs: where a slow round's time went)
        entry["done"] = time.time()
        self.log.append(entry)

    async def stop(self) -> None:
        self.beats.cancel()
        await self.matchmaker.close()
        await self.server.stop(0.5)
        await self.dht.shutdown()


# Seconds the cyclic garbage collector ran in this worker, and its collections, by generation.
GC_SPENT: dict[str, float] = {"s": 0.0, "gen0": 0, "gen1": 0, "gen2": 0}


def gc_timer() -> Any:
    """Time every collection from now on (`gc.callbacks`) into GC_SPENT; returns the callback."""
    began = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            GC_SPENT["s"] += time.perf_counter() - began[0]
            GC_SPENT[f"gen{info['generation']}"] += 1

    gc.callbacks.append(timed)
    return timed


async def worker(
    first: int, count: int, peers: int, work: float, seconds: float, host: str, ttl: float, heartbeat: float
) -> None:
    initial = [] if first == 0 else receive()["maddrs"]
    local: list[Peer] = []
    for index in range(first, first + count):
        peer = Peer(index, host, heartbeat=heartbeat or ttl / 4, ttl=ttl)
        await peer.start(initial)
        if os.environ.get("BENCH_VERBOSE"):
            print(f"peer {index} started", file=sys.stderr, flush=True)
        if index == 0:
            initial = await peer.dht.maddrs()
            send({"maddrs": initial})
        local.append(peer)
    # everyone in each local peer's table before round 0
    waited = time.monotonic()
    while True:
        counts = [len(await p.membership.members()) for p in local]
        if min(counts) >= peers:
            break
        if time.monotonic() - waited > 30:
            print(f"worker {first}: tables hold {counts} of {peers} members", file=sys.stderr, flush=True)
            waited = time.monotonic()
        await asyncio.sleep(0.5)
    send({"ready": True})
    # On a thread: this loop serves the local peers' DHT nodes, which the other workers' peers are reading from
    start_at = (await asyncio.to_thread(receive))["start_at"]
    await asyncio.sleep(max(0.0, start_at - time.time()))
    pids = {p.dht.p2pd_pid() for p in local}
    dht_sent, started = p2pd_bytes_sent(pids), time.monotonic()
    for peer in local:
        peer.client.unary_bytes.clear()
        peer.membership.counters.clear()
        peer.matchmaker.counters.clear()
        peer.dht.calls.clear()

    async def run(peer: Peer) -> None:
        round_id = 0
        while time.time() <= start_at + seconds:
            await peer.run_round(round_id, work)
            # Late, a node takes the swarm's state and joins its round: here, the newest round a peer announced.
            late = "late" in peer.log[-1]
            round_id = max(round_id + 1, peer.matchmaker.newest_announced()) if late else round_id + 1

    lag = {"max_s": 0.0, "at_s": 0.0}

    async def watch_lag() -> None:
        """The event loop's worst lateness: how far past its time a 0.1 s sleep woke up (when, from the start)."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.1)
            late = time.monotonic() - before - 0.1
            if late > lag["max_s"]:
                lag.update(max_s=round(late, 3), at_s=round(time.monotonic() - started, 1))

    watcher = asyncio.create_task(watch_lag())
    collections = gc_timer()
    await asyncio.gather(*(run(p) for p in local))
    elapsed = time.monotonic() - started
    gc.callbacks.remove(collections)
    watcher.cancel()
    dht_sent = p2pd_bytes_sent(pids) - dht_sent
    reports = [
        {
            "peer": p.peer_id,
            "log": p.log,
            "control_bytes": sum(p.client.unary_bytes.values()),
            "reads": p.membership.counters["reads"],
            "beats": p.membership.counters["stores"],
            "knocks": p.matchmaker.counters["knocks"],
            "dht_calls": dict(p.dht.calls),
        }
        for p in local
    ]
    send({"reports": reports, "dht_sent": dht_sent, "elapsed": elapsed, "loop_lag": lag, "gc": GC_SPENT})
    for peer in local:
        await peer.stop()


def worker_main(argv: list[str]) -> None:
    first, count, peers, work, seconds, host, ttl, heartbeat = argv
    if os.environ.get("BENCH_DEBUG"):
        import logging

        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")
        logging.basicConfig(level=logging.DEBUG, format=f"w{first} %(name)s %(message)s")
    torch.set_num_threads(1)
    if os.environ.get("BENCH_KNOCK_BACKOFF_STEPS"):  # --knock-every-second
        from farloco.protocol.matchmaking import driver

        driver.KNOCK_BACKOFF_STEPS = int(os.environ["BENCH_KNOCK_BACKOFF_STEPS"])
    numbers = [float(v) for v in (work, seconds, ttl, heartbeat)]
    asyncio.run(
        worker(int(first), int(count), int(peers), numbers[0], numbers[1], host, numbers[2], numbers[3])
    )


def run_swarm(
    peers: int, per_process: int, work: float, seconds: float, ttl: float, heartbeat: float = 0.0
) -> dict[str, Any]:
    script = os.path.abspath(__file__)
    starts = list(range(0, peers, per_process))

    def command(first: int) -> list[str]:
        count = min(per_process, peers - first)
        return [sys.executable, script, "--worker", str(first), str(count), str(peers), str(work), str(seconds),
                "127.0.0.1", str(ttl), str(heartbeat)]  # fmt: skip

    procs = [
        subprocess.Popen(command(first), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for first in starts
    ]
    answers = drive(procs, "scale")
    reports = [r for a in answers for r in a["reports"]]
    if os.environ.get("BENCH_DUMP"):  # every peer's round log, for a closer look
        with open(f"{os.environ['BENCH_DUMP']}-{peers}.json", "w") as f:
            json.dump(reports, f)
    elapsed = max(a["elapsed"] for a in answers)
    per_peer_s = peers * elapsed
    exchanged = [e for r in reports for e in r["log"] if "digest" in e]
    by_group: dict[str, set[str]] = {}
    for e in exchanged:
        by_group.setdefault(e["group"], set()).add(e["digest"])
    errors = sorted(e["err"] for e in exchanged if "err" in e)
    seconds = sorted(e["exchange_s"] for e in exchanged)
    return {
        "peers": peers,
        "per_process": per_process,
        "work_s": work,
        "ttl_s": ttl,
        "heartbeat_s": heartbeat or ttl / 4,
        "leader_timeout_s": LEADER_TIMEOUT,
        "group_size": GROUP_SIZE,
        "codec": CODEC,
        "numel": NUMEL,
        **summarize(reports, peers, work),
        # the exchange: groups whose members all hold the same mean, bit for bit; its distance from the exact
        # mean (relative L2, max and median over rounds); its time and what each member sent per round
        "groups_alike": f"{sum(len(d) == 1 for d in by_group.values())}/{len(by_group)}",
        "err_max": max(errors, default=None),
        "err_p50": errors[len(errors) // 2] if errors else None,
        "exchange_p50_s": seconds[len(seconds) // 2] if seconds else None,
        "exchange_sent_per_round": round(sum(e["exchange_sent"] for e in exchanged) / max(1, len(exchanged))),
        "dht_bytes_per_peer_s": round(sum(a["dht_sent"] for a in answers) / per_peer_s),
        "control_bytes_per_peer_s": round(sum(r["control_bytes"] for r in reports) / per_peer_s),
        "table_reads_per_peer_s": round(sum(r["reads"] for r in reports) / per_peer_s, 3),
        "heartbeats_per_peer_s": round(sum(r["beats"] for r in reports) / per_peer_s, 3),
        # knocks at members of the last group whose record lapsed (a connect and an authenticated call each)
        "knocks_per_peer_s": round(sum(r["knocks"] for r in reports) / per_peer_s, 3),
        "dht_calls_per_peer_s": {
            kind: round(sum(r["dht_calls"].get(kind, 0) for r in reports) / per_peer_s, 3)
            for kind in sorted({k for r in reports for k in r["dht_calls"]})
        },
        "seconds": round(elapsed, 1),
        # each worker's event loop at its latest (seconds, and when): several peers share one loop here
        "loop_lag_max_s": max(a["loop_lag"]["max_s"] for a in answers),
        "loop_lag": [a["loop_lag"] for a in answers],
        # the cyclic garbage collector: its share of the workers' time, and its full collections
        "gc_share": round(sum(a["gc"]["s"] for a in answers) / (elapsed * len(answers)), 4),
        "gc_full_collections": sum(a["gc"]["gen2"] for a in answers),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| peers | exchange | rounds | all | p50 ms | p99 ms | split | DHT B/peer/s | control B/peer/s | "
        "reads/peer/s | means alike | err max | exchange p50 s | sent/peer/round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        exchange = f"rows of {r['group_size']}" if r["group_size"] else "flat"
        err = "" if r["err_max"] is None else f"{r['err_max']:.2g}"
        lines.append(
            f"| {r['peers']} | {exchange}, {r['codec']} | {r['rounds']} | {100 * r['all_share']:.1f}% | "
            f"{r['match_p50_ms']} | {r['match_p99_ms']} | {r['split_rounds']} | {r['dht_bytes_per_peer_s']} | "
            f"{r['control_bytes_per_peer_s']} | {r['table_reads_per_peer_s']} | {r['groups_alike']} | {err} | "
            f"{r['exchange_p50_s']} | {r['exchange_sent_per_round']} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="*", default=[8, 16, 32, 64])
    parser.add_argument("--per-process", type=int, default=8, help="peers per worker process")
    parser.add_argument("--work", type=float, default=1.0, help="seconds of 'training' per round (+-20%%)")
    parser.add_argument("--seconds", type=float, default=120.0, help="rounds are started for this long")
    parser.add_argument("--ttl", type=float, default=8.0, help="member_ttl (the daemon's default: 8 s)")
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=0.0,
        help="seconds between member-record stores (0, the daemon's default: ttl/4)",
    )
    parser.add_argument(
        "--read-every-beat",
        action="store_true",
        help="read the member table at every heartbeat (the cadence before the pacer) instead of the pacer's",
    )
    parser.add_argument(
        "--knock-every-second",
        action="store_true",
        help="knock at a lapsed member that answers every second (before the matchmaker's back-off)",
    )
    parser.add_argument(
        "--walk-every-store",
        action="store_true",
        help="every member-record store walks the DHT (hivemind's store) instead of going to the replicas",
    )
    parser.add_argument(
        "--leader-timeout",
        type=float,
        default=5.0,
        help="matchmaking's leader_timeout (the daemon's default: 5 s); records must reach every peer within half",
    )
    parser.add_argument(
        "--read-walks",
        action="store_true",
        help="read the member table with a walk of the DHT (before dhtcall.get_near) instead of from its replicas",
    )
    parser.add_argument(
        "--hivemind-caching",
        action="store_true",
        help="keep hivemind's background cache refresh and cache_nearest (before dhtcall.DHT_NODE_OPTIONS)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="the exchange in rows and columns of at most this many (run.exchange_group_size); 0: flat",
    )
    parser.add_argument("--codec", default="fp32", help="the exchange's codec (fp32, int8, ...)")
    parser.add_argument("--numel", type=int, default=1024, help="values each peer contributes per round")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    global GROUP_SIZE, CODEC, NUMEL
    GROUP_SIZE, CODEC, NUMEL = args.group_size, args.codec, args.numel
    os.environ["BENCH_GROUP_SIZE"] = str(args.group_size)  # the workers inherit them
    os.environ["BENCH_CODEC"] = args.codec
    os.environ["BENCH_NUMEL"] = str(args.numel)
    os.environ["BENCH_LEADER_TIMEOUT"] = str(args.leader_timeout)
    global LEADER_TIMEOUT
    LEADER_TIMEOUT = args.leader_timeout
    if args.read_walks:
        os.environ["BENCH_READ_WALK"] = "1"
    if args.hivemind_caching:
        os.environ["BENCH_DHT_KWARGS"] = json.dumps({"cache_refresh_before_expiry": 5, "cache_nearest": 1})
    if args.walk_every_store:
        os.environ["BENCH_REPLAN_EVERY"] = "0"
    if args.read_every_beat:
        os.environ["BENCH_READ_INTERVAL"] = "0"  # the workers inherit it
    if args.knock_every_second:
        os.environ["BENCH_KNOCK_BACKOFF_STEPS"] = "0"
    print(f"# load before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores", flush=True)
    rows = []
    for peers in args.peers:
        started = time.time()
        row = run_swarm(peers, args.per_process, args.work, args.seconds, args.ttl, args.heartbeat)
        row["wall_s"] = round(time.time() - started, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
