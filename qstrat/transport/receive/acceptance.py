"""A receiver's accept vote on one round: what it checks in the round's ``update_info`` and wire
manifest before any data (:func:`~qstrat.transport.receive.receiver.receive_round`'s ``check``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qstrat.errors import TransportError
from qstrat.transport.delta import encoding as delta
from qstrat.transport.engine_check import EngineExpectations
from qstrat.transport.receive.receiver_flag import MixFlag
from qstrat.transport.protocol import DELTA_MODES, MODES
from qstrat.transport.wire_manifest import WireManifest, check_against

#: What a receiver accepts: name -> (dtype, shape), or an engine's manifest (EngineExpectations).
Expected = dict[str, tuple[str, tuple[int, ...]]] | EngineExpectations


def check_expected(wm: WireManifest, info: dict[str, Any], expected: Expected | None, flag: MixFlag,
                   sent: set[str]) -> None:
    """A round's wire manifest ``wm`` against what the receiver accepts, then the MIX flag's rule:
    an engine's :class:`EngineExpectations` (who quantizes, the format, its tensors and whole reload
    units; ``info`` is the round's ``update_info``), a ``{name: (dtype, shape)}`` map
    (:func:`check_against`), or None (anything); a flagged receiver accepts only a whole round
    (``sent``: the round's tensor names). Raises: WireManifestMismatchError saying what differs."""
    if isinstance(expected, EngineExpectations):
        expected.check(wm, info)
    elif expected is not None:
        check_against(wm, expected)
    flag.check_whole(expected, sent)


class RoundCheck:
    """The check of one round, called with its wire manifest; records what the round sends.

    Malformed ``update_info`` is refused here, in the accept vote, not when it arrives: the
    sender and the other ranks are already waiting in the round's collectives.

    Args:
        update_info: the round's ``update_info`` as received (any value).
        expected: returns what the receiver accepts (:data:`Expected`, or None: anything).
        flag: the receiver's MIX flag (a flagged receiver accepts only a whole round).
        base: returns the receiver's delta base (``delta`` and ``bounded-delta`` rounds are checked against it).
    """

    def __init__(self, update_info: Any, expected: Callable[[], Expected | None], flag: MixFlag,
                 base: Callable[[], delta.Base | None]) -> None:
        self.update_info, self.expected, self.flag, self.base = update_info, expected, flag, base
        #: ``update_info`` if it is a dict, else empty.
        self.info: dict[str, Any] = update_info if isinstance(update_info, dict) else {}
        self.mode = self.info.get("mode", "atomic")
        #: The names of the tensors the round sends (its target's, for a delta round).
        self.sent: set[str] = set()
        #: A delta round's target wire manifest (the round's own), once checked.
        self.target: WireManifest | None = None

    def __call__(self, wm: WireManifest) -> None:
        """Raise unless the round may be received (TransportError: no dict or an unknown mode;
        WireManifestMismatchError: not what the receiver expects, or partial while flagged;
        :mod:`qstrat.transport.delta.encoding`'s errors for a delta round's header or base)."""
        if not isinstance(self.update_info, dict) or self.mode not in MODES:
            raise TransportError(f"qstrat transfer: update_info must be a dict with a round mode in "
                                 f"{MODES}, got mode {self.mode!r}")
        if self.mode in DELTA_MODES:  # the engine checks the round's (target) wire manifest, the base after
            delta.check_info(self.info.get("delta"))
            self.target = wm
        self.sent.update(s.name for s in wm.slots)
        check_expected(wm, self.info, self.expected(), self.flag, self.sent)
        if self.mode in DELTA_MODES:
            delta.check_base(self.info["delta"], wm, self.base())
