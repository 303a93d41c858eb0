"""qstrat's own per-engine state, kept in a registry of its own keyed by the engine object.

An engine (a ``vllm.LLM``, one worker, one weight-transfer backend) carries qstrat state across
calls: its MIX flag, the KV-cache scales it must hold, its engine manifests, its expectations.
That state lives here, not in the vLLM object's ``__dict__``: one :class:`EngineState` per
kind of state, keyed by the object's identity and held weakly, so an entry goes when its engine
is collected. An object that cannot be weakly referenced (a ``SimpleNamespace`` stand-in in a
test) is held strongly instead, and its entry stays until :meth:`EngineState.drop`.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def _engine(obj: Any) -> Any:
    """The vLLM object behind a view (a view and its object share one entry)."""
    from qstrat.vllm.adapter.views import EngineView, WorkerView

    return obj.llm if isinstance(obj, EngineView) else obj.worker if isinstance(obj, WorkerView) else obj


class EngineState(Generic[T]):
    """One kind of per-engine state: engine -> value.

    Args: what: what the state is, for messages (``"MIX flag"``).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._values: dict[int, tuple[Any, T]] = {}  # id(engine) -> (weakref or the engine, value)

    def _ref(self, engine: Any) -> Any:
        key = id(engine)
        try:
            return weakref.ref(engine, lambda _ref, key=key: self._values.pop(key, None))
        except TypeError:  # not weak-referenceable: hold it (its id stays unique while held)
            return engine

    def get(self, engine: Any, default: T | None = None) -> T | None:
        """``engine``'s value, ``default`` if it has none."""
        engine = _engine(engine)
        held = self._values.get(id(engine))
        if held is None:
            return default
        ref, value = held
        target = ref() if isinstance(ref, weakref.ref) else ref
        return value if target is engine else default

    def set(self, engine: Any, value: T) -> T:
        """Set ``engine``'s value; returns it."""
        engine = _engine(engine)
        self._values[id(engine)] = (self._ref(engine), value)
        return value

    def setdefault(self, engine: Any, factory: Callable[[], T]) -> T:
        """``engine``'s value, made by ``factory()`` and kept on first use."""
        held = self.get(engine, None)
        return held if held is not None else self.set(engine, factory())

    def drop(self, engine: Any) -> None:
        """Forget ``engine``'s value (nothing if it has none)."""
        if self.get(engine, None) is not None:
            del self._values[id(_engine(engine))]
