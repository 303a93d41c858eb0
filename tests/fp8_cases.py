"""Inputs and byte views shared by the FP8 reference tests: tests/test_block_fp8.py,
tests/test_mxfp8.py and tests/test_formats_common.py."""
from __future__ import annotations

import torch


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors viewed as uint8 of the same shape (torch.equal has no float8 kernel, and bytes
    tell -0.0 from 0.0); other tensors unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def random_rows(shape: tuple[int, int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Seeded randn [N, K] whose rows have magnitudes 10^u, u uniform in [-4, 2]: tiles and blocks
    with scales over many octaves, cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.empty(shape[0], 1).uniform_(-4, 2, generator=g)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def special_blocks() -> torch.Tensor:
    """[8, 256] float32 rows of docs/test-vectors.md classes, each row 32-aligned (row 5 is
    unseeded randn * 1e-3)."""
    rows = torch.zeros(8, 256)
    rows[1] = torch.linspace(1e-40, 1e-35, 256)               # fp32 subnormal territory
    rows[2, :32] = 0.5; rows[2, 0] = 460.0                      # mantissa just above 1.75 * 2^8
    rows[2, 32:64] = 0.1; rows[2, 40] = 0.90                    # just above 1.75 * 2^-1
    rows[3, :32] = 1.0; rows[3, 0] = 448.0                      # amax exactly 448 * 2^0
    rows[3, 32:64] = 1.0; rows[3, 32] = 448.0 * 2 ** -10        # 448 * 2^-10
    ties = torch.tensor([1.0625, 17, 232, 0.0029296875, 126.24, 1.97, -124.5, 448.0])
    rows[4, :8] = ties                                         # amax 448: s = 1, values are encoded as is
    rows[5] = torch.randn(256) * 1e-3
    rows[6, ::2] = 3.0e4; rows[6, 1::2] = -1.0e-3              # large magnitudes
    rows[7] = -torch.arange(256, dtype=torch.float32)          # negative ramp
    return rows
