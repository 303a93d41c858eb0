"""qstrat.config.schema (with qstrat.config.validation's wording): exact types, every problem reported at
once, typos answered with the valid names (and the nearest one). Reading files (duplicate keys,
YAML 1.2): tests/test_config_files.py."""
from __future__ import annotations

import pytest

import qstrat
from qstrat import ConfigError, load_config


def config_error(source) -> str:
    """The message of the ConfigError ``load_config(source)`` raises."""
    with pytest.raises(ConfigError) as info:
        load_config(source)
    return str(info.value)


@pytest.mark.parametrize("data,message", [
    ({"keep_bf16": {"first": True}}, "keep_bf16.first: Input should be a valid integer"),
    ({"keep_bf16": {"last": "1"}}, "keep_bf16.last: Input should be a valid integer"),
    ({"keep_bf16": {"first": 1.0}}, "keep_bf16.first: Input should be a valid integer"),
    ({"rules": [{"serializer": "block_fp8", "options": {"ue8m0": "yes"}}]},
     "rules[0].options.ue8m0: Input should be a valid boolean"),
    ({"rules": [{"serializer": "block_fp8", "options": {"ue8m0": 1}}]},
     "rules[0].options.ue8m0: Input should be a valid boolean"),
    ({"rules": [{"serializer": "mxfp8", "allow_special": "true"}]},
     "rules[0].allow_special: Input should be a valid boolean"),
    ({"rules": [{"serializer": "mxfp8", "options": {"min_scale_byte": "1"}}]},
     "rules[0].options.min_scale_byte: Input should be a valid integer"),
    ({"rules": [{"serializer": "nvfp4", "options": {"input_scale": "0.5"}}]},
     "rules[0].options.input_scale: Input should be a valid number"),
    ({"rules": [{"serializer": "mxfp8", "options": {"chunk_elements": True}}]},
     "rules[0].options.chunk_elements: Input should be a valid integer"),
])
def test_types_are_strict(data, message):
    assert config_error(data) == message


def test_exact_types_and_an_int_for_a_float_are_accepted():
    cfg = load_config({"keep_bf16": {"first": 1}, "rules": [
        {"select": ("experts",), "serializer": "nvfp4", "options": {"input_scale": 1}},
        {"serializer": "block_fp8", "options": {"ue8m0": True}, "allow_special": False}]})
    assert cfg.keep_bf16.first == 1 and cfg.rules[0].select == ["experts"]
    assert qstrat.get_serializer("nvfp4", **cfg.rules[0].options).options.input_scale == 1.0
    with pytest.raises(ConfigError, match=r"ue8m0: Input should be a valid boolean"):
        qstrat.get_serializer("block_fp8", ue8m0=1)  # the Python API is strict too


def test_every_problem_is_reported_at_once():
    bad = {"preset": "nope", "bogus": 1, "default": "int3", "layout": "qwen3moe",
           "keep_bf16": {"first": -1, "last": "a"},
           "rules": [{"select": "expertz", "serializer": "mxfp9", "options": {"x": 1}},
                     {"serializer": "block_fp8", "options": {"ue8m0": "yes", "backend": "gpu"}}]}
    lines = config_error(bad).splitlines()
    assert lines[0] == "invalid config:"
    assert [ln.strip() for ln in lines[1:]] == [
        "preset: unknown strategy 'nope'; valid: bf16, block-fp8, mxfp8, mxfp8-experts, nvfp4-experts",
        "rules[0].select: unknown selector 'expertz'; did you mean 'experts'? valid: attention, dense_mlp, "
        "embeddings, experts, linear, lm_head, routers, shared_experts",
        "rules[0].serializer: unknown serializer 'mxfp9'; did you mean 'mxfp8'? valid: bf16, block_fp8, "
        "mxfp8, nvfp4",
        "rules[1].options.backend: Input should be 'auto', 'torch', 'fast' or 'triton'",
        "rules[1].options.ue8m0: Input should be a valid boolean",
        "keep_bf16.first: Input should be greater than or equal to 0",
        "keep_bf16.last: Input should be a valid integer",
        "default: unknown serializer 'int3'; valid: bf16, block_fp8, mxfp8, nvfp4",
        "layout: unknown layout 'qwen3moe'; did you mean 'qwen3_moe' or 'qwen3_5_moe'? valid: deepseek_v3, "
        "generic, glm4_moe, gpt_oss, llama, mixtral, qwen3, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe, qwen3_next",
        "bogus: Extra inputs are not permitted; valid keys: preset, rules, keep_bf16, default, expert_emission, "
        "layout, unplaced_weights, wire_order, expert_batch, quantize_in",
    ]


@pytest.mark.parametrize("source,message", [
    ({"preset": "block_fp8"}, "preset: unknown strategy 'block_fp8'; did you mean 'block-fp8'? valid: bf16, "
                              "block-fp8, mxfp8, mxfp8-experts, nvfp4-experts"),
    ("mxfp8-expert", "config file 'mxfp8-expert' does not exist, nor is it a preset name (did you mean "
                     "'mxfp8-experts' or 'nvfp4-experts'? valid presets: bf16, block-fp8, mxfp8, mxfp8-experts, "
                     "nvfp4-experts)"),
    ("zzz", "config file 'zzz' does not exist, nor is it a preset name (valid presets: bf16, block-fp8, mxfp8, "
            "mxfp8-experts, nvfp4-experts)"),
    # the field's names for a format: 'fp8' is block FP8 (vLLM's quant_method), not the nearer 'mxfp8'
    ("fp8", "config file 'fp8' does not exist, nor is it a preset name (did you mean 'block-fp8' (block FP8 with "
            "DeepSeek-style 128x128 scales, vLLM's quant_method 'fp8')? valid presets: bf16, block-fp8, mxfp8, "
            "mxfp8-experts, nvfp4-experts)"),
    ({"default": "fp8"}, "default: unknown serializer 'fp8'; did you mean 'block_fp8' (block FP8 with "
                         "DeepSeek-style 128x128 scales, vLLM's quant_method 'fp8')? valid: bf16, block_fp8, mxfp8, nvfp4"),
    ({"rules": [{"select": "experts", "serializer": "modelopt_fp4"}]},
     "rules[0].serializer: unknown serializer 'modelopt_fp4'; did you mean 'nvfp4' (vLLM's method name for "
     "ModelOpt NVFP4)? valid: bf16, block_fp8, mxfp8, nvfp4"),
])
def test_preset_typos_list_the_valid_names(source, message):
    assert config_error(source) == message


def test_every_error_class_is_documented():
    import inspect
    from pathlib import Path

    import qstrat.errors as errors

    doc = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    classes = [n for n, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.QstratError)]
    assert len(classes) >= 7
    assert [n for n in classes if f"| `{n}` |" not in doc] == []


def test_hf_config_may_be_a_transformers_config_but_not_a_path(tiny_model):
    from qstrat import RefitDriver

    driver = RefitDriver("block-fp8", hf_config=tiny_model.config)
    assert driver.layout.name == "qwen3_moe" and driver.hf_config["num_hidden_layers"] == 4
    with pytest.raises(ConfigError) as info:
        RefitDriver("block-fp8", hf_config="config.json")
    assert str(info.value) == ("hf_config must be the model's config.json content (a mapping) or a transformers "
                               "config (model.config), got str")
