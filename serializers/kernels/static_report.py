"""Static facts of the compiled kernels, without a GPU: registers, spills, SASS per element,
native conversions and the instruction-issue ceiling against HBM bandwidth.

The launch measured is the one the public API makes: ``plan_<format>`` (the function
``quantize(..., backend="triton")`` runs) is called on ``meta`` tensors of the slab's shape,
dtype and strides, and its kernel is specialized exactly as Triton's launcher specializes it
(integer arguments equal to 1 become constants, 16-divisible integers and 16-byte aligned
pointers get divisibility hints), then compiled by Triton's own pipeline for ``sm_90`` or
``sm_100`` and assembled by the ``ptxas`` shipped in the triton wheel. ``cuobjdump`` (same wheel)
reads the cubin: ``REG``/``STACK``/``SHARED`` from ``-res-usage``, the instruction list from
``-sass``. Compiling needs real triton (not ``TRITON_INTERPRET=1``: see :func:`report`).

Formulas (docs/performance.md, "GPU kernels, statically"; /work/shared/docs/gpu-without-gpu.md):

- instructions per element ``I = sass * 32 * num_warps * programs / elements``, where ``sass`` is
  the count of SASS instructions a program executes: every instruction once (no NOP, not the
  trap loop after the last EXIT), the body of a backward branch times its trip count
  (:attr:`.launch.Launch.loop_trips`); a kernel without loops executes each instruction at most
  once (forward branches are counted as taken: an upper bound).
- issue rate ``SMs * 4 schedulers * 32 lanes * boost clock`` thread-instructions per second;
  ``ceiling = issue_rate / I / (HBM bytes per second / bytes per element)``: the fraction of
  HBM bandwidth the instruction issue alone allows (>= 1: issue is not the limit). Bytes per
  element: input read + every output written (payload and scales), over the slab's elements.
- warps per SM the registers allow: an SM has 65,536 registers, allocated per warp in units of
  256, at most 64 resident warps and 32 resident blocks:
  ``min(64, 32 * num_warps, floor(65536 / (ceil(regs * 32 / 256) * 256 * num_warps)) * num_warps)``.
"""
from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

#: GPUs whose HBM the ceiling is computed against: (arch, SMs, boost clock Hz, HBM bytes/s).
#: Datasheet figures: H100 SXM5, H200 SXM and B200 (NVIDIA product pages).
GPUS: dict[str, tuple[int, int, float, float]] = {
    "H100": (90, 132, 1.98e9, 3.35e12),
    "H200": (90, 132, 1.98e9, 4.8e12),
    "B200": (100, 148, 1.965e9, 8.0e12),
}
#: The architectures compiled for: Hopper (sm_90) and Blackwell datacenter (sm_100).
ARCHS = (90, 100)
#: Slabs of the report: the issue's [4, 512, 1024], a realistic MoE projection, and a DeepSeek-V3
#: expert slab (256 x 4096 x 7168 = 7.5e9 elements, past 2^31: the launch with a 64-bit expert
#: offset and 32-bit per-element offsets, ``E64``; docs/performance.md, the kernel figures "by offset width").
SLABS: tuple[tuple[int, int, int], ...] = ((4, 512, 1024), (8, 1536, 2048), (256, 4096, 7168))
#: A slab whose ONE expert passes 2^31 elements: the fully 64-bit launch (``WIDE``). No model
#: qstrat knows has such a matrix (DeepSeek-V3's largest, the embedding, is 129280 x 7168 = 9.3e8),
#: so a refit does not make this launch; it is compiled to keep it correct and spill-free.
WIDE_SLAB: tuple[int, int, int] = (1, 65536, 32768)
#: Formats with a kernel, in report order.
FORMATS = ("block_fp8", "mxfp8", "nvfp4")
#: PTX of the native conversions (PTX ISA: cvt with .satfinite, round to nearest even).
NATIVE_CVT = {"e4m3": "cvt.rn.satfinite.e4m3x2", "e2m1": "cvt.rn.satfinite.e2m1x2"}

_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)")


class StaticReportError(RuntimeError):
    """The kernels cannot be compiled here (interpreter active, no ptxas) or a cubin is not
    what the report can read (a loop without a trip count)."""


