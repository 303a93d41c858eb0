"""The command line, run as a user would (subprocess: exit codes, output, files)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import MODELS

CLI = [sys.executable, "-m", "qstrat.cli"]


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


def test_plan_lists_every_tensor_and_summary(tmp_path):
    cfg = tmp_path / "refit.yaml"
    cfg.write_text("preset: mxfp8-experts\nkeep_bf16: {first: 1, last: 2}\n")
    out = run("plan", MODELS / "qwen3-235b-a22b", "--config", cfg).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith(("model.", "lm_head"))]
    assert len(lines) == 36945
    row = next(ln for ln in lines if ln.startswith("model.layers.93.mlp.experts.0.up_proj.weight "))
    assert "bf16" in row and "keep_bf16.last" in row
    assert '"quant_algo": "MXFP8"' in out


def test_quantize_a_checkpoint_and_plan_it_back(tiny_model, tmp_path):
    from qstrat.tiny_model import save_bf16

    save_bf16(tiny_model, tmp_path / "bf16")
    run("quantize", tmp_path / "bf16", "--preset", "block-fp8", "-o", tmp_path / "fp8")
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
    assert "rules[0]: unknown serializer 'mxfp9'; valid:" in proc.stderr
