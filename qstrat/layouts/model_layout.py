"""Model layouts: per-model naming data, and the methods a model family may override.

A :class:`ModelLayout` is a naming schema: where decoder layers live, what the MLP/MoE block, the
routers, the experts, their grouped slabs and the engine's fused shards are called. Its methods
are the override points of a family; what each concern's default does lives in its own module:

- the name parser, :mod:`qstrat.layouts.name_parser`: :meth:`ModelLayout.parse` turns an HF tensor name
  into a :class:`ParsedName` (layer index, expert index, kind) from the schema - never from
  substrings (``gate`` is a substring of ``gate_proj``);
- facts read from the model's parsed config (:class:`~qstrat.layouts.model_config.ModelConfig`),
  :mod:`qstrat.layouts.config_facts`: decoder depth, routed experts, MTP layers, the architecture an
  output config.json names (transformers' auto tables);
- the slab policy, :mod:`qstrat.layouts.slabs`: :class:`SlabSpec` and why a slab must stay whole;
- the tensors a config.json implies, :mod:`qstrat.layouts.skeleton` (:class:`~qstrat.layouts.skeleton.LayoutTensors`,
  the Llama-style default every layout inherits).

Layouts are registered as plugins (hook ``qstrat_layouts``); adding a model family is data, plus
an override of a small method where its structure differs (:meth:`ModelLayout.is_moe_layer`,
:meth:`ModelLayout.output_architecture`, :meth:`ModelLayout.output_config`,
:meth:`ModelLayout.whole_slab_reason`, the generator's methods). Each built-in family lives in
one module of :mod:`qstrat.plugins.builtin.layouts`; shared code asks the layout, never its name.

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
from dataclasses import dataclass, field
from typing import Any

from qstrat.layouts import config_facts as layout_config, name_parser
from qstrat.layouts.model_config import ModelConfig
from qstrat.layouts.name_parser import WRAPPER_PREFIXES, ParsedName
from qstrat.layouts.skeleton import LayoutTensors
from qstrat.layouts.slabs import Shape, SlabSpec, whole_slab_reason

__all__ = ["QUANTIZABLE_KINDS", "SPECIAL_KINDS", "WRAPPER_PREFIXES", "ModelLayout", "ParsedName", "SlabSpec",
           "detect_layout"]

#: Kinds that ordinary selectors may quantize. Everything else needs ``allow_special``.
QUANTIZABLE_KINDS = frozenset({"attention", "dense_mlp", "expert", "shared_expert", "linear"})
#: Kinds never quantized unless a rule says so explicitly. ``sensitive``: a projection the
#: family's official quantized checkpoints keep in BF16 (:attr:`ModelLayout.sensitive`).
SPECIAL_KINDS = frozenset({"embedding", "lm_head", "router", "norm", "sensitive", "mtp", "non_decoder",
                           "other"})


@dataclass(frozen=True)
class ModelLayout(LayoutTensors):
    """Naming data of one model family, and the small methods its family may override (see the
    module docstring; the tensor generator's methods: :class:`~qstrat.layouts.skeleton.LayoutTensors`).

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

    Methods read the model's facts from its parsed config (:class:`~qstrat.layouts.model_config.ModelConfig`,
    the language model's keys): :meth:`num_layers`, :meth:`num_experts`, :meth:`num_mtp_layers`,
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

    # ---- facts from the model's config (qstrat.layouts.config_facts) ---------------------------------
    def num_layers(self, config: ModelConfig) -> int | None:
        """Decoder depth from the model's config, or None when the config does not say."""
        return layout_config.num_layers(config, self.num_layers_key)

    def num_experts(self, config: ModelConfig) -> int | None:
        """Routed experts per MoE layer (the first of :attr:`num_experts_keys` set), or None for
        a dense model or a config that does not say."""
        return layout_config.num_experts(config, self.num_experts_keys)

    def num_mtp_layers(self, config: ModelConfig) -> int:
        """Multi-token-prediction layers stored after the decoder layers (DeepSeek-V3: 1)."""
        return layout_config.num_mtp_layers(config, self.mtp_layers_key)

    def is_moe_layer(self, config: ModelConfig, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts: every layer of a model with
        experts (Mixtral, gpt-oss). Families with dense layers override it (DeepSeek's
        ``first_k_dense_replace``, Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``)."""
        return bool(self.num_experts(config))

    # ---- what an output checkpoint's config.json says -----------------------------------------
    def output_architecture(self, config: ModelConfig) -> str | None:
        """The ``architectures`` entry an output config.json gets when ``config`` has none
        (``model.config.to_dict()`` leaves it null; vLLM picks the model class from it):
        :func:`qstrat.layouts.config_facts.architecture_for` - transformers' auto-model table, else this
        layout's architecture when it names exactly one; None when neither says."""
        return layout_config.architecture_for(config, self.architectures)

    def output_config(self, config: ModelConfig) -> ModelConfig:
        """The model config a checkpoint of this family is written with (``write_checkpoint``'s
        config.json): ``config`` as given. A family whose transformers modeling fixes what vLLM
        reads from a config key (with another default) overrides it: it fills in the key
        (:meth:`~qstrat.layouts.model_config.ModelConfig.with_language`), or refuses (QstratError naming
        the key) a value vLLM would read differently from the trainer."""
        return config

    # ---- slab policy (qstrat.layouts.slabs) -----------------------------------------------------------
    def whole_slab_reason(self, projection: str | None, shape: Shape) -> str | None:
        """Why the grouped expert slab ``projection`` (of ``shape``) cannot be cut into
        per-expert matrices, so it is neither quantized nor split over expert-parallel ranks; None
        when it can (:attr:`SlabSpec.splittable`) or ``projection`` is no slab of this layout.
        A family adds what its engine does with such slabs (gpt-oss)."""
        return whole_slab_reason(self.name, self.slabs, projection, shape)

    # ---- the name parser (qstrat.layouts.name_parser) -------------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        """The checkpoint name vLLM loads for the trainer's key ``name``: wrapper prefixes
        (:data:`WRAPPER_PREFIXES`) stripped and wrapper modules (:data:`WRAPPER_MODULES`) removed
        wherever they occur, then :attr:`renames` applied inside decoder layers.
        ``_orig_mod.model.layers.0.mlp.gate.weight`` -> ``model.layers.0.block_sparse_moe.gate.weight``
        (Mixtral). Include/exclude patterns and every name qstrat emits use this form."""
        return name_parser.checkpoint_name(self, name)

    def parse(self, name: str, num_layers: int | None = None) -> ParsedName:
        """Parse a trainer's tensor name (see :meth:`checkpoint_name` for its engine form).

        Args:
            name: e.g. ``model.layers.3.mlp.experts.7.gate_proj.weight`` or the slab
                ``model.layers.3.mlp.experts.gate_up_proj``.
            num_layers: decoder depth; layers at or beyond it are MTP layers (DeepSeek-V3
                stores its MTP block as ``model.layers.61``). None: no MTP detection by index.
        Returns: a :class:`ParsedName` (``name`` as given, ``module`` etc. in checkpoint form).
        """
        return name_parser.parse(self, name, num_layers)

    def _parse_canonical(self, name: str, num_layers: int | None) -> ParsedName:
        return name_parser.parse_canonical(self, name, num_layers)

    def _structures(self) -> dict[str, name_parser.Structure] | None:
        """This layout's parse memo (:func:`qstrat.layouts.name_parser.structures`), or None."""
        cls = type(self)
        return name_parser.structures(self, cls._in_layer is ModelLayout._in_layer
                                      and cls._in_mlp is ModelLayout._in_mlp)

    def _in_layer(self, module: str, param: str, tokens: list[str]) -> name_parser.Structure:
        """What a name inside a decoder layer is (``tokens``: its dotted parts after the layer
        index); an override point (default :func:`qstrat.layouts.name_parser.in_layer`)."""
        return name_parser.in_layer(self, module, param, tokens)

    def _in_mlp(self, module: str, t: list[str]) -> name_parser.Structure:
        """What a name inside a layer's MLP/MoE block is (``t``: its dotted parts after the
        block); an override point (default :func:`qstrat.layouts.name_parser.in_mlp`)."""
        return name_parser.in_mlp(self, module, t)


def detect_layout(layouts: Mapping[str, ModelLayout], model_config: Any) -> ModelLayout:
    """Choose a layout by HF ``architectures`` / ``model_type``, else the generic one.

    Args:
        layouts: registered layouts by name (must include ``generic``).
        model_config: the model's config: a :class:`~qstrat.layouts.model_config.ModelConfig`, or what
            :meth:`~qstrat.layouts.model_config.ModelConfig.of` parses (config.json content, None).
    Raises: ConfigError naming the key for an ``architectures`` that is not a list of class
        names or a ``model_type`` that is not a string (null or absent are fine).
    """
    config = ModelConfig.of(model_config)
    model_type = config.model_type
    archs = set(config.architectures)
    for layout in layouts.values():
        if archs & set(layout.architectures) or (model_type and model_type in layout.model_types):
            return layout
    return layouts["generic"]
