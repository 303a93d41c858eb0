"""The checkpoint ``quantization_config`` of an engine, read where vLLM reads it."""
from __future__ import annotations

from typing import Any


def engine_quantization_config(llm: Any) -> dict[str, Any] | None:
    """The engine's checkpoint ``quantization_config`` from its HF config, where vLLM 0.32 looks
    (``weight_utils.get_quant_config``): the config's own, else its ``text_config``'s (multimodal
    models), else ``compression_config`` (compressed-tensors); None for an unquantized engine."""
    from qstrat.vllm.adapter.views import EngineView

    return quantization_config_of(EngineView(llm).hf_config)


def quantization_config_of(model_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` vLLM reads from a model config (a
    :class:`~qstrat.layouts.model_config.ModelConfig`, an HF config object or a config.json mapping):
    see :func:`engine_quantization_config` (:attr:`qstrat.layouts.model_config.ModelConfig.quantization_config`)."""
    from qstrat.layouts.model_config import ModelConfig

    return ModelConfig.of(model_config).quantization_config
