"""qstrat.select: the trainer-side decisions for a module or a list of names."""
from __future__ import annotations

import qstrat


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
