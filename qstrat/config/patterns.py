"""Name patterns of a config's ``include`` / ``exclude``: a glob, or a regex after ``re:``.

Compiled when a config is validated (:mod:`qstrat.config.schema`: an invalid regex is reported
with its key path) and matched when rules decide (:mod:`qstrat.config.rules`).
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence


class NamePattern:
    """A glob (``*.experts.*``) or, with a ``re:`` prefix, a regex searched in the checkpoint name
    (:meth:`qstrat.layouts.model_layout.ModelLayout.checkpoint_name`: the same whatever wraps the model).

    Raises: re.error for an invalid regex (reported by config validation with its key path).
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
