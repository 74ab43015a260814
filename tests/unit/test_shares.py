"""protocol/shares.py: each peer's share of recent rounds, and why a live member was left out (sans-IO)."""

from __future__ import annotations

import pytest

from farloco.protocol import shares
from farloco.protocol.shares import RoundShares, left_out_reason


def test_a_peers_share_counts_only_the_rounds_it_was_live_in() -> None:
    book = RoundShares(window=4)
    assert book.share("a") is None
    book.record(["a", "b"], ["a", "b"])
    book.record(["a", "b"], ["a"])  # b left out
    book.record(["a"], ["a"])  # b gone: not held against it
    assert book.share("a") == 1.0 and book.share("b") == 0.5
    book.record(["a", "c"], ["c"])  # a itself missed this one (late, say)
    assert book.share("a") == 0.75 and book.share("c") == 1.0
    book.record(["a"], ["a"])  # the window drops the oldest round
    assert book.share("b") == 0.0 and book.share("a") == 0.75
    with pytest.raises(ValueError, match="window must be >= 1"):
        RoundShares(window=0)


def test_the_leaders_reason_for_each_live_member_left_out() -> None:
    assert left_out_reason("exchanging", 7, 7, in_group=True) == shares.UNREACHABLE
    assert left_out_reason("leaving", 7, 7, in_group=False) == shares.LEAVING
    assert left_out_reason("syncing", 5, 7, in_group=False) == shares.BEHIND
    assert left_out_reason("training", 7, 7, in_group=False) == shares.NOT_READY
    assert left_out_reason("training", 8, 7, in_group=False) == shares.AHEAD
