"""A receiver's MIX flag (:mod:`qstrat.transport.receive.session`'s fault semantics): the rule of
:mod:`qstrat.execute.mix_rule`, with "whole" measured against what the receiver expects."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qstrat.execute import mix_rule as mix_flag
from qstrat.errors import WireManifestMismatchError
from qstrat.transport.engine_check import EngineExpectations


class MixFlag(mix_flag.MixFlag):
    """A receiver's flag; a refusal raises WireManifestMismatchError.

    "Whole" is the receiver's expectations when it has them (every part of an engine's
    :class:`~qstrat.transport.engine_check.EngineExpectations`, or every name of a
    ``name -> (dtype, shape)`` mapping), else every tensor of the round that set the flag.
    """

    def __init__(self) -> None:
        super().__init__("this receiver", WireManifestMismatchError)

    def check_whole(self, expected: Any, sent: set[str]) -> None:
        """Raise WireManifestMismatchError, naming the flag, when the receiver is flagged and a
        round sending ``sent`` is not whole for ``expected``."""
        if self.reason is None:
            return
        self.refuse_partial(*self._coverage(expected, sent),
                            "parts" if isinstance(expected, EngineExpectations) else "tensors")

    def loaded(self, expected: Callable[[], Any], sent: set[str]) -> None:
        """A round sending ``sent`` loaded completely: clear the flag if it was whole
        (``expected`` is called only when the receiver is flagged)."""
        if self.reason is not None:
            self.clear_if_whole(*self._coverage(expected(), sent))

    def _coverage(self, expected: Any, sent: set[str]) -> tuple[int, int]:
        """(how much of the receiver a round sending ``sent`` updates, the whole)."""
        if isinstance(expected, EngineExpectations):
            return expected.coverage(sent)
        need = set(expected) if expected is not None else (self.required or set())
        return len(need & sent), len(need)
