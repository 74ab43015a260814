"""Per-call authentication of farloco RPCs: an HMAC-SHA256 token derived from the run secret.

Every call carries gRPC metadata naming the run, the sender, the round, a timestamp and a random nonce, plus
an HMAC over all of those *and the method name*, so a token cannot be moved to another run, another method or
another round, and cannot be replayed: the verifier remembers every nonce it accepted for as long as its
timestamp would still pass the skew check (after that the timestamp check alone refuses it).

Refusals raise `Reject(UNAUTHENTICATED, reason, detail)` with one of the stable reasons:
MISSING_TOKEN, MALFORMED_TOKEN, RUN_MISMATCH, BAD_SIGNATURE, EXPIRED, REPLAYED_NONCE.

The same secret also binds DHT identities: `member_proof(peer_id, owner)` is an HMAC over the run, the peer id
and the RSA public key that signs the member's DHT records (its sub-key). hivemind's signature validator proves
who wrote a sub-key; this proof says that writer holds the run secret and speaks for that peer id, so records of
keys without a valid proof are ignored (see farloco.protocol.membership).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Sequence

import grpc

from farloco.protocol.errors import Reject

_PREFIX = "farloco-"
KEY_RUN = _PREFIX + "run"
KEY_SENDER = _PREFIX + "sender"
KEY_ROUND = _PREFIX + "round"
KEY_TIME = _PREFIX + "ts-us"
KEY_NONCE = _PREFIX + "nonce"
KEY_MAC = _PREFIX + "mac"
_KEYS = (KEY_RUN, KEY_SENDER, KEY_ROUND, KEY_TIME, KEY_NONCE, KEY_MAC)
_NONCE_BYTES = 16
# Metadata values are ASCII; a peer id or run id longer than this is not a real one and only costs memory.
_MAX_FIELD_CHARS = 256


def _refuse(reason: str, detail: str) -> Reject:
    return Reject(grpc.StatusCode.UNAUTHENTICATED, reason, detail)


class Authenticator:
    """Signs outgoing calls and verifies incoming ones for one peer of one run.

    `secret` is the run's shared secret; `clock` returns seconds since the epoch (injectable for tests).
    """

    def __init__(
        self,
        run_id: str,
        secret: bytes,
        peer_id: str,
        *,
        max_skew: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not secret:
            raise ValueError("Authenticator needs a non-empty run secret, got b''")
        if max_skew <= 0:
            raise ValueError(f"max_skew must be > 0 seconds, got {max_skew}")
        for name, value in (("run_id", run_id), ("peer_id", peer_id)):
            if not value or len(value) > _MAX_FIELD_CHARS or not value.isascii():
                raise ValueError(f"{name} must be 1..{_MAX_FIELD_CHARS} ASCII characters, got {value!r}")
        self.run_id = run_id
        self.peer_id = peer_id
        self.max_skew = max_skew
        self._secret = secret
        self._clock = clock
        # (sender, nonce) -> the time after which its timestamp alone makes the token fail, so it can be forgotten.
        self._seen: dict[tuple[str, str], float] = {}
        self._next_prune = 0.0

    def _mac(self, run_id: str, sender: str, method: str, round_id: int, ts_us: int, nonce: str) -> str:
        message = "\0".join(("farloco-auth-v1", run_id, sender, method, str(round_id), str(ts_us), nonce))
        return hmac.new(self._secret, message.encode(), hashlib.sha256).hexdigest()

    def member_proof(self, peer_id: str, owner: bytes) -> str:
        """Proof that the holder of the run secret speaks for `peer_id` under the DHT signing key `owner`."""
        message = b"\0".join((b"farloco-member-v1", self.run_id.encode(), peer_id.encode(), owner))
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def check_member_proof(self, peer_id: str, owner: bytes, proof: str) -> bool:
        """Whether `proof` is `member_proof(peer_id, owner)` (constant-time comparison)."""
        if not isinstance(proof, str) or not proof.isascii() or not isinstance(owner, bytes):
            return False
        return hmac.compare_digest(self.member_proof(peer_id, owner), proof)

    def metadata(self, method: str, round_id: int) -> tuple[tuple[str, str], ...]:
        """gRPC metadata authenticating one call of `method` for `round_id` from this peer."""
        ts_us = int(self._clock() * 1e6)
        nonce = os.urandom(_NONCE_BYTES).hex()
        mac = self._mac(self.run_id, self.peer_id, method, round_id, ts_us, nonce)
        return (
            (KEY_RUN, self.run_id),
            (KEY_SENDER, self.peer_id),
            (KEY_ROUND, str(round_id)),
            (KEY_TIME, str(ts_us)),
            (KEY_NONCE, nonce),
            (KEY_MAC, mac),
        )

    def verify(self, method: str, metadata: Sequence[tuple[str, str | bytes]]) -> tuple[str, int]:
        """Check the token of an incoming call of `method`; return (sender peer_id, round_id) or raise Reject."""
        fields: dict[str, str] = {}
        for key, value in metadata:
            if key in _KEYS:
                if isinstance(value, bytes):
                    raise _refuse("MALFORMED_TOKEN", f"metadata {key} must be ASCII text, got bytes")
                if key in fields:
                    raise _refuse("MALFORMED_TOKEN", f"metadata {key} appears more than once")
                fields[key] = value
        missing = [key for key in _KEYS if key not in fields]
        if missing:
            raise _refuse(
                "MISSING_TOKEN", f"call of {method} lacks metadata {missing}; expected all of {_KEYS}"
            )
        run_id, sender, nonce, mac = fields[KEY_RUN], fields[KEY_SENDER], fields[KEY_NONCE], fields[KEY_MAC]
        if run_id != self.run_id:
            raise _refuse(
                "RUN_MISMATCH", f"expected run {self.run_id!r}, got {run_id[:64]!r} from {sender[:64]}"
            )
        try:
            round_id = int(fields[KEY_ROUND])
            ts_us = int(fields[KEY_TIME])
        except ValueError:
            raise _refuse(
                "MALFORMED_TOKEN",
                f"round and timestamp must be integers, got round={fields[KEY_ROUND][:32]!r} "
                f"ts={fields[KEY_TIME][:32]!r}",
            ) from None
        if len(sender) > _MAX_FIELD_CHARS or len(nonce) != 2 * _NONCE_BYTES:
            raise _refuse(
                "MALFORMED_TOKEN",
                f"expected a sender of at most {_MAX_FIELD_CHARS} chars and a {2 * _NONCE_BYTES}-hex-digit nonce, "
                f"got sender of {len(sender)} chars and nonce of {len(nonce)}",
            )
        expected = self._mac(run_id, sender, method, round_id, ts_us, nonce)
        if not hmac.compare_digest(expected, mac):
            raise _refuse(
                "BAD_SIGNATURE",
                f"HMAC does not match for method={method} round={round_id} sender={sender} "
                "(wrong secret, or method/round/sender/timestamp/nonce altered)",
            )
        now = self._clock()
        skew = abs(now - ts_us / 1e6)
        if skew > self.max_skew:
            raise _refuse(
                "EXPIRED",
                f"token timestamp is {skew:.1f}s from local time, expected at most {self.max_skew}s "
                f"(sender={sender})",
            )
        self._prune(now)
        seen_key = (sender, nonce)
        if seen_key in self._seen:
            raise _refuse("REPLAYED_NONCE", f"nonce {nonce} from {sender} was already used (method={method})")
        # Past ts + max_skew the EXPIRED check refuses this token anyway, so the nonce can be forgotten then.
        self._seen[seen_key] = ts_us / 1e6 + self.max_skew
        return sender, round_id

    def _prune(self, now: float) -> None:
        # Amortised: scan at most once per max_skew/4 so verification stays O(1) on average.
        if now < self._next_prune:
            return
        self._next_prune = now + self.max_skew / 4
        self._seen = {key: expiry for key, expiry in self._seen.items() if expiry >= now}
