"""gpt-oss: Llama-style attention with biases and ``sinks``, a router with a bias, and experts as
transposed, gate/up-interleaved slabs with biases (transformers 5.x ``modeling_gpt_oss.py``:
``GptOssAttention``, ``GptOssTopKRouter``, ``GptOssExperts``)."""
from __future__ import annotations

from qstrat.plugins.builtin.layouts.common import QKVO
from qstrat.layouts.model_layout import ModelLayout, SlabSpec
from qstrat.layouts.model_config import ModelConfig
from qstrat.layouts.skeleton import Shape, Tensors


class GptOssLayout(ModelLayout):
    """gpt-oss: the default generator plus attention sinks and the router bias; the slabs and
    their biases come from its :class:`~qstrat.layouts.model_layout.SlabSpec` data."""

    def attention_tensors(self, p: str, c: ModelConfig) -> Tensors:
        """The default's q/k/v/o (with ``attention_bias``: true in gpt-oss) and ``sinks`` [heads]."""
        yield from super().attention_tensors(p, c)
        yield f"{p}.sinks", (c.num_attention_heads,)

    def router_tensors(self, p: str, c: ModelConfig, n: int) -> Tensors:
        """``mlp.router.weight`` [E, H] and its ``bias`` [E]."""
        yield from super().router_tensors(p, c, n)
        yield f"{p}.bias", (n,)

    def whole_slab_reason(self, projection: str | None, shape: Shape) -> str | None:
        """The default's reason, and what vLLM's ``GptOssForCausalLM`` loads instead."""
        reason = super().whole_slab_reason(projection, shape)
        return reason and (f"{reason}; vLLM's GptOssForCausalLM loads them unquantized or as its own "
                           "MXFP4 only")


#: gpt-oss (``GptOssForCausalLM``): q/k/v/o with biases and attention ``sinks``; router
#: ``mlp.router`` with bias; experts as transposed slabs ``gate_up_proj`` [E, H, 2I] (gate/up
#: interleaved) and ``down_proj`` [E, I, H], with ``*_bias`` [E, 2I] / [E, H]. The slabs are sent
#: whole and unquantized (see :class:`~qstrat.layouts.model_layout.SlabSpec`); attention may be quantized.
GPT_OSS = GptOssLayout(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    attention_projections=QKVO,
    slabs={"gate_up_proj": SlabSpec(("gate_proj", "up_proj"), transposed_interleaved=True, biases=True),
           "down_proj": SlabSpec(("down_proj",), transposed_interleaved=True, biases=True)},
    routers=("router",),
    fused=(("q_proj", "k_proj", "v_proj"),),
)
