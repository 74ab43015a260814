"""farloco.optim: outer strategies, codecs, error feedback and aggregation. Pure tensor math, no I/O.

Codecs turn a flat float32 pseudo-gradient into self-describing bytes and back (`get_codec`); strategies turn
(theta_outer, theta_local) into a contribution and apply the swarm's mean as the outer step (`make_strategy`);
`mean_of` is the deterministic aggregation the exchange uses between the two; `aggregate` adds the robust rules
of `run.aggregator`.
"""

from farloco.optim.aggregate import AGGREGATORS, ATTACKS, Aggregator, aggregate, byzantine_update, mean_of
from farloco.optim.registry import available_codecs, get_codec
from farloco.optim.strategies import (
    DeMo,
    DiLoCo,
    OuterStrategy,
    SparseLoCo,
    StrategyError,
    StreamingDiLoCo,
    available_strategies,
    make_strategy,
)
from farloco.optim.wire import Codec, CodecError

__all__ = [
    "AGGREGATORS",
    "ATTACKS",
    "Aggregator",
    "Codec",
    "CodecError",
    "DeMo",
    "DiLoCo",
    "OuterStrategy",
    "SparseLoCo",
    "StrategyError",
    "StreamingDiLoCo",
    "aggregate",
    "available_codecs",
    "available_strategies",
    "byzantine_update",
    "get_codec",
    "make_strategy",
    "mean_of",
]
