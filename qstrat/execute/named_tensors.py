"""The trainer's tensors as qstrat reads them: (name, tensor) pairs, specs, lazily loaded handles.

Every sink (``qstrat.vllm``, ``qstrat.execute.checkpoint``) and the driver take :data:`NamedTensors` and
turn it into a name-keyed dict with :func:`as_tensor_dict`; values are read through
:func:`materialize`, which also accepts a handle with ``.load()`` (``checkpoint.LazyTensor``,
:class:`OnDevice`) and gathers a sharded ``DTensor`` (FSDP2, tensor parallel) into the whole
tensor. A plan needs only :class:`TensorSpec` (name, shape, dtype): :func:`tensor_specs` makes
them from ``(name, shape, dtype)`` triples or from tensors without touching their values.
"""
from __future__ import annotations

import operator

import sys
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.errors import NoValuesError, PlanError

#: A mapping or an iterable of (HF name, tensor) pairs; tensors may be ``meta`` for planning.
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def as_tensor_dict(named_tensors: NamedTensors) -> dict[str, torch.Tensor]:
    """The pairs as a dict, in the producer's order.

    Values must be ``torch.Tensor`` (any device, ``meta`` and DTensors included) or objects
    with ``.shape`` and a torch ``.dtype``: a :class:`TensorSpec` (planning only) or a lazy
    handle with ``.load()`` (:class:`qstrat.execute.checkpoint.LazyTensor`, :class:`OnDevice`).

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
        if isinstance(name, str) and isinstance(t, torch.Tensor) and name not in out:
            out[name] = t  # the common case: nothing to check further
            continue
        try:
            check_new_name(name, out)
        except PlanError as exc:
            errors.append(str(exc))
            continue
        problem = value_problem(t)
        if problem:
            errors.append(f"{name}: {problem}")
        out[name] = t
    if errors:
        head = "invalid input tensors:\n  " if len(errors) > 1 else ""
        raise PlanError(head + "\n  ".join(errors))
    return out


def check_new_name(name: Any, seen: Container[str]) -> None:
    """Raise PlanError unless ``name`` is a str not in ``seen`` (the names read so far)."""
    if not isinstance(name, str):
        raise PlanError(f"tensor names must be strings, got {name!r} ({type(name).__name__})")
    if name in seen:
        raise PlanError(f"{name}: given twice")


@dataclass(frozen=True)
class TensorSpec:
    """What a plan reads of an input: its global ``shape`` and ``dtype`` (no values)."""

    shape: torch.Size
    dtype: torch.dtype

    def __post_init__(self) -> None:
        """Raises PlanError for a ``shape`` that is not a sequence of ints >= 0 (None, an int, a
        str, a negative or fractional dim) or a ``dtype`` that is not a torch.dtype."""
        shape = self.shape
        try:  # ints, numpy or 0-d tensor integers (operator.index); not bools, floats, strs
            if isinstance(shape, (str, bytes)) or any(isinstance(d, bool) for d in shape):
                raise TypeError
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            dims = (-1,)
        if any(d < 0 for d in dims):
            raise PlanError(f"TensorSpec shape must be a sequence of ints >= 0, got {shape!r:.80}")
        object.__setattr__(self, "shape", torch.Size(dims))
        if not isinstance(self.dtype, torch.dtype):
            raise PlanError(f"TensorSpec dtype must be a torch.dtype, got {self.dtype!r}")


def tensor_specs(items: NamedTensors | Iterable[tuple[str, Any, torch.dtype]]) -> dict[str, TensorSpec]:
    """Name -> :class:`TensorSpec`, in the given order, from ``(name, shape, dtype)`` triples, a
    mapping or ``(name, tensor)`` pairs (tensors, DTensors - their global shape -, meta tensors,
    lazy handles: only ``.shape`` and ``.dtype`` are read). Nothing is kept of the values.

    Raises: PlanError for a name that is not a str, a name given twice, or a malformed item
        (naming the tensor: a shape that is not a sequence of ints >= 0, a dtype that is not a
        torch.dtype).
    """
    def specs() -> Iterable[tuple[str, TensorSpec]]:
        for item in items.items() if isinstance(items, Mapping) else items:
            if not (isinstance(item, tuple) and len(item) in (2, 3)):
                raise PlanError(f"expected (name, shape, dtype) or (name, tensor), got {item!r:.80}")
            try:
                if len(item) == 3:
                    yield item[0], TensorSpec(item[1], item[2])
                else:
                    t = item[1]
                    yield item[0], (t if isinstance(t, TensorSpec) else TensorSpec(t.shape, t.dtype))
            except PlanError as exc:
                raise PlanError(f"{item[0]}: {exc}") from exc

    return as_tensor_dict(specs())  # type: ignore[return-value]


class OnDevice:
    """A lazily loaded handle (``.shape``, ``.dtype``, ``.load()``) whose value is loaded and
    moved to ``device`` when the driver quantizes it: ``qstrat quantize --device cuda`` reads a
    checkpoint tensor by tensor onto the GPU, so the Triton kernels do the export."""

    def __init__(self, handle: Any, device: str | torch.device) -> None:
        self.handle, self.device = handle, torch.device(device)
        self.shape, self.dtype = torch.Size(handle.shape), handle.dtype

    def load(self) -> torch.Tensor:
        """The value on :attr:`device`."""
        t = self.handle if isinstance(self.handle, torch.Tensor) else self.handle.load()
        return t.to(self.device, non_blocking=False)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing that module:
    no DTensor exists before it is imported)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def value_problem(t: Any) -> str | None:
    """Why ``t`` cannot be a refit input (None if it can): see :func:`as_tensor_dict`."""
    if isinstance(t, torch.Tensor):
        return None
    kind = f"{type(t).__module__}.{type(t).__qualname__}".removeprefix("builtins.")
    if t is None:
        return "value is None, expected a torch.Tensor"
    if type(t).__module__ == "numpy" or kind.startswith("numpy."):
        return f"is a {kind}, expected a torch.Tensor (convert it with torch.from_numpy)"
    if isinstance(getattr(t, "dtype", None), torch.dtype) and hasattr(t, "shape"):
        return None  # a TensorSpec (planning), a lazy handle (load() is checked when it is read)
    return f"is a {kind}, expected a torch.Tensor (or a TensorSpec or lazy handle: shape and a torch dtype)"


def _short(obj: Any, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def lacks_values(t: Any) -> bool:
    """Whether input ``t`` has no values to read: neither a tensor (DTensors included) nor a lazy
    handle with ``.load()`` - a :class:`TensorSpec` (shape and dtype, for planning)."""
    return not isinstance(t, torch.Tensor) and not is_dtensor(t) and not callable(getattr(t, "load", None))


def no_values_error(names: list[str], t: Any) -> NoValuesError:
    """The :class:`~qstrat.errors.NoValuesError` for inputs ``names`` (the first one's value ``t``)."""
    more = f" (and {len(names) - 1} more: {', '.join(names[1:4])}{' ...' if len(names) > 4 else ''})" \
        if len(names) > 1 else ""
    return NoValuesError(f"{names[0]}: is a {type(t).__name__} (a shape and dtype only, for planning){more}; "
                         "quantizing, sending or writing needs its values: pass the tensor, or a lazy handle "
                         "with .load()")


def materialize(t: Any, name: str) -> torch.Tensor:
    """A plain tensor of the input's whole value.

    A tensor is returned as is; a handle with ``.load()`` (e.g. ``checkpoint.LazyTensor``,
    :class:`OnDevice`) is loaded; a ``DTensor`` (FSDP2 ``fully_shard`` parameters, tensor-parallel
    shards: any ``Shard``/``Replicate`` placement) is gathered with ``DTensor.full_tensor()``.
    The gather is a collective: every rank of the mesh must materialize the same DTensors in
    the same order (the driver does, since every rank runs the same plan in wire order).

    Raises: NoValuesError (a PlanError and a TypeError) naming the input for a value without values
        (a :class:`TensorSpec`); PlanError for a ``meta`` tensor (it has no values to quantize or
        send), and for a handle whose ``load()`` returns something other than a tensor of the
        shape and dtype it declared (what the plan was made from).
    """
    if is_dtensor(t):
        t = t.full_tensor()
    elif lacks_values(t):
        raise no_values_error([name], t)
    elif not isinstance(t, torch.Tensor):
        declared = (tuple(t.shape), t.dtype)
        t = t.load()
        if not isinstance(t, torch.Tensor) or (tuple(t.shape), t.dtype) != declared:
            got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise PlanError(f"{name}: load() returned {got}, but the handle declared {list(declared[0])} "
                            f"{declared[1]} (the plan was made from the declaration)")
    if t.is_meta:
        raise PlanError(f"{name}: is a meta tensor; run() needs values (plan() accepts meta tensors)")
    return t
