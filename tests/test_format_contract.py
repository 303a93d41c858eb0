"""Each format owns its engine contract: which engine quantization_config it serves
(``engine_config_mismatch`` / ``matches_engine_config``), its CPU emulation opt-in and its bench
peers; qstrat's format lists (the engine's format, the emulation list, the bench rows) are read
from the registry. The INT8 example plugin's side is in test_example_plugin.py."""
from __future__ import annotations

import json
import re
import types

import pytest
import torch

from qstrat import PlanError, RefitDriver, get_serializer
from qstrat.cli.bench import NO_PEER, bench_format_names, bench_formats
from qstrat.vllm import emulation
from qstrat.vllm.checks.engine_manifest import engine_format, plan_format_mismatch
from qstrat.errors import EngineManifestError, PluginError
from qstrat.hookspecs import hookimpl
from qstrat.plugins.registry import Registry, get_registry
from qstrat.serializers import PartSpec, Serializer
from qstrat.serializers.bf16 import BF16
from qstrat.serializers.block_fp8 import BlockFP8
from qstrat.serializers.mxfp8 import MXFP8
from qstrat.serializers.nvfp4 import NVFP4

BUILTIN_QUANTIZING = (BlockFP8, MXFP8, NVFP4)


# ---- matches_engine_config: the built-ins against each other's configs ----------------------
@pytest.mark.parametrize("fmt", BUILTIN_QUANTIZING, ids=lambda c: c.name)
@pytest.mark.parametrize("config_of", BUILTIN_QUANTIZING, ids=lambda c: c.name)
def test_truth_table_of_builtin_formats(fmt, config_of):
    cfg = config_of().vllm_quantization_config(["model.layers.0.mlp.gate"])
    assert fmt.matches_engine_config(cfg) is (fmt is config_of)  # on the class: default options
    assert fmt().matches_engine_config(cfg) is (fmt is config_of)
    assert BF16.matches_engine_config(cfg) is False  # a passthrough format serves no quantized engine


def test_refusal_reasons_name_the_key_the_engine_value_and_the_format_value():
    fp8 = BlockFP8().vllm_quantization_config([])
    mx = MXFP8().vllm_quantization_config([])
    nv = NVFP4().vllm_quantization_config([])
    assert MXFP8().engine_config_mismatch(fp8) == \
        "quantization_config.quant_method: engine has 'fp8', mxfp8 writes 'modelopt'"
    assert NVFP4().engine_config_mismatch(mx) == \
        "quantization_config.quant_algo: engine has 'MXFP8', nvfp4 writes 'NVFP4'"
    assert MXFP8().engine_config_mismatch(nv) == \
        "quantization_config.quant_algo: engine has 'NVFP4', mxfp8 writes 'MXFP8'"
    assert BlockFP8().engine_config_mismatch({**fp8, "weight_block_size": (64, 64)}) == \
        "quantization_config.weight_block_size: engine has [64, 64], block_fp8 writes [128, 128]"
    assert BlockFP8().engine_config_mismatch({"quant_method": "fp8"}) == \
        "quantization_config.weight_block_size: engine has none, block_fp8 writes [128, 128]"
    assert NVFP4().engine_config_mismatch({**nv, "group_size": 32}) == \
        "quantization_config.group_size: engine has 32, nvfp4 writes 16"
    assert BF16().engine_config_mismatch(fp8) == "bf16 writes no quantization_config (a passthrough format)"
    # keys the rule does not compare (the ignore list, activation_scheme) do not decide the format
    assert BlockFP8().engine_config_mismatch({**fp8, "ignored_layers": ["lm_head"], "activation_scheme": "x"}) is None


# ---- engine_format: the registered format whose own rule serves the config ------------------
class _Toy(Serializer):
    """A one-part test format: int8 sign of the weight (enough for plans, benches, emulation)."""

    name = "toy_sign"

    def matrix_parts(self, n, k):
        return (PartSpec("weight", (n, k), torch.int8),)

    def reference(self, x, context):
        return {"weight": torch.sign(x).to(torch.int8)}

    def dequantize(self, parts):
        return parts["weight"].float()

    def vllm_quantization_config(self, ignored):
        return {"quant_method": "toy", "ignore": list(ignored)}


class _Plugin:
    """An in-process plugin registering ``classes``."""

    def __init__(self, *classes):
        self.classes = classes

    @hookimpl
    def qstrat_serializers(self):
        return list(self.classes)


