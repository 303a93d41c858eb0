"""qstrat.config.rules: which serializer each tensor gets and why (keep_bf16, the rules in order with
their selectors and include/exclude patterns, the default, special kinds only by explicit rule)."""
from __future__ import annotations

import pytest
import torch

import qstrat
from qstrat import RefitDriver, load_config
from qstrat.plugins.builtin.layouts import QWEN3_MOE
from qstrat.plugins.registry import get_registry
from qstrat.config.rules import PASSTHROUGH, RuleSet, is_weight_matrix, kept_bf16

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
    from qstrat.plugins.selector import Selector

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


def rule_set(config) -> RuleSet:
    return RuleSet(load_config(config), get_registry())


def decided(rules: RuleSet, name: str, matrix: bool = True, num_layers: int | None = 8):
    d = rules.decide(QWEN3_MOE.parse(name, num_layers), matrix, num_layers)
    return d.serializer, d.options, d.rule


def test_decide_in_the_documented_order():
    """not a matrix, then keep_bf16, then the rules in order (first match wins), then default
    for quantizable kinds and passthrough for the rest."""
    rules = rule_set({"keep_bf16": {"first": 1, "last": 2}, "default": "mxfp8",
                      "rules": [{"select": "attention", "exclude": ["*.o_proj.weight"], "serializer": "block_fp8",
                                 "options": {"ue8m0": True}},
                                {"select": ["attention", "experts"], "serializer": "nvfp4"}]})
    assert decided(rules, "model.layers.3.self_attn.q_proj.weight", matrix=False) == \
        (PASSTHROUGH, {}, "not a weight matrix")
    assert decided(rules, "model.layers.0.self_attn.q_proj.weight") == ("bf16", {}, "keep_bf16.first")
    assert decided(rules, "model.layers.6.mlp.experts.1.up_proj.weight") == ("bf16", {}, "keep_bf16.last")
    assert decided(rules, "model.layers.5.mlp.experts.1.up_proj.weight") == ("nvfp4", {}, "rules[1]")
    assert decided(rules, "model.layers.3.self_attn.q_proj.weight") == ("block_fp8", {"ue8m0": True}, "rules[0]")
    assert decided(rules, "model.layers.3.self_attn.o_proj.weight") == ("nvfp4", {}, "rules[1]")  # excluded from [0]
    assert decided(rules, "model.layers.3.mlp.shared_expert.up_proj.weight") == ("mxfp8", {}, "default")
    assert decided(rules, "model.layers.3.mlp.gate.weight") == (PASSTHROUGH, {}, "never quantized: router")
    assert decided(rules, "model.layers.0.mlp.gate.weight") == (PASSTHROUGH, {}, "never quantized: router")
    assert decided(rules, "lm_head.weight") == (PASSTHROUGH, {}, "never quantized: lm_head")
    d = rules.decide(QWEN3_MOE.parse("model.layers.3.self_attn.k_proj.weight", 8), True, 8)
    assert (d.parsed.kind, d.parsed.layer, d.parsed.projection) == ("attention", 3, "k_proj")


def test_a_decisions_options_are_a_copy_of_the_rules():
    rules = rule_set({"rules": [{"serializer": "block_fp8", "options": {"ue8m0": True}}]})
    first = rules.decide(QWEN3_MOE.parse("model.layers.1.self_attn.q_proj.weight"), True, 4)
    first.options["ue8m0"] = False
    assert decided(rules, "model.layers.1.self_attn.q_proj.weight") == ("block_fp8", {"ue8m0": True}, "rules[0]")


def test_rule_for_finds_only_config_rules():
    rules = rule_set({"rules": [{"select": "attention", "serializer": "mxfp8", "on_unsupported": "bf16"}]})
    assert rules.rule_for("rules[0]").on_unsupported == "bf16"
    assert rules.rule_for("rules[1]") is None and rules.rule_for("default") is None


