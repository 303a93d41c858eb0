"""qstrat.execute.stream: streamed runs, wire orders, batched per-expert quantization, a partial (whole-layer)
refit. Expert-parallel plans: tests/test_sharding.py."""
from __future__ import annotations

import pytest
import torch
from test_driver_run import per_expert_view, u8

from qstrat import PlanError, RefitDriver, tensor_specs
from qstrat.serializers.base import Serializer


def same_bytes(a, b):
    """Two emitted streams: same names in the same order, identical bytes and dtypes."""
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(u8(x), u8(y)), name


def spy_quantize(monkeypatch):
    """Record (leading dim, data_ptr) of every serializer call's input."""
    calls = []
    original = Serializer.quantize

    def spy(self, w, **kw):
        calls.append((w.shape[0] if w.dim() == 3 else None, w.untyped_storage().data_ptr(), tuple(w.shape), kw.get("name")))
        return original(self, w, **kw)
    monkeypatch.setattr(Serializer, "quantize", spy)
    return calls


@pytest.mark.parametrize("preset", ["block-fp8", "mxfp8-experts", "nvfp4-experts"])
def test_batched_per_expert_equals_one_call_per_expert(tiny_model, tiny_hf_config, preset, monkeypatch):
    state = per_expert_view(tiny_model.state_dict())   # 8 experts x 4 layers, views of the slabs
    copies = {n: t.clone() for n, t in state.items()}  # same values, separate tensors: scratch path
    calls = spy_quantize(monkeypatch)
    one = list(RefitDriver({"preset": preset, "expert_batch": 1}, hf_config=tiny_hf_config).run(state))
    single_expert_calls = [c for c in calls if ".experts." in c[3]]
    assert single_expert_calls and all(c[0] is None for c in single_expert_calls)
    others = len(calls) - len(single_expert_calls)
    calls.clear()
    driver = RefitDriver({"preset": preset, "expert_batch": 3}, hf_config=tiny_hf_config)
    same_bytes(list(driver.run(state)), one)    # views of one slab: read in place
    assert {c[1] for c in calls if c[0]} <= {t.untyped_storage().data_ptr() for t in tiny_model.state_dict().values()}
    view_calls = len(calls)
    same_bytes(list(driver.run(copies)), one)   # separate tensors: stacked into scratch
    # 8 experts in batches of 3, 3, 2 per (layer, projection): 3 calls instead of 8
    expert_calls = [c for c in calls if ".experts." in c[3]]
    assert sorted({c[0] for c in expert_calls}) == [2, 3]
    assert view_calls == len(calls) - view_calls == others + len(single_expert_calls) // 8 * 3
    # the copy path stacks into one scratch per shape, reused from call to call
    copy_calls = [c for c in calls[view_calls:] if c[0]]
    by_shape = {}
    for b, ptr, shape, _ in copy_calls:
        by_shape.setdefault(shape[1:], set()).add(ptr)
    assert by_shape and all(len(ptrs) == 1 for ptrs in by_shape.values())


def test_streamed_run_equals_mapping_run_in_both_orders(tiny_model, tiny_hf_config):
    state = per_expert_view(tiny_model.state_dict())
    items = list(state.items())
    # a producer that yields each layer in its own order: q/k/v last, experts backwards
    def layer_of(name):
        return int(name.split(".")[2]) if name.startswith("model.layers.") else -1
    shuffled = sorted(items, key=lambda kv: (layer_of(kv[0]) if layer_of(kv[0]) >= 0 else
                                              (-1 if "embed" in kv[0] else 99), "self_attn" in kv[0],
                                              -int(kv[0].split(".")[5]) if ".experts." in kv[0] else 0))
    for order, rules in (("natural", ["experts", "attention"]), ("producer", ["attention"])):
        # NVFP4: fused q/k/v (and gate/up) share a global scale, so a member waits for its siblings
        cfg = {"wire_order": order, "rules": [{"select": rules, "serializer": "nvfp4"}]}
        driver = RefitDriver(cfg, hf_config=tiny_hf_config)
        plan = driver.plan(tensor_specs((n, tuple(t.shape), t.dtype) for n, t in shuffled))
        streamed = list(driver.run(iter(shuffled), plan=plan))
        same_bytes(streamed, list(driver.run(dict(shuffled))))
        assert [n for n, _ in streamed] == [o.name for o in plan.outputs()]
        if order == "natural":  # model order, whatever the producer's
            assert streamed[0][0] == "model.embed_tokens.weight" and streamed[-2][0] == "lm_head.weight"
            assert [n for n, _ in streamed] == [o.name for o in driver.plan(state).outputs()]
        else:  # producer order: inputs as yielded, each input's outputs together
            inputs = [n.removesuffix(".weight") for n, _ in shuffled]
            firsts = [n for n, _ in streamed if n.endswith(".weight") or n.rsplit(".", 1)[0] not in inputs]
            assert [f.removesuffix(".weight") for f in firsts] == inputs