_plugin = _Plugin


def test_engine_format_asks_every_format_and_lists_why_none_serves():
    reg = get_registry()
    for fmt in BUILTIN_QUANTIZING:
        assert type(engine_format(fmt().vllm_quantization_config([]), reg)) is fmt
    assert engine_format(None, reg) is None
    with pytest.raises(EngineManifestError) as exc:
        engine_format({"quant_method": "modelopt", "quant_algo": "FP8"}, reg)
    assert str(exc.value) == (
        "no registered format writes the engine's quantization_config {'quant_method': 'modelopt', "
        "'quant_algo': 'FP8'}: qstrat cannot tell which tensors it accepts (block_fp8: "
        "quantization_config.quant_method: engine has 'modelopt', block_fp8 writes 'fp8'; mxfp8: "
        "quantization_config.quant_algo: engine has 'FP8', mxfp8 writes 'MXFP8'; nvfp4: "
        "quantization_config.quant_algo: engine has 'FP8', nvfp4 writes 'NVFP4')")


def test_a_plugin_format_with_its_own_rule_is_the_engines_format():
    class Toy(_Toy):
        name = "toy_sign"

        def engine_config_mismatch(self, quantization_config):
            why = super().engine_config_mismatch(quantization_config)
            return why or (None if quantization_config.get("bits") == 1 else "toy: bits must be 1")

    reg = Registry(plugins=[_plugin(Toy)])
    assert engine_format({"quant_method": "toy", "bits": 1}, reg).name == "toy_sign"
    with pytest.raises(EngineManifestError, match=r"accepts \(toy_sign: toy: bits must be 1; block_fp8: "):
        engine_format({"quant_method": "toy", "bits": 2}, reg)


def test_get_serializer_finds_a_plugin_format_in_the_registry_it_is_given_only():
    """A format registered in a registry of its own (not installed): get_serializer(registry=)
    builds it with its options checked, and this process's registry still does not know it."""
    from qstrat.errors import ConfigError
    from qstrat.plugins.registry import get_serializer

    reg = Registry(plugins=[_plugin(_Toy)])
    ser = get_serializer(_Toy.name, registry=reg)
    assert type(ser) is _Toy and ser.name == _Toy.name
    assert type(get_serializer("mxfp8", registry=reg, scale_rounding="floor")).__name__ == "MXFP8"
    with pytest.raises(ConfigError, match=rf"unknown serializer '{_Toy.name}'"):
        get_serializer(_Toy.name)
    with pytest.raises(ConfigError, match=r"serializer 'mxfp8' options.*scale_rounding"):
        get_serializer("mxfp8", registry=reg, scale_rounding="sideways")


def test_two_formats_serving_one_config_are_refused_not_guessed():
    class Twin(_Toy):
        name = "toy_twin"

    reg = Registry(plugins=[_plugin(_Toy, Twin)])
    with pytest.raises(EngineManifestError, match=r"^formats \['toy_sign', 'toy_twin'\] all serve the engine's "
                                                  r"quantization_config \{'quant_method': 'toy'\}: qstrat cannot tell"):
        engine_format({"quant_method": "toy"}, reg)


