"""The agent's round arithmetic (farloco.node.daemon.outer): the buffer-reusing path gives the same bits as the plain
strategy API, the chunked passes the same bits as whole-vector ones, and bad input from the ranks is named."""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest
import torch

from farloco.node.daemon.outer import OuterError, OuterRound, theta_hash
from farloco.optim import get_codec, make_strategy
from farloco.optim.strategies import CHUNK, StrategyError, _nesterov_step
from farloco.protocol.digest import digest

# Longer than two chunks, and not a multiple of one: the chunked passes' edges are covered.
NUMEL = 2 * CHUNK + 12_345
CASES = [
    ("diloco", "int8", {}),
    ("diloco", "fp32", {}),
    ("streaming-diloco", "int8", {"num_fragments": 3}),
    ("sparseloco", "topk", {}),
    ("demo", "int8", {"weight_decay": 0.01}),
]


@pytest.fixture(params=[1, 4], ids=["one-range", "four-threads"])
def agent_threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The passes as the agent runs them: one range on the calling thread, or cut into contiguous ranges over 4
    threads (util/parallel.py; its minimum work per thread lowered so that these short vectors split too)."""
    from farloco.optim import ranges
    from farloco.util import parallel

    threads = request.param
    before = parallel.get_threads()
    monkeypatch.setattr(parallel, "MIN_BYTES_PER_THREAD", 1)
    parallel.set_threads(threads)
    ranges.set_range_runner(parallel.map_ranges)
    assert parallel.workers_for(12 * NUMEL, -(-NUMEL // CHUNK)) == min(threads, 3)  # 3 chunks: 3 ranges
    try:
        yield threads
    finally:
        ranges.set_range_runner(None)
        parallel.set_threads(before)


def reference_nesterov(theta: torch.Tensor, b: torch.Tensor, g: torch.Tensor, lr: float, mu: float) -> None:
    """The whole-vector form the chunked step must match bit for bit."""
    b.mul_(mu).add_(g)
    step = b * mu
    step.add_(g).mul_(lr)
    theta.sub_(step)


def test_the_chunked_nesterov_step_gives_the_bits_of_the_whole_vector_step(agent_threads: int) -> None:
    generator = torch.Generator().manual_seed(3)
    theta, b, g = (torch.randn(NUMEL, generator=generator) for _ in range(3))
    theta2, b2 = theta.clone(), b.clone()
    for _ in range(3):
        _nesterov_step(theta, b, g, 0.7, 0.9)
        reference_nesterov(theta2, b2, g, 0.7, 0.9)
    assert torch.equal(theta, theta2) and torch.equal(b, b2)


@pytest.mark.parametrize(("name", "codec_name", "hparams"), CASES)
def test_the_agents_buffer_reusing_round_matches_the_plain_strategy_api(
    name: str, codec_name: str, hparams: dict[str, float], agent_threads: int
) -> None:
    """Two peers' worth of rounds through OuterRound (out=, reuse=True, buffer swaps) and through the plain
    allocating calls: theta, the strategy state and the hash agree bit for bit after every round, whether the
    agent's passes run as one range or over several threads."""
    codec = get_codec(codec_name)
    generator = torch.Generator().manual_seed(7)
    theta = torch.randn(NUMEL, generator=generator).mul_(0.02)
    fast = OuterRound(theta.clone(), make_strategy(name, NUMEL, codec, **hparams), codec)
    plain = make_strategy(name, NUMEL, codec, **hparams)
    plain_theta = theta.clone()
    for round_index in range(4):
        local = plain_theta + torch.randn(NUMEL, generator=generator).mul_(1e-3)
        contribution = fast.contribution(local)
        expected = plain.make_contribution(plain_theta, local)
        assert torch.equal(contribution, expected)
        transmitted = codec.decode(codec.encode(expected))
        other = torch.randn(expected.numel(), generator=generator).mul_(1e-3)
        averaged = (transmitted + other) * 0.5
        # Round 1: a range in no mean (a grouped round's slice without our row): nothing of it transmitted.
        withheld = ((1_000, 5_000),) if round_index == 1 else ()
        outer_hash = fast.commit(contribution, transmitted.clone(), averaged.clone(), withheld)
        for a, b in withheld:
            transmitted[a:b] = 0.0
        plain.propose(expected, transmitted)
        plain.apply(plain_theta, averaged)
        plain.commit()
        assert torch.equal(fast.theta, plain_theta)
        assert outer_hash == digest(plain_theta.numpy().tobytes())
        fast_state, plain_state = fast.strategy.state_dict(), plain.state_dict()
        assert fast_state.keys() == plain_state.keys()
        for key in plain_state:
            assert torch.equal(fast_state[key], plain_state[key]), key
        # The ranks continue from what `merged` builds, as from the plain merge.
        publish_buffer = torch.empty(NUMEL)
        load = fast.merged(local, publish_buffer)
        expected_load = local.clone()
        plain.merge_into_local(plain_theta, expected_load)
        assert torch.equal(load, expected_load)


