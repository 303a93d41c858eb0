"""Fast construction of frozen, slotted dataclasses on hot paths (the planner's per-tensor objects).

A ``@dataclass(frozen=True, slots=True)`` instance is built by an ``__init__`` that assigns each
field through ``object.__setattr__`` (the class's own ``__setattr__`` refuses assignment), which
made object construction the largest single cost of a plan (docs/performance.md, "Why the code does it this way").

:func:`fast_builder` returns a class that builds the SAME object faster: a twin class - plain
slots, the same fields in the same order, the same defaults and ``__post_init__`` - whose
``__init__`` assigns each field directly, then re-labels the instance as the frozen class
(``obj.__class__ = cls``: allowed because both classes have the same slots in the same order, so
the same memory layout). The result is an instance of ``cls`` whose fields are those
``cls(*args)`` would hold: equal, with the same hash, and frozen (assigning a field raises
``FrozenInstanceError``).

The twin's ``__init__`` is generated from the fields, as :mod:`dataclasses` generates the
class's own. Keyword arguments, defaults and ``default_factory`` work as in the class's own
``__init__``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def fast_builder(cls: type[T]) -> Callable[..., T]:
    """A callable ``(*args, **kwargs) -> cls instance``, equal to ``cls(*args, **kwargs)``.

    Args:
        cls: a ``@dataclass(frozen=True, slots=True)`` class whose fields all take part in
            ``__init__`` (``init=False`` fields are not supported) and whose ``__post_init__``,
            if any, sets fields with ``object.__setattr__`` (as a frozen dataclass must).
    Returns: the twin class (its instances leave ``__init__`` as instances of ``cls``).
    Raises: TypeError for a class that is not a frozen slotted dataclass or has an
        ``init=False`` field (checked once, here).
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_builder: {cls.__name__} is not a @dataclass(frozen=True, slots=True)")
    fields = dataclasses.fields(cls)
    if any(not f.init for f in fields):
        raise TypeError(f"fast_builder: {cls.__name__} has init=False fields")
    if tuple(cls.__slots__) != tuple(f.name for f in fields):
        raise TypeError(f"fast_builder: {cls.__name__}'s slots {cls.__slots__} are not its fields, in order")
    # the __init__ a plain slotted dataclass would have (one assignment per field), then the
    # re-labelling, then the class's own __post_init__ (which sets through object.__setattr__)
    scope: dict[str, Any] = {"_cls": cls, "_missing": dataclasses.MISSING}
    params_src, body = [], []
    for f in fields:
        if f.default is not dataclasses.MISSING:
            scope[f"_default_{f.name}"] = f.default
            params_src.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            scope[f"_factory_{f.name}"] = f.default_factory
            params_src.append(f"{f.name}=_missing")
            body.append(f"    if {f.name} is _missing: {f.name} = _factory_{f.name}()")
        else:
            params_src.append(f.name)
        body.append(f"    self.{f.name} = {f.name}")
    body.append("    self.__class__ = _cls")
    if hasattr(cls, "__post_init__"):
        scope["_post_init"] = cls.__post_init__
        body.append("    _post_init(self)")
    exec(f"def __init__(self, {', '.join(params_src)}):\n" + "\n".join(body), scope)  # noqa: S102
    twin = type(f"{cls.__name__}Builder", (), {
        "__slots__": cls.__slots__, "__init__": scope["__init__"], "__module__": cls.__module__,
        "__qualname__": f"{cls.__qualname__}Builder",
        "__doc__": f"Builds a {cls.__name__} (same fields and value as {cls.__name__}(...)), fast."})
    return twin  # type: ignore[return-value]
