"""node/daemon/rules.py: every way a round goes on or closes, from its facts alone (no sockets, no processes),
and the properties the swarm relies on: a node commits only from a formed group with enough contributors, never
after a fork it could not heal; one that is left out always says why; catching up always targets the next round."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from farloco.node.daemon.rules import Action, RoundFacts, decide
from farloco.protocol import shares

BASE = RoundFacts(round_id=7, min_peers=2)


@pytest.mark.parametrize(
    ("facts", "action", "left_out", "reason"),
    [
        (BASE, Action.GO_ON, None, ""),
        (replace(BASE, matchmaking="failed"), Action.CATCH_UP, shares.NO_GROUP, "matchmaking failed"),
        (
            replace(BASE, matchmaking="late", group_formed=True),
            Action.CATCH_UP,
            shares.LATE,
            "late for round",
        ),
        (replace(BASE, matchmaking="late", group_formed=False), Action.ADVANCE, shares.NO_GROUP, "no group"),
        (replace(BASE, matchmaking="grouped", group_size=3), Action.GO_ON, None, ""),
        (
            replace(BASE, matchmaking="grouped", group_size=3, fork="unhealed", fork_error="donor gone"),
            Action.ABORT,
            None,
            "healing a fork: the winning side's state did not arrive (donor gone)",
        ),
        (
            replace(
                BASE, matchmaking="grouped", group_size=3, exchange="aborted", exchange_error="peer b hung"
            ),
            Action.ABORT,
            shares.EXCHANGE_FAILED,
            "exchange aborted: peer b hung",
        ),
        (
            replace(BASE, matchmaking="grouped", group_size=3, exchange="done", contributors=1),
            Action.ABORT,
            shares.TOO_FEW,
            "1 contributors < run.min_peers=2",
        ),
        (
            replace(BASE, matchmaking="grouped", group_size=3, exchange="done", contributors=2),
            Action.COMMIT,
            None,
            "",
        ),
        (
            replace(
                BASE, matchmaking="grouped", group_size=3, fork="healed", exchange="done", contributors=3
            ),
            Action.COMMIT,
            None,
            "",
        ),
    ],
)
def test_each_outcome(facts: RoundFacts, action: Action, left_out: str | None, reason: str) -> None:
    decision = decide(facts)
    assert decision.action is action
    assert decision.left_out == left_out
    assert reason in decision.reason
    if action is Action.CATCH_UP:
        assert decision.target_round == facts.round_id + 1


def test_a_healed_fork_redoes_the_contribution_unless_it_is_measured_from_the_ranks_start() -> None:
    healed = replace(BASE, matchmaking="grouped", group_size=2, fork="healed")
    assert decide(healed).redo_contribution
    assert not decide(replace(healed, fixed_reference=True)).redo_contribution
    assert not decide(replace(healed, fork="none")).redo_contribution


def test_invariants_over_every_combination_of_facts() -> None:
    """Whatever could happen: a commit needs a formed group, a healed or absent fork, a finished exchange and
    min_peers contributors; every close but a fork abort names why this node is left out; an abort carries
    its peer count; nothing goes on after the exchange."""
    combos = itertools.product(
        ("pending", "grouped", "failed", "late"),
        (False, True),
        ("none", "healed", "unhealed"),
        ("pending", "done", "aborted"),
        range(4),
        (1, 2, 3),
        (False, True),
    )
    for matchmaking, formed, fork, exchange, contributors, min_peers, fixed in combos:
        if matchmaking != "grouped" and (fork != "none" or exchange != "pending"):
            continue  # unreachable: the hash check and the exchange run only in a formed group
        facts = RoundFacts(
            round_id=3,
            min_peers=min_peers,
            matchmaking=matchmaking,  # type: ignore[arg-type]
            group_formed=formed,
            group_size=3,
            fork=fork,  # type: ignore[arg-type]
            fixed_reference=fixed,
            exchange=exchange,  # type: ignore[arg-type]
            contributors=contributors,
        )
        decision = decide(facts)
        if decision.action is Action.COMMIT:
            assert matchmaking == "grouped" and fork != "unhealed" and exchange == "done", facts
            assert contributors >= min_peers, facts
        if decision.action is Action.GO_ON:
            assert matchmaking in ("pending", "grouped") and exchange == "pending", facts
        if decision.action in (Action.CATCH_UP, Action.ADVANCE):
            assert decision.left_out is not None and matchmaking in ("failed", "late"), facts
        if decision.action is Action.ABORT:
            assert decision.reason and (decision.left_out is not None or fork == "unhealed"), facts
        if (
            matchmaking == "grouped"
            and fork != "unhealed"
            and exchange == "done"
            and contributors >= min_peers
        ):
            assert decision.action is Action.COMMIT, facts


def test_the_healing_rule_prefers_the_larger_side_then_more_outer_steps_then_the_lowest_peer_id() -> None:
    from farloco.node.daemon.rules import healing_winner

    # The larger side wins, whatever its steps.
    assert healing_winner({"p1": "aa", "p2": "bb", "p3": "bb"}, {"p1": 9, "p2": 4, "p3": 4}) == "bb"
    # 1:1: the theta that holds the round's update beats one closed without it, whichever id is lower (peer id
    # alone threw the update away when the member without it had the lower id).
    assert healing_winner({"p1": "aa", "p2": "bb"}, {"p1": 6, "p2": 7}) == "bb"
    assert healing_winner({"p1": "aa", "p2": "bb"}, {"p1": 7, "p2": 6}) == "aa"
    # Equal sides, equal steps: the lowest peer id, as before; a side's steps are its most declared.
    assert healing_winner({"p1": "aa", "p2": "bb"}, {"p1": 5, "p2": 5}) == "aa"
    assert (
        healing_winner({"p1": "aa", "p2": "aa", "p3": "bb", "p4": "bb"}, {"p1": 3, "p2": 3, "p3": 2, "p4": 4})
        == "bb"
    )
    assert healing_winner({"p2": "bb", "p1": "aa"}, {}) == "aa"  # nothing declared: steps count as 0
    with pytest.raises(ValueError, match="at least one claim"):
        healing_winner({}, {})
