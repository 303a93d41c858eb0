"""Benchmark: the same refit quantized in the trainer vs in the engine (``quantize_in``), per format.

For each format (``--formats``: presets vLLM quantizes online on this engine kind) and each mode:

* ``trainer``: an engine started on qstrat's checkpoint of model A (the format's own
  checkpoint); each refit sends qstrat's quantized tensors of model B;
* ``engine``: an engine started on A's BF16 checkpoint with the plan's online config
  (``qstrat.vllm.online.engine_kwargs``); each refit sends B in BF16 and vLLM quantizes it while it
  reloads (its layerwise reload runs the online method per layer).

Per refit (``qstrat.vllm.refit(..., verify=qstrat.vllm.fidelity.probe.Verify(model, check=False))``: reported, not judged, one unmeasured
warm-up refit, then ``--reps`` refits alternating B and A so each one changes every weight; the
median is printed):

* ``wire MiB``: bytes handed to the engine (``RefitReport.bytes``);
* ``trainer s``: qstrat's side - planning (cached after the first), the engine checks, values,
  quantizing (trainer mode) or casting (engine mode), building the payload: the refit's time
  minus the engine's;
* ``engine s``: the engine's side - the ``reload_weights`` RPC (vLLM's layerwise reload, with
  online quantization in engine mode), timed by wrapping ``llm.collective_rpc`` from outside;
* ``total s``: the whole refit (``RefitReport.seconds``: checks to the end of the reload; the
  probe after it is not included);
* ``KL``: the fidelity probe's mean KL(expected || engine), and ``KL bf16``: KL(trainer BF16 ||
  engine), the quantization's own rollout mismatch (docs/fidelity.md).

Model: the demo's tiny Qwen3-MoE (``--size tiny``: hidden 256, 4 layers, 8 experts) or a larger
one (``--size medium``: hidden 1024, 8 layers, 16 experts of 512, ~0.2 B parameters). Engines
start one at a time, in this process, one torch thread (qstrat.vllm.engine.local's default).

    .venv/bin/python scripts/bench_modes.py [--formats block-fp8 mxfp8] [--reps 5] [--size tiny] [--json out.json]

``--options`` (no engine): what the format options vLLM's online quantizer lacks (MXFP8
``scale_rounding: floor``, block FP8 ``ue8m0``) would change, against the default bytes (which
equal vLLM's online ones): share of scales and codes that differ, RMS errors.

    .venv/bin/python scripts/bench_modes.py --options
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SIZES = {"tiny": {}, "medium": dict(hidden_size=1024, num_hidden_layers=8, num_experts=16, moe_intermediate_size=512,
                                    intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4, head_dim=128)}


def timed_reloads(llm: Any) -> list[float]:
    """Wrap ``llm.collective_rpc``: the seconds of every ``reload_weights`` call, appended."""
    seconds: list[float] = []
    real = llm.collective_rpc

    def rpc(method, *args, **kwargs):
        t0 = time.perf_counter()
        out = real(method, *args, **kwargs)
        if method == "reload_weights":
            seconds.append(time.perf_counter() - t0)
        return out

    llm.collective_rpc = rpc
    return seconds


def start_mode_engine(driver: Any, model: Any, mode: str, path: Path) -> Any:
    """An in-process engine on ``model``'s weights for ``driver``'s quantization mode: ``trainer``
    - qstrat's checkpoint at ``path``; ``engine`` - the BF16 checkpoint at ``path``-bf16 with the
    plan's online quantization config (the engine quantizes)."""
    from qstrat import tensor_specs
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import save_bf16
    from qstrat.vllm.engine.local import start_engine
    from qstrat.vllm.online import engine_kwargs

    if mode == "trainer":
        write_checkpoint(driver, model.state_dict(), path)
        return start_engine(path)
    bf16 = save_bf16(model, path.with_name(path.name + "-bf16"))
    return start_engine(bf16, **engine_kwargs(driver.plan(tensor_specs(model.state_dict()))))


def run_mode(preset: str, mode: str, models: tuple[Any, Any], cfg: Any, reps: int, root: Path) -> dict[str, Any]:
    from qstrat import vllm as qvllm
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import release
    from qstrat.vllm.fidelity.probe import Verify

    a, b = models
    driver = RefitDriver({"preset": preset, "keep_bf16": {"first": 0, "last": 0}, "quantize_in": mode}, hf_config=cfg)
    llm = start_mode_engine(driver, a, mode, root / preset)
    reloads = timed_reloads(llm)
    rows = []
    try:
        qvllm.refit(llm, driver, b.state_dict())  # warm-up (plans, first-call costs)
        for i in range(reps):
            model = (a, b)[i % 2 == 0]  # B, A, B, ...: every refit changes every weight
            report = qvllm.refit(llm, driver, model.state_dict(), verify=Verify(model, check=False))
            engine_s = reloads[-1]
            rows.append({"wire_bytes": report.bytes, "trainer_s": report.seconds - engine_s, "engine_s": engine_s,
                         "total_s": report.seconds, "kl": report.fidelity.mean_kl, "kl_bf16": report.fidelity.bf16_kl,
                         "format": report.fidelity.format})
    finally:
        release(llm)
    med = {k: statistics.median(r[k] for r in rows) for k in ("wire_bytes", "trainer_s", "engine_s", "total_s",
                                                               "kl", "kl_bf16")}
    return {"preset": preset, "mode": mode, "format": rows[0]["format"], "reps": reps, **med, "rows": rows}


