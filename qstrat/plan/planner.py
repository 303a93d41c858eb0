"""The planner: every input tensor's decision, outputs and checks, from names, shapes and dtypes.

:meth:`Planner.plan` needs no values (``meta`` tensors plan as well as real ones). For each input,
in natural name order (producer order for ``wire_order: producer``): parse the name (the layout), decide (the rules), check the dtype and that
the format can represent the shape (``on_unsupported: bf16`` falls back visibly), declare the
checkpoint tensors it emits - whole, per expert (a slab cut into ``experts.{e}.{proj}``) or as a
fused slab (:mod:`qstrat.plan.outputs`) - and the engine-fusion group it belongs to. Then the whole-plan checks
(:mod:`qstrat.plan.checks`), the engine's ignore list and its one ``quantization_config``.
Every problem is collected and raised together as one :class:`~qstrat.errors.PlanError`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from qstrat.config.loader import RefitConfig
from qstrat.errors import PlanError, UnsupportedShapeError
from qstrat.layouts.model_layout import ModelLayout
from qstrat.layouts.model_config import ModelConfig
from qstrat.plan import checks, structure
from qstrat.plan.engine_config import SerializerFactory, engine_config, format_lookup, quantizes_lookup
from qstrat.plan.fallbacks import engine_fusions, whole_module_fallbacks
from qstrat.plan.families import families_for
from qstrat.plan.fixes import ShapeRefused, nothing_else_quantized, one_line_per_cause, quantize_something
from qstrat.plan.outputs import OutputDeclaration, fusion_group
from qstrat.plan.data import (PASSTHROUGH, OutputTensor, PlanEntry, RefitPlan, gc_paused, natural_keys,
                              order_entries)
from qstrat.config.rules import Decision, RuleSet, is_weight_matrix
from qstrat.serializers.base import dtype_name, tensor_nbytes

#: Weight dtypes a serializer accepts (an int, bool or already-quantized input is a plan error).
FLOAT_INPUTS = frozenset({torch.bfloat16, torch.float16, torch.float32})

def _dtype_hint(dtype: torch.dtype) -> str:
    """What to do about an input dtype qstrat does not read (appended to the plan error)."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        return (" (already quantized? qstrat quantizes the trainer's BF16 weights; an fp8 tensor "
                "can be neither re-quantized nor passed through)")
    if dtype == torch.float64:
        return " (cast it to float32 or bfloat16)"
    return " (not a floating-point weight: leave buffers such as masks or position ids out of the refit)"




