"""Codec behaviour: documented round-trip bounds, determinism, edge-case tensors, and refusal of bad input/bytes."""

from __future__ import annotations

import math
import re
import struct
import zlib

import numpy as np
import pytest
import scipy.fft
import torch
from helpers.memory import CAN_MEASURE, peak_growth_mib
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from farloco.optim import Codec, CodecError, available_codecs, get_codec, mean_of
from farloco.optim.sparse import _dct_integer_table, _inverse_dct_rows, dct_matrix
from farloco.optim.wire import FLAG_NO_CRC, HEADER_BYTES, all_finite

HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Small chunk/block options so that short hypothesis tensors still span several blocks and a ragged tail.
SMALL_OPTIONS: dict[str, dict[str, int]] = {
    "fp32": {},
    "fp16": {},
    "bf16": {},
    "int8": {"block_size": 16},
    "int4": {"block_size": 8},
    "topk": {"k": 5, "chunk": 32},
    "topk2": {"k": 5, "chunk": 32, "value_bits": 2},
    "dct-topk": {"k": 6, "chunk": 16},
}
CODEC_CASES = list(SMALL_OPTIONS)


def make(case: str) -> Codec:
    name = "topk" if case == "topk2" else case
    return get_codec(name, **SMALL_OPTIONS[case])


def tensors(max_size: int = 300) -> st.SearchStrategy[torch.Tensor]:
    """1-D float32 tensors of mixed magnitude: values in [-1, 1] times 10**e for a per-tensor e in [-30, 30]."""
    values = st.lists(st.floats(-1.0, 1.0, width=32), max_size=max_size)
    return st.builds(
        lambda v, e: torch.tensor(v, dtype=torch.float32) * (10.0**e), values, st.integers(-30, 30)
    ).filter(lambda t: bool(torch.isfinite(t).all()))


