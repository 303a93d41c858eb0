"""A model's facts read from its HF ``config.json`` through a layout's key names: decoder depth,
routed experts, MTP layers, and the architecture an output config.json names.

The defaults of :class:`~qstrat.layouts.model_layout.ModelLayout`'s ``num_layers``, ``num_experts``,
``num_mtp_layers``, ``is_moe_layer`` and ``output_architecture`` (a family overrides the method
on its layout; the code that reads a config lives here). Every reader takes the parsed
:class:`~qstrat.layouts.model_config.ModelConfig` (the language model's keys: ``text_config`` of a
multimodal one) and reads the keys the layout's data names.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qstrat.errors import ConfigError
from qstrat.layouts.model_config import INT_KEYS, MAX_LAYERS, ModelConfig

__all__ = ["architecture_for", "config_int", "num_experts", "num_layers", "num_mtp_layers"]


def num_layers(config: ModelConfig, key: str) -> int | None:
    """Decoder depth (config key ``key``), or None when the config does not say.
    Raises: ConfigError for a value that is not an integer >= 1 (:func:`config_int`)."""
    value = config.value(key)
    return config_int(key, value, minimum=1) if value is not None else None


def num_experts(config: ModelConfig, keys: Sequence[str]) -> int | None:
    """Routed experts per MoE layer: the first of ``keys`` set, or None (a dense model, or a
    config that does not say). Raises: ConfigError as :func:`config_int`."""
    key = next((k for k in keys if config.value(k)), None)
    return config_int(key, config.value(key), minimum=1) if key is not None else None


def num_mtp_layers(config: ModelConfig, key: str | None) -> int:
    """Multi-token-prediction layers stored after the decoder layers (config key ``key``; 0
    without one)."""
    if not key:
        return 0
    return int(config.value(key) or 0)


def architecture_for(config: ModelConfig, architectures: Sequence[str]) -> str | None:
    """The ``architectures`` entry an output config.json gets when ``config`` has none:
    transformers' auto-model table for the config's ``model_type``
    (``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` with a ``vision_config``, else
    ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: what ``save_pretrained`` of that auto class writes),
    else the layout's ``architectures`` when it names exactly one; None when neither says."""
    model_type = config.top_model_type
    if isinstance(model_type, str):
        try:
            from transformers.models.auto import modeling_auto
        except ImportError:
            modeling_auto = None
        if modeling_auto is not None:
            table = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if config.vision
                     else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
            if model_type in table:
                return table[model_type]
    return architectures[0] if len(architectures) == 1 else None


def config_int(key: str, value: Any, minimum: int) -> int:
    """An HF config's integer ``key``; ConfigError naming it for anything else (``"four"``,
    ``2.5``, ``true``, below ``minimum``, above qstrat's limit for it:
    :data:`qstrat.layouts.model_config.INT_KEYS`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"model config: {key} must be an integer >= {minimum}, got {value!r}")
    top = INT_KEYS.get(key, (minimum, MAX_LAYERS if key.endswith("layers") else None))[1]
    if top is not None and value > top:
        raise ConfigError(f"model config: {key} must be an integer in {minimum}..{top}, got {value!r} "
                          f"(qstrat's limit: a larger {key} is no real model)")
    return value
