"""Expert batches: per-expert inputs of one layer quantized together, in one serializer call.

Per-expert inputs (``experts.{e}.{proj}.weight``) of one layer with the same projection, shape,
dtype and format are batched: up to ``expert_batch`` consecutive experts are stacked into one
``[B, N, K]`` tensor - a view when they are equally spaced views of one slab, else a copy into
scratch reused from call to call - and quantized in ONE serializer call (one kernel launch on a
GPU). Every format quantizes each expert of a batch independently (block and tile boundaries
never cross experts; :mod:`qstrat.serializers.base`), so the bytes equal one call per expert.
"""
from __future__ import annotations

from typing import Any

import torch

from qstrat.plan.data import RefitPlan
from qstrat.execute.stream.index import batch_key
from qstrat.execute.stream.window import InputWindow

__all__ = ["ExpertBatcher", "batch_key", "unalias"]


class ExpertBatcher:
    """Which entries of ``plan`` are quantized together, and the stacked tensor of a batch.

    Args:
        plan: the plan being executed.
        inputs: where inputs are read (a stream is read ahead only within one layer's experts).
        expert_batch: most experts per serializer call (1: no batching).
    """

    def __init__(self, plan: RefitPlan, inputs: InputWindow, expert_batch: int) -> None:
        self.plan, self.inputs, self.expert_batch = plan, inputs, max(1, expert_batch)
        self.index = inputs.index.position
        self.by_key = inputs.index.batches  # batch key -> expert -> entry index (read only)
        self.scratch: dict[tuple[Any, ...], torch.Tensor] = {}

    def batch(self, i: int, done: set[int]) -> list[int]:
        """Entry ``i`` and the next consecutive experts of its layer it can be quantized with:
        same projection, shape, dtype and format, not in ``done``, at most ``expert_batch``.
        From a stream, the batch reads ahead only while the arriving inputs belong to the same
        layer's experts (the window stays within the layer)."""
        e = self.plan.entries[i]
        key = batch_key(e)
        if key is None or self.expert_batch == 1:
            return [i]
        by_expert = self.by_key[key]
        batch = [i]
        for x in range(e.expert + 1, e.expert + self.expert_batch):
            j = by_expert.get(x)
            if j is None or j in done:
                break
            name = self.plan.entries[j].name
            while not self.inputs.has(name):
                arrived = self.inputs.pull()
                if arrived is None or self._engine_module(arrived) != e.engine_module:
                    return batch
            batch.append(j)
        return batch

    def _engine_module(self, name: str) -> str | None:
        j = self.index.get(name)
        return None if j is None else self.plan.entries[j].engine_module

    def stack(self, ws: list[torch.Tensor]) -> torch.Tensor:
        """``ws`` (same shape and dtype) as one [B, N, K] tensor: a view when they are equally
        spaced views of one storage (per-expert views of a slab), else copied into scratch
        reused across calls (copy the outputs that alias it: :func:`unalias`)."""
        view = as_strided_batch(ws)
        if view is not None:
            return view
        w = ws[0]
        key = (tuple(w.shape), w.dtype, w.device)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = torch.empty((self.expert_batch,) + tuple(w.shape), dtype=w.dtype,
                                                  device=w.device)
        out = buf[: len(ws)]
        torch.stack(ws, out=out)
        return out

    def close(self) -> None:
        """Release the scratch."""
        self.scratch.clear()


def as_strided_batch(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """A [B, ...] view over equally spaced same-shaped views of one storage, or None."""
    w0 = ws[0]
    base = w0.untyped_storage().data_ptr()
    step = ws[1].storage_offset() - w0.storage_offset()
    if step <= 0:
        return None
    for b, w in enumerate(ws):
        if (w.untyped_storage().data_ptr() != base or w.stride() != w0.stride()
                or w.storage_offset() != w0.storage_offset() + b * step):
            return None
    return w0.as_strided((len(ws),) + tuple(w0.shape), (step,) + tuple(w0.stride()), w0.storage_offset())


def unalias(parts: dict[str, torch.Tensor], scratch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copy parts that share memory with the input batch (a format returning a view of its input
    would otherwise see its outputs overwritten when the scratch is reused)."""
    ptr = scratch.untyped_storage().data_ptr()
    return {k: (v.clone() if v.untyped_storage().data_ptr() == ptr else v) for k, v in parts.items()}
