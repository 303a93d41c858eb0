"""Shapes off the 128 grid at plan time (issue 19), no engine.

- What can be quantized per expert, is: a MoE whose hidden size is off the 128-row tile gets its
  down_proj slab cut per expert (each expert's tiles are its own); a slab whose gate/up halves are
  off a format's row tile is tiled per projection - the bytes of quantizing each expert's
  gate_proj and up_proj on their own (before the fix both were refused: "needs N rows per
  projection to be a multiple of the format's 128-row tile; use expert_emission: fused").
- What vLLM cannot load in a format is known at plan time (before the fix `qstrat quantize`
  wrote a block-FP8 checkpoint with q/k/v of [256, 64, 64] rows that vLLM failed to load:
  "start (5) + length (5) exceeds dimension size (9)"): refused naming the module, the rule vLLM
  applies and the fix, or kept BF16 and listed in the ignore list with ``on_unsupported: bf16``.
"""
from __future__ import annotations

import math

import pytest
import torch
from conftest import per_expert_view

from qstrat import PlanError, RefitDriver
from qstrat.plugins.builtin.layouts import QWEN3, QWEN3_MOE
from qstrat.hookspecs import hookimpl
from qstrat.plugins.registry import Registry
from qstrat.serializers.block_fp8 import BlockFP8
from qstrat.layouts.skeleton import model_tensors

DENSE = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2,
         "hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 64, "vocab_size": 1000, "tie_word_embeddings": False}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 2,
       "hidden_size": 192, "intermediate_size": 256, "moe_intermediate_size": 128, "num_experts": 4,
       "num_experts_per_tok": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
       "vocab_size": 1000, "tie_word_embeddings": False}
QKV0 = "model.layers.0.self_attn.{q_proj,k_proj,v_proj}"


def random_tensors(layout, cfg, grouped: bool) -> dict[str, torch.Tensor]:
    return {n: torch.randn(s, dtype=torch.bfloat16) for n, s in model_tensors(layout, cfg, grouped)}


def outputs(driver, tensors) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in driver.run(tensors)}


def assert_same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
        assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), n


