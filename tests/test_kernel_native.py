"""The kernels' NATIVE branch (what a GPU runs on finite weights) run on CPU, byte for byte.

A compiled launch of finite inputs (``launch.native_casts``) takes each kernel's ``NATIVE=True``
branch: the GPU's conversions (``cvt.rn.satfinite.e4m3x2``, ``cvt.rn.satfinite.e2m1x2`` on
sm_100, ``rcp.rn``, the bf16 -> fp32 and e4m3 -> fp32 upcasts) and, on sm_90, the E2M1 bit
encoder ``fp_encode.e2m1_from_bits``. Under the interpreter those conversions are missing
(``libdevice``, inline asm) or wrong (numpy's fp8 cast, its bf16 subnormals), so this module
replaces exactly them, at ONE seam (:data:`fp_encode.NATIVE_CONVERSIONS`), by their exact twins
(the integer encoders, proven equal on finite inputs: docs/formats.md "Two encoders, one
result", tests/test_native_cast_model.py, and for e2m1 tests/test_e2m1_sm90_exhaustive.py), and
runs every other line of the native branch as written: the plans are made for arch 90 and 100 on
CPU tensors (``plan_<format>(..., arch)``), so ``NATIVE`` (and ``NATIVE_E2M1`` on 100) is True.
The bytes must equal the torch reference on the test-vector classes (docs/test-vectors.md).

:data:`MUTATIONS` lists deliberate breaks of native-branch lines (scale, mask, the fma zero-scale
multiplier, the E2M1 bits, ...); each is applied to a copy of the kernel's source and must make
the same check fail (:func:`test_native_branch_mutation_is_caught`).

On a GPU machine this module runs the compiled native branch itself (no seam), same vectors.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'qstrat[triton]')")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernel_harness as testing  # noqa: E402
from qstrat.serializers.block_fp8 import BlockFP8  # noqa: E402
from qstrat.serializers.kernels import block_fp8 as k_block_fp8  # noqa: E402
from qstrat.serializers.kernels import fp_encode  # noqa: E402
from qstrat.serializers.kernels import mxfp8 as k_mxfp8  # noqa: E402
from qstrat.serializers.kernels import nvfp4 as k_nvfp4  # noqa: E402
from qstrat.serializers.mxfp8 import MXFP8  # noqa: E402
from qstrat.serializers.nvfp4 import NVFP4  # noqa: E402

DEVICE = testing.require_kernel_device()
pytestmark = pytest.mark.interpreter if DEVICE == "cpu" else []

# ---- the exact twins of the seam's hardware conversions (interpreter only) ------------------


@triton.jit
def _upcast_exact(v):
    if v.dtype == tl.bfloat16:  # GPU: exact, subnormals included; the bits route is exact too
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)  # fp16/fp32: exact in numpy


@triton.jit
def _e4m3_exact(y):
    return fp_encode.e4m3_encode(y).to(tl.uint8)


@triton.jit
def _e4m3_value_exact(code):
    return fp_encode.e4m3_decode(code.to(tl.int32))


@triton.jit
def _rcp_exact(x):
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def _e2m1_exact(v):  # cvt.rn.satfinite.e2m1x2: RNE, saturate at 6, the sign bit is v's
    return fp_encode.e2m1_magnitude(tl.abs(v)) | ((fp_encode.f32_bits(v) >> 28) & 8)


@triton.jit
def _e2m1x2_exact(lo, hi):
    return (_e2m1_exact(lo) | (_e2m1_exact(hi) << 4)).to(tl.uint8)


TWINS = {"upcast_native": _upcast_exact, "e4m3_native": _e4m3_exact,
         "e4m3_native_value": _e4m3_value_exact, "rcp_native": _rcp_exact,
         "e2m1x2_native": _e2m1x2_exact}


@contextlib.contextmanager
def native_seam():
    """Replace the seam's hardware conversions by their exact twins (interpreter), nothing else."""
    assert set(TWINS) == set(fp_encode.NATIVE_CONVERSIONS)
    if DEVICE != "cpu":
        yield
        return
    saved = {name: getattr(fp_encode, name) for name in TWINS}
    try:
        for name, twin in TWINS.items():
            setattr(fp_encode, name, twin)
        yield
    finally:
        for name, fn in saved.items():
            setattr(fp_encode, name, fn)


# ---- test vectors (docs/test-vectors.md) ----------------------------------------------------

E4M3_TIES = [v for v, _ in testing.E4M3_TIES]
E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -1.25, -2.5, -5.0]


