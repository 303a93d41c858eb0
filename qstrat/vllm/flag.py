"""The failed-refit flag rule of an in-process engine: vLLM's layerwise reload has no rollback,
so a reload that fails once it began leaves the engine holding a MIX of two rounds. The engine is
flagged (:func:`mark_failed`); while flagged, a partial refit is refused before anything is sent
(:func:`check_whole_while_flagged`), and a whole refit that loads clears the flag
(:func:`clear_after_load`). The transport's receivers follow the same rule
(:mod:`qstrat.transport.mix_flag`)."""
from __future__ import annotations

from typing import Any

from qstrat.engine_manifest import EngineManifest
from qstrat.errors import EngineStateError
from qstrat.plan import RefitPlan

#: Attribute set on an engine whose reload failed part-way (it holds a mix: a whole refit repairs it).
FAILED = "_qstrat_refit_failed"


def mark_failed(engine: Any, reason: str) -> None:
    """Flag ``engine`` (the ``LLM``) as holding a mix of two rounds, ``reason`` saying why."""
    setattr(engine, FAILED, reason)


def clear_after_load(engine: Any) -> None:
    """A whole refit loaded into ``engine`` (a partial one is refused while flagged): clear the flag."""
    if getattr(engine, FAILED, None):
        setattr(engine, FAILED, None)


def check_whole_while_flagged(llm: Any, plan: RefitPlan, manifest: EngineManifest) -> None:
    """Refuse a partial refit of an engine flagged by a reload that failed part-way.

    Raises: EngineStateError naming the flag and how much of the engine the plan covers."""
    failed = getattr(llm, FAILED, None)
    if not failed:
        return
    parts, sent = set(manifest.parts()), manifest.parts_sent(plan)
    if parts - sent:
        raise EngineStateError(f"an earlier refit of this engine failed part-way ({failed}): it holds a MIX of "
                               f"two rounds; the next refit must be whole, this one sends {len(sent & parts)} of "
                               f"the {len(parts)} parts (nothing was sent)")