def test_moe_hidden_size_off_the_tile_is_quantized_per_expert():
    """H = 192: down_proj [E, 192, 128] has a ragged last row tile per expert; each expert's
    tiles are its own, so the slab is cut per expert with the bytes of per-expert inputs."""
    slabs = random_tensors(QWEN3_MOE, MOE, grouped=True)
    driver = RefitDriver("block-fp8", hf_config=MOE)
    got = outputs(driver, slabs)
    assert got["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)
    want = outputs(driver, per_expert_view(slabs))
    assert_same_bytes(got, want)
    w = slabs["model.layers.1.mlp.experts.down_proj"][3]
    parts = BlockFP8().quantize(w)
    assert torch.equal(got["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"], parts["weight_scale_inv"])


class AnyFusion(BlockFP8):
    """Block FP8 for an engine that loads fused members of any size (a plugin format's rule)."""

    name = "block_fp8_any_fusion"

    def engine_fusion_problem(self, rows, experts):
        return None


class _Plugin:
    @hookimpl
    def qstrat_serializers(self):
        return [AnyFusion]


def test_slab_halves_off_the_row_tile_are_tiled_per_projection():
    """gate_up [E, 2*192, H]: a 128-row tile of the whole slab would straddle gate and up; tiled
    per projection (one serializer call on the slab viewed as [E*2, 192, H]), the bytes equal
    quantizing each expert's gate_proj and up_proj on their own."""
    cfg = {**MOE, "hidden_size": 256, "moe_intermediate_size": 192}
    slabs = random_tensors(QWEN3_MOE, cfg, grouped=True)
    driver = RefitDriver({"rules": [{"select": ["experts"], "serializer": "block_fp8_any_fusion"}]},
                         hf_config=cfg, registry=Registry(plugins=[_Plugin()]))
    got = outputs(driver, slabs)
    assert got["model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"].shape == (2, 2)
    assert_same_bytes(got, outputs(driver, per_expert_view(slabs)))
    up = slabs["model.layers.0.mlp.experts.gate_up_proj"][2, 192:]
    assert torch.equal(got["model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"],
                       AnyFusion().quantize(up)["weight_scale_inv"])


def plan_error(config, cfg) -> str:
    with pytest.raises(PlanError) as exc:
        RefitDriver(config, hf_config=cfg).plan({n: torch.empty(s, dtype=torch.bfloat16, device="meta")
                                                 for n, s in model_tensors(QWEN3 if cfg is DENSE else QWEN3_MOE,
                                                                           cfg, True)})
    return str(exc.value)


def test_block_fp8_qkv_off_the_tile_is_refused_with_vllms_rule():
    """64-wide heads, one KV head: q/k/v = [256, 64, 64] rows; k's tile would straddle k and v."""
    msg = plan_error("block-fp8", {**DENSE, "intermediate_size": 256})
    assert (f"{QKV0}: block_fp8 (rules[0]): vLLM fuses these members ([256, 64, 64] rows) into one module "
            "with 128-row scale tiles: every member but the last must be a multiple of 128 rows, or a tile "
            "straddles two members (vLLM's adjust_block_scale_shard: the engine fails to load it or reads "
            "the wrong scale); to keep it BF16: rules[0] is preset block-fp8's rule; to keep what it cannot "
            "represent BF16, add to your config (your rules go ahead of the preset's; from the command line: a YAML "
            "file with preset: block-fp8 and these rules, passed as --config FILE): rules: [{select: [linear], "
            "serializer: block_fp8, on_unsupported: bf16}]; formats that would serve it: mxfp8, nvfp4 "
            "[the same for 1 more: model.layers.*.self_attn.{q_proj,k_proj,v_proj}, layers 0-1]") in msg
    assert "gate_proj" not in msg  # the MLP's [256, 256] members tile exactly


def test_block_fp8_dense_gate_up_off_the_tile_is_refused():
    msg = plan_error("block-fp8", {**DENSE, "num_attention_heads": 2, "head_dim": 128, "intermediate_size": 320})
    assert ("model.layers.0.mlp.{gate_proj,up_proj}: block_fp8 (rules[0]): vLLM fuses these members "
            "([320, 320] rows)") in msg
    assert "self_attn" not in msg  # [256, 128, 128]: every member but the last tiles exactly


def test_block_fp8_moe_intermediate_off_the_tile_is_refused():
    msg = plan_error("block-fp8", {**MOE, "moe_intermediate_size": 96})
    assert msg.count("vLLM's fused-MoE block-FP8 layer needs the experts' intermediate size to be a multiple "
                     "of 128 (got 96; vLLM's validate_fp8_block_shape_moe refuses to start the engine)") == 1
    assert "model.layers.0.mlp.experts: block_fp8 (rules[0]):" in msg
    # 96 = 3 x 32: MXFP8 and NVFP4 serve it (the advice is computed, not "a format with per-row scales")
    assert msg.endswith("; formats that would serve it: mxfp8, nvfp4 [the same for 1 more: model.layers.*.mlp.experts, "
                        "layers 0-1]"), msg


@pytest.mark.parametrize("config,fix", [
    ("mxfp8-experts", "rules[0] is preset mxfp8-experts's rule; to keep what it cannot represent BF16, add to "
                      "your config (your rules go ahead of the preset's; from the command line: a YAML file with preset: "
                      "mxfp8-experts and these rules, passed as --config FILE): rules: [{select: [experts], serializer: "
                      "mxfp8, on_unsupported: bf16}]"),
    ({"rules": [{"select": "experts", "serializer": "nvfp4"}]}, "set on_unsupported: bf16 on rules[0]"),
])
def test_one_bad_expert_size_on_qwen3_235b_is_one_line_with_a_fix_that_plans(config, fix):
    """moe_intermediate_size 1480 (K of down_proj: off MXFP8's 32, NVFP4's 16 and block FP8's
    fused-MoE 128) refused on 128 experts x 94 layers of per-expert tensors: it printed 12,032
    lines (2 MB); now one line with the count, every format tried and why it refuses, and - since
    keeping those experts BF16 leaves the config quantizing nothing - a second line with the
    rules to write; written as printed, they plan."""
    import yaml
    from conftest import model_config

    cfg = {**model_config("qwen3-235b-a22b"), "moe_intermediate_size": 1480}
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(QWEN3_MOE, cfg)}
    with pytest.raises(PlanError) as err:
        RefitDriver(config, hf_config=cfg).plan(tensors)
    lines = str(err.value).splitlines()
    assert len(lines) == 3, lines[:4]
    fmt = "mxfp8" if config == "mxfp8-experts" else "nvfp4"
    other = ("nvfp4: nvfp4 needs K (in_features, last dim) divisible by 16; got K=1480" if fmt == "mxfp8"
             else "mxfp8: mxfp8 needs K (in_features, last dim) divisible by 32; got K=1480")
    assert lines[1] == (f"  model.layers.0.mlp.experts.0.down_proj.weight: {fmt} needs K (in_features, last dim) "
                        f"divisible by {32 if fmt == 'mxfp8' else 16}; got K=1480; no other format fits it either "
                        "(block_fp8: vLLM's fused-MoE block-FP8 layer needs the experts' intermediate size to be a "
                        "multiple of 128 (got 1480; vLLM's validate_fp8_block_shape_moe refuses to start the "
                        f"engine); {other}) (rule rules[0]; to fall back to BF16: {fix}) [the same for 12,031 more: "
                        "model.layers.*.mlp.experts.*.down_proj.weight, layers 0-93]")
    head = ("  kept BF16 (on_unsupported: bf16), the tensors whose shape rules[0] refused take the rest of their "
            "engine modules with them (the engine loads a layer's experts as one) and leave this config "
            "quantizing nothing: to serve this model quantized, ")
    assert lines[2].startswith(head) and lines[2].endswith("; or serve it unquantized: preset: bf16"), lines[2]
    advice = lines[2][len(head):-len("; or serve it unquantized: preset: bf16")]
    if config == "mxfp8-experts":  # the rules to write, as printed
        assert advice == ("add to your config (ahead of preset mxfp8-experts's rules): rules: [{select: [experts], "
                          "serializer: mxfp8, on_unsupported: bf16}, {select: [attention], serializer: mxfp8}]")
        fixed = {"preset": config, "rules": yaml.safe_load(advice.split("rules: ", 1)[1])}
    else:
        assert advice == ("set on_unsupported: bf16 on rules[0], and add this rule: "
                          "{select: [attention], serializer: nvfp4}")
        fixed = {"rules": [{**config["rules"][0], "on_unsupported": "bf16"},
                           yaml.safe_load(advice.split("add this rule: ", 1)[1])]}
    plan = RefitDriver(fixed, hf_config=cfg).plan(tensors)
    assert {e.serializer for e in plan.entries if e.kind == "expert"} == {"bf16"}
    assert {e.serializer for e in plan.entries if e.kind == "attention"} == {fmt}
    # the on_unsupported fix alone (what the first line says) quantizes nothing: that error says what works
    alone = {"preset": "mxfp8-experts", "rules": fixed["rules"][:1]} if fmt == "mxfp8" else {"rules": fixed["rules"][:1]}
    with pytest.raises(PlanError) as err:
        RefitDriver(alone, hf_config=cfg).plan(tensors)
    assert str(err.value).endswith(f"; to quantize something, add the rule {{select: [attention], serializer: {fmt}}} "
                                   "(every attention tensor fits it), or serve the model unquantized: preset: bf16")
    assert RefitDriver("bf16", hf_config=cfg).plan(tensors).totals()