@pytest.mark.parametrize("layer,num_layers,first,last,kept", [
    (0, 8, 1, 0, True), (1, 8, 1, 0, False), (7, 8, 0, 1, True), (6, 8, 0, 1, False), (6, 8, 0, 2, True),
    (7, None, 0, 1, False),  # depth unknown: last keeps nothing (the planner refuses keep_bf16.last then)
    (3, 8, 0, 0, False),
])
def test_kept_bf16_counts_decoder_layers_from_both_ends(layer, num_layers, first, last, kept):
    p = QWEN3_MOE.parse(f"model.layers.{layer}.self_attn.q_proj.weight", num_layers)
    assert kept_bf16(p, num_layers, first, last) is kept


def test_kept_bf16_never_keeps_mtp_or_non_decoder_tensors():
    from qstrat.plugins.builtin.layouts import DEEPSEEK_V3

    mtp = DEEPSEEK_V3.parse("model.layers.61.mlp.experts.0.up_proj.weight", 61)
    assert mtp.kind == "mtp" and kept_bf16(mtp, 61, 0, 1) is False
    assert kept_bf16(QWEN3_MOE.parse("lm_head.weight", 8), 8, 8, 8) is False


def test_is_weight_matrix_is_a_2d_weight_or_a_3d_slab():
    q = QWEN3_MOE.parse("model.layers.0.self_attn.q_proj.weight")
    bias = QWEN3_MOE.parse("model.layers.0.self_attn.q_proj.bias")
    slab = QWEN3_MOE.parse("model.layers.0.mlp.experts.gate_up_proj")
    assert [is_weight_matrix(q, 2), is_weight_matrix(q, 1), is_weight_matrix(q, 3)] == [True, False, False]
    assert [is_weight_matrix(bias, 2), is_weight_matrix(slab, 3), is_weight_matrix(slab, 2)] == [False, True, False]


# ---- one name form for patterns, whatever wraps the model (issue 36, item 1) ------------------
def _wrapped(sd: dict, wrap: str) -> dict:
    """``sd`` as a wrapped model's state dict names it: a prefix (``_orig_mod.``, ``module.``) or,
    for FSDP1 with activation checkpointing, modules inserted inside every decoder layer."""
    if wrap == "fsdp":
        return {_fsdp_name(k): v for k, v in sd.items()}
    return {wrap + k: v for k, v in sd.items()}


