"""qstrat.vllm.refit against a recording stand-in for vllm.LLM: validation happens before any
RPC, and what reaches ``reload_weights`` is exactly driver.run's stream. (The real engine is
exercised in test_engine_refit.py.)"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import qstrat
from qstrat import NonFiniteError, PlanError, RefitDriver


class RecordingLLM:
    """Has what refit touches: llm_engine.model_config.hf_config and collective_rpc."""

    def __init__(self, quantization_config):
        hf = SimpleNamespace(quantization_config=quantization_config)
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf))
        self.calls = []

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, [(n, t.clone()) for n, t in kwargs["weights_iterator"]],
                           kwargs["is_checkpoint_format"]))


@pytest.fixture()
def driver(tiny_hf_config):
    return RefitDriver("block-fp8", hf_config=tiny_hf_config)


@pytest.mark.parametrize("stream", [False, True])
def test_refit_sends_exactly_the_run_stream(tiny_model, driver, stream):
    state = tiny_model.state_dict()
    llm = RecordingLLM(driver.plan(state).vllm_quantization_config())
    report = qstrat.vllm.refit(llm, driver, state, stream=stream)
    (method, sent, ckpt_format), = llm.calls
    assert method == "reload_weights" and ckpt_format is True
    expected = list(driver.run(state))
    assert [n for n, _ in sent] == [n for n, _ in expected]
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.contiguous().view(torch.uint8) if b.element_size() == 1 else b)
               for (_, a), (_, b) in zip(sent, expected))
    assert report.tensors == len(expected)
    assert report.bytes == sum(t.numel() * t.element_size() for _, t in expected)


def test_nan_is_found_before_anything_is_sent(tiny_model, driver):
    state = dict(tiny_model.state_dict())
    bad = state["model.layers.3.self_attn.o_proj.weight"].clone()
    bad[5, 9] = float("inf")
    state["model.layers.3.self_attn.o_proj.weight"] = bad
    llm = RecordingLLM(driver.plan(state).vllm_quantization_config())
    with pytest.raises(NonFiniteError, match=r"layers\.3\.self_attn\.o_proj\.weight: .*\[0, 5, 9\]"):
        qstrat.vllm.refit(llm, driver, state, stream=True)
    assert llm.calls == []


def test_engine_format_mismatch_is_refused(tiny_model, tiny_hf_config, driver):
    state = tiny_model.state_dict()
    fp8_config = driver.plan(state).vllm_quantization_config()
    mx = RefitDriver("mxfp8", hf_config=tiny_hf_config)
    llm = RecordingLLM(fp8_config)
    with pytest.raises(PlanError, match="quantization_config.quant_method: engine has 'fp8'"):
        qstrat.vllm.refit(llm, mx, state)
    with pytest.raises(PlanError, match="does not match"):
        qstrat.vllm.refit(RecordingLLM(None), driver, state)
    other_block = dict(fp8_config, weight_block_size=[64, 64])
    with pytest.raises(PlanError, match="weight_block_size"):
        qstrat.vllm.refit(RecordingLLM(other_block), driver, state)
    assert llm.calls == []


def test_bf16_into_modules_the_engine_serves_quantized_is_refused(tiny_model, tiny_hf_config, driver):
    state = tiny_model.state_dict()
    engine = RecordingLLM(driver.plan(state).vllm_quantization_config())  # every decoder linear in FP8
    kept = RefitDriver({"preset": "block-fp8", "keep_bf16": {"first": 1}}, hf_config=tiny_hf_config)
    with pytest.raises(PlanError, match=r"sends BF16 into modules the engine serves quantized .*"
                                        r"model\.layers\.0\.mlp\.experts"):
        qstrat.vllm.refit(engine, kept, state)
    experts_only = RefitDriver({"rules": [{"select": "experts", "serializer": "block_fp8"}]},
                               hf_config=tiny_hf_config)
    with pytest.raises(PlanError, match=r"model\.layers\.0\.self_attn\.q_proj"):
        qstrat.vllm.refit(engine, experts_only, state)
    assert engine.calls == []
    # The matching engine (started on a keep_bf16.first checkpoint) accepts it.
    ok = RecordingLLM(kept.plan(state).vllm_quantization_config())
    qstrat.vllm.refit(ok, kept, state)
    assert len(ok.calls) == 1


def test_wildcard_ignore_lists_are_understood(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    mx = RefitDriver("mxfp8-experts", hf_config=tiny_hf_config)
    cfg = dict(mx.plan(state).vllm_quantization_config(), ignore=["*self_attn*", "*mlp.gate", "lm_head"])
    qstrat.vllm.refit(RecordingLLM(cfg), mx, state)
    cfg["ignore"] = ["*self_attn*", "lm_head"]  # routers missing: the engine would quantize them
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.gate"):
        qstrat.vllm.refit(RecordingLLM(cfg), mx, state)


def test_refit_reads_each_weight_once_for_nan(tiny_model, driver, monkeypatch):
    import qstrat.serializers.base as base

    calls = []
    real = base.check_finite
    monkeypatch.setattr(base, "check_finite", lambda w3, name, chunk: (calls.append(name), real(w3, name, chunk)))
    state = tiny_model.state_dict()
    qstrat.vllm.refit(RecordingLLM(driver.plan(state).vllm_quantization_config()), driver, state)
    quantized = [e.name for e in driver.plan(state).entries if e.serializer != "passthrough"]
    assert sorted(n for n in calls if n in quantized) == sorted(quantized)  # once each, up front


class FileReadingLLM(RecordingLLM):
    """Reads the folder ``reload_weights(weights_path=...)`` names, as the engine's loader would."""

    def collective_rpc(self, method, kwargs):
        from safetensors.torch import load_file

        folder = kwargs["weights_path"]
        files = sorted(p.name for p in Path(folder).iterdir())
        self.calls.append((method, folder, files, load_file(f"{folder}/model.safetensors"),
                           kwargs["is_checkpoint_format"], "weights_iterator" in kwargs))


def test_refit_through_a_file_sends_the_same_payload_and_cleans_up(tiny_model, driver, tmp_path):
    """``weights_dir`` (multiprocess engines): one safetensors file in a fresh folder under it,
    exactly driver.run's tensors, the folder gone afterwards; ``stream`` with it is refused."""
    state = tiny_model.state_dict()
    llm = FileReadingLLM(driver.plan(state).vllm_quantization_config())
    report = qstrat.vllm.refit(llm, driver, state, weights_dir=tmp_path)
    (method, folder, files, sent, ckpt_format, has_iterator), = llm.calls
    assert method == "reload_weights" and ckpt_format is True and not has_iterator
    assert Path(folder).parent == tmp_path and files == ["model.safetensors"]
    assert not Path(folder).exists() and list(tmp_path.iterdir()) == []
    expected = dict(driver.run(state))
    assert sent.keys() == expected.keys() and report.tensors == len(expected)
    assert all(torch.equal(sent[n].view(torch.uint8), t.contiguous().view(torch.uint8))
               for n, t in expected.items())
    with pytest.raises(ValueError, match="stream=True.*weights_dir"):
        qstrat.vllm.refit(llm, driver, state, stream=True, weights_dir=tmp_path)
    assert len(llm.calls) == 1
