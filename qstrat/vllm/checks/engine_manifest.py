"""The engine manifest: every checkpoint tensor an engine accepts, grouped into its reload units.

vLLM's layerwise reload has no rollback (docs/vllm.md, "What a refit checks"): an unknown name or
a wrong shape fails half-way and leaves the engine unusable; a wrong dtype is cast silently; a
reload unit that receives only part of its tensors is processed with uninitialised memory. So a
refit is checked against an :class:`EngineManifest` before the first byte is sent.

The manifest comes from what the ENGINE was started with, never from the trainer's tensors:

1. the model's tensors from its config.json alone (:func:`qstrat.layouts.skeleton.model_tensors`: the
   layout's names, HF modeling shapes), routed experts both per expert and as grouped slabs;
2. which modules the engine serves quantized: with a ``quantization_config``, every weight
   matrix of a decoder layer (attention, MLP, experts, routers) - and ``lm_head`` for ModelOpt
   methods, which quantize a ``ParallelLMHead`` too - that the engine's ignore list does not
   exclude, read by vLLM's rule for the engine's method (:mod:`qstrat.vllm.checks.engine_ignore`: exact for
   ``fp8``, also substrings and wildcards for ModelOpt, ``re:`` for compressed-tensors; fused
   modules under vLLM's fused name); embeddings and norms never;
3. the checkpoint tensors of a quantized module from the format's part specs (the registered
   serializer that serves the engine's config by its own rule, :func:`engine_format`):
   exact names, shapes and dtypes; every other tensor in the engine's dtype (any float dtype
   is accepted for those: vLLM casts them as it does on a first load);
4. reload units: the vLLM module each tensor loads into (a fused q/k/v or gate/up group is one
   module, a layer's routed experts are one module), and the part of the model each unit
   belongs to (a decoder layer index, or a top-level module name) for explicit partial refits.

:func:`qstrat.vllm.engine_manifest` builds it for a live engine and cross-checks its units with
vLLM's own record of the model (:mod:`qstrat.vllm.adapter.model_record`). This module does not import vLLM.
"""
from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from qstrat.vllm.checks.engine_ignore import ignore_entries, quantizes_lm_head, unquantized_modules
from qstrat.config.format_names import format_title
from qstrat.errors import ConfigOnlyUnsupportedError, EngineManifestError, PlanError, UnsupportedShapeError
from qstrat.layouts.model_layout import ModelLayout
from qstrat.layouts.model_config import ModelConfig
from qstrat.plan.data import RefitPlan, natural_key
from qstrat.plan.outputs import fused_name, fusion_group
from qstrat.plan.planner import FLOAT_INPUTS
from qstrat.plugins.registry import Registry
from qstrat.config.rules import is_weight_matrix
from qstrat.serializers.base import Serializer, dtype_name
from qstrat.layouts.skeleton import model_tensors

#: Kinds whose weight matrices vLLM builds as linear / MoE layers (quantized unless ignored).
LINEAR_KINDS = frozenset({"attention", "dense_mlp", "expert", "shared_expert", "router", "linear"})
#: Floating dtypes a module the engine serves unquantized accepts (cast to the engine's dtype).
CASTABLE = frozenset(dtype_name(d) for d in FLOAT_INPUTS)
#: Error lines shown before "... and N more".
MAX_LINES = 25


