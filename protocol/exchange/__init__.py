"""The collective exchange of one outer round: a weighted mean of every group member's tensor over gRPC.

Dense codecs use reduce-scatter + all-gather: the flat tensor is cut into one part per member, each member
streams its chunks of part j to member j, and j streams back the mean of each chunk as soon as it has every
member's contribution to it. Sparse codecs use an all-gather: every member streams its whole payload to every
other and each sums them all. The mean is bit-identical on every member that returns it. A round is a sequence of
attempts: a failed attempt is voted on, and the survivors retry without the members at fault, or abort alike.

Where each part lives:
  exchange.py   `Exchange`: average (the attempts loop and its deadlines), advance, close; registers the two
                server methods
  api.py        what it takes and gives: TensorCodec, RobustRule, OnDemand, AverageResult, ExchangeAborted
  plan.py       parts, chunks, lanes, spans (slices), attempt ids
  wire.py       the methods' frame headers as typed messages (Hello, Chunk, Piece, Done, Vote, VoteRequest),
                rejections and blame
  attempt.py    one attempt's state and failure (`Attempt`); the attempts this node knows of (`Attempts`:
                a peer's stream waiting for the local side, votes of finished attempts)
  push.py       `Pusher`: our chunks to each owner, the means back
  owner.py      `Owner`: members' chunks of our part taken in, checked, reduced, the means sent back
  reduce.py     the arithmetic run as codec jobs: our chunk encoded, a chunk's mean, the sparse mean
  codec.py      calls into the codec with their results checked; raw float32 views and finiteness
  codecpool.py  `CodecPool`: the codec's work on the exchange's own threads, and each attempt's `Jobs`
  vote.py       `Voter`: votes cast and answered; `excluded`, who the survivors drop
  gone.py       `GoneWatch`: members frozen mid-exchange given up before the deadline
"""

from farloco.protocol.exchange.api import AverageResult, ExchangeAborted, OnDemand, RobustRule, TensorCodec
from farloco.protocol.exchange.exchange import Exchange
from farloco.protocol.exchange.plan import lanes_for, slice_bounds
from farloco.protocol.exchange.wire import PUSH_METHOD, VOTE_METHOD

__all__ = [
    "PUSH_METHOD",
    "VOTE_METHOD",
    "AverageResult",
    "Exchange",
    "ExchangeAborted",
    "OnDemand",
    "RobustRule",
    "TensorCodec",
    "lanes_for",
    "slice_bounds",
]
