"""DeepSeek-V2/V3, and the DeepSeek-style MoE that GLM-4.5 shares.

What their structure adds to the default generator, from transformers 5.x's
``modeling_deepseek_v3.py`` / ``modeling_glm4_moe.py`` and DeepSeek-V3's ``README_WEIGHTS.md``:
the first ``first_k_dense_replace`` layers are dense; with ``noaux_tc`` routing the router holds
``e_score_correction_bias`` [E]; the MTP block is stored as decoder layer ``num_hidden_layers``
with its own embedding, norms, ``eh_proj`` and head (:class:`DeepSeekStyleMoE`); DeepSeek's
attention is MLA (:class:`DeepSeekLayout`).
"""
from __future__ import annotations

from qstrat.layouts.model_layout import ModelLayout
from qstrat.layouts.model_config import ModelConfig
from qstrat.layouts.skeleton import Tensors


class DeepSeekStyleMoE(ModelLayout):
    """Dense first layers, the ``noaux_tc`` router bias, the MTP block (DeepSeek-V3, GLM-4.5)."""

    def is_moe_layer(self, config: ModelConfig, layer: int) -> bool:
        """A model with experts and ``layer >= first_k_dense_replace``."""
        return bool(self.num_experts(config)) and layer >= config.first_k_dense_replace

    def router_tensors(self, p: str, c: ModelConfig, n: int) -> Tensors:
        """The router [E, H], and ``e_score_correction_bias`` [E] with ``topk_method: noaux_tc``
        (DeepSeek-V3's config.json says it; GLM-4.5's has ``n_group`` and no ``topk_method``:
        noaux_tc is its only routing; DeepSeek-V2's ``greedy`` has no bias)."""
        yield from super().router_tensors(p, c, n)
        if (c.topk_method or ("noaux_tc" if c.n_group is not None else None)) == "noaux_tc":
            yield f"{p}.e_score_correction_bias", (n,)

    def mtp_layer_tensors(self, p: str, c: ModelConfig, i: int, grouped: bool) -> Tensors:
        """The MTP block ``model.layers.{i}``: ``embed_tokens`` [V, H], ``enorm``/``hnorm`` [H],
        ``eh_proj`` [H, 2H], ``shared_head.norm`` [H], ``shared_head.head`` [V, H], then a full
        decoder layer."""
        h, vocab = c.hidden_size, c.vocab_size
        yield f"{p}.embed_tokens.weight", (vocab, h)
        yield f"{p}.enorm.weight", (h,)
        yield f"{p}.hnorm.weight", (h,)
        yield f"{p}.eh_proj.weight", (h, 2 * h)
        yield f"{p}.shared_head.norm.weight", (h,)
        yield f"{p}.shared_head.head.weight", (vocab, h)
        yield from super().mtp_layer_tensors(p, c, i, grouped)


#: What transformers' DeepSeek-V3 modeling always does (``DeepseekV3TopkRouter``: sigmoid scores,
#: the noaux_tc correction bias), whatever its config says, against what vLLM 0.32 reads from the
#: config with its own default (``DeepseekV2MoE``: ``scoring_func`` default softmax, ``topk_method``
#: default none - no bias parameter).
V3_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


class DeepSeekLayout(DeepSeekStyleMoE):
    """DeepSeek-V2/V3: :class:`DeepSeekStyleMoE` with MLA attention."""

    def output_config(self, config: ModelConfig) -> ModelConfig:
        """A DeepSeek-V3 config (``model_type: deepseek_v3``) gets :data:`V3_ROUTING` where it has no
        such key (transformers' ``DeepseekV3Config.to_dict()`` has neither: vLLM would route with
        softmax and no correction bias, another model than the trainer's); a different value is
        refused (transformers ignores it, vLLM would not). DeepSeek-V2 configs are written as given
        (transformers and vLLM both read ``topk_method`` and default to softmax scoring).

        Raises: QstratError naming the key, its value and what transformers does.
        """
        from qstrat.errors import QstratError

        if config.language_model_type != "deepseek_v3":
            return config
        for key, value in V3_ROUTING.items():
            given = config.value(key)
            if given is not None and given != value:
                raise QstratError(f"model config: {key} {given!r}: transformers' DeepSeek-V3 always routes with "
                                  f"{key} {value!r} (it does not read the key) while vLLM would use {given!r}: "
                                  f"the engine would serve another model than the trainer's; set {key}: {value!r}")
        return config.with_language(**{k: v for k, v in V3_ROUTING.items() if config.value(k) is None})

    def attention_tensors(self, p: str, c: ModelConfig) -> Tensors:
        """MLA (``kv_lora_rank`` set; else the default attention): ``q_a_proj`` [q_rank, H],
        ``q_a_layernorm``, ``q_b_proj`` [heads*(nope+rope), q_rank] (or ``q_proj`` when
        ``q_lora_rank`` is null: DeepSeek-V2-Lite), ``kv_a_proj_with_mqa`` [kv_rank+rope, H],
        ``kv_a_layernorm``, ``kv_b_proj`` [heads*(nope+v), kv_rank], ``o_proj`` [H, heads*v]."""
        if not c.kv_lora_rank:
            yield from super().attention_tensors(p, c)
            return
        h, heads = c.hidden_size, c.num_attention_heads
        nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        kv_rank, q_rank = c.kv_lora_rank, c.q_lora_rank
        if q_rank:
            yield f"{p}.q_a_proj.weight", (q_rank, h)
            yield f"{p}.q_a_layernorm.weight", (q_rank,)
            yield f"{p}.q_b_proj.weight", (heads * (nope + rope), q_rank)
        else:
            yield f"{p}.q_proj.weight", (heads * (nope + rope), h)
        yield f"{p}.kv_a_proj_with_mqa.weight", (kv_rank + rope, h)
        yield f"{p}.kv_a_layernorm.weight", (kv_rank,)
        yield f"{p}.kv_b_proj.weight", (heads * (nope + v), kv_rank)
        yield f"{p}.o_proj.weight", (h, heads * v)


#: MLA projections (DeepSeek-V2/V3): ``q_proj`` when ``q_lora_rank`` is null.
_MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

#: DeepSeek-V3: MLA attention, ``first_k_dense_replace`` dense layers, shared experts, the MTP
#: block stored as ``model.layers.{num_hidden_layers}``. vLLM fuses q_a_proj + kv_a_proj_with_mqa
#: into ``fused_qkv_a_proj`` (``DeepseekV2Attention``/MLA, when q_lora_rank is set).
DEEPSEEK_V3 = DeepSeekLayout(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    model_types=("deepseek_v3", "deepseek_v2"),
    attention_projections=_MLA,
    shared_experts=("shared_experts",),
    fused=(("q_a_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj")),
    mtp_layers_key="num_nextn_predict_layers",
)
