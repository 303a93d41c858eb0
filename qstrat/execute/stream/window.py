"""The inputs of one execution: random access to a mapping, or a stream read in arrival order.

:class:`InputWindow` holds what has arrived and is not yet quantized (``buffered``) and what is
materialized and still needed (``held``); execution releases each input once its entry, and every
fused-group sibling that needs it, is quantized - the window of about one decoder layer
:mod:`qstrat.execute.stream` describes. :func:`input_mismatch` and :func:`check_inputs` compare inputs
with their plan entries (metadata only).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from qstrat.errors import InputMismatchError, PlanError
from qstrat.execute.named_tensors import check_new_name, is_dtensor, materialize
from qstrat.plan.data import PlanEntry, RefitPlan
from qstrat.serializers.base import dtype_name
from qstrat.execute.stream.index import PlanIndex

__all__ = ["InputWindow", "check_inputs", "input_mismatch"]


class InputWindow:
    """The inputs of ``plan``: a mapping (every tensor at hand) or an iterator of ``(name,
    tensor)`` pairs consumed once, in the producer's order.

    Args:
        plan: the plan being executed (its entries and :attr:`~qstrat.plan.data.RefitPlan.elsewhere`).
        inputs: name -> tensor (or lazy handle), or the iterator.
        index: ``plan``'s :class:`~qstrat.execute.stream.index.PlanIndex` (None: built here); the
            other parts of an execution read it here (:attr:`index`).

    A rank's part of a split plan (:func:`qstrat.execute.sharding.split_plan`: its
    :attr:`~qstrat.plan.data.RefitPlan.elsewhere` is not empty) reads a mapping as a stream, in the
    mapping's order, and gathers each DTensor input (FSDP2 / tensor-parallel shards) when it
    ARRIVES, whether this rank emits it or not: ``DTensor.full_tensor()`` is a collective of the
    DTensor's mesh, so every rank must join every gather in one order - the order of its inputs,
    the same on every rank as ``named_parameters()`` of one module gives - not only the rank
    that emits the tensor (an expert-parallel rank 1 that dropped the replicated FSDP2 weights
    left rank 0 waiting in its gather). The gathered copy of a tensor another rank emits is
    dropped at once; one this rank emits waits in :attr:`buffered` until its turn in the wire order.
    """

    def __init__(self, plan: RefitPlan, inputs: Mapping[str, Any] | Iterable[tuple[str, Any]],
                 index: PlanIndex | None = None) -> None:
        self.plan = plan
        self.index = index if index is not None else PlanIndex.of(plan)
        self.entries = self.index.entries
        split = bool(plan.elsewhere)
        self.mapping = inputs if isinstance(inputs, Mapping) and not split else None
        if isinstance(inputs, Mapping) and split:
            inputs = inputs.items()
        self.stream = None if self.mapping is not None else iter(inputs)
        self.buffered: dict[str, Any] = {}   # arrived, not yet read
        self.held: dict[str, torch.Tensor] = {}  # materialized, still needed
        self.seen: set[str] = set()

    def has(self, name: str) -> bool:
        """Whether ``name`` can be read without pulling the stream."""
        return self.mapping is not None or name in self.buffered or name in self.held

    def get(self, name: str) -> torch.Tensor:
        """The materialized value of input ``name`` (pulled from the stream if needed).

        Raises: PlanError if the stream ends before ``name`` arrives, or for an arriving input
            :meth:`pull` refuses.
        """
        if name in self.held:
            return self.held[name]
        if self.mapping is not None:
            raw = self.mapping[name]
        else:
            while name not in self.buffered:
                if self.pull() is None:
                    raise PlanError(f"{name}: planned, but the input stream ended before it arrived")
            raw = self.buffered.pop(name)
        with torch.no_grad():
            t = materialize(raw, name)
        self.held[name] = t
        return t

    def pull(self) -> str | None:
        """Read one pair from the stream and buffer it; its name, or None at the end.

        Raises: PlanError for a name given twice or not in the plan; InputMismatchError (a
            PlanError) for one whose shape or dtype differs from its entry.
        """
        assert self.stream is not None
        item = next(self.stream, None)
        if item is None:
            return None
        name, t = item
        check_new_name(name, self.seen)
        self.seen.add(name)
        gather = bool(self.plan.elsewhere) and is_dtensor(t)  # a collective: joined on arrival
        e = self.entries.get(name)
        if e is None and name not in self.plan.elsewhere:
            raise PlanError(f"{name}: not in the plan (plan from the same names, shapes and dtypes "
                            "the producer yields)")
        problem = input_mismatch(e, t) if e is not None else None
        if gather:  # every rank of the mesh agrees on what it gathers, or all raise the same error
            agree_on_gather(t, name, problem)
        if name in self.plan.elsewhere:
            if gather:
                with torch.no_grad():
                    materialize(t, name)
            return name  # emitted by another rank: dropped
        if problem:
            raise InputMismatchError(problem)
        if gather:
            with torch.no_grad():
                t = materialize(t, name)
        self.buffered[name] = t
        return name

    def release(self, name: str) -> None:
        """Forget input ``name`` (quantized, and no pending group context needs it)."""
        self.held.pop(name, None)

    def drain(self) -> None:
        """Consume the rest of the stream (inputs of other ranks only).

        Raises: PlanError naming inputs that arrived but no entry used.
        """
        if self.stream is not None:
            while self.pull() is not None:
                pass
            if self.buffered:
                raise PlanError(f"inputs arrived but were never used: {sorted(self.buffered)[:5]}")

    def close(self) -> None:
        """Drop every buffered and held input."""
        self.held.clear()
        self.buffered.clear()


def input_mismatch(e: PlanEntry, t: Any) -> str | None:
    """Why input ``t`` cannot be the planned ``e`` (shape or dtype differ), or None. Metadata only."""
    shape, dtype = getattr(t, "shape", None), getattr(t, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        return f"{e.name}: given a {type(t).__name__}, planned as a {e.dtype}{list(e.shape)} tensor"
    if (tuple(shape), dtype_name(dtype)) != (tuple(e.shape), e.dtype):
        return f"{e.name}: arrived as {dtype_name(dtype)}{list(shape)}, planned as {e.dtype}{list(e.shape)}"
    return None


def check_inputs(plan: RefitPlan, tensors: Mapping[str, Any]) -> None:
    """Raise PlanError listing every planned input missing from ``tensors`` or whose shape or dtype
    differs from the plan - what a stream checks as each tensor arrives - before anything is
    emitted (a plan made beforehand, given with a mapping). Reads ``.shape``/``.dtype`` only.
    Inputs the plan does not name are ignored (a partial plan, e.g. ``only_layers``)."""
    errors = []
    for e in plan.entries:
        if e.name not in tensors:
            errors.append(f"{e.name}: planned, but not among the given tensors")
        else:
            problem = input_mismatch(e, tensors[e.name])
            if problem:
                errors.append(problem)
    if errors:
        more = f"\n  ... {len(errors) - 20} more" if len(errors) > 20 else ""
        raise PlanError("the given tensors do not match the given plan:\n  " + "\n  ".join(errors[:20]) + more)


def agree_on_gather(t: Any, name: str, problem: str | None) -> None:
    """Before a split plan's ``DTensor.full_tensor()`` (a collective of ``t``'s device mesh): every
    rank of each mesh dimension's group says which tensor it is about to gather - name, shape,
    dtype - and the problem its plan entry found with it (:func:`input_mismatch`; only the rank
    that emits the tensor has the entry). One ``torch.distributed.all_gather_object`` per mesh
    dimension, of a few hundred bytes.

    Without it, ranks whose inputs arrive in different orders pair different tensors' shards in
    the gather (silently wrong bytes when the shapes agree), and a rank that refuses an input
    leaves the others waiting in the gather until the group's timeout, naming nothing.

    Raises: PlanError on every rank of the mesh when another rank gathers another tensor here
        (naming both); InputMismatchError on every rank when one rank's entry refuses it.
    """
    import torch.distributed as dist

    mine = (name, [int(s) for s in t.shape], dtype_name(t.dtype), problem)
    mesh = t.device_mesh
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        for rank, other in enumerate(everyone):
            if tuple(other[:3]) != tuple(mine[:3]):
                raise PlanError(
                    f"{name} ({mine[2]}{mine[1]}): rank {rank} of its mesh gathers {other[0]} ({other[2]}{other[1]}) "
                    "at this point: a split plan gathers each DTensor input as it arrives, so every rank must "
                    "pass its DTensors in the same order (named_parameters() of one module gives it)")
        refused = next((other[3] for other in everyone if other[3]), None)
        if refused:
            raise InputMismatchError(refused)
