"""scripts/gpu_check.py's CPU smoke mode (Triton interpreter, tiny shapes) keeps running.

Runs the script in a subprocess (it must set TRITON_INTERPRET before triton is imported) and
checks the values in the JSON it writes, not just its exit code.
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'qstrat[triton]')")

ROOT = Path(__file__).resolve().parents[1]


def serializer_class(name: str):
    """A format by name: the registry's, else the class named so in qstrat.serializers.<name>."""
    from qstrat.plugins.registry import get_registry
    from qstrat.serializers.base import Serializer

    reg = get_registry().serializers
    if name in reg:
        return reg[name].obj
    mod = importlib.import_module(f"qstrat.serializers.{name}")
    return next(
        c for c in vars(mod).values()
        if isinstance(c, type) and issubclass(c, Serializer) and c.__dict__.get("name") == name
    )


@pytest.mark.interpreter
def test_gpu_check_smoke_mode_writes_consistent_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--smoke", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "kernel, 1 launch" in proc.stdout  # the table was printed
    # the verdict is the last line, naming what was judged (scripts/gpu_check_verdict.py)
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "gpu_check: verdict PASS (exit 0): parity, static compile (smoke:")
    report = json.loads(out.read_text())
    assert report["verdict"] == {"failed": {}, "exit_code": 0}
    assert report["mode"].startswith("cpu-smoke")
    assert {"block_fp8", "mxfp8", "nvfp4"} <= set(report["formats"])
    assert report["copy"]["gbps"] > 0
    assert report["copy"]["gbps"] == pytest.approx(
        report["copy"]["bytes"] / report["copy"]["ms"] / 1e6
    )
    rows = {(r["format"], tuple(r["shape"]), r["impl"]): r for r in report["results"]}
    for fmt in report["formats"]:
        ser = serializer_class(fmt)()
        for shape in map(tuple, report["shapes"]):
            e, n, k = shape
            want_bytes = e * n * k * 2 + sum(p.nbytes for p in ser.part_specs(shape))
            for impl in ("kernel, 1 launch", "kernel, per-expert loop", "qstrat torch reference"):
                r = rows[(fmt, shape, impl)]
                assert r["bytes"] == want_bytes, (fmt, shape, impl)
                assert r["ms"] > 0
                assert r["gbps"] == pytest.approx(want_bytes / r["ms"] / 1e6)
                assert r["pct_of_copy"] == pytest.approx(100 * r["gbps"] / report["copy"]["gbps"])
            for impl in ("kernel, 1 launch", "kernel, per-expert loop"):
                r = rows[(fmt, shape, impl)]
                assert (r["bit_exact"], r["mismatched_bytes"]) == (True, 0), (fmt, shape, impl)
            # the same bytes copied on the device: the kernel's GB/s over the copy's
            copy = rows[(fmt, shape, "copy, same bytes")]
            assert copy["bytes"] == want_bytes and copy["gbps"] > 0
            launch = rows[(fmt, shape, "kernel, 1 launch")]
            assert launch["pct_of_same_bytes_copy"] == pytest.approx(100 * launch["gbps"] / copy["gbps"])
    # every test-vector class, kernel vs the CPU reference, byte for byte (all options)
    vec = report["vectors"]
    assert {(v["format"], v["mismatched_bytes"]) for v in vec} == {(f, 0) for f in report["formats"]}
    classes = {v["class"] for v in vec}
    assert {"all-zero blocks", "-0.0 blocks", "tiny (1e-40..1e-35)", "E2M1 ladder and nibble order",
            "NaN/inf (nonfinite=propagate)", "ragged 300 x 200"} <= classes
    assert {(v["format"], str(v["options"])) for v in vec} >= {
        ("block_fp8", "{'ue8m0': True}"), ("mxfp8", "{'scale_rounding': 'floor'}"), ("nvfp4", "{}")}
    assert "test vectors, kernel on cpu vs torch reference on CPU" in proc.stdout
    # the static ceiling of the compiled launch (smoke: sm_90, first shape) beside the row
    st = report["static"]
    assert st["arch"] == 90 and "error" not in st, st
    first = tuple(report["shapes"][0])
    for fmt in report["formats"]:
        facts = st["rows"][f"{fmt}|{'x'.join(map(str, first))}"]
        assert facts["stack"] == 0 and facts["arch"] == 90
        r = rows[(fmt, first, "kernel, 1 launch")]
        assert r["static_ceiling"] == min(facts["ceiling_H100"], facts["ceiling_H200"])
    # issue 14's GPU figures, computed from the rows above (smoke mode: values, not speed)
    assert "targets (issue 14)" in proc.stdout
    targets = {t["format"]: t for t in report["targets"]}
    assert set(targets) == set(report["formats"])
    for fmt, t in targets.items():
        big, small = tuple(t["large_slab"]), tuple(t["small_slab"])
        assert big == max(map(tuple, report["shapes"]), key=lambda s: s[0] * s[1] * s[2])
        assert t["pct_of_copy"] == rows[(fmt, big, "kernel, 1 launch")]["pct_of_copy"]
        assert t["loop_over_launch"] == pytest.approx(rows[(fmt, small, "kernel, per-expert loop")]["ms"]
                                                      / rows[(fmt, small, "kernel, 1 launch")]["ms"])
        assert t["pct_met"] == (t["pct_of_copy"] >= 85.0) and t["loop_met"] == (t["loop_over_launch"] >= 5.0)
    # the native-fp8 proof ran over its sample; the encoder's side of each example is torch's cast
    nf = report["native_fp8"]
    assert (nf["patterns"], nf["step"]) == (65536, 65537)
    assert set(nf["mismatches"]) == {"finite <= 448", "finite > 448", "inf", "nan"}
    assert sum(nf["mismatches"].values()) <= nf["patterns"] and len(nf["examples"]) <= 8
    assert nf["bit_exact_in_range"] == (nf["mismatches"]["finite <= 448"] == 0)
    assert "native fp8 cast vs integer encoder" in proc.stdout
    for bits, enc, _native in nf["examples"]:
        x = torch.tensor([bits - (1 << 32) if bits >= 1 << 31 else bits], dtype=torch.int32).view(torch.float32)
        if x.abs().item() <= 448:
            assert enc == x.to(torch.float8_e4m3fn).view(torch.uint8).item(), hex(bits)


@pytest.mark.interpreter
def test_gpu_check_sh_runs_qstrat_from_the_source_tree(tmp_path):
    """gpu_check.sh with a stock torch + triton Python: qstrat from this tree through a link farm
    (forced here with QSTRAT_FROM_SOURCE=1, since the venv has qstrat installed), removed after."""
    import os

    out = tmp_path / "gc.json"
    env = dict(os.environ, PYTHON=sys.executable, QSTRAT_FROM_SOURCE="1")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke", "--formats", "mxfp8", "--no-pytest",
         "--json", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    farm = Path(report["qstrat"])
    assert farm.name == "qstrat" and farm.parent != ROOT  # imported through the farm ...
    assert not farm.parent.exists()  # ... which is removed on exit
    assert report["formats"] == ["mxfp8"] and {v["mismatched_bytes"] for v in report["vectors"]} == {0}
    # and nothing written into the source tree (it once left serializers/serializers and
    # strategies/strategies links there: ln -s onto the farm's link to a directory)
    assert not (ROOT / "serializers" / "serializers").is_symlink()
    assert not (ROOT / "strategies" / "strategies").is_symlink()
