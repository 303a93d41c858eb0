"""The engine manifest without an engine (qstrat.vllm.checks.engine_manifest): what it lists, and check_plan.

The live cross-check with vLLM's record of the model is in test_engine_manifest.py."""
from __future__ import annotations

import pytest
import torch

from qstrat import PlanError, RefitDriver
from qstrat.plugins.builtin.layouts import DEEPSEEK_V3, QWEN3_MOE
from qstrat.errors import EngineManifestError
from qstrat.vllm.checks.engine_manifest import build_manifest, check_plan
from qstrat.plugins.registry import get_registry
from qstrat.layouts.skeleton import model_tensors

import model_families as mf
from conftest import model_config


def manifest_for(driver, state, dtype="bfloat16"):
    plan = driver.plan(state)
    return plan, build_manifest(driver.hf_config, plan.vllm_quantization_config(), driver.layout,
                                get_registry(), dtype)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_skeleton_equals_transformers_state_dict(arch):
    """The manifest's tensor list comes from qstrat.layouts.skeleton: it must be exactly what
    transformers' real model class holds (grouped slabs in memory), biases included."""
    import transformers

    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=4, vocab_size=100,
                  shared_expert_intermediate_size=64 if "Qwen2" in arch else 0, tie_word_embeddings=False)
    with torch.device("meta"):
        model = getattr(transformers, arch)(cfg)
    real = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert dict(model_tensors(QWEN3_MOE, cfg.to_dict(), grouped=True)) == real
    if "Qwen2" in arch:
        assert "model.layers.0.self_attn.q_proj.bias" in real and "model.layers.0.self_attn.o_proj.bias" not in real


@pytest.mark.parametrize("preset", ["block-fp8", "mxfp8", "mxfp8-experts", "nvfp4-experts", "bf16"])
@pytest.mark.parametrize("emission", ["per_expert", "fused"])
def test_manifest_is_exactly_what_a_checkpoint_of_that_format_holds(tiny_model, tiny_hf_config, preset, emission):
    """Per expert or as fused slabs, a complete plan in the engine's format emits exactly the
    manifest's tensors of that form (names, shapes, dtypes)."""
    drv = RefitDriver({"preset": preset, "expert_emission": emission}, hf_config=tiny_hf_config)
    plan, manifest = manifest_for(drv, tiny_model.state_dict())
    if preset == "nvfp4-experts" and emission == "fused":  # weight_scale_2 / input_scale are [E]
        with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.experts\.down_proj: the engine takes "
                                            r"model\.layers\.0\.mlp\.experts per expert only: vLLM loads a fused "
                                            r"expert slab part only as an \[E, \.\.\.\] 3-D tensor"):
            check_plan(plan, manifest)
        assert "fused" not in manifest.units["model.layers.0.mlp.experts"].forms
        return
    check_plan(plan, manifest)
    form = "fused" if emission == "fused" else "per_expert"
    want = {t.name: (t.shape, t.dtype) for t in manifest.tensors.values() if t.form in ("", form)}
    got = {o.name: (tuple(o.shape), o.dtype) for o in plan.outputs()}
    assert got == want
    assert manifest.format == {"block-fp8": "block_fp8", "bf16": None, "nvfp4-experts": "nvfp4"}.get(
        preset, "mxfp8")


def test_units_group_fused_modules_and_experts(tiny_model, tiny_hf_config):
    drv = RefitDriver("mxfp8-experts", hf_config=tiny_hf_config)
    _, manifest = manifest_for(drv, tiny_model.state_dict())
    qkv = manifest.units["model.layers.0.self_attn.{q_proj,k_proj,v_proj}"]
    assert (qkv.part, qkv.kind, qkv.quantized) == (0, "attention", False)  # in the ModelOpt ignore list
    experts = manifest.units["model.layers.3.mlp.experts"]
    assert experts.quantized and set(experts.forms) == {"per_expert", "fused"}
    assert "model.layers.3.mlp.experts.gate_up_proj_scale" in experts.forms["fused"]
    assert manifest.parts() == [0, 1, 2, 3, "lm_head", "model.embed_tokens", "model.norm"]
    assert manifest.tensors["model.layers.3.mlp.experts.5.up_proj.weight_scale"].dtype == "uint8"


def test_a_config_no_format_writes_is_a_manifest_error(tiny_hf_config):
    with pytest.raises(EngineManifestError, match=r"no registered format writes the engine's quantization_config "
                                            r"\{'quant_method': 'fp8', 'activation_scheme': 'static'\}"):
        build_manifest(tiny_hf_config, {"quant_method": "fp8", "activation_scheme": "static"}, QWEN3_MOE,
                       get_registry())


