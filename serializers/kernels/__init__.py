"""Triton kernels for the formats: one module per format, shared device helpers in
:mod:`.fp_encode`.

A format names its kernel lazily (``kernel = "qstrat.serializers.kernels.<format>:<function>"``);
:meth:`qstrat.serializers.base.Serializer.resolve_kernel` imports it where the backend is chosen,
and only when triton is importable. Without triton every format runs its torch reference.

Compiled or interpreted: as for any ``@triton.jit`` code, ``TRITON_INTERPRET=1`` must be set
before triton is imported for the kernels to run on CPU tensors under the interpreter (triton's
own ``tl.max`` etc. are built at its import), so it cannot be switched in a running process:
see :func:`interpreted`.
"""
from __future__ import annotations


def triton_available() -> bool:
    """True when ``import triton`` succeeds (the kernels need triton >= 3.0)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
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
