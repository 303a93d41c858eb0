"""BF16 passthrough: the weight is stored as bfloat16 and the module stays unquantized in the engine."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from qstrat.serializers.base import Context, PartSpec, Serializer


class BF16(Serializer):
    """No quantization: ``weight`` bfloat16 [N, K]. Modules using it go into the ignore list."""

    name = "bf16"
    summary = "passthrough: keep the weight in bfloat16 (listed in the engine's ignore list)"
    quantizes = False

    def matrix_parts(self, n: int, k: int) -> tuple[PartSpec, ...]:
        """``weight`` bfloat16 [n, k]."""
        return (PartSpec("weight", (n, k), torch.bfloat16, 1),)

    def reference(self, x: torch.Tensor, context: Context | None) -> dict[str, torch.Tensor]:
        """x float32 [e, n, K] -> weight bfloat16 (exact for bf16 input)."""
        return {"weight": x.to(torch.bfloat16)}

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """weight as float32."""
        return parts["weight"].float()
