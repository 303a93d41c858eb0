"""Refit from inside a vLLM worker: what an RL framework's worker extension calls when the
trainer's BF16 weights arrive in the engine's own process (verl's
``vLLMColocateWorkerExtension``, OpenRLHF's ``WorkerWrap``, NeMo-RL's worker extension).

The same checks as :func:`qstrat.vllm.refit` before the first tensor is handed to vLLM (the
plan, the engine's format, its manifest cross-checked with the worker's own model, ignore lists,
CPU experts, every value), then vLLM's layerwise reload in checkpoint format
(``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``). The strategy is the
one the engine's checkpoint was written with (its ``qstrat_plan.json``), so the engine and every
refit agree without a second setting. Importing this module does not import vLLM.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from qstrat.checkpoint import PLAN_FILE
from qstrat.driver import RefitDriver
from qstrat.errors import ConfigError, EngineStateError
from qstrat.inputs import NamedTensors
from qstrat.online import engine_online_args
from qstrat.vllm import _FAILED, RefitReport, model_manifest, quantization_config_of, sink_checks
from qstrat.vllm_adapter.model_record import read_engine_model


def checkpoint_driver(model_config: Any) -> RefitDriver:
    """The :class:`~qstrat.driver.RefitDriver` of the qstrat checkpoint an engine started on:
    the config recorded in its ``qstrat_plan.json``, with the engine's HF config.

    ``model_config``: vLLM's ``ModelConfig`` (``worker.model_runner.vllm_config.model_config``);
    its ``model`` is the checkpoint directory.
    Raises: ConfigError naming the directory when it holds no readable ``qstrat_plan.json``
    (the engine was not started on a qstrat checkpoint: ``qstrat quantize`` writes one).
    """
    plan_file = Path(str(model_config.model)) / PLAN_FILE
    try:
        config = json.loads(plan_file.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"the engine's model {model_config.model!r} is not a qstrat checkpoint ({plan_file}: "
                          f"{type(exc).__name__}: {exc}); start the rollout engine on one (`qstrat quantize`), "
                          "whose strategy every refit then uses") from exc
    return RefitDriver(config, hf_config=model_config.hf_config.to_dict())


def refit_worker(worker: Any, named_tensors: NamedTensors, driver: RefitDriver | None = None,
                 allow_cpu_bf16_experts: bool = False) -> RefitReport:
    """Quantize the trainer's tensors and reload them into the vLLM worker ``worker``.

    Args:
        worker: a vLLM GPU/CPU ``Worker`` (a worker extension's ``self``): its
            ``model_runner.vllm_config.model_config`` and ``model_runner.model`` are read, its
            ``reload_weights`` called.
        named_tensors: the trainer's (HF name, tensor) pairs, BF16 or FP32, the whole model
            (per-expert names or grouped slabs), as for :func:`qstrat.vllm.refit`.
        driver: default :func:`checkpoint_driver` (the engine checkpoint's strategy).
        allow_cpu_bf16_experts: see :func:`qstrat.vllm.check_cpu_expert_reload`.
    Returns: a :class:`~qstrat.vllm.RefitReport`.
    Raises: ConfigError (no qstrat checkpoint); PlanError, EngineManifestError,
        BackendUnavailableError, NonFiniteError (nothing handed to vLLM); EngineStateError when
        the reload failed after it began, and for every later refit of this worker.
    """
    failed = getattr(worker, _FAILED, None)
    if failed:
        raise EngineStateError(f"an earlier refit of this engine failed part-way ({failed}); its weights "
                               "are in an unknown state: restart the engine")
    start = time.perf_counter()
    mc = worker.model_runner.vllm_config.model_config
    driver = driver if driver is not None else checkpoint_driver(mc)
    checks = sink_checks(lambda: quantization_config_of(mc.hf_config),
                         lambda: model_manifest(mc, driver.registry, driver.config.layout,
                                                        read_engine_model(worker)),
                         driver, allow_cpu_bf16_experts=allow_cpu_bf16_experts, online=lambda: engine_online_args(mc))
    prepared = driver.prepare(named_tensors, None, checks)  # values first: vLLM's reload has no rollback
    tensors = [(name, t.contiguous()) for name, t in prepared.execute()]
    try:
        worker.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
    except Exception as exc:
        setattr(worker, _FAILED, f"{type(exc).__name__}: {exc}")
        raise EngineStateError(f"the refit failed after the engine began reloading: {type(exc).__name__}: {exc}. "
                               "vLLM's layerwise reload has no rollback: restart the engine") from exc
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    return RefitReport(prepared.plan, len(tensors), nbytes, time.perf_counter() - start)
