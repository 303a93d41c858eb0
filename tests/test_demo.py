"""The demo's checkpoint path (the engine stage is covered by test_engine_refit.py)."""
from __future__ import annotations

import json

from qstrat.demo import run_demo


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
