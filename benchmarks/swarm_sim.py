"""Matchmaking at scale, simulated: N peers run the real sans-IO rule (`farloco.protocol.matchmaking.decide`, the
same function the daemon's driver calls) over a simulated WAN, round after round, with churn.

    python benchmarks/swarm_sim.py --peers 16 64 256 1000 --rounds 30
    python benchmarks/swarm_sim.py --peers 64 --rounds 50 --loss 0.02 --churn 0.01 --markdown

What is simulated (a discrete-event simulation; one process, no sockets):

- **The driver's moves**: at the start of its round's work a peer announces the round to every peer it knows
  (`MatchAt`); when its work is done it pushes its ready record to them (`MatchReady`, declaring the set it
  expects, as the driver does) and stores it in the DHT; a leader pushes its group (`MatchGroup`), a member that
  learns it from another relays it once and keeps a DHT copy; a one-hop group is pushed to the other members and
  copied to the DHT by its two lowest peer ids. The DHT is modelled as copies every reader sees after a delay (`--dht-ms`), polled every 0.25 s.
- **The WAN**: one-way latency of each peer pair = half an RTT drawn once from a log-normal (median `--rtt-ms`,
  `--rtt-sigma`), each message +-10% jitter; with probability `--loss` a message loses a packet and waits for
  TCP's retransmission (at least 200 ms); with probability `--fail` the call fails and the message never
  arrives (the DHT copy is then the only way); every peer's clock off by up to `--skew-ms`.
- **Work**: each round's local work lasts `--work` s +-`--spread` (uniform); `--stragglers` of the peers sometimes
  (a third of their rounds) take twice as long.
- **Churn**: each round, each peer crashes with probability `--churn` at a random time of its round; it restarts
  (same peer id, nothing remembered) `--restart` s later and joins the round the swarm is in. A crashed peer's
  member record says its round until `member_ttl` (8 s) after its last heartbeat; its address refuses
  connections at once, so the members of its last group stop waiting for it when its record is gone.

Reported per N: `all live` = the share of rounds whose group held every peer that was live and in the round's
work at its freeze (a peer that restarted into a later round is not counted as missing); `one hop` = the share
of groups frozen in one hop; `freeze p50/p99` = last member ready -> group known by every member (ms);
`msgs/peer/round` = messages each peer sent per round (pushes and DHT operations); `split` = rounds with two
groups. The simulation checks on every round that at most one group forms among its live members.

Where it is not the daemon: the driver wakes on every pushed message; here a peer re-decides on a pushed ready
record only when it could change the decision (its declared set may be complete, or every member it expects may
be ready), on a group record, at its deadlines and at each DHT poll, which keeps 1,000 peers (a million messages a
round) to minutes. No exchange is simulated: a round ends at its freeze.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from farloco.protocol.matchmaking import (
    GroupRecord,
    Joined,
    Late,
    Publish,
    ReadyRecord,
    RoundView,
    StragglerWait,
    decide,
    expected_digest,
    schedule,
    spread_sample,
)
from farloco.protocol.types import Group, GroupMember

MATCH_TIMEOUT = 30.0  # timeouts.match_timeout (the daemon's default)
MATCH_TIMEOUT_MIN = 2.0  # timeouts.match_timeout_min: the floor of the straggler wait a peer proposes
LEADER_TIMEOUT = 5.0  # timeouts.leader_timeout
MEMBER_TTL = 8.0  # timeouts.member_ttl
POLL = 0.25  # the driver's DHT poll interval with links


@dataclass(frozen=True)
class Settings:
    peers: int
    rounds: int = 30
    seed: int = 1
    work: float = 3.0
    spread: float = 0.3
    stragglers: float = 0.0
    rtt_ms: float = 60.0
    rtt_sigma: float = 0.6
    loss: float = 0.01
    fail: float = 0.001
    skew_ms: float = 50.0
    dht_ms: float = 500.0
    churn: float = 0.01
    restart: float = 5.0
    one_hop: bool = True  # ready records declare their expected set (False: every group through a leader)


def member(peer_id: str) -> GroupMember:
    return GroupMember(peer_id, f"{peer_id}.example:7000")


@dataclass
class Peer:
    name: str
    skew: float
    incarnation: int = 0
    alive: bool = True
    round_id: int = -1
    ready_at: float | None = None  # global time our ready record went out (this round)
    declared: str = ""
    decided: bool = False
    # what this process has received (a restart forgets it all)
    ready: dict[int, dict[str, ReadyRecord]] = field(default_factory=lambda: defaultdict(dict))
    groups: dict[int, dict[str, GroupRecord]] = field(default_factory=lambda: defaultdict(dict))
    digests: dict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    known_round: dict[str, int] = field(default_factory=dict)  # announcements received: peer -> round
    last_group: tuple[int, frozenset[str]] = (-1, frozenset())
    expected_size: int = 1
    relayed: set[int] = field(default_factory=set)
    sent: int = 0
    straggler: StragglerWait = field(default_factory=lambda: StragglerWait(MATCH_TIMEOUT_MIN, MATCH_TIMEOUT))


class Simulation:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.rng = random.Random(settings.seed)
        names = [f"p{i:04d}" for i in range(settings.peers)]
        self.peers = {n: Peer(n, self.rng.uniform(-1, 1) * settings.skew_ms / 1e3) for n in names}
        self.stragglers = set(self.rng.sample(names, round(settings.stragglers * settings.peers)))
        self.events: list[tuple[float, int, str, str, tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.rtt: dict[tuple[str, str], float] = {}
        self.dht: dict[Any, dict[str, tuple[float, Any]]] = defaultdict(dict)
        self.died_at: dict[str, float] = {}
        self.record_round: dict[str, tuple[int, float]] = {}  # peer -> (round its member record says, since)
        self.published: dict[int, list[tuple[float, Group, bool]]] = defaultdict(list)
        self.outcomes: dict[int, dict[str, Any]] = defaultdict(dict)
        self.known_at: dict[int, dict[str, float]] = defaultdict(dict)  # round -> member -> when it knew
        self.in_work: dict[int, set[str]] = defaultdict(set)  # round -> peers that started its work
        self.ready_time: dict[int, dict[str, float]] = defaultdict(dict)  # round -> peer -> global ready time
        self.messages = 0
        self.crashes = 0
        self.peer_rounds = 0
        self.decides = 0

    # -- the network ----------------------------------------------------------------------------------------

    def at(self, when: float, peer: str, kind: str, *args: Any) -> None:
        heapq.heappush(self.events, (when, next(self.seq), peer, kind, args))

    def one_way(self, a: str, b: str) -> float:
        key = (a, b) if a < b else (b, a)
        rtt = self.rtt.get(key)
        if rtt is None:
            rtt = self.rtt[key] = self.s.rtt_ms / 1e3 * math.exp(self.rng.gauss(0.0, self.s.rtt_sigma))
        return rtt / 2 * self.rng.uniform(0.9, 1.1)

    def push(self, src: Peer, dst: str, kind: str, payload: Any, now: float) -> None:
        """One unary call over gRPC/TCP: a lost packet costs TCP's retransmission timeout (at least 200 ms, on
        Linux); a failed call (`fail`) never arrives, and the DHT copy is the receiver's only way to the record."""
        src.sent += 1
        self.messages += 1
        if self.rng.random() < self.s.fail:
            return
        delay = self.one_way(src.name, dst)
        if self.rng.random() < self.s.loss:
            delay += max(0.2, 4 * delay)
        self.at(now + delay, dst, "deliver", kind, payload, self.peers[dst].incarnation)

    def store(self, key: Any, writer: Peer, value: Any, now: float) -> None:
        writer.sent += 1
        self.messages += 1
        self.dht[key][writer.name] = (now, value)

    def read(self, key: Any, reader: Peer, now: float) -> dict[str, Any]:
        reader.sent += 1
        self.messages += 1
        delay = self.s.dht_ms / 1e3
        return {w: v for w, (t, v) in self.dht.get(key, {}).items() if w == reader.name or t + delay <= now}

    def targets(self, peer: Peer, now: float) -> list[str]:
        """Whom a peer pushes to: every peer whose member record it holds as live (dead ones until their ttl)."""
        return [n for n in self.peers if n != peer.name and now < self.died_at.get(n, math.inf) + MEMBER_TTL]

    # -- one peer's rounds ----------------------------------------------------------------------------------

    def swarm_round(self) -> int:
        return max((p.round_id for p in self.peers.values() if p.alive), default=0)

    def start(self, peer: Peer, round_id: int, now: float) -> None:
        if round_id >= self.s.rounds:
            return
        peer.round_id, peer.ready_at, peer.decided, peer.declared = round_id, None, False, ""
        self.peer_rounds += 1
        self.in_work[round_id].add(peer.name)
        self.record_round[peer.name] = (round_id, now)
        for other in self.targets(peer, now):  # MatchAt
            self.push(peer, other, "at", (peer.name, round_id), now)
        work = self.s.work * self.rng.uniform(1 - self.s.spread, 1 + self.s.spread)
        if peer.name in self.stragglers and self.rng.random() < 1 / 3:
            work *= 2
        if self.rng.random() < self.s.churn:
            self.at(now + self.rng.uniform(0, work + 2.0), peer.name, "crash", peer.incarnation)
        self.at(now + work, peer.name, "ready", round_id, peer.incarnation)

    def expected(self, peer: Peer, round_id: int, now: float) -> frozenset[str]:
        """What the driver's `_expected` gives: members whose record or announcement says the round (records of
        the dead live until their ttl), and the members of our last group whose record is still there."""
        out = {peer.name}
        for name in self.peers:
            if name == peer.name or now >= self.died_at.get(name, math.inf) + MEMBER_TTL:
                continue
            said = peer.known_round.get(name)
            record = self.record_round.get(name)
            if record is not None and record[1] + 1.0 <= now:  # a heartbeat's DHT store, read within ~1 s
                said = max(said if said is not None else -1, record[0])
            if said == round_id:
                out.add(name)
        last_round, members = peer.last_group
        if last_round == round_id - 1:
            for name in members:
                alive_record = now < self.died_at.get(name, math.inf) + MEMBER_TTL
                past = peer.known_round.get(name, -1) > round_id
                if alive_record and not past:
                    out.add(name)
        return frozenset(out)

    def view(self, peer: Peer, round_id: int, now: float) -> RoundView:
        ready = {r.peer_id: r for r in self.read(("ready", round_id), peer, now).values()}
        ready.update(peer.ready[round_id])
        groups = list(self.read(("group", round_id), peer, now).values())
        groups += [g for g in peer.groups[round_id].values() if g.leader in ready]
        expected = self.expected(peer, round_id, now)
        peer.expected_size = len(expected)
        ahead = frozenset(n for n, r in peer.known_round.items() if r > round_id)
        return RoundView(now=now + peer.skew, ready=ready, groups=groups, expected=expected, ahead=ahead)

    def step(self, peer: Peer, round_id: int, now: float) -> None:
        if not peer.alive or peer.round_id != round_id or peer.decided or peer.ready_at is None:
            return
        self.decides += 1
        view = self.view(peer, round_id, now)
        decision = decide(
            round_id, member(peer.name), view, match_timeout=MATCH_TIMEOUT, leader_timeout=LEADER_TIMEOUT
        )
        if isinstance(decision, Joined):
            record = decision.record
            assert record is not None
            if decision.one_hop:
                if peer.name in [m.peer_id for m in decision.group.members[:2]]:
                    if not any(g.group == decision.group for g in view.groups):  # derived, not pushed to us
                        for m in decision.group.members:
                            if m.peer_id not in (peer.name, record.leader):
                                self.push(peer, m.peer_id, "group", record, now)
                    self.store(("group", round_id), peer, record, now)
            elif record.leader != peer.name and round_id not in peer.relayed:
                peer.relayed.add(round_id)
                for m in decision.group.members:
                    if m.peer_id not in (peer.name, record.leader):
                        self.push(peer, m.peer_id, "group", record, now)
                self.store(("group", round_id), peer, record, now)
            if not any(g == decision.group for _, g, _ in self.published[round_id]):
                self.published[round_id].append((now, decision.group, decision.one_hop))
            self.finish(peer, round_id, now, decision.group, view)
        elif isinstance(decision, Publish):
            record = decision.record
            for m in record.group.members:
                if m.peer_id != peer.name:
                    self.push(peer, m.peer_id, "group", record, now)
            self.store(("group", round_id), peer, record, now)
            self.published[round_id].append((now, record.group, False))
            self.finish(peer, round_id, now, record.group, view)
        elif isinstance(decision, Late):
            self.finish(peer, round_id, now, "late")
        else:
            until = decision.until - peer.skew + 1e-9
            self.at(min(now + POLL, until), peer.name, "poll", round_id, peer.incarnation)

    def finish(
        self, peer: Peer, round_id: int, now: float, outcome: Any, view: RoundView | None = None
    ) -> None:
        peer.decided = True
        if isinstance(outcome, Group) and view is not None:  # the driver's StragglerWait sample
            plan = schedule(view, match_timeout=MATCH_TIMEOUT, leader_timeout=LEADER_TIMEOUT)
            peer.straggler.observe(spread_sample(outcome, view, plan))
        self.outcomes[round_id][peer.name] = outcome
        if isinstance(outcome, Group):
            self.known_at[round_id].setdefault(peer.name, now)
            peer.last_group = (round_id, frozenset(m.peer_id for m in outcome.members))
            self.start(peer, round_id + 1, now)
        else:
            self.start(peer, max(round_id + 1, self.swarm_round()), now)

    # -- the event loop -------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        for peer in self.peers.values():
            self.start(peer, 0, 0.0)
        while self.events:
            now, _, name, kind, args = heapq.heappop(self.events)
            peer = self.peers[name]
            if kind == "restart":
                fresh = Peer(name, peer.skew, incarnation=peer.incarnation + 1)
                self.peers[name] = fresh
                self.died_at.pop(name, None)
                self.start(fresh, self.swarm_round(), now)
                continue
            if not peer.alive:
                continue
            if kind == "crash":
                if args[0] == peer.incarnation and not (peer.decided and peer.round_id >= self.s.rounds - 1):
                    peer.alive = False
                    self.crashes += 1
                    self.died_at[name] = now
                    self.outcomes[peer.round_id].setdefault(name, "dead")
                    self.at(now + self.s.restart, name, "restart")
                continue
            if kind in ("ready", "poll") and args[-1] != peer.incarnation:
                continue
            if kind == "ready":
                round_id = args[0]
                if peer.round_id != round_id:
                    continue
                expected = self.expected(peer, round_id, now)
                peer.declared = expected_digest(expected) if len(expected) >= 2 and self.s.one_hop else ""
                record = ReadyRecord(
                    name,
                    member(name).address,
                    round_id,
                    now + peer.skew,
                    wait=peer.straggler.wait(),
                    expected=peer.declared,
                )
                peer.ready[round_id][name] = record
                if record.expected:
                    peer.digests[round_id][record.expected] += 1
                peer.ready_at = now
                # the first time only: a peer that crashed in the group and restarted into the same round id
                # joins it at once, which says nothing about the freeze
                self.ready_time[round_id].setdefault(name, now)
                self.store(("ready", round_id), peer, record, now)
                for other in self.targets(peer, now):
                    self.push(peer, other, "ready", record, now)
                self.step(peer, round_id, now)
            elif kind == "deliver":
                what, payload, incarnation = args
                if incarnation != peer.incarnation:
                    continue
                if what == "at":
                    sender, round_id = payload
                    peer.known_round[sender] = max(peer.known_round.get(sender, -1), round_id)
                    continue
                if what == "ready":
                    round_id = payload.round_id
                    if payload.peer_id in peer.ready[round_id]:
                        continue
                    peer.ready[round_id][payload.peer_id] = payload
                    if payload.expected:
                        peer.digests[round_id][payload.expected] += 1
                    peer.known_round[payload.peer_id] = max(
                        peer.known_round.get(payload.peer_id, -1), round_id
                    )
                    if round_id != peer.round_id or peer.ready_at is None:
                        continue
                    complete = bool(peer.declared) and peer.digests[round_id][peer.declared] == int(
                        peer.declared.split(":")[0]
                    )
                    if complete or len(peer.ready[round_id]) >= peer.expected_size:
                        self.step(peer, round_id, now)
                else:
                    round_id = payload.group.round_id
                    peer.groups[round_id][payload.leader] = payload
                    self.step(peer, round_id, now)
            else:  # poll
                self.step(peer, args[0], now)
        return self.summary(time.perf_counter() - started)

    def summary(self, seconds: float) -> dict[str, Any]:
        rounds = sorted(r for r in self.outcomes if r < self.s.rounds)
        all_live = split = one_hop = formed = 0
        latencies: list[float] = []
        missing_total = 0
        for round_id in rounds:
            by_peer = self.outcomes[round_id]
            groups = {o for o in by_peer.values() if isinstance(o, Group)}
            if len(groups) > 1:
                split += 1
            if not groups:
                continue
            formed += 1
            group = max(groups, key=lambda g: len(g.members))
            names = {m.peer_id for m in group.members}
            hop = next(h for _, g, h in self.published[round_id] if g == group)
            one_hop += hop
            frozen = min(t for t, g, _ in self.published[round_id] if g == group)
            # live at the freeze, and working on this round (not one that restarted into a later round)
            live = {
                n
                for n in self.in_work[round_id]
                if self.died_at.get(n, math.inf) > frozen and by_peer.get(n) != "dead"
            }
            missing = live - names
            missing_total += len(missing)
            all_live += not missing
            known = [self.known_at[round_id][n] for n in names if n in self.known_at[round_id]]
            # global times: a record's ready_at is its peer's skewed clock
            ready = [self.ready_time[round_id][n] for n in names if n in self.ready_time[round_id]]
            if known and ready:
                latencies.append(max(known) - max(ready))
        latencies.sort()

        def pct(q: float) -> float:
            return (
                latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3 if latencies else math.nan
            )

        return {
            "peers": self.s.peers,
            "rounds": len(rounds),
            "formed": formed,
            "all_live": all_live / max(formed, 1),
            "missing_per_round": missing_total / max(formed, 1),
            "one_hop": one_hop / max(formed, 1),
            "freeze_p50_ms": pct(0.5),
            "freeze_p99_ms": pct(0.99),
            "split": split,
            "msgs_per_peer_round": self.messages / max(self.peer_rounds, 1),
            "decides_per_peer_round": self.decides / max(self.peer_rounds, 1),
            "crashes": self.crashes,
            "sim_seconds": seconds,
        }