def test_on_unsupported_bf16_keeps_the_fused_module_bf16_and_ignored():
    cfg = {**DENSE, "intermediate_size": 320}
    rules = {"rules": [{"select": ["attention", "dense_mlp"], "serializer": "block_fp8", "on_unsupported": "bf16"}]}
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(QWEN3, cfg)}
    plan = RefitDriver(rules, hf_config=cfg).plan(tensors)
    by_name = {e.name: e for e in plan.entries}
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        e = by_name[f"model.layers.1.{proj}.weight"]
        assert e.serializer == "bf16" and e.note.startswith("BF16 fallback: model.layers.1.") and \
            "must be a multiple of 128 rows" in e.note, proj
        assert [o.name for o in e.outputs] == [e.name] and e.outputs[0].dtype == "bfloat16"
    assert by_name["model.layers.1.self_attn.o_proj.weight"].serializer == "block_fp8"
    assert by_name["model.layers.1.mlp.down_proj.weight"].serializer == "block_fp8"
    ignored = plan.quantization_config["ignored_layers"]
    assert ignored == ["lm_head"] + [f"model.layers.{i}.{m}" for i in (0, 1) for m in (
        "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj")]


def test_on_unsupported_bf16_keeps_a_moe_layers_experts_bf16_whole():
    cfg = {**MOE, "moe_intermediate_size": 96}
    rules = {"rules": [{"select": ["experts"], "serializer": "block_fp8", "on_unsupported": "bf16"},
                       {"select": ["attention"], "serializer": "block_fp8"}]}
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(QWEN3_MOE, cfg, True)}
    plan = RefitDriver(rules, hf_config=cfg).plan(tensors)
    experts = [e for e in plan.entries if e.kind == "expert"]
    assert len(experts) == 4 and all(e.serializer == "bf16" and "validate_fp8_block_shape_moe" in e.note
                                     for e in experts)
    assert "model.layers.0.mlp.experts" in plan.quantization_config["ignored_layers"]
    down = next(e for e in experts if e.name == "model.layers.0.mlp.experts.down_proj")
    assert [o.name for o in down.outputs][:2] == ["model.layers.0.mlp.experts.0.down_proj.weight",
                                                  "model.layers.0.mlp.experts.1.down_proj.weight"]


