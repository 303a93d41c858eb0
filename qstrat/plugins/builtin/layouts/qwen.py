"""The Qwen families: Qwen2/Qwen3 dense, Qwen2/Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE.

What their structure adds to the default generator (:class:`QwenLayout`), from transformers 5.x's
modeling code: Qwen2's attention has q/k/v biases (``Qwen2Attention``: ``bias=True``; Qwen2-MoE's
``qkv_bias`` defaults to True), Qwen3's has ``q_norm``/``k_norm`` [head_dim]; MoE layers are those
not in ``mlp_only_layers`` and on ``decoder_sparse_step``.
"""
from __future__ import annotations

from dataclasses import replace

from qstrat.plugins.builtin.layouts.common import QKV_GATE_UP, QKVO
from qstrat.layouts.model_layout import ModelLayout
from qstrat.layouts.model_config import ModelConfig, VisionConfig
from qstrat.layouts.skeleton import Tensors

#: Vision-tower keys :meth:`QwenHybridLayout.vision_tensors` does not generate (Qwen3-VL's
#: deepstack mergers): a config that sets them is refused rather than guessed.
_UNGENERATED_VISION_KEYS = ("deepstack_visual_indexes",)


class QwenLayout(ModelLayout):
    """A Qwen layout: the default generator with Qwen's attention and MoE-layer rules. One
    layout serves two generations (``qwen3`` also loads Qwen2 checkpoints), told apart by the
    config's ``model_type``."""

    def attention_tensors(self, p: str, c: ModelConfig) -> Tensors:
        """The default's q/k/v/o, with Qwen2's q/k/v biases unless ``qkv_bias`` says otherwise,
        and Qwen3's ``q_norm``/``k_norm`` [head_dim]."""
        generation = str(c.language_model_type or "")
        if generation.startswith("qwen2") and c.qkv_bias is None:
            c = c.with_language(qkv_bias=True)
        yield from super().attention_tensors(p, c)
        if generation.startswith("qwen3"):
            d = self.head_dim(c)
            yield f"{p}.q_norm.weight", (d,)
            yield f"{p}.k_norm.weight", (d,)

    def is_moe_layer(self, config: ModelConfig, layer: int) -> bool:
        """A model with experts, ``layer`` not in ``mlp_only_layers`` and on
        ``decoder_sparse_step`` (``Qwen3MoeDecoderLayer``)."""
        if not self.num_experts(config):
            return False
        if layer in config.mlp_only_layers:
            return False
        return (layer + 1) % (config.decoder_sparse_step or 1) == 0