def blocks(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(x.split(size)) if x.numel() else []


def check_bound(case: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """Assert the round-trip error bound each codec documents."""
    assert y.dtype == torch.float32 and y.shape == x.shape
    xd, yd = x.double(), y.double()
    err = (xd - yd).abs()
    if case == "fp32":
        assert torch.equal(x, y)
    elif case in ("fp16", "bf16"):
        rel = 2.0**-11 if case == "fp16" else 2.0**-8
        floor = 2.0**-25 if case == "fp16" else 2.0**-134
        assert bool((err <= rel * xd.abs() + floor).all())
    elif case in ("int8", "int4"):
        levels = 127 if case == "int8" else 7
        size = SMALL_OPTIONS[case]["block_size"]
        for bx, be in zip(blocks(x, size), blocks(err, size), strict=True):
            scale = float(bx.abs().max()) / levels
            assert float(be.max()) <= scale / 2 * (1 + 1e-5) + 2.0**-126
    elif case in ("topk", "topk2"):
        k, chunk = SMALL_OPTIONS[case]["k"], SMALL_OPTIONS[case]["chunk"]
        for bx, by in zip(blocks(x, chunk), blocks(y, chunk), strict=True):
            kept = by != 0
            kc = min(k, bx.numel())
            assert int(kept.sum()) <= kc
            magnitude = bx.abs()
            threshold = float(magnitude.topk(kc).values[-1])
            if case == "topk":
                # every value above the k-th largest magnitude survives unless fp16 flushes it to zero
                assert bool((kept | (magnitude <= threshold) | (bx.half() == 0)).all())
                nonzero_fp16 = int((bx.half() != 0).sum())
                assert int(kept.sum()) == min(kc, nonzero_fp16)
                assert bool((~kept | (magnitude >= threshold)).all())
                e = (bx.double() - by.double()).abs()[kept]
                assert bool((e <= 2.0**-11 * bx.double().abs()[kept] + 2.0**-25).all())
            else:
                if threshold > 0:
                    assert bool((kept | (magnitude <= threshold)).all())
                top = float(magnitude.max())
                e = (bx.double() - by.double()).abs()[kept]
                # (M - m)/4 as the codec documents it, up to its float32 levels' rounding: relative among normal
                # magnitudes, one ulp (2^-149) among subnormal ones
                assert bool((e <= top / 4 * (1 + 1e-6) + 2.0**-149).all())
                same_sign = (by[kept].sign() == bx[kept].sign()) | (bx[kept] == 0)
                assert bool(same_sign.all())
    elif case == "dct-topk":
        k, chunk = SMALL_OPTIONS[case]["k"], SMALL_OPTIONS[case]["chunk"]
        for bx, by in zip(blocks(x, chunk), blocks(y, chunk), strict=True):
            coefficients = scipy.fft.dct(bx.double().numpy(), norm="ortho")
            kc = min(k, bx.numel())
            energy = np.sort(coefficients**2)
            dropped = math.sqrt(float(energy[: bx.numel() - kc].sum()))
            quantisation = math.sqrt(kc) * float(np.abs(coefficients).max()) / 32767 / 2
            noise = 1e-5 * float(bx.double().norm()) + 1e-37
            assert float((bx.double() - by.double()).norm()) <= dropped + quantisation + noise


def test_two_bit_topk_gives_each_value_the_nearer_level_even_among_subnormals() -> None:
    """A chunk of 0 and the smallest subnormal: its levels are 0 and 2^-149, whose float32 midpoint rounds to 0,
    and the 0 took the high level (off by the chunk's whole range). Each value takes the nearer level, exactly."""
    x = torch.tensor([0.0, 2.0**-149, -(2.0**-149)])
    assert torch.equal(make("topk2").decode(make("topk2").encode(x)), x)


@pytest.mark.parametrize("case", CODEC_CASES)
@HYPOTHESIS
@given(x=tensors())
@example(x=torch.tensor([0.0, 2.0**-149]))  # what the search found once (the test above)
def test_round_trip_within_documented_bound(case: str, x: torch.Tensor) -> None:
    codec = make(case)
    if case in ("fp16", "topk") and bool((x.abs() > 65504).any()):
        with pytest.raises(CodecError, match="65504"):
            codec.encode(x)
        return
    data = codec.encode(x)
    check_bound(case, x, codec.decode(data))


@pytest.mark.parametrize("case", CODEC_CASES)
@HYPOTHESIS
@given(x=tensors(), data=st.data())
def test_decode_is_deterministic_and_rejects_any_single_corruption(
    case: str, x: torch.Tensor, data: st.DataObject
) -> None:
    codec = make(case)
    x = x.clamp(-60000, 60000)
    payload = codec.encode(x)
    first = codec.decode(payload)
    # Same bytes from any buffer type -> the same bits; the result is a fresh, writable tensor.
    assert torch.equal(first, codec.decode(memoryview(bytearray(payload))))
    assert first.view(torch.int32).tolist() == codec.decode(payload).view(torch.int32).tolist()
    first.add_(1.0)  # must not touch the payload
    assert torch.equal(codec.decode(payload) + 1.0, first)
    position = data.draw(st.integers(0, len(payload) - 1))
    flip = data.draw(st.integers(1, 255))
    corrupted = bytearray(payload)
    corrupted[position] ^= flip
    with pytest.raises(CodecError):
        codec.decode(bytes(corrupted))
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(CodecError):
        codec.decode(payload[:cut])
    with pytest.raises(CodecError):
        codec.decode(payload + b"\0")


EDGE_CASES = {
    "empty": torch.empty(0),
    "one": torch.tensor([0.37]),
    "zeros": torch.zeros(1000),
    "constant": torch.full((1000,), -2.5),
    "tiny": torch.linspace(-1, 1, 1001) * 1e-30,
    "huge": torch.linspace(-1, 1, 1001) * 1e30,
    "huge-range": torch.tensor([1e30, -1e-30, 1.0, 0.0, -3e29, 7e-25] * 50),
}


@pytest.mark.parametrize("case", CODEC_CASES)
@pytest.mark.parametrize("edge", sorted(EDGE_CASES))
def test_edge_case_tensors(case: str, edge: str) -> None:
    codec = make(case)
    x = EDGE_CASES[edge]
    # fp16 values cannot hold 1e30: refusing is the documented behaviour (no silent inf or saturation).
    if case in ("fp16", "topk") and edge in ("huge", "huge-range"):
        with pytest.raises(CodecError, match="65504"):
            codec.encode(x)
        return
    y = codec.decode(codec.encode(x))
    check_bound(case, x, y)
    if edge == "zeros":
        assert torch.equal(y, x)
    if edge == "constant" and case in ("fp32", "fp16", "bf16", "int8", "int4"):
        assert torch.equal(y, x)


@pytest.mark.parametrize("case", CODEC_CASES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 17, 999])
def test_non_finite_input_is_refused(case: str, bad: float, where: int) -> None:
    x = torch.randn(1000)
    x[where] = bad
    with pytest.raises(CodecError, match="finite"):
        make(case).encode(x)


@pytest.mark.parametrize("case", CODEC_CASES)
def test_wrong_dtype_shape_or_type_is_refused(case: str) -> None:
    codec = make(case)
    with pytest.raises(CodecError, match=r"expected torch\.float32, got torch\.float64"):
        codec.encode(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(CodecError, match=r"expected a 1-D tensor, got shape \[2, 2\]"):
        codec.encode(torch.zeros(2, 2))
    with pytest.raises(CodecError, match=re.escape("expected a torch.Tensor, got list")):
        codec.encode([1.0, 2.0])  # type: ignore[arg-type]


@pytest.mark.parametrize("case", CODEC_CASES)
def test_non_contiguous_or_grad_input_is_encoded_by_value(case: str) -> None:
    x = torch.randn(400)
    codec = make(case)
    assert codec.encode(x[::2]) == codec.encode(x[::2].clone())
    assert codec.encode(torch.nn.Parameter(x)) == codec.encode(x)


def rewrite(payload: bytes, offset: int, fmt: str, *values: object) -> bytes:
    """Patch the payload and fix up the CRC, to reach the checks that come after it."""
    data = bytearray(payload)
    struct.pack_into(fmt, data, offset, *values)
    crc = zlib.crc32(memoryview(data)[HEADER_BYTES:], zlib.crc32(memoryview(data)[:24]))
    struct.pack_into("<I", data, 24, crc)
    return bytes(data)


def test_header_errors_name_expected_and_got() -> None:
    payload = get_codec("int8").encode(torch.randn(100))
    with pytest.raises(CodecError, match="expected at least 32 header bytes, got 5"):
        get_codec("int8").decode(payload[:5])
    with pytest.raises(CodecError, match=r"magic: expected b'FLOC', got b'XLOC'"):
        get_codec("int8").decode(b"X" + payload[1:])
    with pytest.raises(CodecError, match="format version: expected 1, got 9"):
        get_codec("int8").decode(rewrite(payload, 4, "<B", 9))
    with pytest.raises(CodecError, match=r"codec: expected 'fp16' \(id 2\), got 'int8' \(id 4\)"):
        get_codec("fp16").decode(payload)
    with pytest.raises(CodecError, match="body for numel=101: expected"):
        get_codec("int8").decode(rewrite(payload, 8, "<Q", 101))
    with pytest.raises(CodecError, match="numel=18446744073709551615"):
        get_codec("int8").decode(rewrite(payload, 8, "<Q", 2**64 - 1))  # must not try to allocate
    with pytest.raises(CodecError, match="CRC-32"):
        get_codec("int8").decode(payload[:-1] + bytes([payload[-1] ^ 1]))
    with pytest.raises(CodecError, match="block >= 1"):
        get_codec("int8").decode(rewrite(payload, 16, "<I", 0))


def test_decode_uses_the_payload_parameters_not_the_instance_options() -> None:
    x = torch.randn(1000)
    assert torch.equal(
        get_codec("int8").decode(get_codec("int8", block_size=7).encode(x)),
        get_codec("int8", block_size=7).decode(get_codec("int8", block_size=7).encode(x)),
    )
    sparse = get_codec("topk", k=3, chunk=50, value_bits=2).encode(x)
    assert int((get_codec("topk").decode(sparse) != 0).sum()) == 60


def test_semantic_corruption_behind_a_valid_crc_is_refused() -> None:
    """Payloads a buggy or hostile peer could produce with a correct CRC still never decode to garbage."""
    x = torch.randn(100)
    int8 = get_codec("int8", block_size=50).encode(x)
    with pytest.raises(CodecError, match="scale 1: expected a finite value >= 0, got nan"):
        get_codec("int8").decode(rewrite(int8, HEADER_BYTES + 4, "<f", math.nan))
    with pytest.raises(CodecError, match=re.escape("scale 0: expected a finite value >= 0, got -1.0")):
        get_codec("int8").decode(rewrite(int8, HEADER_BYTES, "<f", -1.0))
    with pytest.raises(CodecError, match=r"\[-127, 127\], got -128"):
        get_codec("int8").decode(rewrite(int8, HEADER_BYTES + 8 + 3, "<b", -128))
    int4 = get_codec("int4", block_size=50).encode(x[:99])
    with pytest.raises(CodecError, match=re.escape("nibbles in 1..15")):
        get_codec("int4").decode(rewrite(int4, HEADER_BYTES + 8, "<B", 0x80))
    with pytest.raises(CodecError, match="padding nibble: expected 8"):
        get_codec("int4").decode(rewrite(int4, len(int4) - 1, "<B", 0x18))
    fp16 = get_codec("fp16").encode(x)
    with pytest.raises(CodecError, match="finite"):
        get_codec("fp16").decode(rewrite(fp16, HEADER_BYTES, "<H", 0x7C00))  # +inf
    # topk (k=2, chunk=10, uint8 indices): indices start right after the header for fp16 values
    topk = get_codec("topk", k=2, chunk=10).encode(x)
    with pytest.raises(CodecError, match="strictly ascending"):
        get_codec("topk").decode(rewrite(topk, HEADER_BYTES, "<BB", 4, 4))
    with pytest.raises(CodecError, match=r"expected < 10 \(chunk length\), got 10"):
        get_codec("topk").decode(rewrite(topk, HEADER_BYTES, "<BB", 1, 10))
    with pytest.raises(CodecError, match="k <= chunk"):
        get_codec("topk").decode(rewrite(topk, 20, "<I", 11))
    with pytest.raises(CodecError, match="value_bits: expected 16 or 2, got 8"):
        get_codec("topk").decode(rewrite(topk, 6, "<B", 8))
    topk2 = get_codec("topk", k=2, chunk=10, value_bits=2).encode(x)
    with pytest.raises(CodecError, match=r"levels of chunk 0: expected finite 0 <= lo <= hi"):
        get_codec("topk").decode(rewrite(topk2, HEADER_BYTES, "<ff", 2.0, 1.0))
    dct = get_codec("dct-topk", k=2, chunk=10).encode(x)
    with pytest.raises(CodecError, match="scale 3"):
        get_codec("dct-topk").decode(rewrite(dct, HEADER_BYTES + 12, "<f", math.inf))
    with pytest.raises(CodecError, match="got -32768"):
        get_codec("dct-topk").decode(rewrite(dct, HEADER_BYTES + 40, "<h", -32768))
    with pytest.raises(CodecError, match="k <= chunk <= 1024"):
        get_codec("dct-topk").decode(rewrite(dct, 16, "<I", 4096))


def test_registry_and_options() -> None:
    assert available_codecs() == ["fp32", "fp16", "bf16", "int8", "int4", "topk", "dct-topk"]
    with pytest.raises(CodecError, match=r"expected one of \['fp32', .*'dct-topk'\], got 'zstd'"):
        get_codec("zstd")
    with pytest.raises(CodecError, match=r"expected a subset of \['block_size'\], got \['k'\]"):
        get_codec("int8", k=3)
    with pytest.raises(CodecError, match="block_size: expected an int, got bool"):
        get_codec("int8", block_size=True)
    with pytest.raises(CodecError, match="expected 1 <= k <= 32, got 33"):
        get_codec("topk", k=33, chunk=32)
    with pytest.raises(CodecError, match="value_bits: expected 16 or 2, got 4"):
        get_codec("topk", value_bits=4)
    with pytest.raises(CodecError, match="chunk <= 1024, got 4096"):
        get_codec("dct-topk", chunk=4096)
    dense = {name: get_codec(name).dense for name in available_codecs()}
    assert dense == {
        "fp32": True,
        "fp16": True,
        "bf16": True,
        "int8": True,
        "int4": True,
        "topk": False,
        "dct-topk": False,
    }


@pytest.mark.parametrize("case", CODEC_CASES)
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 1000, 4099])
def test_estimated_ratio_is_the_real_wire_size(case: str, numel: int) -> None:
    codec = make(case)
    assert codec.estimated_ratio(numel) == len(codec.encode(torch.randn(numel))) / (4 * numel)
    with pytest.raises(CodecError, match="expected an int >= 1, got 0"):
        codec.estimated_ratio(0)


