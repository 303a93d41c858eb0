"""The checkpoint ``quantization_config`` of an engine, read where vLLM reads it."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def engine_quantization_config(llm: Any) -> dict[str, Any] | None:
    """The engine's checkpoint ``quantization_config`` from its HF config, where vLLM 0.32 looks
    (``weight_utils.get_quant_config``): the config's own, else its ``text_config``'s (multimodal
    models), else ``compression_config`` (compressed-tensors); None for an unquantized engine."""
    from qstrat.vllm_adapter.views import EngineView

    return quantization_config_of(EngineView(llm).hf_config)


def quantization_config_of(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` vLLM reads from a model config (an HF config object or a
    config.json mapping): see :func:`engine_quantization_config`."""
    def get(obj: Any, key: str) -> Any:
        return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)

    from qstrat.model_config import language_config

    cfg = get(hf_config, "quantization_config")
    text = language_config(hf_config)
    if cfg is None and text is not hf_config:
        cfg = get(text, "quantization_config")
    if cfg is None:
        cfg = get(hf_config, "compression_config")
    return dict(cfg) if cfg else None
