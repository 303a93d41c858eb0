"""Property-based tests (hypothesis) of every format's torch reference: the documented error
bound of dequantize(quantize(x)), batched == per expert, re-quantization where the format
promises it. Kernel == reference: tests/test_kernel_properties.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernel_harness import assert_same_bytes
from properties import CASE_IDS, CASES, IDEMPOTENT, PROPS, bound_violations, weights

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize(("case_id", "cls", "opts", "kmul"), CASES, ids=CASE_IDS)
@PROPS
@given(data=st.data())
def test_dequantize_is_within_the_documented_bound(case_id, cls, opts, kmul, data):
    x = data.draw(weights(kmul), label="x")
    ser = cls(backend="torch", **opts)
    parts = ser.quantize(x)
    deq = ser.dequantize(parts)
    assert deq.shape == x.shape and deq.dtype == torch.float32
    assert bound_violations(case_id, x, parts, deq) == 0


@pytest.mark.parametrize(("case_id", "cls", "opts", "kmul"), CASES, ids=CASE_IDS)
@PROPS
@given(data=st.data())
def test_a_batched_slab_equals_its_experts_one_by_one(case_id, cls, opts, kmul, data):
    w3 = data.draw(weights(kmul, batched=True), label="w3")
    ser = cls(backend="torch", **opts)
    chunked = cls(backend="torch", chunk_elements=data.draw(st.integers(1, 5000), label="chunk"), **opts)
    got = ser.quantize(w3)
    assert_same_bytes(chunked.quantize(w3), got, f"{case_id} chunked")  # chunking changes no byte
    for e in range(w3.shape[0]):
        assert_same_bytes({k: v[e] for k, v in got.items()}, ser.quantize(w3[e]), f"{case_id} expert {e}")


@pytest.mark.parametrize(("case_id", "cls", "opts", "kmul"), IDEMPOTENT, ids=[c[0] for c in IDEMPOTENT])
@PROPS
@given(data=st.data())
def test_requantizing_the_dequantized_weight_is_lossless(case_id, cls, opts, kmul, data):
    x = data.draw(weights(kmul), label="x")
    ser = cls(backend="torch", **opts)
    once = ser.dequantize(ser.quantize(x))
    twice = ser.dequantize(ser.quantize(once))
    assert torch.equal(once.view(torch.int32), twice.view(torch.int32))


@PROPS
@given(x=weights(1, dtypes=(torch.bfloat16,)))
def test_bf16_passthrough_is_lossless(x):
    ser = CASES[-1][1]()
    parts = ser.quantize(x)
    assert torch.equal(parts["weight"].view(torch.int16), x.view(torch.int16))
    assert torch.equal(ser.quantize(ser.dequantize(parts))["weight"].view(torch.int16), x.view(torch.int16))
