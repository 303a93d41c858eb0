"""An in-process engine's MIX flag: the rule of :mod:`qstrat.execute.mix_rule` (the one the transport's
receivers follow too), held on the engine (the ``LLM``, or one worker for :mod:`qstrat.vllm.sink.in_worker`),
with "whole" counted in the engine manifest's parts. A reload that fails once it began flags the
engine (:func:`mark_failed`); while flagged, a partial refit is refused before anything is sent
(:func:`check_whole_while_flagged`); a whole refit that loads clears the flag (:func:`clear_after_load`:
only a whole one, the rule of :mod:`qstrat.execute.mix_rule`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qstrat.vllm.checks.engine_manifest import EngineManifest
from qstrat.errors import EngineStateError
from qstrat.execute.mix_rule import MixFlag
from qstrat.plan import RefitPlan
from qstrat.vllm.adapter.engine_state import EngineState

#: Each engine's :class:`~qstrat.execute.mix_rule.MixFlag` (made on first use), kept by qstrat, not on the engine.
FLAGS: EngineState[MixFlag] = EngineState("MIX flag")


def engine_flag(engine: Any) -> MixFlag:
    """``engine``'s flag (:attr:`MixFlag.reason` None: it holds one round); a refusal raises
    EngineStateError."""
    return FLAGS.setdefault(engine, lambda: MixFlag("this engine", EngineStateError))


def mark_failed(engine: Any, reason: str) -> None:
    """Flag ``engine`` as holding a mix of two rounds, ``reason`` saying why."""
    engine_flag(engine).set(reason)


def clear_after_load(engine: Any, coverage: Callable[[], tuple[int, int]]) -> None:
    """A refit loaded into ``engine`` completely: clear the flag if the refit was whole
    (``coverage()``: (parts it sent, the engine's parts), called only when flagged: :func:`plan_coverage`)."""
    flag = engine_flag(engine)
    if flag.reason is not None:
        flag.clear_if_whole(*coverage())


def plan_coverage(manifest: EngineManifest, plan: RefitPlan) -> tuple[int, int]:
    """(how many of the engine's parts (:meth:`EngineManifest.parts`) ``plan`` sends, how many it has)."""
    parts = set(manifest.parts())
    return len(parts & manifest.parts_sent(plan)), len(parts)


def check_whole_while_flagged(llm: Any, plan: RefitPlan, manifest: EngineManifest) -> None:
    """Refuse a partial refit of an engine flagged by a reload that failed part-way.

    Raises: EngineStateError naming the flag's reason and how many of the engine's parts
    (:meth:`EngineManifest.parts`) the plan covers."""
    flag = engine_flag(llm)
    if flag.reason is None:
        return
    flag.refuse_partial(*plan_coverage(manifest, plan), "parts", " (nothing was sent)")
