"""Exact fp32 bit arithmetic shared by the formats (torch reference side).

Scale exponents are computed from the IEEE-754 bits of fp32 values, never with ``log2``/``exp2``
(approximate on GPUs), so the torch reference and the Triton kernels agree bit for bit.
The kernels in :mod:`qstrat.serializers.kernels` implement the same formulas with ``tl`` ops.
"""
from __future__ import annotations

import torch

#: e4m3fn: largest finite magnitude (OCP FP8 spec, "E4M3": bias 7, no infinities).
E4M3_MAX = 448.0
#: fp32 mantissa of 448 = 1.75 * 2^8 is 0x600000: an amax mantissa above it needs one more octave.
_MANT_1_75 = 0x600000
#: E8M0 bias (OCP Microscaling Formats spec v1.0, section 5.4) and its NaN code.
E8M0_BIAS = 127
E8M0_NAN = 255


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0 ** e`` as fp32, built from bits.

    Args:
        e: integer tensor (any int dtype, any shape), unbiased exponents in [-149, 127].
    Returns:
        float32 tensor of e's shape. ``e >= -126`` gives a normal number ``(e + 127) << 23``;
        ``-149 <= e <= -127`` gives the subnormal ``1 << (e + 149)`` (building it as ``0 << 23``
        would give 0.0, a known bug class for E8M0 byte 0 = 2^-127).
    """
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=0) << 23
    sub = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, sub).view(torch.float32)


def e8m0_from_amax(amax: torch.Tensor, rounding: str = "rceil") -> torch.Tensor:
    """E8M0 scale byte of an MX block from its fp32 amax (exact integer bit operations).

    RCEIL (vLLM, FlashInfer, TransformerEngine, cuBLAS): ``clamp(ceil(log2(amax / 448)) + 127, 0, 254)``.
    With ``amax = m * 2^(b - 127)``, ``1 <= m < 2``: ``byte = b - 8 + (m > 1.75)``; amax = 448 * 2^k
    gives exactly ``127 + k``. FLOOR (OCP MX spec v1.0, section 6.3): ``floor(log2 amax) - 8 + 127``
    = ``b - 8``. Zero and fp32-subnormal amax give byte 0; NaN amax gives 255; +inf amax gives
    254 under both rules: ``ceil(log2 inf)`` clamped to 254, as vLLM's
    ``_mxfp8_e4m3_quantize_torch`` gives (tests/test_mxfp8.py) and as a saturating
    (``.satfinite``) GPU ue8m0 conversion does; the exponent-field formula alone gives 247.

    Args:
        amax: float32 tensor of block maxima of |x| (>= 0 or NaN), any shape.
        rounding: ``"rceil"`` or ``"floor"``.
    Returns:
        int32 tensor of amax's shape with values in [0, 255].
    """
    bits = amax.to(torch.float32).contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    byte = biased - 8
    if rounding == "rceil":
        byte = byte + ((bits & 0x7FFFFF) > _MANT_1_75).to(torch.int32)
    elif rounding != "floor":
        raise ValueError(f"rounding must be 'rceil' or 'floor', got {rounding!r}")
    byte = torch.where(biased == 0, torch.zeros_like(byte), byte.clamp(0, 254))
    byte = torch.where(biased == 0xFF, torch.full_like(byte, 254), byte)  # +inf (NaN: below)
    return torch.where(torch.isnan(amax), torch.full_like(byte, E8M0_NAN), byte)


def ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """Round positive normal fp32 values UP to a power of two: ``2^ceil(log2 s)`` (UE8M0 scales).

    Exact from bits (vLLM's ``_ceil_to_ue8m0`` uses log2/pow, which can round 2^k(1+eps) down).
    +inf stays +inf; NaN stays NaN (``2^ceil(log2 NaN)`` is NaN in vLLM's formula too; the
    exponent-field formula alone would give the bits 0x80000000 = -0.0).
    Args: s: float32 tensor, values > 0 and normal, or +inf/NaN. Returns: float32 tensor of the
    same shape.
    """
    s = s.to(torch.float32)
    bits = s.contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.where(torch.isnan(s), s, exp2_int(e))
