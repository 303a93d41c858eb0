"""Triton kernels for the formats: one module per format, shared device helpers in
:mod:`.fp_encode`.

A format module ends with ``load_kernel("<format>")``, which imports
``qstrat.serializers.kernels.<format>`` when triton is importable; that module sets the format's
``Serializer.kernel`` hook (see :class:`qstrat.serializers.base.Serializer`). Without triton the
hook stays ``None`` and every format runs its torch reference.

Compiled or interpreted: as for any ``@triton.jit`` code, ``TRITON_INTERPRET=1`` must be set
before triton is imported for the kernels to run on CPU tensors under the interpreter (triton's
own ``tl.max`` etc. are built at its import), so it cannot be switched in a running process:
see :func:`interpreted`.
"""
from __future__ import annotations

import importlib


def triton_available() -> bool:
    """True when ``import triton`` succeeds (the kernels need triton >= 3.0)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def load_kernel(fmt: str) -> bool:
    """Import the kernel module of format ``fmt`` (registering its hook) if triton is importable.

    Args: fmt: module name under ``qstrat.serializers.kernels`` (``"block_fp8"``, ``"mxfp8"``).
    Returns: True if the kernel module is loaded, False if triton is not installed.
    Raises: any error of the kernel module itself (a broken kernel must not pass silently).
    """
    if not triton_available():
        return False
    importlib.import_module(f"{__name__}.{fmt}")
    return True


def interpreted() -> bool:
    """True when triton was imported with ``TRITON_INTERPRET=1``, so kernels run on CPU tensors.

    Triton builds every ``@triton.jit`` function, its own ``tl.max``/``tl.sum`` included, as
    interpreted or compiled when it is decorated, i.e. when ``triton`` and the kernel modules are
    imported: the variable cannot be switched later in the same process (run the interpreter in
    a subprocess with the variable set from the start, as tests/test_kernels.py does).
    Returns: False as well when triton is not importable.
    """
    if not triton_available():
        return False
    import triton.language as tl

    return type(tl.max).__name__ == "InterpretedFunction"
