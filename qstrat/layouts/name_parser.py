"""The name parser: an HF tensor name -> :class:`ParsedName` (kind, layer, expert, projection),
driven by a layout's naming data - never by substrings (``gate`` is a substring of ``gate_proj``).

:func:`parse` is what :meth:`qstrat.layouts.model_layout.ModelLayout.parse` does: the name's checkpoint form
(:func:`checkpoint_name`: wrapper prefixes stripped, the layout's renames applied), then its
place - outside the decoder (embeddings, lm_head, final norm, non-decoder towers, MTP blocks) or
inside decoder layer ``i``, where the layout's :meth:`~qstrat.layouts.model_layout.ModelLayout._in_layer` /
``_in_mlp`` (defaults :func:`in_layer`, :func:`in_mlp`) say what the part after the layer index
is. That answer is the same for every layer, so it is memoized per layout by that part
(:func:`structures`), unless a layout overrides either method.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


#: A :class:`qstrat.layouts.model_layout.ModelLayout` (its naming fields and override points; not imported
#: here: the layouts module imports this one).
ModelLayout = Any

__all__ = ["WRAPPER_MODULES", "WRAPPER_PREFIXES", "ParsedName", "Structure", "checkpoint_name", "in_layer", "in_mlp", "parse",
           "structures"]

#: Prefixes wrappers add to every state-dict key: DDP/FSDP1 ``module.``, ``torch.compile``
#: ``_orig_mod.`` (stripped before parsing; the trainer's key is kept for reading values).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: Module names torch's wrappers insert ANYWHERE in a parameter's name, removed wherever they
#: occur as a dotted component: ``torch.compile`` of a submodule (``OptimizedModule._orig_mod``),
#: FSDP1 (``torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE``, outside
#: ``summon_full_params``) and activation checkpointing
#: (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE``):
#: ``model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.self_attn.q_proj.weight`` is
#: ``model.layers.0.self_attn.q_proj.weight``. (``module.`` is stripped only as a leading prefix.)
WRAPPER_MODULES = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


@dataclass(slots=True)
class ParsedName:
    """What an HF tensor name means, structurally (a value: read it, do not assign its fields; a
    changed one is another parse, ``dataclasses.replace``).

    Attributes:
        name: the full HF name.
        module: the module prefix (name without its parameter suffix; slabs keep their name).
        param: parameter suffix (``weight``, ``bias``...) or the slab name for grouped slabs.
        kind: one of :data:`qstrat.layouts.model_layout.QUANTIZABLE_KINDS` or :data:`qstrat.layouts.model_layout.SPECIAL_KINDS`.
        layer: decoder layer index, or None outside decoder layers.
        expert: routed expert index for per-expert names.
        projection: projection name (``q_proj``, ``gate_proj``, slab name ``gate_up_proj``).
        slab: True for a grouped expert slab ``[E, rows, K]``.
        engine_module: the vLLM module the tensor loads into, for ignore lists (experts of a
            layer are one fused module ``...mlp.experts``); defaults to ``module``.
        checkpoint_name: the name the engine receives (:func:`checkpoint_name`); defaults to
            ``name``. ``module``, ``engine_module`` are in checkpoint form.
    """

    name: str
    module: str
    param: str
    kind: str
    layer: int | None = None
    expert: int | None = None
    projection: str | None = None
    slab: bool = False
    engine_module: str | None = None
    checkpoint_name: str = ""

    def __post_init__(self) -> None:
        if not self.checkpoint_name:
            self.checkpoint_name = self.name

    @property
    def vllm_module(self) -> str:
        """Module prefix as vLLM's ``ignored_layers`` / ``ignore`` lists name it."""
        return self.engine_module or self.module


#: What :func:`in_layer` decides of a name inside a decoder layer: the :class:`ParsedName` fields
#: ``(kind, expert, projection, slab, engine_module)``.
Structure = tuple[str, "int | None", "str | None", bool, "str | None"]
_OTHER: Structure = ("other", None, None, False, None)
#: ``engine_module`` of a routed expert's :data:`Structure`: "the ``{layer}.{block}.{experts}``
#: module of this name", filled in per name by :func:`parse_canonical`.
_EXPERTS_CONTAINER = "<experts container>"
#: Bound on a layout's parse memo (:func:`structures`): distinct in-layer name tails.
_STRUCTURE_CACHE_SIZE = 1 << 16


def checkpoint_name(layout: ModelLayout, name: str) -> str:
    """The checkpoint name vLLM loads for the trainer's key ``name``: wrapper prefixes
    (:data:`WRAPPER_PREFIXES`) stripped and wrapper modules (:data:`WRAPPER_MODULES`) removed
    wherever they occur, then the layout's ``renames`` applied inside decoder layers.
    ``_orig_mod.model.layers.0.mlp.gate.weight`` -> ``model.layers.0.block_sparse_moe.gate.weight``
    (Mixtral). Include/exclude patterns and every name qstrat emits use this form."""
    inner = "_orig_mod" in name or "_wrapped_module" in name
    if not layout.renames and not inner and not name.startswith(WRAPPER_PREFIXES):
        return name  # the common case, nothing to strip or rename
    if inner:
        name = ".".join(t for t in name.split(".") if t not in WRAPPER_MODULES)
    stripped = True
    while stripped:
        stripped = False
        for w in WRAPPER_PREFIXES:
            if name.startswith(w):
                name, stripped = name[len(w):], True
    prefix = layout.layers_prefix + "."
    if layout.renames and name.startswith(prefix):
        rest = "." + name[len(prefix):]
        for old, new in layout.renames:
            rest = rest.replace(old, new, 1)
        name = prefix + rest[1:]
    return name


