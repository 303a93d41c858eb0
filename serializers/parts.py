"""What a format emits: :class:`PartSpec` (one checkpoint tensor per weight, declared from the
shape alone), byte and dtype-name helpers, and :func:`check_parts`, the check that a format
emitted exactly what it declared."""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: Per-expert state a serializer shares across the members of a fusion group: name -> tensor [E].
Context = Mapping[str, torch.Tensor]

#: Weight dtypes a serializer reads (fp8, integer and float64 inputs are refused).
WEIGHT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


@dataclass(frozen=True)
class PartSpec:
    """One checkpoint tensor a serializer emits for a weight.

    Attributes:
        suffix: checkpoint suffix, e.g. ``"weight"``, ``"weight_scale_inv"``.
        shape: full shape, including the leading expert dim E for grouped input.
        dtype: torch dtype as stored in the checkpoint.
        rows_per_entry: weight rows (the matrix's N) covered by one entry of this part along
            the part's first per-matrix dimension (1 per-row, 128 for 128x128 tiles); ``None``
            for one value per matrix (a per-tensor scale, shape ``[]`` per matrix), which is
            duplicated when a fused weight is split by rows.
    """

    suffix: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows_per_entry: int | None = 1

    @functools.cached_property
    def nbytes(self) -> int:
        """Size in bytes."""
        return tensor_nbytes(self.shape, self.dtype)


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (no allocation)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as plans and checkpoints name it: ``torch.float8_e4m3fn`` -> ``float8_e4m3fn``
    (cached: asked three times per tensor of a plan)."""
    return str(dtype).removeprefix("torch.")


def check_parts(fmt: str, name: str, specs: Sequence[PartSpec], parts: Mapping[str, Any]) -> None:
    """A serializer must emit exactly what it declared in the plan (a plugin-author error):
    a mapping suffix -> tensor (``name``: the tensor, or the ``reference()`` chunk).

    Raises: PluginError naming the format, ``name`` and both sets of (shape, dtype)."""
    from qstrat.errors import PluginError

    if not isinstance(parts, Mapping) or not all(torch.is_tensor(v) for v in parts.values()):
        raise PluginError(f"serializer {fmt!r} returned {type(parts).__name__} {parts!r:.80} for {name}; it must "
                          "return a dict suffix -> tensor, the parts part_specs declares")
    declared = {p.suffix: (tuple(p.shape), p.dtype) for p in specs}
    got = {k: (tuple(v.shape), v.dtype) for k, v in parts.items()}
    if declared != got:
        raise PluginError(
            f"serializer {fmt!r} emitted {got} for {name}, but declared {declared} in the plan"
        )


def declared_parts(ser: Any, shape: tuple[int, ...]) -> tuple[PartSpec, ...]:
    """The parts ``ser`` (a Serializer) declares for a weight of ``shape`` ([N, K] or [E, N, K]):
    its ``matrix_parts(N, K)`` with the leading expert dim prepended.

    Raises: UnsupportedShapeError for other ranks, an empty dim, or a shape the format cannot
        represent; PluginError when ``matrix_parts`` returns anything but PartSpecs."""
    from qstrat.errors import PluginError, UnsupportedShapeError

    if len(shape) not in (2, 3) or min(shape) <= 0:
        raise UnsupportedShapeError(
            f"{ser.name}: expected a non-empty [N, K] or [E, N, K] weight, got shape {list(shape)}"
        )
    lead = shape[:-2]
    declared = ser.matrix_parts(*shape[-2:])
    who = f"serializer {ser.name!r} ({type(ser).__module__}.{type(ser).__qualname__})"
    if not isinstance(declared, (tuple, list)) or not all(isinstance(p, PartSpec) for p in declared):
        raise PluginError(f"{who}: matrix_parts({shape[-2]}, {shape[-1]}) must return a tuple of PartSpec, got "
                          f"{declared!r:.120}")
    for p in declared:  # a dataclass checks nothing: "int8" for torch.int8 failed later as an AttributeError
        why = ("suffix must be a non-empty str" if not isinstance(p.suffix, str) or not p.suffix else
               "dtype must be a torch.dtype" if not isinstance(p.dtype, torch.dtype) else
               "shape must be a tuple of non-negative ints" if not isinstance(p.shape, (tuple, list)) or any(
                   isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in p.shape) else
               "rows_per_entry must be a positive int or None" if p.rows_per_entry is not None and (
                   isinstance(p.rows_per_entry, bool) or not isinstance(p.rows_per_entry, int)
                   or p.rows_per_entry < 1) else None)
        if why:
            raise PluginError(f"{who}: matrix_parts({shape[-2]}, {shape[-1]}) returned {p!r}: its {why}")
    return tuple(PartSpec(p.suffix, lead + p.shape, p.dtype, p.rows_per_entry) for p in declared)


def check_weight_dtype(fmt: str, name: str, dtype: torch.dtype) -> None:
    """Raise UnsupportedShapeError naming the tensor ``name`` and the format ``fmt`` unless
    ``dtype`` is one of :data:`WEIGHT_DTYPES` (a float64 weight is told to cast to float32)."""
    from qstrat.errors import UnsupportedShapeError

    if dtype not in WEIGHT_DTYPES:
        raise UnsupportedShapeError(
            f"{name}: {fmt} quantizes bfloat16, float16 or float32 weights, got "
            f"{dtype_name(dtype)}" + (" (cast it to float32)" if dtype == torch.float64 else "")
        )
