"""The built-in plugin: qstrat's own formats, selectors, presets and layouts, in one place.

Registered through the ``qstrat`` entry-point group exactly like a third-party plugin. The hook
implementations below are the whole list; the data they return lives beside them:

- formats: one module each in ``serializers/`` (:mod:`qstrat.serializers`);
- selectors: :mod:`qstrat.plugins.builtin.selectors`;
- model layouts: :mod:`qstrat.plugins.builtin.layouts`;
- strategy presets: ``strategies/presets.py`` (:mod:`qstrat.strategies.presets`), typed
  :class:`~qstrat.config.schema.PresetConfig` data validated when defined.
"""
from __future__ import annotations

from qstrat.plugins.builtin.layouts import BUILTIN_LAYOUTS
from qstrat.plugins.builtin.selectors import BUILTIN_SELECTORS
from qstrat.hookspecs import hookimpl
from qstrat.serializers.bf16 import BF16
from qstrat.serializers.block_fp8 import BlockFP8
from qstrat.serializers.mxfp8 import MXFP8
from qstrat.serializers.nvfp4 import NVFP4
from qstrat.strategies.presets import BUILTIN_STRATEGIES


@hookimpl
def qstrat_serializers():
    """Built-in formats: bf16, block_fp8, mxfp8, nvfp4."""
    return [BF16, BlockFP8, MXFP8, NVFP4]


@hookimpl
def qstrat_selectors():
    """Built-in selectors (see :mod:`qstrat.plugins.builtin.selectors`)."""
    return list(BUILTIN_SELECTORS)


@hookimpl
def qstrat_strategies():
    """Built-in presets (see :mod:`qstrat.strategies.presets`)."""
    return list(BUILTIN_STRATEGIES)


@hookimpl
def qstrat_layouts():
    """Built-in model layouts (see :mod:`qstrat.plugins.builtin.layouts`)."""
    return list(BUILTIN_LAYOUTS)
