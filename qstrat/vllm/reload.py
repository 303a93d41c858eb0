"""vLLM's layerwise reload of a running engine (``reload_weights`` through
``LLM.collective_rpc``), and what a failure once it began does: the reload is finalized in every
worker and the engine flagged (:mod:`qstrat.vllm.flag`)."""
from __future__ import annotations

from typing import Any

from qstrat.errors import EngineStateError
from qstrat.vllm.flag import clear_after_load, mark_failed


def reload(llm: Any, source: dict[str, Any], sent: dict[str, int], total: int) -> None:
    """Run vLLM's layerwise ``reload_weights`` from ``source`` (an iterator or a folder).

    Raises: EngineStateError for any failure once the engine began reloading: vLLM's reload has
    no rollback, so the reload is finalized and the engine flagged (a later partial refit is
    refused, a whole one that loads clears the flag).
    """
    try:
        llm.collective_rpc("reload_weights", kwargs={**source, "is_checkpoint_format": True})
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        mark_failed(llm, reason + _finalize_failed_reload(llm))
        raise EngineStateError(
            f"the refit failed after the engine began reloading ({sent['tensors']} of {total} "
            f"tensors handed over): {reason}. vLLM's layerwise reload has no rollback: the engine holds a "
            "MIX of two rounds and accepts only a whole refit now") from exc
    except BaseException as exc:  # KeyboardInterrupt mid-reload: same state, keep the interrupt
        mark_failed(llm, f"{type(exc).__name__} during reload")
        raise
    clear_after_load(llm)  # a whole refit loaded (a partial one was refused before)


def _finalize_failed_reload(llm: Any) -> str:
    """Finalize the layerwise reload a failure left open in every worker (layers that received
    nothing get their weights back; the transport's loader does the same). Returns "" or why it
    could not (added to the flag)."""
    try:
        llm.collective_rpc(_finalize_worker_reload)
    except Exception as exc:  # noqa: BLE001 - the flag stands either way
        return f" (finalizing the reload failed too: {type(exc).__name__}: {exc})"
    return ""


def _finalize_worker_reload(worker: Any) -> None:
    """In a vLLM worker: ``finalize_layerwise_reload`` on its model (a no-op for layers that are
    not being reloaded)."""
    from qstrat.vllm_adapter.resolver import resolve

    runner = worker.model_runner
    resolve("finalize_layerwise_reload")(runner.get_model(), runner.vllm_config.model_config)

