"""Built-in model layouts (data only), one per family; docs/models.md is their table.

Each layout is written from the family's transformers 5.x modeling class (its ``state_dict()``,
the trainer's view) and vLLM 0.32's model class (module names, ``packed_modules_mapping``,
``hf_to_vllm_mapper``), and checked against both by tests/test_model_families.py.
What each family keeps in BF16 (routers, ``sensitive`` projections, vision towers) follows the
official quantized checkpoints and ModelOpt's default exclusions
(``modelopt/torch/quantization/config.py``, ``_default_disabled_quantizer_cfg``: ``*lm_head*``,
``*router*``, ``*mlp.gate.*``, ``*block_sparse_moe.gate*``, ``*mlp.shared_expert_gate.*``,
``*linear_attn.conv1d*``); sources per family in docs/models.md.
Registered through the ``qstrat_layouts`` hook like any third-party layout.
"""
from __future__ import annotations

from dataclasses import replace

from qstrat.layouts import ModelLayout, SlabSpec

#: Projections of a softmax-attention block (``self_attn``) in Llama-style families.
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
#: Engine fusions shared by Llama-style families: vLLM's ``qkv_proj`` and ``gate_up_proj``.
QKV_GATE_UP = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

#: Used when no layout matches the HF config: knows the common spellings of MoE blocks, expert
#: projections and routers, so an unknown MoE model never gets its router quantized by accident.
#: It alone guesses: an unknown matrix inside a decoder layer is a quantizable ``linear``.
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

#: Dense Llama (and Llama-style dense models). vLLM ``LlamaForCausalLM``: qkv_proj, gate_up_proj.
LLAMA = ModelLayout(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    attention_projections=QKVO,
    routers=(),
    fused=QKV_GATE_UP,
)

#: Dense Qwen3 (q_norm/k_norm are norms): Llama's structure. vLLM ``Qwen3ForCausalLM``.
QWEN3 = replace(LLAMA, name="qwen3", architectures=("Qwen3ForCausalLM", "Qwen2ForCausalLM"),
                model_types=("qwen3", "qwen2"))

#: Qwen3-MoE (and Qwen2-MoE with its shared expert). vLLM ``Qwen3MoeForCausalLM``: qkv_proj,
#: gate_up_proj of ``mlp_only_layers``; routed experts one FusedMoE ``mlp.experts``.
QWEN3_MOE = ModelLayout(
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
QWEN3_NEXT = ModelLayout(
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
QWEN3_5_MOE = ModelLayout(
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

#: MLA projections (DeepSeek-V2/V3): ``q_proj`` when ``q_lora_rank`` is null.
_MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

#: DeepSeek-V3: MLA attention, ``first_k_dense_replace`` dense layers, shared experts, the MTP
#: block stored as ``model.layers.{num_hidden_layers}``. vLLM fuses q_a_proj + kv_a_proj_with_mqa
#: into ``fused_qkv_a_proj`` (``DeepseekV2Attention``/MLA, when q_lora_rank is set).
DEEPSEEK_V3 = ModelLayout(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    model_types=("deepseek_v3", "deepseek_v2"),
    attention_projections=_MLA,
    shared_experts=("shared_experts",),
    fused=(("q_a_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj")),
    mtp_layers_key="num_nextn_predict_layers",
)

#: GLM-4.5 MoE (``Glm4MoeForCausalLM``): DeepSeek-style dense first layers, shared experts and
#: ``e_score_correction_bias``; q/k/v with biases; MTP as ``model.layers.{num_hidden_layers}``.
GLM4_MOE = ModelLayout(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    model_types=("glm4_moe",),
    attention_projections=QKVO,
    shared_experts=("shared_experts",),
    fused=QKV_GATE_UP,
    mtp_layers_key="num_nextn_predict_layers",
)

#: Mixtral. transformers 5 holds ``mlp.gate`` and slabs ``mlp.experts.gate_up_proj`` [E, 2I, H]
#: (w1 rows, then w3) / ``mlp.experts.down_proj`` (its conversion mapping renames
#: ``block_sparse_moe`` -> ``mlp``); vLLM's ``MixtralForCausalLM`` loads the checkpoint names
#: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w3/w2``. Both inputs parse;
#: outputs use the checkpoint names.
MIXTRAL = ModelLayout(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    mlp_blocks=("block_sparse_moe",),
    renames=((".mlp.", ".block_sparse_moe."),),
    expert_projections=("w1", "w3", "w2"),
    slabs={"gate_up_proj": SlabSpec(("w1", "w3")), "down_proj": SlabSpec(("w2",)),
           "w13": SlabSpec(("w1", "w3")), "w2": SlabSpec(("w2",))},
    attention_projections=QKVO,
    fused=(("q_proj", "k_proj", "v_proj"), ("w1", "w3")),
)

#: gpt-oss (``GptOssForCausalLM``): q/k/v/o with biases and attention ``sinks``; router
#: ``mlp.router`` with bias; experts as transposed slabs ``gate_up_proj`` [E, H, 2I] (gate/up
#: interleaved) and ``down_proj`` [E, I, H], with ``*_bias`` [E, 2I] / [E, H]. The slabs are sent
#: whole and unquantized (see :class:`~qstrat.layouts.SlabSpec`); attention may be quantized.
GPT_OSS = ModelLayout(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    attention_projections=QKVO,
    slabs={"gate_up_proj": SlabSpec(("gate_proj", "up_proj"), transposed_interleaved=True),
           "down_proj": SlabSpec(("down_proj",), transposed_interleaved=True)},
    routers=("router",),
    fused=(("q_proj", "k_proj", "v_proj"),),
)

BUILTIN_LAYOUTS = (GENERIC, LLAMA, QWEN3, QWEN3_MOE, QWEN3_NEXT, QWEN3_5_MOE, QWEN3_5_MOE_TEXT,
                   DEEPSEEK_V3, GLM4_MOE, MIXTRAL, GPT_OSS)
