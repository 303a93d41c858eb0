"""Planning: decisions, ignore lists and errors, before any quantization."""
from __future__ import annotations

import random
import re
import time

import pytest
import torch

import qstrat
from qstrat import PlanError, RefitDriver
from qstrat.builtin.layouts import DEEPSEEK_V3, QWEN3_MOE
from qstrat.skeleton import model_tensors

from conftest import model_config


def meta(layout, cfg, grouped=False):
    return {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(layout, cfg, grouped)}


def by_name(plan):
    return {e.name: e for e in plan.entries}


def test_deepseek_v3_plan_from_config_only():
    cfg = model_config("deepseek-v3")
    t0 = time.perf_counter()
    plan = RefitDriver("block-fp8", hf_config=cfg).plan(meta(DEEPSEEK_V3, cfg))
    print(f"DeepSeek-V3: planned {len(plan.entries)} tensors in {time.perf_counter() - t0:.2f} s")
    e = by_name(plan)
    assert len(plan.entries) == 46183
    assert e["model.layers.0.mlp.gate_proj.weight"].serializer == "block_fp8"         # dense layer
    assert e["model.layers.3.mlp.gate.weight"].serializer == "passthrough"           # router
    assert e["model.layers.3.mlp.gate.e_score_correction_bias"].serializer == "passthrough"
    assert e["model.layers.3.mlp.shared_experts.down_proj.weight"].serializer == "block_fp8"
    assert e["model.layers.60.mlp.experts.255.up_proj.weight"].serializer == "block_fp8"
    assert e["model.layers.61.mlp.experts.0.up_proj.weight"].kind == "mtp"            # MTP block
    assert e["model.layers.61.mlp.experts.0.up_proj.weight"].serializer == "passthrough"
    assert e["model.layers.61.eh_proj.weight"].serializer == "passthrough"
    qc = plan.vllm_quantization_config()
    routers = [f"model.layers.{i}.mlp.gate" for i in range(3, 61)]
    assert qc["ignored_layers"] == ["lm_head"] + routers
    assert qc["weight_block_size"] == [128, 128] and qc["quant_method"] == "fp8"
    w = e["model.layers.3.self_attn.q_b_proj.weight"]
    assert [(o.name, o.shape, o.dtype) for o in w.outputs] == [
        ("model.layers.3.self_attn.q_b_proj.weight", (24576, 1536), "float8_e4m3fn"),
        ("model.layers.3.self_attn.q_b_proj.weight_scale_inv", (192, 12), "float32")]


def test_qwen3_235b_mxfp8_experts_with_keep_bf16():
    cfg = model_config("qwen3-235b-a22b")
    t0 = time.perf_counter()
    plan = RefitDriver({"preset": "mxfp8-experts", "keep_bf16": {"first": 1, "last": 2}},
                       hf_config=cfg).plan(meta(QWEN3_MOE, cfg))
    print(f"Qwen3-235B-A22B: planned {len(plan.entries)} tensors in {time.perf_counter() - t0:.2f} s")
    e = by_name(plan)
    assert e["model.layers.0.mlp.experts.5.gate_proj.weight"].rule == "keep_bf16.first"
    assert e["model.layers.92.mlp.experts.5.gate_proj.weight"].rule == "keep_bf16.last"
    assert e["model.layers.91.mlp.experts.5.gate_proj.weight"].serializer == "mxfp8"
    assert e["model.layers.91.self_attn.q_proj.weight"].serializer == "bf16"          # default
    assert e["model.layers.91.mlp.gate.weight"].serializer == "passthrough"
    assert [o.name for o in e["model.layers.50.mlp.experts.1.down_proj.weight"].outputs] == [
        "model.layers.50.mlp.experts.1.down_proj.weight", "model.layers.50.mlp.experts.1.down_proj.weight_scale"]
    ignore = plan.vllm_quantization_config()["ignore"]
    assert "model.layers.0.mlp.experts" in ignore and "model.layers.93.mlp.experts" in ignore
    assert "model.layers.50.mlp.experts" not in ignore and "model.layers.50.mlp.gate" in ignore
    assert "model.layers.50.self_attn.q_proj" in ignore
    assert plan.vllm_quantization_config()["quant_algo"] == "MXFP8"


