"""Each format owns its engine contract: which engine quantization_config it serves
(``engine_config_mismatch`` / ``matches_engine_config``), its CPU emulation opt-in and its bench
peers; qstrat's format lists (the engine's format, the emulation list, the bench rows) are read
from the registry. The INT8 example plugin's side is in test_example_plugin.py."""
from __future__ import annotations

import types

import pytest
import torch

from qstrat import PlanError, RefitDriver
from qstrat.bench import NO_PEER, bench_format_names, bench_formats
from qstrat.engine import emulation
from qstrat.engine_manifest import engine_format, plan_format_mismatch
from qstrat.errors import EngineManifestError, PluginError
from qstrat.hookspecs import hookimpl
from qstrat.registry import Registry, get_registry
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
        "quantization_config.quant_method: engine has 'fp8', mxfp8 writes 'modelopt' "
        "(the engine does not serve the plan's format mxfp8)")
    assert plan_format_mismatch(plan, None, reg).startswith("engine quantization_config None does not match the plan's")
    # a part of a plan without a quantized entry (one rank's share) is checked with its config's format
    part = plan.subset(lambda e: e.serializer == "passthrough")
    assert part.entries and not any(e.serializer == "mxfp8" for e in part.entries)
    assert plan_format_mismatch(part, fp8, reg).startswith("quantization_config.quant_method: engine has 'fp8'")
    assert plan_format_mismatch(part, plan.vllm_quantization_config(), reg) is None


def test_check_engine_format_takes_the_drivers_registry(tiny_model, tiny_hf_config):
    from qstrat.vllm import check_engine_format

    reg = Registry(plugins=[_plugin(_Toy)])
    drv = RefitDriver({"rules": [{"select": "experts", "serializer": "toy_sign"}]}, hf_config=tiny_hf_config,
                      registry=reg)
    plan = drv.plan(tiny_model.state_dict())
    check_engine_format(plan, plan.vllm_quantization_config(), reg)
    with pytest.raises(PlanError, match=r"^quantization_config\.quant_method: engine has 'fp8', toy_sign writes 'toy'"):
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
