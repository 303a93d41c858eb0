"""qstrat.plan.planner: entries, outputs (per-expert cuts, fused emission), wire order, the engine's
quantization_config and per-tensor refusals, before any quantization. The whole-plan checks are in
test_plan_checks.py, the structure checks in test_plan_structure.py, rule matching in test_rules.py."""
from __future__ import annotations

import random
import re
import time

import pytest
import torch

from qstrat import PlanError, RefitDriver
from qstrat.plugins.builtin.layouts import DEEPSEEK_V3, QWEN3_MOE

from conftest import model_config
from plan_cases import by_name, meta, small_moe


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


def test_unsupported_shape_is_a_plan_error_or_visible_fallback():
    cfg, tensors = small_moe({"moe_intermediate_size": 48})  # down_proj K = 48: not a multiple of 32
    with pytest.raises(PlanError, match=r"experts\.0\.down_proj\.weight: mxfp8 needs K .* K=48"):
        RefitDriver("mxfp8-experts", hf_config=cfg).plan(tensors)
    cfg, tensors = small_moe({"head_dim": 36})  # o_proj K = 4 * 36 = 144; q/k/v K = 256
    plan = RefitDriver({"rules": [{"select": "attention", "serializer": "mxfp8", "on_unsupported": "bf16"}]},
                       hf_config=cfg).plan(tensors)
    e = by_name(plan)
    assert e["model.layers.1.self_attn.o_proj.weight"].serializer == "bf16"
    assert "BF16 fallback: mxfp8 needs K" in e["model.layers.1.self_attn.o_proj.weight"].note
    assert e["model.layers.1.self_attn.q_proj.weight"].serializer == "mxfp8"
    ignore = plan.vllm_quantization_config()["ignore"]
    assert "model.layers.1.self_attn.o_proj" in ignore and "model.layers.1.self_attn.q_proj" not in ignore


def test_mixed_quantized_formats_are_a_plan_error():
    cfg, tensors = small_moe()
    mixed = {"rules": [{"select": "experts", "serializer": "mxfp8"},
                       {"select": "attention", "serializer": "block_fp8"}]}
    with pytest.raises(PlanError, match="mixes quantized formats") as err:
        RefitDriver(mixed, hf_config=cfg).plan(tensors)
    # the message names the rule behind each format, so the user knows which rule to change
    message = str(err.value)
    assert "rules[1] gives block_fp8 (" in message and "rules[0] gives mxfp8 (" in message, message
    assert message.count("tensors, e.g. model.layers.") == 2 and "give every quantized rule one format" in message


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


def test_keep_bf16_last_needs_the_configured_depth():
    cfg, tensors = small_moe()
    with pytest.raises(PlanError, match="keep_bf16.last needs the decoder depth"):
        RefitDriver({"preset": "block-fp8", "keep_bf16": {"last": 1}}).plan(tensors)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.float8_e4m3fn, torch.float64])
def test_non_float_weights_are_plan_errors(dtype):
    t = {"model.layers.0.self_attn.q_proj.weight": torch.empty(128, 256, dtype=dtype, device="meta")}
    with pytest.raises(PlanError, match=rf"q_proj\.weight: is planned as block_fp8 \(rules\[0\]\) and needs a "
                                        rf"bfloat16/float16/float32 tensor, got {str(dtype)[6:]} \("):
        RefitDriver("block-fp8").plan(t)


# ---- a fallback takes the whole module the engine loads (issue 36, item 11) -------------------
def test_an_experts_fallback_keeps_the_whole_experts_module_bf16():
    """Qwen3-MoE with moe_intermediate_size=80 under MXFP8: down_proj (K=80) cannot be represented,
    gate/up can. The old plan fell back for down_proj alone and then failed "some of its tensors
    are quantized and some are not" without naming the fallback."""
    from plan_cases import small_moe

    cfg, tensors = small_moe({"moe_intermediate_size": 80})
    rules = [{"select": "experts", "serializer": "mxfp8", "on_unsupported": "bf16"},
             {"select": "attention", "serializer": "mxfp8"}]
    plan = RefitDriver({"rules": rules}, hf_config=cfg).plan(tensors)
    experts = [e for e in plan.entries if e.kind == "expert"]
    assert experts and {(e.serializer, e.rule) for e in experts} == {("bf16", "rules[0]")}
    gate = next(e for e in experts if e.name == "model.layers.1.mlp.experts.2.gate_proj.weight")
    assert gate.note == ("BF16 fallback: model.layers.1.mlp.experts: model.layers.1.mlp.experts.0.down_proj.weight: "
                         "mxfp8 needs K (in_features, last dim) divisible by 32; got K=80")
    assert {f"model.layers.{i}.mlp.experts" for i in range(4)} <= set(plan.ignored_layers)
    assert {e.serializer for e in plan.entries if e.kind == "attention"} == {"mxfp8"}


def test_an_experts_fallback_next_to_a_strict_rule_names_both():
    from plan_cases import small_moe

    cfg, tensors = small_moe({"moe_intermediate_size": 80})
    rules = [{"select": "experts", "include": ["*.down_proj.weight"], "serializer": "mxfp8", "on_unsupported": "bf16"},
             {"select": "experts", "serializer": "mxfp8"}]
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.experts: model\.layers\.0\.mlp\.experts\.0\.down_proj"
                                        r"\.weight falls back to BF16 \(mxfp8 needs K .*got K=80\), but rules\[1\] "
                                        r"quantizes the rest of the module the engine loads as one"):
        RefitDriver({"rules": rules}, hf_config=cfg).plan(tensors)


def test_a_config_whose_every_match_fell_back_says_so():
    from plan_cases import small_moe

    cfg, tensors = small_moe({"moe_intermediate_size": 80})
    with pytest.raises(PlanError, match=r"rules\[0\] \(experts -> mxfp8\) matched 48 tensors, all kept BF16 by "
                                        r"on_unsupported: bf16 \(model\.layers\.0\.mlp\.experts\.0\."
                                        r"down_proj\.weight: mxfp8 needs K"):
        RefitDriver({"rules": [{"select": "experts", "serializer": "mxfp8", "on_unsupported": "bf16"}]},
                    hf_config=cfg).plan(tensors)
