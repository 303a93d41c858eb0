"""Target-module selectors: which tensors a rule applies to.

A :class:`Selector` is a named predicate on a :class:`~qstrat.layouts.model_layout.ParsedName`. Rules
(:mod:`qstrat.config.rules`) combine selectors (any of them) with include/exclude name patterns and the
``keep_bf16`` first/last-N decoder layer policy. Selectors are plugins (hook
``qstrat_selectors``); the built-ins (:mod:`qstrat.plugins.builtin.selectors`) register the same way.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qstrat.layouts.model_layout import ParsedName


@dataclass(frozen=True)
class Selector:
    """A named predicate on parsed tensor names.

    Attributes:
        name: registry name used in config (``select: experts``).
        summary: one line for ``qstrat list``.
        predicate: ``ParsedName -> bool``.
        special: True if it targets kinds that are never quantized by default (routers,
            embeddings, lm_head); naming such a selector is the explicit opt-in.
    """

    name: str
    summary: str
    predicate: Callable[[ParsedName], bool]
    special: bool = False
