"""Mesh routing: which trainer rank sends which output tensor, and which part of it each engine
rank receives (docs/transport.md, "Mesh round").

Both sides compute the routes from the same two inputs, so neither trusts the other's result:

* the OUTPUTS of the whole plan in wire order, each with its OWNER, the one sender rank that
  quantizes and sends it (:func:`mesh_outputs`, from :func:`qstrat.execute.sharding.split_plan`'s owner:
  the expert-parallel holder of an expert, rank 0 for a replicated tensor);
* every engine rank's :class:`ReceiverLayout`, which that rank reads from its engine and
  publishes itself (:func:`qstrat.transport.mesh.steps.opening`).

An engine rank's SHARE of an output (:func:`share_of`): nothing (an expert it does not hold), the
whole tensor (norms, routers, embeddings and ``lm_head`` - vLLM's vocab-parallel loader narrows
the padded vocabulary itself -, scalars, a dimension that tensor parallelism does not divide),
or one contiguous slice along the dimension vLLM's linear loaders narrow by TP rank:
``ColumnParallelLinear`` (q/k/v, gate/up: output rows, dim 0) and ``RowParallelLinear``
(o_proj, down_proj: input columns, dim 1), ``shard = size // tp_size``, ``start = tp_rank *
shard`` (vLLM ``weight_loader``: ``loaded_weight.narrow(dim, tp_rank * shard_size,
shard_size)``); a weight's scales are narrowed along the same dimension when it divides.
Routed experts follow ``moe_tp``: narrowed like the dense projections (vLLM's FusedMoE under
TP), or whole (expert parallelism: a rank holds whole experts, ``experts`` says which).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.errors import TransportError
from qstrat.plan.engine_shards import KV_HEADS, kv_head_part
from qstrat.transport.wire_manifest import WireManifest, build_wire_manifest

#: Module names whose weights vLLM's ColumnParallelLinear narrows on dim 0 (output rows), and
#: RowParallelLinear on dim 1 (input columns).
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
ROW = ("o_proj", "down_proj", "w2")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")

Output = tuple[str, str, tuple[int, ...], int]  # name, dtype name, shape, owning sender rank


@dataclass(frozen=True)
class ReceiverLayout:
    """What one engine rank loads: its tensor-parallel rank and size, the routed experts it holds
    (None: every expert), whether routed experts are narrowed by TP (``moe_tp``; False under
    expert parallelism, where each rank holds whole experts), and the model's KV heads
    (``kv_heads``, the engine's ``num_key_value_heads``: where ``tp_size`` exceeds it, vLLM
    replicates each KV head and k/v are cut per head, not per rank; None: ``tp_size`` does not
    exceed the KV heads - a layout read from an engine must give it)."""

    tp_rank: int = 0
    tp_size: int = 1
    experts: tuple[int, ...] | None = None
    moe_tp: bool = True
    kv_heads: int | None = None

    def __post_init__(self) -> None:
        ints = {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "kv_heads": self.kv_heads}
        for key, value in ints.items():
            if value is not None and (type(value) is not int or value < 0):
                raise TransportError(f"receiver layout: {key} {value!r} is not a non-negative int")
        if self.kv_heads == 0:  # read as "unknown" below (falsy): an engine has at least one KV head
            raise TransportError("receiver layout: kv_heads 0 is not a positive int (None: not known)")
        if not 0 <= self.tp_rank < self.tp_size:
            raise TransportError(f"receiver layout: tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if type(self.moe_tp) is not bool:
            raise TransportError(f"receiver layout: moe_tp {self.moe_tp!r} is not a bool")
        if self.experts is not None:
            if not isinstance(self.experts, (tuple, list)):
                raise TransportError(f"receiver layout: experts {self.experts!r} must be a sequence of expert "
                                     "indices (None: every expert)")
            if any(type(e) is not int or e < 0 for e in self.experts) or len(set(self.experts)) != len(self.experts):
                raise TransportError(f"receiver layout: experts {self.experts!r} must be distinct non-negative ints")
            if self.moe_tp and self.tp_size > 1:
                raise TransportError("receiver layout: a rank holding a subset of the experts (expert parallelism) "
                                     "holds them whole: set moe_tp=False")
            object.__setattr__(self, "experts", tuple(sorted(self.experts)))
        if self.kv_heads is not None and self.kv_heads and self.tp_size > self.kv_heads and self.tp_size % self.kv_heads:
            raise TransportError(f"receiver layout: tp_size {self.tp_size} is not a multiple of kv_heads "
                                 f"{self.kv_heads} (vLLM replicates each KV head on tp_size / kv_heads ranks)")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what a rank publishes)."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "moe_tp": self.moe_tp,
                "experts": None if self.experts is None else list(self.experts), "kv_heads": self.kv_heads}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ReceiverLayout:
        """Inverse of :meth:`to_dict` (no coercion: a field of another type is refused).
        Raises: TransportError for a malformed document."""
        try:
            ex = doc["experts"]
            return cls(doc["tp_rank"], doc["tp_size"], None if ex is None else tuple(ex), doc["moe_tp"],
                       doc.get("kv_heads"))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"malformed receiver layout {doc!r}: {exc}") from None


@dataclass(frozen=True)
class ShareSlice:
    """One engine rank's part of one output: ``cut(t)`` = ``t.narrow(dim, start, stop - start)``
    (``dim`` None: the whole tensor). ``shape``: the whole tensor's; :attr:`sent`: the part's."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0

    @property
    def sent(self) -> tuple[int, ...]:
        """The shape on the wire."""
        if self.dim is None:
            return self.shape
        return self.shape[:self.dim] + (self.stop - self.start,) + self.shape[self.dim + 1:]

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        """The part of ``t`` (the whole output) this rank receives (a view)."""
        return t if self.dim is None else t.narrow(self.dim, self.start, self.stop - self.start)

    def embed(self, part: torch.Tensor) -> torch.Tensor:
        """What a loader that narrows by TP rank itself expects: a tensor of the whole
        :attr:`shape` holding ``part`` where :meth:`cut` takes it (zeros elsewhere, never read
        by that loader); ``part`` itself when this share is the whole tensor."""
        if self.dim is None:
            return part
        full = torch.zeros(self.shape, dtype=part.dtype, device=part.device)
        self.cut(full).copy_(part)
        return full


