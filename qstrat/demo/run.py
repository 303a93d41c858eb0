"""``qstrat demo``: the main job on the built-in default model, end to end.

Stages: build the seeded tiny Qwen3-MoE (trainer view: grouped expert slabs), plan, quantize and
write an HF checkpoint, verify it (bytes re-derived, names, config, dequantization error), and -
where a block-FP8 vLLM engine can run - refit a live engine started on model A's checkpoint with
model B's trainer tensors and check its greedy tokens and logprobs against a fresh engine on B.
"""
from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qstrat.checkpoint import load_checkpoint, write_checkpoint
from qstrat.driver import RefitDriver
from qstrat.errors import VerificationError
from qstrat.plan import PASSTHROUGH, RefitPlan
from qstrat.serializers.base import dtype_name


@dataclass
class DemoReport:
    """Figures of one demo run (printed by the CLI)."""

    plan: RefitPlan | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)
    rel_error: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    verified: bool = False
    engine: str = "not run"
    engine_ok: bool | None = None


@contextmanager
def _stage(report: DemoReport, name: str):
    t0 = time.perf_counter()
    yield
    report.stage_seconds[name] = time.perf_counter() - t0


def run_demo(config: Any = "block-fp8", out_dir: str | Path | None = None, engine: bool = True,
             console: Any = None) -> DemoReport:
    """Run the demo. Returns a :class:`DemoReport`; raises VerificationError if verification fails.

    Args:
        config: refit config (preset name, path or mapping); default ``block-fp8``.
        out_dir: where checkpoints go (default: a temporary directory).
        engine: run the vLLM engine stage when an engine can run here.
        console: rich Console for progress lines (None: silent).
    """
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe, hf_config

    say = console.print if console is not None else (lambda *a, **k: None)
    report = DemoReport()
    out = Path(out_dir or tempfile.mkdtemp(prefix="qstrat-demo-"))
    with _stage(report, "build model"):
        model_b = build_tiny_qwen3_moe(seed=1)
        cfg = hf_config(model_b)
        trainer_b = dict(model_b.state_dict())
    driver = RefitDriver(config, hf_config=cfg)
    with _stage(report, "plan"):
        report.plan = driver.plan(trainer_b)
    say(f"planned {len(report.plan.entries)} tensors -> {len(report.plan.outputs())} outputs")
    with _stage(report, "quantize + write"):
        write_checkpoint(driver, trainer_b, out / "model-b", overwrite=True)
    report.checkpoint = out / "model-b"
    with _stage(report, "verify"):
        report.rel_error = verify_checkpoint(driver, trainer_b, report.checkpoint)
        report.verified = True
    say(f"checkpoint written and verified: {report.checkpoint}")
    if engine:
        _engine_stage(report, driver, config, cfg, trainer_b, out, say)
    return report


def verify_checkpoint(driver: RefitDriver, tensors: Mapping[str, torch.Tensor],
                      directory: Path) -> dict[str, float]:
    """Check a written checkpoint against the plan and a fresh quantization.

    Checks: config.json carries the plan's quantization_config; the file holds exactly the
    planned names, shapes and dtypes; its bytes equal a fresh ``driver.run`` (determinism).
    Returns: relative RMS error ``||dequant(w) - w|| / ||w||`` per serializer over its tensors.
    Raises: VerificationError naming the first difference.
    """
    import json

    plan = driver.plan(tensors)
    stored = load_checkpoint(directory)
    written_cfg = json.loads((directory / "config.json").read_text()).get("quantization_config")
    if written_cfg != plan.vllm_quantization_config():
        raise VerificationError(f"{directory}/config.json: quantization_config {written_cfg} differs "
                                f"from the plan's {plan.vllm_quantization_config()}")
    planned = {o.name: (o.shape, o.dtype) for o in plan.outputs()}
    got = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in stored.items()}
    if got != planned:
        diff = sorted(n for n in set(got) | set(planned) if got.get(n) != planned.get(n))
        raise VerificationError(f"{directory}: checkpoint differs from the plan in {diff[:5]}")
    for name, t in driver.run(tensors):
        a, b = stored[name], t.contiguous()
        if not torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b):
            raise VerificationError(f"{name}: stored bytes differ from a fresh quantization")
    num, den = defaultdict(float), defaultdict(float)
    for e in plan.entries:
        if e.serializer == PASSTHROUGH:
            continue
        ser = driver.serializer(e.serializer, e.options)
        w = tensors[e.name].float()
        parts = ser.quantize(tensors[e.name], name=e.name)
        num[e.serializer] += float((ser.dequantize(parts) - w).pow(2).sum())
        den[e.serializer] += float(w.pow(2).sum())
    return {k: (num[k] / den[k]) ** 0.5 for k in num}


def _engine_stage(report: DemoReport, driver: RefitDriver, config: Any, cfg: dict[str, Any],
                  trainer_b: dict[str, torch.Tensor], out: Path, say: Any) -> None:
    """Refit a live engine started on model A's checkpoint with B's trainer tensors (grouped
    slabs) and compare its greedy tokens and logprobs with a fresh engine on B's checkpoint.

    On a CPU without AMX both engines run qstrat's emulated block-FP8 kernels
    (:mod:`qstrat.engine.emulation`): the comparison checks names, scales, ignore lists and the
    reload lifecycle, not AMX numerics; the report says which kernels ran.
    """
    from qstrat.engine.local import block_fp8_engine_support

    plan = report.plan
    fmt = (plan.quantization_config or {}).get("quant_method")
    ok, kernels = block_fp8_engine_support()
    if fmt != "fp8" or not ok:
        reason = kernels if fmt == "fp8" else f"the demo's engine stage runs block FP8, not {fmt}"
        report.engine = f"skipped: {reason}"
        return
    from qstrat import vllm as qvllm
    from qstrat.engine.local import EMULATED, greedy, release, start_engine
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe

    say(f"engine kernels: {kernels}")
    with _stage(report, "engine: write A"):
        model_a = build_tiny_qwen3_moe(seed=0)
        write_checkpoint(driver, model_a.state_dict(), out / "model-a", hf_config=cfg, overwrite=True)
    with _stage(report, "engine: start on A"):
        llm = start_engine(out / "model-a")
    with _stage(report, "engine: refit A -> B"):
        refit = qvllm.refit(llm, driver, trainer_b)
    with _stage(report, "engine: generate"):
        refit_out = greedy(llm)
    release(llm)
    del llm
    with _stage(report, "engine: fresh on B"):
        fresh = start_engine(report.checkpoint)
        fresh_out = greedy(fresh)
    release(fresh)
    del fresh
    say(f"refit sent {refit.tensors} tensors ({refit.bytes / 2**20:.1f} MiB) in {refit.seconds:.2f} s")
    report.engine_ok = refit_out == fresh_out
    how = "emulated block-FP8 kernels, CPU without AMX" if kernels == EMULATED else kernels
    report.engine = (f"refit engine == fresh engine on B (tokens and logprobs; {how})" if report.engine_ok
                     else f"MISMATCH ({how}): refit {refit_out} vs fresh {fresh_out}")
    say(report.engine)
