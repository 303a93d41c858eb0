"""How the emulated kernels are put into vLLM: the two patterns every format uses, and the journal
that takes an interrupted installation back out.

* :func:`register_cpu_linear_kernel`: a linear kernel class appended to vLLM's CPU candidates
  through the public ``kernels.linear.register_linear_kernel`` (vLLM tries them in order, so
  native kernels keep priority);
* :func:`route_backend`: a fused-MoE oracle's ``backend -> experts classes`` resolver (a module
  global the oracle looks up at call time) wrapped so that one backend resolves to the torch
  experts class instead.

Both mark what they install (attribute :data:`MARK`) so that registering twice changes nothing.
Every change goes through :func:`set_attr`, :func:`insert` or :func:`register_cpu_linear_kernel`,
which record how to undo it in the open :func:`installing` journal: an exception half-way through
installing the formats of a process leaves vLLM as it found it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from qstrat.vllm.emulation.announcing import Announcing
from qstrat.vllm.adapter.resolver import resolve

MARK = "_qstrat_emulation"
#: Set on a registered linear kernel class whose installation was undone: it then claims no
#: platform (vLLM's public registration has no removal).
WITHDRAWN = "_qstrat_withdrawn"

_journal: list[Callable[[], None]] | None = None


@contextlib.contextmanager
def installing() -> Iterator[None]:
    """Record every change made through this module while the block runs; if the block raises,
    undo them, newest first, and re-raise. Not re-entrant (one installation at a time)."""
    global _journal
    _journal = []
    try:
        yield
    except BaseException:
        for undo in reversed(_journal):
            undo()
        raise
    finally:
        _journal = None


def _record(undo: Callable[[], None]) -> None:
    if _journal is not None:
        _journal.append(undo)


def set_attr(obj: Any, attr: str, value: Any) -> None:
    """``setattr(obj, attr, value)``, undone by restoring the previous value (or removing the
    attribute where there was none)."""
    missing = not hasattr(obj, attr)
    old = getattr(obj, attr, None)
    setattr(obj, attr, value)
    _record(lambda: delattr(obj, attr) if missing else setattr(obj, attr, old))


def insert(items: list[Any], at: int, value: Any) -> None:
    """``items.insert(at, value)``, undone by removing ``value``."""
    items.insert(at, value)
    _record(lambda: items.remove(value))


def is_wired(obj: object) -> bool:
    """Whether ``obj`` was installed by this module (registration already done)."""
    return bool(getattr(obj, MARK, False))


def cpu_linear_kernel_hooks(kernel: str) -> dict[str, Any]:
    """What :func:`register_cpu_linear_kernel` needs for vLLM's kernel class ``kernel`` (a key
    of qstrat's vLLM version table; public names). Raises VllmNameError naming a missing one."""
    return {"register_linear_kernel": resolve("register_linear_kernel"),
            "linear_kernel": resolve(kernel),
            "cpu": resolve("platform_cpu")}


def moe_format_hooks(linear_kernel: str, oracle: str, emulation: str, to_cls: str, triton_experts: str,
                     **more: str) -> dict[str, Any]:
    """The vLLM objects a format's CPU wiring (:func:`wire_moe_format`) uses, each given by its
    key in qstrat's vLLM version table (literal keys: tests/test_vllm_adapter.py collects them):
    the linear kernel class (:func:`cpu_linear_kernel_hooks`), the MoE ``oracle`` module, its
    ``emulation`` backend, its resolver ``to_cls``, vLLM's ``triton_experts`` class, and ``more``
    (name -> key). Raises VllmNameError naming a missing one."""
    return {
        **cpu_linear_kernel_hooks(linear_kernel),
        "oracle": resolve(oracle),
        "emulation": resolve(emulation),
        "to_cls": resolve(to_cls),
        "triton_experts": resolve(triton_experts),
        **{name: resolve(key) for name, key in more.items()},
    }


def wire_moe_format(h: dict[str, Any], fmt: str, resolver_attr: str, experts: Callable[[], type]) -> None:
    """Register vLLM's ``fmt`` emulation linear kernel for the CPU platform
    (:func:`register_cpu_linear_kernel`) and route the MoE oracle's ``resolver_attr`` so that
    its emulation backend resolves to ``experts()`` (:func:`route_backend`); ``h`` =
    :func:`moe_format_hooks`. Idempotent (nothing done when ``h["to_cls"]`` is already wired)."""
    if is_wired(h["to_cls"]):
        return
    register_cpu_linear_kernel(h, fmt)
    route_backend(h["oracle"], resolver_attr, h["to_cls"], h["emulation"], experts())


def register_cpu_linear_kernel(h: dict[str, Any], kernel_type: str) -> type:
    """Register vLLM's own ``h["linear_kernel"]`` for ``h["cpu"]`` as ``kernel_type``
    (``"mxfp8"``, ``"nvfp4"``), as a subclass that announces itself when built
    (``Qstrat<name>`` in vLLM's "Using ... for ... GEMM" line). Undone (inside
    :func:`installing`) by withdrawing the class: it then reports itself unsupported.
    Returns the registered class."""
    base = h["linear_kernel"]

    def is_supported(cls: type, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
        if getattr(cls, WITHDRAWN, False):
            return False, "qstrat's emulation was not installed in this process"
        return super(registered, cls).is_supported(*args, **kwargs)

    registered = type(f"Qstrat{base.__name__}", (Announcing, base),
                      {"__doc__": f"vLLM's {base.__name__}, registered for the CPU platform by qstrat.",
                       MARK: True, "is_supported": classmethod(is_supported)})
    h["register_linear_kernel"](registered, h["cpu"], kernel_type)
    _record(lambda: setattr(registered, WITHDRAWN, True))
    return registered


def route_backend(oracle: ModuleType, attr: str, resolver: Callable[[Any], list], backend: Any,
                  experts_cls: type) -> None:
    """Set ``oracle.<attr>`` to ``resolver`` except that ``backend`` resolves to
    ``[experts_cls]``. No-op if ``resolver`` is already one of these wrappers."""
    if is_wired(resolver):
        return

    def resolve(b: Any) -> list:
        return [experts_cls] if b == backend else resolver(b)

    setattr(resolve, MARK, True)
    set_attr(oracle, attr, resolve)
