"""Planner checks of routed-expert inputs and tensor ranks (qstrat.plan.checks), no engine:
a trainer's per-expert tensors or grouped slabs that would reach an engine half-loaded or with
disagreeing sizes are refused at plan time, naming the tensor."""
from __future__ import annotations

import pytest
import torch

from qstrat import PlanError, RefitDriver
from qstrat.plugins.builtin.layouts import QWEN3_MOE
from qstrat.layouts.skeleton import model_tensors

from conftest import model_config
from plan_cases import small_moe

E, H, I = 4, 256, 128
CFG = {**model_config("qwen3-235b-a22b"), "num_hidden_layers": 2, "num_experts": E, "hidden_size": H,
       "moe_intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "vocab_size": 512}
EXPERTS = "model.layers.1.mlp.experts"


def meta(shape):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta")


def tensors(grouped: bool) -> dict[str, torch.Tensor]:
    return {n: meta(s) for n, s in model_tensors(QWEN3_MOE, CFG, grouped)}


def plan_error(state, cfg=CFG) -> str:
    with pytest.raises(PlanError) as exc:
        RefitDriver("block-fp8", hf_config=cfg).plan(state)
    return str(exc.value)


@pytest.mark.parametrize("grouped", [False, True])
def test_complete_inputs_plan(grouped):
    RefitDriver("block-fp8", hf_config=CFG).plan(tensors(grouped))


def test_one_experts_projection_missing():
    state = tensors(False)
    del state[f"{EXPERTS}.3.up_proj.weight"]
    assert f"{EXPERTS}: expert(s) [3] have no up_proj (each expert needs down_proj, gate_proj, " \
           "up_proj)" in plan_error(state)


def test_a_whole_expert_missing_with_and_without_the_expert_count():
    state = tensors(False)
    for p in ("gate_proj", "up_proj", "down_proj"):
        del state[f"{EXPERTS}.2.{p}.weight"]
    assert f"{EXPERTS}: expert(s) [2] have no down_proj, gate_proj, up_proj" in plan_error(state)
    # Without num_experts in the config, the layer's own projections must still agree.
    no_count = {k: v for k, v in CFG.items() if k != "num_experts"}
    del state[f"{EXPERTS}.1.down_proj.weight"]
    state[f"{EXPERTS}.2.gate_proj.weight"] = meta((I, H))
    msg = plan_error(state, no_count)
    assert f"{EXPERTS}: expert(s) [1] have no down_proj" in msg
    assert f"{EXPERTS}: expert(s) [2] have no down_proj, up_proj" in msg


def test_expert_index_out_of_range():
    state = tensors(False)
    for p, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        state[f"{EXPERTS}.{E}.{p}.weight"] = meta(shape)
    msg = plan_error(state)
    assert f"{EXPERTS}.4.gate_proj.weight: expert index 4 is out of range: the model config has 4 " \
           "experts per layer (0..3)" in msg
    assert msg.count("out of range") == 3


def test_down_proj_slab_intermediate_disagrees_with_gate_up():
    state = tensors(True)
    state[f"{EXPERTS}.down_proj"] = meta((E, H, 64))
    assert f"{EXPERTS}.gate_up_proj: gate_proj is [{I}, {H}] per expert but down_proj is [{H}, 64] " \
           f"(from {EXPERTS}.down_proj): the intermediate or hidden sizes disagree" in plan_error(state)


def test_one_experts_matrix_disagrees_with_the_others():
    state = tensors(False)
    state[f"{EXPERTS}.2.down_proj.weight"] = meta((H, 64))
    assert f"{EXPERTS}.2.down_proj.weight: shape [{H}, 64] differs from {EXPERTS}.0.down_proj.weight " \
           f"[{H}, {I}]" in plan_error(state)


def test_slabs_of_one_layer_disagree_on_the_expert_count():
    state = tensors(True)
    state[f"{EXPERTS}.down_proj"] = meta((E - 1, H, I))
    msg = plan_error(state, {k: v for k, v in CFG.items() if k != "num_experts"})
    assert f"{EXPERTS}.gate_up_proj: holds 4 experts but {EXPERTS}.down_proj holds 3" in msg


def test_odd_slab_rows_are_refused_in_fused_emission_too():
    state = tensors(True)
    state[f"{EXPERTS}.gate_up_proj"] = meta((E, 2 * I + 1, H))
    with pytest.raises(PlanError, match=r"gate_up_proj: 257 rows do not split into 2 projections"):
        RefitDriver({"preset": "block-fp8", "expert_emission": "fused"}, hf_config=CFG).plan(state)


def test_a_3d_tensor_where_a_matrix_belongs():
    state = tensors(False)
    state["model.layers.0.self_attn.o_proj.weight"] = meta((1, H, 256))
    state[f"{EXPERTS}.0.gate_proj.weight"] = meta((1, I, H))
    msg = plan_error(state)
    assert "model.layers.0.self_attn.o_proj.weight: a projection weight is a matrix [N, K] " \
           "(out_features, in_features), got shape [1, 256, 256]" in msg
    assert f"{EXPERTS}.0.gate_proj.weight: a projection weight is a matrix" in msg


def test_a_flattened_slab():
    state = tensors(True)
    state[f"{EXPERTS}.gate_up_proj"] = meta((E * 2 * I, H))
    assert f"{EXPERTS}.gate_up_proj: a grouped expert slab is [E, rows, K], got shape [1024, 256]" \
        in plan_error(state)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod."])
def test_per_expert_names_under_a_wrapper_prefix_plan_like_plain_ones(prefix):
    """DDP (module.) and torch.compile (_orig_mod.) prefixes on per-expert names: the same plan
    as the plain names (the expert checks once cut the projection out at the wrong offset and
    refused every expert with 'shape differs'), and a real mismatch is still refused."""
    plain = RefitDriver("block-fp8", hf_config=CFG).plan(tensors(False))
    wrapped = RefitDriver("block-fp8", hf_config=CFG).plan({prefix + n: t for n, t in tensors(False).items()})
    assert [(o.name, o.shape, o.dtype) for o in wrapped.outputs()] == \
           [(o.name, o.shape, o.dtype) for o in plain.outputs()]
    state = {prefix + n: t for n, t in tensors(False).items()}
    state[f"{prefix}{EXPERTS}.2.up_proj.weight"] = meta((I + 16, H))
    assert f"{prefix}{EXPERTS}.2.up_proj.weight: shape [{I + 16}, {H}] differs from " in plan_error(state)


def test_half_quantized_fused_module_is_a_plan_error():
    """One expert quantized, the others BF16 (an include pattern). A BF16 fallback of one
    projection takes the whole experts module instead (test_planner.py, issue 36 item 11)."""
    cfg, tensors = small_moe()
    with pytest.raises(PlanError, match=r"model\.layers\.\d\.mlp\.experts: some of its tensors are quantized"):
        RefitDriver({"rules": [{"select": "experts", "include": ["*.experts.0.*"], "serializer": "mxfp8"}]},
                    hf_config=cfg).plan(tensors)


def test_fused_shards_with_different_formats_are_a_plan_error():
    cfg, tensors = small_moe()
    bad = {"rules": [{"select": "attention", "exclude": ["*.k_proj.weight"], "serializer": "block_fp8"}]}
    with pytest.raises(PlanError, match=r"k_proj\.weight .* are fused by the engine but planned differently"):
        RefitDriver(bad, hf_config=cfg).plan(tensors)


def test_duplicate_outputs_per_expert_and_slab_are_a_plan_error():
    cfg, tensors = small_moe()
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.empty(4, 256, 256, device="meta")
    with pytest.raises(PlanError, match="both emit model.layers.0.mlp.experts.0.gate_proj.weight"):
        RefitDriver("block-fp8", hf_config=cfg).plan(tensors)


def test_slab_and_per_expert_inputs_for_one_layer_are_refused_in_any_emission():
    cfg, tensors = small_moe()
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.empty(4, 256, 256, device="meta")
    for emission in ("per_expert", "fused"):
        with pytest.raises(PlanError, match="given both as grouped slabs and as per-expert tensors"):
            RefitDriver({"preset": "block-fp8", "expert_emission": emission}, hf_config=cfg).plan(tensors)


def test_slab_expert_count_must_match_config():
    cfg, _ = small_moe()
    t = {"model.layers.0.mlp.experts.down_proj": torch.empty(3, 256, 128, device="meta")}
    with pytest.raises(PlanError, match="slab holds 3 experts, the model config says 4"):
        RefitDriver("block-fp8", hf_config=cfg).plan(t)


def test_fused_group_mismatch_shows_options():
    cfg, tensors = small_moe()
    rules = {"rules": [{"select": "attention", "include": ["*.k_proj.weight"], "serializer": "block_fp8",
                        "options": {"ue8m0": True}}, {"select": "attention", "serializer": "block_fp8"}]}
    with pytest.raises(PlanError, match=r"'ue8m0': True"):
        RefitDriver(rules, hf_config=cfg).plan(tensors)


def entries(driver, shapes):
    """Plan entries of ``{name: shape}`` (bf16), one by one: no whole-plan check runs."""
    return [driver.planner.entry(n, s, torch.bfloat16, CFG["num_hidden_layers"]) for n, s in shapes.items()]


def test_check_ranks_allows_slab_biases_and_convolutions_only():
    from qstrat.plan import checks

    driver = RefitDriver("bf16", hf_config=CFG)
    es = entries(driver, {
        f"{EXPERTS}.gate_up_proj": (E, 2 * I, H), f"{EXPERTS}.gate_up_proj_bias": (E, 2 * I),
        "model.layers.1.self_attn.q_proj.weight": (256, 256), "model.layers.1.self_attn.q_proj.bias": (256,),
        "model.layers.1.self_attn.conv1d.weight": (256, 1, 4),
        "model.layers.1.self_attn.k_proj.weight": (2, 128, 256), f"{EXPERTS}.down_proj": (E * H, I)})
    assert checks.check_ranks(es) == [
        "model.layers.1.self_attn.k_proj.weight: a projection weight is a matrix [N, K] (out_features, "
        "in_features), got shape [2, 128, 256]",
        f"{EXPERTS}.down_proj: a grouped expert slab is [E, rows, K], got shape [{E * H}, {I}]"]


def test_check_groups_and_check_outputs_return_one_line_per_problem():
    from qstrat.plan import checks

    plain = RefitDriver("block-fp8", hf_config=CFG)
    ue8m0 = RefitDriver({"rules": [{"select": "attention", "serializer": "block_fp8", "options": {"ue8m0": True}}]},
                        hf_config=CFG)
    q, k = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    es = entries(plain, {q: (256, 256)}) + entries(ue8m0, {k: (128, 256)})
    assert es[0].group == es[1].group == "model.layers.1.self_attn.{q_proj,k_proj,v_proj}"
    assert checks.check_groups(es) == [
        f"{k} (block_fp8 {{'ue8m0': True}}, rules[0]) and {q} (block_fp8 {{}}, rules[0]) are fused by the "
        "engine but planned differently"]
    assert checks.check_groups(entries(plain, {q: (256, 256), k: (128, 256)})) == []
    assert checks.check_outputs(es) == []
    assert checks.check_outputs(es + es[:1]) == [f"{q} and {q} both emit {q}", f"{q} and {q} both emit {q}_scale_inv"]


@pytest.mark.parametrize("options", [{"ue8m0": False}, {"backend": "torch"}, {"chunk_elements": 4096}])
def test_fused_siblings_whose_options_mean_the_same_bytes_plan_together(options):
    """q_proj with options that change no byte next to k/v without: the old check compared the
    options as written and refused them as "planned differently"."""
    cfg, tensors = small_moe()
    rules = [{"select": "attention", "include": ["*.q_proj.weight"], "serializer": "block_fp8", "options": options},
             {"select": "attention", "serializer": "block_fp8"}]
    plan = RefitDriver({"rules": rules}, hf_config=cfg).plan(tensors)
    q = next(e for e in plan.entries if e.name == "model.layers.0.self_attn.q_proj.weight")
    assert (q.serializer, q.options, q.rule) == ("block_fp8", options, "rules[0]")


def test_fused_siblings_whose_options_change_the_bytes_are_still_refused():
    cfg, tensors = small_moe()
    rules = [{"select": "attention", "include": ["*.q_proj.weight"], "serializer": "block_fp8",
              "options": {"ue8m0": True}}, {"select": "attention", "serializer": "block_fp8"}]
    with pytest.raises(PlanError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight \(block_fp8 \{'ue8m0': True\}, "
                                        r"rules\[0\]\) and model\.layers\.0\.self_attn\.k_proj\.weight \(block_fp8 \{\}, "
                                        r"rules\[1\]\) are fused by the engine but planned differently"):
        RefitDriver({"rules": rules}, hf_config=cfg).plan(tensors)
