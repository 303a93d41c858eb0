"""vLLM's layerwise reload of a running engine (``reload_weights`` through
``LLM.collective_rpc``), and what a failure once it began does: the reload is finalized in every
worker and the engine flagged (:mod:`qstrat.vllm.sink.engine_flag`)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from qstrat.errors import EngineStateError
from qstrat.vllm.sink.engine_flag import clear_after_load, engine_flag, mark_failed
from qstrat.vllm.adapter.views import EngineView, WorkerView


def reload(llm: Any, source: dict[str, Any], progress: Callable[[], str],
           coverage: Callable[[], tuple[int, int]]) -> None:
    """Run vLLM's layerwise ``reload_weights`` from ``source`` (an iterator or a folder) in every
    worker of ``llm``, under :func:`flagged_reload`'s rule (``progress``: its text of how much
    was handed over; ``coverage``: as :func:`flagged_reload` takes it)."""
    view = EngineView(llm)
    flagged_reload(llm, lambda: view.reload_weights(**source, is_checkpoint_format=True),
                   lambda: finalize_engine_reload(llm), progress, coverage)


def finalize_engine_reload(llm: Any) -> None:
    """``finalize_layerwise_reload`` in every worker of ``llm`` after a failed reload: an
    in-process engine runs :func:`_finalize_worker_reload` as a function; a multiprocess one (whose
    RPC cannot carry a function: "Object of type <class 'function'> is not serializable") by name,
    ``qstrat_finalize_reload`` of qstrat's worker extension (:class:`qstrat.vllm.sink.kv_scales.KVScaleReader`).

    Raises: ConfigError for a multiprocess engine whose ``worker_extension_cls`` lacks it
        (:meth:`qstrat.execute.mix_rule.MixFlag.fail_load` adds it to the flag's reason).
    """
    from qstrat.errors import ConfigError
    from qstrat.vllm.sink.kv_scales import READER, extension_class
    from qstrat.vllm.adapter.platform_facts import in_process

    view = EngineView(llm)
    if in_process(llm):
        view.collective_rpc(_finalize_worker_reload)
        return
    extension = view.worker_extension_cls
    if not hasattr(extension_class(extension), "qstrat_finalize_reload"):
        raise ConfigError(f"this multiprocess engine's worker_extension_cls ({repr(extension) if extension else 'none'}) has no "
                          "qstrat_finalize_reload, and vLLM's RPC cannot send a function to a worker process: the "
                          "failed reload was not finalized (layers that received nothing keep no weights until a "
                          f"whole refit loads). Start the engine with worker_extension_cls={READER!r}")
    view.collective_rpc("qstrat_finalize_reload")


def handed_over(tensors: list[tuple[str, Any]], count: dict[str, int], key: str = "handed"
                ) -> Iterator[tuple[str, Any]]:
    """Yield ``tensors`` (a complete payload) one by one, counting in ``count[key]`` how many the
    consumer (vLLM's reload) has drawn: what a failed reload really received, not what was built."""
    count[key] = 0
    for item in tensors:
        count[key] += 1
        yield item


def flagged_reload(engine: Any, reload: Callable[[], Any], finalize: Callable[[], Any],
                   progress: Callable[[], str], coverage: Callable[[], tuple[int, int]]) -> None:
    """Run ``reload()`` (vLLM's layerwise reload into ``engine``: an ``LLM``, or one worker for
    :mod:`qstrat.vllm.sink.in_worker`) under the rule every qstrat engine sink follows
    (:mod:`qstrat.vllm.sink.engine_flag`): a reload that fails after it began is finalized (``finalize()``)
    and ``engine`` FLAGGED as holding a mix of two rounds; while flagged, a partial refit is
    refused before anything is sent; a whole one that loads clears the flag.

    Args: progress: text after "began reloading" in the error (how much was handed over);
        coverage: (parts the refit sends, the engine's parts), asked only when flagged
        (:func:`qstrat.vllm.sink.engine_flag.plan_coverage`).
    Raises: EngineStateError for any failure of ``reload()`` (vLLM's reload has no rollback).
    """
    try:
        reload()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        engine_flag(engine).fail_load(reason, finalize)
        raise EngineStateError(
            f"the refit failed after the engine began reloading{progress()}: {reason}. vLLM's layerwise reload "
            "has no rollback: the engine holds a MIX of two rounds and accepts only a whole refit now") from exc
    except BaseException as exc:  # KeyboardInterrupt mid-reload: same state, keep the interrupt
        mark_failed(engine, f"{type(exc).__name__} during reload")
        raise
    clear_after_load(engine, coverage)  # only a whole refit clears (a partial one was refused before)


def _finalize_worker_reload(worker: Any) -> None:
    """In a vLLM worker: ``finalize_layerwise_reload`` on its model (a no-op for layers that are
    not being reloaded)."""
    from qstrat.vllm.adapter.resolver import resolve

    view = WorkerView(worker)
    resolve("finalize_layerwise_reload")(view.model(), view.model_config)

