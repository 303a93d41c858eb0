"""GLM-4.5 MoE: Llama attention (q/k/v biases via ``attention_bias``) in DeepSeek's MoE structure
(:class:`~qstrat.plugins.builtin.layouts.deepseek.DeepSeekStyleMoE`)."""
from __future__ import annotations

from qstrat.plugins.builtin.layouts.common import QKV_GATE_UP, QKVO
from qstrat.plugins.builtin.layouts.deepseek import DeepSeekStyleMoE

#: GLM-4.5 MoE (``Glm4MoeForCausalLM``): DeepSeek-style dense first layers, shared experts and
#: ``e_score_correction_bias``; q/k/v with biases; MTP as ``model.layers.{num_hidden_layers}``.
GLM4_MOE = DeepSeekStyleMoE(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    model_types=("glm4_moe",),
    attention_projections=QKVO,
    shared_experts=("shared_experts",),
    fused=QKV_GATE_UP,
    mtp_layers_key="num_nextn_predict_layers",
)