def vectors(k: int) -> torch.Tensor:
    """[4, 80, k] bf16 (N ragged for every tile height; k ragged for 128-wide tiles): expert 0
    random with a power-of-two gain per row (rows far below the global max: small and zero
    NVFP4 block scales); expert 1 every special class along its rows: all-zero, tiny
    (1e-40..1e-35, bf16 subnormal), tiny negative and -0.0 beside a large value (NVFP4 zero scale
    with signs: the fma rule), block amax just above 1.75 * 2^k, exactly 448 * 2^k, E4M3 ties and
    carries, saturation, E2M1 ties, the nibble order pair [1, 2]; expert 2 a bf16 bit sweep
    (every exponent, mixed signs); expert 3 zeros and -0.0 (all-zero tiles and blocks, a zero
    NVFP4 global amax)."""
    g = testing.gen(46)
    x = torch.randn(4, 80, k, generator=g)
    gain = torch.randint(-30, 30, (80, 1), generator=g).float().exp2()
    x[0] *= gain
    s = x[1]
    s[0:8] = 0.0
    s[8:16] = torch.empty(8, k).uniform_(1e-40, 1e-35, generator=g) * torch.randn(8, k, generator=g).sign()
    s[16:20, :] = -1e-38
    s[16:20, ::3] = -0.0
    s[16:20, -1] = 3.0e4  # global max: the tiny blocks' NVFP4 scale is 0
    s[20:24] = 0.5
    s[20:24, ::32] = 460.0
    s[24:26, ::32] = 0.90
    s[26:30] = torch.randn(4, k, generator=g)
    s[26:30, ::16] = 448.0 * 2.0 ** torch.arange(-3, 1).float()[:, None]
    for i, v in enumerate(E4M3_TIES + [464.0, 480.0, 1e4, -1e4]):
        s[30 + i % 20, (5 * i) % k] = v
    s[50:60, : len(E2M1_TIES)] = torch.tensor(E2M1_TIES)
    s[50:60, 16] = 6.0  # block max 6: scale 1 wherever the global scale allows
    s[60, :2] = torch.tensor([1.0, 2.0])
    sweep = torch.randint(-(2**15), 2**15, (80, k), generator=g, dtype=torch.int32).to(torch.int16)
    sweep = sweep.view(torch.bfloat16).float()  # magnitudes below 2^100: no scale rounds past fp32
    x[2] = torch.where(sweep.abs() < 2.0**100, sweep, torch.zeros_like(sweep))
    x[3] = 0.0
    x[3, ::7, ::5] = -0.0
    return x.to(torch.bfloat16)


#: (format name, serializer options, K): K ragged for every tile width (block FP8: two 128 x 128
#: tiles; MXFP8 / NVFP4: a multiple of 32 / 16 below the 128-wide tile). Small: the interpreter.
CASES = [("block_fp8", {}, 200), ("block_fp8", {"ue8m0": True}, 200),
         ("mxfp8", {}, 96), ("mxfp8", {"scale_rounding": "floor", "min_scale_byte": 100}, 96),
         ("nvfp4", {}, 112)]
SERIALIZERS = {"block_fp8": BlockFP8, "mxfp8": MXFP8, "nvfp4": NVFP4}
KERNELS = {"block_fp8": k_block_fp8, "mxfp8": k_mxfp8, "nvfp4": k_nvfp4}
ARCHS = (90, 100)


def native_parts(module, fmt: str, opts: dict, w: torch.Tensor, arch: int) -> dict[str, torch.Tensor]:
    """The native branch's output parts: ``module.plan_<fmt>`` for ``arch`` run on ``w``."""
    ser = SERIALIZERS[fmt](backend="triton", **opts)
    if DEVICE == "cpu":
        launch = getattr(module, f"plan_{fmt}")(ser, w, None, arch)
    else:
        from qstrat.serializers.kernels.launch import device_arch
        launch = getattr(module, f"plan_{fmt}")(ser, w, None, device_arch(w))
    assert launch.constexprs["NATIVE"] is True
    if fmt == "nvfp4":
        assert launch.constexprs["NATIVE_E2M1"] is (launch.constexprs["NATIVE"] and
                                                  (arch if DEVICE == "cpu" else device_arch(w)) >= 100)
    with native_seam():
        return launch.run()


def reference(fmt: str, opts: dict, w: torch.Tensor) -> dict[str, torch.Tensor]:
    return SERIALIZERS[fmt](backend="torch", **opts).quantize(w.cpu())


@pytest.fixture(scope="module")
def inputs():
    return {k: vectors(k).to(DEVICE) for k in sorted({c[2] for c in CASES})}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'-'.join(map(str, c[1].values())) or 'default'}")
def test_native_branch_matches_reference(case, arch, inputs):
    fmt, opts, k = case
    if DEVICE != "cpu" and arch != ARCHS[0]:
        pytest.skip("compiled on a GPU: one run for the device's own arch")
    w = inputs[k]
    got = native_parts(KERNELS[fmt], fmt, opts, w, arch)
    testing.assert_same_bytes({n: t.cpu() for n, t in got.items()}, reference(fmt, opts, w),
                              f"{fmt} {opts} native sm_{arch}")


