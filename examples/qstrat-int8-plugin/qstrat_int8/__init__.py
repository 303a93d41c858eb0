"""INT8 per-channel weights for qstrat: s = max(amax_row, tiny) / 127, q = clamp(rne(x / s), -127, 127).

Stored as compressed-tensors' int8 channel scheme: ``weight`` int8 [N, K], ``weight_scale`` float32
[N, 1] (the dequant multiplier). vLLM loads it as ``CompressedTensorsW8A8Int8`` (linear layers) and
``CompressedTensorsW8A8Int8MoEMethod`` (experts), which quantize activations per token at run time.
An engine serves these checkpoints only with that scheme: ``engine_config_mismatch`` tells it apart
from every other compressed-tensors config (FP8, W4A16, static int8 activations...).
"""
import torch

from qstrat.hookspecs import hookimpl
from qstrat.serializers import PartSpec, Serializer, config_difference
from qstrat.strategies import Strategy

QMAX = 127
AMAX_FLOOR = torch.finfo(torch.float32).tiny  # all-zero rows: s > 0, q = 0, no NaN
INT8 = {"num_bits": 8, "type": "int", "symmetric": True}
#: What selects vLLM's CompressedTensorsW8A8Int8 with these parts, per config group: the weights'
#: scheme (int8, symmetric, one scale per row) and dynamic int8 activations (static ones would
#: need an input_scale tensor this format does not write).
SCHEME_KEYS = ("weights.num_bits", "weights.type", "weights.symmetric", "weights.strategy",
               "input_activations.num_bits", "input_activations.type", "input_activations.dynamic")


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

    def engine_config_mismatch(self, quantization_config):
        """None if the engine's config is compressed-tensors with this scheme in every group."""
        mine = self.vllm_quantization_config([])
        why = (super().engine_config_mismatch(quantization_config)  # quant_method
               or config_difference(mine, quantization_config, ("format",), self.name))
        if why:
            return why
        groups = quantization_config.get("config_groups") or {}
        if not groups:
            return f"quantization_config.config_groups: engine has none, {self.name} writes one"
        scheme = {**mine["config_groups"]["group_0"], "format": mine["format"]}
        for name, group in groups.items():
            keys = SCHEME_KEYS + (("format",) if "format" in group else ())  # a group's own format wins
            why = config_difference(scheme, group, keys, self.name, f"quantization_config.config_groups.{name}.")
            if why:
                return why
        return None


@hookimpl
def qstrat_serializers():
    return [Int8Channel]


@hookimpl
def qstrat_strategies():
    return [Strategy("int8-experts", "INT8 per-channel on routed MoE experts only",
                     {"rules": [{"select": ["experts"], "serializer": "int8_channel"}]})]