@dataclass(frozen=True)
class KernelFacts:
    """Static facts of one format's launch compiled for one architecture.

    Attributes:
        format, arch, slab: what was compiled (arch 90 or 100, slab [E, N, K] bf16).
        registers: registers per thread; stack: spill (local stack) bytes per thread;
        shared: static shared memory bytes per block; num_warps: warps per program.
        programs: programs in the grid; sass: SASS instructions one program executes.
        loops: backward branches found (each needs a trip count).
        instr_per_element: ``sass * 32 * num_warps * programs / elements``.
        bytes_per_element: HBM bytes moved per element (input + outputs).
        warps_per_sm: resident warps per SM the registers allow.
        native: which native conversions (``e4m3``, ``e2m1``) appear in the PTX.
        ceilings: GPU name -> issue-bound fraction of its HBM bandwidth (GPUs of this arch).
    """

    format: str
    arch: int
    slab: tuple[int, int, int]
    registers: int
    stack: int
    shared: int
    num_warps: int
    programs: int
    sass: int
    loops: int
    instr_per_element: float
    bytes_per_element: float
    warps_per_sm: int
    native: tuple[str, ...]
    ceilings: dict[str, float]

    def row(self) -> dict[str, Any]:
        """A flat dict for tables and JSON (ceilings as ``ceiling_<GPU>`` keys)."""
        d = asdict(self)
        d["slab"] = "x".join(map(str, self.slab))
        d["native"] = ",".join(self.native) or "none"
        for gpu, c in d.pop("ceilings").items():
            d[f"ceiling_{gpu}"] = round(c, 3)
        d["instr_per_element"] = round(self.instr_per_element, 2)
        d["bytes_per_element"] = round(self.bytes_per_element, 4)
        return d


