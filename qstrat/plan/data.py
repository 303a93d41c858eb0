"""The refit plan's data: every input tensor's decision and outputs, resolved before any quantization.

A :class:`RefitPlan` lists :class:`PlanEntry` items (inputs in wire order). The WIRE ORDER -
the order in which outputs are emitted - is derived from metadata alone (:data:`WIRE_ORDERS`):

- ``natural`` (default): model order - embeddings, then decoder layers by index, then the rest
  (final norm, lm_head, blocks outside the decoder) - and, inside each of these sections, the
  natural order of output checkpoint names (digit runs compare as numbers: ``layers.2`` before
  ``layers.10``). The same model gives the same wire order whether the trainer hands over grouped
  slabs or per-expert tensors, in any input order; a layer-by-layer stream is emitted with a
  window of about one layer.
- ``producer``: inputs in the order the trainer produced them (the order of the spec list or
  mapping the plan was made from), each input's outputs in natural name order. Nothing waits
  for a later input (except members of an engine-fused group whose format shares state across
  the group): what a sender with no names on the wire needs, where the exporter's order IS the
  wire order.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from qstrat.config.rules import PASSTHROUGH
from qstrat.serializers.base import tensor_nbytes

__all__ = ["PASSTHROUGH", "WIRE_ORDERS", "OutputTensor", "PlanEntry", "RefitPlan", "natural_key",
           "natural_keys", "order_entries", "section_key"]

#: Wire orders a plan can have (see the module docstring).
WIRE_ORDERS = ("natural", "producer")


@dataclass(slots=True)
class OutputTensor:
    """One checkpoint tensor the engine receives (a value: read it, do not assign its fields).

    Attributes:
        name: checkpoint name, e.g. ``model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv``.
        shape, dtype, nbytes: as emitted (dtype as a torch dtype name, bytes exact).
        suffix: serializer part it comes from; ``expert`` / ``row_part`` / ``row_parts``: how it
            is cut out of a grouped slab (None for whole tensors).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    suffix: str = "weight"
    expert: int | None = None
    row_part: int | None = None
    row_parts: int = 1


