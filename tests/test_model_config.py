"""qstrat.model_config: a model config's shape keys are integers in range before any tensor is
generated (no ZeroDivisionError, negative dimension or endless generation), named in the error."""
from __future__ import annotations

import re

import pytest
import torch

from qstrat import RefitDriver
from qstrat.builtin.layouts import DEEPSEEK_V3, QWEN3_MOE
from qstrat.errors import ConfigError
from qstrat.model_config import bounded, check_model_config, language_config
from qstrat.skeleton import model_tensors

from conftest import model_config


@pytest.mark.parametrize("key, value, message", [
    ("num_attention_heads", 0, "num_attention_heads must be an integer in 1..2147483647, got 0"),
    ("hidden_size", -4096, "hidden_size must be an integer in 1..2147483647, got -4096"),
    ("hidden_size", "4096", "hidden_size must be an integer in 1..2147483647, got '4096'"),
    ("vocab_size", 1024.0, "vocab_size must be an integer in 1..2147483647, got 1024.0"),
    ("num_key_value_heads", True, "num_key_value_heads must be an integer in 1..2147483647, got True"),
    ("num_hidden_layers", 10**12, "num_hidden_layers must be an integer in 1..4096, got 1000000000000 "
                                  "(qstrat's limit: a larger num_hidden_layers is no real model)"),
    ("num_experts", 10**6, "num_experts must be an integer in 0..65536, got 1000000 (qstrat's limit"),
    # a string "false" is truthy: read as is, the planner dropped the untied lm_head (adversarial run)
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false (a JSON boolean), got 'false'"),
    ("attention_bias", 1, "attention_bias must be true or false (a JSON boolean), got 1"),
])
def test_a_bad_shape_key_is_named_before_any_tensor(key, value, message):
    cfg = {**model_config("qwen3-235b-a22b"), key: value}
    with pytest.raises(ConfigError, match="^" + re.escape(f"model config: {message}")):
        check_model_config(cfg)
    with pytest.raises(ConfigError, match=re.escape(message)):
        next(iter(model_tensors(QWEN3_MOE, cfg)))


def test_deepseek_keys_are_checked_too():
    cfg = {**model_config("deepseek-v3"), "kv_lora_rank": 0}
    with pytest.raises(ConfigError, match=r"^model config: kv_lora_rank must be an integer in 1\.\.2147483647, got 0$"):
        list(model_tensors(DEEPSEEK_V3, cfg))


def test_text_config_must_be_a_mapping_for_the_driver_too():
    for cfg in ({"text_config": 5}, {"text_config": [1, 2]}):
        with pytest.raises(ConfigError, match=r"^model config: text_config must be a mapping \(the language "
                                              r"model's config\), got (int 5|list \[1, 2\])$"):
            RefitDriver("mxfp8", hf_config={**cfg, "model_type": "qwen3_moe"}).plan(
                {"model.layers.0.mlp.down_proj.weight": torch.empty(64, 64, device="meta")})
    assert language_config({"text_config": None, "hidden_size": 4}) == {"text_config": None, "hidden_size": 4}
    assert language_config({"text_config": {"hidden_size": 4}}) == {"hidden_size": 4}


def test_the_driver_refuses_an_impossible_depth():
    with pytest.raises(ConfigError, match=r"num_hidden_layers must be an integer in 1\.\.4096, got 1000000000000"):
        RefitDriver({"preset": "mxfp8", "keep_bf16": {"last": 1}},
                    hf_config={"model_type": "qwen3_moe", "num_hidden_layers": 10**12}).plan(
            {"model.layers.0.mlp.down_proj.weight": torch.empty(64, 64, device="meta")})


def test_generation_is_bounded():
    assert list(bounded(range(3), "x", limit=3)) == [0, 1, 2]
    with pytest.raises(ConfigError, match=r"^model config: it implies more than 3 tensors \(x\); qstrat's limit"):
        list(bounded(range(4), "x", limit=3))
    cfg = {**model_config("qwen3-235b-a22b"), "num_hidden_layers": 4000, "num_experts": 60000}
    with pytest.raises(ConfigError, match=r"implies more than 1000000 tensors \(layout qwen3_moe\)"):
        list(model_tensors(QWEN3_MOE, cfg))


def test_real_configs_pass():
    for name, layout in (("qwen3-235b-a22b", QWEN3_MOE), ("deepseek-v3", DEEPSEEK_V3)):
        check_model_config(model_config(name), layout.num_layers_key)
        assert len(list(model_tensors(layout, model_config(name)))) > 10_000


def test_one_language_config_lookup_serves_every_reader():
    """Where a multimodal model's text config lives is said once (model_config.language_config):
    the quantization config vLLM reads, the checkpoint's config.json, DeepSeek-V3's routing keys,
    the probe's vocabulary and the layouts all go through it (issue 43: five hand-written lookups)."""
    import ast
    from pathlib import Path
    from types import SimpleNamespace

    from qstrat.builtin.layouts import DEEPSEEK_V3
    from qstrat.fidelity import text_vocab_size
    from qstrat.model_config import with_language_config
    from qstrat.vllm.quant_config import quantization_config_of

    qc = {"quant_method": "fp8"}
    text = {"hidden_size": 4, "model_type": "deepseek_v3", "quantization_config": qc}
    mm = {"model_type": "kimi_vl", "text_config": text}
    assert language_config(mm) is text and language_config({"hidden_size": 4}) == {"hidden_size": 4}
    obj = SimpleNamespace(text_config=SimpleNamespace(vocab_size=7))  # an HF config object
    assert language_config(obj) is obj.text_config and language_config(SimpleNamespace(a=1)).a == 1
    assert language_config(None) == {}
    assert quantization_config_of(mm) == qc and quantization_config_of({**mm, "quantization_config": {"a": 1}}) == {"a": 1}
    assert text_vocab_size(SimpleNamespace(config=obj)) == 7
    assert with_language_config(mm, {"x": 1}) == {"model_type": "kimi_vl", "text_config": {"x": 1}}
    assert with_language_config({"y": 2}, {"x": 1}) == {"x": 1}
    out = DEEPSEEK_V3.output_config(mm)  # V3's routing keys filled in where the language model's config is
    assert out["text_config"]["scoring_func"] == "sigmoid" and "scoring_func" not in out
    # no module reads text_config by hand: only model_config.py names the key in code
    root = Path(__file__).resolve().parents[1] / "qstrat"
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if any(isinstance(n, ast.Constant) and n.value == "text_config" for n in ast.walk(ast.parse(p.read_text())))
                     or any(isinstance(n, ast.Attribute) and n.attr in ("text_config", "get_text_config")
                            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "layout", "ModelLayout"))
                            for n in ast.walk(ast.parse(p.read_text()))))
    assert readers == ["model_config.py"], readers
