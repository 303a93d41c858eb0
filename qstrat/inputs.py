"""The trainer's tensors as qstrat reads them: (name, tensor) pairs, lazily loaded handles.

Every sink (``qstrat.vllm``, ``qstrat.checkpoint``) and the driver take :data:`NamedTensors` and
turn it into a name-keyed dict with :func:`as_tensor_dict`; values are read through
:func:`materialize`, which also accepts a handle with ``.load()`` (``checkpoint.LazyTensor``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from qstrat.errors import PlanError

#: A mapping or an iterable of (HF name, tensor) pairs; tensors may be ``meta`` for planning.
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def as_tensor_dict(named_tensors: NamedTensors) -> dict[str, torch.Tensor]:
    """The pairs as a dict, in the producer's order.

    Values must be ``torch.Tensor`` (any device, ``meta`` included) or lazy handles with
    ``.shape``, a torch ``.dtype`` and ``.load()`` (:class:`qstrat.checkpoint.LazyTensor`).

    Raises: PlanError listing every bad pair: a name that is not a str, a name given twice, a
        value that is not a tensor (``None``, a numpy array - the message says
        ``torch.from_numpy`` - a list, ...).
    """
    if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not isinstance(named_tensors, (Mapping, Iterable)):
        raise PlanError(f"expected a mapping or an iterable of (name, tensor) pairs, got "
                        f"{type(named_tensors).__name__}")
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out: dict[str, torch.Tensor] = {}
    errors: list[str] = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            errors.append(f"expected (name, tensor) pairs, got {_short(item)}")
            continue
        name, t = item
        if not isinstance(name, str):
            errors.append(f"tensor names must be strings, got {name!r} ({type(name).__name__})")
        elif name in out:
            errors.append(f"{name}: given twice")
        else:
            problem = value_problem(t)
            if problem:
                errors.append(f"{name}: {problem}")
            out[name] = t
    if errors:
        head = "invalid input tensors:\n  " if len(errors) > 1 else ""
        raise PlanError(head + "\n  ".join(errors))
    return out


def value_problem(t: Any) -> str | None:
    """Why ``t`` cannot be a refit input (None if it can): see :func:`as_tensor_dict`."""
    if isinstance(t, torch.Tensor):
        return None
    kind = f"{type(t).__module__}.{type(t).__qualname__}".removeprefix("builtins.")
    if t is None:
        return "value is None, expected a torch.Tensor"
    if type(t).__module__ == "numpy" or kind.startswith("numpy."):
        return f"is a {kind}, expected a torch.Tensor (convert it with torch.from_numpy)"
    if isinstance(getattr(t, "dtype", None), torch.dtype) and hasattr(t, "shape") and callable(
            getattr(t, "load", None)):
        return None  # a lazy handle
    return f"is a {kind}, expected a torch.Tensor (or a lazy handle with shape, dtype and load())"


def _short(obj: Any, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def materialize(t: Any, name: str) -> torch.Tensor:
    """A tensor, or a lazily loaded handle with ``.load()`` (e.g. checkpoint.LazyTensor), loaded.

    Raises: PlanError for a ``meta`` tensor (it has no values to quantize or send), and for a
        handle whose ``load()`` returns something other than a tensor of the shape and dtype it
        declared (what the plan was made from).
    """
    if not isinstance(t, torch.Tensor):
        declared = (tuple(t.shape), t.dtype)
        t = t.load()
        if not isinstance(t, torch.Tensor) or (tuple(t.shape), t.dtype) != declared:
            got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise PlanError(f"{name}: load() returned {got}, but the handle declared {list(declared[0])} "
                            f"{declared[1]} (the plan was made from the declaration)")
    if t.is_meta:
        raise PlanError(f"{name}: is a meta tensor; run() needs values (plan() accepts meta tensors)")
    return t
