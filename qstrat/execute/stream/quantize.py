"""Quantizing one plan entry, or a batch of experts: the serializer call and the NaN/inf checks.

:class:`EntryQuantizer` turns an entry index into its parts (serializer part name -> tensor):
a passthrough input as it is (checked for NaN/inf unless the values were checked before), a
grouped slab in one call (viewed per projection where the plan tiles each projection on its
own), per-expert inputs batched by :class:`~qstrat.execute.stream.batches.ExpertBatcher`, each with its
fused group's context (:class:`~qstrat.execute.stream.groups.GroupContexts`). A NaN in a batch is
reported with the expert's own tensor name.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from qstrat.errors import NonFiniteError
from qstrat.plan.data import PASSTHROUGH, PlanEntry, RefitPlan
from qstrat.plan.outputs import projection_shape, split_by_projection
from qstrat.serializers.base import Serializer, check_finite
from qstrat.execute.stream.batches import ExpertBatcher, unalias
from qstrat.execute.stream.groups import GroupContexts
from qstrat.execute.stream.window import InputWindow

__all__ = ["EntryQuantizer", "Quantize", "SerializerSource", "check_passthrough", "quantize_whole"]


class SerializerSource(Protocol):
    """What execution needs of the driver: the serializer instance for a planned format
    (:meth:`qstrat.RefitDriver.serializer`, cached per format and options)."""

    def serializer(self, name: str, options: Mapping[str, Any]) -> Serializer: ...


class Quantize(Protocol):
    """How an entry's serializer call is made: ``(ser, key, w, name=, context=, values_checked=)``
    -> ``ser.quantize``'s parts (the same bytes), ``key`` naming the entry (its input name, or
    the names of an expert batch) across executions. Default: :func:`quantize_whole`; a delta
    round's sender passes :meth:`qstrat.transport.delta.requantize.Requantizer.quantize`."""

    def __call__(self, ser: Serializer, key: Any, w: torch.Tensor, *, name: str, context: Any,
                 values_checked: bool) -> dict[str, torch.Tensor]: ...


def quantize_whole(ser: Serializer, key: Any, w: torch.Tensor, *, name: str, context: Any,
                   values_checked: bool) -> dict[str, torch.Tensor]:
    """``ser.quantize`` of ``w`` (``key`` unused): every execution quantizes every entry whole."""
    return ser.quantize(w, name=name, context=context, values_checked=values_checked)


class EntryQuantizer:
    """Quantizes the entries of one execution.

    Args:
        driver: the serializer instances.
        plan: the plan being executed.
        inputs: where input values are read.
        values_checked: NaN/inf already checked for every input.
        expert_batch: most experts per serializer call.
        quantize: the serializer call (:class:`Quantize`; default :func:`quantize_whole`).
    """

    def __init__(self, driver: SerializerSource, plan: RefitPlan, inputs: InputWindow, values_checked: bool,
                 expert_batch: int, quantize: Quantize | None = None) -> None:
        self.driver, self.plan, self.inputs, self.values_checked = driver, plan, inputs, values_checked
        self.call = quantize or quantize_whole
        self.groups = GroupContexts(plan, inputs, values_checked)
        self.batches = ExpertBatcher(plan, inputs, expert_batch)

    def quantize(self, i: int) -> dict[int, dict[str, torch.Tensor]]:
        """Quantize entry ``i`` (with the experts batched with it). Returns entry index -> parts.

        Raises: NonFiniteError naming the input tensor; PlanError for a streamed input
            :class:`~qstrat.execute.stream.window.InputWindow` refuses.
        """
        e = self.plan.entries[i]
        if e.serializer == PASSTHROUGH:
            t = self.inputs.get(e.name)
            if not self.values_checked:
                check_passthrough(t, e.name)
            self.groups.finish([i])
            return {i: {"weight": t}}
        ser = self.driver.serializer(e.serializer, e.options)
        batch = self.batches.batch(i, self.groups.done)
        with torch.no_grad():
            ws = [self.inputs.get(self.plan.entries[j].name) for j in batch]
            ctxs = [self.groups.context(j, ser) for j in batch]
            checked = self.values_checked or all(self.plan.entries[j].name in self.groups.checked for j in batch)
            if len(batch) == 1:  # quantize checks NaN/inf itself (the fast path: from its block maxima)
                result = {i: self._one(e, ser, ws[0], ctxs[0], checked)}
            else:
                result = self._batch(e, ser, batch, ws, ctxs, checked)
        self.groups.finish(batch)
        return result

    def _one(self, e: PlanEntry, ser: Serializer, w: torch.Tensor, ctx: Any, checked: bool) -> dict[str, torch.Tensor]:
        k = projection_split(e, ser)
        if not k:
            return self.call(ser, e.name, w, name=e.name, context=ctx, values_checked=checked)
        # a slab whose projections are tiled on their own (qstrat.plan.outputs.split_by_projection)
        parts = self.call(ser, e.name, w.reshape(projection_shape(tuple(w.shape), k)), name=e.name, context=ctx,
                          values_checked=checked)
        return {n: v.reshape(w.shape[0], k * v.shape[1], *v.shape[2:]) for n, v in parts.items()}

    def _batch(self, e: PlanEntry, ser: Serializer, batch: list[int], ws: list[torch.Tensor], ctxs: list[Any],
               checked: bool) -> dict[int, dict[str, torch.Tensor]]:
        stacked = self.batches.stack(ws)
        ctx = None if ctxs[0] is None else {k: torch.stack([c[k] for c in ctxs]) for k in ctxs[0]}
        name = f"{e.name} (with {len(batch) - 1} more experts)"
        try:
            parts = self.call(ser, tuple(self.plan.entries[j].name for j in batch), stacked, name=name,
                              context=ctx, values_checked=checked)
        except NonFiniteError:  # name the expert's own tensor, not the stacked batch
            for j, w in zip(batch, ws):
                ser.check_values(w, self.plan.entries[j].name)
            raise
        parts = unalias(parts, stacked)
        return {j: {k: v[b] for k, v in parts.items()} for b, j in enumerate(batch)}

    def close(self) -> None:
        """Release the batch scratch."""
        self.batches.close()


def projection_split(e: PlanEntry, ser: Serializer) -> int:
    """For a grouped slab the plan tiles per projection (:func:`~qstrat.plan.outputs.split_by_projection`),
    the number of projections it stacks; else 0."""
    if e.expert is not None or len(e.shape) != 3 or not e.outputs or e.outputs[0].row_parts < 2:
        return 0
    k = e.outputs[0].row_parts
    return k if split_by_projection(ser.part_specs(e.shape), e.shape[1], k) else 0


def check_passthrough(t: torch.Tensor, name: str) -> None:
    """NaN/inf in a tensor sent unchanged (norms, routers, embeddings) is an error too.

    Raises: NonFiniteError naming ``name`` and the first bad index.
    """
    if t.is_floating_point() and t.numel():
        check_finite(t if t.dim() <= 3 else t.reshape(-1, *t.shape[-2:]), name, 1)
