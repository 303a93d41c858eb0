"""Which implementation of a format runs: the lazy ``"module:attr"`` references a format declares
(its Triton kernel, CPU emulation, bench peers), imported on first use so that importing a format
never imports triton, vLLM or a peer library, and the ``backend`` option's choice between the
Triton kernel and the torch paths."""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import torch

from qstrat.errors import BackendUnavailableError, PluginError

#: Kernels resolved by :func:`resolve_kernel`, per format class.
_RESOLVED: dict[type, Callable[..., dict[str, torch.Tensor]] | None] = {}


def import_ref(fmt: str, ref: str, what: str = "kernel", need_callable: bool = True) -> Any:
    """Import ``"module:attr"`` (or ``"module"``: the module itself).

    Raises: PluginError naming the format ``fmt`` and ``what`` if it does not import or
    (``need_callable``) is not callable."""
    module, _, attr = ref.partition(":")
    try:
        obj = importlib.import_module(module)
        obj = getattr(obj, attr) if attr else obj
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"serializer {fmt!r}: {what} {ref!r} cannot be imported: {exc}") from exc
    if need_callable and not callable(obj):
        raise PluginError(f"serializer {fmt!r}: {what} {ref!r} is not callable")
    return obj


def resolve_kernel(cls: type) -> Callable[..., dict[str, torch.Tensor]] | None:
    """``cls.kernel`` (``cls`` a Serializer class) as a function, or None (no kernel declared, or
    triton not importable); a ``"module:function"`` reference is imported on first use and cached
    per class.

    Raises: PluginError if the reference does not name an importable callable (a broken kernel
    module must not fall back to the reference silently)."""
    ref = cls.kernel
    if ref is None or callable(ref):
        return ref
    if cls not in _RESOLVED:
        from qstrat.serializers.kernels import triton_available

        _RESOLVED[cls] = import_ref(cls.name, ref) if triton_available() else None
    return _RESOLVED[cls]


def resolve_emulation(cls: type) -> Any | None:
    """``cls.emulation`` imported (an object with ``hooks()`` and ``register(hooks)``), or None.

    Raises: PluginError if the reference cannot be imported or lacks ``hooks``/``register``."""
    ref = cls.emulation
    obj = import_ref(cls.name, ref, "emulation", need_callable=False) if isinstance(ref, str) else ref
    if obj is not None and not all(callable(getattr(obj, a, None)) for a in ("hooks", "register")):
        raise PluginError(f"serializer {cls.name!r}: emulation {ref!r} has no hooks() and register(hooks)")
    return obj


def resolve_bench_peers(cls: type) -> dict[str, Callable[..., Any]]:
    """``cls.bench_peers`` with lazy references imported: label -> ``peer(format_name, x)``.

    Raises: PluginError naming the format and the reference that does not import."""
    return {label: import_ref(cls.name, ref, f"bench peer {label!r}") if isinstance(ref, str) else ref
            for label, ref in cls.bench_peers.items()}


def runs_kernel(ser: Any, device: torch.device | str) -> bool:
    """Whether ``ser`` (a :class:`~qstrat.serializers.base.Serializer`) quantizing tensors on
    ``device`` runs its Triton kernel (else a torch path), raising if its ``backend`` option cannot
    run there. Reads no data.

    Raises: BackendUnavailableError: ``backend="triton"`` and the format has no kernel, triton
        does not import, or ``device`` is not CUDA without ``TRITON_INTERPRET=1``."""
    backend = ser.options.backend
    if backend in ("torch", "fast"):
        return False
    has_kernel = resolve_kernel(type(ser)) is not None
    is_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        return has_kernel and is_cuda
    if not has_kernel:
        why = "no Triton kernel is registered for this format" if type(ser).kernel is None else (
            "no Triton kernel is available (triton does not import: pip install 'qstrat[triton]')")
        raise BackendUnavailableError(f"{ser.name}: backend='triton' cannot run: {why}")
    if not is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendUnavailableError(
            f"{ser.name}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU); "
            f"the tensors are on {torch.device(device)}: use backend 'auto' or 'torch' here"
        )
    return True
