"""MXFP8 (E4M3 values, E8M0 scale per 1 x 32) on a CPU vLLM engine: vLLM's emulation, wired in.

vLLM 0.32 ships the torch pieces but does not wire them for the CPU platform:

* linear: vLLM's own ``EmulationMxfp8LinearKernel`` (pure torch: dequantize to BF16 with
  ``mxfp8_utils.dequant_mxfp8_to_bf16`` at load or per call, then ``F.linear``) is registered for
  ``PlatformEnum.CPU`` through the PUBLIC ``kernels.linear.register_linear_kernel``;
* fused MoE: the MXFP8 oracle already picks ``Fp8MoeBackend.EMULATION`` on a CPU, but resolves
  it to ``Mxfp8EmulationTritonExperts``, which computes through Triton (on CPU: "triton.language
  has no attribute bfloat16" at the first generate). The private resolver
  ``oracle.mxfp8._mxfp8_backend_to_kernel_cls`` (looked up at call time) is wrapped to return a
  subclass of it whose ``apply`` is :mod:`.moe`'s torch loop on the same dequantized weights.

Covers qstrat's ModelOpt MXFP8 checkpoints and vLLM's online MXFP8 (``quantization="online"``,
``{"linear": "mxfp8", "moe": "mxfp8"}``), which use the same kernel selection. With
``VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD`` (vLLM's default) the live weights are BF16 after
load; ``reload_weights`` still takes checkpoint-format MXFP8 (vLLM re-runs the load processing).
"""
from __future__ import annotations

from typing import Any

import torch

from qstrat.vllm.emulation.moe import ExpertWeight, TorchExperts
from qstrat.vllm.emulation.wiring import moe_format_hooks, wire_moe_format


def hooks() -> dict[str, Any]:
    """The vLLM objects :func:`register` uses (:func:`.wiring.moe_format_hooks`, with vLLM's
    ``dequant`` for MXFP8). Raises VllmNameError naming a missing one."""
    return moe_format_hooks("mxfp8_emulation_linear_kernel", "mxfp8_moe_oracle", "fp8_moe_emulation_backend",
                            "mxfp8_moe_backend_to_kernel_cls", "mxfp8_emulation_triton_experts",
                            dequant="dequant_mxfp8_to_bf16")


def register(h: dict[str, Any]) -> None:
    """Register vLLM's MXFP8 emulation linear kernel for CPU and the torch MoE experts
    (``h`` = :func:`hooks`). Idempotent."""
    wire_moe_format(h, "mxfp8", "_mxfp8_backend_to_kernel_cls",
                    lambda: _build_experts(h["triton_experts"], h["dequant"]))


def _build_experts(triton_experts: type, dequant: Any) -> type:
    class TorchMxfp8EmulationExperts(TorchExperts, triton_experts):
        """vLLM's ``Mxfp8EmulationTritonExperts`` (W8A16: BF16 activations) computing in torch.
        w1 [E, 2I, H] / w2 [E, H, I]: BF16 when dequantized at load, else float8_e4m3fn with
        E8M0 (uint8) scales [E, 2I, H/32] / [E, H, I/32] (``w1_scale_val``, vLLM's stash)."""

        def expert_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertWeight, ExpertWeight]:
            def of(w: torch.Tensor, scale: torch.Tensor) -> ExpertWeight:
                if w.element_size() >= 2:  # dequantized at load (vLLM's default)
                    return lambda e: w[e].float()
                return lambda e: dequant(w[e], scale[e]).float()

            return of(w1, self.w1_scale_val), of(w2, self.w2_scale_val)

    return TorchMxfp8EmulationExperts
