#!/usr/bin/env python
"""Time the CPU fast path over candidate chunk sizes: the data behind the default chunk size.

For each case (one format on one weight shape: the shapes of ``qstrat bench``), every candidate
``chunk_elements`` runs in turn (interleaved, so load from other processes hits all alike) for
``--reps`` rounds after one warm-up; prints the median ms per candidate and its ratio to the
best median of that case, and the grouped-vs-loop ratio per chunk size when ``--loop`` is given.
Bytes are checked equal across candidates (chunking must not change them).

Usage: python scripts/chunk_sweep.py [--sizes 131072,262144,...] [--reps 5] [--shapes formats,grouped]
       [--formats block_fp8,mxfp8,nvfp4] [--loop] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import qstrat
from qstrat.serializers.chunking import DEFAULT_CHUNK_ELEMENTS

SHAPES = {"formats": [(1, 4096, 4096)], "grouped": [(256, 256, 512), (128, 1536, 2048), (128, 2048, 768)]}
SIZES = [1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23, 9830400]  # last: 300 MiB / 4 / 8


def sweep(fmt: str, shape: tuple[int, int, int], sizes: list[int], reps: int, loop: bool) -> dict:
    """Median ms of ``fmt``'s fast path on a seeded bf16 ``shape`` per chunk size (and of a
    per-expert loop at the same chunk size when ``loop``)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = w[0] if shape[0] == 1 else w
    sers = {c: qstrat.get_serializer(fmt, chunk_elements=c) for c in sizes}
    want = {k: v.view(torch.uint8) if v.dtype.itemsize == 1 else v for k, v in sers[sizes[0]].quantize(x).items()}
    impls = {}
    for c, s in sers.items():
        got = s.quantize(x)
        for k, v in got.items():
            assert torch.equal(v.view(torch.uint8) if v.dtype.itemsize == 1 else v, want[k]), (fmt, shape, c, k)
        impls[("grouped", c)] = lambda s=s: s.quantize(x)
        if loop and shape[0] > 1:
            impls[("loop", c)] = lambda s=s: [s.quantize(w[e]) for e in range(w.shape[0])]
    times = {k: [] for k in impls}
    for fn in impls.values():
        fn()
    for _ in range(reps):
        for k, fn in impls.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    best = min(v for (kind, _), v in med.items() if kind == "grouped")
    rows = []
    for c in sizes:
        row = {"chunk": c, "ms": round(med[("grouped", c)], 2), "over_best": round(med[("grouped", c)] / best, 3)}
        if ("loop", c) in med:
            row["loop_ms"] = round(med[("loop", c)], 2)
            row["loop_over_grouped"] = round(med[("loop", c)] / med[("grouped", c)], 2)
        rows.append(row)
    return {"format": fmt, "shape": list(shape), "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--formats", default="block_fp8,mxfp8,nvfp4")
    p.add_argument("--shapes", default="formats,grouped", help="groups (formats, grouped) or ExNxK shapes")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--loop", action="store_true", help="also time the per-expert loop at each size")
    p.add_argument("--json")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    doc = {"threads": torch.get_num_threads(), "default": DEFAULT_CHUNK_ELEMENTS,
           "load_before": os.getloadavg(), "cases": []}
    for group in args.shapes.split(","):
        for shape in SHAPES.get(group) or [tuple(int(d) for d in group.split("x"))]:
            for fmt in args.formats.split(","):
                case = sweep(fmt, shape, sizes, args.reps, args.loop)
                doc["cases"].append(case)
                cells = "  ".join(f"{r['chunk'] >> 10}K:{r['ms']:.1f}({r['over_best']:.2f}"
                                  + (f", loop/g {r['loop_over_grouped']}" if "loop_over_grouped" in r else "")
                                  + ")" for r in case["rows"])
                print(f"{fmt:10} {'x'.join(map(str, shape)):14} {cells}  load {os.getloadavg()[0]:.1f}", flush=True)
    doc["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
