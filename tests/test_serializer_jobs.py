"""serializers/base.py's Serializer split by job (issue 43): the math (FormatMath), the engine
contract (EngineFormat) and the emulation hooks (EmulationHooks) are three classes in three
modules; Serializer, what a plugin subclasses, joins them. Each job's class holds its own
methods and none of another's, and a format built from the pieces plans, quantizes and is served
by its engine config exactly as before."""
from __future__ import annotations

import inspect

import torch

from qstrat import Registry, RefitDriver
from qstrat.hookspecs import hookimpl
from qstrat.serializers import Serializer
from qstrat.serializers.base import EmulationHooks, EngineFormat, FormatMath
from qstrat.serializers.block_fp8 import BlockFP8
from qstrat.serializers.engine_contract import EngineFormat as ContractClass
from qstrat.serializers.format_math import SerializerOptions

#: job -> the methods and attributes it owns (docs/plugins.md's table)
JOBS = {
    FormatMath: {"matrix_parts", "reference", "dequantize", "group_context", "encode_into", "part_specs",
                 "quantize", "check_values", "check_decoded", "resolve_kernel", "has_fast_path", "check_backend",
                 "row_tile", "kernel", "Options", "decode_check_above",
                 # the incremental re-quantization's split of the math (qstrat.transport.delta.requantize)
                 "scale_block", "scale_part", "codes_per_byte", "e8m0_parts", "block_scales", "codes", "context_of_block_maxima"},
    EngineFormat: {"vllm_quantization_config", "engine_config_mismatch", "engine_fusion_problem",
                   "matches_engine_config", "quantizes"},
    EmulationHooks: {"emulation", "bench_peers", "resolve_emulation", "resolve_bench_peers"},
}


def own(cls: type) -> set[str]:
    return {k for k in vars(cls) if not k.startswith("_")}


def test_each_job_holds_its_own_members_and_no_others():
    for cls, members in JOBS.items():
        assert own(cls) == members, (cls.__name__, own(cls) ^ members)
    assert own(Serializer) == {"summary"}  # the join adds only the one line for `qstrat list`
    assert Serializer.__bases__ == (FormatMath, EngineFormat, EmulationHooks)
    assert ContractClass is EngineFormat and inspect.getmodule(FormatMath).__name__ == "qstrat.serializers.format_math"
    assert inspect.getmodule(EmulationHooks).__name__ == "qstrat.serializers.emulation_hooks"


class Int4Rows(Serializer):
    """A plugin format written against Serializer: math, engine contract and hooks overridden on
    one subclass, as docs/plugins.md shows."""

    name = "test_rows"
    summary = "per-row absmax to bf16 (a test format)"
    Options = SerializerOptions
    bench_peers = {"none": "no.such.module:peer"}

    def matrix_parts(self, n, k):
        from qstrat.serializers.parts import PartSpec
        return (PartSpec("weight", (n, k), torch.bfloat16), PartSpec("weight_scale", (n, 1), torch.float32))

    def reference(self, x, context):
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
        return {"weight": (x / scale).to(torch.bfloat16), "weight_scale": scale}

    def dequantize(self, parts):
        return parts["weight"].float() * parts["weight_scale"]

    def vllm_quantization_config(self, ignored):
        return {"quant_method": "test_rows", "ignored_layers": list(ignored)}


class RowsPlugin:
    @hookimpl
    def qstrat_serializers(self):
        return [Int4Rows]


def test_a_plugin_format_written_against_serializer_plans_quantizes_and_is_matched():
    registry = Registry(plugins=[RowsPlugin()])
    assert registry.serializers["test_rows"].obj is Int4Rows
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16) - 5
    driver = RefitDriver({"rules": [{"select": ["attention"], "serializer": "test_rows"}]}, registry=registry)
    plan = driver.plan({"model.layers.0.self_attn.q_proj.weight": w})
    assert [o.name for o in plan.outputs()] == ["model.layers.0.self_attn.q_proj.weight",
                                                "model.layers.0.self_attn.q_proj.weight_scale"]
    assert plan.vllm_quantization_config()["quant_method"] == "test_rows"
    parts = Int4Rows().quantize(w)
    want_scale = w.float().abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
    assert torch.equal(parts["weight_scale"], want_scale)
    assert torch.equal(parts["weight"], (w.float() / want_scale).to(torch.bfloat16))
    # the engine contract's default rule, unchanged by the split
    assert Int4Rows.matches_engine_config({"quant_method": "test_rows"})
    assert Int4Rows().engine_config_mismatch({"quant_method": "fp8"}) == (
        "quantization_config.quant_method: engine has 'fp8', test_rows writes 'test_rows'")
    assert Int4Rows.resolve_emulation() is None and BlockFP8.matches_engine_config(
        {"quant_method": "fp8", "weight_block_size": [128, 128]})


