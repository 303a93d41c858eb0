"""Model layouts: per-model naming data and the name parser driven by it.

A :class:`ModelLayout` says where decoder layers live, what the MLP/MoE block, the routers, the
experts, their grouped slabs and the engine's fused shards are called. :meth:`ModelLayout.parse`
turns an HF tensor name into a :class:`ParsedName` (layer index, expert index, kind) from that
structure - never from substrings (``gate`` is a substring of ``gate_proj``).
Layouts are registered as plugins (hook ``qstrat_layouts``); adding a model family is data, plus
an override of a small method where its structure differs: the tensors a config.json implies
(:class:`~qstrat.skeleton.LayoutTensors`, the Llama-style default every layout inherits), the
architecture an output config.json names (:meth:`ModelLayout.output_architecture`), which
decoder layers are MoE (:meth:`ModelLayout.is_moe_layer`) and why a grouped slab must stay whole
(:meth:`ModelLayout.whole_slab_reason`). Each built-in family lives in one module of
:mod:`qstrat.builtin.layouts`; shared code asks the layout, never its name.

Names are parsed in CHECKPOINT form, the names vLLM's loader accepts: wrapper prefixes added by
DDP (``module.``) or ``torch.compile`` (``_orig_mod.``) are stripped, the module names FSDP1 and
activation checkpointing insert (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``) are
removed wherever they occur, and a layout's
:attr:`ModelLayout.renames` turn transformers' in-memory names into checkpoint names (Mixtral:
``mlp.`` -> ``block_sparse_moe.``). :attr:`ParsedName.checkpoint_name` is what the engine receives;
:attr:`ParsedName.name` stays the trainer's key.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from qstrat.frozen import fast_builder
from qstrat.skeleton import LayoutTensors, Shape

#: Kinds that ordinary selectors may quantize. Everything else needs ``allow_special``.
QUANTIZABLE_KINDS = frozenset({"attention", "dense_mlp", "expert", "shared_expert", "linear"})
#: Kinds never quantized unless a rule says so explicitly. ``sensitive``: a projection the
#: family's official quantized checkpoints keep in BF16 (:attr:`ModelLayout.sensitive`).
SPECIAL_KINDS = frozenset({"embedding", "lm_head", "router", "norm", "sensitive", "mtp", "non_decoder",
                           "other"})
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


@dataclass(frozen=True)
class SlabSpec:
    """A grouped expert slab ``[E, rows, K]`` and how it splits into per-expert projections.

    ``parts`` are the per-expert projection names stacked along dim 1 in order (``rows`` split:
    gate rows first, then up, as transformers v5 ``Qwen3MoeExperts.gate_up_proj`` holds them;
    see docs/concepts.md).

    ``transposed_interleaved``: the slab is ``[E, K, 2*N]`` with gate and up interleaved along
    the last dim (gpt-oss: transformers ``GptOssExperts.gate_up_proj`` [E, H, 2I], gate =
    ``[..., ::2]``, up = ``[..., 1::2]``). It cannot be cut into per-expert ``[N, K]`` rows, and
    vLLM's ``GptOssForCausalLM`` loads such experts only unquantized (slab name ``gate_up_proj``)
    or as its own MXFP4 ``*_blocks``/``*_scales``: qstrat sends it whole, unchanged, and refuses
    to quantize it (:class:`~qstrat.errors.PlanError`).

    ``biases``: the slab has a ``{slab}_bias`` [E, parts * rows] beside it (gpt-oss).
    """

    parts: tuple[str, ...]
    transposed_interleaved: bool = False
    biases: bool = False

    @property
    def splittable(self) -> bool:
        """Whether the slab can be cut into per-expert ``[rows, K]`` matrices (and quantized)."""
        return not self.transposed_interleaved

    def shape(self, experts: int, rows: int, k: int) -> Shape:
        """The slab's shape for ``experts`` experts whose parts are each ``[rows, k]`` matrices
        (out_features, in_features): ``[E, parts * rows, k]``, transposed ``[E, k, parts * rows]``."""
        n = len(self.parts) * rows
        return (experts, k, n) if self.transposed_interleaved else (experts, n, k)


@dataclass(frozen=True)
class ModelLayout(LayoutTensors):
    """Naming data of one model family, and the small methods its family may override (see the
    module docstring; the tensor generator's methods: :class:`~qstrat.skeleton.LayoutTensors`).

    Attributes:
        name: registry name (``qwen3_moe``).
        architectures / model_types: HF ``config.json`` values that select this layout.
        layers_prefix: dotted prefix of decoder layers; a layer is ``{layers_prefix}.{i}.``.
        mlp_blocks: names of the MLP/MoE block inside a layer (``mlp``, ``block_sparse_moe``).
        experts: container of routed experts inside the MLP block.
        expert_projections: per-expert projection names (``gate_proj`` ... or ``w1`` ...).
        slabs: grouped slab name -> :class:`SlabSpec` (transformers v5 / Megatron grouped GEMM).
        routers: names of router linears inside the MLP block (never quantized by default).
        shared_experts: container names of always-active shared experts.
        dense_projections: projections of a dense MLP block.
        attention_blocks: attention block names inside a layer (``self_attn``; Qwen3.5 and
            Qwen3-Next also ``linear_attn``, the Gated-DeltaNet block).
        attention_projections: the projections (matrices) an attention block may hold; None
            accepts any name (the generic layout). A matrix in a layer that the layout cannot
            place is kind ``other``, which a plan refuses (see docs/models.md).
        sensitive: projection names kept in BF16 by default (kind ``sensitive``), following the
            family's official quantized checkpoints (Qwen3.5: ``linear_attn.in_proj_a/b``).
        fused: groups of sibling modules the engine fuses into one weight (q/k/v, gate/up);
            they must share a serializer and a group context.
        renames: ``(old, new)`` substrings replaced once, in order, inside a decoder layer's name
            to get the checkpoint name vLLM loads (Mixtral: ``(".mlp.", ".block_sparse_moe.")``,
            undoing transformers 5's in-memory rename).
        embeddings / lm_heads / final_norms: top-level module names outside the decoder.
        non_decoder_prefixes: prefixes of non-decoder towers (vision): kind ``non_decoder``,
            never quantized and listed in the engine's ignore list (vLLM builds a vision tower's
            linears with the model's quantization config).
        mtp_prefixes: prefixes of multi-token-prediction blocks stored apart (Qwen3.5 ``mtp.``):
            kind ``mtp``; vLLM's main model drops them.
        num_layers_key / mtp_layers_key: HF config keys for decoder depth and MTP layer count.
        num_experts_keys: HF config keys that may hold the routed expert count (first set wins).

    Methods read the model's facts from an HF config (``text_config`` of a multimodal config
    first): :meth:`num_layers`, :meth:`num_experts`, :meth:`num_mtp_layers`,
    :meth:`is_moe_layer`, :meth:`output_architecture`; and from the layout's data:
    :meth:`whole_slab_reason`.
    """

    name: str
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    layers_prefix: str = "model.layers"
    mlp_blocks: tuple[str, ...] = ("mlp",)
    experts: str = "experts"
    expert_projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    slabs: Mapping[str, SlabSpec] = field(
        default_factory=lambda: {
            "gate_up_proj": SlabSpec(("gate_proj", "up_proj")),
            "down_proj": SlabSpec(("down_proj",)),
        }
    )
    routers: tuple[str, ...] = ("gate",)
    shared_experts: tuple[str, ...] = ()
    dense_projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    attention_blocks: tuple[str, ...] = ("self_attn",)
    attention_projections: tuple[str, ...] | None = None
    sensitive: tuple[str, ...] = ()
    fused: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    renames: tuple[tuple[str, str], ...] = ()
    embeddings: tuple[str, ...] = ("model.embed_tokens",)
    lm_heads: tuple[str, ...] = ("lm_head",)
    final_norms: tuple[str, ...] = ("model.norm",)
    non_decoder_prefixes: tuple[str, ...] = ("model.visual.", "visual.", "model.vision_tower.",
                                             "vision_tower.")
    mtp_prefixes: tuple[str, ...] = ("mtp.", "model.mtp.")
    num_layers_key: str = "num_hidden_layers"
    mtp_layers_key: str | None = None
    num_experts_keys: tuple[str, ...] = ("num_experts", "n_routed_experts", "num_local_experts")

    @staticmethod
    def text_config(hf_config: Mapping[str, Any] | None) -> Mapping[str, Any]:
        """The language model's config: ``text_config`` of a multimodal config, else the config.
        Raises ConfigError for a ``text_config`` that is not a mapping
        (:func:`qstrat.model_config.language_config`)."""
        from qstrat.model_config import language_config

        return language_config(hf_config)

    def num_layers(self, hf_config: Mapping[str, Any] | None) -> int | None:
        """Decoder depth from an HF config, or None when the config does not say."""
        value = self.text_config(hf_config).get(self.num_layers_key)
        return _config_int(self.num_layers_key, value, minimum=1) if value is not None else None

    def num_experts(self, hf_config: Mapping[str, Any] | None) -> int | None:
        """Routed experts per MoE layer (the first of :attr:`num_experts_keys` set), or None for
        a dense model or a config that does not say."""
        cfg = self.text_config(hf_config)
        key = next((k for k in self.num_experts_keys if cfg.get(k)), None)
        return _config_int(key, cfg[key], minimum=1) if key is not None else None

    def num_mtp_layers(self, hf_config: Mapping[str, Any] | None) -> int:
        """Multi-token-prediction layers stored after the decoder layers (DeepSeek-V3: 1)."""
        if not self.mtp_layers_key:
            return 0
        return int(self.text_config(hf_config).get(self.mtp_layers_key, 0) or 0)

    def is_moe_layer(self, hf_config: Mapping[str, Any] | None, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts: every layer of a model with
        experts (Mixtral, gpt-oss). Families with dense layers override it (DeepSeek's
        ``first_k_dense_replace``, Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``)."""
        return bool(self.num_experts(hf_config))

    def output_architecture(self, hf_config: Mapping[str, Any]) -> str | None:
        """The ``architectures`` entry an output config.json gets when ``hf_config`` has none
        (``model.config.to_dict()`` leaves it null; vLLM picks the model class from it):
        transformers' auto-model table for the config's ``model_type``
        (``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` with a ``vision_config``, else
        ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: what ``save_pretrained`` of that auto class
        writes), else this layout's architecture when it names exactly one; None when neither says.
        """
        model_type = hf_config.get("model_type")
        if isinstance(model_type, str):
            try:
                from transformers.models.auto import modeling_auto
            except ImportError:
                modeling_auto = None
            if modeling_auto is not None:
                table = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if hf_config.get("vision_config")
                         else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
                if model_type in table:
                    return table[model_type]
        return self.architectures[0] if len(self.architectures) == 1 else None

    def output_config(self, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """The model config a checkpoint of this family is written with (``write_checkpoint``'s
        config.json): ``hf_config`` as given. A family whose transformers modeling fixes what vLLM
        reads from a config key (with another default) overrides it: it fills in the key, or
        refuses (QstratError naming the key) a value vLLM would read differently from the trainer."""
        return dict(hf_config)

    def whole_slab_reason(self, projection: str | None, shape: Shape) -> str | None:
        """Why the grouped expert slab ``projection`` (of ``shape``) cannot be cut into
        per-expert matrices, so it is neither quantized nor split over expert-parallel ranks; None
        when it can (:attr:`SlabSpec.splittable`) or ``projection`` is no slab of this layout.
        A family adds what its engine does with such slabs (gpt-oss)."""
        spec = self.slabs.get(projection) if projection is not None else None
        if spec is None or spec.splittable:
            return None
        interleaved = ", ".join(f"{slab}: {'/'.join(x.removesuffix('_proj') for x in s.parts)} interleaved "
                                "along the last dim" for slab, s in self.slabs.items() if len(s.parts) > 1)
        return (f"{self.name} stores its experts as transposed {shape} slabs [E, in, out]"
                + (f" ({interleaved})" if interleaved else ""))

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint name vLLM loads for the trainer's key ``name``: wrapper prefixes
        (:data:`WRAPPER_PREFIXES`) stripped and wrapper modules (:data:`WRAPPER_MODULES`) removed
        wherever they occur, then :attr:`renames` applied inside decoder layers.
        ``_orig_mod.model.layers.0.mlp.gate.weight`` -> ``model.layers.0.block_sparse_moe.gate.weight``
        (Mixtral). Include/exclude patterns and every name qstrat emits use this form."""
        inner = "_orig_mod" in name or "_wrapped_module" in name
        if not self.renames and not inner and not name.startswith(WRAPPER_PREFIXES):
            return name  # the common case, nothing to strip or rename
        if inner:
            name = ".".join(t for t in name.split(".") if t not in WRAPPER_MODULES)
        stripped = True
        while stripped:
            stripped = False
            for w in WRAPPER_PREFIXES:
                if name.startswith(w):
                    name, stripped = name[len(w):], True
        prefix = self.layers_prefix + "."
        if self.renames and name.startswith(prefix):
            rest = "." + name[len(prefix):]
            for old, new in self.renames:
                rest = rest.replace(old, new, 1)
            name = prefix + rest[1:]
        return name

    def parse(self, name: str, num_layers: int | None = None) -> ParsedName:
        """Parse a trainer's tensor name (see :meth:`checkpoint_name` for its engine form).

        Args:
            name: e.g. ``model.layers.3.mlp.experts.7.gate_proj.weight`` or the slab
                ``model.layers.3.mlp.experts.gate_up_proj``.
            num_layers: decoder depth; layers at or beyond it are MTP layers (DeepSeek-V3
                stores its MTP block as ``model.layers.61``). None: no MTP detection by index.
        Returns: a :class:`ParsedName` (``name`` as given, ``module`` etc. in checkpoint form).
        """
        canonical = self.checkpoint_name(name)
        p = self._parse_canonical(canonical, num_layers)
        return p if canonical == name else replace(p, name=name, checkpoint_name=canonical)

    def _parse_canonical(self, name: str, num_layers: int | None) -> ParsedName:
        module, _, param = name.rpartition(".")
        if not module:  # no dot: the name is the module
            module, param = name, ""
        if name.startswith(self.non_decoder_prefixes):
            return ParsedName(name, module, param, "non_decoder")
        if name.startswith(self.mtp_prefixes):
            return ParsedName(name, module, param, "mtp")
        if module in self.embeddings:
            return ParsedName(name, module, param, "embedding")
        if module in self.lm_heads:
            return ParsedName(name, module, param, "lm_head")
        if module in self.final_norms:
            return ParsedName(name, module, param, "norm")
        prefix = self.layers_prefix + "."
        if not name.startswith(prefix):
            return ParsedName(name, module, param, "other")
        head, _, rest = name[len(prefix):].partition(".")
        if not (head.isascii() and head.isdigit()) or not rest:
            return ParsedName(name, module, param, "other")
        layer = int(head)
        if num_layers is not None and layer >= num_layers:
            return ParsedName(name, module, param, "mtp", layer=layer)
        cache = self._structures()
        found = cache.get(rest) if cache is not None else None
        if found is None:
            found = self._in_layer(module, param, rest.split("."))
            if cache is not None:
                if len(cache) >= _STRUCTURE_CACHE_SIZE:
                    cache.clear()
                cache[rest] = found
        kind, expert, projection, slab, engine_module = found
        if engine_module is _EXPERTS_CONTAINER:  # the layer's experts module, cut out of this name
            engine_module = module[: module.index("." + self.experts) + len(self.experts) + 1]
        return _parsed_name(name, module, param, kind, layer, expert, projection, slab, engine_module, name)

    def _structures(self) -> dict[str, _Structure] | None:
        """This layout's memo of :meth:`_in_layer` by the name's part after the layer index
        (``mlp.experts.7.gate_proj.weight``: the same for every layer, so DeepSeek-V3's 46k names
        are ~800 parses), or None for a subclass that overrides ``_in_layer`` / ``_in_mlp``
        (their answer may depend on the layer). The one field that depends on the layer, a routed
        expert's ``engine_module``, is :data:`_EXPERTS_CONTAINER` in the structure and cut out of
        each name by :meth:`_parse_canonical`.
        """
        try:
            return self.__dict__["_structure_memo"]
        except KeyError:
            pass
        plain = type(self)._in_layer is ModelLayout._in_layer and type(self)._in_mlp is ModelLayout._in_mlp
        memo: dict[str, _Structure] | None = {} if plain else None
        object.__setattr__(self, "_structure_memo", memo)  # not a field: eq, repr, replace() ignore it
        return memo

    def _in_layer(self, module: str, param: str, tokens: list[str]) -> _Structure:
        """What a name inside a decoder layer is (``tokens``: its dotted parts after the layer index)."""
        block = tokens[0]
        if block in self.mlp_blocks and len(tokens) >= 2:
            return self._in_mlp(module, tokens[1:])
        if block in self.attention_blocks and len(tokens) == 3 and param == "weight":
            proj = tokens[1]
            if proj.endswith("norm"):
                return "norm", None, proj, False, None
            if proj in self.sensitive:
                return "sensitive", None, proj, False, None
            if self.attention_projections is None or proj in self.attention_projections:
                return "attention", None, proj, False, None
            return "other", None, proj, False, None
        if block.endswith("norm"):
            return "norm", None, None, False, None
        if self.attention_projections is not None:  # a family layout: no guessing
            return _OTHER
        if len(tokens) >= 2 and tokens[-2] in self.routers:
            return "router", None, None, False, None  # a router in a block this layout does not know
        if len(tokens) >= 2 and param == "weight":
            return "linear", None, tokens[-2], False, None
        return _OTHER

    def _in_mlp(self, module: str, t: list[str]) -> _Structure:
        """What a name inside a layer's MLP/MoE block is (``t``: its dotted parts after the block)."""
        head = t[0]
        if head == self.experts and len(t) >= 2:
            # engine_module: the layer's experts container ``...mlp.experts``, which _parse_canonical
            # cuts out of the name (the one layer-dependent field: this result is cached per layout)
            if t[1].isascii() and t[1].isdigit() and len(t) == 4 and t[2] in self.expert_projections:
                return "expert", int(t[1]), t[2], False, _EXPERTS_CONTAINER
            if len(t) == 2 and t[1] in self.slabs:
                return "expert", None, t[1], True, _EXPERTS_CONTAINER
            if len(t) == 2 and t[1].removesuffix("_bias") in self.slabs:  # a slab's bias [E, rows] (SlabSpec.biases)
                return "expert", None, t[1].removesuffix("_bias"), False, _EXPERTS_CONTAINER
            return _OTHER
        if head in self.routers and len(t) == 2:
            return "router", None, None, False, None
        if head in self.shared_experts and len(t) == 3:
            return "shared_expert", None, t[1], False, None
        if head in self.sensitive and len(t) == 2:
            return "sensitive", None, head, False, None
        if head in self.dense_projections and len(t) == 2:
            return "dense_mlp", None, head, False, None
        return _OTHER


#: What :meth:`ModelLayout._in_layer` decides of a name inside a decoder layer: the
#: :class:`ParsedName` fields ``(kind, expert, projection, slab, engine_module)``.
_Structure = tuple[str, "int | None", "str | None", bool, "str | None"]
_OTHER: _Structure = ("other", None, None, False, None)
#: ``engine_module`` of a routed expert's :data:`_Structure`: "the ``{layer}.{block}.{experts}``
#: module of this name", filled in per name by :meth:`ModelLayout._parse_canonical`.
_EXPERTS_CONTAINER = "<experts container>"


@dataclass(frozen=True, slots=True)
class ParsedName:
    """What an HF tensor name means, structurally.

    Attributes:
        name: the full HF name.
        module: the module prefix (name without its parameter suffix; slabs keep their name).
        param: parameter suffix (``weight``, ``bias``...) or the slab name for grouped slabs.
        kind: one of :data:`QUANTIZABLE_KINDS` or :data:`SPECIAL_KINDS`.
        layer: decoder layer index, or None outside decoder layers.
        expert: routed expert index for per-expert names.
        projection: projection name (``q_proj``, ``gate_proj``, slab name ``gate_up_proj``).
        slab: True for a grouped expert slab ``[E, rows, K]``.
        engine_module: the vLLM module the tensor loads into, for ignore lists (experts of a
            layer are one fused module ``...mlp.experts``); defaults to ``module``.
        checkpoint_name: the name the engine receives (:meth:`ModelLayout.checkpoint_name`);
            defaults to ``name``. ``module``, ``engine_module`` are in checkpoint form.
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
            object.__setattr__(self, "checkpoint_name", self.name)

    @property
    def vllm_module(self) -> str:
        """Module prefix as vLLM's ``ignored_layers`` / ``ignore`` lists name it."""
        return self.engine_module or self.module


#: :class:`ParsedName` built ~4x faster, same value (:func:`qstrat.frozen.fast_builder`): the parser's
#: per-tensor path (one per input tensor of a plan).
_parsed_name = fast_builder(ParsedName)
#: Bound on a layout's parse memo (:meth:`ModelLayout._structures`): distinct in-layer name tails.
_STRUCTURE_CACHE_SIZE = 1 << 16


def detect_layout(layouts: Mapping[str, ModelLayout], hf_config: Mapping[str, Any] | None) -> ModelLayout:
    """Choose a layout by HF ``architectures`` / ``model_type``, else the generic one.

    Args:
        layouts: registered layouts by name (must include ``generic``).
        hf_config: parsed ``config.json`` or None.
    Raises: ConfigError naming the key for an ``architectures`` that is not a list of class
        names or a ``model_type`` that is not a string (null or absent are fine).
    """
    from qstrat.errors import ConfigError

    cfg = hf_config or {}
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs)):
        raise ConfigError(f"model config: architectures must be a list of class names (strings), got {archs!r}")
    model_type = cfg.get("model_type") or ModelLayout.text_config(cfg).get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"model config: model_type must be a string, got {model_type!r}")
    archs = set(archs or ())
    for layout in layouts.values():
        if archs & set(layout.architectures) or (model_type and model_type in layout.model_types):
            return layout
    return layouts["generic"]


def _config_int(key: str, value: Any, minimum: int) -> int:
    """An HF config's integer ``key``; ConfigError naming it for anything else (``"four"``,
    ``2.5``, ``true``, below ``minimum``, above qstrat's limit for it:
    :data:`qstrat.model_config.INT_KEYS`)."""
    from qstrat.errors import ConfigError
    from qstrat.model_config import INT_KEYS, MAX_LAYERS

    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"model config: {key} must be an integer >= {minimum}, got {value!r}")
    top = INT_KEYS.get(key, (minimum, MAX_LAYERS if key.endswith("layers") else None))[1]
    if top is not None and value > top:
        raise ConfigError(f"model config: {key} must be an integer in {minimum}..{top}, got {value!r} "
                          f"(qstrat's limit: a larger {key} is no real model)")
    return value