@dataclass(frozen=True)
class ManifestTensor:
    """One checkpoint tensor the engine accepts.

    Attributes:
        name: checkpoint name (``model.layers.0.self_attn.q_proj.weight_scale_inv``).
        shape: exact shape; dtype: exact dtype name for a quantized module's parts, else the
            engine's dtype (any of :data:`CASTABLE` is accepted and cast).
        unit: the reload unit it belongs to; form: ``""``, or ``"per_expert"`` / ``"fused"``
            for routed experts (a refit sends one form per unit).
        quantized: part of a module the engine serves quantized.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    unit: str
    form: str = ""
    quantized: bool = False

    def accepts(self, dtype: str) -> bool:
        """Whether a tensor of ``dtype`` loads correctly (exact for quantized parts)."""
        return dtype == self.dtype if self.quantized else dtype in CASTABLE


@dataclass(frozen=True)
class ManifestUnit:
    """One reload unit: the vLLM module that is processed once all of its tensors have arrived.

    Attributes:
        name: vLLM module prefix (``model.layers.0.self_attn.o_proj``), a fused group key
            (``model.layers.0.self_attn.{q_proj,k_proj,v_proj}``) or the experts module
            (``model.layers.0.mlp.experts``).
        part: the decoder layer index, or the top-level module name (``model.embed_tokens``,
            ``model.norm``, ``lm_head``): what a partial refit updates whole.
        kind: layout kind (``attention``, ``expert``, ``norm``...); quantized: served quantized.
        forms: form -> tensor names; one form (``""``), or ``per_expert`` and (where every part
            of the format is [E, ...] 3-D, as vLLM's FusedMoE loader requires) ``fused``.
    """

    name: str
    part: int | str
    kind: str
    quantized: bool
    forms: Mapping[str, tuple[str, ...]]


@dataclass
class EngineManifest:
    """What an engine accepts. Build it with :func:`build_manifest` (or
    :func:`qstrat.vllm.engine_manifest` for a live engine).

    Attributes:
        tensors: name -> :class:`ManifestTensor`; units: name -> :class:`ManifestUnit`.
        layout: the layout used; num_layers, num_experts: from the model config.
        format: the engine's quantized format (serializer name) or None; dtype: engine dtype.
        dropped: names the engine accepts and ignores (a tied ``lm_head.weight``) -> tensor.
        platform: where the engine runs (``cpu``, ``cuda``...), if known.
    """

    tensors: dict[str, ManifestTensor]
    units: dict[str, ManifestUnit]
    layout: ModelLayout
    num_layers: int
    num_experts: int | None
    format: str | None
    dtype: str
    dropped: dict[str, ManifestTensor] = field(default_factory=dict)
    platform: str | None = None

    def parts(self) -> list[int | str]:
        """Every part a partial refit may name: decoder layer indices, then top-level modules."""
        found = {u.part for u in self.units.values()}
        return sorted(p for p in found if isinstance(p, int)) + sorted(p for p in found if isinstance(p, str))

    def parts_sent(self, plan: RefitPlan) -> set[int | str]:
        """The parts (see :meth:`parts`) that ``plan`` sends at least one tensor of."""
        return {self.units[t.unit].part for e in plan.entries for o in e.outputs
                if (t := self.tensors.get(o.name)) is not None}

    @cached_property
    def _suffixes(self) -> dict[str, set[str]]:
        """module prefix -> the suffixes the engine takes for it."""
        out: dict[str, set[str]] = {}
        for t in self.tensors.values():
            module, _, suffix = t.name.rpartition(".")
            out.setdefault(module, set()).add(suffix)
        return out

    def explain_unknown(self, name: str) -> str:
        """Why ``name`` is not a tensor of this engine (for error messages)."""
        p = self.layout.parse(name, self.num_layers)
        if p.kind == "expert" and p.expert is not None and self.num_experts and p.expert >= self.num_experts:
            return (f"expert index {p.expert} is out of range: the engine's model has {self.num_experts} "
                    f"experts per layer (0..{self.num_experts - 1})")
        if p.kind == "mtp":
            where = (f"decoder layer {p.layer} does not exist: the engine's model has {self.num_layers} "
                     "decoder layers" if p.layer is not None else "an MTP layer is not part of the engine's model")
            return (f"{where} (MTP layers load only into a speculative-decoding draft model, and vLLM's "
                    "reload_weights reloads the main model only: the drafter would keep its old weights)")
        module, _, suffix = name.rpartition(".")
        unit = self.units.get(module)
        if unit is not None and unit.kind == "expert" and "fused" not in unit.forms:
            return (f"the engine takes {module} per expert only: vLLM loads a fused expert slab part "
                    f"only as an [E, ...] 3-D tensor, and {self.format} has per-expert scalars (use "
                    "expert_emission: per_expert)")
        known = sorted(self._suffixes.get(module, ()))
        if known:
            return (f"the engine's {module} takes {', '.join(known)}, not {suffix} (vLLM would drop it "
                    "silently or fail half-way)")
        return "the engine's model has no such tensor (vLLM would fail half-way or drop it silently)"


def engine_format(quantization_config: Mapping[str, Any] | None, registry: Registry) -> Serializer | None:
    """The registered quantizing format (default options) that serves ``quantization_config``
    (its :meth:`~qstrat.serializers.Serializer.matches_engine_config`, the format's own rule),
    or None for an unquantized engine.

    Raises: EngineManifestError if no registered format serves that config (each format's
        reason is listed), or if more than one does (qstrat could not tell which tensors the
        engine accepts).
    """
    if not quantization_config:
        return None
    found: list[Serializer] = []
    reasons: list[str] = []
    for entry in registry.serializers.values():
        if not entry.obj.quantizes:
            continue
        try:
            ser = entry.obj()
        except (TypeError, ValueError):  # a format without usable defaults
            continue
        why = ser.engine_config_mismatch(quantization_config)
        if why is None:
            found.append(ser)
        else:
            reasons.append(f"{entry.name}: {why}")
    if len(found) > 1:
        raise EngineManifestError(f"formats {[s.name for s in found]} all serve the engine's quantization_config "
                                  f"{dict(quantization_config)}: qstrat cannot tell which tensors it accepts "
                                  "(a format's engine_config_mismatch must refuse the other formats' configs)")
    if not found:
        raise EngineManifestError(f"no registered format writes the engine's quantization_config "
                                  f"{dict(quantization_config)}: qstrat cannot tell which tensors it accepts "
                                  f"({'; '.join(reasons)})")
    return found[0]


def config_format_mismatch(config: Mapping[str, Any] | None, engine_config: Mapping[str, Any] | None,
                           registry: Registry) -> str | None:
    """:func:`plan_format_mismatch` for a plan known only by its ``vllm_quantization_config()``
    (as a transport round names it): the registered format that writes ``config`` (default
    options) against ``engine_config``; the same reasons in the same words.

    Raises: EngineManifestError if no registered format writes ``config``.
    """
    if (config is None) != (engine_config is None):
        return (f"{engine_started_for(engine_config, registry)}: engine quantization_config {engine_config} "
                f"does not match the plan's {config}")
    own = engine_format(config, registry) if config is not None else None
    why = own.engine_config_mismatch(engine_config) if own is not None else None
    return None if why is None else (f"{engine_started_for(engine_config, registry)}, the plan writes "
                                     f"{format_title(own.name)}: {why} (the engine does not serve the plan's format "
                                     f"{own.name})")


def engine_started_for(engine_config: Mapping[str, Any] | None, registry: Registry) -> str:
    """The engine's format in qstrat's words, with vLLM's beside it: ``"the engine was started
    for NVFP4 (vLLM: quant_method 'modelopt', quant_algo 'NVFP4')"`` (the registered format that
    serves ``engine_config``: :func:`engine_format`), ``"the engine was started unquantized"``, or
    ``"the engine was started for a format qstrat does not write (vLLM: quant_method 'awq')"``."""
    if not engine_config:
        return "the engine was started unquantized (no quantization_config)"
    nested = engine_config.get("quantization")
    algo = engine_config.get("quant_algo") or (nested.get("quant_algo") if isinstance(nested, Mapping) else None)
    vllm = f"vLLM: quant_method {engine_config.get('quant_method')!r}" + (f", quant_algo {algo!r}" if algo else "")
    try:
        ser = engine_format(engine_config, registry)
    except EngineManifestError:
        return f"the engine was started for a format qstrat does not write ({vllm})"
    return f"the engine was started for {format_title(ser.name) if ser else 'no format'} ({vllm})"


def plan_format_mismatch(plan: RefitPlan, engine_config: Mapping[str, Any] | None,
                         registry: Registry) -> str | None:
    """Why the engine does not serve the plan's format (a refusal reason), or None when it does:
    both unquantized, or every quantizing format of the plan (with the plan's options) serves
    ``engine_config`` (:meth:`~qstrat.serializers.Serializer.engine_config_mismatch`).

    A plan (or a part of one) with a ``quantization_config`` but no quantized entry is checked
    with the registered format that serves its own config.

    Args: plan: the validated plan; engine_config: the engine's ``quantization_config`` (None:
        unquantized); registry: where the plan's formats are looked up.
    Raises: EngineManifestError if no registered format serves the plan's own config.
    """
    mine = plan.vllm_quantization_config()
    if mine is None or engine_config is None:
        return config_format_mismatch(mine, engine_config, registry)
    formats: dict[tuple[str, str], Serializer] = {}
    for e in plan.entries:
        entry = registry.serializers.get(e.serializer)
        if entry is not None and entry.obj.quantizes and (e.serializer, repr(e.options)) not in formats:
            formats[(e.serializer, repr(e.options))] = registry.serializer(e.serializer, **e.options)
    if not formats:  # e.g. one rank's share of the plan: only unquantized tensors
        return config_format_mismatch(mine, engine_config, registry)
    for ser in formats.values():
        why = ser.engine_config_mismatch(engine_config)
        if why is not None:
            return (f"{engine_started_for(engine_config, registry)}, the plan writes {format_title(ser.name)}: "
                    f"{why} (the engine does not serve the plan's format {ser.name})")
    return None


def ignore_list(quantization_config: Mapping[str, Any] | None) -> list[str]:
    """The modules a quantization_config leaves unquantized, from the key the engine's vLLM method
    reads (:func:`qstrat.vllm.checks.engine_ignore.ignore_entries`: ``ignored_layers``, ModelOpt ``ignore`` or
    nested ``quantization.exclude_modules``...). Which modules its entries exclude:
    :func:`qstrat.vllm.checks.engine_ignore.unquantized_modules`."""
    return ignore_entries(quantization_config)


def build_manifest(model_config: Any, quantization_config: Mapping[str, Any] | None,
                   layout: ModelLayout, registry: Registry, dtype: str | torch.dtype = "bfloat16",
                   platform: str | None = None, unbuilt: Collection[str] = (),
                   accept_mtp: bool = False) -> EngineManifest:
    """The manifest of an engine started on a checkpoint with this config (module docstring).

    Args:
        model_config: the engine's model config: a :class:`~qstrat.layouts.model_config.ModelConfig`, or
            config.json content parsed here (``text_config`` is used when present).
        quantization_config: the engine's checkpoint quantization_config (None: unquantized).
        layout: naming data of the model family; registry: where formats are looked up.
        dtype: the engine's model dtype; platform: recorded for platform-specific checks.
        unbuilt: name prefixes of towers the engine did not build (a multimodal model started
            without images: vLLM skips the vision tower and its weights); their tensors are
            accepted and dropped.
        accept_mtp: accept the model's MTP layers as optional tensors (``dropped``: a checkpoint
            may hold them; a running engine's main model does not load them, so by default they
            are unknown names).
    Returns: an :class:`EngineManifest`.
    Raises: EngineManifestError (unknown format, a config key the model needs is missing, a shape the
        format cannot represent, a fused module the ignore list splits).
    """
    config = ModelConfig.of(model_config)
    fmt = engine_format(quantization_config, registry)
    engine_dtype = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    num_layers = layout.num_layers(config)
    if num_layers is None:
        raise EngineManifestError(f"the engine's model config has no {layout.num_layers_key!r}")
    try:
        grouped = list(model_tensors(layout, config, grouped=True))
        if all(spec.splittable for spec in layout.slabs.values()):
            per_expert = list(model_tensors(layout, config))
            slabs = [(n, s) for n, s in grouped if layout.parse(n, num_layers).slab]
        else:  # experts that exist only as whole slabs (gpt-oss): the fused form only
            slabs = [(n, s) for n, s in grouped if layout.parse(n, num_layers).kind == "expert"]
            per_expert = [(n, s) for n, s in grouped if layout.parse(n, num_layers).kind != "expert"]
    except KeyError as exc:
        raise EngineManifestError(f"the engine's model config lacks {exc} (layout {layout.name})") from exc
    quantizable = LINEAR_KINDS | ({"lm_head"} if quantizes_lm_head(quantization_config) else set())
    # vLLM module -> kept unquantized by the engine's ignore list (vLLM's rule for its method)
    ignored = unquantized_modules(quantization_config, {layout.parse(n, num_layers).vllm_module
                                                        for n, _ in per_expert + slabs}, layout.fused)
    tensors: dict[str, ManifestTensor] = {}
    dropped: dict[str, ManifestTensor] = {}
    members: dict[str, dict[str, list[str]]] = {}
    unit_info: dict[str, tuple[int | str, str, set[bool]]] = {}
    if fmt is not None and any(len(s.shape) != 3 for _, shape in slabs[:1] for s in fmt.part_specs(shape)):
        slabs = []  # vLLM loads a fused slab part only as [E, ...] 3-D (FusedMoE load_weights)
    for items, slab_form in ((per_expert, False), (slabs, True)):
        for name, shape in items:
            p = layout.parse(name, num_layers)
            if p.kind == "mtp":  # loaded by a speculative-decoding drafter only (docs/vllm.md)
                if accept_mtp:
                    dropped[name] = ManifestTensor(name, tuple(shape), engine_dtype, "")
                continue
            if unbuilt and name.startswith(tuple(unbuilt)):
                dropped[name] = ManifestTensor(name, tuple(shape), engine_dtype, "")
                continue
            # a bias belongs to its weight's fused unit (q/k/v biases load with qkv_proj)
            weight = layout.parse(f"{p.module}.weight", num_layers) if p.param == "bias" else p
            unit = p.vllm_module if p.kind == "expert" else (fusion_group(layout, weight) or p.module)
            form = ("fused" if slab_form else "per_expert") if p.kind == "expert" else ""
            matrix = p.kind in quantizable and is_weight_matrix(p, len(shape))
            quantized = fmt is not None and matrix and not ignored[p.vllm_module]
            for t in _checkpoint_tensors(name, shape, p.module, slab_form, fmt if quantized else None,
                                         engine_dtype, unit, form):
                tensors[t.name] = t
                members.setdefault(unit, {}).setdefault(form, []).append(t.name)
            part = p.layer if p.layer is not None else (
                _tower(layout, name) if p.kind == "non_decoder" else p.module)
            statuses = unit_info.setdefault(unit, (part, p.kind, set()))[2]
            if matrix:  # a module's bias or norm follows its weight matrix
                statuses.add(quantized)
    units = {}
    for unit, (part, kind, statuses) in unit_info.items():
        if len(statuses) > 1:
            raise EngineManifestError(f"{unit}: the engine's ignore list covers some of this fused module's "
                                "members but not all (vLLM refuses such a checkpoint)")
        forms = {f: tuple(sorted(ns, key=natural_key)) for f, ns in members[unit].items()}
        units[unit] = ManifestUnit(unit, part, kind, bool(statuses and statuses.pop()), forms)
    if config.tie_word_embeddings and layout.lm_heads:
        emb = tensors[f"{layout.embeddings[0]}.weight"]
        name = f"{layout.lm_heads[0]}.weight"
        dropped[name] = ManifestTensor(name, emb.shape, emb.dtype, "")
    return EngineManifest(tensors, units, layout, num_layers, layout.num_experts(config),
                          fmt.name if fmt else None, engine_dtype, dropped, platform)


def _tower(layout: ModelLayout, name: str) -> str:
    """The part a non-decoder tensor belongs to: its tower's prefix (``model.visual``)."""
    return next(p for p in layout.non_decoder_prefixes if name.startswith(p)).rstrip(".")


