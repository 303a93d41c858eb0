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
    ({"rules": [{"serializer": "mxfp9"}]}, r"rules\[0\]\.serializer: unknown serializer 'mxfp9'; did you mean 'mxfp8'\? valid: bf16, block_fp8"),
    ({"rules": [{"select": "expertz", "serializer": "mxfp8"}]}, r"rules\[0\]\.select: unknown selector 'expertz'; did you mean 'experts'\? valid: .*experts"),
    ({"rules": [{"serializer": "mxfp8", "options": {"scale_rounding": "up"}}]}, r"rules\[0\]\.options\.scale_rounding: Input should be 'rceil' or 'floor'"),
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
    with pytest.raises(ConfigError, match=r"bad\.yaml: rules\[0\]\.serializer: unknown serializer"):
        load_config(bad)


def test_get_serializer_errors():
    with pytest.raises(ConfigError, match="unknown serializer 'fp7'; valid:"):
        qstrat.get_serializer("fp7")
    with pytest.raises(ConfigError, match=r"min_scale_byte: Input should be less than or equal to 254"):
        qstrat.get_serializer("mxfp8", min_scale_byte=255)


@pytest.mark.parametrize("data,message", [
    ({"preset": ["a"]}, "preset: Input should be a valid string"),
    ({"preset": "nvfp4-experts", "keep_bf16": 3},
     "keep_bf16: Input should be a valid dictionary or instance of KeepBF16"),
    ({"preset": "block-fp8", "rules": None}, "rules: Input should be a valid list"),
    ({"preset": "block-fp8", "rules": "block_fp8"}, "rules: Input should be a valid list"),
    ({"preset": "nope"}, "preset: unknown strategy 'nope'; valid: bf16, block-fp8, mxfp8, mxfp8-experts, "
                         "nvfp4-experts"),
])
def test_badly_typed_preset_extensions_name_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert str(info.value) == message


def test_preset_merge_keeps_well_typed_parts():
    cfg = load_config({"preset": "nvfp4-experts", "keep_bf16": {"last": 3}})
    assert (cfg.keep_bf16.first, cfg.keep_bf16.last) == (1, 3)  # the preset's first, the config's last
    assert [r.serializer for r in load_config({"preset": "block-fp8", "rules": []}).rules] == ["block_fp8"]
    assert load_config({"preset": None}).rules == []


def test_unreadable_config_files_are_config_errors(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "dir.yaml")
    assert str(info.value) == f"{tmp_path / 'dir.yaml'}: is a directory, not a config file (.yaml, .toml, .json)"
    (tmp_path / "bin.toml").write_bytes(b"preset = \xff\xfe")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "bin.toml")
    assert str(info.value) == f"{tmp_path / 'bin.toml'}: not a text config file (invalid start byte at byte 9)"


ACCEPTED = ("expected a config file path (str or pathlib.Path: .yaml, .yml, .toml, .json), a preset name, "
            "a mapping or a RefitConfig")


@pytest.mark.parametrize("source,got", [
    (None, "None"),
    (5, "int 5"),
    (3.5, "float 3.5"),
    ("", "str ''"),
    (["block-fp8"], "list ['block-fp8']"),
    (b"preset: block-fp8", "bytes b'preset: block-fp8' (for a file's content, pass the file's path, or the "
                           "mapping yaml.safe_load returns)"),
])
def test_a_source_of_another_type_is_a_config_error_naming_it(source, got):
    """load_config and RefitDriver name what they were given and what they read (not a bare
    TypeError from pathlib)."""
    with pytest.raises(ConfigError) as info:
        load_config(source)
    assert str(info.value) == f"refit config: got {got}; {ACCEPTED}"
    with pytest.raises(ConfigError) as info:
        qstrat.RefitDriver(source)
    assert str(info.value) == f"refit config: got {got}; {ACCEPTED}"
