"""The fast CPU path (``backend="fast"``, the ``auto`` default on CPU) gives exactly the bytes of
the eager torch reference (``backend="torch"``, the oracle), on every input class of
shared/docs/test-vectors.md, for every format and option, chunked or not."""
from __future__ import annotations

import pytest
import torch
from kernel_harness import assert_same_bytes

import qstrat
from qstrat.serializers.base import all_finite
from qstrat.serializers.chunking import block_max, chunks

FORMATS = {
    "block_fp8": [{}, {"ue8m0": True}],
    "mxfp8": [{}, {"scale_rounding": "floor"}, {"min_scale_byte": 1}],
    "nvfp4": [{}, {"input_scale": 0.25}],
}
CASES = [(name, opts) for name, variants in FORMATS.items() for opts in variants]


def _pair(name, **opts):
    return (qstrat.get_serializer(name, backend="fast", **opts),
            qstrat.get_serializer(name, backend="torch", **opts))


def _check(name, opts, w, what, **extra):
    fast, ref = _pair(name, **opts, **extra)
    assert fast.has_fast_path()
    assert_same_bytes(fast.quantize(w), ref.quantize(w), f"{name} {opts} {what}")


def _vectors(k: int = 128) -> dict[str, torch.Tensor]:
    """One [rows, k] fp32 matrix per test-vector class (every row a few blocks of the class)."""
    g = torch.Generator().manual_seed(14)
    ties = torch.tensor([1.0625, 17, 232, 0.0029296875, 126.24, 1.97, -124.5, 448,
                         0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])  # e4m3 and e2m1 ties
    e2m1_scaled = ties.repeat(k // 16)
    rows = {
        "zeros": torch.zeros(4, k),
        "negative_zeros": torch.full((4, k), -0.0),
        "tiny_subnormal": torch.linspace(1e-40, 1e-35, 4 * k).reshape(4, k),
        "fp32_subnormal_block": torch.linspace(1e-40, 1e-39, 4 * k).reshape(4, k),
        "mantissa_above_1_75": torch.tensor([460.0, 0.90, 1.7500001, 448.0]).repeat(4, k // 4),
        "amax_448_times_2k": torch.cat([torch.full((1, k), 0.5 * 2.0 ** j) for j in (-20, -1, 0, 3)])
        * torch.where(torch.arange(k) % 32 == 5, 896.0, 1.0),
        "ties_and_carries": e2m1_scaled.repeat(4, 1) * torch.tensor([[1.0], [2.0 ** -3], [3.0], [-1.0]]),
        "saturation": torch.tensor([464.0, -480.0, 480.0, 1e4, -1e4, 100.0, 0.5, -3.0]).repeat(4, k // 8),
        "randn": torch.randn(64, k, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1),
        "huge_and_tiny_mix": torch.where(torch.rand(8, k, generator=g) < 0.5, 1e30, 1e-30)
        * torch.randn(8, k, generator=g),
    }
    return rows


@pytest.mark.parametrize("name,opts", CASES)
def test_every_test_vector_class_gives_reference_bytes(name, opts):
    for cls, w in _vectors().items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = w.to(dtype)
            if not torch.isfinite(x).all():  # fp16 overflow of the huge classes
                continue
            _check(name, opts, x, f"{cls} {dtype}")


@pytest.mark.parametrize("name,opts", CASES)
def test_nan_and_inf_propagate_exactly_like_the_reference(name, opts):
    w = torch.randn(3, 160, 256)
    w[0, 3, 7] = float("nan")
    w[1, 130, 40] = float("inf")
    w[2, 0, 0] = -float("inf")
    w[2, 9, 200] = -float("nan")
    w[2, 10, 32:48] = float("nan")  # a whole NVFP4 block
    _check(name, opts, w, "nan/inf", nonfinite="propagate")


def test_nvfp4_nan_multipliers_from_outside_the_block_match_the_reference():
    """With nonfinite="propagate", NVFP4's per-block multiplier can be NaN in a block holding no
    NaN: a +inf anywhere makes the global encode scale 0 (so the inf block's scale is 0 * inf),
    a NaN in another row band (another chunk) or in a fused sibling makes it NaN. The fast path
    must then give the reference's bytes too (found by an adversarial run)."""
    inf_only = torch.ones(1, 16)
    inf_only[0, 0] = float("inf")
    _check("nvfp4", {}, inf_only, "+inf only", nonfinite="propagate")
    other_band = torch.ones(2, 16)
    other_band[0, 0] = float("nan")
    _check("nvfp4", {}, other_band, "NaN in another row band", nonfinite="propagate", chunk_elements=16)
    big = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    big[5, 7] = float("nan")  # the default chunks cut this matrix into row bands
    _check("nvfp4", {}, big, "NaN in the first band of a large matrix", nonfinite="propagate")
    fast, ref = _pair("nvfp4", nonfinite="propagate")
    a, b = torch.ones(4, 16), torch.ones(4, 16)
    b[0, 0] = float("nan")
    ctx = fast.group_context([a, b])
    assert_same_bytes(fast.quantize(a, context=ctx), ref.quantize(a, context=ctx), "NaN in a fused sibling")


@pytest.mark.parametrize("name", list(FORMATS))
def test_fast_path_raises_naming_tensor_and_first_bad_index(name):
    fast = qstrat.get_serializer(name, backend="fast")
    w = torch.randn(2, 256, 64)
    w[1, 200, 17] = float("nan")
    w[1, 250, 3] = float("inf")
    with pytest.raises(qstrat.NonFiniteError, match=r"layers\.3\.w.*\[1, 200, 17\]"):
        fast.quantize(w, name="layers.3.w")


@pytest.mark.parametrize("name,opts", CASES)
def test_ragged_grouped_chunked_and_strided_inputs_give_reference_bytes(name, opts):
    g = torch.Generator().manual_seed(3)
    k = 200 if name == "block_fp8" else 224  # not a multiple of 128; MX formats need K % 32
    shapes = [(300, k), (5, 136, k), (1, 129, 256), (7, 16, 64)]
    for shape in shapes:
        w = torch.randn(shape, generator=g, dtype=torch.bfloat16)
        for chunk in (None, 128 * k, 5000, 1 << 30):
            _check(name, opts, w, f"{shape} chunk {chunk}", chunk_elements=chunk)
    slab = torch.randn(4, 512, 256, generator=g, dtype=torch.bfloat16)
    _check(name, opts, slab[:, 256:, :], "strided view of a slab")
    _check(name, opts, slab.transpose(1, 2), "transposed view")


def test_nvfp4_fused_group_context_gives_reference_bytes():
    fast, ref = _pair("nvfp4")
    gate, up = torch.randn(2, 6, 64, 128).unbind(0)
    ctx = ref.group_context([gate, up * 3])
    for m in (gate, up):
        assert_same_bytes(fast.quantize(m, context=ctx), ref.quantize(m, context=ctx), "member")


def test_chunks_cover_every_element_once_and_respect_the_row_tile():
    for shape, budget, tile in [((256, 256, 512), 1 << 19, 128), ((3, 300, 200), 128 * 200, 128),
                                ((1, 4096, 4096), 1 << 19, 1), ((2, 10, 7), 1, 1)]:
        seen = torch.zeros(shape[:2], dtype=torch.int32)
        for e0, e1, r0, r1 in chunks(shape, budget, tile):
            seen[e0:e1, r0:r1] += 1
            assert r0 % tile == 0
        assert seen.eq(1).all(), (shape, budget)
    assert list(chunks((256, 256, 512), 1 << 19, 128))[:2] == [(0, 4, 0, 256), (4, 8, 0, 256)]


def test_block_max_equals_amax_with_nan_and_inf():
    """Every route of block_max (max_pool1d for 16-blocks, amax for wider or strided blocks)."""
    a = torch.rand(6, 4, 64)
    a[2, 1, 7] = float("nan")
    a[3, 2, 40] = float("inf")
    a[4, 0, 17] = float("nan")
    a[4, 0, 18] = float("inf")
    views = [a.view(6, 4, 64 // w, w) for w in (16, 32, 64)] + [a[..., :16], a[..., 1:17]]
    for v in views:
        got, want = block_max(v), v.amax(-1)
        assert got.shape == want.shape
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert block_max(a.view(6, 4, 4, 16))[2, 1, 0].isnan() and block_max(a.view(6, 4, 4, 16))[3, 2, 2] == float("inf")


def test_all_finite_screen_catches_every_nan_and_inf():
    """check_finite's one-reduction screen (aminmax): any NaN (either sign) or +-inf anywhere,
    in contiguous and strided views, every float dtype; finite tensors pass."""
    g = torch.Generator().manual_seed(21)
    specials = (float("nan"), -float("nan"), float("inf"), -float("inf"))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert all_finite(torch.randn(3, 37, 129, generator=g).to(dtype))
        assert all_finite(torch.empty(0, 5, dtype=dtype))
        for i in range(64):
            w = torch.randn(3, 37, 129, generator=g).to(dtype)
            w.view(-1)[int(torch.randint(0, w.numel(), (1,), generator=g))] = specials[i % 4]
            assert not all_finite(w) and not all_finite(w.transpose(1, 2)), (dtype, i)


@pytest.mark.parametrize("name", list(FORMATS))
def test_auto_backend_on_cpu_takes_the_fast_path(name, monkeypatch):
    ser = qstrat.get_serializer(name)
    cls = type(ser)

    def refuse(self, x, context):
        raise AssertionError("reference() called with backend='auto' on CPU")

    monkeypatch.setattr(cls, "reference", refuse)
    parts = ser.quantize(torch.randn(256, 128))
    assert set(parts) == {p.suffix for p in ser.part_specs((256, 128))}


@pytest.mark.parametrize("name", list(FORMATS))
def test_grouped_call_equals_the_per_expert_loop_on_bench_shapes(name):
    """``qstrat bench``'s grouped section compares one call on a slab with a loop of per-expert
    calls: both must give the same bytes (the loop's outputs stacked; NVFP4: a global scale per
    expert both ways), on each bench shape's experts [N, K] - whole experts packed several per
    chunk (256 x 512), experts cut into row bands (1536 x 2048: three 512-row bands; 2048 x 768:
    a 1280- and a 768-row band) - with enough experts for a ragged last chunk of several."""
    from qstrat.cli.bench import SIZES

    ser = qstrat.get_serializer(name)  # the CPU default (auto: the fast path), as the bench runs it
    g = torch.Generator().manual_seed(5)
    for e, n, k in SIZES["full"]["grouped"]:
        experts = 11 if n * k * 8 <= ser._chunk_elements() else 2
        w = torch.randn(experts, n, k, generator=g).to(torch.bfloat16)
        grouped = ser.quantize(w)
        loop = [ser.quantize(w[i]) for i in range(experts)]
        stacked = {part: torch.stack([out[part] for out in loop]) for part in grouped}
        assert_same_bytes(grouped, stacked, f"{name} {experts} x {n} x {k}: grouped call vs per-expert loop")
