"""Plan entries of a family of names - the same tensor in every decoder layer - derived from one.

``model.layers.{i}.mlp.experts.7.gate_proj.weight`` is planned alike in every layer ``i``: same
parse (but the layer), same rule, format, outputs, group. A model of 61 layers x 256 experts
repeats ~800 such families, so :class:`Families` plans two members of each the full way
(:meth:`qstrat.plan.planner.Planner.entry`) and builds the others from the first by putting
their layer prefix (``model.layers.{i}.``) in place of its own in every name the entry holds -
its own name, output names, fusion group, engine module - and their layer index in ``layer``.
It is how the planner meets the cold-planning target for DeepSeek-V3's 46k tensors (docs/performance.md).

When that gives the very entry the full way would (the invariant):

- the entry depends on the layer only through that prefix, the layer index and ``keep_bf16``:
  the layout parses with :class:`~qstrat.layouts.model_layout.ModelLayout`'s own parser (its structure memo,
  no renames), and every rule is decided by built-in selectors without include/exclude patterns
  (:meth:`qstrat.config.rules.RuleSet.structural`); otherwise :func:`families_for` returns None and
  every tensor is planned the full way;
- the family key holds everything else an entry reads: the name after the layer prefix, shape,
  dtype and whether ``keep_bf16`` keeps the layer (first / last);
- the second member planned the full way must equal the first's derivation (a family whose
  entries differ otherwise - a future field naming the layer in another form - is then planned
  the full way for every member); names whose derivation is not a prefix swap (an output name
  outside the layer) are never derived.

Only successful entries are learned: a tensor whose planning raises is planned the full way
each time, so every error names its own tensor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from qstrat.layouts.model_layout import WRAPPER_PREFIXES, ModelLayout
from qstrat.plan.data import OutputTensor, PlanEntry

if TYPE_CHECKING:
    from qstrat.config.rules import RuleSet


#: A family's key: (name after the layer prefix, shape, dtype, kept by keep_bf16.first, .last).
_Key = tuple[str, tuple[int, ...], torch.dtype, bool, bool]


class _Recipe:
    """A learned family: its first member's entry with the layer prefix taken out of every name.

    ``verified``: the second member, planned the full way, equalled its derivation (until
    then :meth:`Families.entry` derives nothing); ``broken``: it did not, or a name of the first
    member does not start with its layer prefix - never derive.
    """

    __slots__ = ("entry", "outputs", "group", "engine_module", "verified", "broken")

    def __init__(self, entry: PlanEntry, prefix: str) -> None:
        self.entry = entry
        self.verified = False
        n = len(prefix)
        names = [o.name for o in entry.outputs] + [entry.engine_module] + (
            [entry.group] if entry.group is not None else [])
        self.broken = not all(s.startswith(prefix) for s in names)
        # per output: (name after the prefix, the OutputTensor's other fields)
        self.outputs = [(o.name[n:], o.shape, o.dtype, o.nbytes, o.suffix, o.expert, o.row_part, o.row_parts)
                        for o in entry.outputs]
        self.group = None if entry.group is None else entry.group[n:]
        self.engine_module = entry.engine_module[n:]

    def derive(self, name: str, prefix: str, layer: int) -> PlanEntry:
        """The entry of member ``name`` (layer prefix ``prefix``, decoder layer ``layer``)."""
        e = self.entry
        outs = tuple([OutputTensor(prefix + tail, shape, dtype, nbytes, suffix, expert, row_part, row_parts)
                      for tail, shape, dtype, nbytes, suffix, expert, row_part, row_parts in self.outputs])
        return PlanEntry(name, e.shape, e.dtype, e.kind, layer, e.expert, e.rule, e.serializer,
                           dict(e.options) if e.options else {}, outs,
                           None if self.group is None else prefix + self.group, e.note,
                           prefix + self.engine_module)


class Families:
    """The family memo of one plan (see the module docstring). Build with :func:`families_for`.

    Args:
        layers_prefix: the layout's ``layers_prefix`` with its dot (``model.layers.``).
        num_layers: decoder depth (layers at or past it are MTP layers: never derived), or None.
        first, last: the config's ``keep_bf16``.
    """

    def __init__(self, layers_prefix: str, num_layers: int | None, first: int, last: int) -> None:
        self.prefix = layers_prefix
        self.num_layers = num_layers
        self.first = first
        self.last = last
        self.recipes: dict[_Key, _Recipe] = {}
        # layer prefix as written ("model.layers.17.") -> (layer, kept by keep_bf16.first, .last),
        # or None: not a decoder layer (no digits, an MTP layer)
        self.layers: dict[str, tuple[int, bool, bool] | None] = {}

    def key(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[_Key, str, int] | None:
        """``(family key, layer prefix, layer)`` of a decoder-layer tensor, or None (a name
        outside the decoder layers, an MTP layer, a malformed layer index). ``shape``: a tuple
        or a ``torch.Size`` (equal keys)."""
        if not name.startswith(self.prefix):
            return None
        at = len(self.prefix)
        dot = name.find(".", at)
        if dot < 0 or dot == len(name) - 1:
            return None
        prefix = name[:dot + 1]
        try:
            layer = self.layers[prefix]
        except KeyError:
            layer = self.layers[prefix] = self._layer(name[at:dot])
        if layer is None:
            return None
        return (name[dot + 1:], shape, dtype, layer[1], layer[2]), prefix, layer[0]

    def _layer(self, head: str) -> tuple[int, bool, bool] | None:
        """``(layer, kept by keep_bf16.first, .last)`` of a layer index as written, or None."""
        if not (head.isascii() and head.isdigit()):
            return None
        layer = int(head)
        n = self.num_layers
        if n is not None and layer >= n:
            return None
        return layer, layer < self.first, bool(self.last) and n is not None and layer >= n - self.last

    def entry(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> PlanEntry | None:
        """The derived entry of ``name``, or None: plan it the full way, then :meth:`learn`."""
        found = self.key(name, shape, dtype)
        if found is None:
            return None
        recipe = self.recipes.get(found[0])
        if recipe is None or not recipe.verified:
            return None
        return recipe.derive(name, found[1], found[2])

    def learn(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, entry: PlanEntry) -> None:
        """Record ``entry``, planned the full way: the first member of its family becomes the
        family's recipe, the second verifies it."""
        found = self.key(name, shape, dtype)
        if found is None:
            return
        key, prefix, layer = found
        recipe = self.recipes.get(key)
        if recipe is None:
            self.recipes[key] = _Recipe(entry, prefix)
        elif not recipe.verified and not recipe.broken:
            if recipe.derive(name, prefix, layer) == entry:
                recipe.verified = True
            else:
                recipe.broken = True


