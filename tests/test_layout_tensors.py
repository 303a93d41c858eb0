"""The tensors each layout expects from a config.json (:class:`qstrat.layouts.skeleton.LayoutTensors` and
its per-family overrides in ``qstrat/plugins/builtin/layouts/``), held against transformers' real classes;
the other family questions shared code asks a layout; and a plugin family that supplies its own
tensor shapes, planned config-only through ``qstrat plan``.

tests/test_model_families.py holds every built-in family's grouped tensors against its class; this
module covers the per-family config variants and forms that test does not reach.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import qstrat.plugins.registry
from qstrat import PlanError, RefitDriver, Registry
from qstrat.plugins.builtin.layouts import DEEPSEEK_V3, GENERIC, GLM4_MOE, GPT_OSS, MIXTRAL, QWEN3, QWEN3_MOE
from qstrat.errors import ConfigOnlyUnsupportedError
from qstrat.hookspecs import hookimpl
from qstrat.layouts.model_layout import ModelLayout
from qstrat.execute.sharding import ExpertParallel
from qstrat.layouts.skeleton import model_tensors
from qstrat.layouts.model_config import ModelConfig

import model_families as mf

BASE = mf._BASE
MOE = mf._MOE


def real(cfg, layout=None) -> dict[str, tuple[int, ...]]:
    """Names (checkpoint form) and shapes of the transformers class's ``state_dict()`` (meta)."""
    with torch.device("meta"):
        model = getattr(transformers, cfg.architectures[0])(cfg)
    rename = layout.checkpoint_name if layout is not None else (lambda k: k)
    return {rename(k): tuple(v.shape) for k, v in model.state_dict().items()}


def config(cls_name, arch, **kw):
    cfg = getattr(transformers, cls_name)(**kw)
    cfg.architectures = [arch]
    return cfg


# ---- per-family overrides, against transformers' classes ------------------------------------
@pytest.mark.parametrize("cls_name,arch,kw", [
    # Qwen2: q/k/v biases without a config key (Qwen2Attention: bias=True); no q_norm/k_norm
    ("Qwen2Config", "Qwen2ForCausalLM", BASE),
    # Qwen2-MoE: qkv_bias (default True) and False; shared expert with its gate
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**BASE, **MOE, "shared_expert_intermediate_size": 128}),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**BASE, **MOE, "shared_expert_intermediate_size": 128,
                                              "qkv_bias": False}),
    # Qwen3-MoE with dense layers: mlp_only_layers and decoder_sparse_step
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**BASE, **MOE, "num_hidden_layers": 4, "mlp_only_layers": [0],
                                              "decoder_sparse_step": 2}),
    # DeepSeek-V2: q_lora_rank null (q_proj), greedy routing (no e_score_correction_bias)
    ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **BASE, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "q_lora_rank": None, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
        "v_head_dim": 64, "moe_intermediate_size": 128, "n_shared_experts": 2}),
    # Llama with attention_bias: q/k/v/o biases
    ("LlamaConfig", "LlamaForCausalLM", {**BASE, "attention_bias": True}),
])
def test_family_variants_equal_the_transformers_class(cls_name, arch, kw):
    cfg = config(cls_name, arch, **kw)
    hf = cfg.to_dict()
    layout = RefitDriver("bf16", hf_config=hf).layout
    assert dict(model_tensors(layout, hf, grouped=True)) == real(cfg, layout)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "glm4_moe", "mixtral"])
