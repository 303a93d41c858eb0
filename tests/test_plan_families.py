"""The planner's speed paths plan exactly what the full way plans (issue 25: DeepSeek-V3 <= 0.5 s).

- frozen digests: the whole plan (``to_json``: every entry, output, group, rule; the engine's
  quantization_config and ignore list) and its wire order, for the models the bench and the docs
  plan, as main computed them BEFORE the speed paths existed (``_digest`` below; a deliberate
  change of what a plan holds updates them: run this module with ``-s`` and read the printed
  digests);
- the family memo (:mod:`qstrat.plan.families`) against the full way, tensor by tensor, and the
  configs it must refuse (a plugin selector reading the layer, include patterns, renames);
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

import qstrat
import qstrat.plan.planner as planner_module
from qstrat import RefitDriver
from qstrat.plan.data import OutputTensor, PlanEntry
from qstrat.plan.families import Families, families_for
from qstrat.layouts.skeleton import model_tensors

from conftest import model_config

#: gpt-oss-120b's config.json (the fields planning reads): grouped, transposed expert slabs.
GPT_OSS_120B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
                "intermediate_size": 2880, "num_hidden_layers": 36, "num_local_experts": 128,
                "num_experts_per_tok": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
                "head_dim": 64, "vocab_size": 201088, "attention_bias": True, "tie_word_embeddings": False}
BF16_EXPERTS = {"select": ["experts"], "serializer": "bf16"}
LAYER_PATTERNS = {"select": ["experts"], "serializer": "bf16", "include": ["*.layers.1?.*", r"re:layers\.5[0-3]\."]}

#: case -> (model config, refit config, grouped slabs, name prefix, tensors, digest). Digests
#: computed on main at 6bcb682 (before the speed paths), recomputed when plans gained `quantize_in` and
#: `engine_quantization` (every entry and the wire order unchanged); bench's plan section is the first case.
CASES = {
    "deepseek-v3 block-fp8": ("deepseek-v3", {"preset": "block-fp8"}, False, "", 46183,
                              "f595ecf123ad8e9941f561f63b3aa43130f4091c0241ae4015319d9ca08bceb3"),
    "deepseek-v3 nvfp4-experts producer": (
        "deepseek-v3", {"preset": "nvfp4-experts", "wire_order": "producer"}, False, "", 46183,
        "e7f7c67e0557073f2ed844761d46e377591fb3df3222648a01b10bef06383756"),
    "deepseek-v3 include patterns": ("deepseek-v3", {"preset": "block-fp8", "rules": [LAYER_PATTERNS]}, False, "",
                                     46183, "fe9e856c22fa90a5e158576bd0d35cf7599ce5e5f33c580a9b9f7527ed0c75a9"),
    "qwen3-235b block-fp8": ("qwen3-235b-a22b", {"preset": "block-fp8"}, False, "", 36945,
                             "134843391caf3ebe2363ae265b1dd700fd8f4712826006f76c14976a2ba0013d"),
    "qwen3-235b mxfp8-experts keep_bf16": (
        "qwen3-235b-a22b", {"preset": "mxfp8-experts", "keep_bf16": {"first": 1, "last": 2}}, False, "", 36945,
        "e5cc72ea70db7383d62cceec4a651a7a7facce04ba790f732b3a3f1c2d43d2e9"),
    "qwen3-235b grouped block-fp8": ("qwen3-235b-a22b", {"preset": "block-fp8"}, True, "", 1037,
                                     "6e5f34ed9e06883379483bdca945cef81dd7954acfee92694750abd6d43b4899"),
    "qwen3-235b grouped fused mxfp8": (
        "qwen3-235b-a22b", {"preset": "mxfp8", "expert_emission": "fused"}, True, "", 1037,
        "9e4f12a2bd36b98aa489997503a220d2e1fe352febe3bfb83e0ea88d9ee8d731"),
    "qwen3-235b DDP-prefixed nvfp4-experts": (
        "qwen3-235b-a22b", {"preset": "nvfp4-experts"}, False, "module.", 36945,
        "e19d1948f7e116005d0b53e33e2572e5538b687f69d58905374b708d5fd78846"),
    "gpt-oss-120b block-fp8": (GPT_OSS_120B, {"preset": "block-fp8", "rules": [BF16_EXPERTS]}, True, "", 615,
                               "1aab5bc2d6e4857fc38e3e288d81c2e07113b08af8eae5e0691367ee214dea70"),
}


def _hf(model):
    return model if isinstance(model, dict) else model_config(model)


def _tensors(driver, hf, grouped, prefix=""):
    return {prefix + n: torch.empty(s, dtype=torch.bfloat16, device="meta")
            for n, s in model_tensors(driver.layout, hf, grouped)}


def _digest(plan) -> str:
    h = hashlib.sha256(plan.to_json().encode())
    h.update(json.dumps([(i, o.name, list(o.shape), o.dtype, o.nbytes, o.suffix, o.expert, o.row_part, o.row_parts)
                         for i, o in plan.wire_order()]).encode())
    return h.hexdigest()


@pytest.mark.parametrize("case", list(CASES))
def test_plan_equals_the_frozen_digest(case):
    model, config, grouped, prefix, count, digest = CASES[case]
    hf = _hf(model)
    driver = RefitDriver(config, hf_config=hf)
    tensors = _tensors(driver, hf, grouped, prefix)
    plan = driver.plan(tensors)
    print(f"{case!r}: {_digest(plan)!r}")
    assert len(tensors) == count
    assert _digest(plan) == digest


def _full_way(monkeypatch, driver, tensors):
    """The plan with the family memo off: every entry planned by Planner.entry."""
    with monkeypatch.context() as m:
        m.setattr(planner_module, "families_for", lambda *a: None)
        return driver.plan(tensors)


class _Counting(Families):
    """Counts the entries the memo derived (so a test cannot pass with the memo unused)."""

    derived = 0

    def entry(self, name, shape, dtype):
        e = super().entry(name, shape, dtype)
        _Counting.derived += e is not None
        return e


@pytest.mark.parametrize("model,config,derived_at_least", [
    ("deepseek-v3", {"preset": "block-fp8"}, 43000),
    ("qwen3-235b-a22b", {"preset": "nvfp4-experts", "keep_bf16": {"first": 2, "last": 3}}, 34000),
])
def test_family_memo_equals_the_full_way(monkeypatch, model, config, derived_at_least):
    hf = model_config(model)
    driver = RefitDriver(config, hf_config=hf)
    tensors = _tensors(driver, hf, grouped=False)
    monkeypatch.setattr(_Counting, "derived", 0)

    def counting(layout, rules, num_layers):
        f = families_for(layout, rules, num_layers)
        return None if f is None else _Counting(f.prefix, f.num_layers, f.first, f.last)

    monkeypatch.setattr(planner_module, "families_for", counting)
    fast = driver.plan(tensors)
    assert _Counting.derived >= derived_at_least
    slow = _full_way(monkeypatch, driver, tensors)
    assert fast.entries == slow.entries  # entry by entry: every field, every output
    assert fast.to_json() == slow.to_json()
    assert fast.wire_order() == slow.wire_order()


def test_family_memo_refused_for_a_layer_dependent_selector(monkeypatch):
    """A plugin selector may read the layer: the memo is off and odd layers alone are quantized."""
    from qstrat.hookspecs import hookimpl
    from qstrat.plugins.selector import Selector

    class OddLayers:
        @hookimpl
        def qstrat_selectors(self):
            return [Selector("odd_layers", "experts of odd layers", lambda p: p.kind == "expert" and p.layer % 2 == 1)]

    reg = qstrat.Registry(plugins=[OddLayers()])
    hf = {**model_config("qwen3-235b-a22b"), "num_hidden_layers": 6, "num_experts": 4}
    driver = RefitDriver({"rules": [{"select": ["odd_layers"], "serializer": "mxfp8"}]}, hf_config=hf, registry=reg)
    assert families_for(driver.layout, driver.rules, 6) is None
    plan = driver.plan(_tensors(driver, hf, grouped=False))
    fmt = {e.name: e.serializer for e in plan.entries}
    for layer in range(6):
        assert fmt[f"model.layers.{layer}.mlp.experts.3.up_proj.weight"] == ("mxfp8" if layer % 2 else "bf16")


def test_family_memo_refused_for_patterns_renames_and_parser_overrides():
    hf = model_config("deepseek-v3")
    assert families_for((d := RefitDriver("block-fp8", hf_config=hf)).layout, d.rules, 61) is not None
    patterns = RefitDriver({"preset": "block-fp8", "rules": [LAYER_PATTERNS]}, hf_config=hf)
    assert families_for(patterns.layout, patterns.rules, 61) is None
    excluded = RefitDriver({"preset": "block-fp8", "rules": [{**BF16_EXPERTS, "exclude": ["*.experts.0.*"]}]},
                           hf_config=hf)
    assert families_for(excluded.layout, excluded.rules, 61) is None
    mixtral = RefitDriver("block-fp8", hf_config={"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2})
    assert mixtral.layout.renames and families_for(mixtral.layout, mixtral.rules, 2) is None

    class OwnParser(type(d.layout)):
        def _in_mlp(self, module, t):
            return super()._in_mlp(module, t)

    own = OwnParser(**{f.name: getattr(d.layout, f.name) for f in dataclasses.fields(d.layout)})
    assert families_for(own, d.rules, 61) is None


def test_a_family_whose_second_member_differs_is_never_derived():
    fam = Families("model.layers.", 4, 0, 0)
    out = OutputTensor("model.layers.0.mlp.down_proj.weight", (8, 16), "bfloat16", 256)
    first = PlanEntry("model.layers.0.mlp.down_proj.weight", (8, 16), "bfloat16", "dense_mlp", 0, None,
                      "default", "bf16", {}, (out,), None, "", "model.layers.0.mlp.down_proj")
    shape, dtype = (8, 16), torch.bfloat16
    fam.learn(first.name, shape, dtype, first)
    name2 = "model.layers.1.mlp.down_proj.weight"
    assert fam.entry(name2, shape, dtype) is None  # one member: not verified yet
    derived = fam.recipes[next(iter(fam.recipes))].derive(name2, "model.layers.1.", 1)
    assert derived.outputs[0].name == name2 and derived.engine_module == "model.layers.1.mlp.down_proj"
    fam.learn(name2, shape, dtype, dataclasses.replace(derived, note="planned otherwise"))
    for layer in (2, 3):
        assert fam.entry(f"model.layers.{layer}.mlp.down_proj.weight", shape, dtype) is None
    assert fam.entry("model.layers.4.mlp.down_proj.weight", shape, dtype) is None  # past the depth: MTP
    assert fam.key("model.layers.x.mlp.down_proj.weight", shape, dtype) is None


def test_a_verified_family_derives_its_members():
    fam = Families("model.layers.", None, 1, 0)
    shape, dtype = (8, 16), torch.bfloat16

    def entry(layer):
        p = f"model.layers.{layer}."
        outs = (OutputTensor(p + "mlp.up_proj.weight", shape, "float8_e4m3fn", 128),
                OutputTensor(p + "mlp.up_proj.weight_scale_inv", (1, 1), "float32", 4, "weight_scale_inv"))
        return PlanEntry(p + "mlp.up_proj.weight", shape, "bfloat16", "dense_mlp", layer, None, "rules[0]",
                         "block_fp8", {}, outs, p + "mlp.{gate_proj,up_proj}", "", p + "mlp.up_proj")

    fam.learn(entry(1).name, shape, dtype, entry(1))
    fam.learn(entry(2).name, shape, dtype, entry(2))
    assert fam.entry(entry(7).name, shape, dtype) == entry(7)
    assert fam.entry(entry(0).name, shape, dtype) is None  # kept by keep_bf16.first: another family
