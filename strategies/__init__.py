"""Strategy presets (installed as ``qstrat.strategies``).

A :class:`Strategy` is a named partial :class:`qstrat.RefitConfig` mapping. Built-in presets live
in :mod:`qstrat.strategies.presets` and register through the ``qstrat_strategies`` hook.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Strategy:
    """A named preset.

    Attributes:
        name: registry name (``mxfp8-experts``).
        summary: one line for ``qstrat list``.
        config: partial RefitConfig mapping; a user's config extends it (user rules first).
    """

    name: str
    summary: str
    config: Mapping[str, Any] = field(default_factory=dict)


__all__ = ["Strategy"]
