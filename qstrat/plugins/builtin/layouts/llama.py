"""Llama (dense): the structure the default tensor generator writes
(:class:`~qstrat.layouts.skeleton.LayoutTensors`)."""
from __future__ import annotations

from qstrat.plugins.builtin.layouts.common import QKV_GATE_UP, QKVO
from qstrat.layouts.model_layout import ModelLayout

#: Dense Llama (and Llama-style dense models). vLLM ``LlamaForCausalLM``: qkv_proj, gate_up_proj.
LLAMA = ModelLayout(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    attention_projections=QKVO,
    routers=(),
    fused=QKV_GATE_UP,
)
