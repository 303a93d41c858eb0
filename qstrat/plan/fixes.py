"""What a plan error tells the user to do, and how many lines it takes.

- :func:`on_unsupported_fix`: how to keep what a rule's format cannot represent in BF16 - on a
  rule the user wrote, ``on_unsupported: bf16`` on it; on a rule a preset added (the user wrote
  none: the error still says ``rules[i]``), the rule to write ahead of the preset's, spelled out.
- :func:`formats_that_serve`: which registered formats would serve a refused engine-fused module
  (computed with the same checks the plan applies, so the advice is one that plans).
- :func:`formats_that_fit`: for one tensor its format refuses, which other formats would take it
  (its own shape and, for a routed expert, the engine's fused-MoE rule), or each one's refusal.
- :func:`nothing_else_quantized`: the line added when keeping the refused tensors BF16 would
  leave the config quantizing nothing (the ``on_unsupported`` fix alone then fails to plan): a
  rule to add that plans, or the whole model BF16.
- :func:`one_line_per_cause`: a cause repeated on every layer and expert (one bad
  ``moe_intermediate_size`` refuses 128 experts x 94 layers: 12,032 lines) as one line with the
  layers it covers and a count.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from qstrat.errors import PlanError, UnsupportedShapeError
from qstrat.plan import checks
from qstrat.plan.data import PASSTHROUGH, PlanEntry
from qstrat.config.rules import RuleSet


def on_unsupported_fix(rules: RuleSet, labels: Sequence[str]) -> str:
    """``"set on_unsupported: bf16 on rules[0]"`` for the user's own rules ``labels``; for a rule
    the config's preset added, the rule to add instead (it goes ahead of the preset's, which then
    becomes ``rules[i+1]``), e.g. ``"rules[0] is preset mxfp8-experts's rule; to keep what it
    cannot represent BF16, add to your config: rules: [{select: [experts], serializer: mxfp8,
    on_unsupported: bf16}]"``."""
    if not all(re.fullmatch(r"rules\[\d+\]", lb) for lb in labels):  # default, keep_bf16.*: no rule to mark
        return ("add a rule selecting these tensors with this format and on_unsupported: bf16 (the format "
                f"came from {', '.join(lb for lb in labels if not lb.startswith('rules['))})")
    own = [lb for lb in labels if not _preset_index(rules, lb)]
    theirs = [rules.rule_for(lb) for lb in labels if _preset_index(rules, lb)]
    parts = [f"set on_unsupported: bf16 on {', '.join(own)}"] if own else []
    if theirs:
        written = ", ".join(_inline(r) for r in theirs if r is not None)
        parts.append(f"{', '.join(lb for lb in labels if _preset_index(rules, lb))} is preset "
                     f"{rules.config.preset}'s rule; to keep what it cannot represent BF16, add to your config "
                     f"(your rules go ahead of the preset's; from the command line: a YAML file with preset: "
                     f"{rules.config.preset} and these rules, passed as --config FILE): rules: [{written}]")
    return "; or ".join(parts) if parts else "set on_unsupported: bf16 on the rule that chose this format"


def _preset_index(rules: RuleSet, label: str) -> bool:
    m = re.fullmatch(r"rules\[(\d+)\]", label)
    return m is not None and int(m.group(1)) >= rules.preset_from


def _inline(rule: Any) -> str:
    """A rule as one YAML flow mapping, ``on_unsupported: bf16`` added."""
    keys = [f"select: [{', '.join(rule.select)}]"]
    keys += [f"{k}: [{', '.join(getattr(rule, k))}]" for k in ("include", "exclude") if getattr(rule, k)]
    keys.append(f"serializer: {rule.serializer}")
    if rule.options:
        keys.append("options: {" + ", ".join(f"{k}: {v}" for k, v in rule.options.items()) + "}")
    return "{" + ", ".join([*keys, "on_unsupported: bf16"]) + "}"


def formats_that_serve(planner: Any, entries: Sequence[PlanEntry], indices: Sequence[int], refused: str) -> str:
    """``"; formats that would serve it: mxfp8"`` - the registered quantizing formats other than
    ``refused`` that represent every tensor of the module ``entries[indices]`` and that the
    engine loads fused (:func:`qstrat.plan.checks.fusion_shape_problems`) - or ``"; no other
    format serves it (mxfp8: ..., nvfp4: ...)"`` with each one's reason."""
    members = [entries[i] for i in indices]
    serving, why = _sort_formats(planner, [n for n in planner.rules.formats if n != refused],
                                 lambda ser: _module_problem(ser, members, planner.layout.slabs))
    if serving:
        return f"; formats that would serve it: {', '.join(serving)}"
    return f"; no other format serves it ({'; '.join(why)})" if why else ""