@dataclass(slots=True)
class PlanEntry:
    """The decision for one input tensor (a value: read it, do not assign its fields; a plan's
    entries are shared by every refit its driver reuses it for, :class:`qstrat.execute.driver.PlanCache`).

    Attributes:
        name, shape, dtype: the trainer's tensor.
        kind, layer, expert: from the layout's name parser.
        rule: what decided (``rules[0]``, ``keep_bf16.first``, ``default``, ``never quantized: router``).
        serializer: registered format name, or ``passthrough`` (sent unchanged).
        options: serializer options.
        outputs: checkpoint tensors emitted, in wire order.
        group: fusion-group key when the engine fuses this tensor with siblings.
        note: e.g. the reason of a BF16 fallback.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    layer: int | None
    expert: int | None
    rule: str
    serializer: str
    options: dict[str, Any]
    outputs: tuple[OutputTensor, ...]
    group: str | None = None
    note: str = ""
    engine_module: str = ""

    @property
    def nbytes_out(self) -> int:
        """Bytes emitted for this input."""
        return sum(o.nbytes for o in self.outputs)


@dataclass(repr=False)
class RefitPlan:
    """A validated plan. Build it with :meth:`qstrat.RefitDriver.plan`.

    Printed (``repr``/``str``) as one line of totals (:meth:`summary`); every entry:
    ``plan.to_json()`` or ``plan.entries``.

    Attributes:
        entries: one per input, in wire order.
        layout: model layout name; num_layers: decoder depth used for keep_bf16.
        ignored_layers: vLLM module prefixes left unquantized (routers included).
        quantization_config: the engine's quantization_config, or None for a BF16 plan.
        order: the wire order, one of :data:`WIRE_ORDERS`.
        rank: for a per-rank plan (:func:`qstrat.execute.sharding.split_plan`), the rank that emits
            these entries; None for a whole plan.
        elsewhere: for a part of a plan (:meth:`subset`), input name -> the rank emitting it
            (None: not emitted by this refit): inputs it may be given (a replicated tensor, the
            whole model's stream) but drops.
        engine_quantization: for a plan quantized in the engine (``quantize_in: engine``), the
            ``quantization_config`` of vLLM's online quantization the engine must run (its
            ``linear`` / ``moe`` methods and ``ignore`` list, :mod:`qstrat.vllm.online`); the entries
            are then all sent unquantized. None: quantized by qstrat (or not at all).
    """

    entries: list[PlanEntry]
    layout: str
    num_layers: int | None
    ignored_layers: list[str]
    quantization_config: dict[str, Any] | None
    config: dict[str, Any] = field(default_factory=dict)
    order: str = "natural"
    rank: int | None = None
    elsewhere: dict[str, int | None] = field(default_factory=dict)
    engine_quantization: dict[str, Any] | None = None

    def summary(self) -> str:
        """One line: layout, depth, inputs -> output tensors, per format (inputs -> tensors),
        e.g. ``layout qwen3_moe, 4 decoder layers, 47 inputs -> 247 tensors (passthrough 23 ->
        23, block_fp8 24 -> 224)``; a per-rank plan adds its rank."""
        totals = self.totals()
        outputs = sum(t["outputs"] for t in totals.values())
        formats = ", ".join(f"{name} {t['tensors']} -> {t['outputs']}" for name, t in totals.items())
        layers = "" if self.num_layers is None else f", {self.num_layers} decoder layers"
        rank = "" if self.rank is None else f", rank {self.rank}"
        return (f"layout {self.layout}{layers}{rank}, {len(self.entries)} inputs -> {outputs} tensors"
                f" ({formats})")

    def __repr__(self) -> str:
        return f"RefitPlan({self.summary()})"

    def vllm_quantization_config(self) -> dict[str, Any] | None:
        """The exact ``quantization_config`` for the engine's config.json (None: unquantized)."""
        return None if self.quantization_config is None else dict(self.quantization_config)

    def outputs(self) -> list[OutputTensor]:
        """Every emitted tensor, in wire order."""
        return [o for _, o in self.wire_order()]

    def wire_order(self) -> list[tuple[int, OutputTensor]]:
        """(entry index, output) pairs in wire order (:attr:`order`; see the module docstring)."""
        with gc_paused():
            pairs = [(i, o) for i, e in enumerate(self.entries) for o in e.outputs]
            if self.order == "producer":
                return sorted(pairs, key=lambda p: (p[0], natural_key(p[1].name)))
            # by natural name, then (a stable sort) by section: the order of the key (section, name)
            keys = natural_keys([o.name for _, o in pairs])
            pairs = [pairs[k] for k in sorted(range(len(pairs)), key=keys.__getitem__)]
            sections = [section_key(e) for e in self.entries]
            pairs.sort(key=lambda p: sections[p[0]])
            return pairs

    def subset(self, keep: Callable[[PlanEntry], bool], rank: int | None = None,
               others: Callable[[PlanEntry], int | None] = lambda e: None) -> RefitPlan:
        """The plan of the entries ``keep`` selects, in this plan's wire order; the others go to
        :attr:`elsewhere` (``others(entry)``: the rank that emits them, None: nobody). The
        engine's ``quantization_config`` and ignore list stay those of the whole plan."""
        kept = [e for e in self.entries if keep(e)]
        names = {e.name for e in kept}
        elsewhere = {**self.elsewhere, **{e.name: others(e) for e in self.entries if e.name not in names}}
        return RefitPlan(kept, self.layout, self.num_layers, list(self.ignored_layers),
                         self.vllm_quantization_config(), dict(self.config), order=self.order,
                         rank=rank, elsewhere=elsewhere, engine_quantization=self.engine_quantization)

    def only_layers(self, layers: Iterable[int]) -> RefitPlan:
        """The plan of whole decoder layers ``layers`` (every tensor of each: vLLM's layerwise
        reload processes a layer that receives only part of its tensors with uninitialised memory
        for the rest, and keeps the old weights of a layer that receives nothing). Inputs of
        other layers and outside the decoder may still be given: they are dropped.

        Raises: PlanError naming a layer this plan does not have.
        """
        wanted = set(layers)
        missing = sorted(wanted - {e.layer for e in self.entries if e.layer is not None})
        if missing:
            from qstrat.errors import PlanError

            raise PlanError(f"only_layers: layers {missing} are not in the plan")
        return self.subset(lambda e: e.layer in wanted)

    def totals(self) -> dict[str, dict[str, int]]:
        """Per serializer: ``tensors`` (inputs), ``outputs``, ``bytes_in`` (as given), ``bytes_out``."""
        out: dict[str, dict[str, int]] = {}
        for e in self.entries:
            t = out.setdefault(e.serializer, {"tensors": 0, "outputs": 0, "bytes_in": 0, "bytes_out": 0})
            t["tensors"] += 1
            t["outputs"] += len(e.outputs)
            t["bytes_in"] += tensor_nbytes(e.shape, getattr(torch, e.dtype))
            t["bytes_out"] += e.nbytes_out
        return out

    def to_json(self, indent: int | None = None) -> str:
        """The whole plan as JSON: config, layout, quantization_config, totals, entries."""
        doc = {
            "layout": self.layout,
            "num_layers": self.num_layers,
            "config": self.config,
            "quantization_config": self.quantization_config,
            "ignored_layers": self.ignored_layers,
            "engine_quantization": self.engine_quantization,
            "wire_order": self.order,
            "rank": self.rank,
            "totals": self.totals(),
            "entries": [asdict(e) for e in self.entries],
        }
        return json.dumps(doc, indent=indent)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (restored after, if it was on).

    Planning allocates ~5 long-lived, acyclic objects per tensor (230k for DeepSeek-V3); the
    collector would rescan them again and again, and, re-enabled, scan them all once more at the
    next allocation (docs/performance.md, "Why the code does it this way"). So on exit they are moved to the oldest generation unscanned
    (``gc.freeze()`` then ``gc.unfreeze()``: two list splices), as surviving two young
    collections would have moved them. Other young objects of the process move with them (their
    cycles, if any, are collected at the next full collection instead of a young one). Skipped
    when the process has frozen objects of its own (``gc.get_freeze_count()``: unfreezing would
    release them).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> str:
    """Sort key comparing digit runs as integers: ``layers.2`` < ``layers.10``.

    The order is that of the tuple key ``(text, int, text, int, ...)`` from splitting ``name``
    at digit runs (where one name has a digit run and the other text, the digit run sorts
    first; leading zeros do not count), encoded as one string for speed (sorting 91k outputs
    of a DeepSeek-V3 plan): each digit run becomes ``"\0"``, a length character, the digits
    without leading zeros. Names must not contain ``"\0"``.

    Encoded per dot-separated segment (a digit run never spans a dot, so joining the segments'
    keys with dots gives the whole name's key), each segment's key cached: the names of one
    model repeat a few hundred segments (``layers``, ``17``, ``gate_proj``...).
    """
    return ".".join(map(_segment_key, name.split(".")))