# ---- the plan's format against the engine's -------------------------------------------------
def test_plan_format_check_uses_the_plans_format(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    plan = RefitDriver("mxfp8", hf_config=tiny_hf_config).plan(state)
    fp8 = BlockFP8().vllm_quantization_config([])
    reg = get_registry()
    assert plan_format_mismatch(plan, plan.vllm_quantization_config(), reg) is None
    assert plan_format_mismatch(plan, fp8, reg) == (
        "the engine was started for block FP8 (vLLM: quant_method 'fp8'), the plan writes MXFP8: "
        "quantization_config.quant_method: engine has 'fp8', mxfp8 writes 'modelopt' "
        "(the engine does not serve the plan's format mxfp8)")
    # vLLM's 'modelopt' named as qstrat's format: NVFP4 and MXFP8 are both quant_method 'modelopt'
    nvfp4 = get_serializer("nvfp4").vllm_quantization_config([])
    assert plan_format_mismatch(plan, nvfp4, reg).startswith(
        "the engine was started for NVFP4 (vLLM: quant_method 'modelopt', quant_algo 'NVFP4'), the plan writes "
        "MXFP8: quantization_config.quant_algo: engine has 'NVFP4', mxfp8 writes 'MXFP8'")
    assert plan_format_mismatch(plan, {"quant_method": "awq"}, reg).startswith(
        "the engine was started for a format qstrat does not write (vLLM: quant_method 'awq'), the plan writes MXFP8")
    assert plan_format_mismatch(plan, None, reg).startswith(
        "the engine was started unquantized (no quantization_config): engine quantization_config None does not "
        "match the plan's")
    # a part of a plan without a quantized entry (one rank's share) is checked with its config's format
    part = plan.subset(lambda e: e.serializer == "passthrough")
    assert part.entries and not any(e.serializer == "mxfp8" for e in part.entries)
    assert plan_format_mismatch(part, fp8, reg).startswith("the engine was started for block FP8 (vLLM: quant_method "
                                                           "'fp8'), the plan writes MXFP8: quantization_config."
                                                           "quant_method: engine has 'fp8'")
    assert plan_format_mismatch(part, plan.vllm_quantization_config(), reg) is None


def test_check_engine_format_takes_the_drivers_registry(tiny_model, tiny_hf_config):
    from qstrat.vllm import check_engine_format

    reg = Registry(plugins=[_plugin(_Toy)])
    drv = RefitDriver({"rules": [{"select": "experts", "serializer": "toy_sign"}]}, hf_config=tiny_hf_config,
                      registry=reg)
    plan = drv.plan(tiny_model.state_dict())
    check_engine_format(plan, plan.vllm_quantization_config(), reg)
    with pytest.raises(PlanError, match=r"^the engine was started for block FP8 \(vLLM: quant_method 'fp8'\), "
                       r"the plan writes toy_sign: quantization_config\.quant_method: engine has 'fp8', toy_sign writes 'toy'"):
        check_engine_format(plan, BlockFP8().vllm_quantization_config([]), reg)


# ---- the emulation list: every registered format that names an emulation --------------------
class _Emulation:
    """An emulation object as a format names it: hooks() resolves, register(hooks) installs."""

    def __init__(self):
        self.registered = []

    def hooks(self):
        return {"kernel": "toy-kernel"}

    def register(self, hooks):
        self.registered.append(hooks)


def test_a_plugin_format_opts_into_the_emulation(monkeypatch):
    emu = _Emulation()

    class Emulated(_Toy):
        name = "toy_emulated"
        emulation = emu

    reg = Registry(plugins=[_plugin(_Toy, Emulated)])
    assert emulation.formats() == ("block_fp8", "mxfp8", "nvfp4")
    assert emulation.formats(reg) == ("toy_emulated", "block_fp8", "mxfp8", "nvfp4")  # toy_sign: none
    assert emulation.check(("toy_emulated",), reg) == {"toy_emulated": {"kernel": "toy-kernel"}}
    # register(): what vLLM calls in each process, on the registry it finds there
    monkeypatch.setattr(emulation, "get_registry", lambda: reg)
    monkeypatch.setattr(emulation, "needed_formats", lambda: (("toy_emulated",), "CPU without AMX"))
    monkeypatch.setattr(emulation, "_status", emulation.Status())
    emulation.register()
    assert emu.registered == [{"kernel": "toy-kernel"}]
    assert emulation.status() == emulation.Status(("toy_emulated",), "CPU without AMX")


def test_a_broken_emulation_reference_registers_nothing_and_says_which(monkeypatch, caplog):
    class Broken(_Toy):
        name = "toy_broken"
        emulation = "qstrat_no_such_module.emulation"

    class Hookless(_Toy):
        name = "toy_hookless"
        emulation = types.SimpleNamespace(register=lambda h: None)

    reg = Registry(plugins=[_plugin(Broken, Hookless)])
    with pytest.raises(PluginError, match=r"^serializer 'toy_broken': emulation 'qstrat_no_such_module\.emulation' "
                                          r"cannot be imported: No module named 'qstrat_no_such_module'"):
        emulation.check(("toy_broken",), reg)
    with pytest.raises(PluginError, match=r"^serializer 'toy_hookless': emulation .* has no hooks\(\) and register"):
        emulation.check(("toy_hookless",), reg)
    monkeypatch.setattr(emulation, "get_registry", lambda: reg)
    monkeypatch.setattr(emulation, "needed_formats", lambda: (("toy_broken",), "CPU without AMX"))
    monkeypatch.setattr(emulation, "_status", emulation.Status())
    emulation.register()  # must not raise: that would break every engine on the machine
    status = emulation.status()
    assert status.active == () and "toy_broken" in status.error
    assert "qstrat CPU emulation NOT registered: serializer 'toy_broken'" in caplog.text


# ---- bench rows: every registered quantizing format, with the peers it declares --------------
def _toy_peer(fmt, x):
    return (lambda: torch.sign(x).to(torch.int8)), f"torch.sign for {fmt}"


def test_a_plugin_format_gets_bench_rows_with_or_without_a_peer():
    class Peered(_Toy):
        name = "toy_peered"
        bench_peers = {"torch": _toy_peer}

    reg = Registry(plugins=[_plugin(_Toy, Peered)])
    assert bench_format_names() == ["block_fp8", "mxfp8", "nvfp4"]
    assert bench_format_names(reg) == ["toy_sign", "toy_peered", "block_fp8", "mxfp8", "nvfp4"]
    rows = bench_formats((32, 64), 1, registry=reg)
    by = {(r["format"], r["impl"]): r for r in rows}
    assert {impl for fmt, impl in by if fmt == "toy_sign"} == {"qstrat", "qstrat reference", "copy", "copy into",
                                                               NO_PEER}
    assert by[("toy_sign", NO_PEER)]["ms"] is None
    assert by[("toy_sign", NO_PEER)]["note"] == ("no peer: toy_sign declares no reference quantizer to compare "
                                                 "with (bench_peers)")
    assert by[("toy_sign", "qstrat")]["bytes_equal_reference"] is True
    assert {impl for fmt, impl in by if fmt == "toy_peered"} == {"qstrat", "qstrat reference", "copy", "copy into",
                                                                 "torch"}
    peer = by[("toy_peered", "torch")]
    assert peer["note"] == "torch.sign for toy_peered" and peer["ms"] > 0 and peer["speedup_vs_this"] > 0
    assert peer["bytes_equal_reference"] is None  # no mapping of its output to parts: not compared
    assert {impl for fmt, impl in by if fmt == "mxfp8"} >= {"vllm", "torchao"}  # the built-ins' peers
    assert (("block_fp8", NO_PEER) not in by) and ("block_fp8", "vllm") in by


def test_a_bench_peer_that_does_not_import_names_the_format():
    class Lost(_Toy):
        name = "toy_lost"
        bench_peers = {"vllm": "qstrat_no_such_module:peer"}

    with pytest.raises(PluginError, match=r"^serializer 'toy_lost': bench peer 'vllm' 'qstrat_no_such_module:peer' "
                                          "cannot be imported"):
        Lost.resolve_bench_peers()


# ---- configs as vLLM 0.32 reads them (spelling variants it accepts; what it refuses) ----------
_NESTED_NV = {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
ACCEPTED = [
    ("nvfp4", {"quant_method": "modelopt", "quant_algo": "nvfp4", "group_size": 16, "ignore": []}),
    ("nvfp4", {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "16", "ignore": []}),
    ("nvfp4", {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": []}),  # group_size defaults to 16
    ("nvfp4", {"quant_method": "modelopt", "quantization": _NESTED_NV}),
    ("nvfp4", {"quant_method": "modelopt_fp4", "quantization": _NESTED_NV}),
    ("nvfp4", {"producer": {"name": "modelopt", "version": "0.39.0"}, "quantization": _NESTED_NV}),
    ("mxfp8", {"quant_method": "mxfp8", "ignored_layers": ["lm_head", "mlp.gate"]}),  # MiniMax style
    ("mxfp8", {"quant_method": "modelopt", "quant_algo": "mxfp8", "ignore": []}),
    ("mxfp8", {"quant_method": "MODELOPT_MXFP8", "quant_algo": "MXFP8"}),
    ("mxfp8", {"quant_method": "modelopt", "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None,
                                                            "exclude_modules": []}}),
    ("block_fp8", {"quant_method": "FP8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
]
REFUSED = [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "sixteen"},
     "quantization_config.group_size: vLLM refuses 'sixteen' (must be an integer)"),
    ({"quant_method": "modelopt", "quantization": {k: v for k, v in _NESTED_NV.items() if k != "kv_cache_quant_algo"}},
     "quantization_config.quantization.kv_cache_quant_algo: missing; vLLM requires ['group_size', "
     "'kv_cache_quant_algo', 'exclude_modules'] in the nested ModelOpt form"),
    ({"quant_method": "modelopt", "quantization": "NVFP4"},
     "quantization_config.quantization: vLLM refuses 'NVFP4' (expected a mapping, the nested ModelOpt form)"),
    ({"quant_method": "modelopt", "quant_algo": "nvfp5"},
     "quantization_config.quant_algo: vLLM refuses 'nvfp5' (ModelOpt algorithms: FP8, FP8_PER_CHANNEL_PER_TOKEN, "
     "FP8_PB_WO, NVFP4, W4A16_NVFP4, MXFP8, MIXED_PRECISION)"),
    ({"quant_method": "modelopt"}, "quantization_config.quant_algo: missing; vLLM's ModelOpt config requires it"),
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None,
                                                         "exclude_modules": []}},
     "quantization_config.quantization.quant_algo: vLLM refuses 'MXFP8' in an hf_quant_config.json with producer "
     "modelopt (Unknown ModelOpt quant algo)"),
    ({"quant_method": "mxfp8", "quant_algo": "NVFP4"},
     "quantization_config.quant_algo: vLLM's MXFP8 config (quant_method 'mxfp8') refuses 'NVFP4'"),
]
_FORMATS = {c.name: c for c in BUILTIN_QUANTIZING}


