"""vLLM sink: refit a running engine through its layerwise reload lifecycle.

Uses vLLM's public ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...,
"is_checkpoint_format": True})``: the engine receives HF checkpoint-format names and dtypes
(weights AND their scales), re-runs its post-load processing per layer and copies the results
into its live tensors. That reload has no rollback, so everything that can fail is checked
before the first tensor is sent: :meth:`RefitDriver.prepare` with this sink's checks
(:func:`engine_checks`: the engine's format, its manifest - :mod:`qstrat.engine_manifest`,
cross-checked with vLLM's own record of the model -, its ignore lists, CPU experts) and every
value read first. What can still fail once the engine has begun
(out of memory, an engine-side fault) raises :class:`~qstrat.errors.EngineStateError`: the
reload is finalized (layers that received nothing keep their weights) and the engine is
FLAGGED as holding a mix; while flagged it refuses a partial refit before anything is sent, and
a whole refit that loads clears the flag - the rule of :mod:`qstrat.mix_flag`, which the
transport's receivers follow too.
Importing this package does not import vLLM.

The sink's pieces, one concept each: :mod:`~qstrat.vllm.sink` (:func:`refit`, :class:`RefitReport`),
:mod:`~qstrat.vllm.checks` (the checks a refit runs first), :mod:`~qstrat.vllm.compat` (a plan
against the engine's format and ignore lists), :mod:`~qstrat.vllm.manifest` (the engine's manifest
and vLLM's agreement with it), :mod:`~qstrat.vllm.quant_config`, :mod:`~qstrat.vllm.flag` (the
failed-refit rule), :mod:`~qstrat.vllm.reload` and :mod:`~qstrat.vllm.spool` (a refit through a file).
Every public name is importable from ``qstrat.vllm``.
"""
from qstrat.vllm.compat import check_cpu_expert_reload, check_engine_compatible, check_engine_format
from qstrat.vllm.flag import check_whole_while_flagged
from qstrat.vllm.manifest import check_engine_built, check_model_built, engine_manifest, model_manifest
from qstrat.vllm.quant_config import engine_quantization_config, quantization_config_of
from qstrat.vllm.sink import RefitReport, refit
from qstrat.vllm.checks import engine_checks, sink_checks

__all__ = ["RefitReport", "check_cpu_expert_reload", "check_engine_built", "check_engine_compatible",
           "check_engine_format", "check_model_built", "check_whole_while_flagged", "engine_checks",
           "engine_manifest", "engine_quantization_config", "model_manifest", "quantization_config_of", "refit",
           "sink_checks"]
