"""qstrat.plugins.registry: what the plugins (built-ins included) register, looked up by name; mistakes a plugin
author makes get a PluginError that names the plugin, the hook and the fix.

Each test registers a deliberately broken in-process plugin with ``Registry(plugins=[...])``
next to the built-ins (loaded through the entry point, as in production).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

import qstrat
from qstrat import ConfigError, PluginError, Registry
from qstrat.hookspecs import hookimpl
from qstrat.layouts.model_layout import ModelLayout
from qstrat.plugins.selector import Selector
from qstrat.serializers import PartSpec, Serializer
from qstrat.serializers.mxfp8 import MXFP8
from qstrat.strategies import Strategy


class Good(Serializer):
    """A correct minimal format: int8 values, no scale (test only)."""

    name = "good"

    def matrix_parts(self, n, k):
        return (PartSpec("weight", (n, k), torch.int8, 1),)

    def reference(self, x, context):
        return {"weight": x.round().clamp(-127, 127).to(torch.int8)}

    def dequantize(self, parts):
        return parts["weight"].float()


class Plugin:
    """An in-process plugin object whose hooks return whatever the test gives it."""

    def __init__(self, **hooks):
        for hook, value in hooks.items():
            setattr(self, f"qstrat_{hook}", hookimpl(lambda value=value: value))


def registry(**hooks) -> Registry:
    return Registry(plugins=[Plugin(**hooks)], entry_points=True)


def test_a_good_plugin_registers_with_a_readable_origin():
    reg = registry(serializers=[Good], strategies=[Strategy("good-all", "", {"rules": [{"serializer": "good"}]})])
    assert reg.serializers["good"].origin == "Plugin (in-process)"
    assert reg.serializers["mxfp8"].origin.startswith("builtin (qstrat ")
    assert reg.strategies["good-all"].obj.config["rules"][0]["serializer"] == "good"


def test_serializer_without_name():
    class Nameless(Good):
        name = ""

    class Inherits(Good):  # `name` must be the class's own, not its parent's
        pass

    for cls in (Nameless, Inherits):
        with pytest.raises(PluginError, match=rf"Plugin \(in-process\): qstrat_serializers: serializer "
                                              rf".*{cls.__name__} has no 'name' class attribute"):
            registry(serializers=[cls])


def test_serializer_missing_abstract_methods():
    class Partial(Serializer):
        name = "partial"

        def matrix_parts(self, n, k):
            return ()

    with pytest.raises(PluginError, match=r"serializer 'partial' does not implement: dequantize, reference"):
        registry(serializers=[Partial])


def test_serializer_hook_returns_an_instance_not_a_class():
    with pytest.raises(PluginError, match=r"qstrat_serializers: expected a Serializer subclass, got Good\("):
        registry(serializers=[Good()])


@pytest.mark.parametrize("hook,value,got", [
    ("serializers", Good, r"<class '.*Good'>"),
    ("selectors", {"x": 1}, r"\{'x': 1\}"),
    ("strategies", None, "None"),  # a hook that forgot to return
    ("layouts", "qwen3_moe", "'qwen3_moe'"),
])
def test_hook_must_return_a_list(hook, value, got):
    with pytest.raises(PluginError, match=rf"Plugin \(in-process\): hook qstrat_{hook} must return a list, got {got}$"):
        registry(**{hook: value})


@pytest.mark.parametrize("hook,obj,cls", [
    ("selectors", Selector("", "nothing", lambda p: False), "Selector"),
    ("strategies", Strategy("", "nameless", {"rules": []}), "Strategy"),
    ("layouts", ModelLayout(name=""), "ModelLayout"),
    ("layouts", ModelLayout(name="  "), "ModelLayout"),
])
def test_empty_names(hook, obj, cls):
    with pytest.raises(PluginError, match=rf"qstrat_{hook}: {cls} needs a non-empty str name, got '\s*' in {cls}\("):
        registry(**{hook: [obj]})


def test_wrong_object_type():
    with pytest.raises(PluginError, match=r"qstrat_selectors: expected Selector, got 'experts'"):
        registry(selectors=["experts"])


@pytest.mark.parametrize("hook,obj,name", [
    ("serializers", type("MyMXFP8", (MXFP8,), {"name": "mxfp8"}), "mxfp8"),
    ("selectors", Selector("experts", "mine", lambda p: True), "experts"),
    ("strategies", Strategy("block-fp8", "mine", {"rules": []}), "block-fp8"),
    ("layouts", ModelLayout(name="qwen3_moe"), "qwen3_moe"),
])
def test_name_clash_with_a_builtin_names_both_origins(hook, obj, name):
    with pytest.raises(PluginError, match=rf"qstrat_{hook}: name '{name}' is registered by both "
                                          rf"Plugin \(in-process\) and builtin \(qstrat [^)]+\)"):
        registry(**{hook: [obj]})


def test_name_clash_between_two_plugins():
    with pytest.raises(PluginError, match=r"name 'good' is registered by both Plugin#2 \(in-process\) "
                                          r"and Plugin \(in-process\)"):
        Registry(plugins=[Plugin(serializers=[Good]), Plugin(serializers=[Good])])


@pytest.mark.parametrize("config,detail", [
    ({"rules": [{"select": ["experts"], "serializer": "int7"}]}, r"rules\[0\]\.serializer: unknown serializer 'int7'; valid: .*mxfp8"),
    ({"rules": [{"select": ["expertz"], "serializer": "mxfp8"}]}, r"rules\[0\]\.select: unknown selector 'expertz'"),
    ({"rules": [{"serializer": "mxfp8", "options": {"block": 16}}]}, r"rules\[0\]\.options\.block: Extra inputs are not permitted"),
    ({"keep_bf16": {"frist": 1}}, r"keep_bf16\.frist: Extra inputs"),
    ([{"serializer": "mxfp8"}], r"config must be a mapping \(a partial RefitConfig\), got list"),
])
def test_invalid_preset_names_the_strategy(config, detail):
    with pytest.raises(PluginError, match=rf"strategy 'broken' from Plugin \(in-process\)(: | is invalid: ){detail}"):
        registry(strategies=[Strategy("broken", "", config)])


def test_preset_may_use_the_plugins_own_serializer():
    reg = registry(serializers=[Good], strategies=[Strategy("good-experts", "", {
        "rules": [{"select": ["experts"], "serializer": "good"}]})])
    assert "good-experts" in reg.strategies


def test_misspelled_hook_is_an_error():
    class Typo:
        @hookimpl
        def qstrat_serializer(self):  # singular: not a qstrat hook
            return [Good]

    with pytest.raises(PluginError, match=r"unknown hook 'qstrat_serializer'.*qstrat hooks are: .*qstrat_serializers"):
        Registry(plugins=[Typo()])


def test_hook_with_arguments_is_an_error():
    class Args:
        @hookimpl
        def qstrat_serializers(self, registry):
            return [Good]

    with pytest.raises(PluginError, match=r"(?s)plugin Args: .*qstrat_serializers.*registry"):
        Registry(plugins=[Args()])


# ---- quantize checks what a serializer emits against what it declared -----------------------
def _emits_wrong_shape(ser, w3, context):
    """A 'kernel' that drops the last column (a typical off-by-one in a grid computation)."""
    return {"weight": torch.zeros(w3.shape[0], w3.shape[1], w3.shape[2] - 1, dtype=torch.int8)}


def _emits_wrong_dtype(ser, w3, context):
    return {"weight": torch.zeros(w3.shape, dtype=torch.uint8)}


def _emits_extra_part(ser, w3, context):
    return {"weight": torch.zeros(w3.shape, dtype=torch.int8), "weight_scale": torch.ones(w3.shape[0], 1)}


@pytest.mark.parametrize("kernel,got", [
    (_emits_wrong_shape, r"'weight': \(\(4, 7\), torch\.int8\)"),
    (_emits_wrong_dtype, r"'weight': \(\(4, 8\), torch\.uint8\)"),
    (_emits_extra_part, r"'weight_scale'"),
])
def test_quantize_rejects_parts_that_differ_from_part_specs(kernel, got, monkeypatch):
    broken = type("Broken", (Good,), {"name": "broken", "kernel": kernel})
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets backend='triton' run the 'kernel' on CPU
    with pytest.raises(PluginError, match=rf"serializer 'broken' emitted \{{.*{got}.*\}} for layers\.0\.w, "
                                          r"but declared \{'weight': \(\(4, 8\), torch\.int8\)\} in the plan"):
        broken(backend="triton").quantize(torch.ones(4, 8), name="layers.0.w")
    assert torch.equal(broken(backend="torch").quantize(torch.ones(4, 8))["weight"], torch.ones(4, 8, dtype=torch.int8))


# The torch path copies each reference() chunk into buffers allocated from part_specs; every
# chunk is checked first, so a wrong dtype is not cast silently and a wrong shape or a missing
# part is a PluginError naming the serializer, not a bare torch/KeyError.
class _RefWrongDtype(Good):
    name = "ref_dtype"

    def reference(self, x, context):
        return {"weight": x * 1.7}  # float32 where int8 is declared: truncated by copy_


class _RefWrongShape(Good):
    name = "ref_shape"

    def reference(self, x, context):
        return {"weight": x[..., :-1].to(torch.int8)}


class _RefMissingPart(Good):
    name = "ref_missing"

    def reference(self, x, context):
        return {"w": x.to(torch.int8)}


@pytest.mark.parametrize("cls", [_RefWrongDtype, _RefWrongShape, _RefMissingPart])
def test_reference_that_disagrees_with_part_specs_is_a_plugin_error(cls):
    with pytest.raises(PluginError, match=rf"^serializer '{cls.name}' emitted .* for reference\(\) chunk "
                                          r"\[0:1, 0:4\] of layers\.0\.w, but declared"):  # the tensor named
        cls().quantize(torch.ones(4, 8), name="layers.0.w")


class _RefRaises(Good):
    name = "ref_raises"

    def reference(self, x, context):
        raise ValueError("kaboom")


def test_a_reference_that_raises_is_a_plugin_error_naming_it_and_the_tensor():
    """Adversarial run: a plugin's reference() raising came out as the bare ValueError, naming
    neither the serializer nor the tensor."""
    with pytest.raises(PluginError) as exc:
        _RefRaises().quantize(torch.ones(4, 8), name="layers.0.w")
    assert str(exc.value) == ("serializer 'ref_raises' (test_registry._RefRaises): reference() raised ValueError: "
                              "kaboom on layers.0.w chunk [0:1, 0:4]")
    assert isinstance(exc.value.__cause__, ValueError)


class _StrDtype(Good):
    name = "str_dtype"

    def matrix_parts(self, n, k):
        return (PartSpec("weight", (n, k), "int8", 1),)


class _ZeroRows(Good):
    name = "zero_rows"

    def matrix_parts(self, n, k):
        return (PartSpec("weight", (n, k), torch.int8, 0),)


@pytest.mark.parametrize("cls, why", [
    (_StrDtype, "PartSpec(suffix='weight', shape=(4, 8), dtype='int8', rows_per_entry=1): its dtype must be a "
                "torch.dtype"),  # was: AttributeError 'str' object has no attribute 'itemsize' at plan time
    (_ZeroRows, "PartSpec(suffix='weight', shape=(4, 8), dtype=torch.int8, rows_per_entry=0): its rows_per_entry "
                "must be a positive int or None"),
])
def test_a_malformed_part_spec_is_a_plugin_error_naming_it(cls, why):
    with pytest.raises(PluginError) as exc:
        cls().part_specs((4, 8))
    assert str(exc.value) == f"serializer '{cls.name}' (test_registry.{cls.__name__}): matrix_parts(4, 8) returned {why}"


def test_in_process_registry_is_used_for_driver_config_validation():
    from qstrat.hookspecs import hookimpl
    from qstrat.strategies import Strategy

    class ExtraPreset:
        @hookimpl
        def qstrat_strategies(self):
            return [Strategy("only-here", "in-process preset", {"rules": [{"serializer": "mxfp8"}]})]

    reg = qstrat.Registry(plugins=[ExtraPreset()])
    driver = qstrat.RefitDriver({"preset": "only-here"}, registry=reg)
    assert driver.config.rules[0].serializer == "mxfp8"
    with pytest.raises(qstrat.ConfigError, match="unknown strategy 'only-here'"):
        qstrat.RefitDriver({"preset": "only-here"})


def test_get_serializer_errors():
    with pytest.raises(ConfigError, match="unknown serializer 'fp7'; valid:"):
        qstrat.get_serializer("fp7")
    with pytest.raises(ConfigError, match=r"min_scale_byte: Input should be less than or equal to 254"):
        qstrat.get_serializer("mxfp8", min_scale_byte=255)


# ---- a plugin preset extending a preset (issue 36, item 3) ------------------------------------
def test_a_plugin_preset_extending_a_preset_plans_with_the_base_presets_rules(tiny_model, tiny_hf_config):
    """The old code validated it, then dropped block-fp8's rules: everything BF16, no
    quantization_config, no error."""
    reg = registry(strategies=[Strategy("fp8-safe", "", {"preset": "block-fp8", "keep_bf16": {"first": 1}}),
                               Strategy("fp8-safer", "", {"preset": "fp8-safe", "keep_bf16": {"last": 1}})])
    for name, keep in (("fp8-safe", (1, 0)), ("fp8-safer", (1, 1))):
        cfg = qstrat.load_config(name, registry=reg)
        assert [r.serializer for r in cfg.rules] == ["block_fp8"]
        assert (cfg.keep_bf16.first, cfg.keep_bf16.last) == keep
    driver = qstrat.RefitDriver("fp8-safe", hf_config=tiny_hf_config, registry=reg)
    plan = driver.plan(tiny_model.state_dict())
    assert plan.vllm_quantization_config()["quant_method"] == "fp8"
    assert {e.serializer for e in plan.entries if e.layer == 1 and e.kind == "attention"} == {"block_fp8"}
    assert {e.rule for e in plan.entries if e.layer == 0 and e.kind == "attention"} == {"keep_bf16.first"}


def test_presets_extending_each_other_in_a_cycle_name_the_cycle():
    with pytest.raises(PluginError, match=r"strategy 'loop-a' from Plugin \(in-process\) is invalid: .*"
                                         r"preset 'loop-b' extends itself: loop-b -> loop-a -> loop-b"):
        registry(strategies=[Strategy("loop-a", "", {"preset": "loop-b"}), Strategy("loop-b", "", {"preset": "loop-a"})])


# ---- layout fields are type-checked when the registry loads (issue 36, item 4) ----------------
@pytest.mark.parametrize("fields,message", [
    ({"fused": (("gate_proj", "up_proj"))},  # the missing comma: one tuple of names
     r"layout 'mine': fused\[0\]: Input should be a valid tuple \(got \('gate_proj', 'up_proj'\)\); a tuple of "
     r"groups: did you mean \(\('gate_proj', 'up_proj'\),\)\?"),
    ({"routers": "router"}, r"layout 'mine': routers: Input should be a valid tuple \(got 'router'\)"),
    ({"fused": (("q_proj",),)}, r"layout 'mine': fused: each group lists the two or more sibling modules"),
    ({"mlp_blocks": ("block.mlp",)}, r"layout 'mine': mlp_blocks: module names must be non-empty and hold no dot"),
    ({"num_layers_key": 32}, r"layout 'mine': num_layers_key: Input should be a valid string"),
    ({"slabs": {"gate_up_proj": ("gate_proj", "up_proj")}}, r"layout 'mine': slabs\.gate_up_proj: Input should "
     r"be an instance of SlabSpec"),
])
def test_layout_fields_are_type_checked_naming_the_plugin_and_field(fields, message):
    """The old code registered these: the missing comma made fusion groups of single letters
    (NVFP4 then gave gate and up different weight_scale_2), a str ``routers`` made ``out`` a router."""
    with pytest.raises(PluginError, match=r"^Plugin \(in-process\): qstrat_layouts: " + message):
        registry(layouts=[ModelLayout(name="mine", architectures=("MineForCausalLM",), **fields)])


def test_a_well_typed_plugin_layout_and_every_builtin_register():
    reg = registry(layouts=[ModelLayout(name="mine", fused=(("gate_proj", "up_proj"),), routers=("router",))])
    assert reg.layouts["mine"].obj.fused == (("gate_proj", "up_proj"),)
    assert {"llama", "qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss", "generic"} <= set(reg.layouts)


def test_a_plugin_layout_claiming_a_builtin_architecture_is_refused_naming_both():
    """The old registry took it: detection then picked the plugin's layout (registration order)
    for every Llama - its routers, fused groups and names - with no word."""
    with pytest.raises(PluginError, match=r"^qstrat_layouts: architecture 'LlamaForCausalLM' is claimed by layout "
                                         r"'\w+' from .* and layout '\w+' from .*: detection would pick one"):
        registry(layouts=[ModelLayout(name="mine", architectures=("LlamaForCausalLM",))])
    with pytest.raises(PluginError, match=r"model_type 'mixtral' is claimed by layout"):
        registry(layouts=[ModelLayout(name="mine", model_types=("mixtral",))])
    reg = registry(layouts=[ModelLayout(name="mine", architectures=("MineForCausalLM",), model_types=("mine",))])
    assert qstrat.RefitDriver("block-fp8", hf_config={"architectures": ["LlamaForCausalLM"]},
                              registry=reg).layout.name == "llama"


if TYPE_CHECKING:  # a name only type checkers see: annotations below are strings at runtime
    from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class _HookedLayout(ModelLayout):
    """A plugin's layout subclass annotating its own field with a TYPE_CHECKING-only name (valid
    Python under ``from __future__ import annotations``)."""

    rename_hook: Callable[[str], str] | None = None


def test_a_layout_subclass_with_a_type_checking_only_annotation_registers_and_its_fields_are_still_checked():
    """The old code resolved all annotations at once (typing.get_type_hints): a raw NameError
    ('Callable' is not defined) from the registry, naming no plugin, refusing a valid layout."""
    reg = registry(layouts=[_HookedLayout(name="hooked", rename_hook=str.lower)])
    assert reg.layouts["hooked"].obj.rename_hook is str.lower
    with pytest.raises(PluginError, match=r"layout 'hooked': routers: Input should be a valid tuple \(got 'router'\)"):
        registry(layouts=[_HookedLayout(name="hooked", routers="router")])


# ---- plugin mistakes name the plugin, never a raw error from deep inside (issue 36, item 8) -----
def _broken_distribution(tmp_path, module_text: str) -> Path:
    """A distribution ``qstrat-broken 0.3`` on a path of its own, with entry point ``broken`` in
    the ``qstrat`` group pointing at a module with ``module_text``."""
    (tmp_path / "qstrat_broken_plugin.py").write_text(module_text)
    info = tmp_path / "qstrat_broken-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qstrat-broken\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[qstrat]\nbroken = qstrat_broken_plugin\n")
    return tmp_path


@pytest.mark.parametrize("module_text,detail", [
    ("import not_installed_anywhere\n", "ModuleNotFoundError: No module named 'not_installed_anywhere'"),
    ("raise RuntimeError('plugin init failed')\n", "RuntimeError: plugin init failed"),
])
def test_a_plugin_that_fails_to_import_names_its_entry_point_and_distribution(tmp_path, monkeypatch, module_text,
                                                                               detail):
    monkeypatch.syspath_prepend(str(_broken_distribution(tmp_path, module_text)))
    with pytest.raises(PluginError) as info:
        Registry()
    assert str(info.value) == (f"plugin entry point 'broken' = 'qstrat_broken_plugin' (distribution qstrat-broken "
                               f"0.3) failed to load: {detail}; fix or uninstall that distribution "
                               "(pip uninstall qstrat-broken)")


def test_qstrat_list_with_a_broken_plugin_is_one_error_line_not_a_traceback(tmp_path):
    """The old CLI exited 1 with a traceback naming neither the entry point nor the distribution."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    path = _broken_distribution(tmp_path, "import not_installed_anywhere\n")
    proc = subprocess.run([sys.executable, "-m", "qstrat.cli.commands", "list"], capture_output=True, text=True, timeout=300,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": f"{path}:{root}"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: plugin entry point 'broken' = 'qstrat_broken_plugin' (distribution "
                                  "qstrat-broken 0.3) failed to load: ModuleNotFoundError")


