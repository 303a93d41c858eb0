"""Trainer-side selection: the per-module decision map a trainer uses to pick its own precision.

``qstrat.select(config, model)`` answers, for every weight of an ``nn.Module`` (or for a list of
names), what the refit will do with it - so a trainer can, e.g., run FP8 training only where the
engine will serve FP8, using the same config as the refit.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from qstrat.driver import RefitDriver
from qstrat.rules import Decision, is_weight_matrix


def select(config: Any, module_or_names: torch.nn.Module | Iterable[str],
           hf_config: Mapping[str, Any] | None = None) -> dict[str, Decision]:
    """Decision per module.

    Args:
        config: RefitConfig, mapping, config path or preset name.
        module_or_names: an ``nn.Module`` (its ``named_parameters()`` are read: shapes matter,
            e.g. 1-D parameters are never quantized) or module/parameter names. A name without
            a parameter suffix is taken as a module holding a 2-D ``weight``.
        hf_config: the model's config.json (layout detection, decoder depth for ``keep_bf16``);
            for an ``nn.Module`` its ``.config`` is used when present.
    Returns:
        ``{key: Decision}`` where key is the module name for ``.weight`` parameters
        (``model.layers.0.self_attn.q_proj``) and the parameter name for grouped slabs
        (``model.layers.0.mlp.experts.gate_up_proj``). ``Decision.serializer`` is a format name
        or ``"passthrough"``; ``Decision.rule`` says which rule decided.
    Raises: ConfigError for an invalid config.
    """
    is_module = isinstance(module_or_names, torch.nn.Module)
    if is_module and hf_config is None and hasattr(module_or_names, "config"):
        cfg = module_or_names.config
        hf_config = cfg.to_dict() if hasattr(cfg, "to_dict") else None
    driver = RefitDriver(config, hf_config=hf_config)
    if is_module:
        ndims = {n: p.dim() for n, p in module_or_names.named_parameters()}
    else:  # names: a slab is 3-D, a weight 2-D, a bare module name a module with a 2-D weight
        ndims = {}
        for n in module_or_names:
            p = driver.layout.parse(n)
            if p.slab:
                ndims[n] = 3
            elif p.param in ("weight", "bias"):
                ndims[n] = 2 if p.param == "weight" else 1
            else:
                ndims[f"{n}.weight"] = 2
    num_layers = driver.num_layers(ndims)
    result = {}
    for name, ndim in ndims.items():
        p = driver.layout.parse(name, num_layers)
        if name.endswith(".weight") or p.slab:
            result[name.removesuffix(".weight")] = driver.rules.decide(p, is_weight_matrix(p, ndim), num_layers)
    return result
