"""The in-process vLLM sink: :func:`refit` quantizes a trainer's tensors and reloads them into a
running ``vllm.LLM`` (checks first, then the reload), returning a :class:`RefitReport`."""
from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qstrat.execute.driver import RefitDriver
from qstrat.vllm.checks.engine_manifest import EngineManifest
from qstrat.execute.named_tensors import NamedTensors
from qstrat.vllm.sink.kv_scales import KVScaleGuard
from qstrat.plan import RefitPlan
from qstrat.vllm.sink.reload import handed_over, reload
from qstrat.vllm.checks.sink_checks import engine_checks
from qstrat.vllm.sink.engine_flag import plan_coverage
from qstrat.vllm.checks import live_manifest as engine_manifests
from qstrat.vllm.sink.spool import spooled, warn_cost
from qstrat.vllm.adapter.platform_facts import in_process


@dataclass(frozen=True, repr=False)
class RefitReport:
    """What a refit did: the plan, tensors and bytes sent, seconds spent quantizing+sending.

    Printed (``repr``/``str``) as one line, the plan as its totals per format (the whole plan:
    ``report.plan.to_json()``)::

        RefitReport(tensors=247, bytes=5003712 (4.77 MiB), seconds=1.500, plan: layout qwen3_moe,
        4 decoder layers, 47 inputs -> 247 tensors (passthrough 23 -> 23, block_fp8 24 -> 224))
    """

    plan: RefitPlan
    tensors: int
    bytes: int
    seconds: float
    #: the fidelity probe's report (``refit(..., verify=...)``; docs/fidelity.md), else None
    fidelity: Any = None

    def __repr__(self) -> str:
        return (f"RefitReport(tensors={self.tensors}, bytes={self.bytes} ({self.bytes / 2**20:.2f} MiB), "
                f"seconds={self.seconds:.3f}, plan: {self.plan.summary()}"
                + (f"; {self.fidelity}" if self.fidelity is not None else "") + ")")


