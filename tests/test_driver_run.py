"""Running a refit on the tiny Qwen3-MoE: bytes, names, wire order, sinks."""
from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import per_expert_view

import qstrat
from qstrat import NonFiniteError, RefitDriver
from qstrat.execute.checkpoint import lazy_checkpoint, load_checkpoint, write_checkpoint
from qstrat.plan import natural_key


def u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


@pytest.mark.parametrize("preset", ["block-fp8", "mxfp8", "mxfp8-experts", "nvfp4-experts"])
def test_grouped_slabs_and_per_expert_names_give_identical_checkpoints(tiny_model, tiny_hf_config, preset):
    state = tiny_model.state_dict()
    driver = RefitDriver(preset, hf_config=tiny_hf_config)
    grouped = list(driver.run(state))
    per_expert = list(driver.run(per_expert_view(state)))
    assert [n for n, _ in grouped] == [n for n, _ in per_expert]
    for (name, a), (_, b) in zip(grouped, per_expert):
        assert a.dtype == b.dtype and torch.equal(u8(a), u8(b)), name


def test_run_emits_exactly_the_plan_in_wire_order(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan = driver.plan(state)
    emitted = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in driver.run(state)]
    assert emitted == [(o.name, o.shape, o.dtype) for o in plan.outputs()]
    names = [n for n, _, _ in emitted]
    assert "model.layers.0.mlp.gate.weight" in names  # router sent, unquantized
    expert_scale = dict(driver.run(state))["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"]
    half = state["model.layers.2.mlp.experts.gate_up_proj"][5, 128:]
    assert torch.equal(expert_scale, qstrat.get_serializer("block_fp8").quantize(half)["weight_scale_inv"])


