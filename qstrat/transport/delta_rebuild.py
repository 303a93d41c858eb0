"""A receiver's delta base across rounds (:mod:`qstrat.transport.delta`), and the rebuild of a
delta round's tensors from it."""
from __future__ import annotations

from typing import Any

import torch

from qstrat.transport import delta
from qstrat.transport.keys import Secret
from qstrat.transport.wire_manifest import WireManifest


class DeltaRebuild:
    """The base (the tensors' bytes as of the last delta-mode round this receiver loaded, in host
    memory) and the next one (the round rebuilt, until it is loaded)."""

    def __init__(self) -> None:
        #: None: no base (any round in another mode, or a failed load, drops it).
        self.base: delta.Base | None = None
        self._next: delta.Base | None = None

    def rebuild(self, blobs: list[tuple[str, torch.Tensor]], info: dict[str, Any], target: WireManifest,
                secret: Secret | None) -> list[tuple[str, torch.Tensor]]:
        """The round's ``(name, tensor)`` pairs in ``target``'s order, rebuilt from ``blobs`` (the
        received delta round) and :attr:`base`; the next base is kept until :meth:`take_next`.
        Raises: DeltaError (:func:`qstrat.transport.delta.decode_round`), after dropping the base
        (out of step with the trainer: the next round is whole)."""
        try:
            staged, self._next = delta.decode_round(blobs, info, target, self.base, secret)
        except delta.DeltaError:
            self.base = None
            raise
        return staged

    def take_next(self) -> delta.Base | None:
        """The base of the round rebuilt last (None: none), forgotten here."""
        next_base, self._next = self._next, None
        return next_base
