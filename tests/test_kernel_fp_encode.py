"""The kernels' shared device helpers (serializers/kernels/fp_encode.py) against their torch twins
(serializers/fp_bits.py) and torch 2.13's casts, through the probe kernel (tests/kernel_probe.py).

Runs where the kernels run (see tests/test_kernels.py).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'qstrat[triton]')")

import kernel_harness as testing  # noqa: E402
from qstrat.serializers import fp_bits  # noqa: E402

DEVICE = testing.require_kernel_device()

pytestmark = pytest.mark.interpreter if DEVICE == "cpu" else []


# ---- the shared device helpers, against their torch twins -------------------------------

def f32_from_bits(bits) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)

def e4m3_probe_values() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours +- 1 fp32 ulp, specials, and
    random fp32 bit patterns (all exponents, NaN payloads, subnormals)."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    grid = grid.float()
    grid = grid[~grid.isnan()].unique()  # sorted, -448..448
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    mb = mids.view(torch.int32)
    near = torch.cat([mb - 1, mb, mb + 1]).view(torch.float32)
    specials = torch.tensor(
        [464.0, 480.0, 1e4, float("inf"), -float("inf"), float("nan"), -float("nan"), 448.0,
         449.0, 463.99, -464.0, 2.0**-9, 2.0**-10, 2.0**-11, 1e-40, -1e-40, 0.0, -0.0]
        + [v for v, _ in testing.E4M3_TIES]
    )
    rand_bits = torch.randint(-(2**31), 2**31, (1 << 16,), generator=testing.gen(8), dtype=torch.int64)
    rand = rand_bits.to(torch.int32).view(torch.float32)
    g = testing.gen(9)  # dense in the e4m3 range, where rounding matters
    dense = (torch.rand(1 << 16, generator=g) * 2 - 1) * torch.empty(1 << 16).uniform_(
        -12, 9.5, generator=g
    ).exp2()
    return torch.cat([grid, near, specials, rand, dense])

def test_e4m3_encode_equals_torch_cast():
    x = e4m3_probe_values()
    got = testing.run_fp_encode("e4m3_encode", x, DEVICE)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {x.numel()} differ, e.g. x={x[bad[:5]].tolist()} "
        f"got {got[bad[:5]].tolist()} want {want[bad[:5]].tolist()}"
    )

def test_e8m0_exp2_and_ceil_pow2_equal_fp_bits():
    g = testing.gen(10)
    amax = torch.cat([
        torch.randint(0, 0x7F800000, (1 << 15,), generator=g)
        .to(torch.int32).view(torch.float32),
        torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126, 448.0, 460.0, 0.9, float("inf"),
                      float("nan"), 3e38]),
        torch.tensor([448.0 * 2.0**k for k in range(-140, 120)]),
        f32_from_bits([0x3FE00000 + d for d in (-1, 0, 1)]),  # 1.75 +- ulp
    ])
    assert torch.equal(testing.run_fp_encode("e8m0_rceil", amax, DEVICE), fp_bits.e8m0_from_amax(amax, "rceil"))
    assert torch.equal(testing.run_fp_encode("e8m0_floor", amax, DEVICE), fp_bits.e8m0_from_amax(amax, "floor"))
    e = torch.arange(-149, 128, dtype=torch.int32)
    assert torch.equal(testing.run_fp_encode("exp2_int", e, DEVICE), fp_bits.exp2_int(e).view(torch.int32))
    s = amax[(amax > 2.0**-126) & (amax < 2.0**127)]
    assert torch.equal(testing.run_fp_encode("ceil_pow2", s, DEVICE), fp_bits.ceil_pow2(s).view(torch.int32))
    special = torch.tensor([float("inf"), float("nan")])
    assert testing.run_fp_encode("ceil_pow2", special, DEVICE).tolist() == [0x7F800000, 0x7FC00000]