def test_a_hook_that_raises_names_the_plugin_and_hook():
    class Raiser:
        @hookimpl
        def qstrat_selectors(self):
            raise RuntimeError("boom")

    with pytest.raises(PluginError, match=r"^Raiser \(in-process\): hook qstrat_selectors raised RuntimeError: boom$"):
        Registry(plugins=[Raiser()])


def test_an_unhashable_plugin_object_is_named():
    class Unhashable:
        def __eq__(self, other):
            return False

        @hookimpl
        def qstrat_serializers(self):
            return []

    with pytest.raises(PluginError, match=r"^plugin Unhashable: a plugin must be hashable"):
        Registry(plugins=[Unhashable()])


@pytest.mark.parametrize("predicate,message", [
    (5, r"^Plugin \(in-process\): qstrat_selectors: selector 'mine': predicate must be a callable ParsedName -> "
        r"bool, got 5$"),
    (lambda p: 1 / 0, r"^selector 'mine' from Plugin \(in-process\): its predicate raised ZeroDivisionError: "
                      r"division by zero on model\.layers\.0\."),
    (lambda p: torch.tensor([True, False]), r"^selector 'mine' from Plugin \(in-process\): its predicate must "
                                            r"return a bool, got Tensor on model\.layers\.0\."),
])
def test_a_broken_selector_is_a_plugin_error_naming_it(predicate, message):
    from plan_cases import small_moe

    cfg, tensors = small_moe()
    with pytest.raises(PluginError, match=message):
        reg = registry(selectors=[Selector("mine", "", predicate)])
        qstrat.RefitDriver({"rules": [{"select": "mine", "serializer": "block_fp8"}]}, hf_config=cfg,
                           registry=reg).plan(tensors)


