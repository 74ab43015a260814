"""Authenticator: HMAC tokens bound to run, sender, method, round, time and nonce (fake clock, no sockets)."""

from __future__ import annotations

import grpc
import pytest

from farloco.protocol.auth import KEY_NONCE, KEY_ROUND, Authenticator
from farloco.protocol.errors import Reject


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def pair(
    clock: FakeClock, *, secret: bytes = b"s3cret", run: str = "run-a"
) -> tuple[Authenticator, Authenticator]:
    sender = Authenticator(run, secret, "peerA", clock=clock)
    receiver = Authenticator("run-a", b"s3cret", "peerB", clock=clock)
    return sender, receiver


def refused(receiver: Authenticator, method: str, metadata: tuple[tuple[str, str], ...]) -> str:
    with pytest.raises(Reject) as info:
        receiver.verify(method, metadata)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    return info.value.reason


def test_good_token_accepted() -> None:
    clock = FakeClock()
    sender, receiver = pair(clock)
    assert receiver.verify("Exchange", sender.metadata("Exchange", 42)) == ("peerA", 42)
    clock.now += 29.0  # within max_skew of the receiver
    assert receiver.verify("Exchange", sender.metadata("Exchange", 43)) == ("peerA", 43)


def test_wrong_secret_refused() -> None:
    clock = FakeClock()
    sender, receiver = pair(clock, secret=b"other")
    assert refused(receiver, "Exchange", sender.metadata("Exchange", 1)) == "BAD_SIGNATURE"


def test_other_run_refused() -> None:
    clock = FakeClock()
    sender, receiver = pair(clock, run="run-b")
    assert refused(receiver, "Exchange", sender.metadata("Exchange", 1)) == "RUN_MISMATCH"


def test_tampered_round_and_method_refused() -> None:
    clock = FakeClock()
    sender, receiver = pair(clock)
    metadata = sender.metadata("Exchange", 7)
    tampered = tuple((k, "8" if k == KEY_ROUND else v) for k, v in metadata)
    assert refused(receiver, "Exchange", tampered) == "BAD_SIGNATURE"
    # A token minted for one method does not open another.
    assert refused(receiver, "FetchState", sender.metadata("Exchange", 7)) == "BAD_SIGNATURE"


def test_expired_and_future_timestamps_refused() -> None:
    clock = FakeClock()
    sender, receiver = pair(clock)
    old = sender.metadata("Exchange", 1)
    clock.now += 31.0
    assert refused(receiver, "Exchange", old) == "EXPIRED"
    clock.now -= 62.0  # token now 31 s in the future
    assert refused(receiver, "Exchange", old) == "EXPIRED"


def test_replayed_nonce_refused_and_forgotten_only_once_expired() -> None:
    clock = FakeClock()
    sender, receiver = pair(clock)
    metadata = sender.metadata("Exchange", 5)
    receiver.verify("Exchange", metadata)
    assert refused(receiver, "Exchange", metadata) == "REPLAYED_NONCE"
    clock.now += 20.0
    assert refused(receiver, "Exchange", metadata) == "REPLAYED_NONCE"
    clock.now += 20.0  # past max_skew: the nonce may be pruned, the timestamp check still refuses
    assert refused(receiver, "Exchange", metadata) == "EXPIRED"
    assert len(receiver._seen) <= 1


def test_missing_and_malformed_tokens_refused() -> None:
    clock = FakeClock()
    sender, receiver = pair(clock)
    assert refused(receiver, "Exchange", ()) == "MISSING_TOKEN"
    metadata = sender.metadata("Exchange", 5)
    bad_round = tuple((k, "five" if k == KEY_ROUND else v) for k, v in metadata)
    assert refused(receiver, "Exchange", bad_round) == "MALFORMED_TOKEN"
    short_nonce = tuple((k, "ab" if k == KEY_NONCE else v) for k, v in metadata)
    assert refused(receiver, "Exchange", short_nonce) == "MALFORMED_TOKEN"
    assert refused(receiver, "Exchange", (*metadata, (KEY_ROUND, "5"))) == "MALFORMED_TOKEN"


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="secret"):
        Authenticator("run", b"", "peer")
    with pytest.raises(ValueError, match="peer_id"):
        Authenticator("run", b"x", "")