class QwenHybridLayout(QwenLayout):
    """Qwen3-Next and Qwen3.5: hybrid Gated-DeltaNet (``linear_attn``) / gated softmax attention
    layers, and Qwen3.5's vision tower. From transformers 5.x ``modeling_qwen3_next.py`` /
    ``modeling_qwen3_5_moe.py`` (``Qwen3NextGatedDeltaNet``, ``Qwen3NextAttention``,
    ``Qwen3_5MoeVisionModel``); held against the classes' ``state_dict()`` in
    tests/test_layout_tensors.py."""

    def config_only_refusals(self, c: ModelConfig, grouped: bool = False) -> list[str]:
        """The default's reasons less the two this layout generates (linear attention, the
        vision tower), plus vision keys it does not generate (:data:`_UNGENERATED_VISION_KEYS`)."""
        reasons = [r for r in super().config_only_refusals(c, grouped)
                   if r not in ("hybrid linear-attention layers", "a vision tower")]
        if c.vision:
            reasons += [f"vision_config.{k}" for k in _UNGENERATED_VISION_KEYS if c.vision.value(k)]
        return reasons

    def tensors(self, c: ModelConfig, grouped: bool = False) -> Tensors:
        """The vision tower (if ``vision_config``), then the default's language model."""
        decoder = super().tensors(c, grouped)  # runs the refusals first
        first = next(decoder, None)
        if c.vision:
            yield from self.vision_tensors(c.vision)
        if first is not None:
            yield first
        yield from decoder

    @staticmethod
    def layer_type(c: ModelConfig, i: int) -> str:
        """``layer_types[i]``, else every ``full_attention_interval``-th layer (default 4, as
        ``Qwen3NextConfig``) is ``full_attention``, the others ``linear_attention``."""
        if c.layer_types:
            return str(c.layer_types[i])
        return "full_attention" if (i + 1) % (c.full_attention_interval or 4) == 0 else "linear_attention"

    def layer_tensors(self, p: str, c: ModelConfig, i: int, grouped: bool) -> Tensors:
        """Layer ``i``: ``linear_attn`` or ``self_attn`` (:meth:`layer_type`), the MLP block, the two norms."""
        if self.layer_type(c, i) == "linear_attention":
            yield from self.linear_attention_tensors(f"{p}.linear_attn", c)
        else:
            yield from self.attention_tensors(f"{p}.self_attn", c)
        yield from self.mlp_tensors(f"{p}.{self.mlp_blocks[0]}", c, i, grouped)
        h = c.hidden_size
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)

    def attention_tensors(self, p: str, c: ModelConfig) -> Tensors:
        """Gated softmax attention: the default's (Qwen3's q_norm/k_norm included) with ``q_proj``
        twice as wide - queries and the output gate (``Qwen3NextAttention``: ``heads * head_dim * 2``)."""
        heads, d, h = c.num_attention_heads, self.head_dim(c), c.hidden_size
        for name, shape in super().attention_tensors(p, c):
            if name == f"{p}.q_proj.weight":
                shape = (2 * heads * d, h)
            elif name == f"{p}.q_proj.bias":
                shape = (2 * heads * d,)
            yield name, shape

    def linear_attention_tensors(self, p: str, c: ModelConfig) -> Tensors:
        """Gated DeltaNet: ``dt_bias``, ``A_log`` [Hv], ``conv1d`` [2*Hk*Dk + Hv*Dv, 1, kernel],
        the input projections - Qwen3-Next's stored fused ``in_proj_qkvz`` [2*Hk*Dk + 2*Hv*Dv, H] and
        ``in_proj_ba`` [2*Hv, H], or Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
        ``in_proj_a`` -, ``norm`` [Dv], ``out_proj`` [H, Hv*Dv] (``linear_*`` config keys)."""
        h = c.hidden_size
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        key, value = c.linear_num_key_heads * c.linear_key_head_dim, hv * dv
        yield f"{p}.dt_bias", (hv,)
        yield f"{p}.A_log", (hv,)
        yield f"{p}.conv1d.weight", (2 * key + value, 1, c.linear_conv_kernel_dim)
        if "in_proj_qkvz" in (self.attention_projections or ()):
            yield f"{p}.in_proj_qkvz.weight", (2 * key + 2 * value, h)
            yield f"{p}.in_proj_ba.weight", (2 * hv, h)
        else:
            yield f"{p}.in_proj_qkv.weight", (2 * key + value, h)
            yield f"{p}.in_proj_z.weight", (value, h)
            yield f"{p}.in_proj_b.weight", (hv, h)
            yield f"{p}.in_proj_a.weight", (hv, h)
        yield f"{p}.norm.weight", (dv,)
        yield f"{p}.out_proj.weight", (h, value)

    def vision_tensors(self, v: VisionConfig) -> Tensors:
        """Qwen3.5's vision tower ``model.visual`` from ``vision_config`` (``Qwen3_5MoeVisionModel``):
        the Conv3d ``patch_embed.proj`` [D, C, T, P, P] with bias, ``pos_embed`` [positions, D],
        ``depth`` blocks (LayerNorms ``norm1``/``norm2``, ``attn.qkv`` [3D, D], ``attn.proj``,
        ``mlp.linear_fc1`` [I, D], ``mlp.linear_fc2``, all with biases) and the patch merger
        (``norm`` [D], ``linear_fc1`` [D*m^2, D*m^2], ``linear_fc2`` [out_hidden_size, D*m^2])."""
        p = self.non_decoder_prefixes[0].rstrip(".")
        d, inter, patch = v.hidden_size, v.intermediate_size, v.patch_size
        merged = d * v.spatial_merge_size ** 2

        def linear(name: str, out: int, k: int) -> Tensors:
            yield f"{name}.weight", (out, k)
            yield f"{name}.bias", (out,)

        yield f"{p}.patch_embed.proj.weight", (d, v.in_channels, v.temporal_patch_size, patch, patch)
        yield f"{p}.patch_embed.proj.bias", (d,)
        yield f"{p}.pos_embed.weight", (v.num_position_embeddings, d)
        for i in range(v.depth):
            b = f"{p}.blocks.{i}"
            for norm in ("norm1", "norm2"):
                yield f"{b}.{norm}.weight", (d,)
                yield f"{b}.{norm}.bias", (d,)
            yield from linear(f"{b}.attn.qkv", 3 * d, d)
            yield from linear(f"{b}.attn.proj", d, d)
            yield from linear(f"{b}.mlp.linear_fc1", inter, d)
            yield from linear(f"{b}.mlp.linear_fc2", d, inter)
        yield f"{p}.merger.norm.weight", (d,)
        yield f"{p}.merger.norm.bias", (d,)
        yield from linear(f"{p}.merger.linear_fc1", merged, merged)
        yield from linear(f"{p}.merger.linear_fc2", v.out_hidden_size, merged)