def test_strided_view_native_branch():
    """A [E, N, K] view with stride along K != 1 (``slab[:, :I, :]`` style reads) on the
    native branch."""
    base = vectors(96).transpose(1, 2).contiguous().transpose(1, 2).to(DEVICE)
    assert base.stride(2) != 1
    for fmt in ("mxfp8", "nvfp4"):
        got = native_parts(KERNELS[fmt], fmt, {}, base, 90)
        testing.assert_same_bytes({n: t.cpu() for n, t in got.items()}, reference(fmt, {}, base))


# ---- the seam holds every hardware conversion --------------------------------------------------

_HW = re.compile(r"float8e4nv|inline_asm_elementwise|libdevice\.|tl\.extra|\.to\(tl\.float32\)(?!, bitcast)")


def test_every_hardware_conversion_is_in_the_seam():
    """No kernel line outside the seam converts by hardware: no fp8 cast, no inline asm, no
    libdevice call, no non-bitcast ``.to(tl.float32)`` (fp_encode: outside the seam functions,
    only int -> fp32 of small integers, exact by construction, in the integer encoders)."""
    for mod in (k_block_fp8, k_mxfp8, k_nvfp4):
        src = inspect.getsource(mod)
        assert not _HW.findall(src), f"{mod.__name__} converts outside the seam: {_HW.findall(src)}"
    allowed = {name: inspect.getsource(getattr(fp_encode, name).fn) for name in fp_encode.NATIVE_CONVERSIONS}
    src = inspect.getsource(fp_encode)
    for body in allowed.values():
        src = src.replace(body, "")
    hits = [m.group(0) for m in _HW.finditer(src)]
    assert hits == [".to(tl.float32)"], f"fp_encode converts outside the seam: {hits}"
    assert "mant.to(tl.float32) * 0.001953125" in src  # the one: e4m3_decode's 3-bit integer


# ---- deliberate breaks of native-branch lines -----------------------------------------------