def test_row_scaled_formats_load_any_fused_split():
    """MXFP8 and NVFP4 scale per row (1x32, 1x16 blocks): the same shapes plan without a fallback."""
    cfg = {**DENSE, "intermediate_size": 320}
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(QWEN3, cfg)}
    for fmt in ("mxfp8", "nvfp4"):
        plan = RefitDriver({"default": fmt}, hf_config=cfg).plan(tensors)
        assert {e.serializer for e in plan.entries if e.kind == "attention"} == {fmt}
        assert not any(e.note for e in plan.entries), fmt


# ---- the manifest's cross-check with vLLM's record: vocabulary padding ----------------------
def _record(manifest, pad: int, rows_seen: int):
    """vLLM's record as a CPU engine of this manifest's model holds it: every unit's elements,
    the embedding and lm_head rows padded to ``rows_seen``."""
    from qstrat.vllm.adapter.model_record import EngineModel

    layers = {}
    for u in manifest.units.values():
        if "{" in u.name:
            continue  # fused groups are recorded under vLLM's fused name
        n = {}
        for name in next(iter(u.forms.values())):
            t = manifest.tensors[name]
            count = rows_seen * t.shape[1] if u.kind in ("embedding", "lm_head") else math.prod(t.shape)
            n[t.dtype] = n.get(t.dtype, 0) + count
        layers[u.name] = n
    for u in manifest.units.values():
        if "{" in u.name:
            parent, _, members = u.name.partition(".{")
            fused = "qkv_proj" if "q_proj" in members else "gate_up_proj"
            n = {}
            for name in next(iter(u.forms.values())):
                t = manifest.tensors[name]
                n[t.dtype] = n.get(t.dtype, 0) + math.prod(t.shape)
            layers[f"{parent}.{fused}"] = n
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    return EngineModel(layers, packed, frozenset({"bias"}), 1, {"model.embed_tokens": pad, "lm_head": pad})


def test_cross_check_models_vllms_vocabulary_padding():
    """vocab 1000: vLLM records 1024 rows (padded to 64) where the checkpoint has 1000. Before
    the fix this was a disagreement, and every refit of such a model was refused."""
    from qstrat.vllm.checks.engine_manifest import build_manifest
    from qstrat.plugins.registry import get_registry
    from qstrat.vllm.adapter.model_record import cross_check

    manifest = build_manifest(DENSE, None, QWEN3, get_registry(), "bfloat16")
    assert cross_check(manifest, _record(manifest, 64, 1024)) == []
    # a record whose rows are not what padding to 64 gives is still a disagreement
    errors = cross_check(manifest, _record(manifest, 64, 1088))
    assert errors == [f"model.embed_tokens: the manifest has {{'bfloat16': {1024 * 256}}} elements per dtype, "
                      f"vLLM records {{'bfloat16': {1088 * 256}}}",
                      f"lm_head: the manifest has {{'bfloat16': {1024 * 256}}} elements per dtype, "
                      f"vLLM records {{'bfloat16': {1088 * 256}}}"]


# ---- tied embeddings -----------------------------------------------------------------------
TIED = {**DENSE, "tie_word_embeddings": True, "num_attention_heads": 2, "head_dim": 128, "intermediate_size": 256}


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "block_fp8"])
def test_a_tied_lm_head_without_a_tensor_is_in_the_ignore_list(fmt):
    """No lm_head input (as transformers saves a tied model): vLLM still builds lm_head with the
    checkpoint's quantization config, and ModelOpt formats quantize it unless ignored (before
    the fix the MXFP8 ignore list lacked it: a live refit then differed from a fresh engine,
    max |dlogprob| 5.3). With an lm_head input it is listed as before, once."""
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(QWEN3, TIED)}
    assert "lm_head.weight" not in tensors
    plan = RefitDriver({"default": fmt}, hf_config=TIED).plan(tensors)
    ignored = plan.quantization_config.get("ignore") or plan.quantization_config["ignored_layers"]
    assert ignored == ["lm_head"]
    tensors["lm_head.weight"] = torch.empty(1000, 256, dtype=torch.bfloat16, device="meta")
    plan = RefitDriver({"default": fmt}, hf_config=TIED).plan(tensors)
    assert (plan.quantization_config.get("ignore") or plan.quantization_config["ignored_layers"]) == ["lm_head"]