def test_a_fused_module_split_by_the_ignore_list_is_a_manifest_error(tiny_hf_config):
    cfg = {"quant_method": "fp8", "weight_block_size": [128, 128],
           "ignored_layers": ["model.layers.0.self_attn.q_proj"]}
    with pytest.raises(EngineManifestError, match=r"model\.layers\.0\.self_attn\.\{q_proj,k_proj,v_proj\}: the engine's "
                                            "ignore list covers some"):
        build_manifest(tiny_hf_config, cfg, QWEN3_MOE, get_registry())


def test_tied_lm_head_is_accepted_and_not_required(tiny_model, tiny_hf_config):
    cfg = {**tiny_hf_config, "tie_word_embeddings": True}
    drv = RefitDriver("block-fp8", hf_config=cfg)
    state = tiny_model.state_dict()
    plan, manifest = manifest_for(drv, state)
    assert "lm_head.weight" in manifest.dropped and "lm_head" not in manifest.parts()
    check_plan(plan, manifest)  # with lm_head.weight (as a tied state_dict holds it)
    check_plan(drv.plan({k: v for k, v in state.items() if k != "lm_head.weight"}), manifest)


def test_deepseek_v3_manifest_from_config_leaves_mtp_out():
    cfg = model_config("deepseek-v3")
    drv = RefitDriver("block-fp8", hf_config=cfg)
    meta = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(DEEPSEEK_V3, cfg)}
    decoder = {n: t for n, t in meta.items() if not n.startswith("model.layers.61.")}
    plan, manifest = manifest_for(drv, decoder)
    check_plan(plan, manifest)
    assert manifest.num_layers == 61 and manifest.num_experts == 256
    assert manifest.units["model.layers.0.mlp.{gate_proj,up_proj}"].quantized  # a dense layer
    assert manifest.tensors["model.layers.5.mlp.gate.e_score_correction_bias"].dtype == "bfloat16"
    with pytest.raises(PlanError, match=r"model\.layers\.61\.eh_proj\.weight: decoder layer 61 does not exist: the "
                                        r"engine's model has 61 decoder layers \(MTP layers load only"):
        check_plan(drv.plan(meta), manifest)


def test_check_plan_partial_refits(tiny_model, tiny_hf_config):
    drv = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    state = tiny_model.state_dict()
    _, manifest = manifest_for(drv, state)
    layer2 = drv.plan({k: v for k, v in state.items() if k.startswith("model.layers.2.")})
    check_plan(layer2, manifest, layers=[2])
    with pytest.raises(PlanError, match=r"the refit leaves out decoder layer 0, decoder layer 1, decoder layer 3, "
                                        r"lm_head, model\.embed_tokens, model\.norm of the engine's model"):
        check_plan(layer2, manifest)
    with pytest.raises(PlanError, match=r"decoder layer 3 is refit partially: the plan sends nothing for "
                                        r"model\.layers\.3\.input_layernorm"):
        check_plan(layer2, manifest, layers=[2, 3])
    with pytest.raises(PlanError, match=r"the plan sends model\.layers\.2\.mlp\.experts, but decoder layer 2 is "
                                        r"not among the layers refit"):
        check_plan(layer2, manifest, layers=[])


def test_errors_of_one_unit_are_summarised(tiny_model, tiny_hf_config):
    """An MXFP8-sized slab error does not flood: one line per unit and problem."""
    drv = RefitDriver("block-fp8")  # no model config: the planner cannot check the expert count
    state = dict(tiny_model.state_dict())
    _, manifest = manifest_for(RefitDriver("block-fp8", hf_config=tiny_hf_config), state)
    state["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(8, 512, 256, dtype=torch.bfloat16)
    state["model.layers.1.mlp.experts.down_proj"] = torch.zeros(8, 256, 256, dtype=torch.bfloat16)
    with pytest.raises(PlanError) as exc:
        check_plan(drv.plan(state), manifest)
    lines = str(exc.value).splitlines()[1:]
    assert lines == [
        "  model.layers.1.mlp.experts.0.down_proj.weight (from model.layers.1.mlp.experts.down_proj): shape "
        "[256, 256], the engine expects [256, 128] (and 47 more tensors of model.layers.1.mlp.experts alike)"]


def test_qwen2_moe_biases_follow_their_quantized_module():
    """q/k/v biases (Qwen2-MoE) belong to the quantized fused module and stay in the engine dtype."""
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, vocab_size=512,
                         shared_expert_intermediate_size=256).to_dict()
    drv = RefitDriver("block-fp8", hf_config=cfg)
    meta = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(QWEN3_MOE, cfg, True)}
    plan, manifest = manifest_for(drv, meta)
    check_plan(plan, manifest)
    qkv = manifest.units["model.layers.0.self_attn.{q_proj,k_proj,v_proj}"]
    assert qkv.quantized and "model.layers.0.self_attn.q_proj.bias" in qkv.forms[""]
    assert manifest.tensors["model.layers.0.self_attn.q_proj.bias"].dtype == "bfloat16"
    assert manifest.units["model.layers.1.mlp.shared_expert.{gate_proj,up_proj}"].quantized


