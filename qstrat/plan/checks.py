"""Whole-plan checks: what no single tensor's decision can catch.

Each function takes the planned entries and returns one error line per problem (the planner
collects them all and raises one :class:`~qstrat.errors.PlanError`), except
:func:`ignored_layers`, which also returns the engine's ignore list.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from qstrat.plan.data import PlanEntry, natural_key


def check_groups(entries: Sequence[PlanEntry]) -> list[str]:
    """Members of one engine-fused group (q/k/v, gate/up) must share serializer and options."""
    seen: dict[str, PlanEntry] = {}
    errors = []
    for e in entries:
        if not e.group:
            continue
        first = seen.setdefault(e.group, e)
        if (first.serializer, first.options) != (e.serializer, e.options):
            errors.append(f"{e.name} ({e.serializer} {e.options}, {e.rule}) and {first.name} "
                          f"({first.serializer} {first.options}, {first.rule}) are fused by the engine "
                          "but planned differently")
    return errors


def check_outputs(entries: Sequence[PlanEntry]) -> list[str]:
    """No two inputs may emit the same checkpoint name (e.g. per-expert names AND a slab)."""
    owner: dict[str, str] = {}
    errors = []
    for e in entries:
        for o in e.outputs:
            if o.name in owner:
                errors.append(f"{e.name} and {owner[o.name]} both emit {o.name}")
            owner[o.name] = e.name
    return errors


def check_expert_inputs(entries: Sequence[PlanEntry], num_experts: int | None) -> list[str]:
    """One layer's experts come either as grouped slabs or as per-expert tensors, never both
    (with fused emission both would reach the engine); a slab's E must match ``num_experts``
    (the model config's routed expert count; None: not checked)."""
    per_expert = {e.engine_module for e in entries if e.kind == "expert" and e.expert is not None}
    errors = []
    for e in entries:
        if e.kind != "expert" or e.expert is not None or len(e.shape) != 3:
            continue
        if e.engine_module in per_expert:
            errors.append(f"{e.name}: {e.engine_module} is given both as grouped slabs and as "
                          "per-expert tensors")
        if num_experts and e.shape[0] != num_experts:
            errors.append(f"{e.name}: slab holds {e.shape[0]} experts, the model config says {num_experts}")
    return errors


def ignored_layers(entries: Sequence[PlanEntry], errors: list[str],
                   quantizes: Callable[[PlanEntry], bool]) -> list[str]:
    """vLLM module prefixes of unquantized matrices (routers and vision towers included: vLLM
    builds a vision tower's linears with the model's quantization config; embeddings and MTP
    blocks, which the main model does not load, excluded), in natural order. Appends an error
    for a module with both quantized and unquantized tensors (vLLM loads a module with one
    quantization method)."""
    status: dict[str, bool] = {}
    mixed: set[str] = set()
    for e in entries:
        if len(e.shape) < 2 or e.kind in ("embedding", "mtp") or e.name.endswith((".bias", "_bias")):
            continue
        quantized = quantizes(e)
        mod = e.engine_module
        if mod in status and status[mod] != quantized and mod not in mixed:
            mixed.add(mod)
            errors.append(f"{mod}: some of its tensors are quantized and some are not; vLLM loads it "
                          "as one module")
        status.setdefault(mod, quantized)
    return sorted((m for m, q in status.items() if not q), key=natural_key)
