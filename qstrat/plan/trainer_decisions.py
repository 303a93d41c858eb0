"""Trainer-side selection: the per-module decision map a trainer uses to pick its own precision.

``qstrat.select(config, model)`` answers, for every weight of an ``nn.Module`` (or for a mapping
of names to tensors, or a list of names), what the refit will do with it - so a trainer can,
e.g., run FP8 training only where the engine will serve FP8, using the same config as the refit.

The answer is READ FROM THE PLAN (:meth:`qstrat.RefitDriver.plan` of the same tensors' names,
shapes and dtypes), never recomputed: a BF16 fallback (``on_unsupported: bf16``), a fused
module kept BF16, a refusal (``keep_bf16.last`` without the decoder depth) are the plan's.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from qstrat.execute.driver import RefitDriver
from qstrat.execute.named_tensors import TensorSpec
from qstrat.layouts.model_layout import ModelLayout
from qstrat.layouts.model_config import ModelConfig
from qstrat.plan.data import RefitPlan
from qstrat.config.rules import Decision

#: Rows and columns of the stand-in matrix a bare name is planned with (:func:`select` with names):
#: a multiple of every built-in format's tile (128) and block (16, 32).
NAME_ONLY_DIM = 256


def select(config: Any, module_or_names: torch.nn.Module | Mapping[str, Any] | Iterable[str],
           hf_config: Mapping[str, Any] | None = None, plan: RefitPlan | None = None) -> dict[str, Decision]:
    """Decision per module, as the refit's plan makes it.

    Args:
        config: RefitConfig, mapping, config path or preset name.
        module_or_names: an ``nn.Module`` (its ``named_parameters(remove_duplicate=False)``:
            names, shapes, dtypes - a tied ``lm_head`` included, as in its ``state_dict()``; on
            any device, ``meta`` included), a mapping name -> tensor or spec (a state dict,
            :func:`qstrat.execute.named_tensors.tensor_specs`), or module/parameter names (one name as a str).
            A bare name is planned as a bfloat16 ``[256, 256]`` weight (``[E, 256 * parts, 256]``
            for a grouped slab of ``parts`` projections, ``E`` the routed experts ``hf_config``
            gives, else 1; ``[256]`` for a bias); a name without a
            parameter suffix is a module holding such a ``weight``. Shape-dependent decisions
            (a format's tile, ``on_unsupported: bf16``) need the real shapes: pass the module.
        hf_config: the model's config.json (layout detection, decoder depth for ``keep_bf16``);
            for an ``nn.Module`` its ``.config`` is used when present, or the wrapped model's
            under a DDP / FSDP1 / ``torch.compile`` / activation-checkpointing wrapper.
        plan: the plan to read (a plan made beforehand with the same config, of these tensors:
            :meth:`~qstrat.RefitDriver.check_plan` - with a module or mapping, every planned
            input must be among its tensors with the planned shape and dtype; a partial plan
            answers for its tensors); default: plan ``module_or_names`` here.
    Returns:
        ``{key: Decision}`` for every weight (``.weight`` parameter or grouped slab) of the plan:
        key is the module name for ``.weight`` parameters (``model.layers.0.self_attn.q_proj``,
        as the trainer names it) and the parameter name for grouped slabs
        (``model.layers.0.mlp.experts.gate_up_proj``). ``Decision.serializer`` is the format
        the plan emits (``bf16`` after a fallback, ``note`` saying why) or ``"passthrough"``;
        ``Decision.rule`` says which rule decided.
    Raises: ConfigError for an invalid config; PlanError where the plan refuses (e.g.
        ``keep_bf16.last`` without ``hf_config``'s decoder depth: qstrat does not guess it), or
        for a given ``plan`` made with another config or of other tensors.
    """
    if isinstance(module_or_names, torch.nn.Module) and hf_config is None:
        hf_config = _module_config(module_or_names)
    driver = RefitDriver(config, hf_config=hf_config)
    if plan is None:
        plan = driver.plan(_specs(driver.layout, module_or_names, driver.model_config))
    else:  # the plan's inputs must be the given tensors' (names, shapes, dtypes), not another model's
        given = isinstance(module_or_names, (torch.nn.Module, Mapping))
        driver.check_plan(plan, _specs(driver.layout, module_or_names) if given else None)
    result = {}
    for e in plan.entries:
        p = driver.layout.parse(e.name, plan.num_layers)
        if e.name.endswith(".weight") or p.slab:
            result[e.name.removesuffix(".weight")] = Decision(e.serializer, dict(e.options), e.rule, p, e.note)
    return result


#: Attributes through which torch's wrappers hold the model they wrap: DDP and FSDP1 ``module``,
#: ``torch.compile``'s ``_orig_mod``, FSDP1's ``_fsdp_wrapped_module``, activation checkpointing's
#: ``_checkpoint_wrapped_module`` (the same wrappers whose names :mod:`qstrat.layouts.model_layout` strips).
WRAPPED_MODEL_ATTRS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _module_config(module: torch.nn.Module) -> dict[str, Any] | None:
    """The HF config (``.config.to_dict()``) of ``module`` or of the model a wrapper around it
    holds (:data:`WRAPPED_MODEL_ATTRS`, through any nesting): a DDP-wrapped model has no
    ``.config`` of its own, and without it the layout and the decoder depth would not be the
    plan's (``layout 'generic'``, a Mixtral pattern on ``block_sparse_moe`` matching nothing)."""
    seen = set()
    while isinstance(module, torch.nn.Module) and id(module) not in seen:
        seen.add(id(module))
        cfg = getattr(module, "config", None)
        if cfg is not None:
            return cfg.to_dict() if hasattr(cfg, "to_dict") else None
        module = next((m for m in (getattr(module, a, None) for a in WRAPPED_MODEL_ATTRS)
                       if isinstance(m, torch.nn.Module)), None)
    return None


def _specs(layout: ModelLayout, source: Any, model_config: ModelConfig | None = None) -> dict[str, Any]:
    """What :func:`select` plans: name -> anything with ``.shape`` and ``.dtype`` (a grouped slab
    named bare holds ``model_config``'s routed expert count, which the plan checks it against; a
    single str is one name)."""
    if isinstance(source, torch.nn.Module):
        # every name a parameter has, as state_dict() lists it: a tied lm_head shares the
        # embedding's Parameter and named_parameters() would drop it (the refit plans it)
        return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in source.named_parameters(remove_duplicate=False)}
    if isinstance(source, Mapping):
        return dict(source)
    d = NAME_ONLY_DIM
    experts = (layout.num_experts(model_config) if model_config is not None else None) or 1
    specs = {}
    for n in [source] if isinstance(source, str) else source:
        p = layout.parse(n)
        if p.slab:
            specs[n] = TensorSpec(layout.slabs[p.projection].shape(experts, d, d), torch.bfloat16)
        elif p.param == "bias":
            specs[n] = TensorSpec((d,), torch.bfloat16)
        elif p.param == "weight":
            specs[n] = TensorSpec((d, d), torch.bfloat16)
        else:
            specs[f"{n}.weight"] = TensorSpec((d, d), torch.bfloat16)
    return specs
