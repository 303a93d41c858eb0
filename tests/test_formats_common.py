"""Torch-reference properties several formats share, one test parametrized over the formats:
a grouped [E, N, K] slab is E separate 2-D calls, row chunking and strided views do not change a
byte, fp32-subnormal inputs (docs/test-vectors.md "tiny blocks") give no NaN and no +-448
garbage, and dequantized e4m3 elements keep e4m3's precision.

Each format's own test vectors and vLLM comparisons are in tests/test_block_fp8.py,
tests/test_mxfp8.py and tests/test_nvfp4.py (NVFP4 checks its slabs and chunking there, next to
its per-expert global scale)."""
from __future__ import annotations

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
