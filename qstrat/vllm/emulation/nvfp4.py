"""NVFP4 (E2M1 values, E4M3 scale per 1 x 16, fp32 global) on a CPU vLLM engine.

vLLM 0.32 ships the torch pieces but does not wire them for the CPU platform:

* linear: vLLM's own ``EmulationNvFp4LinearKernel`` (off CUDA it runs the torch path of
  ``nvfp4_emulation_utils.run_nvfp4_emulations``: activation QDQ with ``ref_nvfp4_quant_dequant``,
  weight ``dequantize_to_dtype(swizzle=False)``, matmul) is registered for ``PlatformEnum.CPU``
  through the PUBLIC ``kernels.linear.register_linear_kernel``;
* fused MoE: ``oracle.nvfp4.select_nvfp4_moe_backend`` finds no backend on a CPU ("No NvFp4 MoE
  backend supports the deployment configuration": its ``EMULATION`` experts are Triton). The
  private resolver ``oracle.nvfp4.backend_to_kernel_cls`` (looked up at call time) is wrapped
  to return, for ``NvFp4MoeBackend.EMULATION``, a subclass of vLLM's
  ``Nvfp4QuantizationEmulationTritonExperts`` whose ``apply`` computes the same thing in torch
  with vLLM's torch helpers: W4A4 fake quantization of the expert inputs and of the gated
  intermediate (``ref_nvfp4_quant_dequant`` with the global scales ``a1_gscale`` /
  ``a2_gscale``), weights ``dequantize_to_dtype(w, block_scale, g1_alphas[e], swizzle=False)``.
"""
from __future__ import annotations

from typing import Any

import torch

from qstrat.vllm.emulation.moe import ActivationQDQ, ExpertWeight, TorchExperts
from qstrat.vllm.emulation.wiring import moe_format_hooks, wire_moe_format

BLOCK = 16


def hooks() -> dict[str, Any]:
    """The vLLM objects :func:`register` uses (:func:`.wiring.moe_format_hooks`, with vLLM's
    ``dequant`` and ``qdq`` for NVFP4). Raises VllmNameError naming a missing one."""
    return moe_format_hooks("nvfp4_emulation_linear_kernel", "nvfp4_moe_oracle", "nvfp4_moe_emulation_backend",
                            "nvfp4_moe_backend_to_kernel_cls", "nvfp4_emulation_triton_experts",
                            dequant="nvfp4_dequantize_to_dtype", qdq="ref_nvfp4_quant_dequant")


def register(h: dict[str, Any]) -> None:
    """Register vLLM's NVFP4 emulation linear kernel for CPU and the torch MoE experts
    (``h`` = :func:`hooks`). Idempotent."""
    wire_moe_format(h, "nvfp4", "backend_to_kernel_cls",
                    lambda: _build_experts(h["triton_experts"], h["dequant"], h["qdq"]))


def _build_experts(triton_experts: type, dequant: Any, qdq: Any) -> type:
    class TorchNvfp4EmulationExperts(TorchExperts, triton_experts):
        """vLLM's ``Nvfp4QuantizationEmulationTritonExperts`` computing in torch. w1 uint8
        [E, 2I, H/2] / w2 uint8 [E, H, I/2] (two E2M1 codes per byte, low nibble first), block
        scales float8_e4m3fn [E, 2I, H/16] / [E, H, I/16] in linear layout
        (``w1_scale_val``, vLLM's stash), per-expert decode scales ``g1_alphas`` /
        ``g2_alphas`` float32 [E]."""

        def expert_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertWeight, ExpertWeight]:
            qc = self.quant_config

            def of(w: torch.Tensor, scale: torch.Tensor, alphas: torch.Tensor) -> ExpertWeight:
                return lambda e: dequant(w[e], scale[e], alphas[e], torch.float32, BLOCK, swizzle=False)

            return of(w1, self.w1_scale_val, qc.g1_alphas), of(w2, self.w2_scale_val, qc.g2_alphas)

        def activation_qdq(self) -> tuple[ActivationQDQ, ActivationQDQ]:
            qc = self.quant_config
            return (lambda x: qdq(x, qc.a1_gscale, BLOCK)), (lambda h: qdq(h, qc.a2_gscale, BLOCK))

    return TorchNvfp4EmulationExperts
