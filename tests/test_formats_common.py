"""Torch-reference properties several formats share, one test parametrized over the formats:
a grouped [E, N, K] slab is E separate 2-D calls, row chunking and strided views do not change a
byte, fp32-subnormal inputs (docs/test-vectors.md "tiny blocks") give no NaN and no +-448
garbage, and dequantized e4m3 elements keep e4m3's precision.

Each format's own test vectors and vLLM comparisons are in tests/test_block_fp8.py,
tests/test_mxfp8.py and tests/test_nvfp4.py (NVFP4 checks its slabs and chunking there, next to
its per-expert global scale)."""
from __future__ import annotations

import re

import pytest
import torch

import qstrat
from fp8_cases import as_bytes


@pytest.mark.parametrize("name", ["block_fp8", "mxfp8", "bf16"])
def test_batched_equals_separate_2d_calls(name):
    ser = qstrat.get_serializer(name, backend="torch")
    w = torch.randn(5, 192, 256, dtype=torch.bfloat16)
    batched = ser.quantize(w)
    for e in range(5):
        single = ser.quantize(w[e])
        for k, v in single.items():
            assert torch.equal(as_bytes(batched[k][e]), as_bytes(v)), (k, e)


@pytest.mark.parametrize("name", ["block_fp8", "mxfp8"])
def test_chunking_does_not_change_bytes(name):
    w = torch.randn(3, 520, 384, dtype=torch.bfloat16)
    big = qstrat.get_serializer(name, backend="torch").quantize(w)
    small = qstrat.get_serializer(name, backend="torch", chunk_elements=128 * 384).quantize(w)
    for k in big:
        assert torch.equal(as_bytes(big[k]), as_bytes(small[k]))


@pytest.mark.parametrize("name", ["block_fp8", "mxfp8"])
def test_strided_view_input_matches_contiguous(name):
    slab = torch.randn(4, 512, 256, dtype=torch.bfloat16)
    view = slab[:, 256:, :]
    ser = qstrat.get_serializer(name, backend="torch")
    a, b = ser.quantize(view), ser.quantize(view.contiguous())
    assert all(torch.equal(as_bytes(a[k]), as_bytes(b[k])) for k in a)


@pytest.mark.parametrize("name", ["block_fp8", "mxfp8"])
def test_tiny_subnormal_blocks_give_no_nan_and_no_saturation(name):
    w = torch.linspace(1e-40, 1e-35, 64).reshape(2, 32)
    ser = qstrat.get_serializer(name, backend="torch")
    p = ser.quantize(w)
    deq = ser.dequantize(p)
    assert torch.isfinite(deq).all()
    assert deq.abs().max() < 1e-30  # never +-448 garbage


@pytest.mark.parametrize("name", ["block_fp8", "mxfp8"])
def test_dequantize_error_is_bounded_by_e4m3_precision(name):
    w = torch.randn(256, 512)
    ser = qstrat.get_serializer(name, backend="torch")
    err = (ser.dequantize(ser.quantize(w)) - w).abs()
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of the value, plus subnormal
    # granularity of 2^-9 * scale near zero (scale <= amax / 224 for both formats here).
    bound = w.abs() * 2 ** -4 + w.abs().max() / 224 * 2 ** -9
    assert (err <= bound + 1e-12).all()


# ---- finite inputs whose decode overflows (issue 36, "Also") ----------------------------------
F32_MAX = torch.finfo(torch.float32).max


def _near_max(dtype):
    """A [128, 128] weight at the top of ``dtype``'s range: float32's max in one element, bf16's max
    (3.3895e38) everywhere else - finite, and representable in bfloat16 too."""
    w = torch.full((128, 128), 3.38e38, dtype=torch.float32)
    if dtype == torch.float32:
        w[5, 7] = F32_MAX
    return w.to(dtype)


