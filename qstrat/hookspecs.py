"""The whole plugin contract of qstrat (pluggy hook specifications).

A plugin is a module or object with ``@hookimpl`` functions, registered through the ``qstrat``
entry-point group (``[project.entry-points.qstrat] myname = "my_package.plugin"``). The built-ins
(:mod:`qstrat.plugins.builtin`) register the same way. Every hook returns a list; names must be unique
across all plugins (a clash is a :class:`~qstrat.errors.PluginError` naming both plugins).
"""
from __future__ import annotations

import pluggy

PROJECT = "qstrat"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def qstrat_serializers():
    """Return quantization formats: a list of :class:`qstrat.serializers.Serializer` subclasses.

    Called once when the registry loads. Each class needs a unique ``name`` (str), an ``Options``
    pydantic model (subclass of ``SerializerOptions``) and implementations of ``matrix_parts``,
    ``reference`` and ``dequantize``; ``quantize`` must emit exactly what ``part_specs`` declares.
    """


@hookspec
def qstrat_selectors():
    """Return target-module selectors: a list of :class:`qstrat.plugins.selector.Selector`.

    Called once when the registry loads. A selector is a named predicate on
    :class:`qstrat.layouts.model_layout.ParsedName`, usable in config as ``select: NAME``.
    """


@hookspec
def qstrat_strategies():
    """Return named strategy presets: a list of :class:`qstrat.strategies.Strategy`.

    Called once when the registry loads. A preset is a partial :class:`qstrat.RefitConfig`
    mapping (rules, keep_bf16, default...) usable as ``preset: NAME`` and extendable in config.
    """


@hookspec
def qstrat_layouts():
    """Return model layouts: a list of :class:`qstrat.layouts.model_layout.ModelLayout`.

    Called once when the registry loads. A layout is naming data for one model family, chosen
    by HF ``architectures`` / ``model_type`` or by ``layout: NAME`` in config.
    """
