"""qstrat.config.loader.load_config: a config from a preset name, a file, a mapping; presets extended by the
config's rules; clear errors naming key paths and valid choices."""
from __future__ import annotations

import pytest

import qstrat
from qstrat import ConfigError, load_config


def test_preset_is_extended_by_config_rules_first():
    cfg = load_config({"preset": "mxfp8-experts", "keep_bf16": {"first": 1, "last": 2},
                       "rules": [{"select": "attention", "serializer": "bf16"}]})
    assert [r.serializer for r in cfg.rules] == ["bf16", "mxfp8"]
    assert cfg.keep_bf16.first == 1 and cfg.keep_bf16.last == 2


def test_preset_name_as_source():
    assert load_config("mxfp8").rules[0].serializer == "mxfp8"


@pytest.mark.parametrize("data,pattern", [
    ({"rulez": []}, r"rulez: Extra inputs are not permitted"),
    ({"rules": [{"serializer": "mxfp9"}]}, r"rules\[0\]\.serializer: unknown serializer 'mxfp9'; did you mean 'mxfp8'\? valid: bf16, block_fp8"),
    ({"rules": [{"serializer": "NVFP4"}]}, r"rules\[0\]\.serializer: unknown serializer 'NVFP4'; did you mean 'nvfp4'\? valid: bf16"),
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


@pytest.mark.parametrize("data,message", [
    ({"rulez": []}, "rulez: Extra inputs are not permitted; did you mean 'rules'? valid keys: preset, rules, "
                    "keep_bf16, default, expert_emission, layout, unplaced_weights, wire_order, expert_batch, quantize_in"),
    ({"keep_bf16": {"frist": 1}}, "keep_bf16.frist: Extra inputs are not permitted; did you mean 'first'? "
                                  "valid keys: first, last"),
    ({"rules": [{"serializer": "mxfp8", "on_unsuported": "bf16"}]},
     "rules[0].on_unsuported: Extra inputs are not permitted; did you mean 'on_unsupported'? valid keys: select, "
     "include, exclude, serializer, options, on_unsupported, allow_special"),
    ({"zzz": 1}, "zzz: Extra inputs are not permitted; valid keys: preset, rules, keep_bf16, default, "
                 "expert_emission, layout, unplaced_weights, wire_order, expert_batch, quantize_in"),
])
def test_a_mistyped_key_gets_the_nearest_valid_keys(data, message):
    """pydantic says only "Extra inputs are not permitted"; the nearest key of that place is named."""
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert str(info.value) == message


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


# ---- a preset name is never shadowed by a path in the current directory (issue 36, item 6) ----
def test_a_preset_name_is_the_preset_whatever_the_current_directory_holds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "block-fp8").mkdir()  # a natural -o name; the old code: "is a directory"
    (tmp_path / "nvfp4-experts").write_text("rules: [{serializer: mxfp8}]\n")  # the old code read it instead
    assert load_config("block-fp8") == load_config({"preset": "block-fp8"})
    assert load_config("nvfp4-experts") == load_config({"preset": "nvfp4-experts"})
    assert qstrat.RefitDriver("block-fp8").config == load_config({"preset": "block-fp8"})
    # a file of that name is read when given as a path
    from pathlib import Path

    assert load_config(Path("nvfp4-experts")).rules[0].serializer == "mxfp8"
    assert load_config("./nvfp4-experts").rules[0].serializer == "mxfp8"
    with pytest.raises(ConfigError, match=r"config file 'mxfp8' does not exist; 'mxfp8' is a preset name: "
                                          r"pass it as a str"):
        load_config(Path("mxfp8"))


def test_a_keep_bf16_object_merges_over_the_preset_as_a_mapping_does():
    """The old code: KeepBF16(first=2) replaced nvfp4-experts' {first: 1, last: 1} (last lost)."""
    obj = load_config({"preset": "nvfp4-experts", "keep_bf16": qstrat.KeepBF16(first=2)})
    assert obj == load_config({"preset": "nvfp4-experts", "keep_bf16": {"first": 2}})
    assert (obj.keep_bf16.first, obj.keep_bf16.last) == (2, 1)
