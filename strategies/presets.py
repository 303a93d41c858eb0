"""Built-in strategy presets: named, extendable partial configs, typed and validated when defined.

``preset: mxfp8-experts`` plus ``keep_bf16: {first: 1, last: 2}`` in a config reads as
"MXFP8 on routed experts, first layer and last two layers kept in BF16".
"""
from __future__ import annotations

from qstrat.config.schema import PresetConfig, Rule
from qstrat.strategies import Strategy


def _rule(select: str, serializer: str) -> Rule:
    return Rule.model_validate({"select": [select], "serializer": serializer}, context={"structural": True})


BUILTIN_STRATEGIES = (
    Strategy("bf16", "everything stays BF16 (no quantization_config)", PresetConfig.define(rules=[])),
    Strategy("block-fp8", "block FP8 128x128 on every decoder linear layer",
             PresetConfig.define(rules=[_rule("linear", "block_fp8")])),
    Strategy("mxfp8", "MXFP8 (E8M0 per 1x32) on every decoder linear layer",
             PresetConfig.define(rules=[_rule("linear", "mxfp8")])),
    Strategy("mxfp8-experts", "MXFP8 on routed MoE experts only",
             PresetConfig.define(rules=[_rule("experts", "mxfp8")])),
    Strategy("nvfp4-experts", "NVFP4 (E2M1, E4M3 per 16, fp32 global) on routed experts; "
             "first and last decoder layer kept in BF16 (override with keep_bf16; a CPU vLLM engine "
             "refuses refits of BF16 experts: there, keep_bf16: {first: 0, last: 0})",
             PresetConfig.define(rules=[_rule("experts", "nvfp4")], keep_bf16={"first": 1, "last": 1})),
)
