"""The optional C kernels of the int8 codec (optim/_kernels.c) against the torch path they replace: the same
payload bytes and the same decoded values, bit for bit, on awkward inputs; NaN/Inf and the invalid code -128
refused alike; and the kernels are really built wherever a C compiler is (as in CI)."""

from __future__ import annotations

import shutil

import pytest
import torch

from farloco.optim import CodecError, dense, get_codec

pytestmark = pytest.mark.skipif(
    dense.KERNELS is None and shutil.which("cc") is None, reason="no C compiler: the kernels were not built"
)


def test_kernels_are_built_where_a_compiler_is() -> None:
    assert dense.KERNELS is not None, (
        "farloco.optim._kernels did not build although a C compiler is installed"
    )


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    cases = [
        torch.randn(1000, generator=g),
        torch.randn(128 * 5, generator=g) * 1e-3,  # whole blocks only
        torch.randn(4097, generator=g) * 1e4,  # a short tail block
        torch.zeros(300),  # all-zero blocks: scale 0
        torch.full((129,), 3.25),  # constant
        torch.tensor([1e-45, -3e-44, 2e-40, 0.0] * 40),  # subnormal scales
        torch.cat(
            [torch.randn(200, generator=g) * 1e-30, torch.randn(200, generator=g) * 1e30]
        ),  # huge range
        torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0, -127.0] * 20) / 127 * 127,  # ties: round half even
        torch.empty(0),
        torch.tensor([-0.0, 0.0, 1.0]),
    ]
    # Exact ties of x / scale: absmax 127 gives scale 1, so x = k + 0.5 lands on a tie.
    ties = torch.arange(-126.5, 127, 1.0)
    cases.append(torch.cat([ties, torch.tensor([127.0])]))
    return cases