def test_cross_check_takes_a_tied_lm_head_as_the_embedding_and_refuses_a_quantized_one():
    """vLLM records a tied lm_head module (sharing the embedding's weight) that the manifest
    has no unit for: not unknown, but it must hold the embedding's elements exactly - a tied
    head built quantized (the MXFP8 scales [1024, 8] nothing loads) is refused."""
    from qstrat.vllm.checks.engine_manifest import build_manifest
    from qstrat.plugins.registry import get_registry
    from qstrat.vllm.adapter.model_record import EngineModel, cross_check

    qcfg = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["lm_head"]}
    manifest = build_manifest(TIED, qcfg, QWEN3, get_registry(), "bfloat16")
    assert "lm_head" not in manifest.units and "lm_head.weight" in manifest.dropped
    record = _record(manifest, 64, 1024)
    layers = {**record.layers, "lm_head": {"bfloat16": 1024 * 256}}
    ok = EngineModel(layers, record.packed, record.skipped, 1, record.vocab_padding)
    assert cross_check(manifest, ok) == []
    quantized = EngineModel({**layers, "lm_head": {"bfloat16": 1024 * 256, "uint8": 1024 * 8}}, record.packed,
                            record.skipped, 1, record.vocab_padding)
    assert cross_check(manifest, quantized) == [
        f"lm_head: tied to model.embed_tokens, it should hold the embedding's {{'bfloat16': {1024 * 256}}} elements "
        f"per dtype, vLLM records {{'bfloat16': {1024 * 256}, 'uint8': {1024 * 8}}} (the engine's "
        "quantization_config quantizes the tied lm_head: list it in its ignore list)"]


class _Prefix:
    """A stand-in for vLLM's ``WeightsMapper`` of a multimodal class (Qwen3.5's
    ``hf_to_vllm_mapper`` puts the language model under ``language_model.``): its public
    ``apply_list``, which qstrat's record calls."""

    def apply_list(self, names):
        return [f"language_model.{n}" for n in names]


def test_cross_check_finds_a_tied_lm_head_that_vllm_renames():
    """A tied lm_head under vLLM's renamed module (``language_model.lm_head``) is the tied head,
    not an unknown module (before the fix every refit of a tied Qwen3.5-MoE was refused: "vLLM's
    model has language_model.lm_head ... which the manifest does not know"), and a quantized one
    is still refused under vLLM's name."""
    from qstrat.vllm.checks.engine_manifest import build_manifest
    from qstrat.plugins.registry import get_registry
    from qstrat.vllm.adapter.model_record import EngineModel, cross_check

    qcfg = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["lm_head"]}
    manifest = build_manifest(TIED, qcfg, QWEN3, get_registry(), "bfloat16")
    record = _record(manifest, 64, 1024)
    rename = _Prefix().apply_list
    layers = {rename([k])[0]: v for k, v in record.layers.items()}
    pad = {rename([k])[0]: v for k, v in record.vocab_padding.items()}
    ok = EngineModel({**layers, "language_model.lm_head": {"bfloat16": 1024 * 256}}, record.packed,
                     record.skipped, 1, pad, _Prefix())
    assert cross_check(manifest, ok) == []
    quantized = EngineModel({**layers, "language_model.lm_head": {"bfloat16": 1024 * 256, "uint8": 1024 * 8}},
                            record.packed, record.skipped, 1, pad, _Prefix())
    assert cross_check(manifest, quantized) == [
        f"language_model.lm_head: tied to model.embed_tokens, it should hold the embedding's "
        f"{{'bfloat16': {1024 * 256}}} elements per dtype, vLLM records {{'bfloat16': {1024 * 256}, "
        f"'uint8': {1024 * 8}}} (the engine's quantization_config quantizes the tied "
        "language_model.lm_head: list it in its ignore list)"]