def test_a_round_alone_sends_nothing_loses_nothing_and_keeps_the_work_buffer_apart() -> None:
    codec = get_codec("int8")
    outer = OuterRound(torch.zeros(1000), make_strategy("diloco", 1000, codec), codec)
    local = torch.full((1000,), -0.5)
    contribution = outer.contribution(local)
    transmitted, averaged = outer.alone(contribution)
    assert averaged.data_ptr() != contribution.data_ptr()  # commit consumes the contribution in place
    outer.commit(contribution, transmitted, averaged)
    # Nothing crossed a wire: no residual, the whole pseudo-gradient 0.5 was applied: -0.7 * (0.5 + 0.9 * 0.5).
    assert torch.equal(outer.strategy.state_dict()["residual"], torch.zeros(1000))
    assert torch.allclose(outer.theta, torch.full((1000,), -0.5 * 0.7 * 1.9))
    assert outer.rehash() == theta_hash(outer.theta)


def _resident_pages(tensor: torch.Tensor) -> int:
    """Pages of `tensor`'s memory the process has touched (mincore on an anonymous mapping: resident)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("reference", [False, True])
def test_prefault_writes_the_round_buffers_the_round_then_uses(reference: bool) -> None:
    """A joining agent has the outer thread write every page of the round's buffers once: the round uses those
    very buffers (no allocation of the model's size after), and their pages are resident before it starts."""
    numel = 3 * (1 << 20)  # 12 MiB each: far above malloc's mmap threshold, so fresh pages until written
    codec = get_codec("int8")
    outer = OuterRound(torch.zeros(numel), make_strategy("diloco", numel, codec), codec)
    outer.prefault(reference)
    work, (mean, sent) = outer._work, outer.exchange_buffers(numel)
    assert work is not None
    buffers = [work, mean, sent] + ([outer.reference(outer.theta)] if reference else [])
    assert (outer._reference is not None) == reference
    for buffer in buffers:
        assert _resident_pages(buffer) >= buffer.numel() * 4 // mmap.PAGESIZE - 1
    contribution = outer.contribution(torch.full((numel,), -0.5))
    assert contribution.data_ptr() == work.data_ptr()
    again = outer.exchange_buffers(numel)
    assert (again[0].data_ptr(), again[1].data_ptr()) == (mean.data_ptr(), sent.data_ptr())


def test_non_finite_weights_from_the_ranks_are_named() -> None:
    codec = get_codec("fp32")
    outer = OuterRound(torch.zeros(100), make_strategy("diloco", 100, codec), codec)
    local = torch.zeros(100)
    local[17] = float("nan")
    with pytest.raises(OuterError, match=r"non-finite parameters: .*1 NaN/Inf \(first at index 17"):
        outer.contribution(local)
    with pytest.raises(ValueError, match=r"expected float32\[100\], got torch.float64\[100\]"):
        OuterRound(torch.zeros(100, dtype=torch.float64), outer.strategy, codec)


def test_a_rolled_back_round_leaves_the_error_feedback_untouched() -> None:
    codec = get_codec("int8")
    outer = OuterRound(torch.zeros(1000), make_strategy("diloco", 1000, codec), codec)
    local = torch.linspace(-1, 1, 1000)
    contribution = outer.contribution(local)
    transmitted = codec.decode(codec.encode(contribution))
    outer.stage(contribution, transmitted, transmitted)
    outer.rollback()
    assert torch.equal(outer.strategy.state_dict()["residual"], torch.zeros(1000))
    assert torch.equal(outer.contribution(local), -local)  # the work buffer is scratch again
    # On demand, nothing is written before the commit: a round that does not commit has nothing to undo.
    outer.on_demand = True
    made = outer.contribution(local)
    outer.rollback()
    assert torch.equal(outer.strategy.state_dict()["residual"], torch.zeros(1000))
    with pytest.raises(ValueError, match="with no contribution made"):
        outer.commit(made, ((0, 1000),), torch.zeros(1000))


@pytest.mark.parametrize(("name", "codec", "options"), [CASES[0], CASES[3]])
def test_the_eager_start_previews_the_fresh_contribution_in_place_of_the_stale_one(
    name: str, codec: str, options: dict[str, float], agent_threads: int
) -> None:
    """The eager start point is theta_outer moved as the outer step would have moved it had this node's fresh
    transmitted contribution replaced its stale one in the mean of `group` members: checked against two real
    outer steps from the same state (the step is linear in the mean), and the fresh one is what the codec keeps
    of the contribution, kept as next round's stale."""
    generator = torch.Generator().manual_seed(5)
    theta, local, stale, others = (torch.randn(NUMEL, generator=generator) for _ in range(4))
    strategy = make_strategy(name, NUMEL, get_codec(codec), **options)
    outer = OuterRound(theta.clone(), strategy, get_codec(codec))
    contribution = outer.contribution(local, reference=theta + 0.01)
    torch.testing.assert_close(contribution, (theta + 0.01 - local) * 1.0, rtol=0, atol=0)  # no EF state yet
    start = torch.empty(NUMEL)
    group = 4
    outer.eager_start(start, contribution, group, ours_applied=False)  # the first: nothing of ours applied
    outer._stale.copy_(stale)  # as if the round just applied held this previewed contribution of ours
    outer.eager_start(start, contribution, group, ours_applied=True)
    fresh = get_codec(codec).decode(get_codec(codec).encode(contribution))
    torch.testing.assert_close(outer._stale, fresh)  # kept as next round's stale
    # Two outer steps from the same state: the mean with the stale contribution, and with the fresh one.
    with_stale = (others * (group - 1) + stale) / group
    with_fresh = with_stale + (fresh - stale) / group
    moved = []
    for mean in (with_stale, with_fresh):
        copy = make_strategy(name, NUMEL, get_codec(codec), **options)
        copy.load_state_dict(strategy.state_dict())
        target = theta.clone()
        copy.apply(target, mean)
        moved.append(target)
    torch.testing.assert_close(start - theta, moved[1] - moved[0], rtol=0, atol=1e-5)
    # None for stale: the round applied did not hold our contribution, so nothing of ours is taken out.
    outer.eager_start(start, contribution, group, ours_applied=False)
    torch.testing.assert_close(theta - start, fresh * strategy.eager_scale() / group, rtol=1e-5, atol=1e-6)


def test_a_contribution_measured_from_a_reference_leaves_theta_outer_alone() -> None:
    strategy = make_strategy("diloco", NUMEL, get_codec("fp32"))
    theta = torch.randn(NUMEL)
    outer = OuterRound(theta.clone(), strategy, get_codec("fp32"))
    reference, local = torch.randn(NUMEL), torch.randn(NUMEL)
    assert torch.equal(outer.contribution(local, reference), reference - local)
    assert torch.equal(outer.theta, theta)
    with pytest.raises(StrategyError, match="a delayed outer update"):
        make_strategy("demo", NUMEL, get_codec("int8")).eager_scale()


@pytest.mark.parametrize(
    ("name", "codec_name", "hparams"), [*CASES, ("diloco", "dct-topk", {}), ("demo", "dct-topk", {})]
)
def test_the_on_demand_round_matches_the_plain_strategy_api(
    name: str, codec_name: str, hparams: dict[str, float], agent_threads: int
) -> None:
    """OuterRound with `on_demand`: the contribution is an OnDemand (checked, never written whole), the exchange's
    ranges (a sparse codec: the payload it sent, encoded piece by piece) stand for what the swarm saw, and commit
    writes the state straight in; theta, the state and the hash agree bit for bit with the plain strategy API
    after every round, a round alone among them. Nothing of the model's size is allocated for the contribution
    or for `transmitted`."""
    from farloco.protocol.exchange import OnDemand

    codec = get_codec(codec_name)
    generator = torch.Generator().manual_seed(11)
    theta = torch.randn(NUMEL, generator=generator).mul_(0.02)
    fast = OuterRound(theta.clone(), make_strategy(name, NUMEL, codec, **hparams), codec)
    fast.on_demand = True
    fast.prefault(False)
    plain = make_strategy(name, NUMEL, codec, **hparams)
    plain_theta = theta.clone()
    for round_index in range(4):
        local = plain_theta + torch.randn(NUMEL, generator=generator).mul_(1e-3)
        contribution = fast.contribution(local)
        assert isinstance(contribution, OnDemand)
        expected = plain.make_contribution(plain_theta, local)
        assert torch.equal(contribution.chunk(0, contribution.numel), expected)
        n = expected.numel()
        if round_index == 2:  # a group of one: the mean is the contribution, nothing lost
            sent, averaged = fast.alone(contribution)
            assert sent is None and torch.equal(averaged, expected)
            transmitted, averaged = expected, averaged.clone()
        elif not codec.dense:  # what the exchange does with an OnDemand and a sparse codec
            sent = codec.encode_on_demand(n, contribution.fill, checksum=False)
            transmitted = codec.decode(sent, checksum=False)
            averaged = (transmitted + torch.randn(n, generator=generator).mul_(1e-3)) * 0.5
        else:
            sent = tuple((a, min(a + 50_000, n)) for a in range(0, n, 50_000))
            transmitted = torch.cat([codec.encode_decoded(expected[a:b])[1] for a, b in sent])
            averaged = (transmitted + torch.randn(n, generator=generator).mul_(1e-3)) * 0.5
        # Round 1 (dense codecs): a range in no mean, kept whole by the error feedback.
        withheld = ((10_000, 60_000),) if round_index == 1 and codec.dense else ()
        outer_hash = fast.commit(contribution, sent, averaged, withheld)
        plain.propose(expected, transmitted, withheld=withheld)
        plain.apply(plain_theta, averaged)
        plain.commit()
        assert torch.equal(fast.theta, plain_theta)
        assert outer_hash == digest(plain_theta.numpy().tobytes())
        for key, value in plain.state_dict().items():
            assert torch.equal(fast.strategy.state_dict()[key], value), (round_index, key)
    assert fast._work is None and fast._sent is None


@pytest.mark.parametrize("mean_per_round", [False, True])
def test_the_mean_is_kept_across_rounds_or_made_for_each_round(mean_per_round: bool) -> None:
    """On demand the round keeps only its mean: kept across rounds and written once ahead (prefault), or, with
    `mean_per_round` (ranks training on the host), made for each round and never held between rounds."""
    numel = 3 * (1 << 20)
    codec = get_codec("int8")
    outer = OuterRound(torch.zeros(numel), make_strategy("diloco", numel, codec), codec)
    outer.on_demand, outer.mean_per_round = True, mean_per_round
    outer.prefault(False)
    assert outer._work is None and outer._sent is None
    if mean_per_round:
        assert outer._mean is None
    else:
        assert outer._mean is not None
        assert _resident_pages(outer._mean) >= numel * 4 // mmap.PAGESIZE - 1
    first, second = outer.mean_buffer(numel), outer.mean_buffer(numel // 2)
    assert (first.numel(), second.numel()) == (numel, numel // 2)
    assert (first.data_ptr() == second.data_ptr()) != mean_per_round
    assert (outer._mean is None) == mean_per_round


def test_an_on_demand_round_names_nonfinite_weights_and_a_refused_mean_leaves_the_state_whole() -> None:
    codec = get_codec("int8")
    outer = OuterRound(torch.zeros(NUMEL), make_strategy("diloco", NUMEL, codec), codec)
    outer.on_demand = True
    local = torch.zeros(NUMEL)
    local[CHUNK + 5] = float("nan")
    with pytest.raises(OuterError, match=rf"non-finite parameters: .*values from {CHUNK}"):
        outer.contribution(local)
    local[CHUNK + 5] = 0.5
    contribution = outer.contribution(local)
    residual = outer.strategy.state_dict()["residual"]
    bad = torch.zeros(NUMEL)
    bad[7] = float("inf")
    with pytest.raises(StrategyError, match="averaged: expected only finite values"):
        outer.commit(contribution, ((0, NUMEL),), bad)
    assert torch.equal(outer.strategy.state_dict()["residual"], residual)
    with pytest.raises(ValueError, match="commit: an OnDemand contribution takes the ranges"):
        outer.commit(contribution, torch.zeros(NUMEL), torch.zeros(NUMEL))


@pytest.mark.parametrize(
    ("strategy", "codec", "update", "island", "expected"),
    [
        ("diloco", "int8", "sync", False, True),
        ("sparseloco", "topk", "sync", False, True),
        ("demo", "dct-topk", "sync", False, True),
        ("sparseloco", "topk", "delayed", False, False),
        ("diloco", "int8", "sync", True, False),
    ],
)
def test_the_agent_makes_its_contribution_on_demand_in_the_synchronous_loop(
    strategy: str, codec: str, update: str, island: bool, expected: bool
) -> None:
    """The agent's outer state (the run's tiny model) takes the on-demand round wherever its inputs stay put
    (the synchronous loop) and nothing reduces the contribution first (no island): dense and sparse codecs
    alike."""
    from farloco.node.config import build_config, run_hash
    from farloco.node.daemon.outerstate import OuterState

    run: dict[str, object] = {"strategy": strategy, "codec": codec, "outer_update": update}
    if strategy == "demo":
        run["inner_steps"] = 1
    node: dict[str, object] = {}
    if island:
        run["island_slices"] = 4
        node = {"island": "a", "island_endpoint": "127.0.0.1:29500"}
    config = build_config({"run": run, "node": node})
    outer = OuterState(config, run_hash(config))
    try:
        assert outer.round.on_demand is expected
    finally:
        outer.close()
