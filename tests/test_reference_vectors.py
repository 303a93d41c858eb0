"""Every class of docs/test-vectors.md on the torch reference path, with exact expected bytes."""
from __future__ import annotations

import pytest
import torch

import qstrat
from qstrat.serializers.fp_bits import e8m0_from_amax, exp2_int


def mx(**opts):
    return qstrat.get_serializer("mxfp8", backend="torch", **opts)


def bf(**opts):
    return qstrat.get_serializer("block_fp8", backend="torch", **opts)


def test_all_zero_blocks_have_documented_scales_and_no_nan():
    z = torch.zeros(128, 128, dtype=torch.bfloat16)
    p = bf().quantize(z)
    assert torch.equal(p["weight_scale_inv"], torch.full((1, 1), 1e-4) / 448.0)
    assert p["weight"].view(torch.uint8).eq(0).all()
    p = mx().quantize(z)
    assert p["weight_scale"].eq(0).all() and p["weight"].view(torch.uint8).eq(0).all()
    p = mx(min_scale_byte=1).quantize(z)
    assert p["weight_scale"].eq(1).all() and p["weight"].view(torch.uint8).eq(0).all()


def test_tiny_subnormal_blocks_give_no_nan_and_no_saturation():
    w = torch.linspace(1e-40, 1e-35, 64).reshape(2, 32)
    for ser in (mx(), bf()):
        p = ser.quantize(w)
        deq = ser.dequantize(p)
        assert torch.isfinite(deq).all()
        assert deq.abs().max() < 1e-30  # never +-448 garbage
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


def test_nan_is_a_clear_error_naming_tensor_and_index():
    w = torch.randn(4, 64)
    w[2, 33] = float("nan")
    for ser in (mx(), bf()):
        with pytest.raises(qstrat.NonFiniteError, match=r"^layers\.0\.q: non-finite value nan at index \[2, 33\] \(row, col\);"):
            ser.quantize(w, name="layers.0.q")
    w[2, 33] = float("inf")
    with pytest.raises(qstrat.NonFiniteError):
        mx().quantize(w)


def test_nan_propagates_only_when_asked():
    w = torch.ones(2, 32)
    w[1, 3] = float("nan")
    p = mx(nonfinite="propagate").quantize(w)
    assert int(p["weight_scale"][1, 0]) == 255 and int(p["weight_scale"][0, 0]) != 255
    assert torch.isnan(mx().dequantize(p)[1]).all()


def test_block_fp8_ue8m0_nan_tile_gets_a_nan_scale():
    w = torch.ones(256, 256)
    w[3, 4] = float("nan")
    p = bf(nonfinite="propagate", ue8m0=True).quantize(w)
    s = p["weight_scale_inv"]
    assert bool(s[0, 0].isnan())  # once -0.0: the pow2 rounding of NaN's exponent field
    assert s[0, 1].item() == s[1, 1].item() == 2.0 ** -8  # 1/448 rounded up to a power of two
    assert bool((p["weight"][:128, :128].view(torch.uint8) == 0x7F).all())
    assert torch.isnan(bf().dequantize(p)[:128, :128]).all()


def test_e8m0_byte_zero_is_2_to_minus_127_not_zero():
    assert exp2_int(torch.tensor([-127])).item() == 2.0 ** -127
    assert exp2_int(torch.tensor([-149, 0, 127])).tolist() == [2.0 ** -149, 1.0, 2.0 ** 127]


def test_ragged_block_fp8_zero_pads_with_ceil_grid():
    w = torch.randn(300, 200, dtype=torch.bfloat16)
    p = bf().quantize(w)
    assert p["weight"].shape == (300, 200) and p["weight_scale_inv"].shape == (3, 2)
    corner = w[256:, 128:].float().abs().max().clamp(min=1e-4) / 448.0
    assert p["weight_scale_inv"][2, 1] == corner


def test_mxfp8_rejects_k_not_multiple_of_32():
    with pytest.raises(qstrat.UnsupportedShapeError, match="K=48"):
        mx().part_specs((4, 48))


@pytest.mark.parametrize("name", ["block_fp8", "mxfp8", "bf16"])
def test_batched_equals_separate_2d_calls(name):
    ser = qstrat.get_serializer(name, backend="torch")
    w = torch.randn(5, 192, 256, dtype=torch.bfloat16)
    batched = ser.quantize(w)
    for e in range(5):
        single = ser.quantize(w[e])
        for k, v in single.items():
            assert torch.equal(_u8(batched[k][e]), _u8(v)), (k, e)


@pytest.mark.parametrize("name", ["block_fp8", "mxfp8"])
def test_chunking_does_not_change_bytes(name):
    w = torch.randn(3, 520, 384, dtype=torch.bfloat16)
    big = qstrat.get_serializer(name, backend="torch").quantize(w)
    small = qstrat.get_serializer(name, backend="torch", chunk_elements=128 * 384).quantize(w)
    for k in big:
        assert torch.equal(_u8(big[k]), _u8(small[k]))


def test_strided_view_input_matches_contiguous():
    slab = torch.randn(4, 512, 256, dtype=torch.bfloat16)
    view = slab[:, 256:, :]
    for name in ("block_fp8", "mxfp8"):
        ser = qstrat.get_serializer(name, backend="torch")
        a, b = ser.quantize(view), ser.quantize(view.contiguous())
        assert all(torch.equal(_u8(a[k]), _u8(b[k])) for k in a)


def test_ue8m0_scales_are_powers_of_two_and_cover_amax():
    w = torch.randn(256, 256) * 3
    p = bf(ue8m0=True).quantize(w)
    s = p["weight_scale_inv"]
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    amax = w.abs().reshape(2, 128, 2, 128).amax(dim=(1, 3))
    assert (s * 448 >= amax).all() and (s * 224 < amax).all()


@pytest.mark.parametrize("name", ["block_fp8", "mxfp8"])
def test_dequantize_error_is_bounded_by_e4m3_precision(name):
    w = torch.randn(256, 512)
    ser = qstrat.get_serializer(name, backend="torch")
    err = (ser.dequantize(ser.quantize(w)) - w).abs()
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of the value, plus subnormal
    # granularity of 2^-9 * scale near zero (scale <= amax / 224 for both formats here).
    bound = w.abs() * 2 ** -4 + w.abs().max() / 224 * 2 ** -9
    assert (err <= bound + 1e-12).all()


def _u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t