def test_fused_emission_equals_per_expert_bytes(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    fused = dict(RefitDriver({"preset": "block-fp8", "expert_emission": "fused"}, hf_config=tiny_hf_config).run(state))
    split = dict(RefitDriver("block-fp8", hf_config=tiny_hf_config).run(state))
    slab = fused["model.layers.1.mlp.experts.gate_up_proj"]
    scale = fused["model.layers.1.mlp.experts.gate_up_proj_scale_inv"]
    assert torch.equal(u8(slab[3, :128]), u8(split["model.layers.1.mlp.experts.3.gate_proj.weight"]))
    assert torch.equal(scale[3, 1:], split["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"])


def test_checkpoint_sink_writes_config_and_plan(tiny_model, tiny_hf_config, tmp_path):
    state = tiny_model.state_dict()
    driver = RefitDriver({"preset": "block-fp8", "keep_bf16": {"last": 1}}, hf_config=tiny_hf_config)
    plan = write_checkpoint(driver, state, tmp_path / "ckpt", shard_bytes=1 << 20)
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    # the plan's config, its ignore list also naming the kept layer's fused q/k/v as vLLM calls it
    mine = plan.vllm_quantization_config()
    assert cfg["quantization_config"] == {**mine, "ignored_layers": sorted(
        [*mine["ignored_layers"], "model.layers.3.self_attn.qkv_proj"], key=natural_key)}
    assert "model.layers.3.self_attn.q_proj" in cfg["quantization_config"]["ignored_layers"]
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()  # sharded at 1 MiB
    stored = load_checkpoint(tmp_path / "ckpt")
    assert {n: tuple(t.shape) for n, t in stored.items()} == {o.name: o.shape for o in plan.outputs()}
    assert stored["model.layers.3.self_attn.q_proj.weight"].dtype == torch.bfloat16
    # The written checkpoint plans again from headers only (qstrat plan / quantize input).
    lazy = lazy_checkpoint(tmp_path / "ckpt")
    assert lazy["model.layers.0.mlp.experts.1.down_proj.weight"].dtype == torch.float8_e4m3fn


def test_nan_names_the_tensor_and_writes_nothing(tiny_model, tiny_hf_config, tmp_path):
    state = dict(tiny_model.state_dict())
    bad = state["model.layers.2.mlp.experts.down_proj"].clone()
    bad[6, 17, 3] = float("nan")
    state["model.layers.2.mlp.experts.down_proj"] = bad
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    with pytest.raises(NonFiniteError, match=r"model\.layers\.2\.mlp\.experts\.down_proj: .*\[6, 17, 3\]"):
        write_checkpoint(driver, state, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.iterdir())  # no temporary directory left behind either


@pytest.mark.parametrize("preset", ["block-fp8", "nvfp4-experts"])
def test_nan_in_a_batched_per_expert_tensor_names_that_expert(tiny_model, tiny_hf_config, preset):
    """Per-expert inputs are quantized in stacked batches; the NaN check runs inside that one
    call (no separate read pass) and the error still names the expert's own tensor and index."""
    state = per_expert_view(dict(tiny_model.state_dict()))
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    bad = state[name].clone()
    bad[17, 3] = float("nan")
    state[name] = bad
    driver = RefitDriver(preset, hf_config=tiny_hf_config)
    emitted = []
    with pytest.raises(NonFiniteError) as info:
        for out_name, _ in driver.run(state):
            emitted.append(out_name)
    assert str(info.value) == (f"{name}: non-finite value nan at index [17, 3] (row, col); "
                               "set nonfinite='propagate' to encode it anyway")
    assert not any(n.startswith("model.layers.1.mlp.experts.") and ".down_proj." in n for n in emitted)


def test_plan_errors_before_any_output(tiny_model, tiny_hf_config):
    state = dict(tiny_model.state_dict())
    state["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(128, 256)
    gen = RefitDriver("block-fp8", hf_config=tiny_hf_config).run(state)
    with pytest.raises(qstrat.PlanError, match="both emit"):
        next(gen)


def test_meta_tensors_plan_but_lazy_tensors_run(tiny_model, tiny_hf_config, tmp_path):
    from qstrat.cli.demo.tiny_model import save_bf16

    save_bf16(tiny_model, tmp_path / "bf16")
    lazy = lazy_checkpoint(tmp_path / "bf16")
    driver = RefitDriver("mxfp8", hf_config=tiny_hf_config)
    from_disk = dict(driver.run(lazy))
    from_memory = dict(driver.run(tiny_model.state_dict()))
    assert from_disk.keys() == from_memory.keys()
    assert all(torch.equal(u8(from_disk[k]), u8(from_memory[k])) for k in from_disk)


def test_nvfp4_fused_shards_share_one_global_scale(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    cfg = {"rules": [{"select": ["experts", "attention"], "serializer": "nvfp4"}]}
    out = dict(RefitDriver(cfg, hf_config=tiny_hf_config).run(state))
    p = "model.layers.2"
    gate, up = out[f"{p}.mlp.experts.4.gate_proj.weight_scale_2"], out[f"{p}.mlp.experts.4.up_proj.weight_scale_2"]
    slab = state[f"{p}.mlp.experts.gate_up_proj"][4].float()
    assert gate.shape == () and torch.equal(gate, up)
    assert torch.isclose(gate, slab.abs().max() / 2688, rtol=2 ** -22)
    q, k, v = (out[f"{p}.self_attn.{x}_proj.weight_scale_2"] for x in "qkv")
    assert torch.equal(q, k) and torch.equal(k, v)
    qkv_amax = max(float(state[f"{p}.self_attn.{x}_proj.weight"].float().abs().max()) for x in "qkv")
    assert torch.isclose(q, torch.tensor(qkv_amax / 2688), rtol=2 ** -22)
    o = out[f"{p}.self_attn.o_proj.weight_scale_2"]  # not fused: its own amax
    assert torch.isclose(o, state[f"{p}.self_attn.o_proj.weight"].float().abs().max() / 2688, rtol=2 ** -22)
    # down_proj is not fused with anything: per-expert amax of its own slab row
    down = out[f"{p}.mlp.experts.4.down_proj.weight_scale_2"]
    assert torch.isclose(down, state[f"{p}.mlp.experts.down_proj"][4].float().abs().max() / 2688, rtol=2 ** -22)


def test_nvfp4_plan_config_and_names(tiny_model, tiny_hf_config):
    plan = RefitDriver("nvfp4-experts", hf_config=tiny_hf_config).plan(tiny_model.state_dict())
    qc = plan.vllm_quantization_config()
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and qc["group_size"] == 16
    assert "model.layers.0.mlp.experts" in qc["ignore"] and "model.layers.3.mlp.experts" in qc["ignore"]
    assert "model.layers.1.mlp.experts" not in qc["ignore"]
    outs = {o.name: (o.shape, o.dtype) for o in plan.outputs() if ".layers.1.mlp.experts.2.gate_proj" in o.name}
    assert outs == {
        "model.layers.1.mlp.experts.2.gate_proj.weight": ((128, 128), "uint8"),
        "model.layers.1.mlp.experts.2.gate_proj.weight_scale": ((128, 16), "float8_e4m3fn"),
        "model.layers.1.mlp.experts.2.gate_proj.weight_scale_2": ((), "float32"),
        "model.layers.1.mlp.experts.2.gate_proj.input_scale": ((), "float32")}


def test_nvfp4_checkpoint_from_grouped_slabs(tiny_model, tiny_hf_config, tmp_path):
    state = tiny_model.state_dict()
    driver = RefitDriver("nvfp4-experts", hf_config=tiny_hf_config)
    plan = write_checkpoint(driver, state, tmp_path / "nvfp4")
    stored = load_checkpoint(tmp_path / "nvfp4")
    assert {n: tuple(t.shape) for n, t in stored.items()} == {o.name: o.shape for o in plan.outputs()}
    gate = stored["model.layers.1.mlp.experts.3.gate_proj.weight_scale_2"]
    assert torch.equal(gate, stored["model.layers.1.mlp.experts.3.up_proj.weight_scale_2"])


def test_nan_in_a_passthrough_tensor_is_an_error(tiny_model, tiny_hf_config):
    state = dict(tiny_model.state_dict())
    norm = state["model.layers.1.input_layernorm.weight"].clone()
    norm[7] = float("nan")
    state["model.layers.1.input_layernorm.weight"] = norm
    with pytest.raises(NonFiniteError, match=r"^model\.layers\.1\.input_layernorm\.weight: non-finite value nan at "
                                             r"index \[7\]; set"):
        list(RefitDriver("block-fp8", hf_config=tiny_hf_config).run(state))


def test_meta_tensors_cannot_run(tiny_hf_config):
    t = {"model.layers.0.self_attn.q_proj.weight": torch.empty(128, 256, device="meta")}
    with pytest.raises(qstrat.PlanError, match=r"q_proj\.weight: is a meta tensor"):
        list(RefitDriver("block-fp8", hf_config=tiny_hf_config).run(t))


# ---- the plan cache (RefitDriver.plan_cache): one plan per metadata ----------------------------
def _meta(state):
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in state.items()}


def test_the_same_metadata_gets_the_same_plan_object(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan = driver.plan(state)
    assert driver.plan(state) is plan
    assert driver.plan(_meta(state)) is plan  # values are not metadata: meta copies plan alike
    assert driver.plan(list(state.items())) is plan
    assert driver.prepare(state).plan is plan  # every sink's plan step (vllm.refit, TRL's sync, transport)
    assert plan.to_json() == RefitDriver("block-fp8", hf_config=tiny_hf_config).plan(state).to_json()


def _renamed(state):
    first = next(iter(state))
    return {("module." + n if n == first else n): t for n, t in state.items()}


@pytest.mark.parametrize("change,reason", [
    ("rename", "names"), ("add", "names"), ("drop", "names"), ("reorder", "names"),
    ("reshape", "model.layers.1.mlp.experts.down_proj: shape [8, 128, 256], planned [8, 256, 128]"),
    ("recast", "model.norm.weight: dtype torch.float32, planned torch.bfloat16"),
    ("hf_config", "hf_config")])
def test_changed_metadata_plans_again(tiny_model, tiny_hf_config, change, reason):
    """Every kind of change misses the kept plan (PlanCache's one rule), says which it was, and
    gets the plan a fresh driver makes; the same input again is then a hit."""
    state = _meta(tiny_model.state_dict())
    without_norm = {n: t for n, t in state.items() if n != "model.norm.weight"}
    driver = RefitDriver({"preset": "block-fp8", "wire_order": "producer"}, hf_config=tiny_hf_config)
    plan = driver.plan(without_norm if change == "add" else state)
    assert driver.plan_cache.miss == "empty"
    name = "model.layers.1.mlp.experts.down_proj"
    changed = {
        "rename": lambda: _renamed(state),
        "add": lambda: state,
        "drop": lambda: without_norm,
        "reorder": lambda: dict(reversed(list(state.items()))),
        "reshape": lambda: {**state, name: torch.empty(state[name].shape[0], 128, 256, dtype=torch.bfloat16,
                                                       device="meta")},
        "recast": lambda: {**state, "model.norm.weight": state["model.norm.weight"].float()},
        "hf_config": lambda: state,
    }[change]()
    if change == "hf_config":
        driver.hf_config["tie_word_embeddings"] = not driver.hf_config.get("tie_word_embeddings", False)
    again = driver.plan(changed)
    assert again is not plan
    assert driver.plan_cache.miss == reason
    fresh = RefitDriver({"preset": "block-fp8", "wire_order": "producer"}, hf_config=driver.hf_config)
    assert again.to_json() == fresh.plan(changed).to_json()
    assert driver.plan(changed) is again and driver.plan_cache.miss is None
    assert driver.plan(dict(changed)) is again  # a new mapping of the same tensors: a hit


def test_a_failed_plan_is_not_kept(tiny_model, tiny_hf_config):
    state = _meta(tiny_model.state_dict())
    bad = {**state, "model.norm.weight": torch.empty(64, dtype=torch.int64, device="meta")}
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan = driver.plan(state)
    for _ in range(2):  # each call raises its own error, the kept plan stays the good one
        with pytest.raises(qstrat.PlanError, match=r"model\.norm\.weight: .*needs a bfloat16/float16/float32"):
            driver.plan(bad)
        assert driver.plan(state) is plan


@pytest.mark.parametrize("bad", ["none", "numpy", "list"])
def test_a_kept_plan_is_not_served_for_values_that_are_not_tensors(tiny_model, tiny_hf_config, bad):
    """A dict input is looked up before it is validated (the warm path): a value that is not a
    tensor - of the same name, even with a ``.shape`` - still gets the input error, never the plan."""
    import numpy as np

    state = tiny_model.state_dict()
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan = driver.plan(state)
    name = "model.norm.weight"
    value = {"none": None, "numpy": np.zeros(tuple(state[name].shape), dtype=np.float32),
             "list": [0.0] * state[name].shape[0]}[bad]
    with pytest.raises(qstrat.PlanError, match=rf"^{re.escape(name)}: .*"):
        driver.plan({**state, name: value})
    assert driver.plan(state) is plan


def test_what_the_plan_alone_gives_is_kept_with_it_and_dropped_with_it(tiny_model, tiny_hf_config):
    """PlanCache.keep: computed once while the plan is kept; for another plan each call; gone with
    a miss; a refused value (a sink's check raising) drops the kept plan itself."""
    state = _meta(tiny_model.state_dict())
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan, made = driver.plan(state), []
    keep = driver.plan_cache.keep
    assert keep(plan, "k", lambda: made.append(1) or len(made)) == keep(plan, "k", lambda: made.append(1)) == 1
    partial = plan.only_layers([0])
    assert [keep(partial, "k", lambda: made.append(1) or len(made)) for _ in range(2)] == [2, 3]
    recast = {**state, "model.norm.weight": state["model.norm.weight"].float()}
    again = driver.plan(recast)
    assert keep(again, "k", lambda: "new") == "new" and driver.plan_cache.planned == 2

    def refuse():
        raise qstrat.PlanError("refused by the sink")
    with pytest.raises(qstrat.PlanError, match="refused by the sink"):
        keep(again, "check", refuse)
    assert driver.plan_cache.plan is None
    assert driver.plan(recast) is not again and driver.plan_cache.miss == "empty" and driver.plan_cache.planned == 3


def test_an_all_or_none_sink_gets_the_kept_plan_by_names_and_the_stream_checks_each_input(tiny_model,
                                                                                        tiny_hf_config):
    """prepare(all_or_none=True): the kept plan matched by names and hf_config only; a recast input
    is refused where the stream reads it (InputMismatchError naming it, arrived vs planned), after
    the outputs before it; a sink that is not all-or-none gets a new plan up front."""
    from qstrat.errors import InputMismatchError

    state = tiny_model.state_dict()
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan = driver.plan(state)
    assert driver.plan_cache.planned == 1
    name = "model.layers.1.self_attn.o_proj.weight"
    recast = {**state, name: state[name].float()}
    p = driver.prepare(recast, all_or_none=True)
    assert p.plan is plan and p.checked_in_stream and p.streamed and p.ran == ["plan"] and not p.plan_given
    emitted = []
    with pytest.raises(InputMismatchError, match=rf"^{re.escape(name)}: arrived as float32\[256, 256\], "
                                                 r"planned as bfloat16\[256, 256\]$"):
        for n, _ in p.execute():
            emitted.append(n)
    assert emitted and name not in emitted and driver.plan_cache.planned == 1
    same = driver.prepare(dict(state), all_or_none=True)  # nothing changed: the whole stream passes
    assert same.plan is plan and [n for n, _ in same.execute()] == [n for n, _ in driver.run(state)]
    up_front = driver.prepare(recast)
    assert up_front.plan is not plan and not up_front.checked_in_stream and driver.plan_cache.planned == 2
