"""Wall seconds by phase, for the sender's and receivers' round profiles."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class Phases(dict):
    """``name -> seconds`` (a dict), accumulated by :meth:`timed` and :meth:`call`."""

    def __init__(self, *names: str) -> None:
        super().__init__(dict.fromkeys(names, 0.0))

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the wall seconds of the ``with`` block to ``name`` (also when it raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - t0

    def call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its wall seconds added to ``name``."""
        with self.timed(name):
            return fn(*args)