def refit(llm: Any, driver: RefitDriver, named_tensors: NamedTensors, stream: bool = False,
          plan: RefitPlan | None = None, manifest: EngineManifest | None = None,
          allow_cpu_bf16_experts: bool = False, weights_dir: str | Path | None = None,
          verify: Any = None, read_once: bool = False) -> RefitReport:
    """Quantize trainer tensors and reload them into a running vLLM ``LLM``.

    Before the first tensor is sent: :meth:`RefitDriver.prepare` with the engine's checks
    (:func:`engine_checks`), values first (docs/concepts.md, "What runs before the first byte").

    Args:
        llm: a ``vllm.LLM`` started on a checkpoint of the same model and format.
        driver: the refit driver.
        named_tensors: the trainer's (HF name, tensor) pairs: per-expert names or grouped slabs.
        stream: hand vLLM a generator (quantize while loading: memory bounded to about one
            layer of quantized parts) instead of a list of every quantized tensor. Needs an
            in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a multiprocess engine
            pickles its RPC arguments, which a generator cannot be.
        plan: a plan made beforehand, e.g. ``driver.plan(specs).only_layers(changed)`` to refit
            only the layers that changed: an explicit PARTIAL refit of whole layers (each part of
            the model the plan touches - a decoder layer, ``model.embed_tokens``, ``model.norm``,
            ``lm_head`` - must be complete; the others keep their weights). ``named_tensors``
            may then hold more tensors than the plan; the others are not sent. Without it the
            refit must update every layer.
        manifest: the engine's manifest (default: :func:`engine_manifest`).
        allow_cpu_bf16_experts: see :func:`check_cpu_expert_reload`.
        weights_dir: send the tensors through a file instead of the RPC: they are written as
            one safetensors file into a fresh temporary folder under ``weights_dir`` (deleted
            afterwards), and the engine reloads from it (``reload_weights(weights_path=...)``;
            vLLM then records that folder as its model path). Needed by multiprocess engines
            (vLLM's default, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``): vLLM 0.32 cannot forward
            tensors in ``collective_rpc`` kwargs from its engine core to a worker process
            ("cannot pickle memoryview objects"), so for such an engine the default is the
            system's temporary folder (``tempfile.gettempdir()``; the engine runs on this host).
            Every refit then holds the whole payload in this process's memory, writes it there
            and has the engine read it back: the first one in a process warns (RuntimeWarning
            naming the bytes, the folder and its free space; the transport,
            :class:`qstrat.transport.RefitSender`, is the path that scales). Not with ``stream``.
        read_once: ``named_tensors`` is an iterator read ONCE, in its order, whose items may be
            valid only until the next one is drawn (TRL's ``_iter_named_params`` under ZeRO-3 or
            FSDP, which the caller copies per item): each input is quantized as it arrives and
            dropped once its fused group is done (:func:`qstrat.execute.stream.execute`), so memory holds
            the payload (what is sent: quantized parts, BF16 tensors) plus about one layer of
            inputs, never a copy of every input. Values are checked as they arrive, and the whole
            payload is built before the reload begins: a bad value is still refused with nothing
            sent. Needs ``plan`` (the inputs cannot be read twice to plan them); not with ``stream``.
        verify: after the reload, ``verify(llm, driver)`` - e.g.
            ``qstrat.vllm.fidelity.probe.Verify(model)``: the fidelity probe (docs/fidelity.md) - and its
            result on ``RefitReport.fidelity``; it raises FidelityError when the engine does not
            serve what was sent (the reload is complete then). A ``verify`` with ``check_plan(plan)``
            / ``check_engine(llm)`` methods (``Verify`` has both) is asked first: what they raise
            is raised before anything is sent.
    Returns: a :class:`RefitReport`.
    Raises: ValueError (nothing sent, the engine unchanged) for ``stream`` with ``weights_dir``
        or with a multiprocess engine, ``read_once`` without ``plan`` or with ``stream``; PlanError, BackendUnavailableError or
        NonFiniteError (nothing sent); EngineManifestError (nothing sent: qstrat cannot tell what the engine accepts);
        EngineStateError if the reload failed after it began (the engine is flagged as holding a
        mix), and for every later PARTIAL refit of that engine until a whole one loads
        (nothing sent); KVScaleError (an EngineStateError) when the reload changed an FP8 KV-cache
        scale it did not send (:mod:`qstrat.vllm.sink.kv_scales`); FidelityError from ``verify``.
    """
    if verify is not None and not callable(verify):
        raise TypeError(f"refit: verify must be callable as verify(llm, driver) (e.g. qstrat.vllm.fidelity.probe.Verify(model)), "
                        f"got {type(verify).__name__}; nothing was sent")
    if stream and weights_dir is not None:
        raise ValueError("refit: stream=True hands vLLM a generator; weights_dir writes a file: pick one")
    if read_once and (plan is None or stream):
        raise ValueError("refit: read_once needs a plan (the inputs are read once, so they cannot be planned "
                         "first) and builds the whole payload before the reload (not with stream=True); "
                         "nothing was sent")
    if not in_process(llm):  # vLLM cannot pickle tensors (nor a generator) to a worker process
        if stream:
            raise ValueError("refit: stream=True needs an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0); "
                             "this engine runs in worker processes, which cannot receive a generator: "
                             "drop stream=True (the refit then goes through a temporary file)")
        if weights_dir is None:
            weights_dir = tempfile.gettempdir()
    start = time.perf_counter()
    checks = engine_checks(llm, driver, manifest, allow_cpu_bf16_experts)
    # values="first": vLLM's reload has no rollback (read_once checks them as they arrive, but
    # the payload is complete - every value checked - before the reload begins)
    prepared = driver.prepare(named_tensors, plan, checks, values="inline" if read_once else "first",
                              stream=read_once)
    plan = prepared.plan
    if callable(getattr(verify, "check_plan", None)):
        verify.check_plan(plan)  # e.g. a format with no fidelity threshold: refused before the reload
    if callable(getattr(verify, "check_engine", None)):
        verify.check_engine(llm)  # e.g. an engine whose max_logprobs caps the probe's top_k
    sent = {"tensors": 0, "bytes": 0, "handed": 0}

    def coverage() -> tuple[int, int]:  # asked only when the engine is flagged
        return plan_coverage(manifest if manifest is not None else engine_manifests.engine_manifest(llm, driver), plan)

    kv_scales = KVScaleGuard.start(llm)  # FP8 KV-cache scales: unchanged by the reload unless sent

    def payload() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in prepared.execute():
            t = t.contiguous()
            kv_scales.observe(name, t)
            sent["tensors"] += 1
            sent["handed"] = sent["tensors"]  # a stream is handed over as it is made
            sent["bytes"] += t.numel() * t.element_size()
            yield name, t

    total = len(plan.outputs())
    if weights_dir is None:
        # a list is complete (every value checked) before the engine starts; vLLM then draws it
        # one tensor at a time, and what it drew is what was handed over
        weights = payload() if stream else handed_over(list(payload()), sent)
        reload(llm, {"weights_iterator": weights}, lambda: f" ({sent['handed']} of {total} tensors handed over)", coverage)
    else:
        with spooled(payload(), weights_dir) as folder:
            warn_cost(sent["bytes"], Path(weights_dir))
            reload(llm, {"weights_path": folder},
                   lambda: f" (all {total} tensors written to a file for the engine to read; how many it "
                           "loaded before failing is not known)", coverage)
    kv_scales.check(llm)
    seconds = time.perf_counter() - start
    fidelity = verify(llm, driver) if verify is not None else None
    return RefitReport(plan, sent["tensors"], sent["bytes"], seconds, fidelity)