def test_default_ratios() -> None:
    numel = 1 << 20
    ratios = {name: get_codec(name).estimated_ratio(numel) for name in available_codecs()}
    assert ratios["fp32"] == pytest.approx(1.0, abs=1e-4)
    assert ratios["fp16"] == ratios["bf16"] == pytest.approx(0.5, abs=1e-4)
    assert ratios["int8"] == pytest.approx((1 + 4 / 128) / 4, abs=1e-4)
    assert ratios["int4"] == pytest.approx((0.5 + 4 / 64) / 4, abs=1e-4)
    assert ratios["topk"] == pytest.approx(64 * 4 / 4096 / 4, abs=1e-4)  # uint16 index + fp16 value
    assert get_codec("topk", value_bits=2).estimated_ratio(numel) == pytest.approx(
        (64 * 2.25 + 8) / 4096 / 4, abs=1e-4
    )
    assert ratios["dct-topk"] == pytest.approx((4 * 3 + 4) / 128 / 4, abs=1e-4)


def test_dct_tables_are_orthonormal_and_match_an_independent_dct() -> None:
    for length in (1, 2, 7, 16, 64, 128, 1024):
        d = dct_matrix(length).double()
        assert torch.allclose(d @ d.T, torch.eye(length, dtype=torch.float64), atol=1e-6)
        x = np.random.default_rng(length).standard_normal(length)
        assert np.allclose((d @ torch.from_numpy(x)).numpy(), scipy.fft.dct(x, norm="ortho"), atol=1e-5)
        table = _dct_integer_table(length)
        assert bool((table == table.round()).all()) and float(table.abs().max()) <= 2**28


