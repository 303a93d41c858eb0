"""Quantization formats (installed as ``qstrat.serializers``).

One module per format: its spec constants, torch reference math, dequantize, checkpoint suffixes
and vLLM config fragment live together. Triton kernels live in :mod:`qstrat.serializers.kernels`;
the engine-contract helpers a format's ``engine_config_mismatch`` uses in
:mod:`qstrat.serializers.engine_contract`.
"""
from qstrat.serializers.base import PartSpec, Serializer, SerializerOptions
from qstrat.serializers.engine_contract import (MATCH_KEYS, EngineConfigRefused, config_difference, read_difference,
                                               vllm_reading)

__all__ = ["MATCH_KEYS", "EngineConfigRefused", "PartSpec", "Serializer", "SerializerOptions", "config_difference",
           "read_difference", "vllm_reading"]
