"""Property-based kernel == reference (hypothesis): every Triton kernel gives the torch
reference's bytes on random small slabs: ragged shapes, all dtypes, strided views, every option,
NaN/inf with ``nonfinite="propagate"``.

Where it runs: on CUDA tensors on a GPU machine; on a CPU machine inside the one interpreter child
process of tests/test_kernels.py, where the properties run on CPU tensors.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("triton", reason="the kernels need triton (pip install 'qstrat[triton]')")

import kernel_harness as testing  # noqa: E402
from properties import CASES, PROPS, weights  # noqa: E402

DEVICE = testing.require_kernel_device()
KERNEL_CASES = [c for c in CASES if c[1].kernel is not None]

pytestmark = pytest.mark.interpreter if DEVICE == "cpu" else []

@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN arithmetic (interpreter)
@pytest.mark.parametrize(("case_id", "cls", "opts", "kmul"), KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
@PROPS
@given(data=st.data())
def test_kernel_equals_reference(case_id, cls, opts, kmul, data):
    rows = 140 if case_id.startswith("block_fp8") else 40  # two 128-row tiles at most
    w = data.draw(weights(kmul, max_rows=rows, max_k_blocks=3, batched=True), label="w")
    nonfinite = data.draw(st.sampled_from(["error", "propagate"]), label="nonfinite")
    if nonfinite == "propagate":
        w = w.clone()
        flat = w.view(-1)
        for value in data.draw(st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf")]),
                                        max_size=3), label="specials"):
            flat[data.draw(st.integers(0, flat.numel() - 1), label="at")] = value
    w = w.to(DEVICE)
    if data.draw(st.booleans(), label="strided view"):  # a slab cut out of a wider one, read in place
        w = torch.cat([w, w.flip(-1)], dim=-1)[..., : w.shape[-1]]
    kern = cls(backend="triton", nonfinite=nonfinite, **opts).quantize(w)
    ref = cls(backend="torch", nonfinite=nonfinite, **opts).quantize(w)
    testing.assert_same_bytes(kern, ref, f"{case_id} {w.dtype} {list(w.shape)} {w.stride()}")
