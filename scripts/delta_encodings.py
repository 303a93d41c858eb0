"""Measure the delta encodings (qstrat.transport.delta.encoding) on quantized tensors, per format and lr.

A [rows, cols] bf16 matrix (std 0.02, seeded) takes one sign-like Adam step of size ``lr``
(``w + lr * sign(noise)``, computed in float32, rounded to bf16 - the issue's model of an RL step);
both matrices are quantized with qstrat's own serializers (``RefitDriver(...).run``). Per
checkpoint tensor (its bytes padded to whole 32 KiB tiles, qstrat.transport.delta.encoding.TILE) the script
prints the changed bytes and the patch size with every tile run-length coded (3 bytes per
change), every tile a bitmap (1/8 byte per byte + 1 per change), an int32 index list (5 bytes per
change), and per tile the smallest of rle / bitmap / raw (``tiled``: what qstrat sends, with its
header and tile table), each as a percentage of the tensor's bytes.

    .venv/bin/python scripts/delta_encodings.py [--rows 2048 --cols 2048] [--lr 1e-7 1e-6 1e-5]
"""
from __future__ import annotations

import argparse

import torch

from qstrat.execute.driver import RefitDriver
from qstrat.transport.delta.encoding import padded_size, patch_sizes

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
          f"{'index %':>8} {'rle %':>7} {'tiled %':>8}")
    for fmt, config in FORMATS.items():
        driver = RefitDriver(config)
        old = dict(driver.run({NAME: w.bfloat16()}))
        for lr in args.lr:
            new = dict(driver.run({NAME: (w + lr * step).bfloat16()}))
            total = {"bytes": 0, "tiled": 0}
            for name, t in new.items():
                a, b = (stream(x) for x in (t, old[name]))
                row = patch_sizes(a, b)
                nbytes = t.numel() * t.element_size()
                total["bytes"] += nbytes
                total["tiled"] += row["tiled"]
                pct = {e: 100 * row[e] / max(nbytes, 1) for e in ("changed", "bitmap", "index", "rle", "tiled")}
                print(f"{fmt:10} {lr:7.0e} {name.rsplit('.', 1)[-1]:24} {nbytes:9d} {pct['changed']:10.3f} "
                      f"{pct['bitmap']:9.2f} {pct['index']:8.2f} {pct['rle']:7.2f} {pct['tiled']:8.2f}")
            print(f"{fmt:10} {lr:7.0e} {'(all tensors)':24} {total['bytes']:9d} {'':10} {'':9} {'':8} {'':7} "
                  f"{100 * total['tiled'] / total['bytes']:8.2f}")


def stream(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes padded with zeros to whole tiles."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    out = torch.zeros(padded_size(raw.numel()), dtype=torch.uint8)
    out[:raw.numel()] = raw
    return out


if __name__ == "__main__":
    main()
