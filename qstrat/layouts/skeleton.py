"""The tensors a model's HF ``config.json`` implies (names and shapes, no weights): the default,
Llama-style generator every :class:`~qstrat.layouts.model_layout.ModelLayout` inherits, and
:func:`model_tensors`, the one entry point.

Used by ``qstrat plan`` on a config-only directory (DeepSeek-V3- or Qwen3-235B-shaped), by the
engine manifest and by tests. Names follow the layout (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``);
shapes follow HF's modeling code: linear weights are [out_features, in_features].

The generator is a chain of small methods a family layout overrides where its structure differs
(its home is its layout module in :mod:`qstrat.plugins.builtin.layouts`, or a plugin's):

- :meth:`LayoutTensors.tensors`: embeddings, decoder layers, MTP layers, final norm, ``lm_head``;
- :meth:`~LayoutTensors.layer_tensors`: the two norms, :meth:`~LayoutTensors.attention_tensors`
  (q/k/v/o with HF's ``attention_bias`` / ``qkv_bias``), :meth:`~LayoutTensors.mlp_tensors`
  (a dense MLP, or :meth:`~LayoutTensors.router_tensors`, :meth:`~LayoutTensors.expert_tensors`
  from the layout's :class:`~qstrat.layouts.model_layout.SlabSpec` data, :meth:`~LayoutTensors.shared_expert_tensors`);
- :meth:`~LayoutTensors.mtp_layer_tensors`: a decoder layer stored past ``num_hidden_layers``;
- :meth:`~LayoutTensors.config_only_refusals`: structures the layout does not generate.

With ``grouped=True`` the built-in layouts' names and shapes equal the transformers 5.x class's
``state_dict()`` (in checkpoint names), MTP layers aside (tests/test_model_families.py,
tests/test_layout_tensors.py). Families whose structure no layout generates (hybrid linear
attention, vision towers, the ``generic`` layout) are refused with a
:class:`~qstrat.errors.ConfigOnlyUnsupportedError`: plan their trainer's ``state_dict()`` (a
``meta`` copy is enough).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from qstrat.errors import ConfigOnlyUnsupportedError
from qstrat.layouts.model_config import ModelConfig, bounded

Shape = tuple[int, ...]
#: ``(checkpoint name, shape)`` pairs, in the order a model's ``state_dict()`` lists them.
Tensors = Iterator[tuple[str, Shape]]


class LayoutTensors:
    """The default (Llama-style) tensors of a decoder LM, read from a layout's naming data.

    A mixin of :class:`~qstrat.layouts.model_layout.ModelLayout` (it reads ``self.embeddings``,
    ``self.layers_prefix``, ``self.slabs`` ...). ``p`` arguments are dotted name prefixes
    (``model.layers.3.self_attn``), ``c`` the model's parsed config
    (:class:`~qstrat.layouts.model_config.ModelConfig`: the language model's keys, ``text_config`` of a
    multimodal one). Every method yields ``(name, shape)`` pairs; a missing config key raises
    KeyError naming it.
    """

    def tensors(self, c: ModelConfig, grouped: bool = False) -> Tensors:
        """Every tensor of the model ``c`` describes (see :func:`model_tensors`)."""
        reasons = self.config_only_refusals(c, grouped)
        if reasons:
            raise ConfigOnlyUnsupportedError(
                f"layout {self.name!r}: config-only planning does not generate {' and '.join(reasons)}; "
                "plan the trainer's state_dict() instead (a copy on the meta device is enough: "
                "transformers' class built under torch.device('meta'))")
        h, vocab = c.hidden_size, c.vocab_size
        n_layers = int(c.required(self.num_layers_key))
        yield f"{self.embeddings[0]}.weight", (vocab, h)
        for i in range(n_layers):
            yield from self.layer_tensors(f"{self.layers_prefix}.{i}", c, i, grouped)
        for i in range(n_layers, n_layers + self.num_mtp_layers(c)):
            yield from self.mtp_layer_tensors(f"{self.layers_prefix}.{i}", c, i, grouped)
        yield f"{self.final_norms[0]}.weight", (h,)
        if not c.tie_word_embeddings:
            yield f"{self.lm_heads[0]}.weight", (vocab, h)

    def config_only_refusals(self, c: ModelConfig, grouped: bool = False) -> list[str]:
        """What this generator would get wrong for ``c`` (empty: nothing): hybrid
        linear-attention layers (``layer_types`` or a ``linear_attn`` block), a vision tower
        (``vision_config``); without ``grouped``, per-expert names of experts that exist only as
        whole slabs (a slab that is not :attr:`~qstrat.layouts.model_layout.SlabSpec.splittable`: gpt-oss).
        A layout that generates them overrides this and the methods."""
        reasons = []
        if not grouped and any(not spec.splittable for spec in self.slabs.values()):
            reasons.append("per-expert names for experts that exist only as whole transposed slabs (plan "
                           "them grouped: --grouped, grouped=True)")
        if "linear_attention" in c.layer_types or "linear_attn" in self.attention_blocks:
            reasons.append("hybrid linear-attention layers")
        if c.vision:
            reasons.append("a vision tower")
        return reasons

    def layer_tensors(self, p: str, c: ModelConfig, i: int, grouped: bool) -> Tensors:
        """Decoder layer ``i``: ``input_layernorm`` and ``post_attention_layernorm`` [H], the
        attention block, the MLP block."""
        h = c.hidden_size
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield from self.attention_tensors(f"{p}.{self.attention_blocks[0]}", c)
        yield from self.mlp_tensors(f"{p}.{self.mlp_blocks[0]}", c, i, grouped)

    def mtp_layer_tensors(self, p: str, c: ModelConfig, i: int, grouped: bool) -> Tensors:
        """A multi-token-prediction layer stored as decoder layer ``i >= num_hidden_layers``
        (:attr:`~qstrat.layouts.model_layout.ModelLayout.mtp_layers_key`): by default a plain decoder layer;
        DeepSeek-V3's block overrides it (:mod:`qstrat.plugins.builtin.layouts.deepseek`)."""
        yield from self.layer_tensors(p, c, i, grouped)

    @staticmethod
    def head_dim(c: ModelConfig) -> int:
        """Attention head size: ``head_dim``, else ``hidden_size // num_attention_heads`` (HF)."""
        return c.head_dim or c.hidden_size // c.num_attention_heads

    def attention_tensors(self, p: str, c: ModelConfig) -> Tensors:
        """Softmax attention (``LlamaAttention``): q [heads*d, H], k/v [kv_heads*d, H],
        o [H, heads*d]; biases as HF builds them: ``attention_bias`` on q/k/v/o, ``qkv_bias``
        on q/k/v."""
        h, heads, d = c.hidden_size, c.num_attention_heads, self.head_dim(c)
        kv = c.num_key_value_heads or heads
        yield f"{p}.q_proj.weight", (heads * d, h)
        yield f"{p}.k_proj.weight", (kv * d, h)
        yield f"{p}.v_proj.weight", (kv * d, h)
        yield f"{p}.o_proj.weight", (h, heads * d)
        if c.attention_bias or c.qkv_bias:
            yield f"{p}.q_proj.bias", (heads * d,)
            yield f"{p}.k_proj.bias", (kv * d,)
            yield f"{p}.v_proj.bias", (kv * d,)
        if c.attention_bias:
            yield f"{p}.o_proj.bias", (h,)

    def mlp_tensors(self, p: str, c: ModelConfig, i: int, grouped: bool) -> Tensors:
        """Layer ``i``'s MLP block: a dense gate/up/down MLP (``intermediate_size``) unless
        :meth:`~qstrat.layouts.model_layout.ModelLayout.is_moe_layer`; else the router, the routed experts
        (``moe_intermediate_size``, else ``intermediate_size``) and the shared experts."""
        h = c.hidden_size
        if not self.is_moe_layer(c, i):
            gate, up, down = self.dense_projections
            inter = c.intermediate_size
            yield f"{p}.{gate}.weight", (inter, h)
            yield f"{p}.{up}.weight", (inter, h)
            yield f"{p}.{down}.weight", (h, inter)
            return
        n = self.num_experts(c)
        inter = c.moe_intermediate_size or c.intermediate_size
        yield from self.router_tensors(f"{p}.{self.routers[0]}", c, n)
        yield from self.expert_tensors(f"{p}.{self.experts}", c, n, inter, grouped)
        yield from self.shared_expert_tensors(p, c, inter)

    def router_tensors(self, p: str, c: ModelConfig, n: int) -> Tensors:
        """The router linear ``{p}.weight`` [E, H] (no bias)."""
        yield f"{p}.weight", (n, c.hidden_size)

    def expert_tensors(self, p: str, c: ModelConfig, n: int, inter: int, grouped: bool) -> Tensors:
        """``n`` routed experts of intermediate size ``inter`` under the experts container ``p``.

        Per expert (``grouped=False``, the checkpoint form vLLM loads): ``{p}.{e}.{gate,up}.weight``
        [I, H], ``{p}.{e}.{down}.weight`` [H, I] (:attr:`expert_projections`). Grouped: the
        layout's slabs whose parts are (gate, up) and (down,), shaped by their
        :class:`~qstrat.layouts.model_layout.SlabSpec` (``[E, 2I, H]`` and ``[E, H, I]``; transposed
        ``[E, H, 2I]`` / ``[E, I, H]``) with their ``*_bias`` [E, rows] when the spec has biases.
        Slabs that cannot be split have no per-expert form (:meth:`config_only_refusals`).
        """
        h = c.hidden_size
        gate, up, down = self.expert_projections
        gate_up = next((k, s) for k, s in self.slabs.items() if s.parts == (gate, up))
        down_slab = next((k, s) for k, s in self.slabs.items() if s.parts == (down,))
        if grouped:
            for (slab, spec), rows, k in ((gate_up, inter, h), (down_slab, h, inter)):
                yield f"{p}.{slab}", spec.shape(n, rows, k)
                if spec.biases:
                    yield f"{p}.{slab}_bias", (n, len(spec.parts) * rows)
            return
        for e in range(n):
            yield f"{p}.{e}.{gate}.weight", (inter, h)
            yield f"{p}.{e}.{up}.weight", (inter, h)
            yield f"{p}.{e}.{down}.weight", (h, inter)

    def shared_expert_tensors(self, p: str, c: ModelConfig, inter: int) -> Tensors:
        """Always-active shared experts of the MoE block ``p``: DeepSeek's ``n_shared_experts`` x
        ``inter`` wide, or Qwen's ``shared_expert_intermediate_size`` (with its
        ``shared_expert_gate`` [1, H]); nothing when the layout names no shared experts."""
        h = c.hidden_size
        shared = c.n_shared_experts * inter or c.shared_expert_intermediate_size
        if not (shared and self.shared_experts):
            return
        q = f"{p}.{self.shared_experts[0]}"
        yield f"{q}.gate_proj.weight", (shared, h)
        yield f"{q}.up_proj.weight", (shared, h)
        yield f"{q}.down_proj.weight", (h, shared)
        if c.shared_expert_intermediate_size:
            yield f"{p}.shared_expert_gate.weight", (1, h)


