"""The checks a running engine adds to :meth:`RefitDriver.prepare` (:func:`engine_checks`; any
engine: :func:`sink_checks`), sharing the engine's quantization_config and manifest between them."""
from __future__ import annotations

from typing import Any

from qstrat.execute.driver import RefitDriver
from qstrat.vllm.checks.engine_manifest import EngineManifest, check_plan
from qstrat.vllm.online import check_engine_online, engine_online_args, engine_unquantized
from qstrat.execute.prepare import PreparedRefit, SinkCheck
from qstrat.vllm.checks import live_manifest as engine_manifests
from qstrat.vllm.checks.plan_fit import check_cpu_expert_reload, check_engine_compatible, check_engine_format
from qstrat.vllm.sink.engine_flag import check_whole_while_flagged
from qstrat.vllm.checks.quant_config import engine_quantization_config
from qstrat.vllm.adapter.views import EngineView


class _EngineChecks:
    """The engine sink's checks (:func:`engine_checks`), sharing the engine's quantization_config
    and manifest between them (each is read once per refit)."""

    def __init__(self, quantization_config: Any, make_manifest: Any, driver: RefitDriver,
                 manifest: EngineManifest | None, allow_cpu_bf16_experts: bool, flagged: Any = None,
                 online: Any = None) -> None:
        self.online = online  # online(): the engine's online-quantization args (qstrat.vllm.online), or None
        # quantization_config(), make_manifest(): read when the checks run, not before
        self.quantization_config, self.make_manifest = quantization_config, make_manifest
        self.flagged = flagged  # what carries a failed reload's flag (the LLM), or None
        self.driver, self.given_manifest = driver, manifest
        self.allow_cpu_bf16_experts = allow_cpu_bf16_experts
        self.config: dict[str, Any] | None = None
        self.manifest: EngineManifest | None = None

    def engine_format(self, p: PreparedRefit) -> None:
        self.config = self.quantization_config()
        check_engine_format(p.plan, self.config, self.driver.registry)

    def engine_manifest(self, p: PreparedRefit) -> None:
        self.manifest = self.given_manifest if self.given_manifest is not None else self.make_manifest()
        check_plan(p.plan, self.manifest, self.manifest.parts_sent(p.plan) if p.plan_given else None)
        if self.flagged is not None:
            check_whole_while_flagged(self.flagged, p.plan, self.manifest)

    def ignore_lists(self, p: PreparedRefit) -> None:
        check_engine_compatible(p.plan, self.config, self.driver.registry)

    def engine_quantization(self, p: PreparedRefit) -> None:
        check_engine_online(p.plan, self.online() if self.online is not None else None)

    def cpu_experts(self, p: PreparedRefit) -> None:
        if self.manifest is not None:
            check_cpu_expert_reload(engine_unquantized(p.plan), self.manifest, self.allow_cpu_bf16_experts)



def engine_checks(llm: Any, driver: RefitDriver, manifest: EngineManifest | None = None,
                  allow_cpu_bf16_experts: bool = False) -> tuple[SinkCheck, ...]:
    """The checks a running engine adds to :meth:`RefitDriver.prepare`, in this order:

    0. ``engine quantization``: plan and engine agree on who quantizes, and the engine runs the
       online config a ``quantize_in: engine`` plan was made for (:func:`qstrat.vllm.online.check_engine_online`);
    1. ``engine format``: the plan's format is the engine's (:func:`check_engine_format`);
    2. ``engine manifest``: the plan against the engine's manifest (``manifest``, default
       :func:`engine_manifest`; :func:`qstrat.vllm.checks.engine_manifest.check_plan`: names, shapes,
       dtypes, every reload unit complete, every layer covered unless the plan was given), and
       a whole plan while the engine is flagged (:func:`check_whole_while_flagged`);
    3. ``ignore lists``: both directions of the ignore list (:func:`check_engine_compatible`);
    4. ``cpu experts``: no unquantized routed experts into a CPU engine
       (:func:`check_cpu_expert_reload`; experts the engine quantizes online are quantized).

    Raises (when run): PlanError; EngineManifestError (the manifest cannot be built or vLLM
    disagrees with it).
    """
    return sink_checks(lambda: engine_quantization_config(llm), lambda: engine_manifests.engine_manifest(llm, driver),
                       driver, manifest, allow_cpu_bf16_experts, flagged=llm,
                       online=lambda: engine_online_args(EngineView(llm).model_config))


def sink_checks(quantization_config: Any, make_manifest: Any, driver: RefitDriver,
                manifest: EngineManifest | None = None, allow_cpu_bf16_experts: bool = False,
                flagged: Any = None, online: Any = None) -> tuple[SinkCheck, ...]:
    """:func:`engine_checks`' five checks, in order, for any engine: ``quantization_config()``
    returns its checkpoint quantization_config (None: unquantized), ``make_manifest()`` its
    :class:`~qstrat.vllm.checks.engine_manifest.EngineManifest` (called only when ``manifest`` is None);
    both are called when the checks run. ``flagged``: the object a failed reload flags (the
    ``LLM``; :func:`check_whole_while_flagged`), None to skip that check. Used inside vLLM
    workers (:mod:`qstrat.vllm.sink.in_worker`)."""
    c = _EngineChecks(quantization_config, make_manifest, driver, manifest, allow_cpu_bf16_experts, flagged, online)
    return (SinkCheck("engine quantization", c.engine_quantization), SinkCheck("engine format", c.engine_format),
            SinkCheck("engine manifest", c.engine_manifest), SinkCheck("ignore lists", c.ignore_lists),
            SinkCheck("cpu experts", c.cpu_experts))