def _checkpoint_tensors(name: str, shape: tuple[int, ...], module: str, slab: bool, fmt: Serializer | None,
                        dtype: str, unit: str, form: str) -> list[ManifestTensor]:
    if fmt is None:
        return [ManifestTensor(name, tuple(shape), dtype, unit, form)]
    try:
        specs = fmt.part_specs(shape)
    except UnsupportedShapeError as exc:
        raise EngineManifestError(f"{name}: {exc} (the engine serves it quantized)") from exc
    return [ManifestTensor(fused_name(name, s.suffix) if slab else f"{module}.{s.suffix}", tuple(s.shape),
                           dtype_name(s.dtype), unit, form, True) for s in specs]


def check_plan(plan: RefitPlan, manifest: EngineManifest,
               layers: Collection[int | str] | None = None,
               against: str = "what the engine accepts (nothing was sent)") -> None:
    """Raise PlanError unless every tensor the plan emits is one the engine accepts and every
    reload unit gets all of its tensors or none.

    Checks each output's name, shape and dtype (a quantized module's parts exactly; others any
    float dtype), that one form (per expert or fused slabs) is used per experts unit and is
    complete, and completeness: without ``layers`` the plan must cover every unit; with
    ``layers`` (decoder layer indices and/or top-level module names, see
    :meth:`EngineManifest.parts`) exactly the units of those parts, each completely.

    Args:
        plan: the validated plan; manifest: the engine's; layers: an explicit partial refit;
        against: what the manifest stands for, in the error's first line.
    Raises: PlanError listing every problem (the first :data:`MAX_LINES`), naming the tensors.
    """
    if isinstance(layers, (int, str)):  # one part given bare
        layers = [layers]
    found: dict[tuple[str, str], list[str]] = {}  # (unit or module, problem) -> messages
    sent: dict[str, str] = {}  # output name -> the input it comes from
    touched: dict[str, set[str]] = {}
    for e in plan.entries:
        for o in e.outputs:
            sent[o.name] = e.name
            origin = "" if e.name == o.name else f" (from {e.name})"
            m = manifest.tensors.get(o.name) or manifest.dropped.get(o.name)
            if m is None:
                where = manifest.layout.parse(o.name, manifest.num_layers).vllm_module
                found.setdefault((where, "unknown"), []).append(
                    f"{o.name}{origin}: {manifest.explain_unknown(o.name)}")
                continue
            if tuple(o.shape) != m.shape:
                found.setdefault((m.unit, "shape"), []).append(
                    f"{o.name}{origin}: shape {list(o.shape)}, the engine expects {list(m.shape)}")
            if not m.accepts(o.dtype):
                why = (f"{m.unit} is served quantized ({manifest.format})" if m.quantized else
                       f"{m.unit} is served unquantized in {manifest.dtype}")
                found.setdefault((m.unit, "dtype"), []).append(
                    f"{o.name}{origin}: dtype {o.dtype}, the engine expects {m.dtype} ({why})")
            if m.unit:
                touched.setdefault(m.unit, set()).add(o.name)
    errors = [msgs[0] + (f" (and {len(msgs) - 1} more tensors of {where} alike)" if len(msgs) > 1 else "")
              for (where, _), msgs in found.items()]
    for unit, names in touched.items():
        errors += _unit_errors(manifest.units[unit], names, sent)
    errors += _coverage_errors(manifest, set(touched), layers)
    if errors:
        more = len(errors) - MAX_LINES
        shown = errors[:MAX_LINES] + ([f"... and {more} more"] if more > 0 else [])
        raise PlanError(f"the refit does not match {against}:\n  " + "\n  ".join(shown))


