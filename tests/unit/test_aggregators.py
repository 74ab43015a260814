"""Robust aggregation (`run.aggregator`): the rules of farloco.optim.aggregate bound what one
Byzantine member of 4 or 8 does to the result, are deterministic, and run inside the real exchange (the chunk
owner applies them), where every honest member still gets the same bits. A swarm of real nodes that outvotes an
insider: tests/integration/test_aggregators_swarm.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from farloco.node.config import AGGREGATOR_NAMES, ConfigError, build_config
from farloco.optim import AGGREGATORS, ATTACKS, Aggregator, aggregate, byzantine_update, get_codec, mean_of
from farloco.optim.aggregate import trimmed_count
from farloco.protocol.auth import Authenticator
from farloco.protocol.exchange import AverageResult, Exchange, ExchangeAborted
from farloco.protocol.rpc import RpcClient, RpcServer
from farloco.protocol.types import Group, GroupMember

ROBUST = [name for name in AGGREGATORS if name != "mean"]


def honest_updates(count: int, numel: int = 4096, seed: int = 0) -> list[torch.Tensor]:
    """`count` honest pseudo-gradients: a shared direction plus each worker's own noise."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(numel, generator=generator)
    return [shared + 0.5 * torch.randn(numel, generator=generator) for _ in range(count)]


def attacked(kind: str, honest: list[torch.Tensor], stale: torch.Tensor) -> torch.Tensor:
    """What a Byzantine member sends instead of its update (farloco.optim.ATTACKS)."""
    return byzantine_update(kind, honest[0], stale)


def test_the_config_and_optim_name_the_same_rules() -> None:
    assert AGGREGATOR_NAMES == AGGREGATORS
    with pytest.raises(ConfigError, match=r"run\.aggregator: expected one of .*got 'krum'"):
        build_config({"run": {"aggregator": "krum"}})
    assert [trimmed_count(m) for m in (1, 2, 3, 4, 5, 8, 9, 16)] == [0, 0, 1, 1, 1, 2, 2, 4]


@pytest.mark.parametrize("members", [4, 8])
@pytest.mark.parametrize("attack", ATTACKS)
def test_one_byzantine_member_moves_a_robust_result_little_and_the_mean_far(
    members: int, attack: str
) -> None:
    updates = honest_updates(members)
    stale = honest_updates(1, seed=99)[0]  # an update of another round: right scale, wrong direction
    target = mean_of(updates[1:])  # what the honest members would agree on without the attacker
    spread = max(float((u - target).norm()) for u in updates[1:])
    sent = [attacked(attack, updates, stale), *updates[1:]]
    errors = {name: float((aggregate(name, sent) - target).norm()) for name in AGGREGATORS}
    # One member's bounded say: at most about its share of twice the honest scale, whatever the attacker's scale
    # (the outlier-removing rules do better: within the honest members' own spread).
    share = 2 * max(float(u.norm()) for u in updates[1:]) / members
    for name in ROBUST:
        bound = spread if name in ("trimmed_mean", "median", "centered_clip") else spread + share
        assert errors[name] <= bound, (name, errors, spread, share)
    if attack != "stale":  # a stale update is within the honest scale: the mean is hurt little too
        assert errors["mean"] > 5 * max(errors[name] for name in ROBUST), errors


def test_rules_are_deterministic_and_reduce_to_the_plain_cases() -> None:
    updates = honest_updates(5, numel=1000)
    for name in AGGREGATORS:
        first = aggregate(name, updates)
        assert torch.equal(first, aggregate(name, [u.clone() for u in updates]))  # same bits every time
        assert first.dtype == torch.float32 and first.shape == (1000,)
        assert torch.equal(aggregate(name, updates[:1]), updates[0])  # one member: itself
    stacked = torch.stack(updates)
    assert torch.equal(aggregate("median", updates), stacked.sort(0).values[2])
    assert torch.allclose(aggregate("trimmed_mean", updates), stacked.sort(0).values[1:4].mean(0))
    same = [updates[0].clone() for _ in range(4)]  # identical contributions: every rule returns them
    for name in AGGREGATORS:
        assert torch.allclose(aggregate(name, same), updates[0], atol=1e-6)
    with pytest.raises(ValueError, match="expected one of"):
        Aggregator("krum")
    with pytest.raises(ValueError, match="expected a 1-D float32 tensor of 1000 values"):
        aggregate("median", [updates[0], updates[1][:10]])