def _vllm_parses(cfg):
    """vLLM 0.32's own reading of a checkpoint config: its method (with the ModelOpt overrides) and
    from_config; raises ValueError where vLLM refuses it."""
    import vllm.config  # noqa: F401 (imported first: the convertor module is part of an import cycle)
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    cfg = json.loads(json.dumps(cfg))
    norm = ModelArchConfigConvertorBase._normalize_quantization_config(None, types.SimpleNamespace(
        quantization_config=cfg))
    method = norm["quant_method"]
    for name in ("modelopt", "modelopt_fp4", "modelopt_mxfp8"):
        method = get_quantization_config(name).override_quantization_method(norm, None) or method
    return get_quantization_config(method).from_config(norm)


@pytest.mark.parametrize("fmt, cfg", ACCEPTED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(ACCEPTED)])
def test_what_vllm_accepts_is_the_formats_config(fmt, cfg):
    _vllm_parses(cfg)  # the oracle: vLLM accepts it
    assert type(engine_format(cfg, get_registry())) is _FORMATS[fmt]
    for other in BUILTIN_QUANTIZING:
        assert other.matches_engine_config(cfg) is (other is _FORMATS[fmt])


@pytest.mark.parametrize("cfg, reason", REFUSED, ids=range(len(REFUSED)))
def test_what_vllm_refuses_is_refused_naming_the_key(cfg, reason):
    with pytest.raises(ValueError):
        _vllm_parses(cfg)  # the oracle: vLLM refuses it
    for fmt in (MXFP8, NVFP4):
        assert fmt().engine_config_mismatch(cfg) == reason
    with pytest.raises(EngineManifestError, match=re.escape(f"mxfp8: {reason}; nvfp4: {reason}")):
        engine_format(cfg, get_registry())


