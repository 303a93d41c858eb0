"""Every format kernel compiled for sm_90 (H100/H200) and sm_100 (B200) without a GPU.

The launches compiled are the ones ``quantize(..., backend="triton")`` makes
(:func:`qstrat.serializers.kernels.static_report.plan`); the facts asserted are static
properties of the compiled code, deterministic for a given triton: it compiles, spills nothing,
uses the native conversions where the architecture has them, leaves >= 16 warps per SM to the
register file, and its instruction count per element does not cap HBM bandwidth (the issue-bound
ceiling, docs/performance.md "Static kernel report"). No timing is asserted. Compiles are cached
within the session (the two small slabs share their specializations; DeepSeek-V3's, past 2^31
elements, adds the E64 launch: 12 compiles + 6 variant compiles + 3 fully 64-bit ones).
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="the kernels need triton (pip install 'qstrat[triton]')")

from qstrat.serializers.kernels import static_report as sr  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # kernels are interpreter objects in this process
    pytest.skip("static compile tests need a process without TRITON_INTERPRET=1 "
                "(tests/test_kernels.py runs the interpreter in a child)", allow_module_level=True)

#: Targets (issue 29): ceiling of HBM bandwidth per GPU, by format; sm_90 NVFP4 has no native
#: e2m1 conversion, so 0.85 there.
CEILING_MIN = {
    ("block_fp8", "H100"): 1.0, ("block_fp8", "H200"): 1.0, ("block_fp8", "B200"): 0.85,
    ("mxfp8", "H100"): 1.0, ("mxfp8", "H200"): 1.0, ("mxfp8", "B200"): 0.85,
    ("nvfp4", "H100"): 0.85, ("nvfp4", "H200"): 0.85, ("nvfp4", "B200"): 0.85,
}
NATIVE_WANTED = {("block_fp8", 90): {"e4m3"}, ("block_fp8", 100): {"e4m3"},
                 ("mxfp8", 90): {"e4m3"}, ("mxfp8", 100): {"e4m3"},
                 ("nvfp4", 90): {"e4m3"}, ("nvfp4", 100): {"e4m3", "e2m1"}}
CASES = [(f, a, s) for s in sr.SLABS for f in sr.FORMATS for a in sr.ARCHS]


def _id(case):
    f, a, s = case
    return f"{f}-sm{a}-{'x'.join(map(str, s))}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_public_launch_compiles_at_the_roofline(case):
    fmt, arch, slab = case
    f = sr.facts(fmt, slab, arch)
    assert f.stack == 0, f"{fmt} sm_{arch}: {f.stack} bytes of spills per thread ({f.registers} registers)"
    assert f.loops == 0 and f.sass > 0
    assert set(f.native) == NATIVE_WANTED[fmt, arch], f"native conversions in the PTX: {f.native}"
    assert f.warps_per_sm >= 16, f"{f.registers} registers x {f.num_warps} warps leave {f.warps_per_sm} warps/SM"
    for gpu, c in f.ceilings.items():
        assert c >= CEILING_MIN[fmt, gpu], (
            f"{fmt} sm_{arch} on {gpu}: {f.instr_per_element:.2f} SASS instructions per element cap "
            f"HBM bandwidth at {c:.3f} (target {CEILING_MIN[fmt, gpu]})")
    # one launch per grouped slab: grid axis 1 walks the experts
    launch = sr.plan(fmt, slab, arch)
    assert launch.grid[1] == slab[0]
    # 32-bit per-element offsets at every slab of the report, DeepSeek-V3's 7.5e9 elements
    # included (its expert offset alone is 64-bit: E64)
    assert launch.constexprs["WIDE"] is False
    assert launch.constexprs["E64"] is (slab[0] * slab[1] * slab[2] >= 2**31)


@pytest.mark.parametrize("fmt", sr.FORMATS)
def test_fully_64_bit_launch_compiles_without_spills(fmt):
    """One expert past 2^31 elements (:data:`static_report.WIDE_SLAB`): the WIDE launch, which no
    known model makes (docs/performance.md "64-bit offsets"), compiles for sm_90 with no spills
    and leaves >= 16 warps per SM; its ceilings are reported, not held to the targets."""
    launch = sr.plan(fmt, sr.WIDE_SLAB, 90)
    assert launch.constexprs["WIDE"] is True and launch.constexprs["E64"] is True
    f = sr.facts(fmt, sr.WIDE_SLAB, 90)
    assert f.stack == 0 and f.warps_per_sm >= 16, (f.registers, f.stack, f.warps_per_sm)


@pytest.mark.parametrize("variant", ["strided", "propagate"])
@pytest.mark.parametrize("fmt", sr.FORMATS)
def test_other_launch_variants_compile_without_spills(fmt, variant):
    """A transposed view (stride along K != 1) and ``nonfinite="propagate"`` (the exact integer
    path, no native casts) compile for sm_90 with no spills."""
    f = sr.facts(fmt, sr.SLABS[0], 90, variant)
    assert f.stack == 0, f"{fmt} {variant}: {f.stack} bytes of spills ({f.registers} registers)"
    if variant == "propagate":
        assert f.native == ()
    else:
        assert f.native and f.native[0] == "e4m3"


def test_report_rows_and_table():
    rows = sr.report(formats=["mxfp8"], slabs=[sr.SLABS[0]])
    assert [(r["format"], r["arch"]) for r in rows] == [("mxfp8", 90), ("mxfp8", 100)]
    assert set(rows[0]) >= {"registers", "stack", "warps_per_sm", "instr_per_element",
                            "ceiling_H100", "ceiling_H200", "native"}
    assert "ceiling_B200" not in rows[0] and "ceiling_B200" in rows[1]
    lines = sr.table(rows).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 4x512x1024 | mxfp8 | 90 |")


# ---- the formulas, on known figures --------------------------------------------------------

def test_issue_ceiling_reproduces_issue_29_figures():
    """Issue 29's table: block FP8 on sm_90 at 94.6 SASS/element on H200 is 0.22; NVFP4 on
    sm_100 at 145.8 on B200 is 0.08 (bytes per element: bf16 in + payload + scales)."""
    assert round(sr.issue_ceiling("H200", 94.6, 2 + 1 + 4 / 16384), 2) == 0.22
    assert round(sr.issue_ceiling("B200", 145.8, 2 + 0.5 + 1 / 16), 2) == 0.08


def test_warps_per_sm_from_registers():
    assert sr.warps_per_sm(128, 4) == 16  # 4096 regs per warp -> 4 blocks of 4 warps
    assert sr.warps_per_sm(255, 8) == 8  # 8192 per warp: one block of 8 warps
    assert sr.warps_per_sm(32, 4) == 64  # register file allows 64: the warp limit
    assert sr.warps_per_sm(16, 1) == 32  # 32 blocks per SM at most


def test_executed_instructions_counts_loops_with_trip_counts():
    sass = [(0x00, "MOV R1, c[0x0][0x28]"), (0x10, "IADD3 R2, R2, 0x1, RZ"),
            (0x20, "ISETP.GE.AND P0, PT, R2, 0x8, PT"), (0x30, "@!P0 BRA 0x10"),
            (0x40, "NOP"), (0x50, "EXIT"), (0x60, "BRA 0x60"), (0x70, "NOP")]
    assert sr.executed_instructions(sass, [8]) == (1 + 3 * 8 + 1, 1)
    with pytest.raises(sr.StaticReportError, match="no trip count"):
        sr.executed_instructions(sass)
