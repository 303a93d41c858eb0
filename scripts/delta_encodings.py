"""Measure the delta encodings (qstrat.transport.delta) on quantized tensors, per format and lr.

A [rows, cols] bf16 matrix (std 0.02, seeded) takes one sign-like Adam step of size ``lr``
(``w + lr * sign(noise)``, computed in float32, rounded to bf16 - the issue's model of an RL step);
both matrices are quantized with qstrat's own serializers (``RefitDriver(...).run``), and per
checkpoint tensor the script prints the changed words (a word: one element of the tensor's
dtype; NVFP4's packed uint8 holds two codes) and the blob size of each encoding (bitmap, index,
rle; raw = the tensor), as a percentage of the tensor's bytes, and which is smallest.

    .venv/bin/python scripts/delta_encodings.py [--rows 2048 --cols 2048] [--lr 1e-7 1e-6 1e-5]
"""
from __future__ import annotations

import argparse

import torch

from qstrat.driver import RefitDriver
from qstrat.transport.delta import density_table

FORMATS = {"block-fp8": "block-fp8", "mxfp8": "mxfp8",
           "nvfp4": {"rules": [{"select": "linear", "serializer": "nvfp4"}]}}
NAME = "model.layers.0.self_attn.q_proj.weight"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-7, 1e-6, 1e-5])
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.rows, args.cols, generator=g) * 0.02
    step = torch.randn(args.rows, args.cols, generator=g).sign()
    print(f"[{args.rows}, {args.cols}] bf16, std 0.02, w + lr * sign(noise); sizes in % of the tensor's bytes")
    print(f"{'format':10} {'lr':>7} {'tensor':24} {'bytes':>9} {'changed %':>10} {'bitmap %':>9} "
          f"{'index %':>8} {'rle %':>7}  best")
    for fmt, config in FORMATS.items():
        driver = RefitDriver(config)
        old = dict(driver.run({NAME: w.bfloat16()}))
        for lr in args.lr:
            new = dict(driver.run({NAME: (w + lr * step).bfloat16()}))
            total = {"full": 0, "best": 0}
            for name, t in new.items():
                row = density_table(t, old[name])
                nbytes = t.numel() * t.element_size()
                total["full"] += nbytes
                total["best"] += min(row[e] for e in ("raw", "bitmap", "index", "rle"))
                pct = {e: 100 * row[e] / max(nbytes, 1) for e in ("bitmap", "index", "rle")}
                print(f"{fmt:10} {lr:7.0e} {name.rsplit('.', 1)[-1]:24} {nbytes:9d} {100 * row['density']:10.3f} "
                      f"{pct['bitmap']:9.2f} {pct['index']:8.2f} {pct['rle']:7.2f}  {row['best']}")
            print(f"{fmt:10} {lr:7.0e} {'(all: smallest blobs)':24} {total['full']:9d} {'':10} "
                  f"{'':9} {'':8} {100 * total['best'] / total['full']:7.2f}")


if __name__ == "__main__":
    main()