def test_per_expert_form_is_the_grouped_slabs_cut_per_expert(family):
    """Without ``grouped`` the routed experts are per-expert matrices in checkpoint names: each
    slab [E, 2I, H] / [E, H, I] becomes E x (gate [I, H], up [I, H]) / E x down [H, I]; every
    other tensor is the same."""
    cfg = mf.hf_config(family)
    hf = mf.config_dict(cfg)
    layout = RefitDriver("bf16", hf_config=hf).layout
    grouped = dict(model_tensors(layout, hf, grouped=True))
    per_expert = dict(model_tensors(layout, hf))
    gate, up, down = layout.expert_projections
    want = {}
    for name, shape in grouped.items():
        p = layout.parse(name)
        if not p.slab:
            want[name] = shape
            continue
        parts = layout.slabs[p.projection].parts
        for e in range(shape[0]):
            for proj in parts:
                want[f"{p.engine_module}.{e}.{proj}.weight"] = (shape[1] // len(parts), shape[2])
    assert per_expert == want
    assert per_expert[f"{layout.layers_prefix}.{layout.num_layers(ModelConfig.of(hf)) - 1}.{layout.mlp_blocks[0]}.experts.3.{down}"
                      ".weight"] == (cfg.hidden_size, hf.get("moe_intermediate_size") or cfg.intermediate_size)


def test_gpt_oss_generates_its_slabs_biases_and_sinks():
    """gpt-oss' grouped tensors are the transformers class's state_dict: transposed slabs, their
    biases, the router bias, attention sinks. Its experts exist only as whole slabs, so per-expert
    names are refused before the first tensor (also what keeps an engine manifest from being built
    for it; docs/vllm.md)."""
    cfg = mf.hf_config("gpt_oss")
    hf = mf.config_dict(cfg)
    h, i, e, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_attention_heads
    grouped = dict(model_tensors(GPT_OSS, hf, grouped=True))
    assert grouped == real(cfg)
    with pytest.raises(ConfigOnlyUnsupportedError, match="layout 'gpt_oss': config-only planning does not "
                       "generate per-expert names for experts that exist only as whole transposed slabs"):
        next(model_tensors(GPT_OSS, hf))
    p = "model.layers.1"
    assert {k: v for k, v in grouped.items() if k.startswith(f"{p}.mlp.") or k.endswith("sinks")} == {
        f"{p}.mlp.experts.gate_up_proj": (e, h, 2 * i), f"{p}.mlp.experts.gate_up_proj_bias": (e, 2 * i),
        f"{p}.mlp.experts.down_proj": (e, i, h), f"{p}.mlp.experts.down_proj_bias": (e, h),
        f"{p}.mlp.router.weight": (e, h), f"{p}.mlp.router.bias": (e,),
        "model.layers.0.self_attn.sinks": (heads,), f"{p}.self_attn.sinks": (heads,)}


def test_gpt_oss_full_size_default_config_equals_the_class():
    """gpt-oss-120b's shapes (transformers' default config) from the config alone, as built."""
    cfg = config("GptOssConfig", "GptOssForCausalLM")
    assert dict(model_tensors(GPT_OSS, cfg.to_dict(), grouped=True)) == real(cfg)


@pytest.mark.parametrize("layout,n_group,topk_method,bias", [
    (DEEPSEEK_V3, 8, "noaux_tc", True), (DEEPSEEK_V3, 8, None, True), (DEEPSEEK_V3, None, None, False),
    (DEEPSEEK_V3, 8, "greedy", False), (GLM4_MOE, 1, None, True)])
def test_router_score_correction_bias_follows_topk_method(layout, n_group, topk_method, bias):
    """``e_score_correction_bias`` [E] with noaux_tc routing: DeepSeek-V3's config says it;
    GLM-4.5's (``n_group``, no ``topk_method``) means it; DeepSeek-V2's greedy has none."""
    hf = {**BASE, **MOE, "model_type": layout.model_types[0], "num_experts": 8}
    hf.update({k: v for k, v in (("n_group", n_group), ("topk_method", topk_method)) if v is not None})
    names = dict(model_tensors(layout, hf))
    assert names["model.layers.0.mlp.gate.weight"] == (8, 256)
    assert names.get("model.layers.0.mlp.gate.e_score_correction_bias") == ((8,) if bias else None)


@pytest.mark.parametrize("layout", [DEEPSEEK_V3, GLM4_MOE])
def test_mtp_block_follows_deepseek_v3_weights(layout):
    """The MTP layer ``model.layers.{num_hidden_layers}`` (DeepSeek-V3 README_WEIGHTS.md;
    transformers does not build it): its own embedding, enorm/hnorm, eh_proj [H, 2H], shared
    head, then a full (MoE) decoder layer."""
    cfg = mf.hf_config(layout.name)
    hf = {**mf.config_dict(cfg), "num_nextn_predict_layers": 1}
    n = cfg.num_hidden_layers
    mtp = {k: v for k, v in model_tensors(layout, hf) if k.startswith(f"model.layers.{n}.")}
    h, v = cfg.hidden_size, cfg.vocab_size
    extras = {"embed_tokens.weight": (v, h), "enorm.weight": (h,), "hnorm.weight": (h,),
              "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h)}
    assert {k: mtp[f"model.layers.{n}.{k}"] for k in extras} == extras
    last = {k.replace(f"model.layers.{n - 1}.", ""): s for k, s in model_tensors(layout, hf)
            if k.startswith(f"model.layers.{n - 1}.")}
    assert {k.replace(f"model.layers.{n}.", ""): s for k, s in mtp.items()} == {**extras, **last}
    assert all(layout.parse(k, n).kind == "mtp" for k in mtp)


def test_a_layout_generates_its_own_structure_not_the_configs_model_type():
    """Family rules live in the family's layout: a Qwen3 config planned with the Mixtral layout
    gets Mixtral's tensors (no q_norm), the Qwen3 layout gets Qwen3's."""
    hf = mf.config_dict(mf.hf_config("qwen3_moe"))
    assert "model.layers.0.self_attn.q_norm.weight" in dict(model_tensors(QWEN3_MOE, hf))
    mixtral = dict(model_tensors(MIXTRAL, hf))
    assert not any("q_norm" in k for k in mixtral)
    assert mixtral["model.layers.0.block_sparse_moe.experts.3.w2.weight"] == (256, 128)


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"layer_types": None, "num_hidden_layers": 4, "full_attention_interval": 2},
                                {"attention_bias": True}])
