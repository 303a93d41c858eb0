"""Triton kernel for :class:`qstrat.serializers.nvfp4.NVFP4` (E2M1 + e4m3 scale per 1 x 16).

One launch quantizes a whole grouped slab ``[E, N, K]``: grid axis 0 walks the
``ceil(N/BLOCK_N) * ceil(K/BLOCK_K)`` tiles of one expert, axis 1 the expert. The per-expert
global amax comes in through the group context (``{"amax": [E]}`` from
:meth:`NVFP4.group_context`, shared by fused members); every program derives the expert's
``enc`` and ``weight_scale_2`` from it with the reference's fp32 ops, so nothing is computed on
the host and nothing syncs. A program loads ``[BLOCK_N, BLOCK_K/16, 16]`` through the input's
strides (views read in place; int64 per-element offsets where :func:`.launch.needs_int64`), upcasts to fp32, and per 16-block mirrors
``NVFP4.reference`` step by step (see nvfp4.py for the formulas and their vLLM source):

1. ``enc = div_rn(2688, amax)``, capped at 2^116, 1 where amax == 0; ``dec = div_rn(1, enc)``;
2. ``scale = e4m3(enc * (amax_b * fp32(1/6)))`` (saturates at 448);
3. ``os = 1 / (fp32(scale) * dec)`` correctly rounded, 0 where the scale is 0;
4. ``code = e2m1(|x * os|) | 8 * (x < 0)``, packed two per byte, even element in the low nibble.

A native launch (:func:`.launch.native_casts`: compiled, finite weights) converts with
``cvt.rn.satfinite.e4m3x2`` (step 2) and ``cvt.rn.satfinite.e2m1x2`` (step 4, sm_100+; on sm_90
:func:`.fp_encode.e2m1_from_bits`) the value ``fma(x, os, +0.0)``, with ``os = 2^-149`` for a
zero scale, which carries the reference's sign rule (docs/formats.md, "Two encoders, one
result"); the interpreter and ``nonfinite="propagate"`` use the integer encoders.

Divisions are ``tl.math.div_rn`` or ``rcp.rn`` (correctly rounded; GPU ``/`` is approximate). Programs of tile
0 also write the expert's ``weight_scale_2`` and ``input_scale``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qstrat.serializers.kernels import fp_encode
from qstrat.serializers.kernels.launch import Launch, quantize_with, slab_input
from qstrat.serializers.nvfp4 import BLOCK, ENC_MAX, GLOBAL_MAX, NVFP4, RCP_E2M1_MAX

#: Tile of one program: BLOCK_N rows x BLOCK_K columns (BLOCK_K a multiple of 16). 64 x 128: the fewest SASS per element at <= 128 registers (static report; docs/performance.md).
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4


@triton.jit
def _nvfp4_kernel(
    x_ptr, amax_ptr, q_ptr, s_ptr, s2_ptr, in_ptr,
    N, K, KT, input_scale,
    stride_e, stride_n, stride_k, stride_amax,
    GMAX: tl.constexpr, EMAX: tl.constexpr, RCP6: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FB: tl.constexpr, BF16_BITS: tl.constexpr,
    NATIVE: tl.constexpr, NATIVE_E2M1: tl.constexpr, WIDE: tl.constexpr, E64: tl.constexpr,
):
    tile, e = fp_encode.program_ids(WIDE, E64)

    # Step 1: the expert's global encode scale (nvfp4.global_encode_scale) and its reciprocal.
    amax_t = tl.load(amax_ptr + e * stride_amax)  # float32 (the host converts)
    enc = tl.math.div_rn(tl.full([], GMAX, tl.float32), tl.where(amax_t == 0, 1.0, amax_t))
    enc = tl.where(enc > EMAX, EMAX, enc)  # torch clamp(max=): NaN stays NaN
    enc = tl.where(amax_t == 0, 1.0, enc)
    dec = tl.math.div_rn(tl.full([], 1.0, tl.float32), enc)
    if tile == 0:
        tl.store(s2_ptr + e, dec)
        tl.store(in_ptr + e, input_scale)

    G: tl.constexpr = BLOCK_K // FB
    x, rows, groups, r3, c3, mask = fp_encode.load_block_tile(  # 16-element blocks along K
        x_ptr, e, tile, N, K, KT, stride_e, stride_n, stride_k, BLOCK_N, BLOCK_K, FB, BF16_BITS)

    # Step 2: e4m3 block scale.
    amax_b = tl.max(tl.abs(x), axis=2) if NATIVE else fp_encode.amax_last_axis(x)
    if NATIVE:  # finite: enc * (amax_b * 1/6) <= 2688 * (1 + 2^-22): satfinite == clamp at 448
        scale = fp_encode.e4m3_native(enc * (amax_b * RCP6))
        s = fp_encode.e4m3_native_value(scale)
    else:
        scale = fp_encode.e4m3_encode(enc * (amax_b * RCP6))
        s = fp_encode.e4m3_decode(scale)
    # Step 3: element multiplier from the DECODED scale.
    zero = s == 0
    denom = tl.where(zero, 1.0, s * dec)  # no 1/0 on the discarded lanes
    if NATIVE:
        rcp = fp_encode.rcp_native(denom)  # rcp.rn.f32: correctly rounded, = div_rn(1, denom)
        # Step 4 by the sign of y = fma(x, os, +0.0): RNE(x*os + 0) is x*os rounded, and its sign
        # is x's sign for every x != -0.0 (a nonzero product keeps its sign even when it rounds
        # to zero), +0.0 for x = -0.0: exactly the reference's "8 * (x < 0)". A zero scale's
        # os = 0 becomes 2^-149: |x * 2^-149| < 0.25 rounds to code 0 for every finite x, as 0 does,
        # and keeps the sign for the same reason (docs/formats.md, "Two encoders, one result").
        os = tl.where(zero, 1.401298464324817e-45, rcp)
        y = tl.fma(x, os[:, :, None], 0.0)
        lo, hi = tl.split(tl.reshape(y, (BLOCK_N, G, FB // 2, 2)))
        if NATIVE_E2M1:
            packed = fp_encode.e2m1x2_native(lo, hi)
        else:
            packed = fp_encode.e2m1_from_bits(lo) | (fp_encode.e2m1_from_bits(hi) << 4)
    else:
        os = tl.where(zero, 0.0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), denom))
        # Step 4: E2M1 codes, sign from x itself, two per byte (even element in the low nibble).
        code = fp_encode.e2m1_magnitude(tl.abs(x * os[:, :, None])) | ((x < 0).to(tl.int32) << 3)
        lo, hi = tl.split(tl.reshape(code, (BLOCK_N, G, FB // 2, 2)))
        packed = lo | (hi << 4)

    KH = K // 2
    pairs = groups[None, :, None] * (FB // 2) + tl.arange(0, FB // 2).to(tile.dtype)[None, None, :]
    tl.store(q_ptr + e * N * KH + r3 * KH + pairs, packed.to(tl.uint8),
             mask=(r3 < N) & (pairs < KH))
    fp_encode.store_block_scales(s_ptr, e, N, K // FB, rows, groups, scale)


def plan_nvfp4(serializer: NVFP4, w3: torch.Tensor, ctx=None, arch: int | None = None) -> Launch:
    """The one launch that quantizes a grouped slab to NVFP4 (reads no data: ``w3`` may be a
    ``meta`` tensor, see :mod:`.static_report`).

    Args:
        serializer: the :class:`NVFP4` instance (reads ``options.input_scale``).
        w3: [E, N, K] bf16/fp16/fp32 on CUDA (or CPU under ``TRITON_INTERPRET=1``), any strides,
            ``K % 16 == 0``; read in place, never copied.
        ctx: ``{"amax": float32 [E]}`` from :meth:`NVFP4.group_context` (the fusion group's
            per-expert max|W|); ``None`` computes it from ``w3`` alone (a group of one).
        arch: compute capability compiled for (:func:`.launch.device_arch`; None: interpreter).
    Returns:
        the :class:`.launch.Launch`, whose outputs are ``{"weight": uint8 [E, N, K/2], "weight_scale": float8_e4m3fn [E, N, K/16],
        "weight_scale_2": float32 [E], "input_scale": float32 [E]}``, contiguous, on ``w3``'s
        device; bytes identical to ``NVFP4.reference`` (formulas: nvfp4.py and docs/formats.md,
        after vLLM's ``ref_nvfp4_quant``).
    Raises:
        ValueError: ``w3`` is not 3-D, or ``ctx["amax"]`` is not [E].
        UnsupportedShapeError: ``K % 16 != 0``.
    """
    slab = slab_input("nvfp4", w3, arch, serializer.options.nonfinite, BLOCK)
    e, n, k, x, native = slab.e, slab.n, slab.k, slab.x, slab.native
    if ctx is None:
        ctx = serializer.group_context([w3])
    amax = ctx["amax"].reshape(-1)
    if amax.shape[0] != e:
        raise ValueError(f"nvfp4 kernel: context amax has {amax.shape[0]} entries for E={e}")
    amax = amax.to(device=w3.device, dtype=torch.float32)
    dev = w3.device
    q = torch.empty((e, n, k // 2), dtype=torch.uint8, device=dev)
    s = torch.empty((e, n, k // BLOCK), dtype=torch.uint8, device=dev)
    s2 = torch.empty((e,), dtype=torch.float32, device=dev)
    inp = torch.empty((e,), dtype=torch.float32, device=dev)
    kt = triton.cdiv(k, BLOCK_K)
    return Launch(
        _nvfp4_kernel, (triton.cdiv(n, BLOCK_N) * kt, e),
        (x, amax, q, s, s2, inp, n, k, kt, float(serializer.options.input_scale),
         *x.stride(), amax.stride(0)),
        dict(GMAX=GLOBAL_MAX, EMAX=ENC_MAX, RCP6=RCP_E2M1_MAX, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
             FB=BLOCK, NATIVE_E2M1=native and arch >= 100, **slab.constexprs(w3, q)),
        NUM_WARPS,
        {"weight": q, "weight_scale": s.view(torch.float8_e4m3fn), "weight_scale_2": s2,
         "input_scale": inp},
        w3)


quantize_nvfp4 = quantize_with("nvfp4", plan_nvfp4)
