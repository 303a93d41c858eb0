"""Triton kernel for :class:`qstrat.serializers.block_fp8.BlockFP8` (128 x 128 block FP8).

One launch quantizes a whole grouped slab ``[E, N, K]``: grid axis 0 walks the
``ceil(N/128) * ceil(K/128)`` tiles of one expert, axis 1 the expert. Each program loads one
128 x 128 tile through the input's strides (a non-contiguous view such as ``slab[:, :I, :]`` is
read in place), upcasts to fp32, and computes exactly the torch reference's ops:
``amax = max(max|x|, 1e-4)`` (NaN-propagating), ``s = amax / 448`` and ``1 / s`` as correctly
rounded divisions (``tl.math.div_rn``; GPU ``/`` is approximate), optional UE8M0 ``s``, then
``q = e4m3(x * (1 / s))``: by the GPU's ``cvt.rn.satfinite.e4m3x2`` on a native launch
(:func:`.launch.native_casts`: compiled, finite weights), else by the integer encoder in
:mod:`.fp_encode` (interpreter, ``nonfinite="propagate"``; same bytes: docs/formats.md, "Two
encoders, one result"). Per-element offsets are int32 (int64 where :func:`.launch.needs_int64`: one expert past
2^31), the expert's offset int64.
With ``nonfinite="propagate"`` a tile holding NaN gets a NaN scale and all-0x7F values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qstrat.serializers.block_fp8 import AMAX_FLOOR, BLOCK, BlockFP8
from qstrat.serializers.fp_bits import E4M3_MAX
from qstrat.serializers.kernels import fp_encode
from qstrat.serializers.kernels.launch import Launch, quantize_with, slab_input

#: Warps per 128 x 128 tile program (16384 fp32 values: 64 per thread at 8 warps). Chosen by the static report (docs/performance.md), not by timing.
NUM_WARPS = 8


@triton.jit
def _block_fp8_kernel(
    x_ptr, q_ptr, s_ptr,
    N, K, NB, KB,
    stride_e, stride_n, stride_k,
    AMAX_MIN: tl.constexpr, FP8_MAX: tl.constexpr, UE8M0: tl.constexpr, TILE: tl.constexpr,
    BF16_BITS: tl.constexpr, NATIVE: tl.constexpr, WIDE: tl.constexpr, E64: tl.constexpr,
):
    tile, e = fp_encode.program_ids(WIDE, E64)
    tn = tile // KB
    tk = tile % KB
    rows = tn * TILE + tl.arange(0, TILE).to(tile.dtype)
    cols = tk * TILE + tl.arange(0, TILE).to(tile.dtype)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    src = x_ptr + e * stride_e + rows[:, None] * stride_n + cols[None, :] * stride_k
    x = fp_encode.load_f32(src, mask, BF16_BITS)

    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    if not NATIVE:  # NaN can reach this path (nonfinite="propagate"): propagate it as torch does
        n_nan = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0)
        amax = fp_encode.nan_if(amax, n_nan > 0)
        amax = tl.where(amax != amax, amax, tl.maximum(amax, AMAX_MIN))  # torch clamp keeps NaN
    else:
        amax = tl.maximum(amax, AMAX_MIN)
    s = tl.math.div_rn(amax, FP8_MAX)
    if UE8M0:
        s = fp_encode.ceil_pow2(s)
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)

    dst = q_ptr + e * N * K + rows[:, None] * K + cols[None, :]
    if NATIVE:
        tl.store(dst, fp_encode.e4m3_native(x * inv), mask=mask)
    else:
        code = fp_encode.e4m3_encode(x * inv)
        # A NaN scale makes every product NaN; which NaN (sign) x * NaN returns when x is NaN too
        # depends on the machine's operand order, so the whole tile is pinned to 0x7F: what torch
        # gives on CPU and GPU (canonical positive NaN).
        code = tl.where(s != s, 0x7F, code)
        tl.store(dst, code.to(tl.uint8), mask=mask)
    tl.store(s_ptr + e * NB * KB + tile, s)


def plan_block_fp8(serializer: BlockFP8, w3: torch.Tensor, ctx=None, arch: int | None = None) -> Launch:
    """The one launch that quantizes a grouped slab to block FP8 (reads no data: ``w3`` may be a
    ``meta`` tensor, see :mod:`.static_report`).

    Args:
        serializer: the :class:`BlockFP8` instance (reads ``options.ue8m0``).
        w3: [E, N, K] bf16/fp16/fp32 on CUDA (or CPU under ``TRITON_INTERPRET=1``), any strides;
            read in place, never copied.
        ctx: unused (block FP8 has no group state); accepted for the hook signature.
        arch: compute capability compiled for (:func:`.launch.device_arch`; None: interpreter).
    Returns:
        the :class:`.launch.Launch`, whose outputs are ``{"weight": float8_e4m3fn [E, N, K], "weight_scale_inv": float32 [E, ceil(N/128),
        ceil(K/128)]}``, contiguous, on ``w3``'s device; bytes identical to
        ``BlockFP8.reference`` (vLLM ``per_block_cast_to_fp8`` math, see block_fp8.py).
    Raises:
        ValueError: ``w3`` is not 3-D.
    """
    slab = slab_input("block_fp8", w3, arch, serializer.options.nonfinite)
    e, n, k, x = slab.e, slab.n, slab.k, slab.x
    nb, kb = triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)
    q = torch.empty((e, n, k), dtype=torch.uint8, device=w3.device)
    s = torch.empty((e, nb, kb), dtype=torch.float32, device=w3.device)
    return Launch(
        _block_fp8_kernel, (nb * kb, e), (x, q, s, n, k, nb, kb, *x.stride()),
        dict(AMAX_MIN=AMAX_FLOOR, FP8_MAX=E4M3_MAX, UE8M0=bool(serializer.options.ue8m0),
             TILE=BLOCK, **slab.constexprs(w3, q)),
        NUM_WARPS, {"weight": q.view(torch.float8_e4m3fn), "weight_scale_inv": s}, w3)


quantize_block_fp8 = quantize_with("block_fp8", plan_block_fp8)
