"""qstrat.plan.structure: a plan never guesses about a model it does not understand (layers past
the config's depth, weight matrices the layout cannot place, a config that quantizes nothing).
Through the planner: tests/test_model_families.py (unplaced matrices, another family's layout, a
config that quantizes nothing)."""
from __future__ import annotations

import pytest

from qstrat import PlanError, RefitDriver
from qstrat.plan import structure


def test_layers_past_the_configs_depth_are_an_error_not_mtp(tiny_model, tiny_hf_config):
    """num_hidden_layers too small for the tensors given (an adversarial case: layers 2-3 were
    taken for MTP layers and passed through in BF16 silently)."""
    with pytest.raises(PlanError, match=r"tensors are in layers past the model config's 2 decoder layers "
                                        r"\(it has no MTP layers\): model\.layers\.2\."):
        RefitDriver("block-fp8", hf_config={**tiny_hf_config, "num_hidden_layers": 2}).plan(tiny_model.state_dict())


def entries(driver, shapes, num_layers=None):
    """Plan entries of ``{name: shape}`` (bf16), one by one: no whole-plan check runs."""
    import torch

    return [driver.planner.entry(n, s, torch.bfloat16, num_layers) for n, s in shapes.items()]


QWEN = {"model_type": "qwen3_moe", "num_hidden_layers": 2}


def test_layers_past_the_model_names_them_and_counts_mtp_layers():
    driver = RefitDriver("block-fp8", hf_config=QWEN)
    es = entries(driver, {"model.layers.1.self_attn.q_proj.weight": (128, 128),
                          "model.layers.2.self_attn.q_proj.weight": (128, 128),
                          "model.layers.3.input_layernorm.weight": (128,)}, num_layers=2)
    assert structure.layers_past_the_model(es, None, 0) == []  # depth unknown: nothing checked
    assert structure.layers_past_the_model(es, 2, 2) == []     # layers 2-3 are the MTP layers
    assert structure.layers_past_the_model(es, 2, 1) == [
        "1 tensors are in layers past the model config's 2 decoder layers and 1 MTP layers: "
        "model.layers.3.input_layernorm.weight (is num_hidden_layers right, and are these this model's tensors?)"]


def test_unplaced_matrices_lists_eight_names_then_counts():
    driver = RefitDriver("block-fp8", hf_config=QWEN)
    shapes = {f"model.layers.0.mlp.foo{i}.weight": (128, 128) for i in range(10)}
    shapes["model.layers.0.mlp.foo_bias"] = (128,)  # one dim: not a matrix, never listed
    es = entries(driver, shapes)
    assert [e.kind for e in es] == ["other"] * 11
    listed = ", ".join(f"model.layers.0.mlp.foo{i}.weight" for i in range(8))
    assert structure.unplaced_matrices(es, "qwen3_moe", driver.config) == [
        f"layout 'qwen3_moe' cannot place 10 weight matrices: {listed} ... and 2 more (choose the right "
        "layout with 'layout:', add one for this model, or set 'unplaced_weights: bf16' to send them "
        "unchanged and unquantized)"]
    bf16 = RefitDriver({"preset": "block-fp8", "unplaced_weights": "bf16"}, hf_config=QWEN)
    assert structure.unplaced_matrices(es, "qwen3_moe", bf16.config) == []


def test_quantizes_nothing_names_the_rules_and_what_the_layout_sees():
    driver = RefitDriver("mxfp8-experts", hf_config=QWEN)
    es = entries(driver, {"model.layers.0.self_attn.q_proj.weight": (128, 128),
                          "model.layers.0.mlp.gate_proj.weight": (128, 128),
                          "model.norm.weight": (128,)})
    quantizing = lambda name: name != "bf16"  # noqa: E731
    assert structure.quantizes_nothing(es, "qwen3_moe", driver.config, quantizing) == [
        "the config quantizes nothing in this model: rules[0] (experts -> mxfp8) matched no tensor; "
        "layout 'qwen3_moe' sees attention: 1, dense_mlp: 1; these rules come from preset 'mxfp8-experts': "
        "choose a preset or write rules for the kinds this model has ('qstrat list' shows the presets and selectors)"]
    kept = RefitDriver({"preset": "block-fp8", "keep_bf16": {"first": 1}}, hf_config=QWEN)
    es = entries(kept, {"model.layers.0.self_attn.q_proj.weight": (128, 128)}, num_layers=2)
    assert structure.quantizes_nothing(es, "qwen3_moe", kept.config, quantizing) == [
        "the config quantizes nothing in this model: rules[0] (linear -> block_fp8) decided nothing: keep_bf16 "
        "(first: 1, last: 0) keeps 1 matrices BF16 and the rest matched no rule; layout 'qwen3_moe' sees "
        "attention: 1; these rules come from preset 'block-fp8': choose a preset or write rules for the kinds "
        "this model has ('qstrat list' shows the presets and selectors)"]
    plain = RefitDriver("block-fp8", hf_config=QWEN)
    assert structure.quantizes_nothing(entries(plain, {"model.layers.0.self_attn.q_proj.weight": (128, 128)}),
                                       "qwen3_moe", plain.config, quantizing) == []
    assert structure.quantizes_nothing(es, "qwen3_moe", RefitDriver("bf16").config, quantizing) == []


def test_a_peft_wrapped_models_names_are_refused_with_the_merge_not_unplaced_weights_bf16():
    """The old message told a PeftModel's user to set 'unplaced_weights: bf16', which would send
    'base_model.model....base_layer.weight' and LoRA matrices that no engine loads."""
    import peft
    import torch
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                   num_hidden_layers=1, vocab_size=128)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(PlanError, match=r"layout 'llama' cannot place \d+ weight matrices: base_model\.model\..* - PEFT "
                                        r"names .*merge the adapters and pass the merged model's state dict"):
        RefitDriver("mxfp8", hf_config=cfg.to_dict()).plan(model.state_dict())
    merged = model.merge_and_unload()
    assert RefitDriver("mxfp8", hf_config=cfg.to_dict()).plan(merged.state_dict()).totals()["mxfp8"]