class ZeroBlockPlugin(Serializer):
    """A plugin that stores each 32-block's quantization multiplier ``448 / amax`` with no floor on
    the maximum: an all-zero block gives an infinite scale (the attacker's "non-finite scales from a
    plugin reference")."""

    name = "test_unfloored"
    summary = "per-32 absmax, no floor (a broken test format)"

    def matrix_parts(self, n, k):
        from qstrat.serializers.parts import PartSpec
        return (PartSpec("weight", (n, k), torch.float8_e4m3fn), PartSpec("weight_scale", (n, k // 32), torch.float32))

    def reference(self, x, context):
        e, n, k = x.shape
        blocks = x.view(e, n, k // 32, 32)
        multiplier = 448 / blocks.abs().amax(dim=-1, keepdim=True)
        codes = (blocks * multiplier).to(torch.float8_e4m3fn).view(e, n, k)
        return {"weight": codes, "weight_scale": multiplier.squeeze(-1)}

    def dequantize(self, parts):
        w = parts["weight"].float()
        return (w.view(*w.shape[:-1], -1, 32) / parts["weight_scale"].unsqueeze(-1)).view(w.shape)

    def vllm_quantization_config(self, ignored):
        return {"quant_method": "test_unfloored", "ignored_layers": list(ignored)}


def test_a_plugin_scale_that_is_nan_for_finite_weights_is_refused_naming_tensor_part_and_index():
    import pytest

    from qstrat.errors import NonFiniteError

    w = torch.randn(4, 64, dtype=torch.bfloat16)
    parts = ZeroBlockPlugin().quantize(w, name="layer.q")  # no zero block: accepted, exact
    assert torch.isfinite(parts["weight_scale"]).all()
    w[2, 32:] = 0  # one all-zero block: the plugin's multiplier is 448 / 0 there
    with pytest.raises(NonFiniteError) as err:
        ZeroBlockPlugin().quantize(w, name="layer.q")
    assert str(err.value).startswith("layer.q: serializer 'test_unfloored' emitted a non-finite scale in "
                                      "'weight_scale' at index [2, 1]")
    # nonfinite='propagate' encodes it anyway, as for non-finite weights
    out = ZeroBlockPlugin(nonfinite="propagate").quantize(w, name="layer.q")
    assert torch.isinf(out["weight_scale"][2, 1])
    # the built-in formats floor their block maxima: an all-zero weight quantizes to finite scales
    from qstrat.serializers.mxfp8 import MXFP8
    from qstrat.serializers.nvfp4 import NVFP4

    for fmt in (BlockFP8(), MXFP8(), NVFP4()):
        zero = fmt.quantize(torch.zeros(128, 128, dtype=torch.bfloat16), name="zeros")
        assert all(torch.isfinite(t.float()).all() for t in zero.values() if t.is_floating_point()), fmt.name


def test_an_e8m0_nan_byte_a_plugin_emits_for_finite_weights_is_refused_and_the_built_in_never_emits_it():
    """E8M0 byte 0xFF is NaN (OCP MX v1.0): a raw-E8M0 part (``e8m0_parts``) holding it for finite
    weights is refused like a float NaN scale; MXFP8's own bytes stop at 254 for finite weights."""
    import pytest

    from qstrat.errors import NonFiniteError
    from qstrat.serializers.mxfp8 import MXFP8

    class NaNByte(MXFP8):
        def block_scales(self, amax, context=None):
            byte, mult = super().block_scales(amax, context)
            return torch.where(amax == 0, torch.full_like(byte, 255), byte), mult

    w = torch.randn(4, 64, dtype=torch.bfloat16)
    assert int(MXFP8().quantize(w * 1e30)["weight_scale"].max()) <= 254
    assert torch.equal(NaNByte().quantize(w)["weight_scale"], MXFP8().quantize(w)["weight_scale"])
    w[1, :32] = 0
    with pytest.raises(NonFiniteError, match=r"^layer\.k: serializer 'mxfp8' emitted the E8M0 NaN byte 0xFF in "
                                             r"'weight_scale' at index \[1, 0\]"):
        NaNByte().quantize(w, name="layer.k")
    assert int(NaNByte(nonfinite="propagate").quantize(w)["weight_scale"][1, 0]) == 255
