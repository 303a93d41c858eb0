"""Shared pieces of the property-based tests (hypothesis): weight strategies, the formats under
test, and each format's documented error bound (docs/formats.md, "Error bounds").

Every bound is checked in float64 on the exact input values, per element, against the stored
scale the format chose, with a relative slack of 2^-16 for the fp32 roundings of ``1/s`` and of
the products (each at most 2^-23 relative).
"""
from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from qstrat.serializers.bf16 import BF16
from qstrat.serializers.block_fp8 import BLOCK as FP8_TILE
from qstrat.serializers.block_fp8 import BlockFP8
from qstrat.serializers.mxfp8 import BLOCK as MX_BLOCK
from qstrat.serializers.mxfp8 import MXFP8
from qstrat.serializers.nvfp4 import BLOCK as NV_BLOCK
from qstrat.serializers.nvfp4 import NVFP4

#: Few examples, no deadline (a loaded 2-core machine), no example database written into the
#: tree, derandomized so CI runs the same examples every time. ``QSTRAT_PROPERTY_EXAMPLES=2000``
#: explores more (and randomly) on a developer's machine.
_EXPLORE = os.environ.get("QSTRAT_PROPERTY_EXAMPLES")
PROPS = settings(max_examples=int(_EXPLORE or 20), deadline=None, database=None, derandomize=not _EXPLORE,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SLACK = 1 + 2.0**-16

#: (id, format class, options, K multiple) of every case under test.
CASES = [
    ("block_fp8", BlockFP8, {}, 1),
    ("block_fp8-ue8m0", BlockFP8, {"ue8m0": True}, 1),
    ("mxfp8", MXFP8, {}, MX_BLOCK),
    ("mxfp8-floor", MXFP8, {"scale_rounding": "floor"}, MX_BLOCK),
    ("mxfp8-min_scale_byte", MXFP8, {"min_scale_byte": 1}, MX_BLOCK),
    ("nvfp4", NVFP4, {}, NV_BLOCK),
    ("bf16", BF16, {}, 1),
]
CASE_IDS = [c[0] for c in CASES]

#: Cases whose scales are powers of two: dequantizing is exact and quantizing the dequantized
#: weight again gives the same values (docs/formats.md, "Re-quantization").
IDEMPOTENT = [c for c in CASES if c[0] in ("block_fp8-ue8m0", "mxfp8", "mxfp8-floor", "mxfp8-min_scale_byte")]


@st.composite
def weights(draw, k_multiple: int, max_rows: int = 70, max_k_blocks: int = 4, batched: bool | None = None,
            dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> torch.Tensor:
    """A random weight [N, K] or [E, N, K]: normal values times a tensor gain (2^-60..2^60; fp16:
    2^-14..2^10) and a per-row spread of octaves, with optional all-zero rows, exact e4m3/e2m1
    ties, and fp32-subnormal rows. Shrinks towards small, plain, float32 tensors."""
    dtype = draw(st.sampled_from(dtypes))
    three = draw(st.booleans()) if batched is None else batched
    e = draw(st.integers(1, 3)) if three else 1
    n = draw(st.integers(1, max_rows))
    k = k_multiple * draw(st.integers(1, max_k_blocks)) if k_multiple > 1 else draw(st.integers(1, 150))
    lo, hi = (-14, 10) if dtype == torch.float16 else (-60, 60)
    gain = draw(st.integers(lo, hi))
    spread = draw(st.integers(0, 12 if dtype == torch.float16 else 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(e, n, k, generator=g, dtype=torch.float64)
    rows = torch.randint(-spread, spread + 1, (e, n, 1), generator=g).clamp(lo - gain, hi - gain)
    w = w * torch.exp2((gain + rows).to(torch.float64))
    if draw(st.booleans()):  # exact ties of the element grids (e4m3 midpoints, e2m1 decision points)
        ties = torch.tensor([1.0625, 17.0, 232.0, 0.0029296875, 0.25, 0.75, 2.5, 5.0], dtype=torch.float64)
        m = min(k, ties.numel())
        w[:, 0, :m] = ties[:m] * 2.0 ** min(max(gain, lo), hi - 8)
    if n > 1 and draw(st.booleans()):
        w[:, draw(st.integers(0, n - 1))] = 0.0
    if dtype != torch.float16 and n > 2 and draw(st.booleans()):
        w[:, 1] = torch.randn(k, generator=g, dtype=torch.float64) * 2.0**-135  # fp32 subnormals
    w = w.to(dtype)
    return w if three else w[0]


def bound_violations(case_id: str, x: torch.Tensor, parts: dict[str, torch.Tensor], deq: torch.Tensor) -> int:
    """Elements of ``deq`` (float32 dequantized) outside ``case_id``'s documented bound around ``x``."""
    err = (deq.double() - x.double()).abs()
    return int((err > error_bound(case_id, x, parts) * SLACK).sum())


def error_bound(case_id: str, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """``case_id``'s documented bound of |dequantize(quantize(x)) - x| per element (float64)."""
    ax = x.double().abs()
    if case_id == "bf16":
        bound = torch.zeros_like(ax) if x.dtype == torch.bfloat16 else 2.0**-8 * ax + 2.0**-134
    elif case_id.startswith("block_fp8"):
        s = parts["weight_scale_inv"].double()
        n, k = x.shape[-2:]
        s = s.repeat_interleave(FP8_TILE, -2).repeat_interleave(FP8_TILE, -1)[..., :n, :k]
        bound = 2.0**-4 * ax + 2.0**-10 * s
    elif case_id.startswith("mxfp8"):
        s = torch.exp2(parts["weight_scale"].double() - 127).repeat_interleave(MX_BLOCK, -1)
        bound = 2.0**-4 * ax + 2.0**-10 * s
        if case_id == "mxfp8-floor":
            bound = bound + (ax - 448 * s).clamp(min=0)  # FLOOR scales let |x/s| reach 512: saturation
    elif case_id == "nvfp4":
        s2 = parts["weight_scale_2"].double()
        s2 = s2.reshape(*s2.shape, 1, 1)
        d = (parts["weight_scale"].double() * s2).repeat_interleave(NV_BLOCK, -1)
        bound = torch.maximum(d, ax) / 4 + 6 * 2.0**-10 * s2
    else:
        raise KeyError(case_id)
    return bound
