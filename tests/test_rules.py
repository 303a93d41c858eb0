"""qstrat.rules: which serializer each tensor gets and why (keep_bf16, the rules in order with
their selectors and include/exclude patterns, the default, special kinds only by explicit rule)."""
from __future__ import annotations

import pytest
import torch

import qstrat
from qstrat import RefitDriver

from plan_cases import by_name, small_moe


def test_routers_embeddings_lm_head_need_explicit_rules():
    cfg, tensors = small_moe()
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
    cfg, tensors = small_moe()
    rules = {"rules": [{"select": "linear", "include": ["re:layers\\.[12]\\."],
                        "exclude": ["*.o_proj.weight"], "serializer": "block_fp8"}]}
    e = by_name(RefitDriver(rules, hf_config=cfg).plan(tensors))
    assert e["model.layers.1.self_attn.q_proj.weight"].serializer == "block_fp8"
    assert e["model.layers.1.self_attn.o_proj.weight"].serializer == "bf16"
    assert e["model.layers.3.self_attn.q_proj.weight"].serializer == "bf16"


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
    cfg, tensors = small_moe()
    rule = {"select": "attention", "include": ["*layers.1.*"], "allow_special": True, "serializer": "block_fp8"}
    e = by_name(RefitDriver({"rules": [rule]}, hf_config=cfg).plan(tensors))
    assert e["model.layers.1.mlp.gate.weight"].serializer == "block_fp8"            # opted in
    assert e["model.layers.1.self_attn.q_proj.weight"].serializer == "block_fp8"
    assert e["model.layers.1.mlp.experts.0.up_proj.weight"].serializer == "bf16"    # not selected
    assert e["model.layers.2.mlp.gate.weight"].serializer == "passthrough"


def test_non_special_selector_never_matches_routers():
    from qstrat.hookspecs import hookimpl
    from qstrat.selectors import Selector

    class Greedy:
        @hookimpl
        def qstrat_selectors(self):
            return [Selector("everything", "matches any name", lambda p: True)]

    reg = qstrat.Registry(plugins=[Greedy()])
    driver = qstrat.RefitDriver({"rules": [{"select": "everything", "serializer": "block_fp8"}]},
                                hf_config={"model_type": "qwen3_moe", "num_hidden_layers": 1}, registry=reg)
    t = {"model.layers.0.mlp.gate.weight": torch.empty(8, 256, device="meta"),
         "model.layers.0.self_attn.q_proj.weight": torch.empty(256, 256, device="meta")}
    decided = {e.name: e.serializer for e in driver.plan(t).entries}
    assert decided == {"model.layers.0.mlp.gate.weight": "passthrough",
                       "model.layers.0.self_attn.q_proj.weight": "block_fp8"}