def natural_keys(names: Iterable[str]) -> list[str]:
    """:func:`natural_key` of each name, for sorting many names of one model at once: a name is
    its parent (all but its last two dotted parts: ``model.layers.3.mlp.experts.7``) and its
    tail (``gate_proj.weight``), whose keys are computed once per distinct parent and tail, which
    the names of a plan share (an expert's projections, a weight and its scales; every layer's
    ``gate_proj.weight``); a parent's key is its own parent's key and its last part's (one
    layer's experts share ``model.layers.3.mlp.experts``)."""
    parents: dict[str, str] = {}
    tails: dict[str, str] = {}
    keys = []
    for name in names:
        i = name.rfind(".")
        j = name.rfind(".", 0, i) if i > 0 else -1
        if j < 0:
            keys.append(natural_key(name))
            continue
        parent = name[:j]
        key = parents.get(parent)
        if key is None:
            key = _prefix_key(parent, parents)
        tail = name[j + 1:]
        tail_key = tails.get(tail)
        if tail_key is None:
            tail_key = tails[tail] = natural_key(tail)
        keys.append(key + "." + tail_key)
    return keys


def _prefix_key(prefix: str, memo: dict[str, str]) -> str:
    """:func:`natural_key` of ``prefix``, from the memoized key of its own parent (``memo``: prefix
    -> key, filled in here)."""
    key = memo.get(prefix)
    if key is None:
        k = prefix.rfind(".")
        key = _segment_key(prefix) if k < 0 else _prefix_key(prefix[:k], memo) + "." + _segment_key(prefix[k + 1:])
        memo[prefix] = key
    return key


@functools.lru_cache(maxsize=1 << 16)
def _segment_key(segment: str) -> str:
    return _DIGITS.sub(_encode_digits, segment)


def _encode_digits(m: re.Match[str]) -> str:
    digits = m.group().lstrip("0") or "0"
    return "\0" + chr(0x30 + len(digits)) + digits


def section_key(e: PlanEntry) -> tuple[int, int]:
    """Model section of an input for the ``natural`` wire order: embeddings ``(0, 0)``, decoder
    layer ``i`` (MTP layers stored as ``layers.{i}`` included) ``(1, i)``, the rest ``(2, 0)``."""
    if e.kind == "embedding":
        return (0, 0)
    if e.layer is not None:
        return (1, e.layer)
    return (2, 0)


def order_entries(entries: list[PlanEntry], order: str, names_sorted: bool = False) -> list[PlanEntry]:
    """Entries in wire order: as produced (``producer``) or by (section, natural name) (``natural``).

    Args:
        names_sorted: ``entries`` are in natural name order already (as the planner makes
            them): they are then sorted by section alone, which, the sort being stable, gives
            the same order without recomputing the names' keys.
    Raises: ValueError for an order not in :data:`WIRE_ORDERS`.
    """
    if order not in WIRE_ORDERS:
        raise ValueError(f"wire order {order!r}: expected one of {WIRE_ORDERS}")
    if order == "producer":
        return list(entries)
    if names_sorted:
        return sorted(entries, key=section_key)
    return sorted(entries, key=lambda e: (section_key(e), natural_key(e.name)))
