"""What a plan error tells the user to do, and how many lines it takes.

- :func:`on_unsupported_fix`: how to keep what a rule's format cannot represent in BF16 - on a
  rule the user wrote, ``on_unsupported: bf16`` on it; on a rule a preset added (the user wrote
  none: the error still says ``rules[i]``), the rule to write ahead of the preset's, spelled out.
- :func:`formats_that_serve`: which registered formats would serve a refused engine-fused module
  (computed with the same checks the plan applies, so the advice is one that plans).
- :func:`one_line_per_cause`: a cause repeated on every layer and expert (one bad
  ``moe_intermediate_size`` refuses 128 experts x 94 layers: 12,032 lines) as one line with the
  layers it covers and a count.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from qstrat.errors import UnsupportedShapeError
from qstrat.plan import checks
from qstrat.plan.data import PlanEntry
from qstrat.rules import RuleSet


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
                     f"(your rules go ahead of the preset's): rules: [{written}]")
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
    serving, why = [], []
    for name in planner.rules.formats:
        if name == refused:
            continue
        ser = planner.serializer(name, {})
        if not ser.quantizes:
            continue
        try:
            for e in members:
                ser.part_specs(e.shape)
        except UnsupportedShapeError as exc:
            why.append(f"{name}: {exc}")
            continue
        problems = checks.fusion_shape_problems(members, planner.layout.slabs, lambda e, s=ser: s)
        if problems:
            why.append(f"{name}: {problems[0][1]}")
        else:
            serving.append(name)
    if serving:
        return f"; formats that would serve it: {', '.join(serving)}"
    return f"; no other format serves it ({'; '.join(why)})" if why else ""


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
