"""What a round does next, as a pure function of what happened in it so far: no sockets, no clocks, no state.

`RoundRunner._round` (node/daemon/rounds.py) runs the round's phases (matchmaking, the hash check, the exchange), records each one's outcome in
a `RoundFacts`, and after each phase asks `decide` whether to go on, and if not, how the round closes: commit the
outer step, abort it (theta_outer stays, the residual is kept), catch up with the swarm's state at the next
round boundary, or close the round without an update. The round runner then enacts the decision (`RoundRunner._close`).
Every rule the round follows is here, tested on its own (tests/unit/test_round_rules.py) as membership and
matchmaking are; the agent holds the I/O.

    facts = RoundFacts(round_id=r, min_peers=run.min_peers)
    facts = replace(facts, matchmaking="grouped", group_size=3)     # or "failed" / "late"
    decide(facts)  ->  Decision(Action.GO_ON)
    facts = replace(facts, exchange="done", contributors=3)
    decide(facts)  ->  Decision(Action.COMMIT)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from farloco.protocol import shares


class Action(enum.Enum):
    GO_ON = "go_on"
    """Nothing is decided yet: run the round's next phase."""
    COMMIT = "commit"
    """Take the outer step with the group's mean and move to round r+1."""
    ABORT = "abort"
    """No outer step: theta_outer and the error feedback stay as they were; round r+1 (the ranks keep their
    weights, so the round's work rolls into the next contribution)."""
    CATCH_UP = "catch_up"
    """The others moved on without us: take the swarm's state at the start of `target_round`."""
    ADVANCE = "advance"
    """Nobody formed a group, so nobody's theta changed: close round r without an update."""


@dataclass(frozen=True)
class RoundFacts:
    """What happened in round `round_id` so far (each phase fills its part)."""

    round_id: int
    min_peers: int
    matchmaking: Literal["pending", "grouped", "failed", "late"] = "pending"
    """failed: we could not even declare ourselves ready; late: the round was decided without us."""
    group_formed: bool = False
    """late: whether the others formed a group (they move to r+1) or nobody did."""
    group_size: int = 0
    fork: Literal["none", "healed", "unhealed"] = "none"
    """The hash check: our theta agreed, or disagreed and we took the winning side's (healed), or could not."""
    fork_error: str = ""
    fixed_reference: bool = False
    """Our contribution is measured from where the ranks started (run.outer_update delayed/eager), not from
    theta_outer: a healed fork leaves it valid."""
    exchange: Literal["pending", "done", "aborted"] = "pending"
    exchange_error: str = ""
    contributors: int = 0
    """Members whose contribution is in the mean (the exchange may drop some)."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    left_out: str | None = None
    """Why this node is left out of the round (a `protocol.shares` reason), or None."""
    target_round: int | None = None
    """CATCH_UP: the round whose starting state to take."""
    num_peers: int = 0
    """ABORT: the peers of the aborted round (the event says it)."""
    redo_contribution: bool = False
    """GO_ON after a healed fork: measure the contribution again from the theta now held."""


def decide(facts: RoundFacts) -> Decision:
    """The next step of a round, from its facts so far."""
    if facts.matchmaking == "pending":
        return Decision(Action.GO_ON)
    if facts.matchmaking == "failed":
        # Whatever the others did, take it from them.
        return Decision(
            Action.CATCH_UP, "matchmaking failed", shares.NO_GROUP, target_round=facts.round_id + 1
        )
    if facts.matchmaking == "late":
        if facts.group_formed:
            # The group moves to round r+1 without us: take its state at that boundary.
            return Decision(Action.CATCH_UP, "late for round", shares.LATE, target_round=facts.round_id + 1)
        # Nobody's theta changed: everyone moves on with the same theta, our work stays in the ranks.
        return Decision(Action.ADVANCE, "no group formed", shares.NO_GROUP)
    if facts.fork == "unhealed":
        # We hold the losing side of a fork and the winner's state did not arrive: contributing would average
        # into two models again. Sit this round out; the next one compares hashes again.
        return Decision(
            Action.ABORT,
            f"healing a fork: the winning side's state did not arrive ({facts.fork_error})",
            num_peers=1,
        )
    if facts.exchange == "pending":
        return Decision(Action.GO_ON, redo_contribution=facts.fork == "healed" and not facts.fixed_reference)
    if facts.exchange == "aborted":
        return Decision(
            Action.ABORT,
            f"exchange aborted: {facts.exchange_error}",
            shares.EXCHANGE_FAILED,
            num_peers=facts.group_size,
        )
    if facts.contributors < facts.min_peers:
        return Decision(
            Action.ABORT,
            f"{facts.contributors} contributors < run.min_peers={facts.min_peers}",
            shares.TOO_FEW,
            num_peers=facts.contributors,
        )
    return Decision(Action.COMMIT)


def healing_winner(claims: dict[str, str], updates: dict[str, int]) -> str:
    """The theta hash a group heals to when its members' declared hashes differ (the hash check; every member
    computes it from the same group record): the hash held by the most members; between sides of equal size the
    theta with more outer steps applied (`updates`: member -> its declared count; a member that closed a round
    without an update holds one fewer), then the side holding the lowest peer id."""
    holders: dict[str, set[str]] = {}
    for peer_id, outer_hash in claims.items():
        holders.setdefault(outer_hash, set()).add(peer_id)
    if not holders:
        raise ValueError("healing_winner: expected at least one claim, got none")
    steps = {h: max(updates.get(p, 0) for p in ids) for h, ids in holders.items()}
    return min(holders, key=lambda h: (-len(holders[h]), -steps[h], min(holders[h])))