def test_grouped_slab_is_split_per_expert_in_plan():
    cfg = model_config("qwen3-235b-a22b")
    tensors = {k: v for k, v in meta(QWEN3_MOE, cfg, grouped=True).items() if ".layers.7." in k}
    e = by_name(RefitDriver("mxfp8-experts", hf_config=cfg).plan(tensors))["model.layers.7.mlp.experts.gate_up_proj"]
    assert len(e.outputs) == 128 * 2 * 2
    assert [(o.name, o.shape) for o in e.outputs[:4]] == [
        ("model.layers.7.mlp.experts.0.gate_proj.weight", (1536, 4096)),
        ("model.layers.7.mlp.experts.0.gate_proj.weight_scale", (1536, 128)),
        ("model.layers.7.mlp.experts.0.up_proj.weight", (1536, 4096)),
        ("model.layers.7.mlp.experts.0.up_proj.weight_scale", (1536, 128))]


def test_fused_emission_names():
    cfg = model_config("qwen3-235b-a22b")
    tensors = {k: v for k, v in meta(QWEN3_MOE, cfg, grouped=True).items() if ".layers.7.mlp.experts" in k}
    plan = RefitDriver({"preset": "block-fp8", "expert_emission": "fused"}, hf_config=cfg).plan(tensors)
    assert [(o.name, o.shape) for o in plan.outputs()] == [
        ("model.layers.7.mlp.experts.down_proj", (128, 4096, 1536)),
        ("model.layers.7.mlp.experts.down_proj_scale_inv", (128, 32, 12)),
        ("model.layers.7.mlp.experts.gate_up_proj", (128, 3072, 4096)),
        ("model.layers.7.mlp.experts.gate_up_proj_scale_inv", (128, 24, 32))]


def test_wire_order_is_natural_and_independent_of_input_order():
    cfg = {**model_config("qwen3-235b-a22b"), "num_hidden_layers": 12, "num_experts": 4}
    tensors = meta(QWEN3_MOE, cfg)
    items = list(tensors.items())
    random.Random(0).shuffle(items)
    a = RefitDriver("block-fp8", hf_config=cfg).plan(tensors)
    b = RefitDriver("block-fp8", hf_config=cfg).plan(items)
    assert [o.name for o in a.outputs()] == [o.name for o in b.outputs()]
    layers = [e.layer for e in a.entries if e.layer is not None]
    assert layers == sorted(layers) and 10 in layers


