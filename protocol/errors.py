"""Error types shared by farloco.protocol: what a handler raises to refuse a request, what a caller sees.

They live here (not in rpc.py) so that auth.py can raise `Reject` without importing the transport.
`farloco.protocol.rpc` re-exports both; callers should import them from there.
"""

from __future__ import annotations

import grpc


class Reject(Exception):
    """Raised by a handler (or the authenticator) to refuse a request with a gRPC status and a stable reason.

    The server logs it, counts it under `reason` and answers with `code`; the caller sees an `RpcError`
    carrying the same code, reason and detail.
    """

    def __init__(self, code: grpc.StatusCode, reason: str, detail: str) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError(f"Reject needs a non-OK status code, got {code} (reason={reason})")
        super().__init__(f"{code.name} reason={reason}: {detail}")
        self.code = code
        self.reason = reason
        self.detail = detail


class RpcError(Exception):
    """What a caller sees when a call fails: deadline, unavailable peer, refused request, malformed answer."""

    def __init__(self, code: grpc.StatusCode, reason: str, detail: str) -> None:
        super().__init__(f"{code.name} reason={reason}: {detail}")
        self.code = code
        self.reason = reason
        self.detail = detail


class FrameError(ValueError):
    """Bytes that are not a valid farloco frame; `reason` is FRAME_TOO_LARGE or MALFORMED_FRAME."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
