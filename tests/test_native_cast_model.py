"""The compiled kernels' native-conversion path equals the torch reference: a counterexample search.

A compiled launch of finite inputs (``launch.native_casts``) encodes with the GPU's
``cvt.rn.satfinite.e4m3x2.f32`` / ``cvt.rn.satfinite.e2m1x2.f32`` (sm_100) or the sm_90 E2M1
bit encoder, where the interpreter (and NaN/inf inputs) use the exact integer encoders; the
interpreter cannot run the native casts (its fp8 cast is wrong), so this module models them in
torch from their PTX semantics - round to nearest even on the format's grid, saturate finite
values to the largest finite magnitude, NaN -> NaN, the sign from the value's sign bit - and
replays each kernel's native-path arithmetic (the same fp32 operations in the same order) on
inputs built to hit every case: every finite bf16 value under a dense set of block maxima (so a
scale of every octave and mantissa class), edge tiles, UE8M0/RCEIL/FLOOR/min-byte variants, zero
and tiny blocks. Any difference from ``backend="torch"`` is a counterexample to the range
argument of docs/formats.md ("Two encoders, one result").
"""
from __future__ import annotations

import functools

import pytest
import torch

from qstrat.serializers.block_fp8 import AMAX_FLOOR, BlockFP8
from qstrat.serializers.fp_bits import E4M3_MAX, E8M0_BIAS, ceil_pow2, exp2_int
from qstrat.serializers.mxfp8 import MXFP8
from qstrat.serializers.nvfp4 import E2M1_VALUES, NVFP4, RCP_E2M1_MAX, global_encode_scale

# ---- PTX semantics, modelled in float64 (exact for every fp32 input) ------------------------


def rne_on_grid(a: torch.Tensor, spacing: torch.Tensor) -> torch.Tensor:
    """``a`` (float64 >= 0) rounded to the nearest multiple of ``spacing`` (a power of two), ties
    to the even multiple: ``a / spacing`` is exact, ``torch.round`` is round-half-even."""
    return torch.round(a / spacing) * spacing


def e4m3_cvt_model(y: torch.Tensor) -> torch.Tensor:
    """``cvt.rn.satfinite.e4m3x2.f32`` on fp32 ``y``: uint8 codes. E4M3 (OCP FP8): bias 7,
    3 mantissa bits, subnormal spacing 2^-9, largest finite 448; RNE, finite overflow -> +-448,
    NaN -> 0x7F; the sign bit is y's (so -0.0 -> 0x80)."""
    a = y.double().abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0**-6))).clamp(min=-6)
    r = torch.minimum(rne_on_grid(a, torch.exp2(e - 3)), torch.tensor(E4M3_MAX, dtype=torch.float64))
    mag = r.float().to(torch.float8_e4m3fn).view(torch.uint8)  # r is on the grid: exact
    sign = (y.view(torch.int32) < 0).to(torch.uint8) << 7
    return torch.where(torch.isnan(y), torch.full_like(mag, 0x7F), mag | sign)


E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)


def e2m1_cvt_model(y: torch.Tensor) -> torch.Tensor:
    """``cvt.rn.satfinite.e2m1x2.f32`` on fp32 ``y`` (finite): int32 4-bit codes. E2M1: grid
    spacing 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; RNE, saturate to 6; sign bit = y's."""
    a = y.double().abs()
    spacing = torch.exp2(torch.floor(torch.log2(a.clamp(min=1.0))).clamp(max=2) - 1)
    r = torch.minimum(rne_on_grid(a, spacing), torch.tensor(6.0, dtype=torch.float64))
    code = torch.searchsorted(E2M1, r).to(torch.int32)
    return code | ((y.view(torch.int32) < 0).to(torch.int32) << 3)


def e2m1_sm90_model(y: torch.Tensor) -> torch.Tensor:
    """Twin of ``fp_encode.e2m1_from_bits`` (the sm_90 encoder), the same int32/fp32 ops."""
    a = torch.minimum(y.abs(), torch.tensor(6.0))
    mb = torch.maximum((a.view(torch.int32) & 0x7F800000) + ((22 << 23) + 6),
                       torch.tensor((149 << 23) + 6, dtype=torch.int32))
    r = (a + mb.view(torch.float32)).view(torch.int32)
    return ((r + (r >> 22)) & 7) | ((y.view(torch.int32) >> 28) & 8)


