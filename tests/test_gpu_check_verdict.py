"""scripts/gpu_check.sh's verdict: its exit code and last lines for each failure class, its
refusals, its dry run, and its kernel pytest child under CI=true.

The failure classes are simulated on CPU by reports (the dict gpu_check.py writes) that carry
exactly one failure each; gpu_check.py's ``main`` returns ``exit_code(failures(report))`` and
prints ``last_lines`` (scripts/gpu_check_verdict.py), which tests/test_kernels_gpu_check.py's smoke
run checks end to end on a passing run.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check_verdict", ROOT / "scripts" / "gpu_check_verdict.py")
verdict = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verdict)

#: A GPU report in which every check passed (the fields gpu_check.py writes that the verdict reads).
PASSING = {
    "results": [{"format": "mxfp8", "shape": [1, 8192, 8192], "impl": "kernel, 1 launch",
                 "bit_exact": True, "mismatched_bytes": 0},
                {"format": "mxfp8", "shape": [1, 8192, 8192], "impl": "vllm", "bit_exact": False,
                 "mismatched_bytes": 12}],  # a comparator that differs is reported, not a failure
    "vectors": [{"format": "mxfp8", "class": "ties", "options": {}, "mismatched_bytes": 0, "error": None}],
    "pytest": {"ran": True, "returncode": 0, "summary": "130 passed"},
    "static": {"arch": 90, "gpu": "H200", "rows": {}},
    "native_fp8": {"patterns": 2**32, "mismatches": 0, "bit_exact_in_range": True, "examples": []},
    "targets": [{"format": "mxfp8", "pct_of_copy": 91.0, "pct_target": 85.0, "pct_met": True,
                 "loop_over_launch": 7.5, "loop_target": 5.0, "loop_met": True}],
}


def _with(path: tuple, value) -> dict:
    r = copy.deepcopy(PASSING)
    node = r
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return r


#: (failure class, report with that one failure, words its reason line must hold).
CLASSES = [
    ("parity", _with(("results", 0, "bit_exact"), False), "kernel, 1 launch"),
    ("parity", _with(("vectors", 0, "mismatched_bytes"), 3), "vector class ties"),
    ("parity", _with(("pytest", "returncode"), 1), "parity pytest exited 1"),
    ("static compile", _with(("static", "error"), "CalledProcessError: ptxas fatal"), "ptxas fatal"),
    ("native-cast proof", _with(("native_fp8", "bit_exact_in_range"), False), "native e4m3 cast"),
    ("bandwidth target", _with(("targets", 0, "pct_met"), False), "% of copy"),
    ("bandwidth target", _with(("targets", 0, "loop_met"), False), "loop / 1 launch"),
]


def test_passing_report_exits_0_and_says_so():
    failed = verdict.failures(PASSING, smoke=False)
    assert failed == {} and verdict.exit_code(failed) == 0
    assert verdict.last_lines(failed, smoke=False)[-1].startswith("gpu_check: verdict PASS (exit 0)")


@pytest.mark.parametrize("name,report,words", CLASSES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CLASSES)])
def test_each_failure_class_sets_its_bit_and_is_named_last(name, report, words):
    failed = verdict.failures(report, smoke=False)
    assert list(failed) == [name]
    code = verdict.exit_code(failed)
    assert code == verdict.CHECKS[name] and code != 0
    lines = verdict.last_lines(failed, smoke=False)
    assert lines[-1] == f"gpu_check: verdict FAIL (exit {code}): {name}"
    assert any(line.startswith(f"gpu_check: FAILED {name}: ") and words in line for line in lines[:-1])


def test_failures_combine_into_one_code_naming_each():
    r = _with(("static", "error"), "boom")
    r["results"][0]["bit_exact"] = False
    r["targets"][0]["pct_met"] = False
    failed = verdict.failures(r, smoke=False)
    assert verdict.exit_code(failed) == 1 | 2 | 8
    assert verdict.last_lines(failed, smoke=False)[-1].endswith("parity, static compile, bandwidth target")


def test_smoke_mode_does_not_judge_cpu_bandwidth_or_the_interpreter_cast():
    r = _with(("native_fp8", "bit_exact_in_range"), False)
    r["targets"][0]["pct_met"] = False
    failed = verdict.failures(r, smoke=True)
    assert failed == {}
    assert "not judged on CPU" in verdict.last_lines(failed, smoke=True)[-1]
    # parity and static compile are judged in smoke mode too
    assert list(verdict.failures(_with(("static", "error"), "x"), smoke=True)) == ["static compile"]


# ---- gpu_check.sh: refusals and the dry run ---------------------------------------------------


def _sh(args, **env):
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
                          env=dict(os.environ, **env), capture_output=True, text=True, timeout=300,
                          check=False)


def test_unsupported_python_is_refused_by_name(tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\necho 3.9\nexit 1\n")  # what `-c 'sys.exit(version < 3.11)'` does on 3.9
    fake.chmod(0o755)
    proc = _sh(["--smoke"], PYTHON=str(fake))
    assert proc.returncode == verdict.REFUSED == 64
    assert "Python 3.9" in proc.stderr and "needs Python >= 3.11" in proc.stderr


def test_python_without_torch_is_refused(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$2" in *version_info*) echo 3.12; exit 0;; esac\nexit 1\n')
    fake.chmod(0o755)
    proc = _sh([], PYTHON=str(fake))
    assert proc.returncode == 64 and "cannot import torch and triton" in proc.stderr


def test_dry_run_on_this_machine_shows_the_plan_and_runs_nothing(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "never.json"
    proc = _sh(["--dry-run", "--formats", "mxfp8", "--json", str(out)], PYTHON=sys.executable, CI="true")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "dry run (nothing installed, nothing run)" in text
    assert f"python: {sys.executable}" in text
    gpu = "none" if not __import__("torch").cuda.is_available() else ""
    assert f"GPU: {gpu}" in text
    assert f"scripts/gpu_check.py --formats mxfp8 --json {out}" in text and "--dry-run" not in text.split("would run:")[1]
    assert "parity (1)" in text and "static compile (2)" in text and "native-cast proof (4" in text
    assert "bandwidth target (8" in text
    assert not out.exists()


# ---- CI=true: the kernel pytest child is strict but needs no vLLM ------------------------------


def test_strict_child_requires_only_what_gpu_check_names(monkeypatch):
    import strict_suite

    monkeypatch.delenv(strict_suite.REQUIRED_ENV, raising=False)
    assert strict_suite.required() == ("vllm", "triton")
    monkeypatch.setenv(strict_suite.REQUIRED_ENV, "triton")
    assert strict_suite.required() == ("triton",)
    src = (ROOT / "scripts" / "gpu_check.py").read_text()
    assert 'env = dict(os.environ, QSTRAT_STRICT_REQUIRED="triton")' in src
    assert "subprocess.run(cmd, cwd=ROOT, env=env" in src


def test_strict_session_start_without_vllm_passes_with_the_narrow_list(tmp_path):
    """A child pytest with CI=true and vLLM unimportable: exit 3 with the default list, runs with
    QSTRAT_STRICT_REQUIRED=triton (what gpu_check.py's kernel pytest child sets)."""
    pytest.importorskip("triton")
    (tmp_path / "conftest.py").write_text(
        "import sys\nsys.path.insert(0, %r)\npytest_plugins = ['strict_suite']\n" % str(ROOT / "tests"))
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import importlib.util, sys\n_orig = importlib.util.find_spec\n"
        "def _fs(name, *a, **k):\n    return None if name == 'vllm' else _orig(name, *a, **k)\n"
        "importlib.util.find_spec = _fs\n")
    base = {k: v for k, v in os.environ.items() if k != "QSTRAT_STRICT_REQUIRED"}
    base.update(CI="true", PYTHONPATH=f"{block}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    strict = subprocess.run(cmd, cwd=tmp_path, env=base, capture_output=True, text=True, timeout=300)
    assert strict.returncode == 3 and "vllm cannot be imported" in strict.stdout + strict.stderr
    narrow = subprocess.run(cmd, cwd=tmp_path, env=dict(base, QSTRAT_STRICT_REQUIRED="triton"),
                            capture_output=True, text=True, timeout=300)
    assert narrow.returncode == 0, narrow.stdout[-2000:] + narrow.stderr[-2000:]
