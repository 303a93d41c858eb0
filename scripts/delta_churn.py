"""How quantized weights change per RL step: table and chart per format (qstrat.transport.delta.churn).

The tiny Qwen3-MoE (``--width``: hidden, intermediate and head counts times this) takes
``--steps`` real Adam steps per ``--lr`` (float32 master weights, qstrat.cli.demo.trajectory), its
loss the next-token loss on a fixed text (``--text FILE``, byte-level tokens; default the Zen of
Python); each step is quantized in every
format of ``--formats`` (block FP8, MXFP8, NVFP4 on the experts, NVFP4 on every linear layer).
Per format and lr the script prints the medians and ranges over the steps: % of codes, block
scales and global scales changed, the delta round's bytes in % of the full round's and over a
bf16 delta's of the same step. ``--json`` keeps every step's counts (written after each step: a
run cut short keeps what it measured); ``--png`` draws the chart (matplotlib; the table needs
none); ``--from-json`` redraws from kept JSONs without measuring, several of one study (e.g. one
process per lr) merged into one (and written to ``--json``). ``--forced`` adds what the formats
force: the same table for the step-0 weights against themselves with every weight, or only each
matrix's largest, one bf16 ulp larger (qstrat.transport.delta.churn.forced_churn).

    .venv/bin/python scripts/delta_churn.py [--width 1] [--steps 50] [--lr 1e-7 1e-6 1e-5]
        [--threads 1] [--json docs/delta_churn.json] [--png docs/delta_churn.png]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from qstrat.transport.delta import churn as dc


def measure(width: int, steps: int, lrs: list[float], formats: list[str], out: Path | None,
            text: Path | None = None) -> dict[str, Any]:
    """:func:`qstrat.transport.delta.churn.measure` on the bytes of the file ``text`` (None: the
    Zen of Python), its document written to ``out`` after each step, with ``"seconds"``: its
    wall time so far."""
    t0 = time.perf_counter()

    def done(doc: dict[str, Any]) -> None:
        if "partial" in doc:  # a step: kept with the finished lrs (a run cut short keeps its steps)
            if out is not None:
                kept = {k: v for k, v in doc.items() if k != "partial"}
                out.write_text(json.dumps({**kept, "runs": doc["runs"] + doc["partial"],
                                           "seconds": round(time.perf_counter() - t0)}) + "\n")
            return
        doc["seconds"] = round(time.perf_counter() - t0)
        print(f"lr {doc['runs'][-1]['lr']:.0e}: {steps} steps x {len(formats)} formats, "
              f"{doc['seconds']} s so far, load {doc['load'][-1]:.1f}", flush=True)
        if out is not None:
            out.write_text(json.dumps(doc) + "\n")

    return dc.measure(width, steps, lrs, formats, done, *(() if text is None else (text.read_text(), text.name)))


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document of several runs of one study (same width, steps and token stream; e.g. one
    process per lr): their runs together, ``load`` and ``seconds`` of each kept per part.
    Raises: ValueError when they differ in width, steps or token stream, or repeat a (format, lr)."""
    keys = ("width", "steps", "token_stream")
    if len({tuple(d.get(k) for k in keys) for d in docs}) > 1:
        raise ValueError(f"--from-json: the documents are not one study (they differ in {keys}: "
                         f"{[tuple(d.get(k) for k in keys) for d in docs]})")
    runs = [r for d in docs for r in d["runs"]]
    seen = [(r["format"], r["lr"]) for r in runs]
    if len(set(seen)) < len(seen):
        raise ValueError(f"--from-json: a (format, lr) appears twice: {sorted(x for x in seen if seen.count(x) > 1)}")
    if len(docs) == 1:
        return docs[0]
    forced = [d["forced"] for d in docs if "forced" in d]
    return {**{k: v for k, v in docs[0].items() if k not in ("runs", "load", "seconds", "forced")}, "runs": runs,
            "load": [x for d in docs for x in d["load"]], **({"forced": forced[-1]} if forced else {}),
            "parts": [{"load": d["load"], "seconds": d.get("seconds")} for d in docs]}


def table(doc: dict[str, Any]) -> str:
    """The table (markdown) of ``doc``."""
    heads = [h for _, h, _ in dc.COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r) + " |" for r in dc.table_rows(dc.summaries(doc))]
    return "\n".join(lines)


def forced_table(forced: dict[str, Any]) -> str:
    """The table (markdown) of a :func:`qstrat.transport.delta.churn.measure_forced` document:
    per perturbation and format, % of codes, block scales and global scales changed, the delta
    round's bytes in % of the full round's, and its bytes beside the bf16 delta's."""
    lines = ["| perturbation | format | codes changed % | scales changed % | global scales changed % | delta / full % "
             "| delta bytes | bf16 delta bytes |", "|---|---|---|---|---|---|---|---|"]
    for what, by_format in forced["perturbations"].items():
        for fmt, r in by_format.items():
            pct = ["-" if not r[k] else f"{100 * r[f'{k}_changed'] / r[k]:.4f}" for k in ("codes", "scales", "global")]
            lines.append(f"| {what} | {fmt} | {' | '.join(pct)} | {100 * r['delta_bytes'] / r['full_bytes']:.3f} "
                         f"| {r['delta_bytes']:,} | {r['bf16_delta_bytes']:,} |")
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
        top.set_ylabel("% changed per step (0 drawn at 1e-6)")
        bottom.set_ylabel("delta round bytes, %")
        bottom.set_xlabel("Adam step")
        top.legend(fontsize=6)
        bottom.legend(fontsize=6)
    params = f", {doc['parameters'] / 1e6:.1f} M parameters" if "parameters" in doc else ""
    fig.suptitle(f"tiny Qwen3-MoE x{doc['width']}{params}, {doc.get('token_stream', 'seeded random tokens')}: "
                 f"quantized weights per Adam step (load {min(doc['load']):.0f}-{max(doc['load']):.0f})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-7, 1e-6, 1e-5])
    ap.add_argument("--formats", nargs="+", default=list(dc.FORMATS), choices=list(dc.FORMATS))
    ap.add_argument("--text", type=Path, help="the training text (a UTF-8 file, byte-level tokens; default "
                                              "the Zen of Python)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; 1 on a shared machine)")
    ap.add_argument("--json", type=Path, help="write every step's counts here (after each step; with "
                                              "--from-json: the merged document)")
    ap.add_argument("--from-json", type=Path, nargs="+", help="no measuring: the table and chart of these kept "
                                                              "JSONs (parts of one study, merged)")
    ap.add_argument("--png", type=Path, help="draw the chart here (needs matplotlib)")
    ap.add_argument("--forced", action="store_true",
                    help="also measure what the formats force: the step-0 weights with every weight, or each "
                         "matrix's largest, one bf16 ulp larger (kept in the JSON as 'forced')")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.from_json:
        doc = merge([json.loads(p.read_text()) for p in args.from_json])
        if args.json is not None:
            args.json.write_text(json.dumps(doc) + "\n")
    else:
        doc = measure(args.width, args.steps, args.lr, args.formats, args.json, args.text)
    if args.forced:
        doc["forced"] = dc.measure_forced(doc["width"], [f for f in dc.FORMATS if any(r["format"] == f for r in doc["runs"])])
        if args.json is not None:
            args.json.write_text(json.dumps(doc) + "\n")
    print(table(doc))
    if "forced" in doc:
        print(forced_table(doc["forced"]))
    if args.png is not None:
        chart(doc, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
