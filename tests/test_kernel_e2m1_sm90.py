"""The sm_90 E2M1 encoder (``fp_encode.e2m1_from_bits``) checked on every input that reaches it.

It runs in the native NVFP4 branch on sm_90 (no ``cvt.rn.satfinite.e2m1x2`` there) on
``y = fma(x, os, +0.0)``, finite (a native launch has finite weights and finite multipliers;
``|y| <= 6 * (1 + 2^-22)`` in fact, but the argument below does not need that bound). The
reachable set is every finite fp32 ``y``, and the claim is: its code equals
``e2m1_magnitude(|y|) | 8 * signbit(y)`` (``cvt.rn.satfinite.e2m1x2``'s result: RNE on the E2M1
grid, saturate at 6, the sign bit is y's), the reference's nibble.

Reduction, from the encoder's source (checked below, not assumed):
1. ``y`` enters only through ``a = min(|y|, 6.0)`` and ``(bits(y) >> 28) & 8`` (= bit 31 moved to
   bit 3). So the code of y is ``g(a) | sign``, and every ``|y| >= 6`` has ``a = 6`` exactly:
   checking every fp32 ``a`` in [0, 6] (with either sign) covers every finite y.
2. [0.25, 6] (fp32 bits 0x3E800000..0x40C00000, 37.7 million values): run exhaustively (one
   sign per magnitude: by 1 the magnitude's code does not depend on the sign; both signs occur).
3. [0, 0.25) (fp32 bits 0..0x3E7FFFFF): for ``a < 1`` the exponent field is <= 126, so
   ``mb = max(expbits + (22 << 23) + 6, (149 << 23) + 6)`` is the constant ``(149 << 23) + 6``
   (checked for every exponent field 0..126); with M fixed, ``a -> fl(a + M)`` is monotone (IEEE
   round-to-nearest addition is), so every a in [0, prev(0.25)] gives the same ``r`` as both ends,
   which are run (together with every 2^20-th value between, as a spot check): code 0.
Runs under the interpreter on CPU (numpy's fp32 add is IEEE RNE, as the GPU's ``add.f32``), and
compiled on a GPU.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'qstrat[triton]')")

import kernel_harness as testing  # noqa: E402
from qstrat.serializers.kernels import fp_encode  # noqa: E402
from qstrat.serializers.nvfp4 import e2m1_magnitude  # noqa: E402

DEVICE = testing.require_kernel_device()
pytestmark = pytest.mark.interpreter if DEVICE == "cpu" else []

BITS_QUARTER = 0x3E800000  # 0.25
BITS_SIX = 0x40C00000  # 6.0
BLOCK = 1 << 20  # triton's largest tensor


def cvt_reference(y: torch.Tensor) -> torch.Tensor:
    """``cvt.rn.satfinite.e2m1x2`` on finite fp32 ``y`` as int32 codes, from the reference ladder."""
    sign = (y.view(torch.int32) < 0).to(torch.int32) << 3
    return e2m1_magnitude(y.abs()).to(torch.int32) | sign


def encode(bits: torch.Tensor) -> torch.Tensor:
    return testing.run_fp_encode("e2m1_from_bits", bits.view(torch.float32), DEVICE, block=BLOCK)


def test_inputs_enter_only_through_min_abs_and_sign_bit():
    """Step 1 of the reduction, read off the source: y appears exactly twice."""
    src = inspect.getsource(fp_encode.e2m1_from_bits.fn)
    body = src.split('"""')[-1]
    assert re.findall(r"\by\b", body) == ["y", "y"], body
    assert "a = tl.minimum(tl.abs(y), 6.0)" in body and "((f32_bits(y) >> 28) & 8)" in body


def test_every_fp32_in_quarter_to_six():
    """Step 2: all 37,748,737 fp32 magnitudes in [0.25, 6]; every 7th with the sign bit set too
    (the sign's path is separate from the magnitude's: step 1)."""
    for lo in range(BITS_QUARTER, BITS_SIX + 1, 1 << 24):
        hi = min(lo + (1 << 24), BITS_SIX + 1)
        bits = torch.arange(lo, hi, dtype=torch.int32)
        bits[::7] |= -(2**31)
        got = encode(bits)
        want = cvt_reference(bits.view(torch.float32))
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, (
            f"{bad.numel()} codes differ; first: bits {int(bits[bad[0]]) & 0xFFFFFFFF:#010x} "
            f"({bits.view(torch.float32)[bad[0]].item()!r}) -> {int(got[bad[0]])}, want {int(want[bad[0]])}")


def test_below_quarter_is_code_zero_by_monotonicity():
    """Step 3: the constant M for every exponent field below 1.0, and r at both ends (and a spot
    check between) of [0, 0.25) equal to bits(M), whose code is 0 (with the sign bit)."""
    for expo in range(127):  # exponent field of a < 1: the max() picks the constant
        assert max((expo << 23) + (22 << 23) + 6, (149 << 23) + 6) == (149 << 23) + 6
    bits = torch.cat([torch.arange(0, BITS_QUARTER, 1 << 20, dtype=torch.int32),
                      torch.tensor([0, 1, BITS_QUARTER - 1], dtype=torch.int32)])
    for sign in (0, -(2**31)):
        b = bits | sign
        got = encode(b)
        assert torch.equal(got, cvt_reference(b.view(torch.float32)))
        assert set(got.tolist()) == {8 if sign else 0}


def test_saturation_and_signs_above_six():
    """|y| > 6 up to the largest finite fp32: a = 6 exactly, code 7 (6.0) with the sign."""
    bits = torch.cat([torch.arange(BITS_SIX, 0x7F800000, 1 << 16, dtype=torch.int32),
                      torch.tensor([0x7F7FFFFF], dtype=torch.int32)])
    for sign in (0, -(2**31)):
        got = encode(bits | sign)
        assert set(got.tolist()) == {15 if sign else 7}