def fma_zero(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp32 ``fma(x, m, +0.0)``: the float64 product of two fp32 values is exact, adding +0.0
    is exact (and turns -0.0 into +0.0), and the one rounding to fp32 is the fma's."""
    return (x.double() * m.double() + 0.0).float()


# ---- each kernel's native path, replayed ------------------------------------------------------


def block_fp8_native(x: torch.Tensor, ue8m0: bool) -> dict[str, torch.Tensor]:
    """``_block_fp8_kernel`` with NATIVE: x float32 [E, N, K] -> parts."""
    e, n, k = x.shape
    b = 128
    nb, kb = -(-n // b), -(-k // b)
    pad = torch.nn.functional.pad(x, (0, kb * b - k, 0, nb * b - n)).view(e, nb, b, kb, b)
    amax = pad.abs().amax(dim=(2, 4), keepdim=True).clamp(min=AMAX_FLOOR)
    s = amax / E4M3_MAX
    if ue8m0:
        s = ceil_pow2(s)
    q = e4m3_cvt_model((pad * (1.0 / s)).reshape(-1)).view(e, nb * b, kb * b)[:, :n, :k]
    return {"weight": q.view(torch.float8_e4m3fn), "weight_scale_inv": s.view(e, nb, kb)}


def mxfp8_native(x: torch.Tensor, rceil: bool, min_byte: int) -> dict[str, torch.Tensor]:
    """``_mxfp8_kernel`` with NATIVE (``e8m0_from_finite_amax``, exact 2^(127 - byte))."""
    e, n, k = x.shape
    blocks = x.view(e, n, k // 32, 32)
    bits = blocks.abs().amax(dim=-1).view(torch.int32)
    byte = (bits >> 23) - 8
    if rceil:
        byte = byte + (((bits & 0x7FFFFF) + (0x7FFFFF - 0x600000)) >> 23)
    byte = byte.clamp(min_byte, 254)
    inv = exp2_int(E8M0_BIAS - byte)
    q = e4m3_cvt_model((blocks * inv.unsqueeze(-1)).reshape(-1)).view(e, n, k)
    return {"weight": q.view(torch.float8_e4m3fn), "weight_scale": byte.to(torch.uint8)}


def nvfp4_native(x: torch.Tensor, amax_t: torch.Tensor, sm100: bool) -> dict[str, torch.Tensor]:
    """``_nvfp4_kernel`` with NATIVE (sm100: cvt e2m1x2; else the sm_90 bit encoder)."""
    e, n, k = x.shape
    enc = global_encode_scale(amax_t).view(e, 1, 1)
    dec = 1.0 / enc
    blocks = x.view(e, n, k // 16, 16)
    amax_b = blocks.abs().amax(dim=-1)
    scale = e4m3_cvt_model((enc * (amax_b * RCP_E2M1_MAX)).reshape(-1)).view(amax_b.shape)
    s = scale.view(torch.float8_e4m3fn).float()
    zero = s == 0
    rcp = 1.0 / torch.where(zero, torch.ones_like(s), s * dec)
    os = torch.where(zero, torch.full_like(s, 2.0**-149), rcp)
    y = fma_zero(blocks, os.unsqueeze(-1)).reshape(-1)
    code = (e2m1_cvt_model(y) if sm100 else e2m1_sm90_model(y)).view(e, n, k // 2, 2)
    packed = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    return {"weight": packed, "weight_scale": scale.view(torch.float8_e4m3fn),
            "weight_scale_2": dec.view(e), "input_scale": torch.ones(e)}


# ---- inputs: every finite bf16 value under a dense set of block maxima -------------------------

BF16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
BF16 = BF16[torch.isfinite(BF16)]


#: Block-maximum mantissas: the exact power, the RCEIL boundary 1.75 (448 = 1.75 * 2^8) and its
#: bf16 neighbours, the largest below the next power, and a spread between.
MANTISSAS = (1.0, 1.75, 1.75 + 2**-7, 2 - 2**-7, 1.0 + 2**-7, 1.25, 1.5, 1.75 - 2**-7,
             1.125, 1.3125, 1.4375, 1.5625, 1.6875, 1.8125, 1.875, 1.9375)


def maxima(lo: int, hi: int, per_octave: int = 16) -> torch.Tensor:
    """Block maxima of every octave 2^lo .. 2^hi, ``per_octave`` mantissas each (the first
    ``per_octave`` of :data:`MANTISSAS`), as bf16 values."""
    mants = torch.tensor(MANTISSAS[:per_octave])
    oct_ = torch.arange(lo, hi + 1, dtype=torch.float32).exp2()
    return (oct_[:, None] * mants[None, :]).reshape(-1).to(torch.bfloat16).float().unique()


def blocks_under(amaxes: torch.Tensor, width: int, seed: int, octaves: int = 10) -> torch.Tensor:
    """[rows, width] float32: each row's element 0 is a block maximum (random sign), the other
    ``width - 1`` are bf16 values below it: EVERY finite bf16 value within ``octaves`` octaves
    under it (the codes a scale can give: below that they round to 0 or the smallest
    subnormals), and 256 random smaller ones, shuffled across the rows of that maximum."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    mags = BF16.abs()
    for a in amaxes.tolist():
        near = BF16[(mags <= a) & (mags > a * 2.0**-octaves)]
        far = BF16[mags <= a * 2.0**-octaves]
        far = far[torch.randint(far.numel(), (256,), generator=g)] if far.numel() else far
        vals = torch.cat([near, far])
        vals = vals[torch.randperm(vals.numel(), generator=g)]
        per = width - 1
        r = -(-vals.numel() // per)
        vals = vals[torch.arange(r * per) % vals.numel()].view(r, per)
        sign = torch.where(torch.rand(r, 1, generator=g) < 0.5, -1.0, 1.0)
        rows.append(torch.cat([sign * a, vals], dim=1))
    return torch.cat(rows)


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for key, w in want.items():
        g = got[key]
        gb, wb = g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)
        bad = (gb != wb).nonzero()
        assert bad.numel() == 0, f"{what} {key}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"


# ---- the searches -------------------------------------------------------------------------------

def test_e4m3_model_is_the_ptx_rounding():
    """The model itself on known codes (docs/test-vectors.md ties and carries) and saturation."""
    y = torch.tensor([1.0625, 17.0, 232.0, 0.0029296875, 126.24, 1.97, -124.5, 2.0**-10,
                      3 * 2.0**-10, -0.0, 449.0, 463.9, 464.0, 1e30, -1e30, 2.0**-149])
    want = [0x38, 0x58, 0x76, 0x02, 0x70, 0x40, 0xF0, 0x00, 0x02, 0x80, 0x7E, 0x7E, 0x7E,
            0x7E, 0xFE, 0x00]
    assert e4m3_cvt_model(y).tolist() == want


def test_e2m1_models_on_every_tie_and_saturation():
    """Both E2M1 encoders on the rounding ladder's ties (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturation, and the sign of -0.0 and tiny values."""
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.5, 1e30, -0.0, -1e-30, -2.9])
    want = [0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8, 8, 8 | 5]
    assert e2m1_cvt_model(y).tolist() == want
    assert e2m1_sm90_model(y).tolist() == want


def test_e2m1_sm90_encoder_equals_cvt_model():
    """The sm_90 bit encoder and the cvt model agree on every fp32 bit pattern within 4096 ulps
    of each rounding decision point (the ties 0.25 .. 5, the binade edges 0.5 .. 8, saturation
    at 6) and on every 4099th pattern of magnitude below 16, both signs."""
    points = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0,
                           6.0, 7.0, 8.0, 2.0**-126, 2.0**-149]).view(torch.int32)
    near = (points[:, None] + torch.arange(-4096, 4097, dtype=torch.int32)[None, :]).reshape(-1)
    sweep = torch.arange(0, 0x41800000, 4099, dtype=torch.int64).to(torch.int32)
    bits = torch.cat([near[near >= 0], sweep])
    for sgn in (0, -(2**31)):
        y = (bits + sgn).view(torch.float32)
        bad = (e2m1_sm90_model(y) != e2m1_cvt_model(y)).nonzero()
        assert bad.numel() == 0, f"fp32 {y[bad[0]].item()!r}"


def _reference(cls, x, **opts):
    # nonfinite="propagate": the codes are compared, for every input; with the default "error" the
    # serializer refuses blocks near float32's max whose RCEIL scale decodes to inf (a check on
    # top of the encoders, the same for both paths: Serializer.quantize)
    return cls(backend="torch", nonfinite="propagate", **opts).quantize(x)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_fp8_native_equals_reference(ue8m0):
    """Every bf16 value under tile maxima 2^-30 .. 2^30 (and the 1e-4 floor's territory), one
    maximum per 128 x 128 tile, plus a ragged edge tile."""
    rows = blocks_under(maxima(-30, 30)[::5], 128, seed=1)
    n = -(-rows.shape[0] // 128) * 128
    x = torch.cat([rows, rows[: n - rows.shape[0]]]).view(1, n, 128)
    x = torch.cat([x, x.flip(1)], dim=2)  # two tiles per row band
    x[0, ::128, 1:] = x[0, ::128, 1:].clamp(-1e-6, 1e-6)  # some tiles whose max sits in row 0
    same(block_fp8_native(x, ue8m0), _reference(BlockFP8, x, ue8m0=ue8m0), f"ue8m0={ue8m0}")
    edge = x[:, :300, :200].contiguous()
    same(block_fp8_native(edge, ue8m0), _reference(BlockFP8, edge, ue8m0=ue8m0), "edge tile")


@functools.lru_cache(maxsize=1)
def _mx_rows() -> torch.Tensor:
    amaxes = torch.cat([maxima(-133, -11, 4), maxima(-10, 10), maxima(11, 127, 4)])
    return blocks_under(amaxes, 32, seed=2)


@pytest.mark.parametrize(("rounding", "min_byte"), [("rceil", 0), ("floor", 0), ("rceil", 1)])
def test_mxfp8_native_equals_reference(rounding, min_byte):
    """Every bf16 value under block maxima of every octave 2^-133 .. 2^127 (the E8M0 byte's
    whole range, clamps included) with the RCEIL boundary mantissas (16 mantissas in the octaves
    of normal E4M3 codes, 4 elsewhere); zero blocks."""
    rows = _mx_rows()
    rows = torch.cat([rows, torch.zeros(3, 32), torch.full((1, 32), -0.0)])
    x = rows.unsqueeze(0)
    same(mxfp8_native(x, rounding == "rceil", min_byte),
         _reference(MXFP8, x, scale_rounding=rounding, min_scale_byte=min_byte),
         f"{rounding} min_byte={min_byte}")


@pytest.mark.parametrize("sm100", [True, False], ids=["sm100-cvt", "sm90-bits"])
def test_nvfp4_native_equals_reference(sm100):
    """Every bf16 value under block maxima spanning 2^-40 .. 2^40 relative to expert maxima of
    1 and 2688 (unit encode scale), 2^-120 (encode scale capped at 2^116) and 2^120; zero
    blocks, -0.0 and blocks whose e4m3 scale underflows to 0."""
    experts, amax_t = [], []
    for j, t in enumerate([1.0, 2688.0, 2.0**-120, 2.0**120]):
        rows = blocks_under(maxima(-40, 0, 4) * t, 16, seed=3 + j)
        rows = torch.cat([rows, torch.zeros(2, 16), torch.full((1, 16), -0.0),
                          torch.full((1, 16), t)])
        experts.append(rows)
        amax_t.append(t)
    n = max(r.shape[0] for r in experts)
    x = torch.stack([torch.cat([r, torch.zeros(n - r.shape[0], 16)]) for r in experts])
    x = torch.cat([x, x.flip(1)], dim=2)  # K = 32
    amax = torch.tensor(amax_t)
    ref = NVFP4(backend="torch").quantize(x, context={"amax": amax})
    same(nvfp4_native(x, amax, sm100), ref, "sm100" if sm100 else "sm90")
