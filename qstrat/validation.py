"""How qstrat words validation problems: one line per pydantic error with its key path, and the
nearest valid name for a misspelt one. Shared by the config schema and the plugin registry.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError


#: pydantic error type carrying a nested model's errors (``ctx["errors"]``: (loc, msg) pairs),
#: expanded by :func:`format_validation_error` into one line per error with the full key path.
NESTED_ERRORS = "qstrat_nested_errors"


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per pydantic error: ``rules[0].serializer: unknown serializer 'x'; valid: ...``.

    Errors of a nested model (a rule's serializer options) are expanded under their own path:
    ``rules[1].options.ue8m0: Input should be a valid boolean``.
    """
    def path_of(start: str, loc: tuple[Any, ...]) -> str:
        for part in loc:
            start += f"[{part}]" if isinstance(part, int) else (f".{part}" if start else str(part))
        return start

    lines = []
    for err in exc.errors():
        path = path_of(prefix, err["loc"])
        if err["type"] == NESTED_ERRORS:
            lines += [f"{path_of(path, loc)}: {msg}" for loc, msg in err["ctx"]["errors"]]
            continue
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{path or '<config>'}: {msg}")
    return "; ".join(lines) if len(lines) == 1 else "invalid config:\n  " + "\n  ".join(lines)


def close_matches(name: str, choices: Any) -> str:
    """``"did you mean 'block-fp8'? "`` for a near miss among ``choices`` (difflib), else ``""``."""
    import difflib

    found = difflib.get_close_matches(name, list(choices), n=2, cutoff=0.6)
    return f"did you mean {' or '.join(repr(f) for f in found)}? " if found else ""