@pytest.mark.parametrize("backend", ["torch", "fast"])
@pytest.mark.parametrize("name,opts,dtype,index", [
    ("block_fp8", {"ue8m0": True}, torch.float32, "[0, 0]"),    # scale rounded up to 2^120: 256 * 2^120 = inf
    ("block_fp8", {"ue8m0": True}, torch.bfloat16, "[0, 0]"),
    ("mxfp8", {}, torch.float32, "[0, 0]"),                     # RCEIL: the same
    ("mxfp8", {}, torch.bfloat16, "[0, 0]"),
    ("bf16", {}, torch.float32, "[5, 7]"),                      # an fp32 value above bfloat16's max casts to inf
])
def test_finite_values_that_decode_to_inf_are_a_nonfinite_error(name, opts, dtype, index, backend):
    """The old code emitted these without a word: the engine then reads inf weights."""
    ser = qstrat.get_serializer(name, backend=backend, **opts)
    w = _near_max(dtype)
    peak = f"{float(w.float().abs().max()):.6g}"
    with_opts = f" with {opts}" if opts else ""
    message = (f"w: its finite values (largest magnitude {peak}) decode to a non-finite value in {name}{with_opts} "
               f"at index {index}: a scale or element rounded up past float32's max")
    with pytest.raises(qstrat.NonFiniteError, match="^" + re.escape(message)):
        ser.quantize(w, name="w")
    with pytest.raises(qstrat.NonFiniteError, match=r"^w: its finite values"):
        ser.check_values(w, "w")  # what a refit runs before the first byte
    ser = qstrat.get_serializer(name, backend=backend, nonfinite="propagate", **opts)
    assert not torch.isfinite(ser.dequantize(ser.quantize(w))).all()  # propagate: encoded as asked


@pytest.mark.parametrize("name,opts", [("block_fp8", {}), ("mxfp8", {"scale_rounding": "floor"}), ("nvfp4", {}),
                                       ("bf16", {})])
def test_near_max_values_that_decode_finitely_are_accepted(name, opts):
    """The same weights where the format's rounding stays below float32's max (bf16: a bf16 input)."""
    ser = qstrat.get_serializer(name, **opts)
    for dtype in ((torch.bfloat16,) if name == "bf16" else (torch.float32, torch.bfloat16)):
        w = _near_max(dtype)
        assert torch.isfinite(ser.dequantize(ser.quantize(w, name="w"))).all()
        ser.check_values(w, "w")


@pytest.mark.parametrize("values", ["first", "inline"])
def test_a_refit_refuses_them_before_emitting_the_tensor(values):
    t = {"model.layers.0.self_attn.o_proj.weight": _near_max(torch.float32)}
    driver = qstrat.RefitDriver({"rules": [{"select": "linear", "serializer": "mxfp8"}]})
    emitted = []
    with pytest.raises(qstrat.NonFiniteError, match=r"^model\.layers\.0\.self_attn\.o_proj\.weight: its finite "
                                                    r"values \(largest magnitude 3\.40282e\+38\) decode"):
        for name, _ in driver.prepare(t, values=values).execute():
            emitted.append(name)
    assert emitted == []


@pytest.mark.parametrize("backend", ["torch", "fast"])
@pytest.mark.parametrize("name", ["block_fp8", "mxfp8", "nvfp4", "bf16"])
def test_a_trainers_parameter_quantizes_like_its_tensor(name, backend):
    """The README's one-liner with a trainer's nn.Parameter raised autograd errors on the fast
    path (``abs(): functions with out=... arguments don't support automatic differentiation``,
    NVFP4: ``a leaf Variable that requires grad is being used in an in-place operation``)."""
    ser = qstrat.get_serializer(name, backend=backend)
    w = torch.randn(2, 128, 128, dtype=torch.bfloat16)
    param = torch.nn.Parameter(w.clone())
    got, want = ser.quantize(param), ser.quantize(w)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(as_bytes(got[k]), as_bytes(want[k])) and not got[k].requires_grad, k
    ctx = ser.group_context([param])
    if ctx is not None:  # a fused group's context built from parameters
        ser.quantize(param, context=ctx)
    assert param.grad is None and torch.equal(param.detach(), w)
