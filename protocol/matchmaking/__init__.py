"""Round matchmaking: which peers exchange together in outer round r (one group per round).

The rule (a pure function, `decide`, of an injected `now` and the records a peer sees, plus a thin driver,
`DHTMatchmaker`, that carries the records over the members' own gRPC links and keeps a copy in the DHT):

1. A peer that finished its local work for round r sends a *ready* record (peer id, gRPC address, ready_at in
   DHT time, the hash of the theta_outer it holds) to every live member over its authenticated link, and
   stores it in the background under `farloco/{run}/round/{r}` (sub-key = its public key, so the record is
   signed) for peers its links miss.
2. The round *opens* at the earliest ready_at seen. Its freeze deadline is `opened + wait`, where `wait` is the
   straggler wait proposed in the opening record (each peer proposes one from the round's own arrival
   statistics, `StragglerWait`, between `match_timeout_min` and `match_timeout`; 0 means `match_timeout`;
   never less than `leader_timeout`, which the argument below needs). All
   peers compute the same deadline from the same records, so a leader change cannot restart the clock.
3. **One hop.** Each ready record also declares the set of members its peer expects in the round (their number
   and a digest of their ids, `expected_digest`: the live members working on the round, the last group's
   members still in step, members catching up). When every peer of a set declared that very set, and the last
   of them was ready within `leader_timeout/2` of the opening, the set is the round's group: each peer holding
   their records knows it as the last one arrives, with no leader in between (`one_hop_sets`; peers outside it
   are late). This is the common round (the same members as last time, ready within a few seconds of each
   other); the leader below settles the rest (a member joining or vanishing, a straggler).
4. Leader candidates are the ready peers whose ready_at is at most `opened + wait - leader_timeout/2`
   (the *eligible* peers), ranked by peer id. Rank 0 is the leader: it freezes the group as soon as every
   live member whose member record says round r (and is not leaving) is ready and no member's record says
   a later round (such a member left round r, so r's group may already exist), but not before
   `opened + leader_timeout` (a one-hop freeze of others reaches it by then), and at the latest at the freeze
   deadline; it then publishes the group (sorted members with addresses and the theta hash each declared
   in its ready record; group_id = sha256 of the round, member ids and hashes): pushed to its members over the
   links, and stored under `farloco/{run}/round/{r}/group`.
5. Followers wait for a group record. If none appears, candidate k (k >= 1) takes over in the window
   `[freeze + k*leader_timeout, freeze + k*leader_timeout + leader_timeout/2)` and publishes the ready peers
   it sees minus the k candidates ranked before it (they failed to lead, so they are presumed dead). Every
   candidate, the leader included, publishes only inside its window, and only if it sees no group yet.
6. A member that learns the group from another member relays it once to the others and keeps a DHT copy under
   its own key (a group record may be stored by any of its members): a leader that dies having reached only
   some members, whose relays are lost, still has its group seen by every candidate before its window.
   A peer that sees group records takes the one from the lowest leader peer id. If it is not a member, it
   is late for r: `LateForRound` (it joins round r+1 and never blocks the others). When every candidate's
   window has passed without a group, every remaining peer is late.

Why it agrees: windows of different candidates are `leader_timeout/2` apart, the eligibility cutoff is
`leader_timeout/2` before the freeze, so if a record reaches every peer within `leader_timeout/2` (over a link
or through the DHT, clock skew included), at the freeze every peer sees the same candidates and at
most one candidate publishes. A one-hop set's records were all sent within `leader_timeout/2` of the earliest
ready_at any peer sees, so they reach every peer by `opened + leader_timeout`, before any candidate may publish
(`match_timeout >= leader_timeout` is needed for this; with a shorter one no peer freezes in one hop): every
candidate then sees the set complete and follows it instead. The early freeze is safe if a member's record moves to round r at least
twice that bound before it declares itself ready for r, which holds because the record moves when the local
work of round r starts. The lowest-leader tie-break only matters when those bounds are broken.

Who may write. Ready and group records are read only from signing keys that own a live, proven member record of
our run (`Membership.owners()`), and a ready record must speak for the peer id of that member record; anything
else (a foreign DHT node's records, a member's key claiming another peer id) is ignored, logged and counted in
`Membership.ignored` (NOT_A_MEMBER, PEER_ID_MISMATCH). A ready record from a key we do not know yet triggers one
re-read of the member table first, so a member whose record we have not seen yet is not dropped by mistake.

The package, one concern a file:

    records.py   the wire: ready and group records, the link messages and their methods, the round's DHT keys,
                 reading what the DHT holds of a round (`parse_ready`, `parse_groups`)
    rules.py     the rule itself, sans-IO: what a peer sees (`RoundView`), the round's schedule, `decide`, and
                 the straggler wait a peer proposes (`StragglerWait`)
    driver.py    `DHTMatchmaker`: pushes and relays over the members' links, the DHT copies and reads, the
                 waits; the only file with I/O
"""

from farloco.protocol.matchmaking.driver import DHTMatchmaker
from farloco.protocol.matchmaking.records import (
    AT_METHOD,
    GROUP_METHOD,
    MAX_WAIT,
    READY_METHOD,
    AtMessage,
    GroupRecord,
    LateForRound,
    MatchmakingError,
    ReadyRecord,
    RecordPush,
    expected_digest,
    parse_groups,
    parse_ready,
    round_key,
)
from farloco.protocol.matchmaking.rules import (
    Joined,
    Late,
    Publish,
    RoundSchedule,
    RoundView,
    StragglerWait,
    Wait,
    decide,
    one_hop_sets,
    schedule,
    spread_sample,
)

__all__ = [
    "AT_METHOD",
    "GROUP_METHOD",
    "MAX_WAIT",
    "READY_METHOD",
    "AtMessage",
    "DHTMatchmaker",
    "GroupRecord",
    "Joined",
    "Late",
    "LateForRound",
    "MatchmakingError",
    "Publish",
    "ReadyRecord",
    "RecordPush",
    "RoundSchedule",
    "RoundView",
    "StragglerWait",
    "Wait",
    "decide",
    "expected_digest",
    "one_hop_sets",
    "parse_groups",
    "parse_ready",
    "round_key",
    "schedule",
    "spread_sample",
]
