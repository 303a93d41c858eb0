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

import lazy_loader

#: Public names resolved from the submodules below on first use (lazy_loader, PEP 562), so that
#: importing a submodule of this package imports nothing else.
__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    'loader': ['KeepBF16', 'PresetConfig', 'RefitConfig', 'Rule', 'load_config'],
})
