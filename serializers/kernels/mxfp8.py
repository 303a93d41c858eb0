"""Triton kernel for :class:`qstrat.serializers.mxfp8.MXFP8` (E4M3 + E8M0 per 1 x 32 along K).

One launch quantizes a whole grouped slab ``[E, N, K]``: grid axis 0 walks the
``ceil(N/BLOCK_N) * ceil(K/BLOCK_K)`` tiles of one expert, axis 1 the expert. A program loads a
``[BLOCK_N, BLOCK_K/32, 32]`` view of its tile through the input's strides (non-contiguous views are
read in place), upcasts to fp32, and per 32-block computes exactly the torch reference's ops:
NaN-propagating ``amax``, the E8M0 byte from the amax bits (RCEIL or FLOOR,
:func:`.fp_encode.e8m0_from_amax`), the ``min_scale_byte`` clamp (NaN byte 255 kept), the exact
``1/s = 2^(127 - byte)`` from bits, and ``q = e4m3(x * (1/s))``: the GPU's
``cvt.rn.satfinite.e4m3x2`` on a native launch (:func:`.launch.native_casts`; finite maxima, so
the byte needs no NaN/inf cases: :func:`.fp_encode.e8m0_from_finite_amax`), else the integer
encoder. Per-element offsets are int32 (int64 where :func:`.launch.needs_int64`: one expert past
2^31), the expert's offset int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qstrat.serializers.fp_bits import E8M0_BIAS
from qstrat.serializers.kernels import fp_encode
from qstrat.serializers.kernels.launch import Launch, quantize_with, slab_input
from qstrat.serializers.mxfp8 import BLOCK, MXFP8

#: Tile of one program: BLOCK_N rows x BLOCK_K columns (BLOCK_K a multiple of 32). Chosen by the static report (docs/performance.md), not by timing.
BLOCK_N = 32
BLOCK_K = 128
NUM_WARPS = 4


@triton.jit
def _mxfp8_kernel(
    x_ptr, q_ptr, s_ptr,
    N, K, KT,
    stride_e, stride_n, stride_k,
    RCEIL: tl.constexpr, MIN_BYTE: tl.constexpr, BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MX: tl.constexpr,
    BF16_BITS: tl.constexpr, NATIVE: tl.constexpr, WIDE: tl.constexpr, E64: tl.constexpr,
):
    tile, e = fp_encode.program_ids(WIDE, E64)
    x, rows, groups, r3, c3, mask = fp_encode.load_block_tile(  # 32-element blocks along K
        x_ptr, e, tile, N, K, KT, stride_e, stride_n, stride_k, BLOCK_N, BLOCK_K, MX, BF16_BITS)

    dst = q_ptr + e * N * K + r3 * K + c3
    if NATIVE:  # finite inputs: finite amax, byte in [MIN_BYTE, 254]
        byte = fp_encode.e8m0_from_finite_amax(tl.max(tl.abs(x), axis=2), RCEIL, MIN_BYTE)
        inv = fp_encode.exp2_int(BIAS - byte)  # exact 1/s: x * 2^-j == x / 2^j bit for bit
        tl.store(dst, fp_encode.e4m3_native(x * inv[:, :, None]), mask=mask)
    else:
        amax = fp_encode.amax_last_axis(x)
        byte = fp_encode.e8m0_from_amax(amax, RCEIL)
        byte = tl.where(byte == 255, byte, tl.maximum(byte, MIN_BYTE))
        inv = fp_encode.exp2_int(BIAS - byte)
        code = fp_encode.e4m3_encode(x * inv[:, :, None])
        tl.store(dst, code.to(tl.uint8), mask=mask)
    fp_encode.store_block_scales(s_ptr, e, N, K // MX, rows, groups, byte)


def plan_mxfp8(serializer: MXFP8, w3: torch.Tensor, ctx=None, arch: int | None = None) -> Launch:
    """The one launch that quantizes a grouped slab to MXFP8 (reads no data: ``w3`` may be a
    ``meta`` tensor, see :mod:`.static_report`).

    Args:
        serializer: the :class:`MXFP8` instance (reads ``options.scale_rounding`` and
            ``options.min_scale_byte``).
        w3: [E, N, K] bf16/fp16/fp32 on CUDA (or CPU under ``TRITON_INTERPRET=1``), any strides,
            ``K % 32 == 0``; read in place, never copied.
        ctx: unused (MXFP8 has no group state); accepted for the hook signature.
        arch: compute capability compiled for (:func:`.launch.device_arch`; None: interpreter).
    Returns:
        the :class:`.launch.Launch`, whose outputs are ``{"weight": float8_e4m3fn [E, N, K], "weight_scale": uint8 [E, N, K/32]}`` (raw E8M0
        bytes), contiguous, on ``w3``'s device; bytes identical to ``MXFP8.reference``
        (formulas: mxfp8.py and docs/formats.md: OCP MX spec v1.0 blocks, vLLM's RCEIL scale as in
        ``_mxfp8_e4m3_quantize_torch``).
    Raises:
        ValueError: ``w3`` is not 3-D. UnsupportedShapeError: ``K % 32 != 0``.
    """
    opts = serializer.options
    slab = slab_input("mxfp8", w3, arch, opts.nonfinite, BLOCK)
    e, n, k, x = slab.e, slab.n, slab.k, slab.x
    q = torch.empty((e, n, k), dtype=torch.uint8, device=w3.device)
    s = torch.empty((e, n, k // BLOCK), dtype=torch.uint8, device=w3.device)
    kt = triton.cdiv(k, BLOCK_K)
    return Launch(
        _mxfp8_kernel, (triton.cdiv(n, BLOCK_N) * kt, e), (x, q, s, n, k, kt, *x.stride()),
        dict(RCEIL=opts.scale_rounding == "rceil", MIN_BYTE=int(opts.min_scale_byte),
             BIAS=E8M0_BIAS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, MX=BLOCK, **slab.constexprs(w3, q)),
        NUM_WARPS, {"weight": q.view(torch.float8_e4m3fn), "weight_scale": s}, w3)


quantize_mxfp8 = quantize_with("mxfp8", plan_mxfp8)
