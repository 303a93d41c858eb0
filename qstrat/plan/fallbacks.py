"""Whole-module BF16 fallbacks: where one tensor of a module the engine loads as one - a layer's
routed experts, an engine-fused group (q/k/v, gate/up) - cannot be served in its format, the
whole module is kept BF16 with a visible ``note`` (``on_unsupported: bf16``), or the plan
refuses it naming the module, the reason and the fix. Each function takes the
:class:`~qstrat.plan.planner.Planner` (``planner``: its serializer factory, rules, layout and
output declaration) and rewrites ``entries`` in place, appending to ``errors``."""
from __future__ import annotations

import dataclasses
from typing import Any

from qstrat.plan import checks
from qstrat.plan.data import PASSTHROUGH, PlanEntry
from qstrat.plan.engine_config import format_lookup
from qstrat.plan.fixes import formats_that_serve, on_unsupported_fix


def whole_module_fallbacks(planner: Any, entries: list[PlanEntry], num_layers: int | None, errors: list[str]) -> None:
    """A tensor that fell back to BF16 (``on_unsupported: bf16``: a shape its format cannot
    represent) takes the rest of the module the engine loads it into with it - a layer's
    routed experts (one fused-MoE module: Qwen3-MoE ``moe_intermediate_size=80`` under MXFP8,
    whose ``down_proj`` K=80 is off the 32 block while gate/up are not) or an engine-fused
    group (q/k/v) - kept BF16 with a ``note`` naming the tensor and the reason, as
    :func:`engine_fusions` does. Where a rule that quantizes the rest has no
    ``on_unsupported: bf16``, an error names the fallback and that rule instead."""
    units: dict[str, list[int]] = {}
    for i, e in enumerate(entries):
        key = e.engine_module if e.kind == "expert" else e.group
        if key is not None and len(e.shape) >= 2 and e.serializer != PASSTHROUGH:
            units.setdefault(key, []).append(i)
    bf16 = None
    for unit, indices in units.items():
        fell = next((entries[i] for i in indices if entries[i].note.startswith("BF16 fallback")), None)
        if fell is None:
            continue
        rest = [i for i in indices if not entries[i].note and planner.serializer(entries[i].serializer,
                                                                              entries[i].options).quantizes]
        if not rest:
            continue
        strict = sorted({entries[i].rule for i in rest if (r := planner.rules.rule_for(entries[i].rule)) is None
                         or r.on_unsupported != "bf16"})
        reason = fell.note.removeprefix("BF16 fallback: ")
        if strict:
            errors.append(f"{unit}: {fell.name} falls back to BF16 ({reason}), but {', '.join(strict)} "
                          f"quantizes the rest of the module the engine loads as one ({entries[rest[0]].name}, "
                          f"...); to keep the whole module BF16: {on_unsupported_fix(planner.rules, strict)}")
            continue
        bf16 = bf16 or planner.serializer("bf16", {})
        for i in rest:
            e = entries[i]
            p = planner.layout.parse(e.name, num_layers)
            entries[i] = dataclasses.replace(e, serializer="bf16", options={},
                                             outputs=planner.declare.outputs(p, bf16.part_specs(e.shape), e.shape),
                                             note=f"BF16 fallback: {unit}: {fell.name}: {reason}")

def engine_fusions(planner: Any, entries: list[PlanEntry], num_layers: int | None, errors: list[str]) -> None:
    """Engine-fused modules the engine cannot load in their format
    (:func:`qstrat.plan.checks.fusion_shape_problems`): kept BF16 in place (a visible
    ``note``; they join the ignore list) when every rule that decided them says
    ``on_unsupported: bf16``, else an error naming the module, the reason and the fix."""
    format_of = format_lookup(planner.serializer, entries)
    for indices, problem, module in checks.fusion_shape_problems(entries, planner.layout.slabs, format_of):
        rules = sorted({entries[i].rule for i in indices})
        fallback = all((r := planner.rules.rule_for(label)) is not None and r.on_unsupported == "bf16"
                       for label in rules)
        fmt = entries[indices[0]].serializer
        if not fallback:
            errors.append(f"{module}: {fmt} ({', '.join(rules)}): {problem}; to keep it BF16: "
                          f"{on_unsupported_fix(planner.rules, rules)}{formats_that_serve(planner, entries, indices, fmt)}")
            continue
        bf16 = planner.serializer("bf16", {})
        for i in indices:
            e = entries[i]
            p = planner.layout.parse(e.name, num_layers)
            outs = planner.declare.outputs(p, bf16.part_specs(e.shape), e.shape) if len(e.shape) >= 2 else e.outputs
            entries[i] = dataclasses.replace(e, serializer="bf16", options={}, outputs=outs,
                                             note=f"BF16 fallback: {module}: {problem}")
