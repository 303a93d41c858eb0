"""A receiver's MIX flag (:mod:`qstrat.transport.session`'s fault semantics): set when it holds
new weights from a round that was not committed everywhere; while set, a round must be WHOLE; a
whole round that loads completely clears it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qstrat.errors import WireManifestMismatchError
from qstrat.transport.engine_check import EngineExpectations


class MixFlag:
    """The flag and what "whole" means for it.

    "Whole" is the receiver's expectations when it has them (every part of an engine's
    :class:`~qstrat.transport.engine_check.EngineExpectations`, or every name of a
    ``name -> (dtype, shape)`` mapping), else every tensor of the round that set the flag.
    """

    def __init__(self) -> None:
        #: Why this receiver holds a MIX (None: it does not).
        self.reason: str | None = None
        self._required: set[str] | None = None

    def set(self, reason: str, sent: set[str]) -> None:
        """Flag the receiver after a round sending ``sent`` (tensor names) left it mixed."""
        self.reason = reason
        self._required = self._required or sent

    def check_whole(self, expected: Any, sent: set[str]) -> None:
        """Raise WireManifestMismatchError, naming the flag, when the receiver is flagged and a
        round sending ``sent`` is not whole for ``expected``."""
        if self.reason is None:
            return
        sends, whole = self._coverage(expected, sent)
        if sends < whole:
            word = "parts" if isinstance(expected, EngineExpectations) else "tensors"
            raise WireManifestMismatchError(
                f"this receiver holds a MIX of two rounds ({self.reason}): the next refit "
                f"must be whole, this one sends {sends} of the {whole} {word}")

    def loaded(self, expected: Callable[[], Any], sent: set[str]) -> None:
        """A round sending ``sent`` loaded completely: clear the flag if it was whole
        (``expected`` is called only when the receiver is flagged)."""
        if self.reason is None:
            return
        sends, whole = self._coverage(expected(), sent)
        if sends == whole:
            self.reason, self._required = None, None

    def _coverage(self, expected: Any, sent: set[str]) -> tuple[int, int]:
        """(how much of the receiver a round sending ``sent`` updates, the whole)."""
        if isinstance(expected, EngineExpectations):
            return expected.coverage(sent)
        need = set(expected) if expected is not None else (self._required or set())
        return len(need & sent), len(need)
