"""Type checks of a plugin's :class:`~qstrat.layouts.model_layout.ModelLayout` fields, run when the registry
loads (:mod:`qstrat.plugins.registry`).

A layout is naming data, and a slip in it plans silently wrong: ``fused=(("gate_proj",
"up_proj"))`` (a missing comma: one tuple of two strings, not a tuple of groups) made fusion
groups of single letters, so NVFP4 gave gate and up different ``weight_scale_2``;
``routers="router"`` made a module named ``out`` a router (``"out" in "router"``). Every
dataclass field is validated against its annotation by pydantic in strict mode (a str is not a
tuple, a tuple of str is not a tuple of tuples), then the structure a type cannot say: names are
non-empty dotted-free identifiers where they name one module, and each ``fused`` group has two
or more members.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from qstrat.errors import PluginError

#: Fields that list single module names (a name inside a block: no dots).
_MODULE_NAME_FIELDS = ("mlp_blocks", "expert_projections", "routers", "shared_experts", "dense_projections",
                       "attention_blocks", "attention_projections", "sensitive")


def check_layout(layout: Any, where: str) -> None:
    """Raise PluginError naming ``where`` (the plugin and hook), the layout and the field when a
    field of ``layout`` (a :class:`~qstrat.layouts.model_layout.ModelLayout`, any subclass) does not have its
    annotated type (strict: no coercion) or breaks the structure the module docstring lists."""
    hints = _hints(type(layout))
    problems = []
    for f in dataclasses.fields(layout):
        value = getattr(layout, f.name)
        adapter = _adapter(hints[f.name]) if f.name in hints else None
        if adapter is None:
            continue
        try:
            adapter.validate_python(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            at = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in first["loc"])
            hint = ""
            if f.name == "fused" and isinstance(value, tuple) and all(isinstance(v, str) for v in value):
                hint = (f"; a tuple of groups: did you mean ({value!r},)? (a missing comma makes one group "
                        "a tuple of names)")
            problems.append(f"{f.name}{at}: {first['msg']} (got {value!r:.80}){hint}")
            continue
        problems += _structure(f.name, value)
    if problems:
        raise PluginError(f"{where}: layout {getattr(layout, 'name', '?')!r}: " + "; ".join(problems))


def _structure(field: str, value: Any) -> list[str]:
    """What a type cannot say about one (well-typed) field."""
    if field in _MODULE_NAME_FIELDS and value is not None:
        bad = [v for v in value if not v or "." in v]
        if bad:
            return [f"{field}: module names must be non-empty and hold no dot, got {bad!r}"]
    if field == "fused":
        short = [g for g in value if len(g) < 2]
        if short:
            return [f"fused: each group lists the two or more sibling modules the engine fuses "
                    f"(e.g. (('q_proj', 'k_proj', 'v_proj'), ('gate_proj', 'up_proj'))), got groups {short!r}"]
    return []


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The resolvable field annotations of ``cls`` and its bases, the most derived class's winning.

    Each annotation is resolved on its own, in its class's module: a plugin's subclass that
    annotates a field with a name imported only for type checkers (``if TYPE_CHECKING:``, under
    ``from __future__ import annotations``: valid Python) leaves that one field unchecked instead
    of failing the whole registry with a NameError; ModelLayout's own fields always resolve."""
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        module = sys.modules.get(klass.__module__)
        globalns = vars(module) if module is not None else {}
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            holder = types.SimpleNamespace(__annotations__={name: annotation})
            try:
                hints[name] = typing.get_type_hints(holder, globalns=globalns, localns=dict(vars(klass)))[name]
            except Exception:  # unresolvable at runtime: a type checker's name, not ours to check
                hints.pop(name, None)
    return hints


@functools.cache
def _adapter(hint: Any) -> TypeAdapter | None:
    """A strict validator of ``hint``, or None for a type pydantic cannot validate (a plugin
    subclass's own field of an exotic type: not checked)."""
    try:
        return TypeAdapter(hint, config=ConfigDict(strict=True, arbitrary_types_allowed=True))
    except Exception:
        return None
