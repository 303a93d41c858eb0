#!/usr/bin/env python
"""Where a format's fast CPU path spends its time: torch.profiler over one cache-sized chunk.

Runs each format's ``encode_into`` (the default CPU path) on one seeded bf16 chunk of
[256, 4096] = 1 M elements on ONE torch thread (a chunk worker's setting), prints the time per
chunk and the torch ops by self time (per chunk, averaged over the profiled reps). This is the
profile docs/performance.md quotes ("Where the time goes").

Usage: python scripts/profile_formats.py [--formats block_fp8,mxfp8,nvfp4] [--reps 10] [--rows 12]
"""
from __future__ import annotations

import argparse
import time

import torch

import qstrat
from qstrat.serializers.chunking import Scratch


def profile(fmt: str, reps: int, rows: int) -> None:
    """Print the per-chunk time of ``fmt``'s fast path and its top torch ops by self time."""
    ser = qstrat.get_serializer(fmt)
    shape = (1, 256, 4096)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = {p.suffix: torch.empty(p.shape, dtype=p.dtype) for p in ser.part_specs(shape)}
    ctx = ser.group_context([x])
    scratch = Scratch(torch.device("cpu"))
    for _ in range(3):  # warm-up: scratch allocated, caches warm
        ser.encode_into(x, ctx, out, scratch)
    t0 = time.perf_counter()
    for _ in range(reps):
        ser.encode_into(x, ctx, out, scratch)
    per_chunk_us = (time.perf_counter() - t0) / reps * 1e6
    with torch.profiler.profile() as prof:
        for _ in range(reps):
            ser.encode_into(x, ctx, out, scratch)
    print(f"\n{fmt}: {per_chunk_us:.0f} us per 1 M-element chunk (one thread, {reps} reps)")
    print(f"  {'op':<32} {'us per chunk':>12} {'share':>7} {'calls':>6}")
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    for e in events[:rows]:
        print(f"  {e.key:<32} {e.self_cpu_time_total / reps:>12.0f} {e.self_cpu_time_total / total:>7.1%} "
              f"{e.count // reps:>6}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="block_fp8,mxfp8,nvfp4")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rows", type=int, default=12)
    args = p.parse_args()
    torch.set_num_threads(1)
    for fmt in [f for f in args.formats.split(",") if f]:
        profile(fmt, args.reps, args.rows)


if __name__ == "__main__":
    main()