class Planner:
    """Plans a refit for one config, layout and model.

    Args:
        config: the validated config (expert_emission, keep_bf16).
        layout: the model family's naming data.
        rules: the config's compiled rules.
        serializer: returns the serializer instance for (name, options).
        model_config: the model's parsed config (decoder depth, expert count); may be empty.
    """

    def __init__(self, config: RefitConfig, layout: ModelLayout, rules: RuleSet,
                 serializer: SerializerFactory, model_config: ModelConfig) -> None:
        self.config = config
        self.layout = layout
        self.rules = rules
        self.serializer = serializer
        self.model_config = model_config
        self.declare = OutputDeclaration(config.expert_emission, layout.slabs)

    def num_layers(self, names: Any = ()) -> int | None:
        """Decoder depth from the HF config, else 1 + the largest decoder layer index in ``names``."""
        n = self.layout.num_layers(self.model_config)
        if n is not None:
            return n
        layers = [p.layer for p in (self.layout.parse(x) for x in names) if p.layer is not None]
        return max(layers) + 1 if layers else None

    def decide(self, name: str, shape: tuple[int, ...], num_layers: int | None) -> Decision:
        """The rules' decision for one tensor (no dtype or shape support check)."""
        p = self.layout.parse(name, num_layers)
        return self.rules.decide(p, is_weight_matrix(p, len(shape)), num_layers)

    def plan(self, tensors: Mapping[str, Any]) -> RefitPlan:
        """The plan of ``tensors`` (name -> anything with ``.shape`` and ``.dtype``).

        Raises: PlanError listing every problem found (not only the first).
        """
        with gc_paused():
            return self._plan(tensors)

    def _plan(self, tensors: Mapping[str, Any]) -> RefitPlan:
        num_layers = self.num_layers(tensors)
        errors: list[str] = []
        if self.config.keep_bf16.last and self.layout.num_layers(self.model_config) is None:
            errors.append(f"keep_bf16.last needs the decoder depth: pass hf_config with "
                          f"{self.layout.num_layers_key!r} (inferring it from names would miscount "
                          "MTP layers and pipeline-parallel shards)")
        entries = []
        order = self.config.wire_order
        names = list(tensors)
        if order != "producer":
            keys = natural_keys(names)
            names = [names[k] for k in sorted(range(len(names)), key=keys.__getitem__)]
        families = families_for(self.layout, self.rules, num_layers)  # None: every entry the full way
        refused: list[tuple[str, Exception]] = []
        for name in names:
            t = tensors[name]
            shape, dtype = t.shape, t.dtype  # torch.Size: a family key as is (a derived entry holds a tuple)
            if type(shape) is not torch.Size:  # another object's shape (a lazy handle's): read as the full way does
                shape = tuple(shape)
            try:
                e = families.entry(name, shape, dtype) if families is not None else None
                if e is None:
                    shape = tuple(shape)
                    e = self.entry(name, shape, dtype, num_layers)
                    if families is not None:
                        families.learn(name, shape, dtype, e)
                entries.append(e)
            except (PlanError, UnsupportedShapeError) as exc:
                errors.append(f"{name}: {exc}")
                refused.append((name, exc))
        entries = order_entries(entries, order, names_sorted=order == "natural")
        whole_module_fallbacks(self, entries, num_layers, errors)
        errors += checks.check_groups(entries, self.checkpoint_form) + checks.check_outputs(entries)
        engine_fusions(self, entries, num_layers, errors)
        num_experts = self.layout.num_experts(self.model_config)
        errors += checks.check_expert_inputs(entries, num_experts) + checks.check_ranks(entries)
        errors += checks.check_expert_sets(entries, num_experts, self.layout.slabs)
        errors += structure.unplaced_matrices(entries, self.layout.name, self.config)
        errors += structure.layers_past_the_model(entries, self.layout.num_layers(self.model_config),
                                                  self.layout.num_mtp_layers(self.model_config))
        errors += [line + quantize_something(self, entries) for line in structure.quantizes_nothing(
            entries, self.layout.name, self.config, lambda s: self.serializer(s, {}).quantizes)]
        errors += nothing_else_quantized(self, entries, refused, num_layers)
        format_of = format_lookup(self.serializer, entries)
        ignored = checks.ignored_layers(entries, errors, quantizes_lookup(format_of))
        ignored += checks.tied_lm_head(entries, self.layout, self.model_config)
        qconfig = engine_config(entries, ignored, errors, format_of)
        if errors:
            raise PlanError("refit plan is invalid:\n  " + "\n  ".join(one_line_per_cause(errors)))
        return RefitPlan(entries, self.layout.name, num_layers, ignored, qconfig, self.config.to_dict(),
                         order=order)

    def entry(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              num_layers: int | None) -> PlanEntry:
        """The plan entry of one input. Raises PlanError / UnsupportedShapeError naming the cause."""
        if shape and min(shape) < 0:  # a lazy handle's header, a hand-made spec: never a real tensor
            raise PlanError(f"shape {list(shape)} has a negative dimension")
        p = self.layout.parse(name, num_layers)  # what decide() does, without a Decision object
        per_expert = self._per_expert_names(p, shape) if p.slab and self.rules.patterned else ()
        serializer, options, rule = self.rules.choose(p, is_weight_matrix(p, len(shape)), num_layers, per_expert)
        dname = dtype_name(dtype)
        if dtype not in FLOAT_INPUTS:
            what = (f"is sent unchanged ({rule})" if serializer == PASSTHROUGH
                    else f"is planned as {serializer} ({rule})")
            raise PlanError(f"{what} and needs a bfloat16/float16/float32 tensor, got {dname}"
                            f"{_dtype_hint(dtype)}")
        if serializer == PASSTHROUGH:
            outs = (OutputTensor(p.checkpoint_name, shape, dname, tensor_nbytes(shape, dtype)),)
            return PlanEntry(name, shape, dname, p.kind, p.layer, p.expert, rule, PASSTHROUGH,
                               {}, outs, None, "", p.vllm_module)
        ser = self.serializer(serializer, options)
        whole = self.layout.whole_slab_reason(p.projection, shape) if p.slab and ser.quantizes else None
        if whole:
            raise PlanError(f"{serializer} ({rule}): {whole}, so qstrat does not quantize them: keep them "
                            "BF16 (a rule 'select: [experts], serializer: bf16' first)")
        note = ""
        try:
            specs = ser.part_specs(shape)
        except UnsupportedShapeError as exc:
            config_rule = self.rules.rule_for(rule)
            if config_rule is None or config_rule.on_unsupported != "bf16":
                raise ShapeRefused(self, p, shape, serializer, rule, exc) from exc
            note = f"BF16 fallback: {exc}"
            serializer, options = "bf16", {}
            specs = self.serializer("bf16", {}).part_specs(shape)
        outs = self.declare.outputs(p, specs, shape, None if note else ser)
        return PlanEntry(name, shape, dname, p.kind, p.layer, p.expert, rule, serializer,
                           options, outs, fusion_group(self.layout, p), note, p.vllm_module)

    def _per_expert_names(self, p: ParsedName, shape: tuple[int, ...]) -> list[str]:
        """The per-expert checkpoint names a grouped slab ``[E, rows, K]`` stands for
        (``model.layers.1.mlp.experts.{e}.{part}.weight``: vLLM's names, a per-expert trainer's),
        which include/exclude patterns are matched against too (:meth:`qstrat.config.rules.CompiledRule.matches`);
        none for a slab that cannot be cut per expert (gpt-oss) or a shape without an expert dim."""
        spec = self.layout.slabs.get(p.projection)
        if spec is None or not spec.splittable or len(shape) != 3:
            return []
        return [f"{p.engine_module}.{e}.{part}.weight" for e in range(shape[0]) for part in spec.parts]

    def checkpoint_form(self, e: PlanEntry) -> tuple[str, str]:
        """What of ``e``'s format decides the bytes it emits: its serializer name and options with
        the defaults filled in, less those that never change a byte (``backend``: every backend
        gives the reference's bytes; ``chunk_elements``: chunking does not change them), so fused
        siblings planned with ``{"ue8m0": false}`` and ``{}`` are alike (:func:`checks.check_groups`)."""
        if e.serializer == PASSTHROUGH:
            return e.serializer, ""
        options = self.serializer(e.serializer, e.options).options
        return e.serializer, repr(sorted(options.model_dump(exclude={"backend", "chunk_elements"}).items()))
