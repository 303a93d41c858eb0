"""Built-in selectors (data): one predicate per kind of tensor a rule may target.

Kinds come from :meth:`qstrat.layouts.model_layout.ModelLayout.parse`; ``special=True`` selectors are the
explicit opt-in for kinds never quantized by default (routers, embeddings, lm_head).
"""
from __future__ import annotations

from collections.abc import Callable

from qstrat.layouts.model_layout import QUANTIZABLE_KINDS, ParsedName
from qstrat.plugins.selector import Selector


def _kind(*kinds: str) -> Callable[[ParsedName], bool]:
    return lambda p: p.kind in kinds


BUILTIN_SELECTORS = (
    Selector("linear", "every decoder linear layer: attention, dense MLP, experts, shared experts",
             lambda p: p.kind in QUANTIZABLE_KINDS),
    Selector("experts", "routed MoE experts only (per-expert names and grouped slabs)", _kind("expert")),
    Selector("shared_experts", "always-active shared experts", _kind("shared_expert")),
    Selector("attention", "attention projections (q/k/v/o, MLA projections)", _kind("attention")),
    Selector("dense_mlp", "MLP projections of dense (non-MoE) layers", _kind("dense_mlp")),
    Selector("routers", "MoE router linears (mlp.gate, shared_expert_gate): explicit opt-in",
             _kind("router"), special=True),
    Selector("embeddings", "token embeddings: explicit opt-in", _kind("embedding"), special=True),
    Selector("lm_head", "output projection: explicit opt-in", _kind("lm_head"), special=True),
)
