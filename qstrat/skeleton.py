"""Tensor names and shapes of a model from its HF ``config.json`` alone (no weights).

Used by ``qstrat plan`` on a config-only directory (DeepSeek-V3- or Qwen3-235B-shaped) and by
tests. Names follow the layout (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``); shapes
follow HF's modeling code: linear weights are [out_features, in_features]. With ``grouped=True``
the names and shapes equal the transformers 5.x class's ``state_dict()`` for Llama, Qwen3,
Qwen3-MoE, DeepSeek-V3, GLM-4.5 and (in checkpoint names) Mixtral, MTP layers aside
(tests/test_model_families.py). Families whose structure this module does not generate
(hybrid linear attention, vision towers, gpt-oss' transposed slabs) are refused with a
:class:`~qstrat.errors.PlanError`: plan their trainer's ``state_dict()`` (a ``meta`` copy is enough).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from qstrat.errors import ConfigOnlyUnsupportedError, PlanError
from qstrat.layouts import ModelLayout

Shape = tuple[int, ...]


def model_tensors(layout: ModelLayout, hf_config: Mapping[str, Any],
                  grouped: bool = False) -> Iterator[tuple[str, Shape]]:
    """Yield ``(hf_name, shape)`` for every tensor of the model described by ``hf_config``.

    Args:
        layout: naming data of the model family.
        hf_config: parsed config.json (``text_config`` is used when present).
        grouped: emit routed experts as grouped slabs ``experts.gate_up_proj`` [E, 2I, H] and
            ``experts.down_proj`` [E, H, I] (the trainer's in-memory view) instead of per-expert.
    Raises: KeyError naming a config key the model needs but the config lacks; PlanError for
        a family whose structure is not generated here (see the module docstring).
    """
    _check_supported(layout, hf_config)
    c = layout.text_config(hf_config)
    h, vocab = int(c["hidden_size"]), int(c["vocab_size"])
    n_layers = int(c[layout.num_layers_key])
    n_mtp = layout.num_mtp_layers(hf_config)
    yield f"{layout.embeddings[0]}.weight", (vocab, h)
    for i in range(n_layers + n_mtp):
        p = f"{layout.layers_prefix}.{i}"
        if i >= n_layers:  # DeepSeek-V3 MTP block: projections around a full decoder layer
            yield f"{p}.embed_tokens.weight", (vocab, h)
            yield f"{p}.enorm.weight", (h,)
            yield f"{p}.hnorm.weight", (h,)
            yield f"{p}.eh_proj.weight", (h, 2 * h)
            yield f"{p}.shared_head.norm.weight", (h,)
            yield f"{p}.shared_head.head.weight", (vocab, h)
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield from _attention(f"{p}.{layout.attention_blocks[0]}", c, h)
        yield from _mlp(layout, f"{p}.{layout.mlp_blocks[0]}", c, h, i, grouped)
    yield f"{layout.final_norms[0]}.weight", (h,)
    if not c.get("tie_word_embeddings", False):
        yield f"{layout.lm_heads[0]}.weight", (vocab, h)


def _attention(p: str, c: Mapping[str, Any], h: int) -> Iterator[tuple[str, Shape]]:
    heads = int(c["num_attention_heads"])
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3)
        nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        kv_rank, q_rank = int(c["kv_lora_rank"]), c.get("q_lora_rank")
        if q_rank:
            yield f"{p}.q_a_proj.weight", (int(q_rank), h)
            yield f"{p}.q_a_layernorm.weight", (int(q_rank),)
            yield f"{p}.q_b_proj.weight", (heads * (nope + rope), int(q_rank))
        else:
            yield f"{p}.q_proj.weight", (heads * (nope + rope), h)
        yield f"{p}.kv_a_proj_with_mqa.weight", (kv_rank + rope, h)
        yield f"{p}.kv_a_layernorm.weight", (kv_rank,)
        yield f"{p}.kv_b_proj.weight", (heads * (nope + v), kv_rank)
        yield f"{p}.o_proj.weight", (h, heads * v)
        return
    d = int(c.get("head_dim") or h // heads)
    kv = int(c.get("num_key_value_heads") or heads)
    yield f"{p}.q_proj.weight", (heads * d, h)
    yield f"{p}.k_proj.weight", (kv * d, h)
    yield f"{p}.v_proj.weight", (kv * d, h)
    yield f"{p}.o_proj.weight", (h, heads * d)
    # Biases as HF builds them: ``attention_bias`` on q/k/v/o (Llama, Qwen3), ``qkv_bias`` on
    # q/k/v (Qwen2-MoE, default True there).
    if c.get("attention_bias") or c.get("qkv_bias", str(c.get("model_type", "")).startswith("qwen2")):
        yield f"{p}.q_proj.bias", (heads * d,)
        yield f"{p}.k_proj.bias", (kv * d,)
        yield f"{p}.v_proj.bias", (kv * d,)
    if c.get("attention_bias"):
        yield f"{p}.o_proj.bias", (h,)
    if c.get("model_type", "").startswith("qwen3"):
        yield f"{p}.q_norm.weight", (d,)
        yield f"{p}.k_norm.weight", (d,)


def _mlp(layout: ModelLayout, p: str, c: Mapping[str, Any], h: int, i: int,
         grouped: bool) -> Iterator[tuple[str, Shape]]:
    gate, up, down = layout.expert_projections
    if not layout.is_moe_layer(c, i):
        inter = int(c["intermediate_size"])
        yield f"{p}.gate_proj.weight", (inter, h)
        yield f"{p}.up_proj.weight", (inter, h)
        yield f"{p}.down_proj.weight", (h, inter)
        return
    n = layout.num_experts(c)
    inter = int(c.get("moe_intermediate_size") or c["intermediate_size"])
    yield f"{p}.{layout.routers[0]}.weight", (n, h)
    # DeepSeek-V3 says topk_method noaux_tc; GLM-4.5 has n_group and no topk_method (noaux_tc only)
    if c.get("topk_method", "noaux_tc" if "n_group" in c else None) == "noaux_tc":
        yield f"{p}.{layout.routers[0]}.e_score_correction_bias", (n,)
    if grouped:
        slab_gate_up = next(k for k, v in layout.slabs.items() if v.parts == (gate, up))
        slab_down = next(k for k, v in layout.slabs.items() if v.parts == (down,))
        yield f"{p}.{layout.experts}.{slab_gate_up}", (n, 2 * inter, h)
        yield f"{p}.{layout.experts}.{slab_down}", (n, h, inter)
    else:
        for e in range(n):
            q = f"{p}.{layout.experts}.{e}"
            yield f"{q}.{gate}.weight", (inter, h)
            yield f"{q}.{up}.weight", (inter, h)
            yield f"{q}.{down}.weight", (h, inter)
    shared = int(c.get("n_shared_experts") or 0) * inter or int(c.get("shared_expert_intermediate_size") or 0)
    if shared and layout.shared_experts:
        q = f"{p}.{layout.shared_experts[0]}"
        yield f"{q}.gate_proj.weight", (shared, h)
        yield f"{q}.up_proj.weight", (shared, h)
        yield f"{q}.down_proj.weight", (h, shared)
        if c.get("shared_expert_intermediate_size"):
            yield f"{p}.shared_expert_gate.weight", (1, h)


def _check_supported(layout: ModelLayout, hf_config: Mapping[str, Any]) -> None:
    """Refuse (PlanError) structures :func:`model_tensors` would get wrong."""
    c = layout.text_config(hf_config)
    reasons = []
    if "linear_attention" in (c.get("layer_types") or ()) or "linear_attn" in layout.attention_blocks:
        reasons.append("hybrid linear-attention layers")
    if hf_config.get("vision_config"):
        reasons.append("a vision tower")
    if any(not spec.splittable for spec in layout.slabs.values()):
        reasons.append("transposed expert slabs with biases")
    if layout.name == "generic":  # its names are alternatives to place stored tensors, not a structure
        reasons.append("the tensors of a model family no registered layout matches (set 'layout:' in the "
                       "refit config if it is one that 'qstrat list' shows)")
    if reasons:
        raise ConfigOnlyUnsupportedError(f"layout {layout.name!r}: config-only planning does not generate "
                        f"{' and '.join(reasons)}; plan the trainer's state_dict() instead (a copy "
                        "on the meta device is enough: transformers' class built under "
                        "torch.device('meta'))")