def formats_that_fit(planner: Any, parsed: Any, shape: tuple[int, ...], refused: str) -> str:
    """``"; formats that fit it: nvfp4"``, or ``"; no other format fits it either (block_fp8: ...;
    nvfp4: ...)"`` naming each registered quantizing format other than ``refused`` and why it
    refuses the tensor ``shape`` (its :meth:`part_specs`; for a routed expert, ``parsed.kind ==
    "expert"``, also :meth:`engine_fusion_problem` on either matrix dim, one of which is the
    experts' intermediate size: block FP8's fused-MoE multiple of 128)."""
    fit, why = _sort_formats(planner, [n for n in planner.rules.formats if n != refused],
                             lambda ser: _tensor_problem(ser, parsed, shape, planner.layout.slabs))
    if fit:
        return f"; formats that fit it: {', '.join(fit)}"
    return f"; no other format fits it either ({'; '.join(why)})" if why else ""


def _sort_formats(planner: Any, names: Sequence[str], problem_of: Any) -> tuple[list[str], list[str]]:
    """The quantizing formats of ``names`` (default options) whose ``problem_of(serializer)`` is
    None, and ``"name: problem"`` for the others, in ``names`` order."""
    fit, why = [], []
    for name in names:
        ser = planner.serializer(name, {})
        if not ser.quantizes:
            continue
        problem = problem_of(ser)
        if problem:
            why.append(f"{name}: {problem}")
        else:
            fit.append(name)
    return fit, why


def _module_problem(ser: Any, members: Sequence[PlanEntry], slabs: Any) -> str | None:
    """Why ``ser`` cannot serve the module of ``members``: a member's shape it refuses, or the
    engine's fused load of them (:func:`qstrat.plan.checks.fusion_shape_problems`); else None."""
    try:
        for e in members:
            ser.part_specs(e.shape)
    except UnsupportedShapeError as exc:
        return str(exc)
    problems = checks.fusion_shape_problems(members, slabs, lambda e: ser)
    return problems[0][1] if problems else None


