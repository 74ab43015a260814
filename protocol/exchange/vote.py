"""Votes: after the data phase every member tells every other its outcome, and all survivors decide alike.

Every member exchanges a small vote (`ExchangeVote`: "I have everything" plus the peers that sent it malformed
data, wire.py `Vote`) with every other member; the decision is a pure function of the votes from the members
that answered, so every survivor takes the same one (Exchange.average):
  * every answering member holds the full result -> return it (the contributors are the attempt's members:
    a part can only be complete with every member's contribution, so each part has the same contributor set);
  * otherwise drop the members that did not answer, that excluded themselves, or that a majority of the others
    reported as sending malformed data (`excluded`; each owner checks every chunk on arrival, so an insider that
    sent bad data to several owners is named by each of them), and run a fresh attempt among the rest (a new
    group id, parts re-assigned, every part re-reduced, so no part can include a dropped member's contribution);
  * if nobody can be dropped, or time runs out, raise `ExchangeAborted`, never a partial mean.
A member found in another group (GROUP_MISMATCH) aborts the round: going on without it would split it. A member
given up as gone (gone.py) is not asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc

from farloco.protocol.exchange.api import ExchangeAborted
from farloco.protocol.exchange.attempt import Attempt, Attempts
from farloco.protocol.exchange.gone import GONE_CHECK_SECONDS, GoneWatch
from farloco.protocol.exchange.wire import VOTE_METHOD, AttemptRef, Vote, VoteRequest
from farloco.protocol.rpc import CallContext, Frame, Reject, RpcClient, RpcError
from farloco.protocol.types import GroupMember
from farloco.util.tasks import cancel_and_wait

log = logging.getLogger("farloco.protocol.exchange")


class Voter:
    """Casts this node's votes through `client` and answers the others' (`ExchangeVote`) from `attempts`; members
    `watch` finds gone are not waited for."""

    def __init__(self, client: RpcClient, attempts: Attempts, watch: GoneWatch) -> None:
        self.client = client
        self.attempts = attempts
        self.watch = watch

    async def vote_phase(self, attempt: Attempt, deadline: float) -> dict[str, Vote]:
        """Tell every other member our outcome and learn theirs; returns peer_id -> vote for those that answered.

        A member behind NAT (not `dialable`) is never called: its vote is the one it sent us with its own call.
        Behind NAT ourselves, we learn another such member's vote from what the dialable members relay of the
        calls they got (`pv` in their answers), asking them again until it is there."""
        loop = asyncio.get_running_loop()
        mine = attempt.vote()
        assert attempt.status is not None
        attempt.status.set_result(mine)
        self.attempts.remember(attempt.key, mine, attempt.votes_in)
        relayed: dict[str, Vote] = {}
        mismatched: list[str] = []

        async def call(member: GroupMember) -> Vote | None:
            answer = await self.client.unary(
                member.address,
                VOTE_METHOD,
                Frame(VoteRequest(AttemptRef(attempt.key, attempt.attempt_no, attempt.stage), mine).encode()),
                round_id=attempt.round_id,
                timeout=max(0.001, deadline - loop.time()),
                link=True,  # the kept-open link (protocol/links.py): a repeated vote is the same vote
            )
            try:
                vote = Vote.decode(answer.header)
                relayed.update(relayed_votes(answer.header, attempt.member_ids))
            except Reject:
                log.warning("malformed vote from %s: %r", member.peer_id, answer.header.get("v"))
                return None
            return vote

        async def arrived(member: GroupMember) -> Vote | None:
            """The vote of a member behind NAT: sent to us with its call, or relayed by a dialable member."""
            while True:
                vote = attempt.votes_in.get(member.peer_id) or relayed.get(member.peer_id)
                if vote is not None:
                    return vote
                if loop.time() >= deadline:
                    return None
                attempt.voted.clear()
                if attempt.members[attempt.me].dialable:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(attempt.voted.wait(), timeout=RELAY_POLL_SECONDS)
                else:  # ask a dialable member again for what it has been sent since
                    await asyncio.sleep(RELAY_POLL_SECONDS)
                    for other in attempt.members:
                        if other.dialable and other.peer_id != self.attempts.peer_id:
                            with contextlib.suppress(RpcError):
                                await call(other)
                                break

        async def ask(member: GroupMember) -> Vote | None:
            if member.peer_id in attempt.gone:
                return None  # given up in the data phase: its vote would come at the deadline, if at all
            task = asyncio.ensure_future(call(member) if member.dialable else arrived(member))
            j = attempt.member_ids.index(member.peer_id)
            try:
                while self.watch.watching and not task.done():
                    await asyncio.wait({task}, timeout=GONE_CHECK_SECONDS)
                    if not task.done() and self.watch.lost(attempt, [j]):
                        attempt.gone.add(member.peer_id)
                        log.info(
                            "no vote from %s for %s: gone (no heartbeat)", member.peer_id, attempt.key[:12]
                        )
                        return None
                return await task
            except RpcError as exc:
                if exc.reason == "GROUP_MISMATCH":
                    # Alive but in another group: going on without it would split the round.
                    mismatched.append(member.peer_id)
                log.info("no vote from %s for %s: %s", member.peer_id, attempt.key[:12], exc)
                return None
            finally:
                if not task.done():
                    await cancel_and_wait(task)

        others = [m for j, m in enumerate(attempt.members) if j != attempt.me]
        # The dialable members first: behind NAT, their answers carry the others' votes.
        dialable = [m for m in others if m.dialable]
        stranded = [m for m in others if not m.dialable]
        answers = dict(zip(dialable, await asyncio.gather(*(ask(m) for m in dialable)), strict=True))
        answers |= dict(zip(stranded, await asyncio.gather(*(ask(m) for m in stranded)), strict=True))
        if mismatched:
            raise ExchangeAborted(
                "GROUP_MISMATCH",
                f"round {attempt.round_id}: {mismatched} are in another group than {attempt.key[:12]} "
                f"({attempt.member_ids})",
            )
        votes = {m.peer_id: v for m, v in answers.items() if v is not None}
        votes[self.attempts.peer_id] = mine
        return votes

    async def on_vote(self, ctx: CallContext, frame: Frame) -> Frame:
        """A member asks for our vote in an attempt (and tells us its own): the remembered one, or the one we cast
        once we do, with the votes other members sent us (`pv`: what a member behind NAT cannot ask for)."""
        request = VoteRequest.decode(frame.header)
        decided = self.attempts.decided(request.ref.group)
        if decided is not None:
            vote, votes_in = decided
            if ctx.sender not in votes_in:
                votes_in[ctx.sender] = request.vote
            return Frame(vote.encode() | relay_header(votes_in, ctx.sender))
        attempt = await self.attempts.find(ctx, request.ref)
        attempt.votes_in[ctx.sender] = request.vote
        attempt.voted.set()
        assert attempt.status is not None
        # Shielded: when the asker's deadline passes, gRPC cancels this handler, and a bare await would cancel
        # the vote's future with it: our own vote could then not be cast (vote_phase), nor read by the others.
        vote = await asyncio.shield(attempt.status)
        return Frame(vote.encode() | relay_header(attempt.votes_in, ctx.sender))


RELAY_POLL_SECONDS = 0.05  # behind NAT: how often a vote we wait for is asked of a dialable member again


def relay_header(votes_in: dict[str, Vote], asker: str) -> dict[str, Any]:
    """The `pv` field of a vote answer: the votes members sent us, but the asker's own."""
    relayed = {peer: vote.encode()["v"] for peer, vote in votes_in.items() if peer != asker}
    return {"pv": relayed} if relayed else {}