def _small(cfg_overrides=None):
    cfg = {**model_config("qwen3-235b-a22b"), "num_hidden_layers": 4, "num_experts": 4,
           "hidden_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, **(cfg_overrides or {})}
    return cfg, meta(QWEN3_MOE, cfg)


def test_unsupported_shape_is_a_plan_error_or_visible_fallback():
    cfg, tensors = _small({"moe_intermediate_size": 48})  # down_proj K = 48: not a multiple of 32
    with pytest.raises(PlanError, match=r"experts\.0\.down_proj\.weight: mxfp8 needs K .* K=48"):
        RefitDriver("mxfp8-experts", hf_config=cfg).plan(tensors)
    cfg, tensors = _small({"head_dim": 36})  # o_proj K = 4 * 36 = 144; q/k/v K = 256
    plan = RefitDriver({"rules": [{"select": "attention", "serializer": "mxfp8", "on_unsupported": "bf16"}]},
                       hf_config=cfg).plan(tensors)
    e = by_name(plan)
    assert e["model.layers.1.self_attn.o_proj.weight"].serializer == "bf16"
    assert "BF16 fallback: mxfp8 needs K" in e["model.layers.1.self_attn.o_proj.weight"].note
    assert e["model.layers.1.self_attn.q_proj.weight"].serializer == "mxfp8"
    ignore = plan.vllm_quantization_config()["ignore"]
    assert "model.layers.1.self_attn.o_proj" in ignore and "model.layers.1.self_attn.q_proj" not in ignore


def test_half_quantized_fused_module_is_a_plan_error():
    cfg, tensors = _small({"moe_intermediate_size": 48})
    with pytest.raises(PlanError, match=r"model\.layers\.\d\.mlp\.experts: some of its tensors are quantized"):
        RefitDriver({"rules": [{"select": "experts", "serializer": "mxfp8", "on_unsupported": "bf16"}]},
                    hf_config=cfg).plan(tensors)


def test_fused_shards_with_different_formats_are_a_plan_error():
    cfg, tensors = _small()
    bad = {"rules": [{"select": "attention", "exclude": ["*.k_proj.weight"], "serializer": "block_fp8"}]}
    with pytest.raises(PlanError, match=r"k_proj\.weight .* are fused by the engine but planned differently"):
        RefitDriver(bad, hf_config=cfg).plan(tensors)


def test_mixed_quantized_formats_are_a_plan_error():
    cfg, tensors = _small()
    mixed = {"rules": [{"select": "experts", "serializer": "mxfp8"},
                       {"select": "attention", "serializer": "block_fp8"}]}
    with pytest.raises(PlanError, match="mixes quantized formats"):
        RefitDriver(mixed, hf_config=cfg).plan(tensors)


def test_duplicate_outputs_per_expert_and_slab_are_a_plan_error():
    cfg, tensors = _small()
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.empty(4, 256, 256, device="meta")
    with pytest.raises(PlanError, match="both emit model.layers.0.mlp.experts.0.gate_proj.weight"):
        RefitDriver("block-fp8", hf_config=cfg).plan(tensors)


def test_slab_halves_off_the_tile_are_refused_for_vllms_fused_moe_rule():
    """gate/up halves of 192 rows: per expert each half could be tiled on its own
    (tests/test_odd_shapes.py), but vLLM's fused-MoE block-FP8 layer refuses an intermediate
    size off the 128 grid in either emission (this test asserted, before issue 19, that
    per-expert emission was refused for the tile and that fused emission planned)."""
    t = {"model.layers.0.mlp.experts.gate_up_proj": torch.empty(2, 2 * 192, 256, device="meta")}
    why = ("model.layers.0.mlp.experts: block_fp8 (rules[0]): vLLM's fused-MoE block-FP8 layer needs the "
           "experts' intermediate size to be a multiple of 128 (got 192;")
    for emission in ("per_expert", "fused"):
        with pytest.raises(PlanError, match=re.escape(why)):
            RefitDriver({"preset": "block-fp8", "expert_emission": emission},
                        hf_config={"model_type": "qwen3_moe", "num_hidden_layers": 1}).plan(t)


def test_routers_embeddings_lm_head_need_explicit_rules():
    cfg, tensors = _small()
    everything = {"rules": [{"select": "linear", "include": ["*"], "serializer": "block_fp8"}]}
    e = by_name(RefitDriver(everything, hf_config=cfg).plan(tensors))
    assert e["model.layers.1.mlp.gate.weight"].serializer == "passthrough"
    assert e["lm_head.weight"].serializer == "passthrough"
    explicit = {"rules": [{"select": ["linear", "routers", "lm_head"], "serializer": "block_fp8"}]}
    e = by_name(RefitDriver(explicit, hf_config=cfg).plan(tensors))
    assert e["model.layers.1.mlp.gate.weight"].serializer == "block_fp8"
    assert e["lm_head.weight"].serializer == "block_fp8"
    assert e["model.embed_tokens.weight"].serializer == "passthrough"
    assert e["model.layers.1.input_layernorm.weight"].serializer == "passthrough"


def test_include_exclude_glob_and_regex():
    cfg, tensors = _small()
    rules = {"rules": [{"select": "linear", "include": ["re:layers\\.[12]\\."],
                        "exclude": ["*.o_proj.weight"], "serializer": "block_fp8"}]}
    e = by_name(RefitDriver(rules, hf_config=cfg).plan(tensors))
    assert e["model.layers.1.self_attn.q_proj.weight"].serializer == "block_fp8"
    assert e["model.layers.1.self_attn.o_proj.weight"].serializer == "bf16"
    assert e["model.layers.3.self_attn.q_proj.weight"].serializer == "bf16"


def test_plan_json_roundtrip():
    import json

    cfg, tensors = _small()
    doc = json.loads(RefitDriver("block-fp8", hf_config=cfg).plan(tensors).to_json())
    assert doc["quantization_config"]["quant_method"] == "fp8"
    assert doc["totals"]["block_fp8"]["tensors"] == 4 * (4 + 4 * 3)
    # natural wire order is model order: embeddings, layers by index, then the rest
    assert doc["wire_order"] == "natural"
    assert doc["entries"][0]["name"] == "model.embed_tokens.weight"
    assert [e["name"] for e in doc["entries"][-2:]] == ["lm_head.weight", "model.norm.weight"]


def test_select_on_module_and_names(tiny_model):
    decisions = qstrat.select({"preset": "mxfp8-experts", "keep_bf16": {"first": 1}}, tiny_model)
    assert decisions["model.layers.1.mlp.experts.gate_up_proj"].serializer == "mxfp8"
    assert decisions["model.layers.0.mlp.experts.gate_up_proj"].rule == "keep_bf16.first"
    assert decisions["model.layers.1.mlp.gate"].serializer == "passthrough"
    assert decisions["model.layers.1.self_attn.q_proj"].serializer == "bf16"
    assert "model.layers.1.input_layernorm" in decisions
    by_names = qstrat.select("block-fp8", ["model.layers.0.mlp.gate", "model.layers.0.mlp.gate_proj",
                                           "model.layers.0.mlp.experts.gate_up_proj"],
                             hf_config={"model_type": "qwen3_moe"})
    assert {k: d.serializer for k, d in by_names.items()} == {
        "model.layers.0.mlp.gate": "passthrough", "model.layers.0.mlp.gate_proj": "block_fp8",
        "model.layers.0.mlp.experts.gate_up_proj": "block_fp8"}


def test_generic_layout_never_quantizes_unknown_routers():
    t = {n: torch.empty(8, 256, device="meta") for n in (
        "model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.feed_forward.router.weight",
        "model.layers.0.some_block.gate.weight")}
    t["model.layers.0.block_sparse_moe.experts.0.w1.weight"] = torch.empty(128, 256, device="meta")
    plan = RefitDriver("block-fp8").plan(t)  # no hf_config: generic layout
    assert {e.name: e.serializer for e in plan.entries} == {
        "model.layers.0.block_sparse_moe.experts.0.w1.weight": "block_fp8",
        "model.layers.0.block_sparse_moe.gate.weight": "passthrough",
        "model.layers.0.feed_forward.router.weight": "passthrough",
        "model.layers.0.some_block.gate.weight": "passthrough"}
    assert "model.layers.0.block_sparse_moe.gate" in plan.ignored_layers


def test_allow_special_lets_include_reach_routers_only():
    cfg, tensors = _small()
    rule = {"select": "attention", "include": ["*layers.1.*"], "allow_special": True, "serializer": "block_fp8"}
    e = by_name(RefitDriver({"rules": [rule]}, hf_config=cfg).plan(tensors))
    assert e["model.layers.1.mlp.gate.weight"].serializer == "block_fp8"            # opted in
    assert e["model.layers.1.self_attn.q_proj.weight"].serializer == "block_fp8"
    assert e["model.layers.1.mlp.experts.0.up_proj.weight"].serializer == "bf16"    # not selected
    assert e["model.layers.2.mlp.gate.weight"].serializer == "passthrough"


def test_slab_and_per_expert_inputs_for_one_layer_are_refused_in_any_emission():
    cfg, tensors = _small()
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.empty(4, 256, 256, device="meta")
    for emission in ("per_expert", "fused"):
        with pytest.raises(PlanError, match="given both as grouped slabs and as per-expert tensors"):
            RefitDriver({"preset": "block-fp8", "expert_emission": emission}, hf_config=cfg).plan(tensors)


def test_slab_expert_count_must_match_config():
    cfg, _ = _small()
    t = {"model.layers.0.mlp.experts.down_proj": torch.empty(3, 256, 128, device="meta")}
    with pytest.raises(PlanError, match="slab holds 3 experts, the model config says 4"):
        RefitDriver("block-fp8", hf_config=cfg).plan(t)


def test_keep_bf16_last_needs_the_configured_depth():
    cfg, tensors = _small()
    with pytest.raises(PlanError, match="keep_bf16.last needs the decoder depth"):
        RefitDriver({"preset": "block-fp8", "keep_bf16": {"last": 1}}).plan(tensors)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.float8_e4m3fn, torch.float64])