def test_qwen3_next_hybrid_layers_equal_the_transformers_class(kw):
    """Gated DeltaNet layers (stored-fused in_proj_qkvz/in_proj_ba), gated attention (q_proj
    twice as wide), layer types from ``layer_types`` or ``full_attention_interval``."""
    cfg = config("Qwen3NextConfig", "Qwen3NextForCausalLM", **{**BASE, **MOE, **mf._GDN, **kw})
    hf = cfg.to_dict()
    layout = RefitDriver("bf16", hf_config=hf).layout
    assert dict(model_tensors(layout, hf, grouped=True)) == real(cfg, layout)


def test_a_vision_key_no_layout_generates_is_refused_before_the_first_tensor():
    hf = mf.config_dict(mf.hf_config("qwen3_5_moe"))
    hf["vision_config"] = {**hf["vision_config"], "deepstack_visual_indexes": [0]}
    gen = model_tensors(RefitDriver("bf16", hf_config=hf).layout, hf)
    with pytest.raises(ConfigOnlyUnsupportedError, match="config-only planning does not generate "
                       "vision_config.deepstack_visual_indexes; "):
        next(gen)


def test_the_generic_layout_generates_nothing():
    with pytest.raises(ConfigOnlyUnsupportedError, match="layout 'generic': config-only planning does not "
                       "generate the tensors of a model family no registered layout matches"):
        next(model_tensors(GENERIC, {**BASE, "model_type": "llama"}))


def test_a_missing_config_key_is_named():
    hf = {**BASE, "model_type": "qwen3"}
    del hf["vocab_size"]
    with pytest.raises(KeyError, match="vocab_size"):
        list(model_tensors(QWEN3, hf))


# ---- other family questions shared code asks the layout --------------------------------------
def test_whole_slab_reason_is_the_layouts_answer():
    """Planner and expert-parallel renaming ask the layout why a slab stays whole."""
    shape = (4, 256, 512)
    assert GPT_OSS.whole_slab_reason("gate_up_proj", shape) == (
        "gpt_oss stores its experts as transposed (4, 256, 512) slabs [E, in, out] (gate_up_proj: gate/up "
        "interleaved along the last dim); vLLM's GptOssForCausalLM loads them unquantized or as its own "
        "MXFP4 only")
    assert QWEN3_MOE.whole_slab_reason("gate_up_proj", shape) is None
    assert GPT_OSS.whole_slab_reason("q_proj", shape) is None
    slab = torch.empty(2, 256, 512, device="meta")
    with pytest.raises(PlanError) as exc:
        list(ExpertParallel(2, 4).global_tensors(1, {"model.layers.0.mlp.experts.gate_up_proj": slab}, GPT_OSS))
    assert str(exc.value) == ("model.layers.0.mlp.experts.gate_up_proj: gpt_oss stores its experts as transposed "
                              "(2, 256, 512) slabs [E, in, out] (gate_up_proj: gate/up interleaved along the last "
                              "dim); vLLM's GptOssForCausalLM loads them unquantized or as its own MXFP4 only; they "
                              "cannot be cut into per-expert shards")