def _tensor_problem(ser: Any, parsed: Any, shape: tuple[int, ...], slabs: Any) -> str | None:
    try:
        ser.part_specs(shape)
    except UnsupportedShapeError as exc:
        return str(exc)
    if parsed.kind != "expert" or len(shape) < 2:
        return None
    spec = slabs.get(parsed.projection)
    parts = len(spec.parts) if spec is not None and spec.splittable and len(shape) == 3 else 1
    for dim in (shape[-2] // parts, shape[-1]):
        problem = ser.engine_fusion_problem([dim], True)
        if problem:
            return problem
    return None


class ShapeRefused(PlanError):
    """A tensor's shape its rule's format refuses, the rule without ``on_unsupported: bf16``:
    ``"<the format's reason>; no other format fits it either (...) (rule rules[0]; to fall back
    to BF16: ...)"`` (:func:`formats_that_fit`, :func:`on_unsupported_fix`); ``rule`` and
    ``serializer`` kept for :func:`nothing_else_quantized`."""

    def __init__(self, planner: Any, parsed: Any, shape: tuple[int, ...], serializer: str, rule: str,
                 exc: UnsupportedShapeError) -> None:
        super().__init__(f"{exc}{formats_that_fit(planner, parsed, shape, serializer)} (rule {rule}; to fall back "
                         f"to BF16: {on_unsupported_fix(planner.rules, [rule])})")
        self.rule, self.serializer = rule, serializer


def nothing_else_quantized(planner: Any, entries: Sequence[PlanEntry], failed: Sequence[tuple[str, Exception]],
                           num_layers: int | None) -> list[str]:
    """The plan-error line for shape refusals whose BF16 fallback would leave nothing quantized.

    Args:
        planner: the planner (its rules, layout, serializer factory);
        entries: the inputs that did plan;
        failed: ``(input name, its error)`` of those that did not; the :class:`ShapeRefused`
            ones count - their rules, and the engine modules they load into (a layer's experts:
            the whole-module fallback keeps its other tensors BF16 too; a dense tensor: itself);
        num_layers: the decoder depth (for parsing names).
    Returns: ``[]`` when there is no such refusal or some planned tensor outside those rules'
    refused units still quantizes; else ``["kept BF16, ... leave this config quantizing nothing
    ...: add to your config ..."]`` naming a rule for another kind of module (attention) in a
    format that every tensor of it fits (checked as the plan checks it), or the whole model BF16
    (``preset: bf16``).
    """
    refused = {exc.rule: exc.serializer for _, exc in failed if isinstance(exc, ShapeRefused)}
    if not refused:
        return []
    units = set()
    for name, exc in failed:
        if isinstance(exc, ShapeRefused):
            p = planner.layout.parse(name, num_layers)
            units.add(p.engine_module if p.kind == "expert" else name)
    for e in entries:
        key = e.engine_module if e.kind == "expert" else e.name
        if e.serializer != PASSTHROUGH and key not in units and planner.serializer(e.serializer, e.options).quantizes:
            return []
    add = _other_rule(planner, entries, list(refused.values()))
    labels = sorted(refused)
    rules = planner.rules
    if add and all(_preset_index(rules, lb) for lb in labels):
        written = ", ".join(_inline(r) for lb in labels if (r := rules.rule_for(lb)) is not None)
        fix = f"add to your config (ahead of preset {rules.config.preset}'s rules): rules: [{written}, {add}]"
    elif add:
        fix = f"{on_unsupported_fix(rules, labels)}, and add this rule: {add}"
    else:
        fix = "no other module of this model fits a quantized format"
    return [f"kept BF16 (on_unsupported: bf16), the tensors whose shape {', '.join(labels)} refused take the "
            "rest of their engine modules with them (the engine loads a layer's experts as one) and leave "
            f"this config quantizing nothing: to serve this model quantized, {fix}; or serve it unquantized: "
            "preset: bf16"]


def quantize_something(planner: Any, entries: Sequence[PlanEntry]) -> str:
    """What to add to a config that quantizes nothing because every match fell back to BF16:
    ``"; to quantize something, add the rule {select: [attention], serializer: mxfp8} (...), or
    serve it unquantized: preset: bf16"`` (the rule as :func:`_other_rule` finds it)."""
    fell = [e.serializer for e in entries if e.note.startswith("BF16 fallback")]
    add = _other_rule(planner, entries, [r.serializer for r in planner.rules.config.rules])
    if not fell:
        return ""
    some = f"add the rule {add} (every attention tensor fits it), or " if add else ""
    return f"; to quantize something, {some}serve the model unquantized: preset: bf16"


def _other_rule(planner: Any, entries: Sequence[PlanEntry], preferred: Sequence[str]) -> str | None:
    """``{select: [attention], serializer: mxfp8}`` for the first of ``preferred`` then the other
    quantizing formats that represents every attention tensor of ``entries`` and that the engine
    loads fused (:func:`_module_problem`); ``None`` if none does."""
    members = [e for e in entries if e.kind == "attention" and len(e.shape) >= 2]
    if not members:
        return None
    fit, _ = _sort_formats(planner, list(dict.fromkeys([*preferred, *planner.rules.formats])),
                           lambda ser: _module_problem(ser, members, planner.layout.slabs))
    return f"{{select: [attention], serializer: {fit[0]}}}" if fit else None


#: The parts of a tensor or module name that repeat per layer and per expert.
_REPEATED = re.compile(r"(?<=\.layers\.)\d+|(?<=\.experts\.)\d+")
_NAME = re.compile(r"[\w.{},-]+")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def one_line_per_cause(errors: Sequence[str]) -> list[str]:
    """``errors`` with the lines whose leading name (before the first ``": "``) differs only in
    layer and expert indices, and whose cause (the rest) is the same, merged into one, in the
    order each first appears: the first line as it was, then ``[the same for 12,031 more:
    model.layers.*.mlp.experts.*.down_proj.weight, layers 0-93]``. A line seen once is kept
    as it was; so is a cause that names tensors of its own (those differ per line)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for line in errors:
        head, sep, cause = line.partition(": ")
        key = _REPEATED.sub("*", head) if sep and _NAME.fullmatch(head) else line
        groups.setdefault((key, cause), []).append(line)
    out = []
    for (head, _), lines in groups.items():
        if len(lines) > 1:
            layers = sorted({int(m.group(1)) for ln in lines for m in [_LAYER.search(ln.partition(": ")[0] + ".")] if m})
            where = f", layers {_spans(layers)}" if layers else ""
            out.append(f"{lines[0]} [the same for {len(lines) - 1:,} more: {head}{where}]")
        else:
            out.append(lines[0])
    return out


def _spans(values: Sequence[int]) -> str:
    """``0-3, 5, 7-9`` for sorted integers."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
