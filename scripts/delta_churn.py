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
import time
from pathlib import Path
from typing import Any

from qstrat.transport import delta_churn as dc


def measure(width: int, steps: int, lrs: list[float], formats: list[str], out: Path | None) -> dict[str, Any]:
    """:func:`qstrat.transport.delta_churn.measure`, its document written to ``out`` after each lr."""
    t0 = time.perf_counter()

    def done(doc: dict[str, Any]) -> None:
        if "partial" in doc:  # a step: kept with the finished lrs (a run cut short keeps its steps)
            if out is not None:
                kept = {k: v for k, v in doc.items() if k != "partial"}
                out.write_text(json.dumps({**kept, "runs": doc["runs"] + doc["partial"]}) + "\n")
            return
        print(f"lr {doc['runs'][-1]['lr']:.0e}: {steps} steps x {len(formats)} formats, "
              f"{time.perf_counter() - t0:.0f} s so far, load {doc['load'][-1]:.1f}", flush=True)
        if out is not None:
            out.write_text(json.dumps(doc) + "\n")

    return dc.measure(width, steps, lrs, formats, done)


def table(doc: dict[str, Any]) -> str:
    """The table (markdown) of ``doc``."""
    heads = [h for _, h, _ in dc.COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r) + " |" for r in dc.table_rows(dc.summaries(doc))]
    return "\n".join(lines)


def chart(doc: dict[str, Any], png: Path) -> None:
    """Per format a column of two panels over the steps: % of codes / block scales / global
    scales changed (log scale), and delta bytes in % of the full round's and of the bf16 delta's; one line per lr."""
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
            for kind, style in (("codes", ".-"), ("scales", ".--"), ("global", ".:")):
                if not any(row[kind] for row in run["rows"]):
                    continue
                ys = [100 * row[f"{kind}_changed"] / row[kind] if row[kind] else float("nan") for row in run["rows"]]
                top.plot(steps, [max(y, 1e-6) for y in ys], style, color=color,
                         label=f"{kind}, lr {run['lr']:.0e}")
            bottom.plot(steps, [100 * row["delta_bytes"] / row["full_bytes"] for row in run["rows"]], ".-",
                        color=color, label=f"of full, lr {run['lr']:.0e}")
            bottom.plot(steps, [100 * row["delta_bytes"] / row["bf16_delta_bytes"] for row in run["rows"]], ".:",
                        color=color, label=f"of bf16 delta, lr {run['lr']:.0e}")
        top.set_yscale("log")
        bottom.set_yscale("log")
        top.set_title(fmt)
        top.set_ylabel("% changed per step (none drawn at 1e-6)")
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