#: Dense Qwen3 (q_norm/k_norm are norms) and Qwen2: Llama's structure. vLLM ``Qwen3ForCausalLM``.
QWEN3 = QwenLayout(
    name="qwen3",
    architectures=("Qwen3ForCausalLM", "Qwen2ForCausalLM"),
    model_types=("qwen3", "qwen2"),
    attention_projections=QKVO,
    routers=(),
    fused=QKV_GATE_UP,
)

#: Qwen3-MoE (and Qwen2-MoE with its shared expert). vLLM ``Qwen3MoeForCausalLM``: qkv_proj,
#: gate_up_proj of ``mlp_only_layers``; routed experts one FusedMoE ``mlp.experts``.
QWEN3_MOE = QwenLayout(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"),
    model_types=("qwen3_moe", "qwen2_moe"),
    attention_projections=QKVO,
    routers=("gate", "shared_expert_gate"),
    shared_experts=("shared_expert",),
    fused=QKV_GATE_UP,
)

#: Gated-DeltaNet block (``linear_attn``) of Qwen3-Next: projections stored pre-fused; the
#: ``conv1d`` kernel [C, 1, k] is never a matrix (sent unchanged; vLLM builds it as an
#: unquantized linear, ignored; ModelOpt disables ``*linear_attn.conv1d*``).
_NEXT_LINEAR_ATTN = ("in_proj_qkvz", "in_proj_ba", "out_proj", "conv1d")

#: Qwen3-Next: hybrid ``linear_attn`` (Gated DeltaNet) / ``self_attn`` layers, shared expert with
#: its gate. vLLM ``Qwen3NextForCausalLM``. ``in_proj_ba`` stays BF16 (Qwen's FP8 checkpoints).
QWEN3_NEXT = QwenHybridLayout(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    attention_blocks=("self_attn", "linear_attn"),
    attention_projections=QKVO + _NEXT_LINEAR_ATTN,
    sensitive=("in_proj_ba",),
    routers=("gate", "shared_expert_gate"),
    shared_experts=("shared_expert",),
    fused=QKV_GATE_UP,
)

#: Qwen3.5's Gated-DeltaNet projections, stored apart; vLLM fuses them into in_proj_qkvz / in_proj_ba.
_QWEN3_5_LINEAR_ATTN = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "conv1d")
_QWEN3_5_FUSED = QKV_GATE_UP + (("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a"))

#: Qwen3.5-MoE, the multimodal class (``Qwen3_5MoeForConditionalGeneration``): the language model
#: under ``model.language_model``, the vision tower ``model.visual`` (BF16, in the ignore list),
#: MTP under ``mtp.`` (dropped by vLLM's main model). ``in_proj_a/b`` stay BF16 (Qwen's FP8
#: checkpoints keep them; vLLM fuses them into one ``in_proj_ba``).
QWEN3_5_MOE = QwenHybridLayout(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForConditionalGeneration",),
    model_types=("qwen3_5_moe",),
    layers_prefix="model.language_model.layers",
    embeddings=("model.language_model.embed_tokens",),
    final_norms=("model.language_model.norm",),
    attention_blocks=("self_attn", "linear_attn"),
    attention_projections=QKVO + _QWEN3_5_LINEAR_ATTN,
    sensitive=("in_proj_a", "in_proj_b"),
    routers=("gate", "shared_expert_gate"),
    shared_experts=("shared_expert",),
    fused=_QWEN3_5_FUSED,
)

#: Qwen3.5-MoE, the text-only class (``Qwen3_5MoeForCausalLM``): the same blocks under ``model.``.
QWEN3_5_MOE_TEXT = replace(QWEN3_5_MOE, name="qwen3_5_moe_text", architectures=("Qwen3_5MoeForCausalLM",),
                           model_types=("qwen3_5_moe_text",), layers_prefix="model.layers",
                           embeddings=("model.embed_tokens",), final_norms=("model.norm",))