def simulate(settings: Settings) -> dict[str, Any]:
    """Run one simulation; its summary (see the module docstring)."""
    result = Simulation(settings).run()
    if result["split"]:
        raise AssertionError(f"{result['split']} rounds with two groups: {result}")
    return result


def markdown(rows: list[dict[str, Any]], settings: Settings) -> str:
    lines = [
        f"work {settings.work} s +-{settings.spread:.0%}, RTT median {settings.rtt_ms:g} ms "
        f"(log-normal sigma {settings.rtt_sigma}), packets lost {settings.loss:.0%}, calls failed {settings.fail:.1%}, skew +-{settings.skew_ms:g} ms, "
        f"DHT delay {settings.dht_ms:g} ms, churn {settings.churn:.0%} of peers per round, "
        f"stragglers {settings.stragglers:.0%}"
        + ("" if settings.one_hop else "; leader only (no one-hop freeze)"),
        "",
        "| peers | rounds | all live | missing / round | one hop | freeze p50 ms | freeze p99 ms | msgs/peer/round "
        "| split | sim s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['peers']} | {r['rounds']} | {r['all_live']:.1%} | {r['missing_per_round']:.2f} | "
            f"{r['one_hop']:.0%} | {r['freeze_p50_ms']:.0f} | {r['freeze_p99_ms']:.0f} | "
            f"{r['msgs_per_peer_round']:.0f} | {r['split']} | {r['sim_seconds']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[16, 64, 256])
    defaults = Settings(peers=0)
    for name in ("rounds", "seed"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    for name in (
        "work",
        "spread",
        "stragglers",
        "rtt-ms",
        "rtt-sigma",
        "loss",
        "fail",
        "skew-ms",
        "dht-ms",
        "churn",
    ):
        attr = name.replace("-", "_")
        parser.add_argument(f"--{name}", type=float, default=getattr(defaults, attr))
    parser.add_argument(
        "--leader-only",
        action="store_true",
        help="records declare no expected set: every group through a leader",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    rows = []
    for n in args.peers:
        settings = Settings(
            peers=n,
            **{k: getattr(args, k) for k in ("rounds", "seed", "work", "spread", "stragglers")},
            **{
                k: getattr(args, k)
                for k in ("rtt_ms", "rtt_sigma", "loss", "fail", "skew_ms", "dht_ms", "churn")
            },
            one_hop=not args.leader_only,
        )
        row = simulate(settings)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    table = markdown(rows, settings)
    print(table if args.markdown else "\n".join(json.dumps(r) for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
