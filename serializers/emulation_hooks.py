"""A format's hooks into code that runs it elsewhere: its CPU emulation of vLLM's kernels and
its peers in ``qstrat bench``.

vLLM keeps its kernels apart from its quantization configs, and torchao its benchmarks apart
from its formats; a qstrat format names both by reference (imported on first use, so importing a
format imports neither vLLM nor a peer library). :mod:`qstrat.vllm.emulation` registers every
registered format's emulation on a CPU vLLM platform; ``qstrat bench`` times the peers.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from qstrat.serializers import backend

__all__ = ["EmulationHooks"]


class EmulationHooks:
    """The emulation and bench-peer references of a format (class attributes, below)."""

    #: CPU emulation of vLLM's kernels for this format, opted into by naming it: a lazy
    #: ``"module"`` / ``"module:attr"`` reference or the object itself, with ``hooks() -> dict``
    #: (resolve the vLLM names it needs, change nothing; raise VllmHookError naming a missing
    #: one) and ``register(hooks)`` (install, idempotent). :mod:`qstrat.vllm.emulation` registers
    #: every registered format's on a CPU vLLM platform. None: no emulation (vLLM's own kernels).
    emulation: ClassVar[str | object | None] = None
    #: ``qstrat bench`` peers of this format: implementation label (``"vllm"``) -> a lazy
    #: ``"module:function"`` reference or the function, ``peer(format_name, x) -> (fn | None, note)``
    #: with ``x`` a bf16 [N, K] weight and ``fn()`` the timed call (None: unavailable here, ``note``
    #: says why). Empty: the format has no peer, and its bench rows say so.
    bench_peers: ClassVar[Mapping[str, str | Callable[..., Any]]] = {}

    @classmethod
    def resolve_emulation(cls) -> Any | None:
        """The format's CPU emulation object (see ``emulation``), imported on first use, or None.

        Raises: PluginError if the reference cannot be imported or lacks ``hooks``/``register``.
        """
        return backend.resolve_emulation(cls)

    @classmethod
    def resolve_bench_peers(cls) -> dict[str, Callable[..., Any]]:
        """``bench_peers`` with lazy references imported: label -> ``peer(format_name, x)``.

        Raises: PluginError naming the format and the reference that does not import.
        """
        return backend.resolve_bench_peers(cls)