def model_tensors(layout: LayoutTensors, config: Any, grouped: bool = False) -> Tensors:
    """Yield ``(hf_name, shape)`` for every tensor of the model described by ``config``:
    ``layout.tensors(config, grouped)`` (the layout's own generator, the default above unless
    its family overrides it).

    Args:
        layout: the model family's :class:`~qstrat.layouts.model_layout.ModelLayout`.
        config: the model's :class:`~qstrat.layouts.model_config.ModelConfig`, or config.json content
            (parsed here: :meth:`~qstrat.layouts.model_config.ModelConfig.of`; ``text_config`` is used
            when present).
        grouped: emit routed experts as grouped slabs (``experts.gate_up_proj`` [E, 2I, H] and
            ``experts.down_proj`` [E, H, I], the trainer's in-memory view) instead of per-expert.
    Raises: KeyError naming a config key the model needs but the config lacks; ConfigError
        naming a key whose value is not an integer in range or a ``text_config`` that is not a
        mapping (:func:`qstrat.layouts.model_config.check_model_config`, before any tensor), or a config
        implying more than :data:`qstrat.layouts.model_config.MAX_TENSORS` tensors;
        ConfigOnlyUnsupportedError (a PlanError) for a structure the layout does not generate
        (:meth:`LayoutTensors.config_only_refusals`).
    """
    parsed = ModelConfig.of(config)
    parsed.check(getattr(layout, "num_layers_key", "num_hidden_layers"))
    return bounded(layout.tensors(parsed, grouped), f"layout {getattr(layout, 'name', '?')}")