def _fsdp_name(name: str) -> str:
    """FSDP1 + activation checkpointing per decoder layer: ``_fsdp_wrapped_module.`` at the root
    and ``_fsdp_wrapped_module._checkpoint_wrapped_module.`` after each layer index (what
    ``named_parameters()`` gives outside ``summon_full_params``)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit():
        parts[3:3] = ["_fsdp_wrapped_module", "_checkpoint_wrapped_module"]
    return "_fsdp_wrapped_module." + ".".join(parts)


@pytest.mark.parametrize("wrap", ["_orig_mod.", "module.", "module._orig_mod.", "fsdp"])
@pytest.mark.parametrize("family, pattern", [("llama", "model.layers.0.*"),
                                             ("mixtral", "*.block_sparse_moe.*")])
def test_include_patterns_match_the_checkpoint_name_whatever_wraps_the_model(family, pattern, wrap):
    """A layer-0 include (Llama) and Mixtral's checkpoint block name (transformers 5 calls it
    ``mlp.`` in the trainer) plan a wrapped model exactly as the bare one: same decisions per
    checkpoint name, same ignore list (the old code matched the raw key: 8 vs 1 ignored)."""
    from model_families import config_dict, hf_config, hf_state_dict

    sd, cfg = hf_state_dict(family), config_dict(hf_config(family))
    config = {"preset": "block-fp8", "rules": [{"select": "linear", "include": [pattern], "serializer": "bf16"}]}
    bare = RefitDriver(config, hf_config=cfg).plan(sd)
    wrapped = RefitDriver(config, hf_config=cfg).plan(_wrapped(sd, wrap))
    assert wrapped.ignored_layers == bare.ignored_layers
    kept = {o.name for e in bare.entries if e.rule == "rules[0]" for o in e.outputs}
    assert kept and kept == {o.name for e in wrapped.entries if e.rule == "rules[0]" for o in e.outputs}
    assert [(o.name, o.dtype) for o in wrapped.outputs()] == [(o.name, o.dtype) for o in bare.outputs()]


def test_checkpoint_name_removes_wrapper_modules_anywhere():
    from qstrat.plugins.builtin.layouts import MIXTRAL

    name = "_fsdp_wrapped_module.model.layers.3._orig_mod._checkpoint_wrapped_module.mlp.gate.weight"
    assert MIXTRAL.checkpoint_name(name) == "model.layers.3.block_sparse_moe.gate.weight"
    p = MIXTRAL.parse(name)
    assert (p.kind, p.layer, p.name, p.checkpoint_name) == ("router", 3, name, MIXTRAL.checkpoint_name(name))


# ---- keep_bf16 wins over routers / allow_special rules (issue 36, item 5) ---------------------
@pytest.mark.parametrize("rule", [
    {"select": ["linear", "routers"], "serializer": "block_fp8"},
    {"select": "attention", "include": ["*"], "allow_special": True, "serializer": "block_fp8"}])
def test_keep_bf16_layers_hold_no_quantized_tensor_whatever_the_rules_say(rule):
    cfg, tensors = small_moe()
    plan = RefitDriver({"rules": [rule], "keep_bf16": {"first": 1}}, hf_config=cfg).plan(tensors)
    e = by_name(plan)
    router = e["model.layers.0.mlp.gate.weight"]
    assert (router.serializer, router.rule) == (PASSTHROUGH, "keep_bf16.first")  # old code: block_fp8
    assert "model.layers.0.mlp.gate" in plan.ignored_layers
    assert not [n for n, x in e.items() if x.layer == 0 and x.serializer == "block_fp8"]
    assert e["model.layers.1.mlp.gate.weight"].serializer == "block_fp8"  # the rule still applies past it


# ---- a grouped slab is matched by the per-expert names it stands for ---------------------------
@pytest.mark.parametrize("include", [
    ["*.layers.1.mlp.experts.*.gate_proj.weight", "*.layers.1.mlp.experts.*.up_proj.weight",
     "*.layers.1.mlp.experts.*.down_proj.weight"],
    ["re:layers\\.1\\.mlp\\.experts\\.\\d+\\."],
    ["*.layers.1.mlp.experts.*"],
])
def test_patterns_decide_grouped_slabs_as_the_same_experts_held_per_expert(tiny_model, tiny_hf_config, include):
    """Patterns written on the per-expert checkpoint names (what vLLM loads) matched nothing on
    transformers 5's grouped slabs: the old plan quantized layer 1's experts from slabs and kept
    them BF16 from the same weights held per expert - silently, for one config and one model."""
    from conftest import per_expert_view

    config = {"preset": "mxfp8-experts", "rules": [{"select": "experts", "include": include, "serializer": "bf16"}]}
    slabs = tiny_model.state_dict()
    decided = []
    for tensors in (slabs, per_expert_view(slabs)):
        plan = RefitDriver(config, hf_config=tiny_hf_config).plan(tensors)
        decided.append(sorted({(e.layer, e.serializer, e.rule) for e in plan.entries if e.kind == "expert"}))
    assert decided[0] == decided[1] == [(0, "mxfp8", "rules[1]"), (1, "bf16", "rules[0]"),
                                        (2, "mxfp8", "rules[1]"), (3, "mxfp8", "rules[1]")]


def test_patterns_that_would_split_a_grouped_slab_are_a_plan_error_naming_the_rule(tiny_model, tiny_hf_config):
    config = {"preset": "mxfp8-experts", "rules": [{"select": "experts", "include": ["*.experts.3.*"],
                                                     "serializer": "bf16"}]}
    with pytest.raises(qstrat.PlanError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: rules\[0\]: its include/"
                                               r"exclude patterns match some of this grouped slab's per-expert names "
                                               r"\(model\.layers\.0\.mlp\.experts\.3\.gate_proj\.weight\) and not others "
                                               r"\(model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight\)"):
        RefitDriver(config, hf_config=tiny_hf_config).plan(tiny_model.state_dict())
