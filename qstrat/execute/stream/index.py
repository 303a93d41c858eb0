"""The lookup tables execution reads, computed from a plan alone.

:class:`PlanIndex` is what :func:`qstrat.execute.stream.execute` needs before its first output besides
the inputs: the wire order, the entries by input name, the expert batches' keys and the fused
groups' members. A driver keeps one with its kept plan (:meth:`qstrat.execute.driver.PlanCache.keep`),
so a refit that reuses the plan does not build them again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qstrat.plan.data import PASSTHROUGH, OutputTensor, PlanEntry, RefitPlan

__all__ = ["PlanIndex", "batch_key"]


@dataclass(frozen=True)
class PlanIndex:
    """Read-only tables of one plan (built by :meth:`of`; never changed after).

    Attributes:
        wire_order: ``(entry index, output)`` pairs, :meth:`RefitPlan.wire_order`.
        entries: input name -> its entry.
        position: input name -> its entry's index in ``plan.entries``.
        batches: expert batch key (:func:`batch_key`) -> expert index ->
            entry index.
        groups: fused group key -> its members' entry indices, in plan order.
    """

    wire_order: list[tuple[int, OutputTensor]]
    entries: dict[str, PlanEntry]
    position: dict[str, int]
    batches: dict[tuple[Any, ...], dict[int, int]]
    groups: dict[str, list[int]]

    @classmethod
    def of(cls, plan: RefitPlan) -> PlanIndex:
        """The tables of ``plan`` (one pass over its entries, plus the wire order's sort)."""
        batches: dict[tuple[Any, ...], dict[int, int]] = {}
        groups: dict[str, list[int]] = {}
        for i, e in enumerate(plan.entries):
            key = batch_key(e)
            if key is not None:
                batches.setdefault(key, {})[e.expert] = i  # type: ignore[index]
            if e.group:
                groups.setdefault(e.group, []).append(i)
        return cls(plan.wire_order(), {e.name: e for e in plan.entries},
                   {e.name: i for i, e in enumerate(plan.entries)}, batches, groups)


def batch_key(e: PlanEntry) -> tuple[Any, ...] | None:
    """What per-expert entries of one batch share (experts module, projection, shape, dtype,
    format and options), or None for an entry that is never batched."""
    if e.serializer == PASSTHROUGH or e.kind != "expert" or e.expert is None:
        return None
    proj = e.name.rsplit(f".{e.expert}.", 1)[-1]  # e.g. gate_proj.weight
    return (e.engine_module, proj, tuple(e.shape), e.dtype, e.serializer, repr(sorted(e.options.items())))
