"""Triton device helpers shared by every format kernel: exact fp32-bit encoders.

Everything here is integer arithmetic on the IEEE-754 bits of fp32 values, so a kernel gives the
same bytes compiled for a GPU and under Triton's interpreter (``TRITON_INTERPRET=1``), whose
fp32 -> fp8 cast is wrong (ties round away, lost carries, no saturation; docs/plugins.md,
"Optional kernel").
The torch-side twins of these formulas are in :mod:`qstrat.serializers.fp_bits`; the oracle for
:func:`e4m3_encode` is torch 2.13's ``.to(torch.float8_e4m3fn)`` on CPU.

All helpers take and return Triton tensors of any (matching) shape; ``int32`` codes are returned
so callers can combine them before the final ``.to(tl.uint8)`` store.

Which Triton mode a helper is built for (compiled or interpreted) is decided, as for any
``@triton.jit`` function, by ``TRITON_INTERPRET`` when this module is imported.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

#: fp32 bits of 448.0 (e4m3fn largest finite, OCP FP8 spec): larger magnitudes saturate to it.
F32_BITS_448 = tl.constexpr(0x43E00000)
#: fp32 bits of +inf; anything above is NaN.
F32_BITS_INF = tl.constexpr(0x7F800000)
#: fp32 mantissa of 1.75 (448 = 1.75 * 2^8): RCEIL adds one octave above it (fp_bits._MANT_1_75).
F32_MANT_1_75 = tl.constexpr(0x600000)
#: fp32 bits torch gives for the e4m3fn NaN code 0x7F (c10 ``fp8e4m3fn_to_fp32_value``).
F32_BITS_E4M3_NAN = tl.constexpr(0x7FF00000)
#: Quiet NaN bits (what ``float('nan')`` and ``abs(nan)`` are on CPU).
F32_BITS_QNAN = tl.constexpr(0x7FC00000)


@triton.jit
def program_ids(WIDE: tl.constexpr, E64: tl.constexpr):
    """``(tile, e) = (program_id(0), program_id(1))``: both int64 when ``WIDE`` (offsets within
    ONE expert reach 2^31: :func:`.launch.needs_int64`); ``e`` alone int64 when ``E64`` (the slab
    reaches 2^31, each expert does not: :func:`.launch.slab_needs_int64`); else both int32.

    Every kernel adds the expert's offset (``e * stride_e``, ``e * N * K``: one scalar per
    program) to its base pointer before the per-element offsets, which follow ``tile``'s type:
    a slab of more than 2^31 elements whose experts are each below it (DeepSeek-V3's 256 x 4096 x
    7168) keeps the 32-bit per-element arithmetic (docs/performance.md, the kernel figures "by offset width")."""
    if WIDE:
        return tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    elif E64:
        return tl.program_id(0), tl.program_id(1).to(tl.int64)
    else:
        return tl.program_id(0), tl.program_id(1)


@triton.jit
def f32_bits(x):
    """fp32 tensor -> its int32 bit pattern (a bitcast, no rounding)."""
    return x.to(tl.int32, bitcast=True)


@triton.jit
def load_f32(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load ``ptrs`` (masked, 0 elsewhere) and upcast to fp32 exactly.

    ``BF16_BITS``: ``ptrs`` point at the raw int16 bits of bf16 values (the host passes
    ``w.view(torch.int16)``, see :func:`.launch.kernel_input`); the fp32 bits are ``bits << 16``,
    exact for every value including subnormals and NaN signs. The interpreter's own bf16 -> fp32
    conversion flushes bf16 subnormals and can flip NaN signs, so it is never used.
    Other dtypes (fp16, fp32), and bf16 on a native launch, use :func:`upcast_native` (exact;
    under the interpreter for fp16 and fp32).
    Returns: float32 tensor of the shape of ``ptrs``.
    """
    if BF16_BITS:
        h = tl.load(ptrs, mask=mask, other=0)
        return (h.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return upcast_native(tl.load(ptrs, mask=mask, other=0.0))


@triton.jit
def e4m3_encode(x):
    """fp32 -> e4m3fn code (int32 in [0, 255]) with round-to-nearest-even and saturation.

    Same result as torch's ``x.to(torch.float8_e4m3fn)`` (E4M3 of the OCP 8-bit floating point
    spec, OFP8; RNE and saturation as in docs/formats.md):
    - |x| >= 2^-6 (fp32 biased exponent >= 121): the 23-bit mantissa is rounded to 3 bits by adding
      ``0x7FFFF + lsb`` before the shift, so a carry moves into the exponent (1.9375 -> 2.0);
    - |x| < 2^-6: subnormal code ``round_half_even(|x| / 2^-9)`` from the 24-bit significand shifted
      right by ``141 - biased_exp`` (clamped to [21, 25]; 25 and above always gives 0), which
      rounds up to the smallest normal 0x08 where due;
    - |x| > 448 and +-inf: 0x7E (448) with the sign; NaN: 0x7F with the sign (0x7F / 0xFF).
    Signed zero keeps its sign (-0.0 -> 0x80), as do values that round to zero.

    Args: x: float32 tensor (any shape). Returns: int32 tensor of the same shape.
    """
    u = f32_bits(x)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    biased = a >> 23
    # Normal e4m3 (bias 7 = fp32 bias 127 - 120): round the mantissa at bit 20, carry included.
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    # Subnormal e4m3: value in units of 2^-9 = significand * 2^(biased - 141).
    sig = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(141 - biased, 21), 25)
    q = sig >> sh
    rem = sig & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    code = tl.where(biased >= 121, normal, sub)
    code = tl.where(a > F32_BITS_448, 0x7E, code)
    code = tl.where(a > F32_BITS_INF, 0x7F, code)
    return code | sign


