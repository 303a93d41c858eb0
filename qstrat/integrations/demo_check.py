"""The check every framework demo runs: an engine updated by the framework's own weight-update
code, compared after each update with a FRESH engine on the same weights (greedy tokens and
logprobs, exactly). Used by :mod:`qstrat.integrations.verl_demo` and
:mod:`qstrat.integrations.nemo_rl_demo`."""
from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def step_weights(step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``step``: the tiny Qwen3-MoE with seed ``step`` (bfloat16)."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe

    return {n: t.detach().clone() for n, t in build_tiny_qwen3_moe(seed=step).state_dict().items()}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def check_updates(strategy: str, steps: int, work: Path, extension: str,
                  update: Callable[[Any, dict[str, torch.Tensor]], None]) -> list[dict[str, Any]]:
    """Start an engine on a qstrat checkpoint of step 0's weights with the worker extension
    ``extension``, run ``update(llm, step_weights(step))`` for steps 1..``steps`` (stopping at the
    first that raises), then compare each updated engine with a fresh engine.

    Returns: one record per update: ``step``, ``same`` (tokens and logprobs equal),
    ``max_dlogprob``, ``error`` (the update's exception text, or None), ``seconds`` (the update).
    """
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import release, start_engine
    from qstrat.integrations.trl_demo import fresh_engine_greedy, probe_greedy

    cfg = hf_config(build_tiny_qwen3_moe(seed=0))
    write_checkpoint(RefitDriver(strategy, hf_config=cfg), step_weights(0), work / "rollout", hf_config=cfg)
    llm = start_engine(work / "rollout", logprobs_mode="processed_logprobs", worker_extension_cls=extension)
    seen: list[tuple[int, Any, str | None, float]] = []
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            try:
                update(llm, step_weights(step))
                error = None
            except Exception as exc:  # noqa: BLE001 - a stock extension's failure is a result
                error = _one_line(exc)
                if exc.__context__ is not None:  # a receiver's cleanup can mask the cause
                    error += f" (raised while handling {_one_line(exc.__context__)})"
            seen.append((step, None if error else probe_greedy(llm), error, time.perf_counter() - t0))
            if error:
                break
    finally:
        release(llm)
    records = []
    for step, engine, error, seconds in seen:
        rec: dict[str, Any] = {"step": step, "error": error, "seconds": seconds, "same": False, "max_dlogprob": None}
        if engine is not None:
            want = fresh_engine_greedy(strategy, cfg, step_weights(step), work / f"fresh{step}")
            rec["same"] = [g.tokens for g in engine] == [w.tokens for w in want] and \
                [g.logprobs for g in engine] == [w.logprobs for w in want]
            rec["max_dlogprob"] = max((abs(a - b) for g, w in zip(engine, want)
                                       for a, b in zip(g.logprobs, w.logprobs)), default=0.0)
        records.append(rec)
    return records


def report(records: list[dict[str, Any]], steps: int, say: Callable[[str], Any], started: float) -> int:
    """Print one line per update and the verdict. Returns 0 when all ``steps`` updates equalled a
    fresh engine, 1 otherwise."""
    ok = bool(records) and len(records) == steps and all(r["same"] for r in records)
    for r in records:
        if r["error"]:
            say(f"update {r['step']}: FAILED in {r['seconds']:.1f} s: {r['error']}")
        else:
            say(f"update {r['step']}: {r['seconds']:.1f} s; engine {'==' if r['same'] else '!='} fresh engine on the "
                f"trainer's weights (max |dlogprob| {r['max_dlogprob']:.3g})")
    say(f"{'OK' if ok else 'FAILED'} in {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


def demo_parser(prog: str, description: str, stock_help: str) -> argparse.ArgumentParser:
    """A demo's command line: ``--strategy`` (default block-fp8), ``--steps`` (default 2),
    ``--stock`` (the framework's own worker extension instead of qstrat's, ``stock_help``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--strategy", default="block-fp8", help="a qstrat preset or config file (default block-fp8)")
    parser.add_argument("--steps", type=int, default=2, help="weight updates (default 2)")
    parser.add_argument("--stock", action="store_true", help=stock_help)
    return parser


def run_logged(headline: str, prefix: str, steps: int, run: Callable[[Path], list[dict[str, Any]]]) -> int:
    """Print ``headline``, call ``run(work)`` in a temporary folder named ``prefix...`` with the
    engines' output sent to a log there, and :func:`report` its records. Returns report's code."""
    from qstrat.cli.console import make_console, quiet_torchao_import, stderr_to

    quiet_torchao_import()
    say = make_console().print
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        log = Path(tmp) / "engine.log"
        say(headline.replace("goes to a log", f"goes to {log}, removed at the end: its last lines are shown "
                                              "if a step fails"))
        with stderr_to(log):
            records = run(Path(tmp))
    return report(records, steps, say, start)
