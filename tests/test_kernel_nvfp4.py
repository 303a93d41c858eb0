"""NVFP4 Triton kernel vs the NVFP4 torch reference, byte for byte.

Runs where the kernels run (see tests/test_kernels.py): on CUDA tensors on a GPU machine; on a
CPU machine inside the one interpreter child process (``TRITON_INTERPRET=1 pytest
tests/test_kernel_nvfp4.py`` runs it directly).
Input classes: docs/test-vectors.md.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'qstrat[triton]')")

import kernel_harness as testing  # noqa: E402
from qstrat.serializers.nvfp4 import NVFP4  # noqa: E402

DEVICE = testing.require_kernel_device()

pytestmark = pytest.mark.interpreter if DEVICE == "cpu" else []
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)

def wide_randn(shape, dtype, seed=0):
    """randn with a random power-of-two gain per row (rows far below the global amax
    exercise small and zero block scales); fp16 gets a range it can hold."""
    g = gen(seed)
    lo, hi = (-10, 8) if dtype == torch.float16 else (-30, 30)
    gain = torch.randint(lo, hi, (*shape[:-1], 1), generator=g).to(torch.float32).exp2()
    return (torch.randn(shape, generator=g) * gain).to(dtype).to(DEVICE)

def check(w, context=None, **opts):
    kern = NVFP4(backend="triton", **opts).quantize(w, context=context)
    ref = NVFP4(backend="torch", **opts).quantize(w, context=context)
    testing.assert_same_bytes(kern, ref, f"nvfp4 {opts} {w.dtype} {list(w.shape)}")
    return kern

def nibbles(parts) -> torch.Tensor:
    """uint8 codes [..., K] (low nibble first) of the packed weight."""
    q = parts["weight"].cpu()
    return torch.stack((q & 0x0F, q >> 4), dim=-1).flatten(-2)

def amax_ctx(*values):
    return {"amax": torch.tensor(values, dtype=torch.float32, device=DEVICE)}

# ---- random inputs, grouped, options --------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(40, 96), (3, 33, 160)], ids=str)
def test_random_matches_reference(shape, dtype):
    check(wide_randn(shape, dtype, seed=len(shape)))

def test_input_scale_option_and_plain_gaussian():
    w = torch.randn(2, 32, 64, generator=gen(1)).to(torch.bfloat16).to(DEVICE)
    got = check(w, input_scale=0.3)
    assert got["input_scale"].cpu().tolist() == [torch.tensor(0.3).item()] * 2

# ---- fused groups share one global scale; views are read in place --------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_gate_up_views_share_global_scale(dtype, monkeypatch):
    e, i, k = 2, 24, 96
    slab = wide_randn((e, 2 * i, k), dtype, seed=2)
    gate, up = slab[:, :i, :], slab[:, i:, :]
    ctx = NVFP4().group_context([gate, up])
    refs = [NVFP4(backend="torch").quantize(m.contiguous(), context=ctx) for m in (gate, up)]
    with testing.no_contiguous_copies(monkeypatch):
        got = [NVFP4(backend="triton").quantize(m, context=ctx) for m in (gate, up)]
    for g, r, name in zip(got, refs, ("gate", "up")):
        testing.assert_same_bytes(g, r, name)
    assert torch.equal(got[0]["weight_scale_2"], got[1]["weight_scale_2"])

def test_transposed_view():
    w = wide_randn((2, 64, 40), torch.bfloat16, seed=3).transpose(1, 2)  # stride_k != 1
    assert not w.is_contiguous()
    check(w)

def test_batched_equals_separate_2d_calls():
    w = wide_randn((3, 20, 64), torch.bfloat16, seed=4)
    ser = NVFP4(backend="triton")
    ctx = ser.group_context([w])
    batched = ser.quantize(w, context=ctx)
    for e in range(w.shape[0]):
        one = ser.quantize(w[e], context={"amax": ctx["amax"][e]})
        testing.assert_same_bytes({k: v[e] for k, v in batched.items()}, one, f"expert {e}")
    testing.assert_same_bytes(batched, NVFP4(backend="torch").quantize(w, context=ctx))

# ---- test-vector classes ------------------------------------------------------------

def test_all_zero_blocks_and_all_zero_tensor():
    w = torch.zeros(2, 4, 32, device=DEVICE)
    w[1, 2, 16:] = 3.0  # one non-zero block; expert 0 is all zero
    got = check(w)
    assert got["weight_scale_2"].cpu().tolist() == [1.0, torch.tensor(3.0 / 2688).item()]
    scales = got["weight_scale"].view(torch.uint8).cpu()
    assert int(scales[1, 2, 1]) == 0x7E  # the block holding the amax: scale 448
    scales[1, 2, 1] = 0
    assert int(scales.count_nonzero()) == 0
    codes = nibbles(got)
    assert codes[1, 2, 16:].tolist() == [7] * 16  # 3.0 at scale 448 * (3/2688): 6.0
    codes[1, 2, 16:] = 0
    assert int(codes.count_nonzero()) == 0

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiny_subnormal_range(dtype):
    g = gen(5)
    mag = 10.0 ** torch.empty(2, 16, 64).uniform_(-40, -35, generator=g)
    sign = torch.where(torch.rand(2, 16, 64, generator=g) < 0.5, -1.0, 1.0)
    got = check((mag * sign).to(dtype).to(DEVICE))
    scales = got["weight_scale"].view(torch.uint8).cpu()
    assert not bool(((scales & 0x7F) == 0x7F).any()), "NaN block scales from tiny inputs"
    assert bool(got["weight_scale_2"].isfinite().all())

def test_e2m1_rounding_and_nibble_order():
    # Global amax 2688 -> enc = 1; block amax 6 -> scale e4m3(6 * fp32(1/6)) = 1.0, so the
    # element multiplier is exactly 1 and codes are e2m1_rne(x) itself.
    vals = [1.0, 2.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.0, -0.75, -5.0, 0.5, 3.0,
            4.0]
    want = [0x2, 0x4, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7, 0x0, 0xA, 0xE, 0x1, 0x5, 0x6]
    w = torch.tensor([vals], dtype=torch.float32, device=DEVICE)
    got = check(w, context={"amax": torch.tensor(2688.0, device=DEVICE)})  # 2-D: amax []
    assert got["weight_scale"].view(torch.uint8).cpu().tolist() == [[0x38]]
    assert nibbles(got)[0].tolist() == want
    assert int(got["weight"][0, 0]) == 0x42  # [1.0, 2.0]: first element in the low nibble

def test_block_scale_saturates_at_448():
    # A context amax below the data's (caller-supplied): enc * amax_b / 6 > 448 -> 0x7E,
    # and elements x * 6 saturate at 6.0 (code 7).
    w = torch.full((1, 1, 16), 4.0, device=DEVICE)
    w[0, 0, 1] = -1e4
    got = check(w, context=amax_ctx(1.0), nonfinite="propagate")
    assert got["weight_scale"].view(torch.uint8).cpu().tolist() == [[[0x7E]]]
    assert nibbles(got)[0, 0, :2].tolist() == [0x7, 0xF]

@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN arithmetic (interpreter)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_propagate(dtype):
    w = wide_randn((3, 8, 64), torch.float32, seed=6).clamp(-1e4, 1e4)
    w[0, 0, 0], w[0, 3, 17] = float("nan"), -float("nan")
    w[1, 7, 63], w[1, 0, 5] = float("inf"), -float("inf")
    got = check(w.to(dtype), nonfinite="propagate")
    assert bool(got["weight_scale_2"][0].isnan())
    # expert 2 is finite and unaffected
    clean = NVFP4(backend="triton").quantize(w[2].to(dtype))
    testing.assert_same_bytes({k: v[2] for k, v in got.items()}, clean, "finite expert")

# (the non-finite error and the K % 16 refusal: tests/test_kernel_fp8.py, with the other formats)

# ---- shared helpers only NVFP4 uses -------------------------------------------------

from qstrat.serializers import nvfp4 as nvfp4_ref

def test_e4m3_decode_equals_torch_cast_for_all_codes():
    codes = torch.arange(256, dtype=torch.int32)
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float().view(torch.int32)
    assert torch.equal(testing.run_fp_encode("e4m3_decode", codes, DEVICE), want)

def test_e2m1_magnitude_equals_reference():
    g = gen(7)
    a = torch.cat([
        torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, float("inf"),
                      float("nan"), 1e-30]),
        torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).view(torch.int32).add(1)
        .view(torch.float32),
        torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).view(torch.int32).sub(1)
        .view(torch.float32),
        torch.rand(1 << 14, generator=g) * 8,
    ])
    assert torch.equal(testing.run_fp_encode("e2m1_magnitude", a, DEVICE), nvfp4_ref.e2m1_magnitude(a).to(torch.int32))

# ---- GPU only: offsets beyond 2^31 elements -----------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU with >= 16 GiB free")
def test_offsets_beyond_2_31_elements():
    reason = testing.check_offsets_beyond_2_31(NVFP4)
    if reason:
        pytest.skip(reason)
