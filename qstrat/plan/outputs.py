"""The checkpoint tensors one input emits: names, shapes, dtypes and bytes, before any data is read.

A whole tensor emits each of its format's parts under ``{module}.{suffix}``. A grouped expert
slab ``[E, rows, K]`` emits, with ``expert_emission: fused``, each part under the slab's own name
(:func:`fused_name`), or, per expert (the default), one ``{experts}.{e}.{proj}.{suffix}`` per
expert and projection, cut out of the slab's parts (:class:`~qstrat.plan.data.OutputTensor`'s
``expert`` / ``row_part`` / ``row_parts``). Engine-fused siblings (q/k/v, one expert's gate/up)
share a group key (:func:`fusion_group`).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from qstrat.errors import PlanError
from qstrat.layouts.model_layout import ModelLayout, ParsedName, SlabSpec
from qstrat.plan.data import OutputTensor
from qstrat.serializers.base import FormatMath, PartSpec, dtype_name, tensor_nbytes

__all__ = ["OutputDeclaration", "fused_name", "fusion_group", "projection_shape", "split_by_projection"]


class OutputDeclaration:
    """Declares the outputs of a plan's inputs.

    Args:
        expert_emission: the config's ``per_expert`` or ``fused``.
        slabs: the layout's grouped slabs (:attr:`qstrat.layouts.model_layout.ModelLayout.slabs`).
    """

    def __init__(self, expert_emission: str, slabs: Mapping[str, SlabSpec]) -> None:
        self.expert_emission = expert_emission
        self.slabs = slabs

    def outputs(self, p: ParsedName, specs: tuple[PartSpec, ...], shape: tuple[int, ...],
                ser: FormatMath | None = None) -> tuple[OutputTensor, ...]:
        """The outputs of the input ``p`` of ``shape`` whose format has parts ``specs``: whole, a
        fused slab, or per expert (a slab cut into ``experts.{e}.{proj}``; ``ser``: the format,
        needed to tile each projection of a slab on its own when its rows are off the format's
        row tile, :func:`split_by_projection`).

        Raises: PlanError for slab rows that do not split into the layout's projections, or a
        per-expert split the format's row tile cannot express."""
        if not p.slab:
            module = p.module
            return tuple([OutputTensor(f"{module}.{s.suffix}", s.shape, dtype_name(s.dtype), s.nbytes, s.suffix)
                          for s in specs])

        def out(name: str, spec: PartSpec, shp: tuple[int, ...], **kw: Any) -> OutputTensor:
            return OutputTensor(name, shp, dtype_name(spec.dtype), tensor_nbytes(shp, spec.dtype),
                                  spec.suffix, **kw)

        if self.expert_emission == "fused" or not self.slabs[p.projection].splittable:
            return tuple(out(fused_name(p.checkpoint_name, s.suffix), s, s.shape) for s in specs)
        projections = self.slabs[p.projection].parts
        k = len(projections)
        rows = shape[1]
        if rows % k:
            raise PlanError(f"slab rows {rows} do not split into {k} projections {projections}")
        if not shape[0]:
            return ()  # an empty slab emits nothing
        split = split_by_projection(specs, rows, k)
        if split:  # each projection tiled on its own: the parts of the slab viewed as [E*k, rows/k, K]
            if ser is None or any(s.rows_per_entry is None for s in specs):
                raise PlanError(f"per-expert split of {p.projection} needs {rows // k} rows per projection "
                                "to be a multiple of the format's row tile (it has a per-matrix value "
                                "shared by the projections); use expert_emission: fused")
            specs = ser.part_specs(projection_shape(shape, k))
        cut = []  # per part: (suffix, shape, dtype, bytes) of one expert's projection, the same for all
        for s in specs:
            r = s.rows_per_entry
            inner = s.shape[1:]
            if r is not None and not split:
                inner = (inner[0] // k,) + inner[1:]
            cut.append((s.suffix, inner, dtype_name(s.dtype), tensor_nbytes(inner, s.dtype)))
        experts = p.engine_module
        return tuple([OutputTensor(f"{experts}.{e}.{proj}.{suffix}", inner, dname, nbytes, suffix, e, j, k)
                      for e in range(shape[0]) for j, proj in enumerate(projections)
                      for suffix, inner, dname, nbytes in cut])


def split_by_projection(specs: tuple[PartSpec, ...], rows: int, k: int) -> bool:
    """Whether a grouped slab ``[E, rows, K]`` of ``k`` stacked projections (gate_up: k=2),
    emitted per expert, is quantized as ``[E*k, rows/k, K]`` (:func:`projection_shape`): when a
    part's row tile (``rows_per_entry``, 128 for block FP8) does not divide ``rows/k``, a tile of
    the whole slab would straddle gate and up. Tiled per projection, the bytes are those of
    quantizing each expert's gate_proj and up_proj on their own (what a per-expert checkpoint
    holds); the stream views the slab so (:mod:`qstrat.execute.stream`), still in one serializer call."""
    return k > 1 and any(s.rows_per_entry is not None and (rows // k) % s.rows_per_entry for s in specs)


def projection_shape(shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """``[E, k*R, K]`` -> ``[E*k, R, K]``: a slab's projections as separate matrices."""
    return (shape[0] * k, shape[1] // k) + tuple(shape[2:])


def fusion_group(layout: ModelLayout, p: ParsedName) -> str | None:
    """Key of the engine-fused group ``p`` belongs to (``model.layers.0.self_attn.{q_proj,k_proj,v_proj}``,
    from the layout's ``fused``; one expert's gate/up: ``...experts.3.{gate_proj,up_proj}``), or None
    (a grouped slab holds its group already)."""
    if p.slab or p.projection is None:
        return None
    members = _fused_members(layout.fused, p.projection)
    return None if members is None else f"{p.module.rsplit('.', 1)[0]}.{members}"


@functools.lru_cache(maxsize=256)
def _fused_members(fused: tuple[tuple[str, ...], ...], projection: str) -> str | None:
    """``{q_proj,k_proj,v_proj}``: the engine-fused group of ``projection`` in a layout's
    ``fused`` as a group key ends, or None (cached: asked once per tensor of a plan)."""
    for members in fused:
        if projection in members:
            return f"{{{','.join(members)}}}"
    return None


def fused_name(slab: str, suffix: str) -> str:
    """Checkpoint name of a slab part with fused emission:
    ``experts.gate_up_proj`` + ``weight_scale_inv`` -> ``experts.gate_up_proj_scale_inv``."""
    if suffix == "weight":
        return slab
    return slab + suffix.removeprefix("weight") if suffix.startswith("weight_") else f"{slab}_{suffix}"
