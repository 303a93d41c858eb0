"""``qstrat bench --quick``: every section runs and reports its figures. Structure only: speed is
printed, never asserted (a shared CI machine's timings gate nothing)."""
from __future__ import annotations

import json
import math

from qstrat.cli import main


def test_quick_bench_reports_every_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["size"] == "quick" and doc["machine"]["torch_threads"] >= 1
    rows = doc["rows"]
    by = {(r["section"], r.get("format"), r["impl"]) for r in rows}
    for fmt in ("block_fp8", "mxfp8", "nvfp4"):
        for impl in ("qstrat", "qstrat reference", "copy", "copy into", "vllm"):
            assert ("formats", fmt, impl) in by, (fmt, impl)
        for impl in ("grouped call", "per-expert loop"):
            assert ("grouped", fmt, impl) in by, (fmt, impl)
    assert {("plan", None, "plan"), ("plan", None, "wire order"),
            ("driver", None, "RefitDriver.run"), ("driver", None, "direct serializer calls")} <= by
    for r in rows:
        if r.get("ms") is not None:
            assert r["ms"] > 0 and r["ms_min"] <= r["ms"] and r["reps"] == doc["reps"]
    fmt_rows = [r for r in rows if r["section"] == "formats" and r.get("ms") is not None]
    # the fast path, vLLM's block FP8 / MXFP8 and torchao's MX cast give the reference's bytes
    for r in fmt_rows:
        if r["impl"] in ("qstrat", "qstrat reference") or (r["impl"] == "vllm" and r["format"] != "nvfp4"):
            assert r["bytes_equal_reference"] is True, r
        if r["impl"] == "torchao":
            assert r["bytes_equal_reference"] is True, r
    qstrat_ms = {r["format"]: r["ms"] for r in fmt_rows if r["impl"] == "qstrat"}
    for r in fmt_rows:
        if r["impl"] == "vllm":
            assert math.isclose(r["speedup_vs_this"], r["ms"] / qstrat_ms[r["format"]], rel_tol=0.02, abs_tol=0.01)
        if r["impl"] in ("copy", "copy into"):
            assert math.isclose(r["qstrat_over_copy"], qstrat_ms[r["format"]] / r["ms"], rel_tol=0.02, abs_tol=0.01)
    plan = next(r for r in rows if r["impl"] == "plan")
    assert plan["tensors"] > 20 and math.isclose(plan["us_per_tensor"], plan["ms"] * 1e3 / plan["tensors"], rel_tol=0.02)
    text = capsys.readouterr().out
    assert "its ms / qstrat ms" in text and "loop / grouped" in text and "overhead" in text


def test_unknown_section_is_a_user_error(capsys):
    assert main(["bench", "--quick", "--only", "formats,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_bad_arguments_are_refused_before_measuring(tmp_path, capsys):
    """Each is one error line and exit 2, before any section runs (a full run takes minutes)."""
    cases = {
        ("--max-experts", "0"): "--max-experts must be >= 1, got 0",
        ("--max-experts", "-1"): "--max-experts must be >= 1, got -1",
        ("--reps", "0"): "--reps must be >= 1, got 0",
        ("--only", ",,"): "--only: no section given",
        ("--json", str(tmp_path)): f"--json {tmp_path}: is a directory",
        ("--json", "/proc/qstrat-nope/b.json"): "--json /proc/qstrat-nope/b.json: cannot create its directory",
    }
    for args, message in cases.items():
        assert main(["bench", "--quick", *args]) == 2, args
        captured = capsys.readouterr()
        assert message in captured.err, (args, captured.err)
        assert "its ms" not in captured.out, args  # nothing was measured