def relayed_votes(header: dict[str, Any], members: list[str]) -> dict[str, Vote]:
    """The votes a vote answer relays (`pv`), of the attempt's members only; `Reject` (BAD_VOTE) if malformed."""
    raw = header.get("pv", {})
    if not isinstance(raw, dict) or len(raw) > len(members):
        raise Reject(
            grpc.StatusCode.INVALID_ARGUMENT, "BAD_VOTE", f"expected a map of votes, got {type(raw)}"
        )
    return {peer: Vote.decode({"v": vote}) for peer, vote in raw.items() if peer in members}


def excluded(alive: list[GroupMember], votes: dict[str, Vote]) -> set[str]:
    """Members to drop: those that excluded themselves, those whose (numel, codec) differs from what a strict
    majority of the answering members have (everyone, if there is no such majority), and those that a strict
    majority of the other answering members reported as sending malformed data. An accusation without such a
    majority drops nobody (a lone accuser may be the liar) and the round aborts. Accuser and accused are not
    dropped together: with two honest members and one insider that leaves each honest member with a different
    theta (one aborts, one commits alone), and the hash check cannot break a one-against-one tie.
    A pure function of the votes, so it is the same on every member that saw the same votes."""
    dropped = set()
    kinds = [(votes[m.peer_id].numel, votes[m.peer_id].codec) for m in alive]
    majority = [kind for kind in set(kinds) if 2 * kinds.count(kind) > len(kinds)]
    for member in alive:
        if not majority or (votes[member.peer_id].numel, votes[member.peer_id].codec) != majority[0]:
            dropped.add(member.peer_id)
        reporters = [o.peer_id for o in alive if member.peer_id in votes[o.peer_id].bad]
        others = len(alive) - 1
        if member.peer_id in reporters or (others > 0 and 2 * len(reporters) > others):
            dropped.add(member.peer_id)
    return dropped