def test_dct_topk_keeps_everything_when_k_equals_chunk() -> None:
    x = torch.randn(1000)
    y = get_codec("dct-topk", k=64, chunk=64).decode(get_codec("dct-topk", k=64, chunk=64).encode(x))
    assert float((x - y).abs().max()) < 1e-3 * float(x.abs().max())


def test_dct_topk_recovers_a_signal_sparse_in_the_dct_domain() -> None:
    chunk = 128
    coefficients = torch.zeros(50, chunk)
    coefficients[:, 3] = 2.0
    coefficients[:, 40] = -0.5
    x = (coefficients @ dct_matrix(chunk)).view(-1)  # inverse DCT of a 2-sparse spectrum per chunk
    y = get_codec("dct-topk", k=2, chunk=chunk).decode(get_codec("dct-topk", k=2, chunk=chunk).encode(x))
    assert float((x - y).abs().max()) < 1e-4


def test_mean_of_is_order_independent_once_sorted_and_reduces_part_wise() -> None:
    generator = torch.Generator().manual_seed(3)
    contributions = {f"peer-{i:02d}": torch.randn(999, generator=generator) * 10.0**i for i in range(6)}
    reference = mean_of([contributions[p] for p in sorted(contributions)])
    arrivals = list(contributions.items())
    for seed in range(5):
        order = torch.randperm(len(arrivals), generator=torch.Generator().manual_seed(seed)).tolist()
        arrived = [arrivals[i] for i in order]
        again = mean_of([t for _, t in sorted(arrived)])
        assert again.view(torch.int32).tolist() == reference.view(torch.int32).tolist()
    # A part of the mean equals the mean of the parts: what reduce-scatter relies on.
    parts = [
        mean_of([contributions[p][s] for p in sorted(contributions)])
        for s in (slice(0, 400), slice(400, 999))
    ]
    assert torch.equal(torch.cat(parts), reference)
    weights = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    weighted = mean_of([contributions[p] for p in sorted(contributions)], weights)
    expected = (
        sum(w * contributions[p].double() for w, p in zip(weights, sorted(contributions), strict=True)) / 21
    )
    assert torch.allclose(weighted.double(), expected, rtol=1e-5, atol=1e-3)