def families_for(layout: ModelLayout, rules: RuleSet, num_layers: int | None) -> Families | None:
    """A :class:`Families` memo for planning with ``layout`` and ``rules``, or None where a
    derived entry could differ from the full way's (see the module docstring):

    - the layout parses with a subclass's own parser or renames names;
    - a rule's decision may read more than a name's structure (a plugin selector, include or
      exclude patterns: :meth:`~qstrat.config.rules.RuleSet.structural`);
    - a name under the decoder-layer prefix could be taken for something else before its layer
      is read: a wrapper, non-decoder or MTP prefix overlapping the layer prefix, or an
      embedding, lm_head or final norm module inside it.
    """
    base = ModelLayout
    cls = type(layout)
    if (layout.renames or cls.parse is not base.parse or cls._parse_canonical is not base._parse_canonical
            or cls.checkpoint_name is not base.checkpoint_name or layout._structures() is None
            or not rules.structural()):
        return None
    prefix = layout.layers_prefix + "."
    prefixes: tuple[Any, ...] = WRAPPER_PREFIXES + tuple(layout.non_decoder_prefixes) + tuple(layout.mtp_prefixes)
    if any(p.startswith(prefix) or prefix.startswith(p) for p in prefixes):
        return None
    if any(m.startswith(prefix) for m in (*layout.embeddings, *layout.lm_heads, *layout.final_norms)):
        return None
    keep = rules.config.keep_bf16
    return Families(prefix, num_layers, keep.first, keep.last)
