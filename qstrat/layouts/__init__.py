"""Model layouts: what a tensor name means and what a model's config.json says about it.

``from qstrat.layouts import ModelLayout`` keeps working (names resolved lazily from
:mod:`.model_layout`). One module per model family: :mod:`qstrat.plugins.builtin.layouts`.

- :mod:`.model_layout`: :class:`ModelLayout`: the naming schema and a family's override points
- :mod:`.name_parser`: a tensor name -> :class:`ParsedName` (kind, layer, expert, projection)
- :mod:`.config_facts`: facts read from the HF config: depth, routed experts, MTP, output
  architecture
- :mod:`.slabs`: grouped expert slabs: how one splits into per-expert projections, when it stays
  whole
- :mod:`.skeleton`: the tensors a config.json implies (names, shapes): the Llama-style default
- :mod:`.model_config`: the config.json values shapes come from, validated; where the language
  config lives
"""

#: Public name -> the module defining it, imported on first use (so that importing a
#: submodule of this package imports nothing else).
_EXPORTS = {
    'ModelLayout': 'qstrat.layouts.model_layout',
    'ParsedName': 'qstrat.layouts.model_layout',
    'QUANTIZABLE_KINDS': 'qstrat.layouts.model_layout',
    'SPECIAL_KINDS': 'qstrat.layouts.model_layout',
    'SlabSpec': 'qstrat.layouts.model_layout',
    'WRAPPER_PREFIXES': 'qstrat.layouts.model_layout',
    'detect_layout': 'qstrat.layouts.model_layout',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
