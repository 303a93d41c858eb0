"""vLLM sink: refit a running engine through its layerwise reload lifecycle.

Uses vLLM's public ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...,
"is_checkpoint_format": True})``: the engine receives HF checkpoint-format names and dtypes
(weights AND their scales), re-runs its post-load processing per layer and copies the results
into its live tensors. The whole plan is validated - including that it matches the engine's own
quantization_config - before the first tensor is sent: a reload that fails half-way leaves an
engine corrupted. Importing this module does not import vLLM.
"""
from __future__ import annotations

import fnmatch
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.driver import RefitDriver
from qstrat.inputs import NamedTensors, as_tensor_dict
from qstrat.errors import PlanError
from qstrat.plan import RefitPlan, natural_key

#: quantization_config keys that must agree between the engine and the plan.
_MATCH_KEYS = ("quant_method", "quant_algo", "weight_block_size", "group_size")


@dataclass(frozen=True)
class RefitReport:
    """What a refit did: the plan, tensors and bytes sent, seconds spent quantizing+sending."""

    plan: RefitPlan
    tensors: int
    bytes: int
    seconds: float


def engine_quantization_config(llm: Any) -> dict[str, Any] | None:
    """The engine's checkpoint ``quantization_config`` (from its HF config), or None."""
    hf = llm.llm_engine.model_config.hf_config
    cfg = getattr(hf, "quantization_config", None)
    return dict(cfg) if cfg else None


def check_engine_compatible(plan: RefitPlan, engine_config: Mapping[str, Any] | None) -> None:
    """Raise PlanError unless the plan emits what the engine's modules expect.

    Checks the format keys (:data:`_MATCH_KEYS`) and both directions of the ignore list: a
    module the plan quantizes must not be in the engine's ignore list, and a module the plan
    leaves in BF16 must be in it (sending BF16 into a module the engine serves in FP8 silently
    corrupts it). Ignore entries match exactly or as ``fnmatch`` wildcards (ModelOpt form).

    Args:
        plan: the validated refit plan.
        engine_config: the engine's ``quantization_config`` (None: unquantized engine).
    """
    mine = plan.vllm_quantization_config()
    if (mine is None) != (engine_config is None):
        raise PlanError(f"engine quantization_config {engine_config} does not match the plan's {mine}")
    if mine is None or engine_config is None:
        return
    for key in _MATCH_KEYS:
        if key in mine or key in engine_config:
            if _norm(mine.get(key)) != _norm(engine_config.get(key)):
                raise PlanError(f"quantization_config.{key}: engine has {engine_config.get(key)!r}, "
                                f"the plan emits {mine.get(key)!r}")
    engine_ignored = list(engine_config.get("ignored_layers") or engine_config.get("ignore") or ())
    plan_ignored = set(plan.ignored_layers)
    never_quantized = {e.engine_module for e in plan.entries if e.kind in ("lm_head", "embedding")}
    modules = {e.engine_module for e in plan.entries if len(e.shape) >= 2 and e.kind not in
               ("mtp", "non_decoder")} - never_quantized
    sent_quantized = sorted(m for m in modules - plan_ignored if _covered(m, engine_ignored))
    if sent_quantized:
        raise PlanError(f"the plan quantizes modules the engine keeps unquantized: {sent_quantized[:5]}")
    sent_bf16 = sorted((m for m in plan_ignored - never_quantized if not _covered(m, engine_ignored)),
                       key=natural_key)
    if sent_bf16:
        raise PlanError(f"the plan sends BF16 into modules the engine serves quantized (not in its "
                        f"ignore list): {sent_bf16[:5]}{' ...' if len(sent_bf16) > 5 else ''}")


def _covered(module: str, patterns: list[str]) -> bool:
    return any(module == p or fnmatch.fnmatchcase(module, p) for p in patterns)


def refit(llm: Any, driver: RefitDriver, named_tensors: NamedTensors, stream: bool = False,
          plan: RefitPlan | None = None) -> RefitReport:
    """Quantize trainer tensors and reload them into a running vLLM ``LLM``.

    Args:
        llm: a ``vllm.LLM`` started on a checkpoint of the same model and format.
        driver: the refit driver.
        named_tensors: the trainer's (HF name, tensor) pairs: per-expert names or grouped slabs.
        stream: hand vLLM a generator (quantize while loading: memory bounded to about one
            layer of quantized parts) instead of a list of every quantized tensor. Needs an
            in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a multiprocess engine
            pickles its RPC arguments, which a generator cannot be.
        plan: a plan made beforehand, e.g. ``driver.plan(specs).only_layers(changed)`` to refit
            only the layers that changed (whole layers; the others keep their weights).
            ``named_tensors`` may then hold more tensors than the plan; the others are not sent.
    Returns: a :class:`RefitReport`.
    Raises: PlanError (before anything is sent) if the plan is invalid or does not match the
        engine's quantization_config; NonFiniteError naming the tensor (before anything is
        sent: every input is checked first, one read pass, no copies).
    """
    start = time.perf_counter()
    tensors = as_tensor_dict(named_tensors)
    if plan is None:
        plan = driver.plan(tensors)
    else:
        driver.check_plan(plan)
    check_engine_compatible(plan, engine_quantization_config(llm))
    driver.check_values(plan, tensors)
    sent = {"tensors": 0, "bytes": 0}

    def payload() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in driver.execute(plan, tensors, values_checked=True):
            t = t.contiguous()
            sent["tensors"] += 1
            sent["bytes"] += t.numel() * t.element_size()
            yield name, t

    weights = payload() if stream else list(payload())
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                 "is_checkpoint_format": True})
    return RefitReport(plan, sent["tensors"], sent["bytes"], time.perf_counter() - start)


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
