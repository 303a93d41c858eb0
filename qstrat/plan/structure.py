"""Structure checks: a plan never guesses silently about a model it does not understand.

Two failures of a layout that does not fit the model would otherwise pass unnoticed (the
engine would serve BF16 weights, or refuse names half-way through a refit):

- :func:`unplaced_matrices`: weight matrices the layout cannot place (kind ``other``): a
  renamed block, a new projection, a layout for another family. Refused unless the config
  says ``unplaced_weights: bf16`` (sent unchanged and listed in the engine's ignore list).
- :func:`quantizes_nothing`: a config asking for a quantized format (a rule or ``default``)
  whose rules matched no tensor of this model (experts-only MXFP8 on a layout that sees no
  experts).
- :func:`idle_rules`: not an error - warning lines for rules that decided no tensor while
  others did (a mistyped include pattern, a selector for a kind the model lacks).

The first three return error lines for :class:`~qstrat.plan.planner.Planner` to collect.
"""
from __future__ import annotations

import re

from collections import Counter
from collections.abc import Callable, Sequence

from qstrat.config.loader import RefitConfig
from qstrat.plan.data import PASSTHROUGH, PlanEntry

#: How many names an error message lists before "... and N more".
SHOWN = 8


def layers_past_the_model(entries: Sequence[PlanEntry], num_layers: int | None, num_mtp: int) -> list[str]:
    """One error naming the inputs of decoder layers past the model config's depth plus its MTP
    layers (``num_hidden_layers`` too small for the tensors, or another model's tensors): they
    would otherwise be taken for MTP layers and passed through unquantized.

    Args: num_layers: the config's decoder depth (None: not known, nothing checked);
        num_mtp: MTP layers stored after them (DeepSeek-V3's ``num_nextn_predict_layers``).
    """
    if num_layers is None:
        return []
    names = [e.name for e in entries if e.kind == "mtp" and e.layer is not None and e.layer >= num_layers + num_mtp]
    if not names:
        return []
    return [f"{len(names)} tensors are in layers past the model config's {num_layers} decoder layers"
            f"{f' and {num_mtp} MTP layers' if num_mtp else ' (it has no MTP layers)'}: {_listing(names)} "
            "(is num_hidden_layers right, and are these this model's tensors?)"]


def unplaced_matrices(entries: Sequence[PlanEntry], layout: str, config: RefitConfig) -> list[str]:
    """One error naming the tensors of two or more dims (matrices, slabs, conv kernels) of
    kind ``other``.

    Args:
        entries: the planned inputs; layout: the layout's name (for the message);
        config: its ``unplaced_weights`` (``error`` / ``bf16``) decides.
    """
    names = [e.name for e in entries if e.kind == "other" and len(e.shape) >= 2]
    if not names or config.unplaced_weights == "bf16":
        return []
    if any(_PEFT_NAME.search(n) for n in names):  # 'unplaced_weights: bf16' would send adapter names
        return [f"layout {layout!r} cannot place {len(names)} weight matrices: {_listing(names)} - PEFT names "
                "(a PeftModel's 'base_model.model.' prefix, LoRA 'base_layer'/'lora_A'/'lora_B' tensors), which "
                "no engine loads: merge the adapters and pass the merged model's state dict "
                "(peft's merge_and_unload(); docs/integrations.md)"]
    return [f"layout {layout!r} cannot place {len(names)} weight matrices: {_listing(names)} "
            "(choose the right layout with 'layout:', add one for this model, or set "
            "'unplaced_weights: bf16' to send them unchanged and unquantized)"]


#: Names only a PEFT-wrapped model holds: its ``base_model.model.`` prefix, LoRA's wrapped
#: ``base_layer`` and adapter ``lora_A`` / ``lora_B`` (``lora_embedding_A/B``) modules.
_PEFT_NAME = re.compile(r"^base_model\.model\.|\.(base_layer|lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.")


def quantizes_nothing(entries: Sequence[PlanEntry], layout: str, config: RefitConfig,
                      quantizing: Callable[[str], bool]) -> list[str]:
    """One error when the config names a quantized format but no tensor gets one.

    Args:
        entries: the planned inputs; layout: the layout's name;
        config: the expanded config (rules, default);
        quantizing: whether a serializer name quantizes (``bf16`` does not).
    """
    asked = [f"rules[{i}] ({', '.join(r.select)} -> {r.serializer})" for i, r in enumerate(config.rules)
             if quantizing(r.serializer)]
    if quantizing(config.default):
        asked.append(f"default ({config.default})")
    if not asked or any(e.serializer != PASSTHROUGH and quantizing(e.serializer) for e in entries):
        return []
    kinds = Counter(e.kind for e in entries if e.rule != "not a weight matrix")
    seen = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) or "no weight matrices"
    kept = sum(e.rule.startswith("keep_bf16.") for e in entries)
    fell = [e for e in entries if e.note.startswith("BF16 fallback")]
    why = (f"decided nothing: keep_bf16 (first: {config.keep_bf16.first}, last: {config.keep_bf16.last}) keeps "
           f"{kept} matrices BF16 and the rest matched no rule" if kept else "matched no tensor")
    if fell:
        why = (f"matched {len(fell)} tensors, all kept BF16 by on_unsupported: bf16 "
               f"({fell[0].name}: {fell[0].note.removeprefix('BF16 fallback: ')})")
    preset = getattr(config, "preset", None)
    hint = (f"; these rules come from preset {preset!r}: choose a preset or write rules for the kinds this model "
            "has ('qstrat list' shows the presets and selectors)" if preset and not fell else "")
    return [f"the config quantizes nothing in this model: {'; '.join(asked)} {why}; "
            f"layout {layout!r} sees {seen}{hint}"]


def idle_rules(entries: Sequence[PlanEntry], config: RefitConfig) -> list[str]:
    """Warning lines, one per rule of ``config`` that decided no entry of the plan.

    A rule decides an entry when it is the first rule that selects it and nothing before the
    rules (``keep_bf16``, a never-quantized kind) decided it (``entry.rule == "rules[i]"``).
    A rule deciding nothing is legal (a config shared by several models), so this warns; a
    config whose quantizing rules all decide nothing is the :func:`quantizes_nothing` error.

    Args:
        entries: the plan's entries; config: the expanded config the plan was made with.
    Returns: ``rules[i] (select, include, exclude -> serializer) decided no tensor of this
        model: ...`` per idle rule, in rule order (empty when every rule decided something).
    """
    used = {e.rule for e in entries}
    lines = []
    for i, r in enumerate(config.rules):
        if f"rules[{i}]" in used:
            continue
        what = ", ".join(r.select) + "".join(f" {k} {v}" for k, v in (("include", r.include), ("exclude", r.exclude))
                                             if v)
        lines.append(f"rules[{i}] ({what} -> {r.serializer}) decided no tensor of this model: its selectors "
                     "or patterns match none here, or an earlier rule, keep_bf16 or a never-quantized kind "
                     "decided each match (`qstrat plan` lists which rule decided each tensor)")
    return lines


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" ... and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
