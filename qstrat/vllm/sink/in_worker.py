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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qstrat.execute.checkpoint import PLAN_FILE
from qstrat.execute.driver import RefitDriver
from qstrat.errors import ConfigError
from qstrat.execute.named_tensors import NamedTensors
from qstrat.vllm.online import engine_online_args
from qstrat.plan import RefitPlan
from qstrat.vllm.checks.sink_checks import sink_checks
from qstrat.vllm.checks.live_manifest import model_manifest
from qstrat.vllm.sink.engine_flag import plan_coverage
from qstrat.vllm.sink.reload import _finalize_worker_reload, flagged_reload
from qstrat.vllm.sink.in_process import RefitReport
from qstrat.vllm.adapter.model_record import read_engine_model
from qstrat.vllm.adapter.views import WorkerView, parsed_config_of


def checkpoint_driver(model_config: Any) -> RefitDriver:
    """The :class:`~qstrat.execute.driver.RefitDriver` of the qstrat checkpoint an engine started on:
    the config recorded in its ``qstrat_plan.json``, with the engine's HF config.

    ``model_config``: vLLM's ``ModelConfig`` (:attr:`WorkerView.model_config`);
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
    return RefitDriver(config, hf_config=parsed_config_of(model_config))


def refit_worker(worker: Any, named_tensors: NamedTensors, driver: RefitDriver | None = None,
                 allow_cpu_bf16_experts: bool = False, plan: RefitPlan | None = None) -> RefitReport:
    """Quantize the trainer's tensors and reload them into the vLLM worker ``worker``.

    Args:
        worker: a vLLM GPU/CPU ``Worker`` (a worker extension's ``self``): its
            model config and model are read, its ``reload_weights`` called (:class:`WorkerView`).
        named_tensors: the trainer's (HF name, tensor) pairs, BF16 or FP32, the whole model
            (per-expert names or grouped slabs), as for :func:`qstrat.vllm.refit`.
        driver: default :func:`checkpoint_driver` (the engine checkpoint's strategy).
        allow_cpu_bf16_experts: see :func:`qstrat.vllm.check_cpu_expert_reload`.
        plan: a partial refit's plan (``driver.plan(...).only_layers(...)``), as for
            :func:`qstrat.vllm.refit`; None: the whole model.
    Returns: a :class:`~qstrat.vllm.RefitReport`.
    Raises: ConfigError (no qstrat checkpoint); PlanError, EngineManifestError,
        BackendUnavailableError, NonFiniteError (nothing handed to vLLM); EngineStateError when
        the reload failed after it began (the worker is flagged), and for every later PARTIAL
        refit of this worker until a whole one loads (nothing handed to vLLM): the rule of
        :func:`qstrat.vllm.sink.reload.flagged_reload`, the same as :func:`qstrat.vllm.refit`'s.
    """
    start = time.perf_counter()
    view = WorkerView(worker)
    mc = view.model_config
    driver = driver if driver is not None else checkpoint_driver(mc)
    manifests: list[Any] = []  # the one the checks built, for the flag's coverage

    def manifest() -> Any:
        manifests.append(model_manifest(mc, driver.registry, driver.config.layout, read_engine_model(worker)))
        return manifests[-1]

    checks = sink_checks(lambda: parsed_config_of(mc).quantization_config, manifest,
                         driver, allow_cpu_bf16_experts=allow_cpu_bf16_experts, flagged=worker,
                         online=lambda: engine_online_args(mc))
    prepared = driver.prepare(named_tensors, plan, checks)  # values first: vLLM's reload has no rollback
    tensors = [(name, t.contiguous()) for name, t in prepared.execute()]
    handed = [0]

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for item in tensors:
            handed[0] += 1
            yield item

    flagged_reload(worker, lambda: view.reload_weights(weights_iterator=counted(), is_checkpoint_format=True),
                   lambda: _finalize_worker_reload(worker),
                   lambda: f" ({handed[0]} of {len(tensors)} tensors handed over)",
                   lambda: plan_coverage(manifests[-1] if manifests else manifest(), prepared.plan))
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    return RefitReport(prepared.plan, len(tensors), nbytes, time.perf_counter() - start)
