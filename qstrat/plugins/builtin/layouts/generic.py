"""The ``generic`` layout: used when no registered layout matches the HF config."""
from __future__ import annotations

from qstrat.layouts.model_layout import ModelLayout, SlabSpec
from qstrat.layouts.model_config import ModelConfig


class GenericLayout(ModelLayout):
    """Knows the common spellings of MoE blocks, expert projections and routers, so an unknown
    MoE model never gets its router quantized by accident. It alone guesses: an unknown matrix
    inside a decoder layer is a quantizable ``linear``. Its names are alternatives to place
    stored tensors, not a structure: it generates no tensors from a config alone."""

    @property
    def summary(self) -> str:
        """``qstrat list``'s line for it (it has no architectures to list)."""
        return ("the fallback for models no other layout matches: common MoE, expert and router "
                "names; plans stored tensors, not a config.json alone")

    def config_only_refusals(self, c: ModelConfig, grouped: bool = False) -> list[str]:
        """The default's refusals, and always the tensors of an unknown family."""
        return super().config_only_refusals(c, grouped) + [
            "the tensors of a model family no registered layout matches (set 'layout:' in the refit "
            "config if it is one that 'qstrat list' shows)"]


GENERIC = GenericLayout(
    name="generic",
    mlp_blocks=("mlp", "block_sparse_moe", "feed_forward", "moe"),
    expert_projections=("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2"),
    slabs={"gate_up_proj": SlabSpec(("gate_proj", "up_proj")), "down_proj": SlabSpec(("down_proj",)),
           "w13": SlabSpec(("w1", "w3")), "w2": SlabSpec(("w2",))},
    routers=("gate", "router", "shared_expert_gate"),
    shared_experts=("shared_expert", "shared_experts"),
    fused=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3")),
)
