"""Noticing a node that had peers and finds itself alone (sans-IO: every call takes `now`).

Alone is not always wrong: the others may have left (their departure tombstones say so), or the node may be the
first of its swarm. What must not pass in silence is a node whose peers *vanished*: their records expired without
a tombstone. From inside one node a crashed peer and a network partition look the same, and in a partition every
side that goes on training alone forks the swarm (four one-member swarms, four hashes, every status "training").
So a node in that state is **isolated**, and the agent's policy (ARCHITECTURE.md, "Isolation") is:

- say so at once: status state ``isolated``, the ``farloco_isolated`` metric, a warning and an ``isolated`` event
  naming the vanished peers;
- commit no round while isolated; try to reach the swarm again through the initial peers and the vanished peers'
  last addresses, and re-read the members, until `timeouts.isolation_timeout`;
- if a peer comes back: ``rejoined``, and the node takes the swarm's state if the swarm moved on;
- if none does in time: with ``run.min_peers`` > 1 the node can never commit alone, so it exits with an error
  (a supervisor restarts it and it joins afresh); with ``min_peers`` = 1 it goes on alone, saying so
  (``continuing_alone``), and the vanished peers are forgotten: only peers seen again can isolate it again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Verdict = Literal["connected", "alone", "isolated"]


@dataclass
class IsolationWatch:
    """What the node's view of its members says about it (see the module docstring).

    Feed it every member read with `observe(now, live, departed)`: `live` the peer ids of live members other than
    us, `departed` the peer ids whose departure tombstones were seen. `verdict` then says:
    ``connected`` (another member is live), ``alone`` (nobody else, and every peer we knew left properly, or we
    never had one) or ``isolated`` (nobody else, and `vanished` names the peers that disappeared without leaving).
    """

    known: set[str] = field(default_factory=set)  # peers seen live and neither departed nor forgotten
    vanished: tuple[str, ...] = ()
    isolated_since: float | None = None
    verdict: Verdict = "alone"
    episodes: int = 0  # how many times the node became isolated

    def observe(self, now: float, live: Iterable[str], departed: Iterable[str]) -> Verdict:
        live_now = set(live)
        self.known -= set(departed)
        if live_now:
            self.known |= live_now
            self.vanished, self.isolated_since, self.verdict = (), None, "connected"
            return self.verdict
        if not self.known:
            self.vanished, self.isolated_since, self.verdict = (), None, "alone"
            return self.verdict
        if self.isolated_since is None:
            self.isolated_since = now
            self.episodes += 1
        self.vanished = tuple(sorted(self.known))
        self.verdict = "isolated"
        return self.verdict

    def isolated_for(self, now: float) -> float:
        """Seconds the node has been isolated (0 when it is not)."""
        return 0.0 if self.isolated_since is None else max(0.0, now - self.isolated_since)

    def forget(self) -> None:
        """Go on alone: the vanished peers no longer isolate us (a peer seen live again is known again)."""
        self.known.clear()
        self.vanished, self.isolated_since, self.verdict = (), None, "alone"
