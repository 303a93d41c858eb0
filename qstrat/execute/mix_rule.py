"""The MIX flag rule every engine sink follows, in-process (:mod:`qstrat.vllm.sink.engine_flag`) or across
processes (:mod:`qstrat.transport.receive.receiver_flag`): vLLM's layerwise reload has no rollback, so a refit
that fails once the engine began loading leaves it holding a MIX of two rounds. The holder is
FLAGGED; while flagged, a refit that does not update the whole engine is refused before anything
is sent; a whole refit that loads completely clears the flag - and ONLY a whole one: a holder
clears on :meth:`MixFlag.clear_if_whole`, never unconditionally, so a partial refit that reached
the engine by a path that skipped the refusal still leaves it flagged (issue 43: the in-process
holder used to clear on any load that finished). A failed load is flagged, THEN finalized
(:meth:`MixFlag.fail_load`), so the flag stands even when finalizing fails too.

What "whole" counts (an engine's parts, or a receiver's tensor names) and which error a refusal
raises belong to the sink; the rule and its words are here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from qstrat.errors import QstratError


class MixFlag:
    """One holder's flag: :attr:`reason` (None: not flagged) and the rule over it.

    Args:
        holder: the words naming the holder in a refusal ("this engine", "this receiver").
        error: the error a refusal raises.
    """

    def __init__(self, holder: str, error: type[QstratError]) -> None:
        self.holder, self.error = holder, error
        #: Why the holder holds a MIX (None: it does not).
        self.reason: str | None = None
        #: The tensor names the round that set the flag sent (what "whole" is when the sink
        #: knows nothing better).
        self.required: set[str] | None = None

    def set(self, reason: str, sent: Iterable[str] = ()) -> None:
        """Flag the holder: a refit sending ``sent`` (tensor names) failed once it began loading."""
        self.reason = reason
        self.required = self.required or set(sent)

    def refuse_partial(self, sends: int, whole: int, unit: str, after: str = "") -> None:
        """Refuse a refit that updates ``sends`` of the ``whole`` ``unit`` (e.g. "parts") while
        flagged (``after``: words appended to the reason, e.g. what was not sent).

        Raises: ``error`` naming the flag's reason and the coverage, when flagged and ``sends < whole``.
        """
        if self.reason is not None and sends < whole:
            raise self.error(f"{self.holder} holds a MIX of two rounds ({self.reason}): the next refit must be "
                             f"whole, this one sends {sends} of the {whole} {unit}{after}")

    def fail_load(self, reason: str, finalize: Callable[[], object], sent: Iterable[str] = ()) -> None:
        """A load that began failed: flag the holder (:meth:`set`), then ``finalize()`` the reload
        (layers that received nothing get their weights back); a finalize that fails too is added
        to the reason, never raised (the flag is what matters now)."""
        self.set(reason, sent)
        try:
            finalize()
        except Exception as exc:  # noqa: BLE001 - the flag stands either way
            self.reason = f"{self.reason} (finalizing the reload failed too: {type(exc).__name__}: {exc})"

    def clear_if_whole(self, sends: int, whole: int) -> None:
        """A refit updating ``sends`` of the ``whole`` loaded completely: clear the flag if it was whole."""
        if sends >= whole:
            self.reason, self.required = None, None