def expert_of(name: str) -> int | None:
    """The routed expert index in a per-expert checkpoint name (None: not a routed expert)."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def tp_dim(name: str) -> int | None:
    """The dimension vLLM's linear loader narrows by TP rank for ``name`` (None: loaded whole)."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    return 0 if module in COLUMN else 1 if module in ROW else None


def share_of(name: str, dtype: str, shape: Sequence[int], layout: ReceiverLayout) -> ShareSlice | None:
    """``layout``'s share of output ``name`` (see the module docstring); None: it loads none of it."""
    shape = tuple(int(d) for d in shape)
    expert = expert_of(name)
    if expert is not None and layout.experts is not None and expert not in layout.experts:
        return None
    dim = tp_dim(name)
    narrow = layout.tp_size > 1 and (expert is None or layout.moe_tp)
    parts, part = layout.tp_size, layout.tp_rank
    if kv_projection(name) and layout.kv_heads and layout.tp_size > layout.kv_heads:
        # vLLM's QKVParallelLinear replicates each KV head: cut per head, not per rank
        parts, part = layout.kv_heads, kv_head_part(layout.tp_rank, layout.tp_size, layout.kv_heads)
    if not narrow or dim is None or len(shape) <= dim or len(shape) < 2 or shape[dim] % parts:
        return ShareSlice(name, dtype, shape)
    n = shape[dim] // parts
    return ShareSlice(name, dtype, shape, dim, part * n, (part + 1) * n)


