"""The refit driver: plan every tensor, then quantize and emit in wire order.

Two visible stages. :meth:`RefitDriver.plan` resolves each input (HF name, tensor) to a rule, a
serializer and its outputs - names, shapes, dtypes, bytes - and fails, before any quantization,
on everything a user can fix (unsupported shapes, mixed formats the engine cannot load, fused
shards with different formats, duplicate outputs). :meth:`RefitDriver.run` re-plans, then
yields ``(checkpoint_name, tensor)`` pairs in the plan's wire order; a grouped expert slab is
quantized in one call and emitted per expert (default) or as a fused slab.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.config import RefitConfig, Rule, load_config
from qstrat.errors import PlanError, UnsupportedShapeError
from qstrat.layouts import QUANTIZABLE_KINDS, SPECIAL_KINDS, ModelLayout, ParsedName, detect_layout
from qstrat.plan import PASSTHROUGH, OutputTensor, PlanEntry, RefitPlan, natural_key
from qstrat.registry import Registry, get_registry
from qstrat.selectors import NamePattern, any_match, kept_bf16
from qstrat.serializers.base import PartSpec, Serializer, check_finite, tensor_nbytes as _nbytes

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Decision:
    """How one tensor is treated: ``serializer`` (name or ``passthrough``), its ``options``, the
    ``rule`` that decided, and the parsed name (``kind``, ``layer``...)."""

    serializer: str
    options: dict[str, Any]
    rule: str
    parsed: ParsedName
    note: str = ""


#: Special kinds an ``allow_special`` rule's include patterns may select.
OPT_IN_KINDS = frozenset({"router", "embedding", "lm_head"})
#: Weight dtypes a serializer accepts (an int, bool or already-quantized input is a plan error).
FLOAT_INPUTS = frozenset({torch.bfloat16, torch.float16, torch.float32})


class _CompiledRule:
    def __init__(self, index: int, rule: Rule, registry: Registry) -> None:
        self.label = f"rules[{index}]"
        self.rule = rule
        self.selectors = [registry.lookup("selectors", s).obj for s in rule.select]
        self.include = [NamePattern(t) for t in rule.include]
        self.exclude = [NamePattern(t) for t in rule.exclude]

    def matches(self, p: ParsedName) -> bool:
        # Special kinds (routers, embeddings, lm_head...) count only for selectors that declare
        # them (``special=True``): a third-party selector cannot quantize a router by accident.
        special = p.kind in SPECIAL_KINDS
        chosen = any(s.predicate(p) for s in self.selectors if s.special or not special)
        if not chosen and self.rule.allow_special and self.include:
            chosen = p.kind in OPT_IN_KINDS  # explicit: include patterns may name these
        if not chosen:
            return False
        if self.include and not any_match(self.include, p.name):
            return False
        return not any_match(self.exclude, p.name)


class RefitDriver:
    """Applies a :class:`~qstrat.RefitConfig` to trainer output.

    Args:
        config: RefitConfig, mapping, config file path or preset name (see :func:`load_config`).
        hf_config: the model's parsed ``config.json`` (selects the layout and gives the decoder
            depth for ``keep_bf16.last`` and MTP detection). Without it the layout comes from
            ``config.layout`` (else ``generic``) and the depth is inferred from the names.
        registry: plugin registry (default: the process-wide one).
    """

    def __init__(self, config: Any, hf_config: Mapping[str, Any] | None = None,
                 registry: Registry | None = None) -> None:
        self.registry = registry or get_registry()
        self.config: RefitConfig = load_config(config, registry=self.registry)
        self.hf_config = dict(hf_config or {})
        if self.config.layout:
            self.layout: ModelLayout = self.registry.lookup("layouts", self.config.layout).obj
        else:
            layouts = {k: e.obj for k, e in self.registry.layouts.items()}
            self.layout = detect_layout(layouts, self.hf_config)
        self._rules = [_CompiledRule(i, r, self.registry) for i, r in enumerate(self.config.rules)]
        self._serializers: dict[tuple[str, Any], Serializer] = {}

    # ---- decisions ----------------------------------------------------------------------
    def serializer(self, name: str, options: Mapping[str, Any]) -> Serializer:
        """Cached serializer instance for (name, options)."""
        try:
            key = (name, tuple(sorted(options.items())))
            hash(key)
        except TypeError:  # unhashable option values
            key = (name, repr(sorted(options.items())))
        if key not in self._serializers:
            self._serializers[key] = self.registry.serializer(name, **options)
        return self._serializers[key]

    def num_layers(self, names: Iterable[str] = ()) -> int | None:
        """Decoder depth from the HF config, else 1 + the largest decoder layer index in ``names``."""
        n = self.layout.num_layers(self.hf_config)
        if n is not None:
            return n
        layers = [p.layer for p in (self.layout.parse(x) for x in names) if p.layer is not None]
        return max(layers) + 1 if layers else None

    def decide(self, name: str, shape: tuple[int, ...], num_layers: int | None) -> Decision:
        """The decision for one tensor (no shape support check; see :meth:`plan`)."""
        p = self.layout.parse(name, num_layers)
        matrix = (len(shape) == 2 and p.param == "weight") or (len(shape) == 3 and p.slab)
        if not matrix:
            return Decision(PASSTHROUGH, {}, "not a weight matrix", p)
        keep = self.config.keep_bf16
        if p.kind in QUANTIZABLE_KINDS and kept_bf16(p, num_layers, keep.first, keep.last):
            which = "first" if p.layer is not None and p.layer < keep.first else "last"
            return Decision("bf16", {}, f"keep_bf16.{which}", p)
        for rule in self._rules:
            if rule.matches(p):
                return Decision(rule.rule.serializer, dict(rule.rule.options), rule.label, p)
        if p.kind in QUANTIZABLE_KINDS:
            return Decision(self.config.default, {}, "default", p)
        return Decision(PASSTHROUGH, {}, f"never quantized: {p.kind}", p)

    # ---- plan ---------------------------------------------------------------------------
    def plan(self, named_tensors: NamedTensors) -> RefitPlan:
        """Resolve every tensor; nothing is quantized or sent.

        Args:
            named_tensors: mapping or iterable of (HF name, tensor); tensors may be on any
                device, or ``meta`` (only ``.shape`` and ``.dtype`` are read).
        Returns: the :class:`RefitPlan` in wire order.
        Raises: PlanError listing every problem found (not only the first).
        """
        tensors = _as_dict(named_tensors)
        num_layers = self.num_layers(tensors)
        errors: list[str] = []
        if self.config.keep_bf16.last and self.layout.num_layers(self.hf_config) is None:
            errors.append(f"keep_bf16.last needs the decoder depth: pass hf_config with "
                          f"{self.layout.num_layers_key!r} (inferring it from names would miscount "
                          "MTP layers and pipeline-parallel shards)")
        entries = []
        for name in sorted(tensors, key=natural_key):
            t = tensors[name]
            try:
                entries.append(self._plan_entry(name, tuple(t.shape), t.dtype, num_layers))
            except (PlanError, UnsupportedShapeError) as exc:
                errors.append(f"{name}: {exc}")
        errors += _check_groups(entries) + _check_outputs(entries) + _check_expert_inputs(entries, self)
        ignored = _ignored_layers(entries, errors, self._quantizes)
        qconfig = self._engine_config(entries, ignored, errors)
        if errors:
            raise PlanError("refit plan is invalid:\n  " + "\n  ".join(errors))
        return RefitPlan(entries, self.layout.name, num_layers, ignored, qconfig, self.config.to_dict())

    def _plan_entry(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                    num_layers: int | None) -> PlanEntry:
        d = self.decide(name, shape, num_layers)
        p, note = d.parsed, ""
        dtype_name = str(dtype).removeprefix("torch.")
        if d.serializer == PASSTHROUGH:
            outs = (OutputTensor(name, shape, dtype_name, _nbytes(shape, dtype)),)
            return PlanEntry(name, shape, dtype_name, p.kind, p.layer, p.expert, d.rule, PASSTHROUGH,
                             {}, outs, None, "", p.vllm_module)
        if dtype not in FLOAT_INPUTS:
            raise PlanError(f"{d.serializer} ({d.rule}) needs a bfloat16/float16/float32 weight, got "
                            f"{dtype_name}")
        ser = self.serializer(d.serializer, d.options)
        try:
            specs = ser.part_specs(shape)
        except UnsupportedShapeError as exc:
            rule = self._rule_for(d.rule)
            if rule is None or rule.on_unsupported != "bf16":
                raise PlanError(f"{exc} (rule {d.rule}; set on_unsupported: bf16 to fall back)") from exc
            note = f"BF16 fallback: {exc}"
            d = Decision("bf16", {}, d.rule, p)
            ser = self.serializer("bf16", {})
            specs = ser.part_specs(shape)
        outs = self._outputs(p, specs, shape)
        return PlanEntry(name, shape, dtype_name, p.kind, p.layer, p.expert, d.rule, d.serializer,
                         d.options, outs, self._group_key(p), note, p.vllm_module)

    def _quantizes(self, e: PlanEntry) -> bool:
        return e.serializer != PASSTHROUGH and self.serializer(e.serializer, e.options).quantizes

    def _rule_for(self, label: str) -> Rule | None:
        return next((r.rule for r in self._rules if r.label == label), None)

    def _outputs(self, p: ParsedName, specs: tuple[PartSpec, ...],
                 shape: tuple[int, ...]) -> tuple[OutputTensor, ...]:
        def out(name: str, spec: PartSpec, shp: tuple[int, ...], **kw: Any) -> OutputTensor:
            dtype = str(spec.dtype).removeprefix("torch.")
            return OutputTensor(name, shp, dtype, _nbytes(shp, spec.dtype), spec.suffix, **kw)

        if not p.slab:
            return tuple(out(f"{p.module}.{s.suffix}", s, s.shape) for s in specs)
        if self.config.expert_emission == "fused":
            return tuple(out(_fused_name(p.name, s.suffix), s, s.shape) for s in specs)
        projections = self.layout.slabs[p.projection].parts
        k = len(projections)
        rows = shape[1]
        if rows % k:
            raise PlanError(f"slab rows {rows} do not split into {k} projections {projections}")
        result = []
        for e in range(shape[0]):
            for j, proj in enumerate(projections):
                for s in specs:
                    r = s.rows_per_entry
                    if r is not None and (rows // k) % r:
                        raise PlanError(
                            f"per-expert split of {p.projection} needs {rows // k} rows per projection "
                            f"to be a multiple of the format's {r}-row tile; use expert_emission: fused")
                    inner = s.shape[1:]
                    if r is not None:
                        inner = (inner[0] // k,) + inner[1:]
                    name = f"{p.engine_module}.{e}.{proj}.{s.suffix}"
                    result.append(out(name, s, inner, expert=e, row_part=j, row_parts=k))
        return tuple(result)

    def _group_key(self, p: ParsedName) -> str | None:
        if p.slab or p.projection is None:
            return None
        for fused in self.layout.fused:
            if p.projection in fused:
                parent = p.module.rsplit(".", 1)[0]
                return f"{parent}.{{{','.join(fused)}}}"
        return None

    def _engine_config(self, entries: list[PlanEntry], ignored: list[str],
                       errors: list[str]) -> dict[str, Any] | None:
        used = {id(s): s for s in (self.serializer(e.serializer, e.options) for e in entries
                                   if e.serializer != PASSTHROUGH) if s.quantizes}
        configs: dict[str, dict[str, Any]] = {}
        for ser in used.values():
            cfg = ser.vllm_quantization_config(ignored)
            configs.setdefault(repr(cfg), cfg)
        if len(configs) > 1:
            formats = sorted({s.name for s in used.values()})
            errors.append(f"the plan mixes quantized formats {formats} that one vLLM quantization_config "
                          "cannot express")
        return next(iter(configs.values()), None)

    # ---- run ----------------------------------------------------------------------------
    def run(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Plan, then quantize and yield ``(checkpoint_name, tensor)`` in wire order.

        Args: named_tensors: as for :meth:`plan` (real tensors, any device; BF16 typically).
        Yields: checkpoint tensors on the input's device; views into a slab's quantized parts
            for per-expert emission (call ``.contiguous()`` before serializing bytes).
        Raises: PlanError before the first tensor is yielded; NonFiniteError naming the tensor.
        """
        tensors = _as_dict(named_tensors)
        plan = self.plan(tensors)
        yield from self.execute(plan, tensors)

    def check_values(self, plan: RefitPlan, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise NonFiniteError for the first input holding NaN/inf (passthrough tensors and
        formats with ``nonfinite="error"``), before anything is emitted. One read pass, no copies."""
        for e in plan.entries:
            t = _materialize(tensors[e.name], e.name)
            if e.serializer == PASSTHROUGH:
                _check_passthrough(t, e.name)
            else:
                self.serializer(e.serializer, e.options).check_values(t, e.name)

    def execute(self, plan: RefitPlan, tensors: Mapping[str, torch.Tensor],
                values_checked: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Emit the outputs of an already validated ``plan`` for ``tensors`` in wire order.

        ``values_checked=True``: :meth:`check_values` already ran on ``tensors`` (as in
        ``qstrat.vllm.refit``), so the per-tensor NaN/inf read pass is not repeated.

        Each input is quantized once, when its first output is due, and its parts are dropped
        after its last output: with natural name order that bounds live parts to about one
        decoder layer (a layer's slabs interleave per expert).
        """
        members: dict[str, list[str]] = {}
        for e in plan.entries:
            if e.group:
                members.setdefault(e.group, []).append(e.name)
        contexts: dict[str, Any] = {}
        live: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
        for i, o in plan.wire_order():
            e = plan.entries[i]
            if i not in live:
                live[i] = (self._quantize_entry(e, tensors, members, contexts, values_checked),
                           len(e.outputs))
            parts, left = live[i]
            yield o.name, _cut(parts[o.suffix], o)
            if left == 1:
                del live[i]
            else:
                live[i] = (parts, left - 1)

    def _quantize_entry(self, e: PlanEntry, tensors: Mapping[str, torch.Tensor],
                        members: Mapping[str, list[str]], contexts: dict[str, Any],
                        values_checked: bool) -> dict[str, torch.Tensor]:
        t = _materialize(tensors[e.name], e.name)
        if e.serializer == PASSTHROUGH:
            if not values_checked:
                _check_passthrough(t, e.name)
            return {"weight": t}
        ser = self.serializer(e.serializer, e.options)
        ctx = None
        if e.group:
            if e.group not in contexts:
                contexts[e.group] = ser.group_context([_materialize(tensors[m], m) for m in members[e.group]])
            ctx = contexts[e.group]
        return ser.quantize(t, name=e.name, context=ctx, values_checked=values_checked)


def _check_passthrough(t: torch.Tensor, name: str) -> None:
    """NaN/inf in a tensor sent unchanged (norms, routers, embeddings) is an error too."""
    if t.is_floating_point() and t.numel():
        w3 = t.reshape(1, -1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, 1, -1)
        check_finite(w3, name, 1)


def _materialize(t: Any, name: str) -> torch.Tensor:
    """A tensor, or a lazily loaded handle with ``.load()`` (e.g. checkpoint.LazyTensor).

    Raises: PlanError for a ``meta`` tensor (it has no values to quantize or send).
    """
    t = t if isinstance(t, torch.Tensor) else t.load()
    if t.is_meta:
        raise PlanError(f"{name}: is a meta tensor; run() needs values (plan() accepts meta tensors)")
    return t


def _cut(part: torch.Tensor, o: OutputTensor) -> torch.Tensor:
    """Slice one output out of a serializer part (per-expert emission of a grouped slab)."""
    if o.expert is None:
        return part
    part = part[o.expert]
    if o.row_part is not None and part.dim() >= 2:
        rows = part.shape[0] // o.row_parts
        return part[o.row_part * rows:(o.row_part + 1) * rows]
    # a per-matrix value (e.g. NVFP4 weight_scale_2) duplicated for each fused projection: a copy,
    # so outputs never alias one another (safetensors refuses shared memory)
    return part.clone() if o.row_parts > 1 else part


def _fused_name(slab: str, suffix: str) -> str:
    """``experts.gate_up_proj`` + ``weight_scale_inv`` -> ``experts.gate_up_proj_scale_inv``."""
    if suffix == "weight":
        return slab
    return slab + suffix.removeprefix("weight") if suffix.startswith("weight_") else f"{slab}_{suffix}"


def _check_groups(entries: list[PlanEntry]) -> list[str]:
    """Members of one engine-fused group must share serializer and options."""
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


def _check_expert_inputs(entries: list[PlanEntry], driver: RefitDriver) -> list[str]:
    """One layer's experts come either as grouped slabs or as per-expert tensors, never both
    (with fused emission both would reach the engine); a slab's E must match the config."""
    per_expert = {e.engine_module for e in entries if e.kind == "expert" and e.expert is not None}
    n_experts = _text(driver.hf_config).get("num_experts") or _text(driver.hf_config).get(
        "n_routed_experts") or _text(driver.hf_config).get("num_local_experts")
    errors = []
    for e in entries:
        if e.kind != "expert" or e.expert is not None or len(e.shape) != 3:
            continue
        if e.engine_module in per_expert:
            errors.append(f"{e.name}: {e.engine_module} is given both as grouped slabs and as "
                          "per-expert tensors")
        if n_experts and e.shape[0] != int(n_experts):
            errors.append(f"{e.name}: slab holds {e.shape[0]} experts, the model config says {n_experts}")
    return errors


def _text(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    return hf_config.get("text_config") or hf_config


def _check_outputs(entries: list[PlanEntry]) -> list[str]:
    """No two inputs may emit the same checkpoint name (e.g. per-expert names AND a slab)."""
    owner: dict[str, str] = {}
    errors = []
    for e in entries:
        for o in e.outputs:
            if o.name in owner:
                errors.append(f"{e.name} and {owner[o.name]} both emit {o.name}")
            owner[o.name] = e.name
    return errors


def _ignored_layers(entries: list[PlanEntry], errors: list[str],
                    quantizes: Callable[[PlanEntry], bool]) -> list[str]:
    """vLLM module prefixes of unquantized matrices (routers included; embeddings excluded)."""
    status: dict[str, bool] = {}
    mixed: set[str] = set()
    for e in entries:
        if len(e.shape) < 2 or e.kind in ("embedding", "mtp", "non_decoder") or e.name.endswith(".bias"):
            continue
        quantized = quantizes(e)
        mod = e.engine_module
        if mod in status and status[mod] != quantized and mod not in mixed:
            mixed.add(mod)
            errors.append(f"{mod}: some of its tensors are quantized and some are not; vLLM loads it "
                          "as one module")
        status.setdefault(mod, quantized)
    return sorted((m for m, q in status.items() if not q), key=natural_key)


def _as_dict(named_tensors: NamedTensors) -> dict[str, torch.Tensor]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        if not isinstance(name, str):
            raise PlanError(f"tensor names must be strings, got {name!r} ({type(name).__name__})")
        if name in out:
            raise PlanError(f"{name}: given twice")
        out[name] = t
    return out
