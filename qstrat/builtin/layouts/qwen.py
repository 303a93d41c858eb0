"""The Qwen families: Qwen2/Qwen3 dense, Qwen2/Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE.

What their structure adds to the default generator (:class:`QwenLayout`), from transformers 5.x's
modeling code: Qwen2's attention has q/k/v biases (``Qwen2Attention``: ``bias=True``; Qwen2-MoE's
``qkv_bias`` defaults to True), Qwen3's has ``q_norm``/``k_norm`` [head_dim]; MoE layers are those
not in ``mlp_only_layers`` and on ``decoder_sparse_step``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from qstrat.builtin.layouts.common import QKV_GATE_UP, QKVO
from qstrat.layouts import ModelLayout
from qstrat.skeleton import Tensors


class QwenLayout(ModelLayout):
    """A Qwen layout: the default generator with Qwen's attention and MoE-layer rules. One
    layout serves two generations (``qwen3`` also loads Qwen2 checkpoints), told apart by the
    config's ``model_type``."""

    def attention_tensors(self, p: str, c: Mapping[str, Any]) -> Tensors:
        """The default's q/k/v/o, with Qwen2's q/k/v biases unless ``qkv_bias`` says otherwise,
        and Qwen3's ``q_norm``/``k_norm`` [head_dim]."""
        generation = str(c.get("model_type") or "")
        if generation.startswith("qwen2") and "qkv_bias" not in c:
            c = {**c, "qkv_bias": True}
        yield from super().attention_tensors(p, c)
        if generation.startswith("qwen3"):
            d = self.head_dim(c)
            yield f"{p}.q_norm.weight", (d,)
            yield f"{p}.k_norm.weight", (d,)

    def is_moe_layer(self, hf_config: Mapping[str, Any] | None, layer: int) -> bool:
        """A model with experts, ``layer`` not in ``mlp_only_layers`` and on
        ``decoder_sparse_step`` (``Qwen3MoeDecoderLayer``)."""
        if not self.num_experts(hf_config):
            return False
        c = self.text_config(hf_config)
        if layer in (c.get("mlp_only_layers") or ()):
            return False
        return (layer + 1) % int(c.get("decoder_sparse_step", 1) or 1) == 0


#: Dense Qwen3 (q_norm/k_norm are norms) and Qwen2: Llama's structure. vLLM ``Qwen3ForCausalLM``.
QWEN3 = QwenLayout(
    name="qwen3",
    architectures=("Qwen3ForCausalLM", "Qwen2ForCausalLM"),
    model_types=("qwen3", "qwen2"),
    attention_projections=QKVO,
    routers=(),
    fused=QKV_GATE_UP,
)

#: Qwen3-MoE (and Qwen2-MoE with its shared expert). vLLM ``Qwen3MoeForCausalLM``: qkv_proj,
#: gate_up_proj of ``mlp_only_layers``; routed experts one FusedMoE ``mlp.experts``.
QWEN3_MOE = QwenLayout(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"),
    model_types=("qwen3_moe", "qwen2_moe"),
    attention_projections=QKVO,
    routers=("gate", "shared_expert_gate"),
    shared_experts=("shared_expert",),
    fused=QKV_GATE_UP,
)

#: Gated-DeltaNet block (``linear_attn``) of Qwen3-Next: projections stored pre-fused; the
#: ``conv1d`` kernel [C, 1, k] is never a matrix (sent unchanged; vLLM builds it as an
#: unquantized linear, ignored; ModelOpt disables ``*linear_attn.conv1d*``).
_NEXT_LINEAR_ATTN = ("in_proj_qkvz", "in_proj_ba", "out_proj", "conv1d")

#: Qwen3-Next: hybrid ``linear_attn`` (Gated DeltaNet) / ``self_attn`` layers, shared expert with
#: its gate. vLLM ``Qwen3NextForCausalLM``. ``in_proj_ba`` stays BF16 (Qwen's FP8 checkpoints).
#: Its tensors are not generated from a config alone (the default refuses linear attention).
QWEN3_NEXT = QwenLayout(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    attention_blocks=("self_attn", "linear_attn"),
    attention_projections=QKVO + _NEXT_LINEAR_ATTN,
    sensitive=("in_proj_ba",),
    routers=("gate", "shared_expert_gate"),
    shared_experts=("shared_expert",),
    fused=QKV_GATE_UP,
)

#: Qwen3.5's Gated-DeltaNet projections, stored apart; vLLM fuses them into in_proj_qkvz / in_proj_ba.
_QWEN3_5_LINEAR_ATTN = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "conv1d")
_QWEN3_5_FUSED = QKV_GATE_UP + (("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a"))

#: Qwen3.5-MoE, the multimodal class (``Qwen3_5MoeForConditionalGeneration``): the language model
#: under ``model.language_model``, the vision tower ``model.visual`` (BF16, in the ignore list),
#: MTP under ``mtp.`` (dropped by vLLM's main model). ``in_proj_a/b`` stay BF16 (Qwen's FP8
#: checkpoints keep them; vLLM fuses them into one ``in_proj_ba``).
QWEN3_5_MOE = QwenLayout(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForConditionalGeneration",),
    model_types=("qwen3_5_moe",),
    layers_prefix="model.language_model.layers",
    embeddings=("model.language_model.embed_tokens",),
    final_norms=("model.language_model.norm",),
    attention_blocks=("self_attn", "linear_attn"),
    attention_projections=QKVO + _QWEN3_5_LINEAR_ATTN,
    sensitive=("in_proj_a", "in_proj_b"),
    routers=("gate", "shared_expert_gate"),
    shared_experts=("shared_expert",),
    fused=_QWEN3_5_FUSED,
)

#: Qwen3.5-MoE, the text-only class (``Qwen3_5MoeForCausalLM``): the same blocks under ``model.``.
QWEN3_5_MOE_TEXT = replace(QWEN3_5_MOE, name="qwen3_5_moe_text", architectures=("Qwen3_5MoeForCausalLM",),
                           model_types=("qwen3_5_moe_text",), layers_prefix="model.layers",
                           embeddings=("model.embed_tokens",), final_norms=("model.norm",))