# ---- every family has a manifest (no refit without its checks) -------------------------------
#: Built-in families (tests/model_families.py) x presets: MXFP8 experts on every MoE family but gpt-oss.
FAMILY_CASES = [(f, "block-fp8") for f in mf.FAMILIES] + [
    (f, "mxfp8-experts") for f in mf.FAMILIES if f not in ("llama", "qwen3", "gpt_oss")]


@pytest.mark.parametrize("family,preset", FAMILY_CASES, ids=[f"{f}-{p}" for f, p in FAMILY_CASES])
def test_every_family_builds_a_manifest_its_plan_passes(family, preset):
    """The engine manifest of every built-in family builds from its config (the layout's tensors:
    hybrid linear attention, Qwen3.5's vision tower and gpt-oss' whole slabs included), and the
    plan of the family's transformers ``state_dict()`` matches it exactly - every name, shape and
    dtype, every unit complete (the live engines of tests/test_model_families_engine.py also
    cross-check it with vLLM's record)."""
    cfg = mf.hf_config(family)
    hf = mf.config_dict(cfg)
    rules = [{"select": ["experts"], "serializer": "bf16"}] if family == "gpt_oss" else []
    drv = RefitDriver({"preset": preset, "rules": rules}, hf_config=hf)
    plan = drv.plan(mf.hf_state_dict(family, cfg))
    manifest = build_manifest(hf, plan.vllm_quantization_config(), drv.layout, drv.registry)
    check_plan(plan, manifest)
    sent = {o.name for e in plan.entries for o in e.outputs}
    assert sent <= set(manifest.tensors) | set(manifest.dropped)
    assert {manifest.tensors[n].unit for n in sent if n in manifest.tensors} == set(manifest.units)


def test_qwen3_5_mtp_tensors_are_refused_with_the_reason():
    cfg = mf.hf_config("qwen3_5_moe_text")
    hf = mf.config_dict(cfg)
    drv = RefitDriver("block-fp8", hf_config=hf)
    sd = mf.hf_state_dict("qwen3_5_moe_text", cfg)
    plan = drv.plan({**sd, "mtp.fc.weight": torch.empty(256, 512, dtype=torch.bfloat16, device="meta")})
    manifest = build_manifest(hf, plan.vllm_quantization_config(), drv.layout, drv.registry)
    with pytest.raises(PlanError, match=r"mtp\.fc\.weight: an MTP layer is not part of the engine's model \(MTP "
                                        r"layers load only into a speculative-decoding draft model, and vLLM's "
                                        r"reload_weights reloads the main model only"):
        check_plan(plan, manifest)


def test_an_engine_without_its_vision_tower_drops_the_tower_tensors():
    cfg = mf.hf_config("qwen3_5_moe")
    hf = mf.config_dict(cfg)
    drv = RefitDriver("block-fp8", hf_config=hf)
    plan = drv.plan(mf.hf_state_dict("qwen3_5_moe", cfg))
    manifest = build_manifest(hf, plan.vllm_quantization_config(), drv.layout, drv.registry,
                              unbuilt=("model.visual.",))
    check_plan(plan, manifest)
    assert "model.visual.blocks.0.attn.qkv.weight" in manifest.dropped
    assert not any(n.startswith("model.visual.") for n in manifest.tensors)


def test_an_engine_of_a_family_without_a_manifest_is_refused():
    """No refit without the manifest's checks: a family whose tensors its layout cannot derive
    from the config (here the ``generic`` layout) is an EngineManifestError, not a warning."""
    from types import SimpleNamespace

    from qstrat import vllm as qvllm

    hf = {**model_config("qwen3-235b-a22b"), "architectures": ["SomethingNewForCausalLM"], "model_type": "new"}
    config = SimpleNamespace(to_dict=lambda: hf, quantization_config=None)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(
        hf_config=config, dtype="bfloat16", multimodal_config=None)))
    with pytest.raises(EngineManifestError, match=r"no engine manifest for layout 'generic': layout 'generic': "
                                                  r"config-only planning does not generate .*\(nothing was sent"):
        qvllm.engine_manifest(llm)