def kv_projection(name: str) -> bool:
    """Whether ``name`` is a k/v projection's tensor (weight or scale), which vLLM replicates per
    KV head when tensor parallelism exceeds the KV heads."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    return module in KV_HEADS


def _output(output: Any) -> Output:
    """One (name, dtype, shape, owner) output, checked. Raises: TransportError naming what is wrong."""
    try:
        name, dtype, shape, owner = output
        dims = tuple(shape)
    except (TypeError, ValueError):
        raise TransportError(f"mesh routes: an output must be (name, dtype, shape, owner), got {output!r}") from None
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise TransportError(f"mesh routes: {name}: shape {list(dims)} must be non-negative ints")
    if isinstance(owner, bool) or not isinstance(owner, int):
        raise TransportError(f"mesh routes: {name}: owner {owner!r} is not a sender rank (an int)")
    return str(name), str(dtype), dims, owner


def mesh_outputs(plan: Any, owner: Any) -> list[Output]:
    """The whole plan's outputs in wire order, each with its owning sender rank
    (``owner(entry)``, e.g. :meth:`qstrat.execute.sharding.ExpertParallel.owner`)."""
    outputs = []
    for i, o in plan.wire_order():
        rank = owner(plan.entries[i])
        if isinstance(rank, bool) or not isinstance(rank, int):  # int(1.7) would route it to rank 1
            raise TransportError(f"mesh outputs: the owner of {o.name} must be a sender rank (an int), got {rank!r}")
        outputs.append((o.name, o.dtype, tuple(o.shape), rank))
    return outputs


class MeshRoutes:
    """The routes of one mesh round: ``senders`` trainer ranks (group ranks ``0..S-1``) and one
    :class:`ReceiverLayout` per engine rank (group ranks ``S..S+R-1``).

    Raises: TransportError for ``senders`` not a positive int, a layout that is no
        :class:`ReceiverLayout`, an output that is not (name, dtype, shape of non-negative ints,
        int owner), an owner outside ``0..senders-1``, a name given twice, or a routed expert
        that no engine rank holds (it would reach no engine).
    """

    def __init__(self, outputs: Iterable[Sequence[Any]], senders: int, layouts: Sequence[ReceiverLayout],
                 bucket_bytes: int, alignment: int) -> None:
        if isinstance(senders, bool) or not isinstance(senders, int) or senders < 1:
            raise TransportError(f"mesh routes: senders must be a positive int (the trainer ranks), got {senders!r}")
        self.outputs = [_output(o) for o in outputs]
        self.senders, self.layouts = senders, list(layouts)
        for r, layout in enumerate(self.layouts):
            if not isinstance(layout, ReceiverLayout):
                raise TransportError(f"mesh routes: engine rank {r}'s layout is a {type(layout).__name__}, "
                                     "not a ReceiverLayout")
        self.bucket_bytes, self.alignment = bucket_bytes, alignment
        names = [o[0] for o in self.outputs]
        bad = [o for o in self.outputs if not 0 <= o[3] < senders]
        if bad or len(set(names)) != len(names):
            why = f"{bad[0][0]} owned by rank {bad[0][3]}" if bad else "a name given twice"
            raise TransportError(f"mesh routes: {why} ({senders} senders)")
        if self.layouts and all(layout.experts is not None for layout in self.layouts):
            held = {e for layout in self.layouts for e in layout.experts or ()}
            orphan = next((n for n, *_ in self.outputs if expert_of(n) is not None and expert_of(n) not in held), None)
            if orphan is not None:
                raise TransportError(f"mesh routes: {orphan}: expert {expert_of(orphan)} is held by no engine rank "
                                     f"(the layouts hold experts {sorted(held)}); it would reach no engine")
        self._pairs: dict[tuple[int, int], list[ShareSlice]] = {}
        self._manifests: dict[tuple[int, int], WireManifest] = {}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able outputs and layout parameters (what the round's ``update_info`` carries;
        the layouts travel in the round itself)."""
        return {"outputs": [[n, d, list(s), o] for n, d, s, o in self.outputs], "senders": self.senders,
                "bucket_bytes": self.bucket_bytes, "alignment": self.alignment}

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of the outputs, owners, layouts and bucket parameters: the round MAC binds it."""
        body = {**self.to_dict(), "layouts": [layout.to_dict() for layout in self.layouts]}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def pair(self, sender: int, receiver: int) -> list[ShareSlice]:
        """What ``sender`` sends to engine rank ``receiver`` (0-based among receivers), in wire order.
        Raises: TransportError for a sender or receiver outside the round."""
        key = (sender, receiver)
        if key not in self._pairs:
            if not 0 <= sender < self.senders or not 0 <= receiver < len(self.layouts):
                raise TransportError(f"mesh routes: no pair (sender {sender}, engine rank {receiver}): the round "
                                     f"has {self.senders} senders and {len(self.layouts)} engine ranks")
            layout = self.layouts[receiver]
            self._pairs[key] = [s for n, d, shape, o in self.outputs if o == sender
                                for s in [share_of(n, d, shape, layout)] if s is not None]
        return self._pairs[key]

    def pair_manifest(self, sender: int, receiver: int) -> WireManifest:
        """The pair's own wire manifest: :func:`build_wire_manifest` over its parts' sent shapes."""
        key = (sender, receiver)
        if key not in self._manifests:
            self._manifests[key] = build_wire_manifest(((s.name, s.dtype, s.sent) for s in self.pair(*key)),
                                                       self.bucket_bytes, self.alignment)
        return self._manifests[key]

    def share(self, receiver: int) -> list[ShareSlice]:
        """Everything engine rank ``receiver`` receives, over all senders, in wire order."""
        by = {s.name: s for k in range(self.senders) for s in self.pair(k, receiver)}
        return [by[n] for n, *_ in self.outputs if n in by]

    def bytes_per_receiver(self) -> list[int]:
        """Payload bytes (alignment padding included) each engine rank receives."""
        return [sum(self.pair_manifest(k, r).total_bytes for k in range(self.senders))
                for r in range(len(self.layouts))]

    def full_bytes(self) -> int:
        """The whole model's payload bytes (what a broadcast gives every rank), unpadded."""
        return sum(torch.Size(s).numel() * getattr(torch, d).itemsize for _, d, s, _ in self.outputs)