class Member:
    def __init__(self, peer_id: str, rule: str) -> None:
        auth = Authenticator("aggregator-test", b"aggregator-test-secret", peer_id)
        self.peer_id = peer_id
        self.server = RpcServer(auth, data_port=0)
        self.client = RpcClient(auth)
        self.exchange = Exchange(self.server, self.client, peer_id, chunk_bytes=16 << 10)
        self.rule = None if rule == "mean" else Aggregator(rule)

    async def start(self) -> GroupMember:
        return GroupMember(self.peer_id, await self.server.start())

    async def stop(self) -> None:
        await self.client.close()
        await self.server.stop(0)


async def exchange(
    rules: list[str], inputs: list[torch.Tensor], codec: str
) -> list[AverageResult | Exception]:
    members = [Member(f"peer-{i}", rule) for i, rule in enumerate(rules)]
    try:
        group = Group.make(3, [await m.start() for m in members])
        return list(
            await asyncio.gather(
                *(
                    m.exchange.average(group, inputs[i], get_codec(codec), timeout=30, rule=m.rule)
                    for i, m in enumerate(members)
                ),
                return_exceptions=True,
            )
        )
    finally:
        for m in members:
            await m.stop()


@pytest.mark.parametrize("codec", ["fp32", "int8"])
@pytest.mark.parametrize("rule", ROBUST)
def test_the_exchange_applies_the_rule_per_chunk_and_every_member_gets_the_same_bits(
    rule: str, codec: str
) -> None:
    numel = 20_011  # 4 uneven parts of several 4096-value chunks
    inputs = honest_updates(4, numel=numel)
    inputs[2] = -1000.0 * inputs[2]  # peer-2 is Byzantine: sign flip x1000

    results = asyncio.run(asyncio.wait_for(exchange([rule] * 4, inputs, codec), 120))
    assert all(isinstance(r, AverageResult) for r in results), results
    for r in results:
        assert isinstance(r, AverageResult)
        assert torch.equal(r.averaged, results[0].averaged)  # bit-identical everywhere
    first = results[0]
    assert isinstance(first, AverageResult)
    # The owner applied the rule to each chunk of what every member transmitted (the codec's view of it).
    sent = [r.transmitted for r in results if isinstance(r, AverageResult)]
    if codec == "fp32":
        expected = torch.cat(
            [aggregate(rule, [t[a:b] for t in sent]) for a, b in chunk_ranges(numel, 4, 4096)]
        )
        assert torch.equal(first.averaged, expected)
    honest = mean_of([inputs[i] for i in (0, 1, 3)])
    spread = max(float((inputs[i] - honest).norm()) for i in (0, 1, 3))
    share = 2 * max(float(inputs[i].norm()) for i in (0, 1, 3)) / 4  # one member's bounded say (norm_clip)
    bound = spread + share if rule == "norm_clip" else spread
    assert float((first.averaged - honest).norm()) <= bound  # the x1000 member did not take it over


def chunk_ranges(numel: int, parts: int, chunk: int) -> list[tuple[int, int]]:
    base, extra = divmod(numel, parts)
    out, start = [], 0
    for index in range(parts):
        end = start + base + (1 if index < extra else 0)
        out += [(a, min(a + chunk, end)) for a in range(start, end, chunk)]
        start = end
    return out


def test_members_with_different_rules_refuse_each_other_naming_both() -> None:
    inputs = honest_updates(2, numel=5000)
    results = asyncio.run(asyncio.wait_for(exchange(["median", "mean"], inputs, "fp32"), 120))
    assert all(isinstance(r, ExchangeAborted) for r in results), results


def test_norm_rules_need_a_dense_codec() -> None:
    from farloco.node.daemon.core import build_outer

    sparse = {"strategy": "sparseloco", "codec": "topk"}
    config = build_config({"run": {**sparse, "aggregator": "centered_clip"}})
    with pytest.raises(ConfigError, match="needs a dense codec"):
        build_outer(config, 1000)
    build_outer(build_config({"run": {**sparse, "aggregator": "median"}}), 1000)
    build_outer(build_config({"run": {"strategy": "diloco", "aggregator": "centered_clip"}}), 1000)
