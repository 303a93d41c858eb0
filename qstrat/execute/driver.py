"""The refit driver: plan every tensor, then quantize and emit in wire order.

:class:`RefitDriver` is the facade a trainer uses. It ties the stages together:

1. :meth:`RefitDriver.plan` - parse names (:mod:`qstrat.layouts.model_layout`), decide (:mod:`qstrat.config.rules`),
   declare every output and check the whole plan (:mod:`qstrat.plan.planner`); raises
   :class:`~qstrat.errors.PlanError` before any quantization. A plan is a pure function of the
   inputs' metadata and the driver's configs, so the driver keeps the last one it made and
   returns it again for the same metadata (:class:`PlanCache`): a refit every training step
   plans once.
2. :meth:`RefitDriver.prepare` - everything that runs before the first byte, in one order
   (:data:`qstrat.execute.prepare.STEPS`: plan, the sink's own checks, backends, values).
3. :meth:`RefitDriver.execute` - quantize each input once (a grouped expert slab, or a batch of
   per-expert tensors, in one call), emit ``(checkpoint_name, tensor)`` in the plan's wire order,
   drop parts after their last output (:mod:`qstrat.execute.stream`).

:meth:`RefitDriver.run` is prepare + execute, or, given a plan made from metadata, execute over a
stream consumed once; every sink (:mod:`qstrat.vllm`, :mod:`qstrat.execute.checkpoint`,
:mod:`qstrat.transport`) prepares the same way and consumes the same output stream.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from qstrat.config.loader import RefitConfig, load_config
from qstrat.errors import PlanError
from qstrat.execute.named_tensors import NamedTensors, as_tensor_dict, materialize
from qstrat.layouts.model_layout import ModelLayout, detect_layout
from qstrat.layouts.model_config import ModelConfig
from qstrat.plan.data import PASSTHROUGH, RefitPlan, gc_paused
from qstrat.plan.planner import Planner
from qstrat.execute.prepare import PreparedRefit, SinkCheck, ValuesWhen, prepare
from qstrat.plugins.registry import Registry, get_registry
from qstrat.config.rules import Decision, RuleSet
from qstrat.serializers.base import Serializer
from qstrat.execute.stream import Quantize, check_passthrough, cut_output, execute
from qstrat.execute.stream.index import PlanIndex

__all__ = ["Decision", "NamedTensors", "PlanCache", "PreparedRefit", "RefitDriver", "SinkCheck",
           "check_passthrough", "cut_output"]


class PlanCache:
    """The last plan a driver made, the metadata it was made from, and what depends on it alone.

    The invalidation rule (one): the kept plan is reused exactly when the inputs' names, in the
    producer's order, and the ``hf_config`` as it reads now (``repr``) equal those it was planned
    from, and each input's ``.shape`` and ``.dtype`` equal those it was planned with. The refit
    config is the driver's, fixed at construction. Anything else - a renamed, added, dropped or
    reordered input, a reshaped or recast one, an edited ``hf_config`` - re-plans and replaces
    the entry; :attr:`miss` says which of these it was. A plan that fails is not kept (every call
    raises its own PlanError), nor one a sink's check refused. One entry: a trainer refits one
    model. What is computed from the plan alone (a sink's checks of it, its wire manifest, the
    execution's tables) is kept with it (:meth:`keep`) and goes with it. What depends on the model
    config alone (the engine manifest a sink without an engine checks against) is kept in
    :attr:`manifests`, keyed by its inputs' values: the driver's one cache.

    Where the shapes and dtypes are compared: up front, by :meth:`get` (every in-process sink),
    or - for a sink that is all-or-none until the last input was read (a transport round before
    its commit vote, :meth:`qstrat.transport.RefitSender.refit`) - where the stream reads each
    input (:meth:`get` with ``inputs=False`` matches names and ``hf_config`` only, and the plan is
    executed over the inputs as a stream, which refuses an input whose shape or dtype differs from
    its entry with :class:`~qstrat.errors.InputMismatchError`); that sink then discards the round,
    drops the entry (:meth:`clear`) and plans again. The rule is the same; only the place of the
    last comparison moves.

    Checked in that order, cheapest first: the names (one tuple comparison), the ``hf_config``,
    then the shapes and dtypes (one pass over the inputs against the copy :meth:`put` kept), so
    nothing is allocated per input on a hit. A value without ``.shape`` / ``.dtype`` misses
    (the planner then names it). A dtype is compared by identity with the torch dtype planned
    (``torch.bfloat16`` is one object), a shape by value with the ``torch.Size`` it had.
    """

    def __init__(self) -> None:
        self.names: tuple[str, ...] | None = None
        self.hf_config: str | None = None
        #: per input, in the producer's order: ``(shape, dtype)`` as planned
        self.metadata: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.plan: RefitPlan | None = None
        #: why the last :meth:`get` missed (``"names"``, ``"hf_config"``, ``"{name}: shape ..."``,
        #: ``"{name}: dtype ..."``, ``"empty"``), or None after a hit
        self.miss: str | None = None
        #: how many plans were kept (:meth:`put`): the planner's runs for this driver
        self.planned = 0
        self._kept: dict[Any, Any] = {}
        #: engine manifests built from the model config (not from a plan, so kept across plans),
        #: by layout, ``hf_config`` and ``quantization_config``
        #: (:func:`qstrat.vllm.checks.engine_manifest.check_model_tensors`'s ``cache``)
        self.manifests: dict[Any, Any] = {}

    def get(self, tensors: Mapping[str, Any], hf_config: Mapping[str, Any], inputs: bool = True
            ) -> RefitPlan | None:
        """The kept plan if ``tensors`` (name -> anything with ``.shape`` and ``.dtype``) and
        ``hf_config`` are what it was planned from (the rule above), else None (:attr:`miss`
        says why). Reads no data. ``inputs=False``: the names and ``hf_config`` only - the
        caller compares each input with its plan entry where it reads it (see above)."""
        self.miss = self._differs(tensors, hf_config, inputs)
        return self.plan if self.miss is None else None

    def keep(self, plan: RefitPlan, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per kept plan: a value that depends on ``plan`` and ``key``
        alone (e.g. a sink's check of the plan, its wire manifest for one bucket size). Kept only
        while ``plan`` is the kept plan (dropped with it); for another plan (one given by the
        caller, a partial one) it is computed each call. Raises: what ``make`` raises - and then
        the kept plan is dropped (:meth:`clear`): a plan a sink refused is not kept, so a refit
        that reuses a plan only ever reuses one whose checks passed."""
        if plan is not self.plan:
            return make()
        if key in self._kept:
            return self._kept[key]
        try:
            value = self._kept[key] = make()
        except BaseException:
            self.clear()
            raise
        return value

    def _differs(self, tensors: Mapping[str, Any], hf_config: Mapping[str, Any], inputs: bool) -> str | None:
        if self.plan is None:
            return "empty"
        if tuple(tensors) != self.names:
            return "names"
        if repr(hf_config) != self.hf_config:
            return "hf_config"
        if not inputs:
            return None
        for (shape, dtype), (name, t) in zip(self.metadata, tensors.items()):
            try:
                if t.shape != shape and tuple(t.shape) != shape:  # a handle's list shape equals by value
                    return f"{name}: shape {list(t.shape)}, planned {list(shape)}"
                if t.dtype is not dtype:
                    return f"{name}: dtype {t.dtype}, planned {dtype}"
            except AttributeError:  # not a tensor: the planner names it
                return f"{name}: a {type(t).__name__}, not a tensor"
        return None

    def put(self, tensors: Mapping[str, Any], hf_config: Mapping[str, Any], plan: RefitPlan) -> None:
        """Keep ``plan``, made from ``tensors`` and ``hf_config``, replacing the previous entry."""
        self.names, self.hf_config, self.plan = tuple(tensors), repr(hf_config), plan
        self.metadata = [(tuple(t.shape), t.dtype) for t in tensors.values()]
        self._kept = {}
        self.planned += 1

    def clear(self) -> None:
        """Drop the kept plan and what was kept with it (the next :meth:`RefitDriver.plan` plans)."""
        self.names = self.hf_config = self.plan = None
        self.metadata = []
        self._kept = {}


class RefitDriver:
    """Applies a :class:`~qstrat.RefitConfig` to trainer output.

    Args:
        config: RefitConfig, mapping, config file path or preset name (see :func:`load_config`).
        hf_config: the model's parsed ``config.json`` (selects the layout and gives the decoder
            depth for ``keep_bf16.last`` and MTP detection), or a transformers config object
            (``model.config``: read with its ``to_dict()``), or a parsed
            :class:`~qstrat.layouts.model_config.ModelConfig`: parsed once here into
            :attr:`model_config`, which every layer below reads. Without it the layout comes from
            ``config.layout`` (else ``generic``) and the depth is inferred from the names.
        registry: plugin registry (default: the process-wide one).
    Raises: ConfigError for an invalid config, an unknown layout name, or an ``hf_config`` that
        is neither a mapping nor has ``to_dict()``.
    """

    def __init__(self, config: Any, hf_config: Any = None,
                 registry: Registry | None = None) -> None:
        self.registry = registry or get_registry()
        self.config: RefitConfig = load_config(config, registry=self.registry)
        self.hf_config = hf_config_dict(hf_config)
        self.rules = RuleSet(self.config, self.registry)
        self._serializers: dict[tuple[str, Any], Serializer] = {}
        self._read_hf_config()
        self.plan_cache = PlanCache()

    def _read_hf_config(self) -> None:
        """Choose the layout and build the planner from ``self.hf_config`` as it reads now (at
        construction, and again when a plan finds it edited: a re-plan is a fresh driver's)."""
        #: ``hf_config`` parsed once (:class:`~qstrat.layouts.model_config.ModelConfig`): what every layer
        #: below the driver reads (layouts, planner, manifests, checkpoint writer)
        self.model_config = ModelConfig.of(self.hf_config)
        self.layout: ModelLayout = layout_for(self.registry, self.config.layout, self.model_config)
        # its values checked at the door, as a config-only plan checks them (a string
        # "false" read as true, a negative size): ConfigError naming the key, before any plan
        self.model_config.check(getattr(self.layout, "num_layers_key", "num_hidden_layers"))
        self.planner = Planner(self.config, self.layout, self.rules, self.serializer, self.model_config)
        if self.config.quantize_in == "engine":  # BF16 wire, the engine quantizes (qstrat.vllm.online)
            from qstrat.vllm.online import engine_side_planner

            self.planner = engine_side_planner(self)

    # ---- decisions and plan ---------------------------------------------------------------
    def serializer(self, name: str, options: Mapping[str, Any]) -> Serializer:
        """Cached serializer instance for (name, options)."""
        key: tuple[str, Any] = (name, tuple(sorted(options.items())) if options else ())
        try:
            return self._serializers[key]
        except KeyError:
            pass
        except TypeError:  # unhashable option values
            key = (name, repr(sorted(options.items())))
            if key in self._serializers:
                return self._serializers[key]
        self._serializers[key] = ser = self.registry.serializer(name, **options)
        return ser

    def num_layers(self, names: Iterable[str] = ()) -> int | None:
        """Decoder depth from the HF config, else 1 + the largest decoder layer index in ``names``."""
        return self.planner.num_layers(names)

    def decide(self, name: str, shape: tuple[int, ...], num_layers: int | None) -> Decision:
        """The decision for one tensor (no shape support check; see :meth:`plan`)."""
        return self.planner.decide(name, shape, num_layers)

    def plan(self, named_tensors: NamedTensors) -> RefitPlan:
        """Resolve every tensor; nothing is quantized or sent.

        Args:
            named_tensors: mapping or iterable of (HF name, tensor); tensors may be on any
                device, or ``meta`` (only ``.shape`` and ``.dtype`` are read).
        Returns: the :class:`RefitPlan` in wire order: the same object as the previous call's
            when the metadata is the same (:class:`PlanCache` states the rule; read it, do not
            change it: derive a partial plan with ``subset`` / ``only_layers``).
        Raises: PlanError listing every problem found (not only the first).
        """
        if isinstance(named_tensors, dict):  # looked up before validation: a hit equals a validated input
            plan = self.plan_cache.get(named_tensors, self.hf_config)
            tensors = named_tensors if plan is not None else as_tensor_dict(named_tensors)
        else:
            tensors = as_tensor_dict(named_tensors)
            plan = self.plan_cache.get(tensors, self.hf_config)
        if plan is None:
            if self.plan_cache.miss == "hf_config":  # edited in place: the layout may be another
                self._read_hf_config()
            with gc_paused():  # the planner's objects and the cache's copy of the metadata
                plan = self.planner.plan(tensors)
                self.plan_cache.put(tensors, self.hf_config, plan)
        return plan

    def kept_plan(self, tensors: Mapping[str, Any]) -> RefitPlan | None:
        """The kept plan if ``tensors``' names (in order) and the ``hf_config`` are those it was
        planned from, else None; shapes and dtypes are NOT compared here (:class:`PlanCache`,
        ``inputs=False``): for a caller that executes the plan over ``tensors`` as a stream,
        which compares each input with its entry as it reads it, and discards everything it
        received on :class:`~qstrat.errors.InputMismatchError` (``prepare(..., all_or_none=True)``).
        Reads no data, plans nothing."""
        return self.plan_cache.get(tensors, self.hf_config, inputs=False)

    # ---- run ------------------------------------------------------------------------------
    def run(self, named_tensors: NamedTensors, plan: RefitPlan | None = None,
            ) -> Iterator[tuple[str, torch.Tensor]]:
        """Quantize and yield ``(checkpoint_name, tensor)`` in wire order.

        Args:
            named_tensors: as for :meth:`plan` (real tensors, any device; BF16 typically).
            plan: a plan made beforehand from metadata (``plan(tensor_specs(...))``, meta
                tensors): ``named_tensors`` may then be an iterator, consumed once in the
                producer's order with a window of about one layer (see :mod:`qstrat.execute.stream`).
                Without it the inputs are planned first, which holds every tensor of an
                iterator in memory.
        Yields: checkpoint tensors on the input's device; views into a slab's quantized parts
            for per-expert emission (call ``.contiguous()`` before serializing bytes).
        Raises: PlanError or BackendUnavailableError before the first tensor is yielded (a
            given plan made with another config, an invalid plan: :meth:`prepare`) or,
            streaming, when an input does not match the plan; NonFiniteError naming the tensor.
        """
        yield from self.prepare(named_tensors, plan, values="inline", stream=True).execute()

    def prepare(self, named_tensors: NamedTensors, plan: RefitPlan | None = None,
                checks: Sequence[SinkCheck] = (), values: ValuesWhen = "first",
                stream: bool = False, all_or_none: bool = False) -> PreparedRefit:
        """Run every check before the first byte (:data:`qstrat.execute.prepare.STEPS`, in order: plan,
        the sink's ``checks``, backends, values) and return what to execute.

        Args:
            named_tensors: as for :meth:`plan` (real tensors, or lazy handles, any device).
            plan: a plan made beforehand (checked against this driver's config and, as a
                mapping, the inputs: :meth:`check_plan`); None: plan ``named_tensors`` here.
            checks: the sink's own checks (:class:`~qstrat.execute.prepare.SinkCheck`), run in order
                after the plan.
            values: ``"first"`` - read every input for NaN/inf before returning (sinks that
                cannot take anything back); ``"inline"`` - while quantizing.
            stream: with ``plan``, keep an iterator as an iterator (consumed once by
                ``execute``; devices and values are then checked as each tensor arrives).
            all_or_none: the sink discards everything it received when execution raises (a
                transport round before its commit vote): the kept plan is then matched by names
                and ``hf_config`` only (:meth:`kept_plan`) and each input is checked where the
                stream reads it (:func:`qstrat.execute.prepare.prepare`).
        Returns: a :class:`~qstrat.execute.prepare.PreparedRefit` (``.plan``, ``.execute()``).
        Raises: PlanError; the sink's errors; BackendUnavailableError; NonFiniteError - the
            first step that fails, before anything is emitted (``all_or_none`` with the kept
            plan: an input's shape, dtype, device or values while executing).
        """
        return prepare(self, named_tensors, plan, checks, values, stream, all_or_none)

    def check_plan(self, plan: RefitPlan, tensors: Any = None) -> None:
        """Raise PlanError unless ``plan`` was made with this driver's config (a plan given to
        :meth:`prepare` beforehand) and, when
        ``tensors`` is a mapping, it holds every planned input with its planned shape and dtype
        (:func:`qstrat.execute.stream.check_inputs`; a stream is checked as it arrives)."""
        if plan.config != self.config.to_dict():
            raise PlanError("the given plan was made with another config than this driver's")
        if isinstance(tensors, Mapping):
            from qstrat.execute.stream import check_inputs

            check_inputs(plan, tensors)

    def check_values(self, plan: RefitPlan, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise NonFiniteError for the first input holding NaN/inf (passthrough tensors and
        formats with ``nonfinite="error"``), before anything is emitted. One read pass, no copies."""
        for e in plan.entries:
            t = materialize(tensors[e.name], e.name)
            if e.serializer == PASSTHROUGH:
                check_passthrough(t, e.name)
            else:
                self.serializer(e.serializer, e.options).check_values(t, e.name)

    def check_backends(self, plan: RefitPlan, tensors: Mapping[str, Any]) -> None:
        """Raise BackendUnavailableError (naming the tensor and its rule) if a planned format's
        ``backend`` option cannot run on its input's device; reads no data. The device is the
        value's ``.device`` (a tensor, :class:`qstrat.execute.named_tensors.OnDevice`), else the CPU (lazy
        handles such as :class:`qstrat.execute.checkpoint.LazyTensor` load there)."""
        from qstrat.errors import BackendUnavailableError

        for e in plan.entries:
            if e.serializer == PASSTHROUGH:
                continue
            t = tensors[e.name]
            device = getattr(t, "device", None)
            device = device if isinstance(device, torch.device) else torch.device("cpu")
            try:
                self.serializer(e.serializer, e.options).check_backend(device)
            except BackendUnavailableError as exc:
                raise BackendUnavailableError(f"{e.name} ({e.rule}): {exc}") from exc

    def execute(self, plan: RefitPlan, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                values_checked: bool = False, expert_batch: int | None = None,
                consumer_stream: Any = None, quantize: Quantize | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Emit the outputs of an already validated ``plan`` in wire order.

        Args:
            plan: from :meth:`plan` (or one rank's part, :func:`qstrat.execute.sharding.split_plan`).
            tensors: name -> tensor, or an iterator of ``(name, tensor)`` consumed once.
            values_checked: :meth:`check_values` already ran on ``tensors`` (as in
                ``qstrat.vllm.refit``), so the per-tensor NaN/inf read pass is not repeated.
            expert_batch: most per-expert tensors per serializer call (default: the config's).
            consumer_stream: the CUDA stream that reads the outputs (handoff documented in
                :mod:`qstrat.execute.stream`).
            quantize: the serializer call (:class:`~qstrat.execute.stream.quantize.Quantize`, e.g.
                a delta sender's incremental one; None: ``Serializer.quantize``).

        Each input is quantized once, when its first output is due, and its parts are dropped
        after its last output: that bounds live parts to about one decoder layer.
        """
        index = self.plan_cache.keep(plan, "plan index", lambda: PlanIndex.of(plan))
        yield from execute(self, plan, tensors, values_checked, expert_batch or self.config.expert_batch,
                           consumer_stream, index, quantize)


def hf_config_dict(hf_config: Any) -> dict[str, Any]:
    """``hf_config`` as a plain dict: a mapping (config.json content), a transformers config
    (``to_dict()``), a :class:`~qstrat.layouts.model_config.ModelConfig`, or None (empty).
    Raises: ConfigError for anything else (:meth:`~qstrat.layouts.model_config.ModelConfig.of`)."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    return ModelConfig.of(hf_config).to_dict()


def layout_for(registry: Registry, name: str | None, config: ModelConfig) -> ModelLayout:
    """The layout named in config (``layout:``), else the one the HF config selects, else ``generic``.

    Raises: ConfigError for an unknown layout name (listing the registered ones).
    """
    if name:
        return registry.lookup("layouts", name).obj
    return detect_layout({k: e.obj for k, e in registry.layouts.items()}, config)
