"""Target-module selectors: which tensors a rule applies to.

A :class:`Selector` is a named predicate on a :class:`~qstrat.layouts.ParsedName`. Rules combine
selectors (any of them), include/exclude name patterns (globs, or regexes with a ``re:`` prefix)
and the ``keep_bf16`` first/last-N decoder layer policy. Selectors are plugins
(hook ``qstrat_selectors``); the built-ins below register through the same hook.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qstrat.layouts import QUANTIZABLE_KINDS, ParsedName


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


def _kind(*kinds: str) -> Callable[[ParsedName], bool]:
    return lambda p: p.kind in kinds


BUILTIN_SELECTORS = (
    Selector("linear", "every decoder linear layer: attention, dense MLP, experts, shared experts",
             lambda p: p.kind in QUANTIZABLE_KINDS),
    Selector("experts", "routed MoE experts only (per-expert names and grouped slabs)", _kind("expert")),
    Selector("shared_experts", "always-active shared experts", _kind("shared_expert")),
    Selector("attention", "attention projections (q/k/v/o, MLA projections)", _kind("attention")),
    Selector("dense_mlp", "MLP projections of dense (non-MoE) layers", _kind("dense_mlp")),
    Selector("routers", "MoE router linears (mlp.gate, shared_expert_gate): explicit opt-in",
             _kind("router"), special=True),
    Selector("embeddings", "token embeddings: explicit opt-in", _kind("embedding"), special=True),
    Selector("lm_head", "output projection: explicit opt-in", _kind("lm_head"), special=True),
)


class NamePattern:
    """A glob (``*.experts.*``) or, with a ``re:`` prefix, a regex searched in the HF name.

    Raises: ValueError for an invalid regex (reported by config validation with its key path).
    """

    def __init__(self, text: str) -> None:
        self.text = text
        if text.startswith("re:"):
            self._match = re.compile(text[3:]).search
        else:
            self._match = lambda name: fnmatch.fnmatchcase(name, text)

    def __call__(self, name: str) -> bool:
        return bool(self._match(name))

    def __repr__(self) -> str:
        return f"NamePattern({self.text!r})"


def any_match(patterns: Sequence[NamePattern], name: str) -> bool:
    """True if any pattern matches ``name``."""
    return any(p(name) for p in patterns)


def kept_bf16(p: ParsedName, num_layers: int | None, first: int, last: int) -> bool:
    """True if ``p`` is in the first ``first`` or last ``last`` decoder layers.

    Args:
        p: parsed name (MTP and non-decoder tensors are never decoder layers).
        num_layers: decoder depth (needed for ``last``); None with ``last > 0`` is an error
            caught at plan time.
    """
    if p.layer is None or p.kind == "mtp":
        return False
    if p.layer < first:
        return True
    return bool(last) and num_layers is not None and p.layer >= num_layers - last