def test_mean_of_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        mean_of([])
    with pytest.raises(ValueError, match="input 1: expected 3 values"):
        mean_of([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(
        ValueError, match=re.escape("input 0: expected a 1-D float32 tensor, got torch.float64")
    ):
        mean_of([torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="weights: expected 2"):
        mean_of([torch.zeros(3), torch.zeros(3)], [1.0])
    with pytest.raises(ValueError, match=re.escape("weight 1: expected a finite number > 0, got 0.0")):
        mean_of([torch.zeros(3), torch.zeros(3)], [1.0, 0.0])


@pytest.mark.parametrize("case", CODEC_CASES)
def test_dense_codecs_average_part_wise_like_the_exchange(case: str) -> None:
    """Reduce-scatter + all-gather of a dense codec gives every member the same bits as a whole-vector reduce."""
    codec = make(case)
    if not codec.dense:
        pytest.skip("sparse codecs are all-gathered")
    generator = torch.Generator().manual_seed(5)
    contributions = [torch.randn(1000, generator=generator) for _ in range(3)]
    bounds = [(0, 334), (334, 667), (667, 1000)]
    owned = [mean_of([codec.decode(codec.encode(c[a:b])) for c in contributions]) for a, b in bounds]
    gathered = torch.cat([codec.decode(codec.encode(part)) for part in owned])
    exact = mean_of(contributions)
    # Two quantisations (each contribution, then the owner's mean), each within half a step of the block max.
    step = {"fp32": 1e-7, "fp16": 2.0**-10, "bf16": 2.0**-7, "int8": 1 / 127, "int4": 1 / 7}[case]
    largest = max(float(c.abs().max()) for c in contributions)
    assert float((gathered - exact).abs().max()) <= step * largest


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "fp16", "int4", "topk"])
def test_64_mib_round_trip_is_fast(name: str) -> None:
    import time

    x = torch.randn(16 << 20)
    codec = get_codec(name)
    start = time.perf_counter()
    codec.decode(codec.encode(x))
    assert time.perf_counter() - start < 3.0  # generous: the machine is shared; see benchmarks/codec_speed.py


@pytest.mark.parametrize(("length", "k"), [(16, 1), (128, 4), (128, 128), (1024, 64), (1000, 7)])
def test_dct_decode_is_exact_whatever_the_summation_order(length: int, k: int) -> None:
    """The decoder's sums are exact integers in float64, so a BLAS matmul, a batched gather and a plain
    float64 loop in reverse order all give the same bits: the reason decode is identical on every machine."""
    generator = torch.Generator().manual_seed(length + k)
    rows = 40
    idx = torch.rand(rows, length, generator=generator).topk(k, dim=1).indices.sort(dim=1).values
    codes = torch.randint(-32767, 32768, (rows, k), generator=generator, dtype=torch.int16)
    scales = torch.rand(rows, generator=generator) * 10.0 ** torch.randint(
        -30, 30, (rows,), generator=generator
    )
    dense, gathered = torch.empty(rows, length), torch.empty(rows, length)
    _inverse_dct_rows(codes, idx, scales, dense, dense=True)
    _inverse_dct_rows(codes, idx, scales, gathered, dense=False)
    table = _dct_integer_table(length)
    reverse = torch.zeros(rows, length, dtype=torch.float64)
    for s in reversed(range(k)):
        reverse += codes[:, s : s + 1].double() * table[idx[:, s]]
    reverse = (reverse * scales[:, None].double() * 2.0**-28).float()
    assert torch.equal(dense, gathered) and torch.equal(dense, reverse)


def test_decode_refuses_non_buffers() -> None:
    with pytest.raises(CodecError, match="expected bytes or memoryview, got str"):
        get_codec("fp32").decode("FLOC")  # type: ignore[arg-type]
    strided = memoryview(bytearray(get_codec("fp32").encode(torch.ones(100))))[::2]
    with pytest.raises(CodecError, match="contiguous"):
        get_codec("fp32").decode(strided)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_sees_nan_and_inf_but_not_an_overflowing_sum(dtype: torch.dtype) -> None:
    big = float(torch.finfo(dtype).max)
    # Finite values whose sum overflows: the cheap sum says "not finite", the exact fallback says finite.
    assert all_finite(torch.full((1000,), big, dtype=dtype))
    assert all_finite(torch.tensor([big, -big, big], dtype=dtype))
    assert all_finite(torch.empty(0, dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = torch.randn(70_001).to(dtype)
        values[12_345] = bad
        assert not all_finite(values)


@pytest.mark.parametrize("name", available_codecs())
@pytest.mark.parametrize("numel", [0, 1, 127, 1000, 70_001])
def test_encode_decoded_is_encode_then_decode_bit_for_bit(name: str, numel: int) -> None:
    codec = get_codec(name)
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    if numel > 10:
        tensor[:128] = 0.0  # an all-zero block (scale 0) and a tiny one
        tensor[5] = 1e-30
    data, decoded = codec.encode_decoded(tensor)
    assert data == codec.encode(tensor)
    expected = codec.decode(data)
    assert decoded.dtype == torch.float32 and decoded.shape == expected.shape
    assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32))  # bits, not just values
    # A fresh tensor, never a view of the input the caller may change.
    if numel:
        assert decoded.data_ptr() != tensor.data_ptr()


def test_encode_decoded_refuses_what_encode_refuses() -> None:
    for name in available_codecs():
        with pytest.raises(CodecError, match="finite"):
            get_codec(name).encode_decoded(torch.tensor([1.0, float("nan")]))


@pytest.mark.parametrize("name", available_codecs())
@pytest.mark.parametrize("numel", [0, 1, 1000, 70_001])
def test_no_checksum_and_out_give_the_same_values(name: str, numel: int) -> None:
    """The exchange's fast path: `checksum=False` drops only the CRC (flag set, CRC field zero, the body
    unchanged), and `out=` receives exactly the values a plain decode returns."""
    codec = get_codec(name)
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel + 1)) * 2
    data = codec.encode(tensor)
    bare = codec.encode(tensor, checksum=False)
    assert len(bare) == len(data) and bare[32:] == data[32:]
    assert bare[7] == FLAG_NO_CRC and bare[24:28] == b"\0\0\0\0" and data[7] == 0
    expected = codec.decode(data)
    out = torch.full((numel,), float("nan"))
    got = codec.decode(bare, checksum=False, out=out)
    assert got is out and torch.equal(out.view(torch.int32), expected.view(torch.int32))
    sent, decoded = codec.encode_decoded(tensor, checksum=False, out=torch.empty(numel))
    assert sent == bare and torch.equal(decoded.view(torch.int32), expected.view(torch.int32))
    # checksum=False also reads a payload that has its CRC (without checking it).
    assert torch.equal(codec.decode(data, checksum=False), expected)