def nvidia_tool(name: str) -> Path:
    """Path of ``ptxas``/``cuobjdump``/``nvdisasm`` shipped in the triton wheel
    (``triton/backends/nvidia/bin``). Raises: StaticReportError if absent."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise StaticReportError(f"{name} is not in the triton wheel ({path}); reinstall triton")
    return path


#: Launch variants: the default (contiguous slab, default options: the report's rows), a
#: transposed view (stride along K != 1: the general strided path) and nonfinite="propagate"
#: (the exact integer-encoder path that NaN/inf inputs take).
VARIANTS = ("default", "strided", "propagate")


def plan(fmt: str, slab: tuple[int, int, int], arch: int, variant: str = "default"):
    """The :class:`.launch.Launch` the public API makes for a bf16 ``slab`` (``variant``: see
    :data:`VARIANTS`), built on ``meta`` tensors (no memory, no data) for ``arch``."""
    from qstrat.plugins.registry import get_registry

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    opts = {"nonfinite": "propagate"} if variant == "propagate" else {}
    ser = get_registry().serializer(fmt, **opts)
    e, n, k = slab
    if variant == "strided":
        w3 = torch.empty((e, k, n), dtype=torch.bfloat16, device="meta").transpose(1, 2)
    else:
        w3 = torch.empty(slab, dtype=torch.bfloat16, device="meta")
    # The group context's structure from a tiny real slab of E experts, its tensors made meta.
    ctx = ser.group_context([torch.ones((slab[0], 1, 32))])
    if ctx is not None:
        ctx = {k: torch.empty_like(v, device="meta") if torch.is_tensor(v) else v for k, v in ctx.items()}
    planner = _planner(fmt)
    return planner(ser, w3, ctx, arch)


def _planner(fmt: str):
    import importlib

    mod = importlib.import_module(f"qstrat.serializers.kernels.{fmt}")
    return getattr(mod, f"plan_{fmt}")


def compile_launch(launch, arch: int):
    """Compile ``launch`` for ``sm_<arch>`` as Triton's launcher would on such a GPU.

    Returns: triton's CompiledKernel (``.asm`` holds ``ptx`` and ``cubin``).
    Raises: StaticReportError under ``TRITON_INTERPRET=1`` (kernels are interpreter objects).
    """
    from qstrat.serializers.kernels import interpreted

    if interpreted() or os.environ.get("TRITON_INTERPRET") == "1":
        raise StaticReportError("the static report compiles kernels: run it without TRITON_INTERPRET=1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = {**launch.constexprs, **launch.options(), "debug": False}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    key = (fn.fn.__qualname__, arch, repr(signature), repr(sorted(constexprs.items(), key=str)),
           repr(sorted(attrs.items(), key=str)), repr(sorted(options.__dict__.items(), key=str)))
    return _compile_cached(key, lambda: triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__))


_COMPILED: dict[tuple, Any] = {}


def _compile_cached(key: tuple, build):
    if key not in _COMPILED:
        _COMPILED[key] = build()
    return _COMPILED[key]


def sass_lines(cubin: bytes) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every SASS instruction in ``cubin`` (``cuobjdump -sass``)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([nvidia_tool("cuobjdump"), "-sass", str(path)], capture_output=True,
                             text=True, check=True).stdout
    return [(int(a, 16), ins) for a, ins in _SASS_LINE.findall(out)]


def resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """``(registers, stack bytes, shared bytes)`` per thread/block (``cuobjdump -res-usage``)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([nvidia_tool("cuobjdump"), "-res-usage", str(path)],
                             capture_output=True, text=True, check=True).stdout
    m = _RES.search(out)
    if not m:
        raise StaticReportError(f"cuobjdump -res-usage printed no REG/STACK/SHARED line:\n{out}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def executed_instructions(lines: list[tuple[int, str]], loop_trips: Iterable[int] = ()) -> tuple[int, int]:
    """SASS instructions one program executes, and the number of loops found.

    NOPs and everything after the last ``EXIT`` (the ``BRA`` trap loop and padding) are not
    counted. A backward ``BRA`` at address b to t is a loop: instructions in [t, b] are counted
    ``trips`` times, trips taken from ``loop_trips`` in address order of the branches.
    Raises: StaticReportError when a loop has no trip count.
    """
    last_exit = max((a for a, ins in lines if re.search(r"\bEXIT\b", ins)), default=None)
    body = [(a, ins) for a, ins in lines
            if (last_exit is None or a <= last_exit) and not ins.split()[0].startswith("NOP")]
    weight = {a: 1 for a, _ in body}
    trips = list(loop_trips)
    loops = 0
    for a, ins in body:
        m = _BRANCH.search(ins)
        if m and int(m.group(1), 16) <= a:
            if loops >= len(trips):
                raise StaticReportError(f"loop at SASS {a:#x} -> {m.group(1)} has no trip count")
            t = int(m.group(1), 16)
            for b in weight:
                if t <= b <= a:
                    weight[b] *= trips[loops]
            loops += 1
    return sum(weight.values()), loops


def warps_per_sm(registers: int, num_warps: int) -> int:
    """Resident warps per SM the registers allow (sm_90 and sm_100: 65,536 registers per SM,
    per-warp allocation unit 256, at most 64 warps and 32 blocks per SM)."""
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    blocks = min(32, 65536 // (per_warp * num_warps))
    return min(64, blocks * num_warps)


def issue_ceiling(gpu: str, instr_per_element: float, bytes_per_element: float) -> float:
    """Fraction of ``gpu``'s HBM bandwidth that instruction issue allows (formula: module doc)."""
    _, sms, clock, hbm = GPUS[gpu]
    issue_rate = sms * 4 * 32 * clock
    return issue_rate / instr_per_element / (hbm / bytes_per_element)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@functools.lru_cache(maxsize=None)
def facts(fmt: str, slab: tuple[int, int, int], arch: int, variant: str = "default") -> KernelFacts:
    """Compile the public API's launch of ``fmt`` on a bf16 ``slab`` for ``sm_<arch>`` and read
    its static facts (cached per process; triton also caches compiles on disk).

    Raises: StaticReportError (see :func:`compile_launch`), triton's CompilationError.
    """
    launch = plan(fmt, tuple(slab), arch, variant)
    kernel = compile_launch(launch, arch)
    cubin = kernel.asm["cubin"]
    regs, stack, shared = resource_usage(cubin)
    sass, loops = executed_instructions(sass_lines(cubin), launch.loop_trips)
    elements = math.prod(slab)
    programs = math.prod(launch.grid)
    ipe = sass * 32 * launch.num_warps * programs / elements
    moved = elements * 2 + sum(_nbytes(t) for t in launch.outputs.values())
    bpe = moved / elements
    ptx = kernel.asm["ptx"]
    native = tuple(k for k, pat in NATIVE_CVT.items() if pat in ptx)
    ceilings = {g: issue_ceiling(g, ipe, bpe) for g, spec in GPUS.items() if spec[0] == arch}
    return KernelFacts(fmt, arch, tuple(slab), regs, stack, shared, launch.num_warps, programs, sass,
                       loops, ipe, bpe, warps_per_sm(regs, launch.num_warps), native, ceilings)


def report(formats: Iterable[str] = FORMATS, slabs: Iterable[tuple[int, int, int]] = SLABS,
           archs: Iterable[int] = ARCHS) -> list[dict[str, Any]]:
    """One row (:meth:`KernelFacts.row`) per slab x format x arch.

    Needs triton with its NVIDIA backend and a process without ``TRITON_INTERPRET=1``.
    Raises: StaticReportError, or triton's own error when a kernel does not compile.
    """
    return [facts(f, tuple(s), a).row() for s in slabs for f in formats for a in archs]


def table(rows: Iterable[Mapping[str, Any]]) -> str:
    """The rows as a Markdown table (docs/performance.md's form)."""
    cols = ["slab", "format", "arch", "registers", "stack", "warps_per_sm", "instr_per_element",
            "native", "ceiling_H100", "ceiling_H200", "ceiling_B200"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(report()))
