"""The verdict of scripts/gpu_check.py: which checks failed, the exit code, the last lines printed.

Pure Python (no torch, no triton), so tests/test_gpu_check_verdict.py checks each failure class
on a CPU machine. A report is the dict gpu_check.py writes as JSON.

Exit code: the OR of the failed checks' bits (0: every check passed), so one call on a lent GPU
gives a verdict a script can read; gpu_check.sh's own refusals (unsupported Python, no torch or
triton) exit 64.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Check name -> exit-code bit.
CHECKS = {"parity": 1, "static compile": 2, "native-cast proof": 4, "bandwidth target": 8}
#: gpu_check.sh's exit code when it refuses to run (unsupported Python, missing torch/triton).
REFUSED = 64


def failures(report: Mapping[str, Any], smoke: bool) -> dict[str, list[str]]:
    """Failed checks of ``report`` -> one reason line each.

    parity: a kernel row not bit-exact, a test-vector class that differs, or the GPU parity
    pytest's nonzero return code; static compile: the static report's compile failed; native-cast
    proof: the GPU's fp32 -> e4m3 cast differs from the integer encoder on some |x| <= 448
    (judged on a GPU only: the interpreter's cast is known wrong); bandwidth target: a format
    below an issue-14 target (% of copy bandwidth, per-expert loop / one launch), judged on a
    GPU only.
    Args: report: gpu_check.py's report dict; smoke: CPU interpreter mode.
    """
    out: dict[str, list[str]] = {}
    for r in report.get("results", []):
        if r.get("bit_exact") is False and str(r.get("impl", "")).startswith("kernel"):
            out.setdefault("parity", []).append(
                f"{r['format']} {r.get('shape')} {r['impl']}: {r.get('mismatched_bytes')} bytes differ")
    for v in report.get("vectors", []):
        if v.get("mismatched_bytes") != 0:
            out.setdefault("parity", []).append(
                f"{v['format']} vector class {v.get('class')} {v.get('options')}: "
                f"{v.get('error') or v.get('mismatched_bytes')}")
    rc = report.get("pytest", {}).get("returncode", 0)
    if rc:
        out.setdefault("parity", []).append(
            f"parity pytest exited {rc}: {report['pytest'].get('summary', '')}")
    static = report.get("static", {})
    if "error" in static:
        out.setdefault("static compile", []).append(str(static["error"])[:300])
    if not smoke:
        nf = report.get("native_fp8", {})
        if nf.get("bit_exact_in_range") is False:
            out.setdefault("native-cast proof", []).append(
                f"native e4m3 cast differs from the encoder on |x| <= 448: {nf.get('examples', [])[:3]}")
        for t in report.get("targets", []):
            for key, what in (("pct_met", "% of copy"), ("loop_met", "loop / 1 launch")):
                if t.get(key) is False:
                    got = t.get("pct_of_copy" if key == "pct_met" else "loop_over_launch")
                    want = t.get("pct_target" if key == "pct_met" else "loop_target")
                    out.setdefault("bandwidth target", []).append(
                        f"{t['format']}: {what} {got if got is None else round(got, 2)} < {want}")
    return out


def exit_code(failed: Mapping[str, list[str]]) -> int:
    """OR of :data:`CHECKS` bits of the failed checks (0 when none)."""
    code = 0
    for name in failed:
        code |= CHECKS[name]
    return code


def last_lines(failed: Mapping[str, list[str]], smoke: bool) -> list[str]:
    """The lines gpu_check.py prints last: one per failed check (with its first reasons), then
    the verdict naming every failed check and the exit code."""
    lines = []
    for name in CHECKS:
        for reason in failed.get(name, [])[:5]:
            lines.append(f"gpu_check: FAILED {name}: {reason}")
    code = exit_code(failed)
    judged = [c for c in CHECKS if not smoke or c not in ("native-cast proof", "bandwidth target")]
    if code:
        lines.append(f"gpu_check: verdict FAIL (exit {code}): {', '.join(n for n in CHECKS if n in failed)}")
    else:
        lines.append(f"gpu_check: verdict PASS (exit 0): {', '.join(judged)}"
                     + (" (smoke: native-cast proof and bandwidth targets not judged on CPU)" if smoke else ""))
    return lines
