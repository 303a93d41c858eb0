"""The refit driver: plan every tensor, then quantize and emit in wire order.

:class:`RefitDriver` is the facade a trainer uses. It ties the stages together:

1. :meth:`RefitDriver.plan` - parse names (:mod:`qstrat.layouts`), decide (:mod:`qstrat.rules`),
   declare every output and check the whole plan (:mod:`qstrat.plan.planner`); raises
   :class:`~qstrat.errors.PlanError` before any quantization.
2. :meth:`RefitDriver.check_values` - one read pass for NaN/inf, before anything is emitted.
3. :meth:`RefitDriver.execute` - quantize each input once (a grouped expert slab in one call),
   emit ``(checkpoint_name, tensor)`` in the plan's wire order, drop parts after their last output.

:meth:`RefitDriver.run` is plan + execute; the sinks (:mod:`qstrat.vllm`, :mod:`qstrat.checkpoint`)
consume the same stream.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from qstrat.config import RefitConfig, load_config
from qstrat.inputs import NamedTensors, as_tensor_dict, materialize
from qstrat.layouts import ModelLayout, detect_layout
from qstrat.plan.data import PASSTHROUGH, OutputTensor, PlanEntry, RefitPlan
from qstrat.plan.planner import Planner
from qstrat.registry import Registry, get_registry
from qstrat.rules import Decision, RuleSet
from qstrat.serializers.base import Serializer, check_finite

__all__ = ["Decision", "NamedTensors", "RefitDriver"]


class RefitDriver:
    """Applies a :class:`~qstrat.RefitConfig` to trainer output.

    Args:
        config: RefitConfig, mapping, config file path or preset name (see :func:`load_config`).
        hf_config: the model's parsed ``config.json`` (selects the layout and gives the decoder
            depth for ``keep_bf16.last`` and MTP detection). Without it the layout comes from
            ``config.layout`` (else ``generic``) and the depth is inferred from the names.
        registry: plugin registry (default: the process-wide one).
    Raises: ConfigError for an invalid config or an unknown layout name.
    """

    def __init__(self, config: Any, hf_config: Mapping[str, Any] | None = None,
                 registry: Registry | None = None) -> None:
        self.registry = registry or get_registry()
        self.config: RefitConfig = load_config(config, registry=self.registry)
        self.hf_config = dict(hf_config or {})
        self.layout: ModelLayout = layout_for(self.registry, self.config.layout, self.hf_config)
        self.rules = RuleSet(self.config, self.registry)
        self.planner = Planner(self.config, self.layout, self.rules, self.serializer, self.hf_config)
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
        Returns: the :class:`RefitPlan` in wire order.
        Raises: PlanError listing every problem found (not only the first).
        """
        return self.planner.plan(as_tensor_dict(named_tensors))

    # ---- run ------------------------------------------------------------------------------
    def run(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Plan, then quantize and yield ``(checkpoint_name, tensor)`` in wire order.

        Args: named_tensors: as for :meth:`plan` (real tensors, any device; BF16 typically).
        Yields: checkpoint tensors on the input's device; views into a slab's quantized parts
            for per-expert emission (call ``.contiguous()`` before serializing bytes).
        Raises: PlanError before the first tensor is yielded; NonFiniteError naming the tensor.
        """
        tensors = as_tensor_dict(named_tensors)
        plan = self.plan(tensors)
        yield from self.execute(plan, tensors)

    def check_values(self, plan: RefitPlan, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise NonFiniteError for the first input holding NaN/inf (passthrough tensors and
        formats with ``nonfinite="error"``), before anything is emitted. One read pass, no copies."""
        for e in plan.entries:
            t = materialize(tensors[e.name], e.name)
            if e.serializer == PASSTHROUGH:
                check_passthrough(t, e.name)
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
            yield o.name, cut_output(parts[o.suffix], o)
            if left == 1:
                del live[i]
            else:
                live[i] = (parts, left - 1)

    def _quantize_entry(self, e: PlanEntry, tensors: Mapping[str, torch.Tensor],
                        members: Mapping[str, list[str]], contexts: dict[str, Any],
                        values_checked: bool) -> dict[str, torch.Tensor]:
        t = materialize(tensors[e.name], e.name)
        if e.serializer == PASSTHROUGH:
            if not values_checked:
                check_passthrough(t, e.name)
            return {"weight": t}
        ser = self.serializer(e.serializer, e.options)
        ctx = None
        if e.group:
            if e.group not in contexts:
                contexts[e.group] = ser.group_context([materialize(tensors[m], m) for m in members[e.group]])
            ctx = contexts[e.group]
        return ser.quantize(t, name=e.name, context=ctx, values_checked=values_checked)


def layout_for(registry: Registry, name: str | None, hf_config: Mapping[str, Any] | None) -> ModelLayout:
    """The layout named in config (``layout:``), else the one the HF config selects, else ``generic``.

    Raises: ConfigError for an unknown layout name (listing the registered ones).
    """
    if name:
        return registry.lookup("layouts", name).obj
    return detect_layout({k: e.obj for k, e in registry.layouts.items()}, hf_config)


def check_passthrough(t: torch.Tensor, name: str) -> None:
    """NaN/inf in a tensor sent unchanged (norms, routers, embeddings) is an error too.

    Raises: NonFiniteError naming ``name`` and the first bad index.
    """
    if t.is_floating_point() and t.numel():
        w3 = t.reshape(1, -1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, 1, -1)
        check_finite(w3, name, 1)


def cut_output(part: torch.Tensor, o: OutputTensor) -> torch.Tensor:
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