def parse(layout: ModelLayout, name: str, num_layers: int | None = None) -> ParsedName:
    """Parse a trainer's tensor name with ``layout`` (see :meth:`qstrat.layouts.model_layout.ModelLayout.parse`)."""
    canonical = layout.checkpoint_name(name)
    p = layout._parse_canonical(canonical, num_layers)
    return p if canonical == name else replace(p, name=name, checkpoint_name=canonical)


def parse_canonical(layout: ModelLayout, name: str, num_layers: int | None) -> ParsedName:
    """:func:`parse` of a name already in checkpoint form."""
    module, _, param = name.rpartition(".")
    if not module:  # no dot: the name is the module
        module, param = name, ""
    if name.startswith(layout.non_decoder_prefixes):
        return ParsedName(name, module, param, "non_decoder")
    if name.startswith(layout.mtp_prefixes):
        return ParsedName(name, module, param, "mtp")
    if module in layout.embeddings:
        return ParsedName(name, module, param, "embedding")
    if module in layout.lm_heads:
        return ParsedName(name, module, param, "lm_head")
    if module in layout.final_norms:
        return ParsedName(name, module, param, "norm")
    prefix = layout.layers_prefix + "."
    if not name.startswith(prefix):
        return ParsedName(name, module, param, "other")
    head, _, rest = name[len(prefix):].partition(".")
    if not (head.isascii() and head.isdigit()) or not rest:
        return ParsedName(name, module, param, "other")
    layer = int(head)
    if num_layers is not None and layer >= num_layers:
        return ParsedName(name, module, param, "mtp", layer=layer)
    cache = layout._structures()
    found = cache.get(rest) if cache is not None else None
    if found is None:
        found = layout._in_layer(module, param, rest.split("."))
        if cache is not None:
            if len(cache) >= _STRUCTURE_CACHE_SIZE:
                cache.clear()
            cache[rest] = found
    kind, expert, projection, slab, engine_module = found
    if engine_module is _EXPERTS_CONTAINER:  # the layer's experts module, cut out of this name
        engine_module = module[: module.index("." + layout.experts) + len(layout.experts) + 1]
    return ParsedName(name, module, param, kind, layer, expert, projection, slab, engine_module, name)


def structures(layout: ModelLayout, plain: bool) -> dict[str, Structure] | None:
    """``layout``'s memo of its ``_in_layer`` answers by the name's part after the layer index
    (``mlp.experts.7.gate_proj.weight``: the same for every layer, so DeepSeek-V3's 46k names are
    ~800 parses), or None where ``plain`` is False: the layout's class overrides ``_in_layer`` /
    ``_in_mlp`` (their answer may depend on the layer). The one field that depends on the layer, a routed expert's
    ``engine_module``, is a placeholder in the structure, cut out of each name by
    :func:`parse_canonical`."""
    try:
        return layout.__dict__["_structure_memo"]
    except KeyError:
        pass
    memo: dict[str, Structure] | None = {} if plain else None
    object.__setattr__(layout, "_structure_memo", memo)  # not a field: eq, repr, replace() ignore it
    return memo


def in_layer(layout: ModelLayout, module: str, param: str, tokens: list[str]) -> Structure:
    """What a name inside a decoder layer is (``tokens``: its dotted parts after the layer index)."""
    block = tokens[0]
    if block in layout.mlp_blocks and len(tokens) >= 2:
        return layout._in_mlp(module, tokens[1:])
    if block in layout.attention_blocks and len(tokens) == 3 and param == "weight":
        proj = tokens[1]
        if proj.endswith("norm"):
            return "norm", None, proj, False, None
        if proj in layout.sensitive:
            return "sensitive", None, proj, False, None
        if layout.attention_projections is None or proj in layout.attention_projections:
            return "attention", None, proj, False, None
        return "other", None, proj, False, None
    if block.endswith("norm"):
        return "norm", None, None, False, None
    if layout.attention_projections is not None:  # a family layout: no guessing
        return _OTHER
    if len(tokens) >= 2 and tokens[-2] in layout.routers:
        return "router", None, None, False, None  # a router in a block this layout does not know
    if len(tokens) >= 2 and param == "weight":
        return "linear", None, tokens[-2], False, None
    return _OTHER


def in_mlp(layout: ModelLayout, module: str, t: list[str]) -> Structure:
    """What a name inside a layer's MLP/MoE block is (``t``: its dotted parts after the block)."""
    head = t[0]
    if head == layout.experts and len(t) >= 2:
        # engine_module: the layer's experts container ``...mlp.experts``, which parse_canonical
        # cuts out of the name (the one layer-dependent field: this result is cached per layout)
        if t[1].isascii() and t[1].isdigit() and len(t) == 4 and t[2] in layout.expert_projections:
            return "expert", int(t[1]), t[2], False, _EXPERTS_CONTAINER
        if len(t) == 2 and t[1] in layout.slabs:
            return "expert", None, t[1], True, _EXPERTS_CONTAINER
        if len(t) == 2 and t[1].removesuffix("_bias") in layout.slabs:  # a slab's bias [E, rows] (SlabSpec.biases)
            return "expert", None, t[1].removesuffix("_bias"), False, _EXPERTS_CONTAINER
        return _OTHER
    if head in layout.routers and len(t) == 2:
        return "router", None, None, False, None
    if head in layout.shared_experts and len(t) == 3:
        return "shared_expert", None, t[1], False, None
    if head in layout.sensitive and len(t) == 2:
        return "sensitive", None, head, False, None
    if head in layout.dense_projections and len(t) == 2:
        return "dense_mlp", None, head, False, None
    return _OTHER
