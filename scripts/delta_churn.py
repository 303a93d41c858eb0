"""How quantized weights change per RL step: table and chart per format (qstrat.transport.delta_churn).

The tiny Qwen3-MoE (``--width``: hidden, intermediate and head counts times this) takes
``--steps`` real Adam steps per ``--lr`` (float32 master weights, qstrat.demo.trajectory); each
step is quantized in every format of ``--formats`` (block FP8, MXFP8, NVFP4 on the experts, NVFP4
on every linear layer). Per format and lr the script prints the medians over the steps: % of
codes, block scales and global scales changed, the delta round's bytes in % of the full round's
and over a bf16 delta's of the same step. ``--json`` keeps every step's counts (written after
each lr: a long run keeps what it measured); ``--png`` draws the chart (matplotlib; the table
needs none); ``--from-json`` redraws from a kept JSON without measuring.

    .venv/bin/python scripts/delta_churn.py [--width 1] [--steps 50] [--lr 1e-7 1e-6 1e-5]
        [--json docs/delta_churn.json] [--png docs/delta_churn.png]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from qstrat.transport import delta_churn as dc


def measure(width: int, steps: int, lrs: list[float], formats: list[str], out: Path | None) -> dict[str, Any]:
    """The study's document: ``{"width", "steps", "load", "runs": [{"lr", "format", "rows"}]}``
    (rows: :func:`qstrat.transport.delta_churn.trajectory_churn`'s), written to ``out`` after each lr."""
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.demo.trajectory import adam_trajectory
    from qstrat.driver import RefitDriver

    model = build_tiny_qwen3_moe(seed=1, hidden_size=256 * width, intermediate_size=512 * width,
                                 moe_intermediate_size=128 * width, num_attention_heads=4 * width,
                                 num_key_value_heads=2 * width)
    drivers = {f: RefitDriver(dc.FORMATS[f], hf_config=hf_config(model)) for f in formats}
    doc: dict[str, Any] = {"width": width, "steps": steps, "load": [os.getloadavg()[0]], "runs": []}
    for lr in lrs:
        t0 = time.perf_counter()
        rows = dc.trajectory_churn(drivers, adam_trajectory(model, lr, steps))
        doc["runs"] += [{"lr": lr, "format": f, "rows": r} for f, r in rows.items()]
        doc["load"].append(os.getloadavg()[0])
        print(f"lr {lr:.0e}: {steps} steps x {len(formats)} formats in {time.perf_counter() - t0:.0f} s, "
              f"load {doc['load'][-1]:.1f}", flush=True)
        if out is not None:
            out.write_text(json.dumps(doc) + "\n")
    return doc


def summaries(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One :func:`qstrat.transport.delta_churn.summary` per run of ``doc``, by format then lr."""
    runs = sorted(doc["runs"], key=lambda r: (list(dc.FORMATS).index(r["format"]), r["lr"]))
    return [dc.summary(r["format"], r["lr"], r["rows"]) for r in runs]


def table(doc: dict[str, Any]) -> str:
    """The table (markdown) of ``doc``."""
    heads = [h for _, h, _ in dc.COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r) + " |" for r in dc.table_rows(summaries(doc))]
    return "\n".join(lines)


def chart(doc: dict[str, Any], png: Path) -> None:
    """Per format a column of two panels over the steps: % of codes / scales changed (log
    scale), and delta bytes in % of the full round's and of the bf16 delta's; one line per lr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = [f for f in dc.FORMATS if any(r["format"] == f for r in doc["runs"])]
    fig, axes = plt.subplots(2, len(formats), figsize=(4.2 * len(formats), 7), squeeze=False, sharex=True)
    for j, fmt in enumerate(formats):
        top, bottom = axes[0][j], axes[1][j]
        for k, run in enumerate(r for r in doc["runs"] if r["format"] == fmt):
            color = f"C{k}"
            steps = [row["step"] for row in run["rows"]]
            for kind, style in (("codes", "-"), ("scales", "--")):
                ys = [100 * row[f"{kind}_changed"] / row[kind] if row[kind] else float("nan") for row in run["rows"]]
                top.plot(steps, [max(y, 1e-6) for y in ys], style, color=color,
                         label=f"{kind}, lr {run['lr']:.0e}")
            bottom.plot(steps, [100 * row["delta_bytes"] / row["full_bytes"] for row in run["rows"]], "-",
                        color=color, label=f"of full, lr {run['lr']:.0e}")
            bottom.plot(steps, [100 * row["delta_bytes"] / row["bf16_delta_bytes"] for row in run["rows"]], ":",
                        color=color, label=f"of bf16 delta, lr {run['lr']:.0e}")
        top.set_yscale("log")
        bottom.set_yscale("log")
        top.set_title(fmt)
        top.set_ylabel("% changed per step (1e-6: none)")
        bottom.set_ylabel("delta round bytes, %")
        bottom.set_xlabel("Adam step")
        top.legend(fontsize=6)
        bottom.legend(fontsize=6)
    fig.suptitle(f"tiny Qwen3-MoE x{doc['width']}: quantized weights per Adam step (load "
                 f"{min(doc['load']):.0f}-{max(doc['load']):.0f})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-7, 1e-6, 1e-5])
    ap.add_argument("--formats", nargs="+", default=list(dc.FORMATS), choices=list(dc.FORMATS))
    ap.add_argument("--json", type=Path, help="write every step's counts here (after each lr)")
    ap.add_argument("--from-json", type=Path, help="no measuring: the table and chart of this kept JSON")
    ap.add_argument("--png", type=Path, help="draw the chart here (needs matplotlib)")
    args = ap.parse_args(argv)
    doc = (json.loads(args.from_json.read_text()) if args.from_json else
           measure(args.width, args.steps, args.lr, args.formats, args.json))
    print(table(doc))
    if args.png is not None:
        chart(doc, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