def _unit_errors(unit: ManifestUnit, names: set[str], sent: Mapping[str, str]) -> list[str]:
    forms = {f for f, ns in unit.forms.items() if names & set(ns)}
    if len(forms) > 1:
        return [f"{unit.name}: the plan sends both per-expert and fused slab tensors; the engine "
                "loads one form"]
    expected = unit.forms[forms.pop()]
    missing = [n for n in expected if n not in sent]
    if not missing:
        return []
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return [f"{unit.name}: the plan sends {len(expected) - len(missing)} of its {len(expected)} tensors; "
            f"vLLM would process it with uninitialised memory for the rest. Missing: {shown}"]


def _coverage_errors(manifest: EngineManifest, touched: set[str],
                     layers: Collection[int | str] | None) -> list[str]:
    parts = manifest.parts()
    if layers is None:
        left_out = sorted({_part_label(u.part) for u in manifest.units.values() if u.name not in touched},
                          key=natural_key)
        if not left_out:
            return []
        return [f"the refit leaves out {_few(left_out)} of the engine's model (a refit updates every "
                "layer; for an explicit partial refit of whole layers pass plan=driver.plan(...)"
                ".only_layers([...]))"]
    wanted = set(layers)
    errors = [f"{p!r} is not a part of the engine's model "
              f"(parts: decoder layers 0..{manifest.num_layers - 1} and "
              f"{[x for x in parts if isinstance(x, str)]})"
              for p in sorted(wanted - set(parts), key=str)]
    for u in manifest.units.values():
        if u.part in wanted and u.name not in touched:
            errors.append(f"{_part_label(u.part)} is refit partially: the plan sends nothing for {u.name} "
                          "(a partial refit updates whole layers)")
        elif u.part not in wanted and u.name in touched:
            errors.append(f"the plan sends {u.name}, but {_part_label(u.part)} is not among the layers "
                          "refit")
    return errors


