"""Bad trainer input is refused before anything is quantized or emitted, with a message naming
the tensor: non-tensor values, non-float dtypes (passthrough included), NaN in a fusion-group
member."""
from __future__ import annotations

import pytest
import torch

import qstrat
from qstrat import NonFiniteError, PlanError, RefitDriver
from qstrat.serializers.nvfp4 import NVFP4
from test_inputs import NORM, Q, driver, emitted_before_error, state  # noqa: F401 (driver, state: fixtures)

INT_HINT = "(not a floating-point weight: leave buffers such as masks or position ids out of the refit)"
FP8_HINT = ("(already quantized? qstrat quantizes the trainer's BF16 weights; an fp8 tensor can be "
            "neither re-quantized nor passed through)")


@pytest.mark.parametrize("name,dtype,message", [
    (NORM, torch.float8_e4m3fn, f"{NORM}: is sent unchanged (not a weight matrix) and needs a "
                                f"bfloat16/float16/float32 tensor, got float8_e4m3fn {FP8_HINT}"),
    (NORM, torch.int32, f"{NORM}: is sent unchanged (not a weight matrix) and needs a bfloat16/float16/float32 "
                        f"tensor, got int32 {INT_HINT}"),
    ("model.layers.0.mlp.gate.weight", torch.uint8,
     "model.layers.0.mlp.gate.weight: is sent unchanged (never quantized: router) and needs a "
     f"bfloat16/float16/float32 tensor, got uint8 {INT_HINT}"),
    (Q, torch.float8_e4m3fn, f"{Q}: is planned as block_fp8 (rules[0]) and needs a bfloat16/float16/float32 "
                             f"tensor, got float8_e4m3fn {FP8_HINT}"),
    (Q, torch.float64, f"{Q}: is planned as block_fp8 (rules[0]) and needs a bfloat16/float16/float32 tensor, "
                       "got float64 (cast it to float32 or bfloat16)"),
])
def test_non_float_inputs_are_named_plan_errors(driver, state, name, dtype, message):
    tensors = {**state, name: state[name].to(dtype)}
    names, exc = emitted_before_error(driver, tensors)
    assert names == [] and isinstance(exc, PlanError)
    assert str(exc) == f"refit plan is invalid:\n  {message}"


def test_nvfp4_fusion_group_nan_names_the_member_tensor(state, tiny_hf_config):
    # q/k/v share one global scale; k_proj sorts first in natural order, so "member 0" was k_proj
    driver = RefitDriver({"rules": [{"select": "attention", "serializer": "nvfp4"}]}, hf_config=tiny_hf_config)
    v = "model.layers.0.self_attn.v_proj.weight"
    bad = state[v].clone()
    bad[1, 2] = float("inf")
    names, exc = emitted_before_error(driver, {**state, v: bad})
    assert isinstance(exc, NonFiniteError)
    assert str(exc) == (f"{v}: non-finite value inf at index [1, 2] (row, col); "
                        "set nonfinite='propagate' to encode it anyway")
    assert not any(n.startswith("model.layers.0.self_attn.") and "_proj." in n for n in names)


def test_group_context_names_members_when_given_names():
    gate, up = torch.randn(8, 32), torch.randn(8, 32)
    up[3, 4] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        NVFP4().group_context([gate, up], names=["experts.0.gate_proj.weight", "experts.0.up_proj.weight"])
    assert str(info.value) == ("experts.0.up_proj.weight: non-finite value nan at index [3, 4] (row, col); "
                               "set nonfinite='propagate' to encode it anyway")


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8", "nvfp4"])
def test_direct_quantize_refuses_other_dtypes_and_a_nonfinite_context(fmt):
    """Serializer.quantize called directly (not through a plan): a float64 value beyond the fp32
    range used to become inf scales silently, an int32 weight was accepted, and a hand-made NVFP4
    context with a NaN amax was encoded under nonfinite='error' (adversarial run)."""
    ser = qstrat.get_serializer(fmt)
    w = torch.ones(4, 32, dtype=torch.float64)
    w[1, 3] = 1e39
    with pytest.raises(qstrat.UnsupportedShapeError) as info:
        ser.quantize(w, name="layers.0.w")
    assert str(info.value) == f"layers.0.w: {fmt} quantizes bfloat16, float16 or float32 weights, got float64 (cast it to float32)"
    with pytest.raises(qstrat.UnsupportedShapeError, match="got int32$"):
        ser.quantize(torch.ones(4, 32, dtype=torch.int32), name="layers.0.w")
    if fmt == "nvfp4":
        with pytest.raises(NonFiniteError, match=r"^layers\.0\.w: the fusion-group context's amax is not finite"):
            ser.quantize(torch.ones(4, 32), name="layers.0.w", context={"amax": torch.tensor(float("nan"))})
        got = qstrat.get_serializer(fmt, nonfinite="propagate").quantize(
            torch.ones(4, 32), context={"amax": torch.tensor(float("nan"))})
        assert got["weight_scale_2"].isnan()


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8", "nvfp4", "bf16"])
@pytest.mark.parametrize("backend", ["torch", "fast"])
def test_nonfinite_index_has_the_weights_rank(fmt, backend):
    """[row, col] for a matrix, [expert, row, col] for a slab, on every format and torch path."""
    ser = qstrat.get_serializer(fmt, backend=backend)
    w = torch.randn(4, 128)
    w[3, 70] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        ser.quantize(w, name="layers.0.q_proj.weight")
    assert str(info.value) == ("layers.0.q_proj.weight: non-finite value nan at index [3, 70] (row, col); "
                               "set nonfinite='propagate' to encode it anyway")
    w3 = torch.randn(3, 4, 128, dtype=torch.bfloat16)
    w3[2, 1, 100] = float("-inf")
    with pytest.raises(NonFiniteError) as info:
        ser.quantize(w3, name="experts.down_proj")
    assert str(info.value) == ("experts.down_proj: non-finite value -inf at index [2, 1, 100] (expert, row, col); "
                               "set nonfinite='propagate' to encode it anyway")
    one = torch.randn(1, 4, 128)  # a one-expert slab keeps its expert index
    one[0, 2, 5] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        ser.quantize(one, name="experts.down_proj")
    assert str(info.value).startswith("experts.down_proj: non-finite value nan at index [0, 2, 5] (expert, row, col);")
