"""What the user declares: the refit config, read strictly, and the rules it compiles to.

``from qstrat.config import load_config, RefitConfig, Rule, KeepBF16, PresetConfig`` keeps
working (names resolved lazily from :mod:`.loader`).

- :mod:`.loader`: :func:`load_config`: a file, a mapping or a preset name -> :class:`RefitConfig`
- :mod:`.schema`: the schema (pydantic v2): ``RefitConfig``, ``Rule``, ``KeepBF16``,
  ``PresetConfig``
- :mod:`.files`: YAML / TOML / JSON read strictly (duplicate keys, YAML 1.2), errors with the line
- :mod:`.patterns`: include / exclude patterns: a glob, or a regex after ``re:``
- :mod:`.validation`: how problems are worded: key paths, the nearest valid name
- :mod:`.rules`: ``RuleSet.decide`` -> ``Decision``: which serializer a tensor gets, and why
- :mod:`.format_names`: the names users and vLLM give each format, and how a message spells one
"""

#: Public name -> the module defining it, imported on first use (so that importing a
#: submodule of this package imports nothing else).
_EXPORTS = {
    'KeepBF16': 'qstrat.config.loader',
    'PresetConfig': 'qstrat.config.loader',
    'RefitConfig': 'qstrat.config.loader',
    'Rule': 'qstrat.config.loader',
    'load_config': 'qstrat.config.loader',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
