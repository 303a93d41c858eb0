"""Helpers for the kernel parity tests (tests/test_kernel*.py) and scripts/gpu_check.py.

Where kernels can run in this process: compiled on CUDA tensors, or under Triton's interpreter on
CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was imported (it cannot be switched
later: see :func:`qstrat.serializers.kernels.interpreted`). On a CPU-only machine without the
variable, :func:`run_under_interpreter` re-runs a pytest file in a child process that has it.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from qstrat.serializers.kernels import interpreted, triton_available

#: Set in the child process of :func:`run_under_interpreter` (guards against recursion).
CHILD_ENV = "QSTRAT_KERNEL_TEST_CHILD"


def kernel_device() -> str | None:
    """Device the kernels run on in this process: ``"cuda"`` (compiled, a GPU is present),
    ``"cpu"`` (interpreter active), or ``None`` (no triton, or compiled mode without a GPU)."""
    if not triton_available():
        return None
    if interpreted():
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


#: The kernel test modules: collected only where kernels run in the process (tests/conftest.py).
KERNEL_TEST_GLOB = "test_kernel_*.py"
#: Fewest tests the interpreter child must pass (all of them on a CPU machine today; the >2^31-element cases are GPU-only).
MIN_KERNEL_TESTS = 124

#: (value, e4m3fn code torch 2.13 gives): ties to even and carries, docs/test-vectors.md.
E4M3_TIES = [(1.0625, 0x38), (17.0, 0x58), (232.0, 0x76), (0.0029296875, 0x02), (126.24, 0x70),
             (1.97, 0x40), (-124.5, 0xF0), (2.0**-10, 0x00), (3 * 2.0**-10, 0x02), (-0.0, 0x80)]


def gen(seed: int) -> torch.Generator:
    """A seeded CPU generator."""
    return torch.Generator().manual_seed(seed)


def kernel_test_modules() -> list[Path]:
    """Every kernel test module (tests/test_kernel_*.py), sorted."""
    return sorted(Path(__file__).resolve().parent.glob(KERNEL_TEST_GLOB))


def require_kernel_device() -> str:
    """:func:`kernel_device`, for a kernel test module; skips the module (run directly without
    ``TRITON_INTERPRET=1`` on a CPU machine) where kernels cannot run. Inside the suite such a
    module is never collected there: tests/test_kernels.py runs it in the interpreter child."""
    import pytest

    device = kernel_device()
    if device is None:
        pytest.skip("kernels cannot run in this process: set TRITON_INTERPRET=1 or use a GPU",
                    allow_module_level=True)
    return device


def run_under_interpreter(test_files: list[Path], min_passed: int, timeout_s: float = 1500) -> str:
    """Run ``pytest test_files`` in ONE child process with ``TRITON_INTERPRET=1`` set from the start.

    Args:
        test_files: paths of the test modules to run.
        min_passed: fewest passing tests accepted (a child that silently collects nothing fails).
        timeout_s: wall-clock limit of the child, seconds.
    Returns: the child's combined stdout/stderr.
    Raises:
        AssertionError: the child failed, passed fewer than ``min_passed`` tests, or is itself a
            child (the interpreter did not activate: recursion guard); the message holds the
            tail of its output.
    """
    if os.environ.get(CHILD_ENV):
        raise AssertionError(
            "TRITON_INTERPRET=1 is set but triton's kernels are not interpreted in this child "
            "process (was triton imported before the variable was set?)"
        )
    env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_ENV: "1"})
    cmd = [sys.executable, "-m", "pytest", *map(str, test_files), "-q", "-rfEs", "-p", "no:cacheprovider"]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    out = proc.stdout + proc.stderr
    m = re.search(r"(\d+) passed", out)
    passed = int(m.group(1)) if m else 0
    assert proc.returncode == 0 and passed >= min_passed, (
        f"interpreter child {' '.join(cmd)} exited {proc.returncode} with {passed} passed "
        f"(expected >= {min_passed}):\n{out[-8000:]}"
    )
    return out


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (any dtype, any shape, 0-d included) as a flat uint8 CPU tensor."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def byte_mismatches(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]
) -> list[str]:
    """Describe every difference between two part dicts, compared byte for byte.

    Returns: one line per differing part (keys, dtype, shape or bytes: count and first element
    index with both values); empty when identical.
    """
    if set(got) != set(want):
        return [f"parts differ: got {sorted(got)}, want {sorted(want)}"]
    out = []
    for k in sorted(want):
        g, w = got[k], want[k]
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            out.append(f"{k}: got {g.dtype} {list(g.shape)}, want {w.dtype} {list(w.shape)}")
            continue
        gb, wb = raw_bytes(g), raw_bytes(w)
        bad = (gb != wb).nonzero().flatten()
        if bad.numel():
            size = w.element_size()
            i = int(bad[0]) // size
            gv = g.detach().reshape(-1)[i].cpu()
            wv = w.detach().reshape(-1)[i].cpu()
            out.append(
                f"{k}: {bad.numel()} of {wb.numel()} bytes differ; first at flat element {i}: "
                f"got {gv.float().item() if gv.is_floating_point() else gv.item()} "
                f"(bytes {raw_bytes(gv).tolist()}), want "
                f"{wv.float().item() if wv.is_floating_point() else wv.item()} "
                f"(bytes {raw_bytes(wv).tolist()})"
            )
    return out


def mismatched_bytes(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> int:
    """Bytes that differ between the parts ``got`` holds and the same parts of ``want``.

    Only ``got``'s keys are compared (a comparator may emit a subset of the parts).
    Returns: the count, or -1 when a key is missing from ``want`` or a dtype/shape differs.
    """
    bad = 0
    for k, g in got.items():
        w = want.get(k)
        if w is None or g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            return -1
        bad += int((raw_bytes(g) != raw_bytes(w)).sum())
    return bad


def assert_same_bytes(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], what: str = ""
) -> None:
    """Raise AssertionError describing :func:`byte_mismatches` unless the parts are identical."""
    bad = byte_mismatches(got, want)
    assert not bad, (what + ": " if what else "") + "; ".join(bad)



#: Device helpers of :mod:`.fp_encode` that :func:`run_fp_encode` can apply, by name
#: (``e4m3_native`` is Triton's own ``.to(tl.float8e4nv)``, which scripts/gpu_check.py compares
#: with ``e4m3_encode`` on every fp32 bit pattern).
FP_ENCODE_OPS = ("e4m3_encode", "e8m0_rceil", "e8m0_floor", "exp2_int", "ceil_pow2",
                 "e4m3_decode", "e2m1_magnitude", "e4m3_native", "e2m1_from_bits")


def run_fp_encode(op: str, x: torch.Tensor, device: str, to_cpu: bool = True,
                  block: int = 4096) -> torch.Tensor:
    """Apply one :mod:`.fp_encode` device helper elementwise, to test it against its torch twin.

    Args:
        op: one of :data:`FP_ENCODE_OPS`.
        x: flat input (fp32 for most ops; int32 exponents for ``exp2_int``, codes for
            ``e4m3_decode``).
        device: where the kernel runs (see :func:`kernel_device`).
        to_cpu: copy the result to the CPU (False: leave it on ``device``).
        block: elements per program (a power of two; large blocks make the interpreter fast).
    Returns: int32 tensor of x's shape: codes/bytes, or the fp32 result's bits.
    """
    from kernel_probe import fp_encode_probe

    x = x.to(device)
    out = torch.empty(x.shape, dtype=torch.int32, device=device)
    fp_encode_probe[(-(-x.numel() // block),)](x, out, x.numel(), OP=FP_ENCODE_OPS.index(op), BLOCK=block)
    return out.cpu() if to_cpu else out


def check_offsets_beyond_2_31(cls: type, free_bytes_needed: int = 16 * 2**30) -> str | None:
    """GPU: quantize a [17, 8192, 16384] bf16 slab (2.28e9 elements > 2^31, so element offsets
    need 64 bits) with ``cls``'s kernel and compare experts 0 and 16 with the reference.

    Returns: a skip reason if the GPU has too little free memory, else None.
    Raises: AssertionError on any byte difference.
    """
    free, _ = torch.cuda.mem_get_info()
    if free < free_bytes_needed:
        return f"only {free / 2**30:.1f} GiB free"
    e, n, k = 17, 8192, 16384
    w = torch.empty((e, n, k), dtype=torch.bfloat16, device="cuda")
    for i in range(e):
        w[i].normal_(generator=torch.Generator("cuda").manual_seed(i))
    got = cls(backend="triton").quantize(w)
    for i in (0, e - 1):
        want = cls(backend="torch").quantize(w[i])
        assert_same_bytes({p: v[i] for p, v in got.items()}, want, f"{cls.name} expert {i}")
    del got, w
    torch.cuda.empty_cache()
    return None


@contextlib.contextmanager
def no_contiguous_copies(monkeypatch) -> Iterator[None]:
    """Inside: ``Tensor.contiguous()`` on a non-contiguous tensor raises AssertionError, proving a
    kernel reads strided views in place (pytest's ``monkeypatch``; undone on exit)."""
    real = torch.Tensor.contiguous

    def no_copy(t, *a, **kw):
        if not t.is_contiguous(*a, **kw):
            raise AssertionError("the kernel path copied a strided input (.contiguous())")
        return real(t, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "contiguous", no_copy)
    try:
        yield
    finally:
        monkeypatch.undo()
