"""How the emulated kernels are put into vLLM: the two patterns every format uses.

* :func:`register_cpu_linear_kernel`: a linear kernel class appended to vLLM's CPU candidates
  through the public ``kernels.linear.register_linear_kernel`` (vLLM tries them in order, so
  native kernels keep priority);
* :func:`route_backend`: a fused-MoE oracle's ``backend -> experts classes`` resolver (a module
  global the oracle looks up at call time) wrapped so that one backend resolves to the torch
  experts class instead.

Both mark what they install (attribute :data:`MARK`) so that registering twice changes nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from qstrat.engine.emulation.announcing import Announcing
from qstrat.vllm_adapter.resolver import resolve

MARK = "_qstrat_emulation"


def is_wired(obj: object) -> bool:
    """Whether ``obj`` was installed by this module (registration already done)."""
    return bool(getattr(obj, MARK, False))


def cpu_linear_kernel_hooks(kernel: str) -> dict[str, Any]:
    """What :func:`register_cpu_linear_kernel` needs for vLLM's kernel class ``kernel`` (a key
    of qstrat's vLLM version table; public names). Raises VllmNameError naming a missing one."""
    return {"register_linear_kernel": resolve("register_linear_kernel"),
            "linear_kernel": resolve(kernel),
            "cpu": resolve("platform_cpu")}


def register_cpu_linear_kernel(h: dict[str, Any], kernel_type: str) -> type:
    """Register vLLM's own ``h["linear_kernel"]`` for ``h["cpu"]`` as ``kernel_type``
    (``"mxfp8"``, ``"nvfp4"``), as a subclass that announces itself when built
    (``Qstrat<name>`` in vLLM's "Using ... for ... GEMM" line). Returns the registered class."""
    base = h["linear_kernel"]
    cls = type(f"Qstrat{base.__name__}", (Announcing, base),
               {"__doc__": f"vLLM's {base.__name__}, registered for the CPU platform by qstrat.",
                MARK: True})
    h["register_linear_kernel"](cls, h["cpu"], kernel_type)
    return cls


def route_backend(oracle: ModuleType, attr: str, resolver: Callable[[Any], list], backend: Any,
                  experts_cls: type) -> None:
    """Set ``oracle.<attr>`` to ``resolver`` except that ``backend`` resolves to
    ``[experts_cls]``. No-op if ``resolver`` is already one of these wrappers."""
    if is_wired(resolver):
        return

    def resolve(b: Any) -> list:
        return [experts_cls] if b == backend else resolver(b)

    setattr(resolve, MARK, True)
    setattr(oracle, attr, resolve)
