"""``qstrat bench --quick``: every section runs and reports its figures. Structure only: speed is
printed, never asserted (a shared CI machine's timings gate nothing)."""
from __future__ import annotations

import json
import math

from qstrat.cli.bench import machine
from qstrat.cli.commands import main
from qstrat.serializers import chunking


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
    kernels = [r for r in rows if r["section"] == "kernels"]
    assert {(r["case"], r["format"], r["arch"]) for r in kernels} == {
        (c, f, a) for c in ("4x512x1024", "8x1536x2048", "256x4096x7168") for f in ("block_fp8", "mxfp8", "nvfp4")
        for a in (90, 100)}, [r.get("note") for r in kernels]
    for r in kernels:  # the static facts of the compiled launches (tests/test_kernels_static.py)
        assert r["stack"] == 0 and r["instr_per_element"] > 0 and "e4m3" in r["native"], r
        assert ("ceiling_B200" in r) == (r["arch"] == 100) and ("ceiling_H200" in r) == (r["arch"] == 90)
    assert {("plan", None, "plan (cold)"), ("plan", None, "plan (warm)"), ("plan", None, "wire order"),
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
    plans = [r for r in rows if r["impl"] == "plan (cold)"]
    assert [r["case"].split(" ")[0] for r in plans] == ["deepseek-v3", "qwen3-235b-a22b"]
    for plan in plans:
        assert plan["tensors"] > 20
        assert math.isclose(plan["us_per_tensor"], plan["ms"] * 1e3 / plan["tensors"], rel_tol=0.02)
    cluster = [r for r in rows if r["section"] == "cluster"]  # projected: arithmetic on the plan
    assert [(r["case"], r["trainer"], r["engine"]) for r in cluster] == [
        (m, t, e) for m in ("qwen3-235b-a22b", "deepseek-v3", "kimi-k2-sized")
        for t, e in (("ep8xfsdp8", "tp8xdp16"), ("ep8xfsdp8", "tp8xdp16xep (linear)"), ("ep8xfsdp32", "tp8xdp16"))]
    for r in cluster:
        assert math.isclose(r["mesh_s"], r["busiest_gb"] * 8 / 400, rel_tol=1e-9)
        assert math.isclose(r["broadcast_flat_s"], r["broadcast_pipelined_s"] * 128, rel_tol=1e-9)
        assert math.isclose(r["broadcast_tree_s"], r["broadcast_pipelined_s"] * 8, rel_tol=1e-9)  # ceil(log2 129)
    churn = {r["format"]: r for r in rows if r["section"] == "delta"}  # values: tests/test_delta_churn.py
    assert set(churn) == {"block-fp8", "mxfp8", "nvfp4-experts", "nvfp4-linear"}
    for r in churn.values():
        assert r["lr"] == 1e-5 and r["steps"] == 1 and r["codes_pct"] > 0 and 0 < r["delta_pct_of_full"] < 10, r
    text = capsys.readouterr().out
    assert "its ms / qstrat ms" in text and "loop / grouped" in text and "overhead" in text
    assert "delta / bf16 delta" in text
    assert "sm_90" in text and "sm_100" in text  # the kernels' arch as docs/performance.md names it
    # the machine facts: the JSON's are what the code in force uses, and the header prints them
    m = doc["machine"]
    setting = chunking.chunk_setting()
    assert (m["chunk_elements"], m["chunk_source"]) == (setting.elements, setting.source)
    assert m["chunk_workers"] == chunking.chunk_workers() == m["torch_threads"]
    assert m["reported_llc_bytes"] == chunking.reported_llc_bytes()
    assert m == {**machine(), "torch_threads": m["torch_threads"]}
    assert f"{setting.elements:,} ({setting.source})" in text and "AMX" in text


def test_machine_facts_come_from_cpuinfo_and_the_chunk_setting(monkeypatch, capsys):
    from pathlib import Path

    from qstrat.cli.bench import machine_table
    from rich.console import Console

    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    flags = next(ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags"))
    monkeypatch.setenv("QSTRAT_CHUNK_ELEMENTS", "262144")
    m = machine()
    assert m["cpu"] == model and m["amx"] == ("amx_tile" in flags)
    assert (m["chunk_elements"], m["chunk_source"]) == (262144, "env")
    Console(width=200).print(machine_table(m))
    text = capsys.readouterr().out
    assert "262,144 (env)" in text and model in text
    assert ("AMX" in text) and (("yes" if m["amx"] else "no") in text.split("AMX", 1)[1].split("\n")[0])


def test_malformed_chunk_variable_is_refused_before_measuring(monkeypatch, capsys):
    monkeypatch.setenv("QSTRAT_CHUNK_ELEMENTS", "1M")
    assert main(["bench", "--quick", "--only", "plan"]) == 2
    captured = capsys.readouterr()
    assert "QSTRAT_CHUNK_ELEMENTS='1M': expected an integer >= 1" in captured.err
    assert "us / tensor" not in captured.out


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


def test_torchao_peer_gives_the_reference_bytes_where_installed():
    """The project's .venv has no torchao (pyproject's bench extra): its MXFP8 row says how to
    install it. scripts/torchao_check.sh runs this with torchao on PYTHONPATH
    (QSTRAT_EXPECT_TORCHAO=<version>): its MX cast gives qstrat's reference bytes."""
    import importlib.util
    import os

    from qstrat.cli.bench import bench_formats

    rows = {r["impl"]: r for r in bench_formats((64, 128), 1) if r["format"] == "mxfp8"}
    expected = os.environ.get("QSTRAT_EXPECT_TORCHAO")
    if expected is None:
        assert importlib.util.find_spec("torchao") is None, "torchao is in the project's environment"
        assert rows["torchao"] == {"section": "formats", "case": "64x128 bf16", "format": "mxfp8", "impl": "torchao",
                                   "ms": None, "note": "torchao not installed (pip install 'qstrat[bench]')"}
        return
    import torchao

    assert torchao.__version__ == expected
    assert rows["torchao"]["bytes_equal_reference"] is True and rows["torchao"]["ms"] > 0
    assert rows["torchao"]["note"] == "torchao.prototype.mx_formats MXTensor.to_mx (RCEIL)"
