"""numba where it imports: the transport's CPU kernels (memory-bound passes that torch answers
only in several passes, each over the whole input or a temporary) compiled to one loop.

:func:`cpu_kernel` compiles a Python loop with numba in nopython mode, releasing the GIL (two
threads may run it at once), without bounds checks, cached on disk (numba's cache: the package's
``__pycache__``, else the user's cache folder; without either, compiled once per process). Each
kernel's module keeps the torch path beside it: the same values, used where numba does not import
or the tensors are not on the CPU, and tested against the kernel.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

try:
    import numba
except ImportError:  # every kernel's torch path answers: the same values, slower
    numba = None

#: Whether numba imported (the kernels exist).
AVAILABLE = numba is not None


def cpu_kernel(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """``fn`` compiled by numba (module docstring), or None where numba did not import. The
    compile happens at the first call of each argument type signature (~0.1-1 s; a cached one
    loads in milliseconds)."""
    if numba is None:
        return None
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    except RuntimeError as exc:  # no folder to cache the compiled code in
        logger.debug("qstrat: numba cannot cache %s (%s); compiling it once per process", fn.__name__, exc)
        return numba.njit(nogil=True, boundscheck=False)(fn)
