"""Sharded trainers: which rank emits what, global expert names on expert-parallel ranks.

Three kinds of sharded input, and how qstrat treats each:

- **FSDP2 / tensor-parallel DTensors** (``fully_shard`` parameters, ``distribute_tensor`` with
  ``Shard(d)``): planned from their global ``.shape``, and GATHERED per tensor (a grouped slab is
  one tensor) with ``DTensor.full_tensor()`` when their turn in the wire order comes
  (:func:`qstrat.execute.named_tensors.materialize`). Every rank runs the same plan, so the collectives line
  up; every rank then holds the same outputs (usually one of them sends). Local shards are not
  quantized in place: FSDP2 cuts dim 0 at ``ceil(N / world)`` rows, which cuts 128-row FP8 tiles
  whenever that is not a multiple of 128, and NVFP4's per-tensor scale needs the amax of the
  whole tensor (and of its fused siblings); the engine needs whole tensors anyway. The window
  is one gathered tensor, as in FSDP2's own unshard.
- **Expert-parallel ranks** (:class:`ExpertParallel`): rank ``r`` holds experts ``[a, b)`` of
  every MoE layer under local names; :meth:`ExpertParallel.global_tensors` renames them to
  the global per-expert names. All ranks plan the same whole model (:func:`gather_specs`
  collects every rank's names, shapes and dtypes), :func:`split_plan` gives each rank the entries
  it emits: its experts, and (rank 0) the replicated tensors. Replicated tensors that are
  DTensors (FSDP2 beside expert parallelism) are gathered on EVERY rank as they arrive, since the
  gather is a collective (:class:`qstrat.execute.stream.window.InputWindow`). The union of the per-rank plans
  is the single-process plan, each in the same wire order.
- **Plain tensor-parallel shards** (Megatron-style local tensors without DTensor metadata) are
  not a qstrat input: gather them, or wrap them as DTensors (``DTensor.from_local``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.errors import PlanError
from qstrat.execute.named_tensors import NamedTensors, TensorSpec, tensor_specs
from qstrat.layouts.model_layout import ModelLayout
from qstrat.plan.data import PlanEntry, RefitPlan
from qstrat.serializers.base import dtype_name

__all__ = ["ExpertParallel", "gather_specs", "split_plan"]


@dataclass(frozen=True)
class ExpertParallel:
    """Expert parallelism over ``size`` ranks: rank ``r`` holds the contiguous routed experts
    ``[r * E / size, (r + 1) * E / size)`` of every MoE layer (Megatron-Core's and torchtitan's
    expert-parallel layout), ``E = num_experts``.

    Raises: PlanError if ``size`` is not positive or does not divide ``num_experts``.
    """

    size: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.size <= 0 or self.num_experts <= 0 or self.num_experts % self.size:
            raise PlanError(f"expert parallelism: {self.num_experts} experts do not split evenly over "
                            f"{self.size} ranks")

    @property
    def local_experts(self) -> int:
        """Experts per rank."""
        return self.num_experts // self.size

    def experts(self, rank: int) -> range:
        """Global expert indices held by ``rank``."""
        n = self.local_experts
        return range(rank * n, (rank + 1) * n)

    def owner(self, e: PlanEntry) -> int:
        """The rank that emits entry ``e``: the holder of its expert; rank 0 for everything else
        (attention, norms, routers, embeddings: replicated across expert-parallel ranks).

        Raises: PlanError for a grouped slab (all experts of a layer in one tensor: plan the
            per-expert names :meth:`global_tensors` gives).
        """
        if e.kind == "expert" and e.expert is None and len(e.shape) == 3:
            raise PlanError(f"{e.name}: a grouped slab holds every expert and cannot be split over "
                            f"{self.size} expert-parallel ranks; plan the per-expert names "
                            "(ExpertParallel.global_tensors)")
        if e.kind == "expert" and e.expert is not None:
            if not 0 <= e.expert < self.num_experts:
                raise PlanError(f"{e.name}: expert {e.expert} is outside 0..{self.num_experts - 1}")
            return e.expert // self.local_experts
        return 0

    def global_tensors(self, rank: int, named_tensors: NamedTensors,
                       layout: ModelLayout) -> Iterator[tuple[str, Any]]:
        """``rank``'s tensors under global names, in the producer's order (lazy: a generator).

        Local per-expert names ``...experts.{i}.{proj}.weight`` become ``...experts.{a + i}...``;
        a local grouped slab ``...experts.{slab}`` ``[b - a, rows, K]`` becomes per-expert views
        (no copy) ``...experts.{a + i}.{part}.weight``, rows split into the slab's projections
        (``gate_up_proj`` = gate rows, then up rows). Other names pass unchanged.

        Raises: PlanError for a local expert index or slab size that does not fit the rank's
            ``local_experts``.
        """
        first = self.experts(rank).start
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        for name, t in items:
            p = layout.parse(name)
            if p.kind != "expert":
                yield name, t
            elif p.expert is not None:
                if p.expert >= self.local_experts:
                    raise PlanError(f"{name}: local expert {p.expert}, but rank {rank} holds "
                                    f"{self.local_experts} experts")
                yield f"{p.engine_module}.{first + p.expert}.{name[len(p.engine_module) + 1:].partition('.')[2]}", t
            elif p.slab:
                whole = layout.whole_slab_reason(p.projection, tuple(t.shape))
                if whole:
                    raise PlanError(f"{name}: {whole}; they cannot be cut into per-expert shards")
                if t.shape[0] != self.local_experts:
                    raise PlanError(f"{name}: local slab holds {t.shape[0]} experts, rank {rank} "
                                    f"holds {self.local_experts}")
                parts = layout.slabs[p.projection].parts
                rows = t.shape[1] // len(parts)
                for i in range(self.local_experts):
                    for j, proj in enumerate(parts):
                        yield f"{p.engine_module}.{first + i}.{proj}.weight", t[i, j * rows:(j + 1) * rows]
            else:
                yield name, t


def split_plan(plan: RefitPlan, owner: Callable[[PlanEntry], int], size: int) -> list[RefitPlan]:
    """One plan per rank: rank ``r`` emits the entries ``owner(entry) == r``, in the whole plan's
    wire order; the other entries are in its :attr:`RefitPlan.elsewhere` (inputs it may be
    given - replicated tensors - and drops). The engine's ``quantization_config`` and ignore
    list stay those of the whole model.

    Raises: PlanError from ``owner``, or naming an entry it assigns outside ``0..size-1``.
    """
    owners = {e.name: owner(e) for e in plan.entries}
    bad = [n for n, r in owners.items() if not 0 <= r < size]
    if bad:
        raise PlanError(f"{bad[0]}: assigned to rank {owners[bad[0]]}, outside 0..{size - 1}")
    return [plan.subset(lambda e, r=r: owners[e.name] == r, rank=r, others=lambda e: owners[e.name])
            for r in range(size)]


def gather_specs(named_tensors: NamedTensors, group: Any = None) -> dict[str, TensorSpec]:
    """Every rank's input specs, united: what each rank plans the whole model from.

    Collective (``torch.distributed.all_gather_object`` over ``group``; every rank calls it).
    Only names, shapes and dtypes travel. Order: rank 0's inputs in its order, then each further
    rank's new names in its order. A name held by several ranks (a replicated tensor) must have
    the same shape and dtype everywhere.

    Raises: PlanError naming a tensor whose spec differs between ranks.
    """
    import torch.distributed as dist

    mine = [(n, tuple(s.shape), dtype_name(s.dtype)) for n, s in tensor_specs(named_tensors).items()]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    union: dict[str, TensorSpec] = {}
    for rank, specs in enumerate(everyone):
        for name, shape, dtype in specs:
            spec = TensorSpec(shape, getattr(torch, dtype))
            if name in union and union[name] != spec:
                raise PlanError(f"{name}: rank {rank} holds {dtype}{list(shape)}, an earlier rank "
                                f"{dtype_name(union[name].dtype)}{list(union[name].shape)}")
            union.setdefault(name, spec)
    return union
