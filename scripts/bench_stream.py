"""Benchmark: peak memory of a streamed refit against model size; batched vs per-expert time.

A synthetic Qwen3-MoE-shaped model is produced layer by layer as ``(hf_name, tensor)`` pairs
(per-expert names, as a Megatron-style exporter yields them; values made on the fly, so the
producer itself holds one tensor at a time). Each measurement runs in a fresh child process
with ``MALLOC_MMAP_THRESHOLD_`` fixed (freed tensors go back to the OS at once, so RSS follows
what is live); a thread samples ``/proc/self/statm`` every millisecond, and the consumer samples
it at every yielded tensor. Reported: peak RSS minus the RSS after planning (before the first
tensor is produced).

Modes measured per depth:
- ``stream``: ``driver.run(pairs, plan=driver.plan(tensor_specs(specs)))`` - consumed once;
- ``dict``:   ``driver.run(pairs)`` - planned first, which holds every input (the old way).

Then, on the same layer held in memory: ``execute`` with ``expert_batch`` N vs 1 (median of
``--reps``), on CPU (torch reference) and, where CUDA is available, on the GPU (Triton kernels).

Usage::

    python scripts/bench_stream.py                        # the table in docs/performance.md
    python scripts/bench_stream.py --layers 2 8 --hidden 512 --experts 8 --inter 256 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20


def specs(layers: int, hidden: int, experts: int, inter: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the synthetic model in producer order: embeddings, layers, norm, lm_head."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out.append((f"{p}.input_layernorm.weight", (hidden,)))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((f"{p}.self_attn.{proj}.weight", (hidden, hidden)))
        out.append((f"{p}.post_attention_layernorm.weight", (hidden,)))
        out.append((f"{p}.mlp.gate.weight", (experts, hidden)))
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            out += [(f"{q}.gate_proj.weight", (inter, hidden)), (f"{q}.up_proj.weight", (inter, hidden)),
                    (f"{q}.down_proj.weight", (hidden, inter))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def hf_config(layers: int, hidden: int, experts: int, inter: int, vocab: int) -> dict[str, Any]:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": layers,
            "hidden_size": hidden, "num_experts": experts, "moe_intermediate_size": inter, "vocab_size": vocab}


def produce(shapes: list[tuple[str, tuple[int, ...]]], device: str = "cpu"):
    """Yield (name, bf16 tensor) made on the fly (seeded, so every run sees the same values)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    for name, shape in shapes:
        yield name, torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def child(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    import torch

    from qstrat import RefitDriver, tensor_specs

    torch.set_num_threads(max(1, args.threads))
    dims = (args.hidden, args.experts, args.inter, args.vocab)
    shapes = specs(args.depth, *dims)
    driver = RefitDriver({"preset": args.preset}, hf_config=hf_config(args.depth, *dims))
    plan = driver.plan(tensor_specs((n, s, torch.bfloat16) for n, s in shapes))
    _warm_up(driver, plan)
    model_bytes = sum(2 * _numel(s) for _, s in shapes)
    layer_bytes = sum(2 * _numel(s) for n, s in shapes if n.startswith("model.layers.0."))
    base = rss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out_bytes = 0
    start = time.perf_counter()
    emitted = driver.run(produce(shapes), plan=plan) if mode == "stream" else driver.run(produce(shapes))
    for _, t in emitted:
        out_bytes += t.numel() * t.element_size()
        peak[0] = max(peak[0], rss())
        del t
    seconds = time.perf_counter() - start
    stop.set()
    thread.join()
    return {"mode": mode, "layers": args.depth, "model_bytes": model_bytes, "layer_bytes": layer_bytes,
            "out_bytes": out_bytes, "peak_delta": peak[0] - base, "seconds": seconds}


def batch_times(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Median seconds of one layer's export with expert_batch N and 1 (inputs held in memory)."""
    import torch

    from qstrat import RefitDriver, tensor_specs

    dims = (args.hidden, args.experts, args.inter, args.vocab)
    shapes = [(n, s) for n, s in specs(1, *dims) if n.startswith("model.layers.0.")]
    tensors = dict(produce(shapes, device))
    result: dict[str, Any] = {"device": device, "experts": args.experts, "batch": args.batch}
    outputs = {}
    for batch in (args.batch, 1):
        driver = RefitDriver({"preset": args.preset, "expert_batch": batch}, hf_config=hf_config(1, *dims))
        plan = driver.plan(tensor_specs(tensors))
        times = []
        for _ in range(args.reps + 1):  # the first run warms up (Triton compiles)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = [(n, t.contiguous()) for n, t in driver.execute(plan, tensors)]
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        outputs[batch] = out
        result[f"ms_batch_{batch}"] = 1e3 * statistics.median(times[1:])
    a, b = outputs[args.batch], outputs[1]
    result["bit_exact"] = [n for n, _ in a] == [n for n, _ in b] and all(
        torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x, y.view(torch.uint8) if y.element_size() == 1 else y)
        for (_, x), (_, y) in zip(a, b))
    result["speedup"] = result["ms_batch_1"] / result[f"ms_batch_{args.batch}"]
    return result


def _warm_up(driver: Any, plan: Any) -> None:
    """Run each format of the plan once on a small tensor: the one-time costs (torch's lazily
    created kernels, thread pools, allocator arenas) then fall before the baseline."""
    import torch

    formats = {(e.serializer, repr(e.options)): e for e in plan.entries if e.serializer != "passthrough"}
    for e in formats.values():
        driver.serializer(e.serializer, e.options).quantize(torch.randn(2, 256, 256).to(torch.bfloat16))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16], help="decoder depths")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--inter", type=int, default=512, help="moe_intermediate_size")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--preset", default="block-fp8")
    p.add_argument("--batch", type=int, default=16, help="expert_batch of the batched run")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["stream", "dict"])
    p.add_argument("--no-timing", action="store_true", help="memory only")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", choices=["stream", "dict", "batch"], help=argparse.SUPPRESS)
    p.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        res = child(args.child, args) if args.child != "batch" else batch_times(args, "cpu")
        print(json.dumps(res))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    common = [f"--hidden={args.hidden}", f"--experts={args.experts}", f"--inter={args.inter}",
              f"--vocab={args.vocab}", f"--preset={args.preset}", f"--threads={args.threads}"]
    memory = []
    for depth in args.layers:
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--child", mode, f"--depth={depth}", *common]
            memory.append(json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                                    text=True).stdout.splitlines()[-1]))
            r = memory[-1]
            print(f"{mode:6} layers {depth:3}  model {r['model_bytes'] / MiB:8.1f} MiB  layer "
                  f"{r['layer_bytes'] / MiB:6.1f} MiB  peak RSS +{r['peak_delta'] / MiB:8.1f} MiB "
                  f"({r['peak_delta'] / r['model_bytes']:.2f} x model, {r['peak_delta'] / r['layer_bytes']:.2f} x layer)"
                  f"  {r['seconds']:.2f} s", flush=True)
    timing = []
    if not args.no_timing:
        cmd = [sys.executable, __file__, "--child", "batch", f"--batch={args.batch}", f"--reps={args.reps}", *common]
        timing.append(json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                                text=True).stdout.splitlines()[-1]))
        try:
            import torch

            if torch.cuda.is_available():
                timing.append(batch_times(args, "cuda"))
        except ImportError:
            pass
        for t in timing:
            batched = t[f"ms_batch_{t['batch']}"]
            print(f"one layer, {t['experts']} experts x 3 projections, {t['device']}: expert_batch "
                  f"{t['batch']}: {batched:.1f} ms, expert_batch 1: {t['ms_batch_1']:.1f} ms "
                  f"({t['speedup']:.2f} x), bit-exact: {t['bit_exact']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "memory": memory, "timing": timing}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
