"""Strategy presets (installed as ``qstrat.strategies``).

A :class:`Strategy` is a named partial refit config: a typed
:class:`~qstrat.config.schema.PresetConfig` (built-in presets, :mod:`qstrat.strategies.presets`) or,
from a third-party plugin, a plain mapping with the same keys, validated when the registry
loads. Presets register through the ``qstrat_strategies`` hook.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qstrat.config.schema import PresetConfig


@dataclass(frozen=True)
class Strategy:
    """A named preset.

    Attributes:
        name: registry name (``mxfp8-experts``).
        summary: one line for ``qstrat list``.
        config: a :class:`~qstrat.config.schema.PresetConfig`, or a partial RefitConfig mapping; a
            user's config extends it (user rules first).
    """

    name: str
    summary: str
    config: PresetConfig | Mapping[str, Any] = field(default_factory=dict)

    def mapping(self) -> dict[str, Any]:
        """The preset's keys as a plain mapping (what a RefitConfig merges)."""
        if isinstance(self.config, PresetConfig):
            return self.config.to_mapping()
        return dict(self.config)


__all__ = ["PresetConfig", "Strategy"]