def test_a_payload_without_crc_is_refused_by_a_plain_decode() -> None:
    codec = get_codec("int8")
    bare = codec.encode(torch.randn(100), checksum=False)
    with pytest.raises(CodecError, match="CRC-32: expected one, got a payload written without it"):
        codec.decode(bare)
    flags = bytearray(bare)
    flags[7] = 2  # an unknown flag
    with pytest.raises(CodecError, match="flags"):
        codec.decode(bytes(flags), checksum=False)


def test_decode_out_of_the_wrong_size_or_type_is_refused_before_writing() -> None:
    codec = get_codec("int8")
    data = codec.encode(torch.randn(100))
    for bad in (torch.zeros(99), torch.zeros(100, dtype=torch.float64), torch.zeros(200)[::2]):
        keep = bad.clone()
        with pytest.raises(CodecError, match="out: expected a contiguous float32 CPU tensor of 100 values"):
            codec.decode(data, out=bad)
        assert torch.equal(bad, keep)
        with pytest.raises(CodecError, match="out: expected a contiguous float32 CPU tensor of 100 values"):
            codec.encode_decoded(torch.randn(100), out=bad)
        assert torch.equal(bad, keep)


@pytest.mark.parametrize("block_size", [8, 50, 64])
def test_an_int4_payload_decodes_piece_by_piece_to_the_same_values(
    block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int4 decodes a payload in pieces of whole blocks (its temporaries bounded by a piece, not the payload): any
    piece size gives the bits a one-piece decode gives, and a bad nibble or padding in a later piece is still
    refused."""
    from farloco.optim import dense

    codec = get_codec("int4", block_size=block_size)
    x = torch.randn(2_001, generator=torch.Generator().manual_seed(block_size)) * 3
    x[700:760] = 0.0  # an all-zero block or two
    data = codec.encode(x)
    whole = codec.decode(data)
    for span in (1, 2 * block_size, 333, 1_000):
        monkeypatch.setattr(dense, "INT4_DECODE_SPAN", span)
        assert torch.equal(codec.decode(data).view(torch.int32), whole.view(torch.int32)), span
        assert torch.equal(
            codec.decode(data, out=torch.empty(2_001)).view(torch.int32), whole.view(torch.int32)
        )
        with pytest.raises(CodecError, match=re.escape("nibbles in 1..15")):
            codec.decode(rewrite(data, len(data) - 5, "<B", 0x80))
        with pytest.raises(CodecError, match="padding nibble: expected 8"):
            codec.decode(rewrite(data, len(data) - 1, "<B", 0x18))


@pytest.mark.skipif(not CAN_MEASURE, reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32", "int4", "int8"])
def test_a_dense_decode_into_out_holds_no_float32_copy_of_the_payload(name: str) -> None:
    """decode(out=) writes straight into `out`: a payload of 8M values (a float32 copy: 32 MiB) decodes with the
    peak RSS rising by less than a quarter of that."""
    numel = 8 << 20
    codec = get_codec(name)
    data = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(3)))
    out = torch.empty(numel).fill_(0.0)
    grown = peak_growth_mib(lambda: codec.decode(data, out=out))
    assert grown < 8, f"decoding {name} into out raised the peak by {grown:.1f} MiB"


SPARSE_CASES = {
    "topk": {"k": 5, "chunk": 300},
    "topk-2bit": {"k": 3, "chunk": 50, "value_bits": 2},
    "topk-default": {},
    "dct-topk": {"k": 4, "chunk": 96},
}


def sparse_codec(case: str) -> Codec:
    return get_codec("dct-topk" if case == "dct-topk" else "topk", **SPARSE_CASES[case])


@pytest.mark.parametrize("case", list(SPARSE_CASES))
@pytest.mark.parametrize("numel", [0, 1, 299, 300_001])
def test_a_sparse_payload_encoded_on_demand_is_the_whole_vectors(case: str, numel: int) -> None:
    """encode_on_demand asks for pieces of whole chunks (none twice, together the vector) and writes the payload
    `encode` writes for the whole vector (dct-topk: the same values decoded, its float32 matmul aside)."""
    codec = sparse_codec(case)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    asked: list[tuple[int, int]] = []

    def fill(a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        asked.append((a, b))
        return out.copy_(x[a:b])

    for checksum in (True, False):
        asked.clear()
        made = codec.encode_on_demand(numel, fill, checksum=checksum)
        whole = codec.encode(x, checksum=checksum)
        if case != "dct-topk":
            assert made == whole
        assert torch.equal(codec.decode(made, checksum=checksum), codec.decode(whole, checksum=checksum))
        bounds = [0, *(b for _, b in asked)]
        assert [a for a, _ in asked] == bounds[:-1] and bounds[-1] == numel
        unit = SPARSE_CASES[case].get("chunk", 4096)
        assert all(a % unit == 0 for a, _ in asked)


def test_encode_on_demand_refuses_what_encode_refuses() -> None:
    codec = get_codec("topk", k=2, chunk=10)
    x = torch.randn(100)
    x[57] = float("nan")
    with pytest.raises(CodecError, match="topk encode input"):
        codec.encode_on_demand(100, lambda a, b, out: out.copy_(x[a:b]))
    with pytest.raises(CodecError, match=re.escape("encode input dtype: expected torch.float32")):
        codec.encode_on_demand(100, lambda a, b, out: torch.zeros(b - a, dtype=torch.float64))
    with pytest.raises(CodecError, match=r"piece \[0, 100\): expected 100 values, got 99"):
        codec.encode_on_demand(100, lambda a, b, out: out[1:])
    with pytest.raises(CodecError, match="numel: expected an int >= 0, got -1"):
        codec.encode_on_demand(-1, lambda a, b, out: out)


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_a_parsed_sparse_payload_decodes_any_range_of_whole_chunks_alike(case: str) -> None:
    """parse + decode_into over ranges of whole chunks gives the bits of `decode`, whatever the cut; a range
    off the chunks, or an `out` of the wrong size, is refused by name."""
    codec = sparse_codec(case)
    numel = 10_007
    data = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(5)))
    whole = codec.decode(data)
    payload = codec.parse(data)
    unit = payload.unit
    assert payload.numel == numel and unit == SPARSE_CASES[case].get("chunk", 4096)
    for step in (1, 2, 7, numel):
        out = torch.full((numel,), float("nan"))
        for a in range(0, numel, step * unit):
            b = min(a + step * unit, numel)
            payload.decode_into(a, b, out[a:b])
        assert torch.equal(out.view(torch.int32), whole.view(torch.int32)), step
    with pytest.raises(CodecError, match=rf"whole chunks of {unit} inside \[0, {numel}\], got \[1, {unit}\)"):
        payload.decode_into(1, unit, torch.empty(unit - 1))
    with pytest.raises(CodecError, match=rf"expected {unit} contiguous float32 values, got {unit + 1}"):
        payload.decode_into(0, unit, torch.empty(unit + 1))


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_parse_refuses_every_payload_decode_refuses(case: str) -> None:
    """parse checks what decode checks, before any range is decoded: a flipped byte (the CRC), a bad index, a
    payload of another codec."""
    codec = sparse_codec(case)
    data = codec.encode(torch.randn(1_000, generator=torch.Generator().manual_seed(1)))
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    with pytest.raises(CodecError, match="CRC-32"):
        codec.parse(bytes(flipped))
    with pytest.raises(CodecError):
        codec.parse(bytes(flipped), checksum=False) if case == "dct-topk" else codec.decode(bytes(flipped))
    with pytest.raises(CodecError, match="payload codec"):
        codec.parse(get_codec("int8").encode(torch.ones(8)))


FLAT_PEAK_SCRIPT = """
import json, sys, torch
from helpers.memory import peak_growth_mib
from farloco.optim import get_codec

numel = 8 << 20
x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
out = torch.empty(1 << 18).fill_(0.0)
grown = {}
for name, options in json.loads(sys.argv[1]):
    codec = get_codec(name, **options)
    data = codec.encode(x)
    piece = (1 << 18) // codec.chunk * codec.chunk

    def parse_and_decode():
        payload = codec.parse(data)
        for a in range(0, numel, piece):
            payload.decode_into(a, min(a + piece, numel), out[: min(piece, numel - a)])

    def on_demand():
        codec.encode_on_demand(numel, lambda a, b, o: o.copy_(x[a:b]))

    parse_and_decode(), on_demand()  # the first calls' one-off allocations (kernels, tables) aside
    grown[name + str(options)] = [peak_growth_mib(parse_and_decode), peak_growth_mib(on_demand), len(data)]
print(json.dumps(grown))
"""


@pytest.mark.skipif(not CAN_MEASURE, reason="needs Linux's /proc/self/clear_refs")
def test_a_sparse_payload_parses_and_encodes_on_demand_with_a_flat_peak() -> None:
    """A payload of 8M values (32 MiB as float32) parses, decodes range by range and is encoded on demand with
    the peak RSS rising by far less than a decoded vector: what the exchange's sparse mean holds per member. In
    a process of its own whose allocator hands pieces of this size back at once (a fixed mmap threshold):
    glibc's adaptive one may keep freed pieces in its heap, and the peak then says more about the heap's
    history than about what the code holds."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    cases = [("topk", {}), ("topk", SPARSE_CASES["topk-2bit"]), ("dct-topk", {})]
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    env["PYTHONPATH"] = os.pathsep.join([tests, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", FLAT_PEAK_SCRIPT, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for case, (decoded, encoded, payload_bytes) in json.loads(done.stdout.splitlines()[-1]).items():
        assert decoded < 8, f"parsing and decoding {case} by ranges raised the peak by {decoded:.1f} MiB"
        limit = 3 * payload_bytes / (1 << 20) + 8
        assert encoded < limit, f"encoding {case} on demand raised the peak by {encoded:.1f} MiB"