@triton.jit
def e4m3_decode(code):
    """e4m3fn code (int32 in [0, 255]) -> its exact fp32 value, as torch's fp8 -> fp32 cast.

    Normal codes: fp32 bits ``(exp + 120) << 23 | mant << 20`` (bias 7 vs 127); subnormal
    (exp 0): ``mant * 2^-9``; 0x7F / 0xFF: NaN with torch's bits 0x7FF00000 and the sign;
    the sign bit 0x80 maps to bit 31 (0x80 -> -0.0).
    Args: code: int32 tensor. Returns: float32 tensor of the same shape.
    """
    exp = (code >> 3) & 0xF
    mant = code & 7
    normal = ((exp + 120) << 23) | (mant << 20)
    sub = f32_bits(mant.to(tl.float32) * 0.001953125)  # exact: small integer times 2^-9
    mag = tl.where(exp == 0, sub, normal)
    mag = tl.where((code & 0x7F) == 0x7F, F32_BITS_E4M3_NAN, mag)
    return (mag | ((code >> 7) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def exp2_int(e):
    """Exact ``2.0 ** e`` as fp32 from int32 ``e`` in [-149, 127] (fp_bits.exp2_int).

    ``e >= -126``: the normal ``(e + 127) << 23``; below: the fp32 subnormal ``1 << (e + 149)``
    (so E8M0 byte 0 = 2^-127 is not 0.0). Out-of-range ``e`` wraps exactly as the torch twin does.
    Args: e: int32 tensor. Returns: float32 tensor of the same shape.
    """
    normal = tl.maximum(e + 127, 0) << 23
    sub = 1 << tl.minimum(tl.maximum(e + 149, 0), 22)
    return tl.where(e >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_from_amax(amax, RCEIL: tl.constexpr):
    """E8M0 scale byte (int32 in [0, 255]) of an MX block from its fp32 amax.

    Twin of :func:`qstrat.serializers.fp_bits.e8m0_from_amax`.

    With ``amax = m * 2^(b - 127)``: RCEIL (vLLM/FlashInfer/TE/cuBLAS) ``b - 8 + (m > 1.75)``,
    FLOOR (OCP MX spec v1.0 section 6.3) ``b - 8``; clamped to [0, 254]; zero or fp32-subnormal
    amax -> 0; NaN amax -> 255.
    Args: amax: float32 tensor (>= 0 or NaN); RCEIL: constexpr bool. Returns: int32 tensor.
    """
    bits = f32_bits(amax)
    biased = (bits >> 23) & 0xFF
    byte = biased - 8
    if RCEIL:
        byte = byte + ((bits & 0x7FFFFF) > F32_MANT_1_75).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 0), 254)
    byte = tl.where(biased == 0, 0, byte)
    byte = tl.where(biased == 0xFF, 254, byte)  # +inf: ceil(log2 inf) clamped (NaN: below)
    return tl.where(amax != amax, 255, byte)


@triton.jit
def ceil_pow2(s):
    """Round positive normal fp32 ``s`` UP to a power of two, from its bits (fp_bits.ceil_pow2).

    ``2^(b - 127 + (mantissa != 0))``; +inf stays +inf and NaN stays NaN (the input NaN itself),
    as in the torch twin. Returns: float32 tensor.
    """
    bits = f32_bits(s)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.where(s != s, s, exp2_int(e))


@triton.jit
def e2m1_magnitude(a):
    """3-bit E2M1 magnitude code of ``a = |y|`` (int32 0..7): round half to even, saturating at 6.

    The number of decision points passed, as :func:`qstrat.serializers.nvfp4.e2m1_magnitude`
    (its ``E2M1_THRESHOLDS``): ``> 0.25, >= 0.75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5``, ties to
    the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
    Exact comparisons only; NaN gives 0. Args: a: float32 tensor >= 0. Returns: int32 tensor.
    """
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    return code + (a > 5.0).to(tl.int32)


@triton.jit
def nan_if(amax, has_nan):
    """``amax`` where ``has_nan`` is false, else a quiet NaN: NaN-propagating block maxima.

    GPU ``tl.max`` ignores NaN (maxnum) while torch's ``amax`` propagates it; kernels count NaN
    elements separately and pass ``has_nan = count > 0`` here.
    """
    qnan = tl.full(amax.shape, F32_BITS_QNAN, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(has_nan, qnan, amax)


@triton.jit
def load_block_tile(x_ptr, e, tile, N, K, KT, stride_e, stride_n, stride_k,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B: tl.constexpr,
                    BF16_BITS: tl.constexpr):
    """Load program ``tile`` of expert ``e`` of an [E, N, K] input as B-element scale blocks.

    The tile is rows ``tn * BLOCK_N ...`` and columns ``tk * BLOCK_K ...`` with ``tn, tk =
    divmod(tile, KT)``; ``K % B == 0`` (checked on the host), so a block is wholly in or out.
    ``e``'s offset joins the base pointer first (int64 where the slab needs it); the per-element
    offsets have ``tile``'s type (int64 only where :func:`.launch.needs_int64`), strides the
    input's own.
    Returns: ``(x, rows, groups, r3, c3, mask)``: x float32 [BLOCK_N, BLOCK_K // B, B] (0 where
    masked), the row indices [BLOCK_N], the block indices along K [BLOCK_K // B], their
    broadcast row/column offsets r3 [BLOCK_N, 1, 1] and c3 [1, G, B], and the in-range mask.
    """
    G: tl.constexpr = BLOCK_K // B
    tn = tile // KT
    tk = tile % KT
    rows = tn * BLOCK_N + tl.arange(0, BLOCK_N).to(tile.dtype)
    groups = tk * G + tl.arange(0, G).to(tile.dtype)
    lanes = tl.arange(0, B).to(tile.dtype)
    r3 = rows[:, None, None]
    c3 = groups[None, :, None] * B + lanes[None, None, :]
    mask = (r3 < N) & (c3 < K)
    x = load_f32(x_ptr + e * stride_e + r3 * stride_n + c3 * stride_k, mask, BF16_BITS)
    return x, rows, groups, r3, c3, mask


@triton.jit
def amax_last_axis(x):
    """max |x| over the last axis of a [BLOCK_N, G, B] block of rows x B-element blocks (MX,
    NVFP4), NaN-propagating like torch's ``amax``; returns float32 [BLOCK_N, G]."""
    amax = tl.max(tl.abs(x), axis=2)
    return nan_if(amax, tl.sum((x != x).to(tl.int32), axis=2) > 0)


@triton.jit
def store_block_scales(s_ptr, e, N, KS, rows, groups, val):
    """Store one byte per block, ``val`` [BLOCK_N, G] (rows x block index along K), into a
    contiguous uint8 [E, N, KS] scale tensor at expert ``e`` (int64 offsets); out-of-range
    rows/blocks are masked."""
    r2 = rows[:, None]
    g2 = groups[None, :]
    tl.store(s_ptr + e * N * KS + r2 * KS + g2, val.to(tl.uint8), mask=(r2 < N) & (g2 < KS))


# ---- native conversions: compiled launches of finite inputs only (launch.native_casts) -------
# Each equals its integer twin above on every input such a launch can give it; the range argument
# is in docs/formats.md ("Two encoders, one result") and tests/test_native_cast_model.py searches
# for counterexamples with a torch model of the PTX semantics.
# These functions are THE seam between a kernel's native branch and the hardware: every hardware
# conversion a native branch makes is one of them (tests/test_kernel_native.py checks the kernel
# sources for any other), so that test can run each native branch under the interpreter with
# exactly these replaced by their exact twins and every other line as written.

#: The hardware conversions of the native branches, by function name (the seam above).
NATIVE_CONVERSIONS = ("upcast_native", "e4m3_native", "e4m3_native_value", "rcp_native",
                      "e2m1x2_native")


@triton.jit
def upcast_native(v):
    """bf16/fp16/fp32 tensor -> float32 by the GPU's conversion (``cvt.f32.bf16`` or a shift; exact
    for every finite value, subnormals included). Under the interpreter it is exact for fp16 and
    fp32 only (its bf16 route flushes subnormals): the bf16 inputs of non-native launches take
    :func:`load_f32`'s bits route instead. Returns: float32 tensor of ``v``'s shape."""
    return v.to(tl.float32)


@triton.jit
def e4m3_native_value(code):
    """e4m3fn code (uint8) -> its fp32 value by the GPU's conversion (``cvt.rn.f16x2.e4m3x2``, then
    f16 -> f32: both exact for every finite code). Equals :func:`e4m3_decode` on codes 0..0x7E
    and 0x80..0xFE. Args: code: uint8 tensor. Returns: float32 tensor of the same shape."""
    return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def rcp_native(x):
    """``1 / x`` correctly rounded by ``rcp.rn.f32`` (PTX ISA: IEEE round to nearest even), equal
    to ``tl.math.div_rn(1, x)``. Args: x: float32 tensor. Returns: float32 tensor."""
    return libdevice.rcp_rn(x)


@triton.jit
def e4m3_native(y):
    """fp32 -> e4m3fn code (uint8) by the GPU's ``cvt.rn.satfinite.e4m3x2.f32`` (two values per
    instruction; PTX ISA: round to nearest even, saturate to +-448, NaN -> NaN).

    Equals :func:`e4m3_encode` for every finite ``y`` (the saturation of both is to 448 with the
    sign). Never under the interpreter: its fp8 cast is computed by numpy and is wrong for some
    inputs. Args: y: float32 tensor. Returns: uint8 tensor of the same shape.
    """
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e2m1x2_native(lo, hi):
    """Two fp32 tensors -> one byte each: E2M1 codes of ``lo`` (low nibble) and ``hi`` (high
    nibble) by ``cvt.rn.satfinite.e2m1x2.f32`` (sm_100+; PTX ISA: round to nearest even,
    saturate to +-6; the sign bit is the value's, -0.0 included).

    Four bytes per instruction group (``pack=4``: one 32-bit register). Args: lo, hi: float32
    tensors of one shape, finite. Returns: uint8 tensor of that shape.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b8 b0, b1, b2, b3;
        cvt.rn.satfinite.e2m1x2.f32 b0, $5, $1;
        cvt.rn.satfinite.e2m1x2.f32 b1, $6, $2;
        cvt.rn.satfinite.e2m1x2.f32 b2, $7, $3;
        cvt.rn.satfinite.e2m1x2.f32 b3, $8, $4;
        mov.b32 $0, {b0, b1, b2, b3};
        }""",
        constraints="=r,f,f,f,f,f,f,f,f",
        args=[lo, hi], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def e2m1_from_bits(y):
    """fp32 -> 4-bit E2M1 code (int32 0..15: magnitude 0..7, sign in bit 3 = ``y``'s sign bit)
    with round-to-nearest-even and saturation at 6, for GPUs without a native e2m1 conversion
    (sm_90). Finite ``y`` only.

    ``a = min(|y|, 6)`` lies in binade ``e = max(floor(log2 a), 0)`` in {0, 1, 2}, where the E2M1
    grid spacing is ``2^(e-1)``. ``M = 2^(e+22) + 6 * 2^(e-1)`` has fp32 ulp ``2^(e-1)``, so the
    one IEEE add ``a + M`` rounds ``a`` to the grid, ties to even (the code's parity is the grid
    index's; the offset 6 is even), and ``bits(a + M) = bits(2^(e+22)) + 6 + count`` with
    ``count`` (0..4) the grid index. The code ``count + 2e`` is the low 3 bits of
    ``bits + (bits >> 22)`` (``bits >> 22 = 2e + 298``, and 6 + 298 = 304 = 0 mod 8).
    Twin: ``tests/test_native_cast_model.py::e2m1_sm90_model``. Returns: int32 tensor.
    """
    a = tl.minimum(tl.abs(y), 6.0)
    mb = tl.maximum((f32_bits(a) & 0x7F800000) + ((22 << 23) + 6), (149 << 23) + 6)  # bits of M
    r = f32_bits(a + mb.to(tl.float32, bitcast=True))
    return ((r + (r >> 22)) & 7) | ((f32_bits(y) >> 28) & 8)


@triton.jit
def e8m0_from_finite_amax(amax, RCEIL: tl.constexpr, MIN_BYTE: tl.constexpr):
    """:func:`e8m0_from_amax` clamped below at ``MIN_BYTE``, for finite ``amax >= 0`` only (no
    NaN/inf branches): ``clamp(biased - 8 + rceil_bit, MIN_BYTE, 254)``, where a zero or
    subnormal amax (biased 0) clamps to ``MIN_BYTE`` as the general form gives. Twin of
    ``MXFP8._scale_finite`` (mxfp8.py). Returns: int32 tensor of amax's shape.
    """
    bits = f32_bits(amax)
    byte = (bits >> 23) - 8
    if RCEIL:
        byte = byte + (((bits & 0x7FFFFF) + (0x7FFFFF - F32_MANT_1_75)) >> 23)
    return tl.minimum(tl.maximum(byte, MIN_BYTE), 254)