def test_non_float_weights_are_plan_errors(dtype):
    t = {"model.layers.0.self_attn.q_proj.weight": torch.empty(128, 256, dtype=dtype, device="meta")}
    with pytest.raises(PlanError, match=rf"q_proj\.weight: is planned as block_fp8 \(rules\[0\]\) and needs a "
                                        rf"bfloat16/float16/float32 tensor, got {str(dtype)[6:]} \("):
        RefitDriver("block-fp8").plan(t)


def test_names_must_be_strings():
    with pytest.raises(PlanError, match="tensor names must be strings, got 5"):
        RefitDriver("block-fp8").plan([(5, torch.empty(2, 2, device="meta"))])


def test_fused_group_mismatch_shows_options():
    cfg, tensors = _small()
    rules = {"rules": [{"select": "attention", "include": ["*.k_proj.weight"], "serializer": "block_fp8",
                        "options": {"ue8m0": True}}, {"select": "attention", "serializer": "block_fp8"}]}
    with pytest.raises(PlanError, match=r"'ue8m0': True"):
        RefitDriver(rules, hf_config=cfg).plan(tensors)


def test_layers_past_the_configs_depth_are_an_error_not_mtp(tiny_model, tiny_hf_config):
    """num_hidden_layers too small for the tensors given (an adversarial case: layers 2-3 were
    taken for MTP layers and passed through in BF16 silently)."""
    with pytest.raises(PlanError, match=r"tensors are in layers past the model config's 2 decoder layers "
                                        r"\(it has no MTP layers\): model\.layers\.2\."):
        RefitDriver("block-fp8", hf_config={**tiny_hf_config, "num_hidden_layers": 2}).plan(tiny_model.state_dict())


