"""Plugins: the registry over the ``qstrat`` entry-point group and the built-in plugin.

The hook specifications (the contract a plugin implements) are :mod:`qstrat.hookspecs`.

- :mod:`.registry`: :class:`Registry` (pluggy): serializers, selectors, presets, layouts, validated
- :mod:`.selector`: :class:`Selector`: a named predicate on a ``ParsedName`` (which tensors a rule
  targets)
- :mod:`.layout_checks`: type checks of a plugin layout's fields, run when the registry loads
- :mod:`.builtin` (package): the built-in plugin: hookimpls, selectors, one module per model family
"""
