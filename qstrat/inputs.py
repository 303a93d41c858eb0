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

    Raises: PlanError for a name that is not a str, or a name given twice.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        if not isinstance(name, str):
            raise PlanError(f"tensor names must be strings, got {name!r} ({type(name).__name__})")
        if name in out:
            raise PlanError(f"{name}: given twice")
        out[name] = t
    return out


def materialize(t: Any, name: str) -> torch.Tensor:
    """A tensor, or a lazily loaded handle with ``.load()`` (e.g. checkpoint.LazyTensor), loaded.

    Raises: PlanError for a ``meta`` tensor (it has no values to quantize or send).
    """
    t = t if isinstance(t, torch.Tensor) else t.load()
    if t.is_meta:
        raise PlanError(f"{name}: is a meta tensor; run() needs values (plan() accepts meta tensors)")
    return t