class PartNames(Good):
    name = "part_names"

    def matrix_parts(self, n, k):
        return ("weight",)


class NoParts(Good):
    name = "no_parts"

    def reference(self, x, context):
        return None


class StrConfig(Good):
    name = "str_config"

    def vllm_quantization_config(self, ignored):
        return "fp8"


@pytest.mark.parametrize("cls,message", [
    (PartNames, r"^serializer 'part_names' \(test_registry\.PartNames\): matrix_parts\(256, 128\) must return a "
                r"tuple of PartSpec, got \('weight',\)$"),
    (NoParts, r"^serializer 'no_parts' returned NoneType None for reference\(\) chunk \[0:4, 0:256\] of "
              r"model\.layers\.\d+\.mlp\.experts\.[\w.]+.*; it must return a dict suffix -> tensor"),
    (StrConfig, r"^serializer 'str_config' \(test_registry\.StrConfig\): vllm_quantization_config must return a "
                r"dict \(the engine's quantization_config\) or None, got str 'fp8'$"),
])
def test_a_serializer_returning_the_wrong_type_is_a_plugin_error_naming_it(cls, message):
    """The old code: AttributeError from base.py ('str' object has no attribute 'suffix',
    'NoneType' object has no attribute 'items'); a str config was accepted until write_checkpoint."""
    from plan_cases import small_moe

    cfg, tensors = small_moe()
    reg = registry(serializers=[cls])
    driver = qstrat.RefitDriver({"rules": [{"select": "experts", "serializer": cls.name}]}, hf_config=cfg, registry=reg)
    with pytest.raises(PluginError, match=message):
        list(driver.run({n: torch.zeros(t.shape, dtype=t.dtype) for n, t in tensors.items()}))


def test_a_plugin_installed_under_the_entry_point_and_also_passed_in_process_registers_once():
    """The same module both installed (entry point ``qstrat``) and given in ``plugins=`` (a newcomer's
    source folder on sys.path beside its installed copy): pluggy raised a bare ValueError ("Plugin
    already registered under a different name"); it is one plugin, registered once."""
    from qstrat.plugins import builtin

    reg = Registry(plugins=[builtin])
    assert reg.serializers["mxfp8"].origin.startswith("builtin (qstrat ")
    assert sorted(reg.serializers) == sorted(Registry().serializers)
    assert [p for p in reg.pm.get_plugins() if p is builtin] == [builtin]


def test_a_plugin_equal_to_everything_is_a_plugin_error_not_skipped():
    """Registered-once is decided by identity: a plugin whose __eq__ says True to anything (the
    attacker's) was taken for the built-in and silently skipped; pluggy itself compares plugins
    with ==, so it cannot register such an object: a PluginError naming it."""

    class EqualsAll:
        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

        @hookimpl
        def qstrat_serializers(self):
            return [Good]

    with pytest.raises(PluginError, match=r"^plugin EqualsAll: Plugin already registered under a different name"):
        Registry(plugins=[EqualsAll()])
