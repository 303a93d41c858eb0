"""Quantization formats (installed as ``qstrat.serializers``).

One module per format: its spec constants, torch reference math, dequantize, checkpoint suffixes
and vLLM config fragment live together. Triton kernels live in :mod:`qstrat.serializers.kernels`.
"""
from qstrat.serializers.base import PartSpec, Serializer, SerializerOptions

__all__ = ["PartSpec", "Serializer", "SerializerOptions"]
