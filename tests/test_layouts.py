"""Name parsing from per-model layout data: structure, not substrings."""
from __future__ import annotations

import pytest

from qstrat import RefitDriver
from qstrat.plugins.builtin.layouts import DEEPSEEK_V3, MIXTRAL, QWEN3_5_MOE, QWEN3_MOE
from qstrat.layouts.model_layout import ParsedName


def kinds(layout, names, num_layers=None):
    return [(p.kind, p.layer, p.expert, p.projection) for p in (layout.parse(n, num_layers) for n in names)]


def test_gate_router_is_not_gate_proj():
    got = kinds(QWEN3_MOE, [
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.experts.7.gate_proj.weight",
        "model.layers.3.mlp.shared_expert_gate.weight",
        "model.layers.3.mlp.shared_expert.gate_proj.weight",
        "model.layers.3.mlp.gate_proj.weight",
    ])
    assert got == [("router", 3, None, None), ("expert", 3, 7, "gate_proj"), ("router", 3, None, None),
                   ("shared_expert", 3, None, "gate_proj"), ("dense_mlp", 3, None, "gate_proj")]


def test_grouped_slabs_and_engine_module():
    p = QWEN3_MOE.parse("model.layers.0.mlp.experts.gate_up_proj")
    assert (p.kind, p.slab, p.projection, p.vllm_module) == ("expert", True, "gate_up_proj",
                                                             "model.layers.0.mlp.experts")
    assert QWEN3_MOE.parse("model.layers.0.mlp.experts.3.down_proj.weight").vllm_module == \
        "model.layers.0.mlp.experts"


def test_deepseek_mtp_and_mla():
    got = kinds(DEEPSEEK_V3, [
        "model.layers.61.mlp.experts.0.gate_proj.weight",
        "model.layers.60.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.60.self_attn.kv_a_layernorm.weight",
        "model.layers.2.mlp.down_proj.weight",
        "model.layers.5.mlp.shared_experts.up_proj.weight",
        "model.layers.5.mlp.gate.e_score_correction_bias",
    ], num_layers=61)
    assert got == [("mtp", 61, None, None), ("attention", 60, None, "kv_a_proj_with_mqa"),
                   ("norm", 60, None, "kv_a_layernorm"), ("dense_mlp", 2, None, "down_proj"),
                   ("shared_expert", 5, None, "up_proj"), ("router", 5, None, None)]


def test_vision_tower_and_mtp_blocks_are_not_decoder_layers():
    for name in ["model.visual.blocks.0.attn.qkv.weight", "model.visual.layers.3.mlp.fc1.weight"]:
        assert QWEN3_5_MOE.parse(name).kind == "non_decoder", name
    assert QWEN3_5_MOE.parse("mtp.layers.0.mlp.experts.gate_up_proj").kind == "mtp"
    p = QWEN3_5_MOE.parse("model.language_model.layers.4.mlp.experts.gate_up_proj")
    assert (p.kind, p.layer, p.slab) == ("expert", 4, True)


def test_mixtral_block_sparse_moe():
    got = kinds(MIXTRAL, ["model.layers.1.block_sparse_moe.gate.weight",
                          "model.layers.1.block_sparse_moe.experts.5.w3.weight"])
    assert got == [("router", 1, None, None), ("expert", 1, 5, "w3")]


@pytest.mark.parametrize("name,kind", [("model.embed_tokens.weight", "embedding"),
                                       ("lm_head.weight", "lm_head"), ("model.norm.weight", "norm"),
                                       ("model.layers.0.input_layernorm.weight", "norm"),
                                       ("model.rotary_emb.inv_freq", "other")])
def test_top_level_kinds(name, kind):
    assert isinstance(QWEN3_MOE.parse(name), ParsedName)
    assert QWEN3_MOE.parse(name).kind == kind


def test_a_non_ascii_digit_layer_index_is_an_unplaced_name_not_a_crash():
    """'²' passes str.isdigit() but int() refuses it: it used to end planning with a ValueError."""
    import torch

    from qstrat import PlanError, RefitDriver

    meta = torch.empty(128, 128, dtype=torch.bfloat16, device="meta")
    name = "model.layers.\u00b2.self_attn.q_proj.weight"
    with pytest.raises(PlanError, match=r"cannot place 1 weight matrices: model\.layers\.\u00b2\.self_attn"):
        RefitDriver("block-fp8").plan({name: meta, "model.layers.0.self_attn.q_proj.weight": meta})


@pytest.mark.parametrize("value", ["four", 2.5, True, 0])
def test_a_config_depth_that_is_not_a_positive_integer_names_the_key(tiny_model, tiny_hf_config, value):
    from qstrat import ConfigError

    with pytest.raises(ConfigError, match=r"model config: num_hidden_layers must be an integer in 1\.\.4096, got "):
        RefitDriver("block-fp8", hf_config={**tiny_hf_config, "num_hidden_layers": value}).plan(tiny_model.state_dict())