def test_stream_mismatches_name_the_tensor(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan = driver.plan(tensor_specs(state))
    items = list(state.items())
    with pytest.raises(PlanError, match=r"model\.extra\.weight: not in the plan"):
        list(driver.run(iter(items + [("model.extra.weight", torch.zeros(2, 2))]), plan=plan))
    with pytest.raises(PlanError, match=r"lm_head\.weight: planned, but the input stream ended"):
        list(driver.run(iter(i for i in items if i[0] != "lm_head.weight"), plan=plan))
    bad = [(n, t[:, :128] if n == "model.layers.1.self_attn.o_proj.weight" else t) for n, t in items]
    with pytest.raises(PlanError, match=r"o_proj\.weight: arrived as bfloat16\[256, 128\], planned as bfloat16\[256, 256\]"):
        list(driver.run(iter(bad), plan=plan))
    with pytest.raises(PlanError, match=r"model\.norm\.weight: given twice"):
        list(driver.run(iter(items + [items[-2]]), plan=plan))
    with pytest.raises(PlanError, match="made with another config"):
        next(RefitDriver("mxfp8", hf_config=tiny_hf_config).run(iter(items), plan=plan))


def test_only_whole_layers_are_refit(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan = driver.plan(tensor_specs(state))
    part = plan.only_layers([2])
    whole = dict(driver.run(state))
    got = list(driver.run(iter(state.items()), plan=part))  # the whole model's stream, others dropped
    layer2 = [o.name for o in plan.outputs() if o.name.startswith("model.layers.2.")]
    assert [n for n, _ in got] == layer2 and len(layer2) == 4 * 2 + 2 + 2 + 1 + 8 * 3 * 2  # q/k/v/o, q/k norms, layernorms, router, experts
    assert all(torch.equal(u8(t), u8(whole[n])) for n, t in got)
    assert part.vllm_quantization_config() == plan.vllm_quantization_config()
    with pytest.raises(PlanError, match=r"layers \[7\] are not in the plan"):
        plan.only_layers([2, 7])


def test_checkpoint_from_a_stream_equals_checkpoint_from_a_mapping(tiny_model, tiny_hf_config, tmp_path):
    from qstrat.execute.checkpoint import load_checkpoint, write_checkpoint

    state = tiny_model.state_dict()
    driver = RefitDriver("mxfp8-experts", hf_config=tiny_hf_config)
    plan = driver.plan(tensor_specs(state))
    write_checkpoint(driver, iter(state.items()), tmp_path / "streamed", plan=plan, shard_bytes=1 << 20)
    write_checkpoint(driver, state, tmp_path / "whole", shard_bytes=1 << 20)
    a, b = load_checkpoint(tmp_path / "streamed"), load_checkpoint(tmp_path / "whole")
    assert a.keys() == b.keys() and all(torch.equal(u8(a[k]), u8(b[k])) for k in a)
    assert (tmp_path / "streamed" / "model.safetensors.index.json").read_text() == \
        (tmp_path / "whole" / "model.safetensors.index.json").read_text()
    short = (kv for kv in state.items() if kv[0] != "lm_head.weight")
    with pytest.raises(PlanError, match="lm_head.weight: planned, but the input stream ended"):
        write_checkpoint(driver, short, tmp_path / "broken", plan=plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["streamed", "whole"]  # nothing left behind