@pytest.mark.parametrize("value", ["four", 2.5, True, 0])
def test_a_config_depth_that_is_not_a_positive_integer_names_the_key(tiny_model, tiny_hf_config, value):
    from qstrat import ConfigError

    with pytest.raises(ConfigError, match=r"model config: num_hidden_layers must be an integer >= 1, got "):
        RefitDriver("block-fp8", hf_config={**tiny_hf_config, "num_hidden_layers": value}).plan(tiny_model.state_dict())


def test_nan_in_the_model_config_is_refused_before_writing(tiny_model, tiny_hf_config, tmp_path):
    from qstrat import QstratError
    from qstrat.checkpoint import write_checkpoint

    with pytest.raises(QstratError, match=r"'rope_theta' cannot be written to config.json"):
        write_checkpoint(RefitDriver("block-fp8", hf_config=tiny_hf_config), tiny_model.state_dict(),
                         tmp_path / "out", hf_config={**tiny_hf_config, "rope_theta": float("nan")})
    assert not (tmp_path / "out").exists()


def test_a_plan_prints_as_one_line_of_totals(tiny_model, tiny_hf_config):
    """print(plan) in a notebook: its totals, not every entry (the dataclass repr was the whole plan)."""
    plan = qstrat.RefitDriver("block-fp8", hf_config=tiny_hf_config).plan(tiny_model.state_dict())
    totals = plan.totals()
    want = (f"RefitPlan(layout qwen3_moe, 4 decoder layers, {len(plan.entries)} inputs -> "
            f"{len(plan.outputs())} tensors (passthrough {totals['passthrough']['tensors']} -> "
            f"{totals['passthrough']['outputs']}, block_fp8 {totals['block_fp8']['tensors']} -> "
            f"{totals['block_fp8']['outputs']}))")
    assert repr(plan) == str(plan) == want
    assert len(repr(plan)) < 200
