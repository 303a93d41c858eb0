"""qstrat.config.files: reading a refit config from YAML (1.2 rules, no duplicate keys), TOML or
JSON strictly, and the errors that name the file."""
from __future__ import annotations

import pytest

from qstrat import ConfigError, load_config
from test_config_schema import config_error

TOO_DEEP = "lists or mappings nested too deeply for the parser (it reached Python's recursion limit)"


def test_yaml_and_toml_files(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("preset: block-fp8\nkeep_bf16: {first: 1}\n")
    t = tmp_path / "c.toml"
    t.write_text('preset = "block-fp8"\n[keep_bf16]\nfirst = 1\n')
    assert load_config(y) == load_config(t)
    assert load_config(y).rules[0].serializer == "block_fp8"


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


def test_unreadable_config_files_are_config_errors(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "dir.yaml")
    assert str(info.value) == f"{tmp_path / 'dir.yaml'}: is a directory, not a config file (.yaml, .toml, .json); nothing was read"
    (tmp_path / "bin.toml").write_bytes(b"preset = \xff\xfe")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "bin.toml")
    assert str(info.value) == f"{tmp_path / 'bin.toml'}: not a text config file (invalid start byte at byte 9)"


@pytest.mark.parametrize("name,text,message", [
    ("dup.yaml", "preset: mxfp8\nkeep_bf16: {first: 1}\npreset: block-fp8\n",
     "duplicate key 'preset' (first given on line 1)\n  in \"<unicode string>\", line 3, column 1"),
    ("nested.yaml", "rules:\n  - serializer: mxfp8\n    select: experts\n    serializer: bf16\n",
     "duplicate key 'serializer' (first given on line 2)\n  in \"<unicode string>\", line 4, column 5"),
    ("flow.yml", "keep_bf16: {first: 1, first: 2}\n", "duplicate key 'first' (first given on line 1)"),
    ("dup.json", '{"preset": "mxfp8", "preset": "bf16"}', "duplicate key 'preset'"),
    ("dup.toml", 'preset = "mxfp8"\npreset = "bf16"\n', "Cannot overwrite a value (at line 2, column 16)"),
])
def test_duplicate_keys_are_errors(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    got = config_error(path)
    assert got.startswith(f"{path}: cannot parse: ") and message in got


def test_yaml_booleans_and_floats_follow_yaml_1_2(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rules:\n  - serializer: block_fp8\n    options: {ue8m0: yes}\n")
    # YAML 1.1 would read `yes` as true
    assert config_error(path) == f"{path}: rules[0].options.ue8m0: Input should be a valid boolean"
    path.write_text("rules:\n  - serializer: block_fp8\n    options: {ue8m0: True}\n"
                    "  - serializer: nvfp4\n    select: experts\n    options: {input_scale: 5e-1}\n")
    cfg = load_config(path)
    assert cfg.rules[0].options == {"ue8m0": True}
    assert cfg.rules[1].options == {"input_scale": 0.5}  # YAML 1.1 reads 5e-1 as a string
    import yaml

    assert yaml.safe_load("a: yes") == {"a": True}  # the global SafeLoader is left as it is


def test_a_yaml_merge_key_may_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rules:\n  - serializer: mxfp8\n"
                    "    options: {<<: {min_scale_byte: 1, scale_rounding: floor}, min_scale_byte: 2}\n")
    cfg = load_config(path)
    assert cfg.rules[0].options == {"min_scale_byte": 2, "scale_rounding": "floor"}
    path.write_text("rules:\n  - {serializer: mxfp8, options: {<<: {min_scale_byte: 1}, min_scale_byte: 2, "
                    "min_scale_byte: 3}}\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'min_scale_byte' \(first given on line 2\)"):
        load_config(path)


def test_an_empty_config_file_is_an_error(tmp_path):
    path = tmp_path / "refit.yaml"
    path.write_text("# nothing yet\n")
    assert config_error(path) == (f"{path}: the file holds no settings (empty); a refit config needs at least "
                                  "a preset or rules, e.g. `preset: block-fp8`")


@pytest.mark.parametrize("name,text", [
    ("deep.json", "[" * 100_000 + "]" * 100_000),
    ("deep.json", '{"a": ' * 100_000 + "1" + "}" * 100_000),
    ("deep.yaml", "rules: " + "[" * 100_000 + "]" * 100_000),
    ("deep.yaml", "".join("  " * i + "-\n" for i in range(2_000))),  # block style
    ("deep.toml", "rules = " + "[" * 100_000 + "]" * 100_000),
])
def test_a_config_nested_too_deeply_is_a_config_error(tmp_path, name, text):
    """A parser's RecursionError is a ConfigError naming the file, with nothing chained to it (no
    thousand-frame traceback behind it)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: cannot parse: {TOO_DEEP}; a refit config nests only a few levels"
    assert info.value.__cause__ is None and info.value.__suppress_context__


# ---- files that are not regular, BOMs, YAML 1.1 integers (issue 36, items 10 and 13) ----------
def test_non_regular_files_are_refused_before_reading(tmp_path):
    """A symlink to /dev/zero read without bound (MemoryError), a FIFO blocked forever."""
    import os

    zero = tmp_path / "refit.yaml"
    zero.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match=r"refit\.yaml: is a device, not a config file .*nothing was read"):
        load_config(zero)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"fifo\.yaml: is a FIFO \(named pipe\), not a config file"):
        load_config(fifo)
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"dir\.yaml: is a directory, not a config file"):
        load_config(tmp_path / "dir.yaml")


@pytest.mark.parametrize("suffix,text", [(".json", '{"preset": "block-fp8"}'), (".yaml", "preset: block-fp8\n"),
                                         (".toml", 'preset = "block-fp8"\n')])
def test_a_utf8_bom_is_read_in_every_format(tmp_path, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_config(path) == load_config("block-fp8")


def test_yaml_integers_follow_yaml_1_2(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: block-fp8\nkeep_bf16: {first: 1:30}\n")  # YAML 1.1: 90
    with pytest.raises(ConfigError, match=r"keep_bf16\.first: Input should be a valid integer"):
        load_config(path)
    path.write_text("preset: block-fp8\nkeep_bf16: {first: 010, last: 0x2}\n")  # YAML 1.1: 8
    assert (load_config(path).keep_bf16.first, load_config(path).keep_bf16.last) == (10, 2)
