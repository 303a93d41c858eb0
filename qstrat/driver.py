"""The refit driver: plan every tensor, then quantize and emit in wire order.

:class:`RefitDriver` is the facade a trainer uses. It ties the stages together:

1. :meth:`RefitDriver.plan` - parse names (:mod:`qstrat.layouts`), decide (:mod:`qstrat.rules`),
   declare every output and check the whole plan (:mod:`qstrat.plan.planner`); raises
   :class:`~qstrat.errors.PlanError` before any quantization. A plan is a pure function of the
   inputs' metadata and the driver's configs, so the driver keeps the last one it made and
   returns it again for the same metadata (:class:`PlanCache`): a refit every training step
   plans once.
2. :meth:`RefitDriver.prepare` - everything that runs before the first byte, in one order
   (:data:`qstrat.prepare.STEPS`: plan, the sink's own checks, backends, values).
3. :meth:`RefitDriver.execute` - quantize each input once (a grouped expert slab, or a batch of
   per-expert tensors, in one call), emit ``(checkpoint_name, tensor)`` in the plan's wire order,
   drop parts after their last output (:mod:`qstrat.stream`).

:meth:`RefitDriver.run` is prepare + execute, or, given a plan made from metadata, execute over a
stream consumed once; every sink (:mod:`qstrat.vllm`, :mod:`qstrat.checkpoint`,
:mod:`qstrat.transport`) prepares the same way and consumes the same output stream.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any

import torch

from qstrat.config import RefitConfig, load_config
from qstrat.errors import PlanError
from qstrat.inputs import NamedTensors, as_tensor_dict, materialize
from qstrat.layouts import ModelLayout, detect_layout
from qstrat.plan.data import PASSTHROUGH, RefitPlan, gc_paused
from qstrat.plan.planner import Planner
from qstrat.prepare import PreparedRefit, SinkCheck, ValuesWhen, prepare
from qstrat.registry import Registry, get_registry
from qstrat.rules import Decision, RuleSet
from qstrat.serializers.base import Serializer
from qstrat.stream import check_passthrough, cut_output, execute

__all__ = ["Decision", "NamedTensors", "PlanCache", "PreparedRefit", "RefitDriver", "SinkCheck",
           "check_passthrough", "cut_output"]

#: ``tensor -> (shape, dtype)``: what a plan reads of each input.
_SHAPE_DTYPE = attrgetter("shape", "dtype")


class PlanCache:
    """The last plan a driver made, and the metadata it was made from.

    The invalidation rule: the plan is reused exactly when the inputs' metadata key equals the
    one it was planned from - the names in the producer's order, each input's shape and dtype,
    and the ``hf_config`` as it reads now (``repr``); the refit config is the driver's, fixed at
    construction. Anything else (a renamed, added, dropped, reordered, reshaped or recast input,
    an edited ``hf_config``) re-plans and replaces the entry. A plan that fails is not kept
    (every call raises its own PlanError). A ``dict`` input is looked up before it is validated
    (its key can equal the kept one only if its names, shapes and torch dtypes are those of an
    input that was validated; anything else misses and is validated). One entry: a trainer refits
    one model. The key holds each input's ``.shape`` object as given: tensors and qstrat's
    handles give an immutable ``torch.Size``; a handle whose shape is a list changed in place
    would go unnoticed.
    """

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.plan: RefitPlan | None = None

    @staticmethod
    def metadata_key(tensors: Mapping[str, Any], hf_config: Mapping[str, Any]) -> tuple[Any, ...]:
        """``(names, (shape, dtype) per input, repr(hf_config))``: compared with ``==`` (exact:
        no hash collisions). Reads ``.shape`` and ``.dtype`` of each value, no data."""
        return tuple(tensors), tuple(map(_SHAPE_DTYPE, tensors.values())), repr(hf_config)

    def get(self, key: tuple[Any, ...]) -> RefitPlan | None:
        """The kept plan if ``key`` equals its key, else None."""
        return self.plan if self.plan is not None and self.key == key else None

    def put(self, key: tuple[Any, ...], plan: RefitPlan) -> None:
        """Keep ``plan`` (made from ``key``), replacing the previous entry."""
        self.key, self.plan = key, plan

    def clear(self) -> None:
        """Drop the kept plan (the next :meth:`RefitDriver.plan` plans)."""
        self.key = self.plan = None


class RefitDriver:
    """Applies a :class:`~qstrat.RefitConfig` to trainer output.

    Args:
        config: RefitConfig, mapping, config file path or preset name (see :func:`load_config`).
        hf_config: the model's parsed ``config.json`` (selects the layout and gives the decoder
            depth for ``keep_bf16.last`` and MTP detection), or a transformers config object
            (``model.config``: read with its ``to_dict()``). Without it the layout comes from
            ``config.layout`` (else ``generic``) and the depth is inferred from the names.
        registry: plugin registry (default: the process-wide one).
    Raises: ConfigError for an invalid config, an unknown layout name, or an ``hf_config`` that
        is neither a mapping nor has ``to_dict()``.
    """

    def __init__(self, config: Any, hf_config: Mapping[str, Any] | None = None,
                 registry: Registry | None = None) -> None:
        self.registry = registry or get_registry()
        self.config: RefitConfig = load_config(config, registry=self.registry)
        self.hf_config = hf_config_dict(hf_config)
        self.layout: ModelLayout = layout_for(self.registry, self.config.layout, self.hf_config)
        self.rules = RuleSet(self.config, self.registry)
        self.planner = Planner(self.config, self.layout, self.rules, self.serializer, self.hf_config)
        if self.config.quantize_in == "engine":  # BF16 wire, the engine quantizes (qstrat.online)
            from qstrat.online import engine_side_planner

            self.planner = engine_side_planner(self)
        self.plan_cache = PlanCache()
        self._serializers: dict[tuple[str, Any], Serializer] = {}

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
        with gc_paused():  # the key allocates a tuple per input: no collector passes over the kept plan
            if isinstance(named_tensors, dict):  # a hit needs no validation: its key equals a validated input's
                try:
                    plan = self.plan_cache.get(PlanCache.metadata_key(named_tensors, self.hf_config))
                except AttributeError:  # a value without .shape or .dtype: as_tensor_dict names it below
                    plan = None
                if plan is not None:
                    return plan
            tensors = as_tensor_dict(named_tensors)
            key = PlanCache.metadata_key(tensors, self.hf_config)
            plan = self.plan_cache.get(key)
            if plan is None:
                plan = self.planner.plan(tensors)
                self.plan_cache.put(key, plan)
        return plan

    # ---- run ------------------------------------------------------------------------------
    def run(self, named_tensors: NamedTensors, plan: RefitPlan | None = None,
            ) -> Iterator[tuple[str, torch.Tensor]]:
        """Quantize and yield ``(checkpoint_name, tensor)`` in wire order.

        Args:
            named_tensors: as for :meth:`plan` (real tensors, any device; BF16 typically).
            plan: a plan made beforehand from metadata (``plan(tensor_specs(...))``, meta
                tensors): ``named_tensors`` may then be an iterator, consumed once in the
                producer's order with a window of about one layer (see :mod:`qstrat.stream`).
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
                stream: bool = False) -> PreparedRefit:
        """Run every check before the first byte (:data:`qstrat.prepare.STEPS`, in order: plan,
        the sink's ``checks``, backends, values) and return what to execute.

        Args:
            named_tensors: as for :meth:`plan` (real tensors, or lazy handles, any device).
            plan: a plan made beforehand (checked against this driver's config and, as a
                mapping, the inputs: :meth:`check_plan`); None: plan ``named_tensors`` here.
            checks: the sink's own checks (:class:`~qstrat.prepare.SinkCheck`), run in order
                after the plan.
            values: ``"first"`` - read every input for NaN/inf before returning (sinks that
                cannot take anything back); ``"inline"`` - while quantizing.
            stream: with ``plan``, keep an iterator as an iterator (consumed once by
                ``execute``; devices and values are then checked as each tensor arrives).
        Returns: a :class:`~qstrat.prepare.PreparedRefit` (``.plan``, ``.execute()``).
        Raises: PlanError; the sink's errors; BackendUnavailableError; NonFiniteError - the
            first step that fails, before anything is emitted.
        """
        return prepare(self, named_tensors, plan, checks, values, stream)

    def check_plan(self, plan: RefitPlan, tensors: Any = None) -> None:
        """Raise PlanError unless ``plan`` was made with this driver's config (a plan given to
        :meth:`prepare` beforehand) and, when
        ``tensors`` is a mapping, it holds every planned input with its planned shape and dtype
        (:func:`qstrat.stream.check_inputs`; a stream is checked as it arrives)."""
        if plan.config != self.config.to_dict():
            raise PlanError("the given plan was made with another config than this driver's")
        if isinstance(tensors, Mapping):
            from qstrat.stream import check_inputs

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
        value's ``.device`` (a tensor, :class:`qstrat.inputs.OnDevice`), else the CPU (lazy
        handles such as :class:`qstrat.checkpoint.LazyTensor` load there)."""
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
                consumer_stream: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Emit the outputs of an already validated ``plan`` in wire order.

        Args:
            plan: from :meth:`plan` (or one rank's part, :func:`qstrat.sharding.split_plan`).
            tensors: name -> tensor, or an iterator of ``(name, tensor)`` consumed once.
            values_checked: :meth:`check_values` already ran on ``tensors`` (as in
                ``qstrat.vllm.refit``), so the per-tensor NaN/inf read pass is not repeated.
            expert_batch: most per-expert tensors per serializer call (default: the config's).
            consumer_stream: the CUDA stream that reads the outputs (handoff documented in
                :mod:`qstrat.stream`).

        Each input is quantized once, when its first output is due, and its parts are dropped
        after its last output: that bounds live parts to about one decoder layer.
        """
        yield from execute(self, plan, tensors, values_checked, expert_batch or self.config.expert_batch,
                           consumer_stream)


def hf_config_dict(hf_config: Any) -> dict[str, Any]:
    """``hf_config`` as a plain dict: a mapping (config.json content), a transformers config
    (``to_dict()``), or None (empty). Raises: ConfigError for anything else."""
    from qstrat.errors import ConfigError

    if hf_config is None:
        return {}
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if callable(getattr(hf_config, "to_dict", None)):
        return dict(hf_config.to_dict())
    raise ConfigError(f"hf_config must be the model's config.json content (a mapping) or a transformers "
                      f"config (model.config), got {type(hf_config).__name__}")


def layout_for(registry: Registry, name: str | None, hf_config: Mapping[str, Any] | None) -> ModelLayout:
    """The layout named in config (``layout:``), else the one the HF config selects, else ``generic``.

    Raises: ConfigError for an unknown layout name (listing the registered ones).
    """
    if name:
        return registry.lookup("layouts", name).obj
    return detect_layout({k: e.obj for k, e in registry.layouts.items()}, hf_config)
