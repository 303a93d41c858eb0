"""INT8 per-channel weights for qstrat: s = max(amax_row, tiny) / 127, q = clamp(rne(x / s), -127, 127).

Stored as compressed-tensors' int8 channel scheme: ``weight`` int8 [N, K], ``weight_scale`` float32
[N, 1] (the dequant multiplier). vLLM loads it as ``CompressedTensorsW8A8Int8`` (linear layers) and
``CompressedTensorsW8A8Int8MoEMethod`` (experts), which quantize activations per token at run time.
"""
import torch

from qstrat.hookspecs import hookimpl
from qstrat.serializers import PartSpec, Serializer
from qstrat.strategies import Strategy

QMAX = 127
AMAX_FLOOR = torch.finfo(torch.float32).tiny  # all-zero rows: s > 0, q = 0, no NaN
INT8 = {"num_bits": 8, "type": "int", "symmetric": True}


class Int8Channel(Serializer):
    """Symmetric INT8, one fp32 scale per output row (compressed-tensors ``int-quantized``)."""

    name = "int8_channel"
    summary = "INT8 weights with an fp32 scale per output row (compressed-tensors int-quantized)"

    def matrix_parts(self, n, k):
        return (PartSpec("weight", (n, k), torch.int8, 1), PartSpec("weight_scale", (n, 1), torch.float32, 1))

    def reference(self, x, context):
        s = x.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / QMAX
        q = torch.nan_to_num(torch.round(x / s), nan=0.0).clamp(-QMAX, QMAX)  # round: half to even
        return {"weight": q.to(torch.int8), "weight_scale": s}

    def dequantize(self, parts):
        return parts["weight"].float() * parts["weight_scale"]

    def vllm_quantization_config(self, ignored):
        return {"quant_method": "compressed-tensors", "format": "int-quantized",
                "quantization_status": "compressed", "ignore": list(ignored),
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {**INT8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**INT8, "strategy": "token", "dynamic": True}}}}


@hookimpl
def qstrat_serializers():
    return [Int8Channel]


@hookimpl
def qstrat_strategies():
    return [Strategy("int8-experts", "INT8 per-channel on routed MoE experts only",
                     {"rules": [{"select": ["experts"], "serializer": "int8_channel"}]})]