#: (id, module mutated (a kernel or fp_encode), exact source text, replacement, case, arch). Each changes one line
#: the native branch runs (or a helper only it calls) and must make the byte check fail.
MUTATIONS = [
    ("block_fp8-amax-floor-dropped", "block_fp8", "        amax = tl.maximum(amax, AMAX_MIN)\n",
     "        amax = amax\n", CASES[0], 90),
    ("block_fp8-scale-divided-not-multiplied", "block_fp8", "fp_encode.e4m3_native(x * inv)",
     "fp_encode.e4m3_native(x / s)", CASES[0], 90),
    ("block_fp8-mask-rows-only", "block_fp8", "tl.store(dst, fp_encode.e4m3_native(x * inv), mask=mask)",
     "tl.store(dst, fp_encode.e4m3_native(x * inv), mask=(rows < N - 1)[:, None] & (cols < K)[None, :])",
     CASES[0], 90),
    ("mxfp8-amax-perturbed", "mxfp8", "e8m0_from_finite_amax(tl.max(tl.abs(x), axis=2), RCEIL, MIN_BYTE)",
     "e8m0_from_finite_amax(tl.max(tl.abs(x), axis=2) * 1.0000001, RCEIL, MIN_BYTE)", CASES[2], 90),
    ("mxfp8-min-byte-ignored", "mxfp8", "e8m0_from_finite_amax(tl.max(tl.abs(x), axis=2), RCEIL, MIN_BYTE)",
     "e8m0_from_finite_amax(tl.max(tl.abs(x), axis=2), RCEIL, 0)", CASES[3], 90),
    ("mxfp8-scale-exponent-off-by-one", "mxfp8", "inv = fp_encode.exp2_int(BIAS - byte)  # exact 1/s",
     "inv = fp_encode.exp2_int(BIAS - byte + 1)  # exact 1/s", CASES[2], 90),
    ("mxfp8-mask-columns-by-N", "mxfp8", "fp_encode.e4m3_native(x * inv[:, :, None]), mask=mask)",
     "fp_encode.e4m3_native(x * inv[:, :, None]), mask=(r3 < N) & (c3 < N))", CASES[2], 90),
    ("nvfp4-scale-global-factor-dropped", "nvfp4", "scale = fp_encode.e4m3_native(enc * (amax_b * RCP6))",
     "scale = fp_encode.e4m3_native(amax_b * RCP6)", CASES[4], 90),
    ("nvfp4-scale-code-not-decoded", "nvfp4", "s = fp_encode.e4m3_native_value(scale)",
     "s = scale.to(tl.float32)", CASES[4], 90),
    ("nvfp4-zero-scale-multiplier-0", "nvfp4", "os = tl.where(zero, 1.401298464324817e-45, rcp)",
     "os = tl.where(zero, 0.0, rcp)", CASES[4], 90),
    ("nvfp4-fma-plain-multiply", "nvfp4", "y = tl.fma(x, os[:, :, None], 0.0)",
     "y = x * os[:, :, None]", CASES[4], 90),
    ("nvfp4-scale-not-decoded", "nvfp4", "denom = tl.where(zero, 1.0, s * dec)",
     "denom = tl.where(zero, 1.0, (enc * (amax_b * RCP6)) * dec)", CASES[4], 90),
    ("nvfp4-nibbles-swapped-sm90", "nvfp4",
     "packed = fp_encode.e2m1_from_bits(lo) | (fp_encode.e2m1_from_bits(hi) << 4)",
     "packed = fp_encode.e2m1_from_bits(hi) | (fp_encode.e2m1_from_bits(lo) << 4)", CASES[4], 90),
    ("nvfp4-nibbles-swapped-sm100", "nvfp4", "packed = fp_encode.e2m1x2_native(lo, hi)",
     "packed = fp_encode.e2m1x2_native(hi, lo)", CASES[4], 100),
    ("e2m1-bits-grid-offset", "fp_encode", "((22 << 23) + 6), (149 << 23) + 6)",
     "((22 << 23) + 4), (149 << 23) + 4)", CASES[4], 90),
    ("e2m1-bits-sign-dropped", "fp_encode", "((f32_bits(y) >> 28) & 8)", "((f32_bits(a) >> 28) & 8)",
     CASES[4], 90),
    ("e2m1-bits-no-saturation", "fp_encode", "a = tl.minimum(tl.abs(y), 6.0)", "a = tl.abs(y)",
     CASES[4], 90),
    ("e2m1-bits-code-from-low-bits", "fp_encode", "return ((r + (r >> 22)) & 7)", "return ((r + (r >> 21)) & 7)",
     CASES[4], 90),
    ("e8m0-finite-rceil-bit", "fp_encode", "+ (0x7FFFFF - F32_MANT_1_75)) >> 23)",
     "+ (0x7FFFFF - F32_MANT_1_75 + 1)) >> 23)", CASES[2], 90),
]
#: Native-branch lines whose break the CPU cannot see, and why (the device check covers them).
NOT_CATCHABLE_ON_CPU = {
    "rcp.rn replaced by '/'": "the interpreter's '/' is numpy's correctly rounded division; a "
                              "GPU's is approximate (div.full.f32): scripts/gpu_check.sh parity",
    "cvt.rn.satfinite replaced": "the seam itself is replaced here; tests/test_native_cast_model.py "
                                 "and the device's exhaustive e4m3 probe check the PTX semantics",
}


def _mutated_module(tmp_path: Path, where: str, kernel: str, old: str, new: str):
    """Copies of the ``kernel`` module and of fp_encode, ``where`` (one of them) with ``old``
    replaced by ``new`` (exactly one occurrence), imported from files so the interpreter can read
    their source. Returns: (kernel module copy, fp_encode copy)."""
    pkg = tmp_path / "mutpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    files = {"fp_encode": inspect.getsource(fp_encode), kernel: inspect.getsource(KERNELS[kernel])}
    assert files[where].count(old) == 1, f"mutation text not found once in {where}: {old!r}"
    files[where] = files[where].replace(old, new)
    enc, target = files["fp_encode"], files[kernel]
    target = target.replace("from qstrat.serializers.kernels import fp_encode",
                            "from mutpkg import fp_encode")
    (pkg / "fp_encode.py").write_text(enc)
    (pkg / f"{kernel}.py").write_text(target)
    sys.path.insert(0, str(tmp_path))
    try:
        for name in ("mutpkg", "mutpkg.fp_encode", f"mutpkg.{kernel}"):
            sys.modules.pop(name, None)
        mod = importlib.import_module(f"mutpkg.{kernel}")
        return mod, sys.modules["mutpkg.fp_encode"]
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.skipif(DEVICE != "cpu", reason="mutations run under the interpreter (CPU CI)")
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_native_branch_mutation_is_caught(mutation, tmp_path, inputs, monkeypatch):
    name, where, old, new, case, arch = mutation
    fmt, opts, k = case
    mod, enc = _mutated_module(tmp_path, where, fmt, old, new)
    for seam_name, twin in TWINS.items():  # the mutated copy's seam, replaced as in native_seam
        monkeypatch.setattr(enc, seam_name, twin)
    w = inputs[k]
    got = native_parts(mod, fmt, opts, w, arch)
    want = reference(fmt, opts, w)
    # the unmutated module passes on the same case and arch: test_native_branch_matches_reference
    assert testing.byte_mismatches(got, want), f"mutation {name} was not caught"