def option_differences() -> list[dict[str, Any]]:
    """What the format options vLLM's online quantizer does not have would change: per option,
    the share of scales and codes that differ from the default's (= vLLM's online bytes:
    tests/test_engine_online.py) and both RMS errors, on seeded randn [2048, 2048] bf16 and on the
    tiny Qwen3-MoE's attention weights (seed 1)."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe
    from qstrat.plugins.registry import get_registry

    torch.manual_seed(0)
    reg = get_registry()
    tiny = [p for n, p in build_tiny_qwen3_moe(seed=1).state_dict().items() if n.endswith("proj.weight") and p.dim() == 2]
    inputs = {"randn 2048x2048": [torch.randn(2048, 2048, dtype=torch.bfloat16)], "tiny Qwen3-MoE attention": tiny}
    out = []
    for label, mats in inputs.items():
        for fmt, opts, scale in (("mxfp8", {"scale_rounding": "floor"}, "weight_scale"),
                                 ("block_fp8", {"ue8m0": True}, "weight_scale_inv")):
            default, option = reg.serializer(fmt), reg.serializer(fmt, **opts)
            n = {"scales": 0, "scales_diff": 0, "codes": 0, "codes_diff": 0, "err_default": 0.0, "err_option": 0.0, "el": 0}
            for w in mats:
                pd, po = default.quantize(w), option.quantize(w)
                n["scales"] += pd[scale].numel()
                n["scales_diff"] += int((pd[scale] != po[scale]).sum())
                n["codes"] += pd["weight"].numel()
                n["codes_diff"] += int((pd["weight"].view(torch.uint8) != po["weight"].view(torch.uint8)).sum())
                n["err_default"] += float(((default.dequantize(pd) - w.float()) ** 2).sum())
                n["err_option"] += float(((option.dequantize(po) - w.float()) ** 2).sum())
                n["el"] += w.numel()
            out.append({"input": label, "format": fmt, "option": opts, "scales_differ": n["scales_diff"] / n["scales"],
                        "codes_differ": n["codes_diff"] / n["codes"], "rms_default": (n["err_default"] / n["el"]) ** 0.5,
                        "rms_option": (n["err_option"] / n["el"]) ** 0.5})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["block-fp8", "mxfp8"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--options", action="store_true",
                        help="print what the options vLLM's online quantizer lacks would change, and stop (no engine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.options:
        for r in option_differences():
            print(f"{r['input']:<26} {r['format']:<10} {str(r['option']):<28} scales differ {r['scales_differ']:7.1%}  "
                  f"codes differ {r['codes_differ']:7.1%}  RMS error default {r['rms_default']:.3e} option "
                  f"{r['rms_option']:.3e}")
        return 0
    from qstrat.cli.bench import machine
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config

    models = (build_tiny_qwen3_moe(seed=0, **SIZES[args.size]), build_tiny_qwen3_moe(seed=1, **SIZES[args.size]))
    cfg = hf_config(models[1])
    params = sum(p.numel() for p in models[1].parameters())
    results = []
    with tempfile.TemporaryDirectory(prefix="qstrat-bench-modes-") as tmp:
        for preset in args.formats:
            for mode in ("trainer", "engine"):
                results.append(run_mode(preset, mode, models, cfg, args.reps, Path(tmp)))
    print(f"model: tiny Qwen3-MoE '{args.size}', {params / 1e6:.1f} M parameters; median of {args.reps} refits")
    print(f"{'format':<10} {'mode':<8} {'wire MiB':>9} {'trainer s':>10} {'engine s':>9} {'total s':>8} "
          f"{'KL':>9} {'KL bf16':>9}")
    for r in results:
        print(f"{r['format']:<10} {r['mode']:<8} {r['wire_bytes'] / 2**20:>9.2f} {r['trainer_s']:>10.3f} "
              f"{r['engine_s']:>9.3f} {r['total_s']:>8.3f} {r['kl']:>9.2e} {r['kl_bf16']:>9.2e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine(), "size": args.size, "params": params,
                                         "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