def test_output_architecture():
    """transformers' table for a model_type it knows; else the layout's one architecture; else None."""
    assert QWEN3.output_architecture(ModelConfig.of({"model_type": "qwen3"})) == "Qwen3ForCausalLM"
    assert GENERIC.output_architecture(ModelConfig.of({"model_type": "mixtral"})) == "MixtralForCausalLM"
    assert GPT_OSS.output_architecture(ModelConfig.of({"model_type": "my_oss"})) == "GptOssForCausalLM"
    assert QWEN3.output_architecture(ModelConfig.of({"model_type": "my_qwen"})) is None  # names two
    assert GENERIC.output_architecture(ModelConfig.of({})) is None


# ---- a plugin family supplies its tensor shapes ------------------------------------------------
class Phi3Layout(ModelLayout):
    """A plugin family whose attention and MLP are stored pre-fused (transformers' Phi-3):
    ``self_attn.qkv_proj`` [(heads + 2 kv) * d, H] and ``mlp.gate_up_proj`` [2I, H]."""

    def attention_tensors(self, p, c):
        h, heads, d = c.hidden_size, c.num_attention_heads, self.head_dim(c)
        kv = c.num_key_value_heads or heads
        yield f"{p}.qkv_proj.weight", ((heads + 2 * kv) * d, h)
        yield f"{p}.o_proj.weight", (h, heads * d)

    def mlp_tensors(self, p, c, i, grouped):
        h, inter = c.hidden_size, c.intermediate_size
        yield f"{p}.gate_up_proj.weight", (2 * inter, h)
        yield f"{p}.down_proj.weight", (h, inter)


PHI3 = Phi3Layout(name="test_phi3", architectures=("Phi3ForCausalLM",), model_types=("phi3",),
                  attention_projections=("qkv_proj", "o_proj"), dense_projections=("gate_up_proj", "down_proj"),
                  routers=(), fused=())


class Phi3Plugin:
    @hookimpl
    def qstrat_layouts(self):
        return [PHI3]


def test_a_plugin_layout_supplies_the_shapes_of_a_config_only_plan(tmp_path, monkeypatch, capsys):
    """``qstrat plan DIR`` on a config.json of a family only a plugin knows: the plugin layout's
    generator names the tensors (equal to transformers' Phi3ForCausalLM), the plan quantizes its
    fused projections. Without the plugin the same directory is refused (generic layout)."""
    cfg = config("Phi3Config", "Phi3ForCausalLM", **{**BASE, "pad_token_id": 0})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    from qstrat.cli.commands import main

    monkeypatch.setattr(qstrat.plugins.registry, "_REGISTRY", Registry(plugins=[Phi3Plugin()]))
    assert main(["plan", str(tmp_path), "--preset", "block-fp8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == "test_phi3"
    assert {e["name"]: tuple(e["shape"]) for e in doc["entries"]} == real(cfg)
    formats = {e["name"]: e["serializer"] for e in doc["entries"]}
    assert formats["model.layers.1.self_attn.qkv_proj.weight"] == "block_fp8"
    assert formats["model.layers.1.mlp.gate_up_proj.weight"] == "block_fp8"
    assert formats["lm_head.weight"] == "passthrough"

    monkeypatch.setattr(qstrat.plugins.registry, "_REGISTRY", Registry())
    assert main(["plan", str(tmp_path), "--preset", "block-fp8", "--json"]) == 2
    assert "layout 'generic': config-only planning does not generate" in capsys.readouterr().err