def _part_label(part: int | str) -> str:
    return f"decoder layer {part}" if isinstance(part, int) else part


def _few(items: Sequence[str], limit: int = 6) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_model_tensors(plan: RefitPlan, model_config: Any, layout: ModelLayout,
                        registry: Registry, partial: bool = False,
                        cache: dict[Any, EngineManifest] | None = None) -> bool:
    """Check ``plan`` against the tensors ``model_config`` implies: the manifest of an engine started on
    the plan's own checkpoint (:func:`build_manifest` with the plan's ``quantization_config``, MTP
    layers optional) and :func:`check_plan` - the same check ``qstrat.vllm.refit`` makes against a
    live engine, for sinks without one (``write_checkpoint``, ``RefitSender.refit``): a missing or
    extra tensor, a wrong shape (a transposed projection, a padded vocabulary) or dtype, a reload
    unit sent in part.

    Args:
        plan: the validated plan; model_config: the model's :class:`~qstrat.layouts.model_config.ModelConfig`
            or config.json content (None or empty: nothing to check);
        layout, registry: the driver's; partial: the plan was given (an explicit partial refit:
            whole parts, not every layer); cache: where manifests are kept between calls, by
            model config and quantization_config (a sender's rounds; building one for
            DeepSeek-V3 takes seconds).
    Returns: True if checked; False when the layout cannot derive the model's tensors from
        the config (a structure it does not generate, the ``generic`` layout, a key it lacks).
    Raises: PlanError naming every problem (:func:`check_plan`); EngineManifestError for an ignore
        list vLLM would refuse or read two ways.
    """
    config = ModelConfig.of(model_config)
    if not config or layout.num_layers(config) is None:
        return False
    qc = plan.vllm_quantization_config()
    key = (layout.name, config.key, json.dumps(qc, sort_keys=True, default=repr))
    manifest = cache.get(key) if cache is not None else None
    if manifest is None:
        try:
            manifest = build_manifest(config, qc, layout, registry, accept_mtp=True)
        except ConfigOnlyUnsupportedError:
            return False
        except EngineManifestError as exc:
            if isinstance(exc.__cause__, KeyError):  # the config lacks a key: nothing to derive from
                return False
            raise
        if cache is not None:
            if len(cache) >= 4:  # a driver meets one model config (and a few formats)
                cache.clear()
            cache[key] = manifest
    check_plan(plan, manifest, manifest.parts_sent(plan) if partial else None,
               against="the model's tensors (from its config; nothing was written or sent)")
    return True


def model_tensors_check(driver: Any, model_config: ModelConfig | None = None) -> Any:
    """The ``model tensors`` :class:`~qstrat.execute.prepare.SinkCheck` of a sink without an engine
    (``write_checkpoint``, ``RefitSender.refit``): :func:`check_model_tensors` with the driver's
    layout and registry, against ``model_config`` (default: the driver's), partial when the plan was
    given."""
    from qstrat.execute.prepare import SinkCheck

    def run(p: Any) -> bool:
        cfg = model_config if model_config is not None else driver.model_config
        return check_model_tensors(p.plan, cfg, driver.layout, driver.registry, p.plan_given,
                                   driver.plan_cache.manifests)
    return SinkCheck("model tensors", run)
