"""How qstrat words validation problems: one line per pydantic error with its key path, and the
nearest valid name for a misspelt one. Shared by the config schema and the plugin registry.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError


#: pydantic error type carrying a nested model's errors (``ctx["errors"]``: (loc, msg) pairs),
#: expanded by :func:`format_validation_error` into one line per error with the full key path.
NESTED_ERRORS = "qstrat_nested_errors"


def format_validation_error(exc: ValidationError, prefix: str = "", model: Any = None) -> str:
    """One line per pydantic error: ``rules[0].serializer: unknown serializer 'x'; valid: ...``.

    Errors of a nested model (a rule's serializer options) are expanded under their own path:
    ``rules[1].options.ue8m0: Input should be a valid boolean``. With ``model`` (the pydantic
    model validated), a key it does not have gets the nearest keys of its place
    (:func:`extra_key_hint`): ``rules[0].on_unsuported: Extra inputs are not permitted; did you
    mean 'on_unsupported'? valid keys: ...``.
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
        if err["type"] == "extra_forbidden" and model is not None:
            msg += extra_key_hint(model, err["loc"])
        lines.append(f"{path or '<config>'}: {msg}")
    return "; ".join(lines) if len(lines) == 1 else "invalid config:\n  " + "\n  ".join(lines)


def close_matches(name: str, choices: Any) -> str:
    """``"did you mean 'block-fp8'? "`` for a near miss among ``choices`` (difflib), or for a name
    the field gives one of them (:data:`qstrat.config.format_names.FORMAT_ALIASES`: ``fp8`` -> ``"did
    you mean 'block_fp8' (block FP8 with DeepSeek-style 128x128 scales, ...)? "``), or for the
    same name in another case (``NVFP4`` -> ``nvfp4``), else ``""``."""
    import difflib

    from qstrat.config.format_names import alias_of

    alias = alias_of(name, choices)
    if alias is not None:
        return f"did you mean {alias[0]!r} ({alias[1]})? "
    choices = list(choices)
    folded = {str(c).lower(): c for c in choices}  # case: 'NVFP4' is a near miss of 'nvfp4'
    if isinstance(name, str) and name.lower() in folded:
        return f"did you mean {folded[name.lower()]!r}? "
    found = difflib.get_close_matches(name, choices, n=2, cutoff=0.6)
    return f"did you mean {' or '.join(repr(f) for f in found)}? " if found else ""


def extra_key_hint(model: Any, loc: tuple[Any, ...]) -> str:
    """``"; did you mean 'first'? valid keys: first, last"`` for the unknown key at ``loc`` (a
    pydantic error location: keys and list indices) under the pydantic ``model`` class, else
    ``""`` when the place holding it is not a model (a free-form mapping such as options)."""
    import typing

    here = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # a list item: the item type was taken with the list's field
        field = getattr(here, "model_fields", {}).get(part)
        if field is None:
            return ""
        here = field.annotation
        while typing.get_origin(here) is not None:  # list[Rule], Rule | None: the model inside
            here = next((a for a in typing.get_args(here) if hasattr(a, "model_fields")), None)
    keys = list(getattr(here, "model_fields", {}))
    if not keys:
        return ""
    near = close_matches(str(loc[-1]), keys).rstrip()
    return f"; {near + ' ' if near else ''}valid keys: {', '.join(keys)}"
