"""Who took part in recent rounds, and why a live member did not (sans-IO).

Every round a node closes (committed, aborted, late, or sat out while isolated) it records the live members it
knew and the contributors of the round's mean (none when it did not commit). From that, `share(peer)` is the
fraction of the recent rounds in which `peer` was live *and* contributed: `farloco peers` shows it per peer and
`farloco status` our own. The round's leader also names every live member it left out, with a reason
(`left_out_reason`), and each node counts the rounds it was left out of itself; both go to the event log and to
per-reason metrics, so nobody is left out silently.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# Why a live member is not among a round's contributors, as its leader sees it.
LEAVING = "leaving"  # its record says it is leaving
BEHIND = "behind"  # its record says an earlier round: still training or exchanging that one, or syncing
NOT_READY = "not_ready"  # it works on this round but was not ready when the group froze
AHEAD = "ahead"  # its record says a later round: it left this round before the group formed
UNREACHABLE = "unreachable"  # in the group, but the exchange went on without it (did not answer, or excluded)
# Why we were not among a round's contributors, as we see it.
LATE = "late"  # a group formed without us
NO_GROUP = "no_group"  # no group formed at all
EXCHANGE_FAILED = "exchange_failed"  # we were grouped, but the exchange aborted or dropped us
ISOLATED = "isolated"  # our peers vanished: we committed nothing (protocol/isolation.py)
TOO_FEW = "too_few"  # fewer contributors than run.min_peers: nobody committed


def left_out_reason(state: str, their_round: int, round_id: int, *, in_group: bool) -> str:
    """The reason a live member (its record's `state` and `their_round`) is missing from round `round_id`'s
    contributors; `in_group`: it was a member of the round's group."""
    if in_group:
        return UNREACHABLE
    if state == "leaving":
        return LEAVING
    if their_round < round_id:
        return BEHIND
    if their_round > round_id:
        return AHEAD
    return NOT_READY


@dataclass
class RoundShares:
    """The last `window` rounds this node closed: (live member ids, contributor ids)."""

    window: int = 100
    rounds: deque[tuple[frozenset[str], frozenset[str]]] = field(init=False)
    left_out: Counter[str] = field(default_factory=Counter)  # rounds we were left out of, by reason
    peers_left_out: Counter[str] = field(default_factory=Counter)  # members we left out as leader, by reason

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1 round, got {self.window}")
        self.rounds = deque(maxlen=self.window)

    def record(self, live: Iterable[str], contributors: Iterable[str]) -> None:
        contributed = frozenset(contributors)
        self.rounds.append((frozenset(live) | contributed, contributed))

    def share(self, peer_id: str) -> float | None:
        """Fraction of the recent rounds in which `peer_id` was live that it contributed to (None: never live)."""
        live = [contributed for members, contributed in self.rounds if peer_id in members]
        if not live:
            return None
        return sum(peer_id in contributed for contributed in live) / len(live)
