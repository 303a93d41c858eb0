"""Meta-tensor models for planning tests (no values: plans read only names, shapes, dtypes).

Shared by the planner, plan-check, plan-data and rules tests (tests/test_planner.py,
test_plan_checks.py, test_plan_data.py, test_rules.py).
"""
from __future__ import annotations

import torch

from qstrat.plugins.builtin.layouts import QWEN3_MOE
from qstrat.layouts.skeleton import model_tensors

from conftest import model_config


def meta(layout, cfg, grouped=False):
    """``{name: bf16 meta tensor}`` of every tensor ``layout`` expects from config ``cfg``."""
    return {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(layout, cfg, grouped)}


def by_name(plan):
    """A plan's entries by input name."""
    return {e.name: e for e in plan.entries}


def small_moe(cfg_overrides=None):
    """A 4-layer, 4-expert Qwen3-MoE config (hidden 256, expert intermediate 128) and its
    per-expert meta tensors; ``cfg_overrides`` replaces config keys."""
    cfg = {**model_config("qwen3-235b-a22b"), "num_hidden_layers": 4, "num_experts": 4,
           "hidden_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, **(cfg_overrides or {})}
    return cfg, meta(QWEN3_MOE, cfg)