@pytest.mark.parametrize("block", [128, 1, 7, 4096])
def test_kernel_bytes_and_values_equal_the_torch_path(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    codec = get_codec("int8", block_size=block)
    for x in _inputs():
        fast = codec.encode(x)
        fast_data, fast_decoded = codec.encode_decoded(x)
        with monkeypatch.context() as m:
            m.setattr(dense, "KERNELS", None)
            slow = codec.encode(x)
            slow_values = codec.decode(slow)
        assert fast == slow == fast_data, (block, x[:8])
        values = codec.decode(fast)
        assert torch.equal(values.view(torch.int32), slow_values.view(torch.int32)), (block, x[:8])
        assert torch.equal(fast_decoded.view(torch.int32), values.view(torch.int32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_kernel_refuses_non_finite_input_like_the_torch_path(bad: float) -> None:
    x = torch.randn(1000)
    x[777] = bad
    with pytest.raises(CodecError, match="first at index 777"):
        get_codec("int8").encode(x)


def test_kernel_refuses_the_invalid_code() -> None:
    codec = get_codec("int8")
    data = bytearray(codec.encode(torch.randn(1000)))
    data[-5] = 0x80  # -128 as int8, in the last block
    # The CRC covers the body: recompute it so the codes check is what refuses the payload.
    import struct
    import zlib

    from farloco.optim.wire import HEADER_BYTES

    crc = zlib.crc32(bytes(data[HEADER_BYTES:]), zlib.crc32(bytes(data[:24])))
    struct.pack_into("<I", data, 24, crc)
    with pytest.raises(CodecError, match="-128"):
        codec.decode(bytes(data))


def test_kernel_checks_buffer_sizes() -> None:
    assert dense.KERNELS is not None
    x = torch.randn(10)
    with pytest.raises(ValueError, match="expected 10 float32 values"):
        dense.KERNELS.quantize(
            x.numpy(), 4, 127.0, torch.empty(2).numpy(), torch.empty(10, dtype=torch.int8).numpy(), None
        )
    with pytest.raises(ValueError, match="levels"):
        dense.KERNELS.quantize(
            x.numpy(), 4, 300.0, torch.empty(3).numpy(), torch.empty(10, dtype=torch.int8).numpy(), None
        )
    with pytest.raises(TypeError, match="writable"):
        dense.KERNELS.quantize(
            x.numpy(), 4, 127.0, bytes(12), torch.empty(10, dtype=torch.int8).numpy(), None
        )


def test_the_kernels_spread_over_threads_give_the_same_bytes_and_name_the_same_block() -> None:
    """At millions of values the kernels run on the agent's threads, each on a contiguous run of whole blocks
    (farloco.util.parallel, handed to the codec as the agent does): the payload, the decoded values and the block an error names are those of one
    thread."""
    from farloco.optim import ranges
    from farloco.util import parallel

    block = 100  # runs of whole blocks that do not fall on powers of two
    x = torch.randn(12_000_037, generator=torch.Generator().manual_seed(3))
    codec = get_codec("int8", block_size=block)
    threads = parallel.get_threads()
    ranges.set_range_runner(parallel.map_ranges)  # as the agent does
    try:
        parallel.set_threads(1)
        assert parallel.workers_for(4 * x.numel(), x.numel() // block) == 1
        one, one_decoded = codec.encode_decoded(x)
        one_values = codec.decode(one)
        parallel.set_threads(5)
        assert parallel.workers_for(4 * x.numel(), x.numel() // block) == 5
        many, many_decoded = codec.encode_decoded(x)
        assert many == one
        assert torch.equal(many_decoded.view(torch.int32), one_decoded.view(torch.int32))
        assert torch.equal(codec.decode(many).view(torch.int32), one_values.view(torch.int32))
        # A NaN in the last thread's run is found; a -128 code in the fourth run names its block, as one would.
        bad = x.clone()
        bad[-5] = float("nan")
        with pytest.raises(CodecError, match="NaN"):
            codec.encode(bad)
        payload = bytearray(one)
        codes_at = len(payload) - x.numel()
        payload[codes_at + 7_654_321] = 0x80
        with pytest.raises(CodecError, match=f"got -128 in block {7_654_321 // block}$"):
            codec.decode(bytes(payload), checksum=False)
    finally:
        parallel.set_threads(threads)
        ranges.set_range_runner(None)


def _awkward(n: int, seed: int) -> torch.Tensor:
    """Values over many magnitudes, signs and exact zeros, and subnormals: where a fused multiply-add or a
    reordered sum would round differently from the torch ops."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    x[::97] = 0.0
    x[5::101] = 1e-42
    return x


def _strategy_passes(n: int) -> list[torch.Tensor]:
    """Every outer-strategy pass the C kernels do, run through the strategies' own methods on awkward values:
    the tensors they wrote."""
    from farloco.optim.strategies import DeMo, DiLoCo, SparseLoCo, StreamingDiLoCo, _nesterov_step

    theta, buf, grad = _awkward(n, 1), _awkward(n, 2), _awkward(n, 3)
    written = []
    for lr, mu in ((0.7, 0.9), (1.0, 0.0), (0.123456789, 0.987654321)):
        _nesterov_step(theta, buf, grad, lr, mu)
    written += [theta, buf]
    diloco = DiLoCo(n, get_codec("int8"))
    assert diloco.residual is not None
    diloco.residual.copy_(_awkward(n, 4))
    out = torch.empty(n)
    assert diloco.make_contribution(theta, grad, out=out).data_ptr() == out.data_ptr()
    written.append(out)
    sparse = SparseLoCo(n, get_codec("int8"), beta=0.95)
    sparse.error_buffer.copy_(_awkward(n, 5))
    out = torch.empty(n)
    sparse.make_contribution(theta, grad, out=out)
    written.append(out)
    start = _awkward(n, 6)
    sparse.apply(start, _awkward(n, 7))  # SparseLoCo's outer step: theta - lr*mean
    written.append(start)
    start = _awkward(n, 8)
    diloco.eager_preview(start, _awkward(n, 9), _awkward(n, 10), 3)
    written.append(start)
    streaming = StreamingDiLoCo(n, get_codec("fp32"), num_fragments=min(n, 3), alpha=0.3)
    outer, local = _awkward(n, 11), _awkward(n, 12)
    fragment = streaming.current_fragment()
    streaming.apply(outer, _awkward(int(fragment.stop) - int(fragment.start), 13))
    streaming.merge_into_local(outer, local)
    written += [outer, local]
    for weight_decay in (0.0, 0.1):  # DeMo's sign step, with and without its decoupled weight decay
        demo = DeMo(n, get_codec("fp32"), lr=0.0123, weight_decay=weight_decay)
        start, mean = _awkward(n, 14), _awkward(n, 15)
        mean[3::89] = -0.0  # sign(-0.0) is +0.0, as sign(0.0)
        start[4::83] = -0.0
        demo.apply(start, mean)
        written.append(start)
    return written


@pytest.mark.parametrize("n", [1, 7, 1000, 1_000_003])
def test_strategy_kernels_give_the_torch_bits(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Contributions, outer steps, the eager preview and the streaming merge: the kernels' bits are the torch
    ops' (the same calls with the kernels switched off)."""
    fast = _strategy_passes(n)
    with monkeypatch.context() as m:
        m.setattr(dense, "KERNELS", None)
        slow = _strategy_passes(n)
    for i, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"pass {i} differs"


def test_strategy_kernels_run_on_threads_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    from farloco.optim import ranges
    from farloco.util import parallel

    one = _strategy_passes(3_000_017)
    threads = parallel.get_threads()
    ranges.set_range_runner(parallel.map_ranges)  # as the agent does
    try:
        parallel.set_threads(3)
        many = _strategy_passes(3_000_017)
    finally:
        parallel.set_threads(threads)
        ranges.set_range_runner(None)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_strategy_kernels_refuse_overlap_bad_ops_and_mismatched_lengths() -> None:
    kernels = dense.KERNELS
    assert kernels is not None
    empty = torch.empty(0).numpy()
    kernels.elementwise(0, (empty, empty, empty), (0.7, 0.9))
    a, b, c = torch.randn(10), torch.randn(10), torch.randn(10)
    an, bn, cn = a.numpy(), b.numpy(), c.numpy()
    with pytest.raises(ValueError, match="nesterov: expected buffer 0 apart from buffer 1"):
        kernels.elementwise(0, (an, an, bn), (0.7, 0.9))
    with pytest.raises(ValueError, match="nesterov: expected buffer 0 apart from buffer 1"):
        kernels.elementwise(0, (an[1:], an[:-1], bn[:-1]), (0.7, 0.9))
    with pytest.raises(ValueError, match="one length, got 40 and 36 bytes"):
        kernels.elementwise(0, (an, bn, cn[1:]), (0.7, 0.9))
    with pytest.raises(TypeError, match="writable"):
        kernels.elementwise(0, (an, bytes(40), cn), (0.7, 0.9))
    with pytest.raises(ValueError, match="expected 3 buffers and 2 scalars, got 2 and 2"):
        kernels.elementwise(0, (an, bn), (0.7, 0.9))
    with pytest.raises(ValueError, match=r"expected an op in \[0, 7\), got 7"):
        kernels.elementwise(7, (an,), ())
    with pytest.raises(TypeError, match="must be real number"):
        kernels.elementwise(5, (an, bn), ("x",))
    with pytest.raises(ValueError, match="sub_add: expected buffer 0 to be or be apart from buffer 1"):
        kernels.elementwise(1, (an[:-1], an[1:], bn[1:], cn[1:]), ())
    # A written buffer may be one of the inputs itself: each value is read before it is written.
    expected = (a - b).add_(c)
    kernels.elementwise(1, (cn, an, bn, cn), ())
    assert torch.equal(c, expected)