def test_a_value_vllm_reads_differently_is_shown_both_ways():
    assert NVFP4().engine_config_mismatch({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "32"}) == \
        "quantization_config.group_size: engine has '32' (vLLM reads 32), nvfp4 writes 16"
    assert NVFP4().engine_config_mismatch({"quant_method": "mxfp8"}) == \
        "quantization_config.quant_algo: engine has none (vLLM reads 'MXFP8'), nvfp4 writes 'NVFP4'"


def test_the_quantization_config_is_read_where_vllm_reads_it():
    from qstrat.vllm import quantization_config_of

    nv = NVFP4().vllm_quantization_config(["lm_head"])
    assert quantization_config_of({"text_config": {"quantization_config": nv}}) == nv
    import transformers  # an HF config object (vLLM's hf_config): its text config is a sub-config object

    multimodal = transformers.AutoConfig.for_model("qwen3_5_moe")
    multimodal.text_config.quantization_config = nv
    assert quantization_config_of(multimodal) == nv
    assert quantization_config_of({"quantization_config": nv, "text_config": {"quantization_config": {"x": 1}}}) == nv
    assert quantization_config_of({"compression_config": {"quant_method": "compressed-tensors"}}) == {
        "quant_method": "compressed-tensors"}
    assert quantization_config_of({"text_config": {}}) is None
