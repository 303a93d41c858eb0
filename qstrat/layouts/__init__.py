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

import lazy_loader

#: Public names resolved from the submodules below on first use (lazy_loader, PEP 562), so that
#: importing a submodule of this package imports nothing else.
__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    'model_layout': ['ModelLayout', 'ParsedName', 'QUANTIZABLE_KINDS', 'SPECIAL_KINDS', 'SlabSpec', 'WRAPPER_PREFIXES', 'detect_layout'],
})
