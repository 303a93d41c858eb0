"""Config validation: clear errors naming key paths and valid choices; presets extendable."""
from __future__ import annotations

import pytest

import qstrat
from qstrat import ConfigError, load_config


def test_preset_is_extended_by_config_rules_first():
    cfg = load_config({"preset": "mxfp8-experts", "keep_bf16": {"first": 1, "last": 2},
                       "rules": [{"select": "attention", "serializer": "bf16"}]})
    assert [r.serializer for r in cfg.rules] == ["bf16", "mxfp8"]
    assert cfg.keep_bf16.first == 1 and cfg.keep_bf16.last == 2


def test_yaml_and_toml_files(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("preset: block-fp8\nkeep_bf16: {first: 1}\n")
    t = tmp_path / "c.toml"
    t.write_text('preset = "block-fp8"\n[keep_bf16]\nfirst = 1\n')
    assert load_config(y) == load_config(t)
    assert load_config(y).rules[0].serializer == "block_fp8"


def test_preset_name_as_source():
    assert load_config("mxfp8").rules[0].serializer == "mxfp8"


@pytest.mark.parametrize("data,pattern", [
    ({"rulez": []}, r"rulez: Extra inputs are not permitted"),
    ({"rules": [{"serializer": "mxfp9"}]}, r"rules\[0\]: unknown serializer 'mxfp9'; valid: bf16, block_fp8"),
    ({"rules": [{"select": "expertz", "serializer": "mxfp8"}]}, r"rules\[0\]\.select: unknown selector 'expertz'; valid: .*experts"),
    ({"rules": [{"serializer": "mxfp8", "options": {"scale_rounding": "up"}}]}, r"rules\[0\]: options\.scale_rounding: Input should be 'rceil' or 'floor'"),
    ({"rules": [{"serializer": "block_fp8", "options": {"ue8m00": True}}]}, r"options\.ue8m00: Extra inputs"),
    ({"rules": [{"serializer": "mxfp8", "include": ["re:(unclosed"]}]}, r"rules\[0\]\.include: .*invalid pattern"),
    ({"preset": "nope"}, r"unknown strategy 'nope'; valid: .*block-fp8"),
    ({"keep_bf16": {"first": -1}}, r"keep_bf16\.first: Input should be greater than or equal to 0"),
    ({"default": "int3"}, r"default: unknown serializer 'int3'"),
    ({"expert_emission": "stacked"}, r"expert_emission: Input should be 'per_expert' or 'fused'"),
])
def test_invalid_configs_name_the_key(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(data)


def test_bad_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad)
    bad.write_text("rules: [{serializer: mxfp9}]\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: rules\[0\]: unknown serializer"):
        load_config(bad)


def test_get_serializer_errors():
    with pytest.raises(ConfigError, match="unknown serializer 'fp7'; valid:"):
        qstrat.get_serializer("fp7")
    with pytest.raises(ConfigError, match=r"min_scale_byte: Input should be less than or equal to 254"):
        qstrat.get_serializer("mxfp8", min_scale_byte=255)
