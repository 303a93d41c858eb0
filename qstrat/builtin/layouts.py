"""Built-in model layouts (data only): Qwen3-MoE, Qwen3.5-style grouped slabs, DeepSeek-V3, Mixtral.

Registered through the ``qstrat_layouts`` hook like any third-party layout.
"""
from __future__ import annotations

from qstrat.layouts import ModelLayout, SlabSpec

#: Used when no layout matches the HF config: knows the common spellings of MoE blocks, expert
#: projections and routers, so an unknown MoE model never gets its router quantized by accident.
GENERIC = ModelLayout(
    name="generic",
    mlp_blocks=("mlp", "block_sparse_moe", "feed_forward", "moe"),
    expert_projections=("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2"),
    slabs={"gate_up_proj": SlabSpec(("gate_proj", "up_proj")), "down_proj": SlabSpec(("down_proj",)),
           "w13": SlabSpec(("w1", "w3")), "w2": SlabSpec(("w2",))},
    routers=("gate", "router", "shared_expert_gate"),
    shared_experts=("shared_expert", "shared_experts"),
    fused=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3")),
)

QWEN3_MOE = ModelLayout(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"),
    model_types=("qwen3_moe", "qwen2_moe"),
    routers=("gate", "shared_expert_gate"),
    shared_experts=("shared_expert",),
)

#: Qwen3.5-style: grouped slabs in the trainer's state dict, vision tower and MTP outside the decoder.
QWEN3_5_MOE = ModelLayout(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    layers_prefix="model.language_model.layers",
    embeddings=("model.language_model.embed_tokens",),
    final_norms=("model.language_model.norm",),
    routers=("gate", "shared_expert_gate"),
    shared_experts=("shared_expert",),
    non_decoder_prefixes=("model.visual.", "visual.", "mtp.", "model.mtp."),
)

DEEPSEEK_V3 = ModelLayout(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    model_types=("deepseek_v3", "deepseek_v2"),
    shared_experts=("shared_experts",),
    # vLLM fuses q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj.
    fused=(("q_a_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj")),
    mtp_layers_key="num_nextn_predict_layers",
)

MIXTRAL = ModelLayout(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    mlp_blocks=("block_sparse_moe",),
    expert_projections=("w1", "w3", "w2"),
    slabs={"w13": SlabSpec(("w1", "w3")), "w2": SlabSpec(("w2",))},
    fused=(("q_proj", "k_proj", "v_proj"), ("w1", "w3")),
)

BUILTIN_LAYOUTS = (GENERIC, QWEN3_MOE, QWEN3_5_MOE, DEEPSEEK_V3, MIXTRAL)
