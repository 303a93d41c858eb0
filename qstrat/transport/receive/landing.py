"""Where a receiver's tensors land: the :class:`Loader` a receiver is built with, and
:class:`Landing`, which brackets a round's loads with one ``begin_load`` and one ``end_load``."""
from __future__ import annotations

from typing import Protocol

import torch


class Loader(Protocol):
    """Where a receiver's tensors go (:mod:`qstrat.transport.receive.session`'s module docstring)."""

    def begin_load(self) -> None: ...
    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None: ...
    def end_load(self) -> None: ...


class Landing:
    """A round's loads into ``loader``: ``begin_load`` before the first :meth:`load`, ``end_load``
    at :meth:`end` (only if a load began; units that got nothing keep their weights)."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self._open = False

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load ``tensors`` (whole reload units), beginning the reload first if this round's
        first. Raises: what the loader raises."""
        if not self._open:
            self.loader.begin_load()
            self._open = True
        self.loader.load(tensors)

    def end(self) -> None:
        """Finalize the reload if one began (idempotent). Raises: what ``end_load`` raises."""
        if self._open:
            self._open = False
            self.loader.end_load()
