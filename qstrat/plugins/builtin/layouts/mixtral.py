"""Mixtral: Llama attention, every layer MoE; the default tensor generator with its names."""
from __future__ import annotations

from qstrat.plugins.builtin.layouts.common import QKVO
from qstrat.layouts.model_layout import ModelLayout, SlabSpec

#: Mixtral. transformers 5 holds ``mlp.gate`` and slabs ``mlp.experts.gate_up_proj`` [E, 2I, H]
#: (w1 rows, then w3) / ``mlp.experts.down_proj`` (its conversion mapping renames
#: ``block_sparse_moe`` -> ``mlp``); vLLM's ``MixtralForCausalLM`` loads the checkpoint names
#: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w3/w2``. Both inputs parse;
#: outputs use the checkpoint names.
MIXTRAL = ModelLayout(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    mlp_blocks=("block_sparse_moe",),
    renames=((".mlp.", ".block_sparse_moe."),),
    expert_projections=("w1", "w3", "w2"),
    slabs={"gate_up_proj": SlabSpec(("w1", "w3")), "down_proj": SlabSpec(("w2",)),
           "w13": SlabSpec(("w1", "w3")), "w2": SlabSpec(("w2",))},
    attention_projections=QKVO,
    fused=(("q_proj", "k_proj", "v_proj"), ("w1", "w3")),
)
