"""Block-FP8 and MXFP8 Triton kernels vs their torch references, byte for byte.

Runs where the kernels run (tests/kernel_harness.py): on CUDA tensors on a GPU machine; on a CPU
machine inside the one interpreter child process of tests/test_kernels.py
(``TRITON_INTERPRET=1 pytest tests/test_kernel_fp8.py`` runs it directly).
Input classes: docs/test-vectors.md.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'qstrat[triton]')")

import kernel_harness as testing  # noqa: E402
from qstrat.errors import NonFiniteError, UnsupportedShapeError  # noqa: E402
from qstrat.serializers.block_fp8 import BlockFP8  # noqa: E402
from qstrat.serializers.mxfp8 import MXFP8  # noqa: E402
from qstrat.serializers.nvfp4 import NVFP4  # noqa: E402

DEVICE = testing.require_kernel_device()

pytestmark = pytest.mark.interpreter if DEVICE == "cpu" else []

BLOCK_OPTS = [{}, {"ue8m0": True}]
MX_OPTS = [{}, {"scale_rounding": "floor"}, {"min_scale_byte": 1}]
CASES = [(BlockFP8, o) for o in BLOCK_OPTS] + [(MXFP8, o) for o in MX_OPTS]
CASE_IDS = [
    f"{c.name}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for c, o in CASES
]
FORMATS = [BlockFP8, MXFP8]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def wide_randn(shape, dtype, seed=0):
    """randn with a random power-of-two gain per row: tiles span many octaves, so small
    rows land in e4m3 subnormals. fp16 gets a range it can hold."""
    g = testing.gen(seed)
    lo, hi = (-10, 8) if dtype == torch.float16 else (-30, 30)
    gain = torch.randint(lo, hi, (*shape[:-1], 1), generator=g).to(torch.float32).exp2()
    return (torch.randn(shape, generator=g) * gain).to(dtype).to(DEVICE)

def both(cls, w, **opts):
    """(kernel parts, reference parts) of ``w`` with the same options."""
    kern = cls(backend="triton", **opts).quantize(w)
    ref = cls(backend="torch", **opts).quantize(w)
    return kern, ref

def check(cls, w, **opts):
    kern, ref = both(cls, w, **opts)
    testing.assert_same_bytes(kern, ref, f"{cls.name} {opts} {w.dtype} {list(w.shape)}")
    return kern

def codes(parts):
    return parts["weight"].view(torch.uint8).cpu()

# ---- random inputs, ragged and grouped shapes ----------------------------------------------

SHAPES = {"block_fp8": [(300, 200), (2, 130, 257)], "mxfp8": [(40, 96), (3, 33, 160)]}

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("cls", "opts"), CASES, ids=CASE_IDS)
def test_random_matches_reference(cls, opts, dtype):
    for i, shape in enumerate(SHAPES[cls.name]):
        check(cls, wide_randn(shape, dtype, seed=i), **opts)

@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_single_element_and_single_block(cls):
    k = 1 if cls is BlockFP8 else 32
    check(cls, wide_randn((1, k), torch.float32))
    check(cls, wide_randn((1, 1, k), torch.bfloat16))

# ---- strided views: read in place -------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_strided_views_read_in_place(cls, dtype, monkeypatch):
    e, i, k = 2, 40, 96
    slab = wide_randn((e, 2 * i, k), dtype, seed=1)
    views = {
        "gate rows of a fused slab": slab[:, :i, :],
        "up rows of a fused slab": slab[:, i:, :],
        "transposed (stride_k != 1)": wide_randn((e, k, i), dtype, seed=2).transpose(1, 2),
        "broadcast experts (stride_e == 0)": slab[:1, :i].expand(3, i, k),
        "every other row, 2-D": slab[0, ::2, :],
    }
    refs = {n: cls(backend="torch").quantize(v.contiguous()) for n, v in views.items()}
    with testing.no_contiguous_copies(monkeypatch):
        got = {n: cls(backend="triton").quantize(v) for n, v in views.items()}
    for n in views:
        assert not views[n].is_contiguous()
        testing.assert_same_bytes(got[n], refs[n], n)

# ---- batched == separate 2-D calls --------------------------------------------------------

@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_batched_equals_separate_2d_calls(cls):
    w = wide_randn((3, 70, 96), torch.bfloat16, seed=3)
    ser = cls(backend="triton")
    batched = ser.quantize(w)
    for e in range(w.shape[0]):
        one = ser.quantize(w[e])
        testing.assert_same_bytes({k: v[e] for k, v in batched.items()}, one, f"expert {e}")
    testing.assert_same_bytes(batched, cls(backend="torch").quantize(w))

# ---- test-vector classes ----------------------------------------------------------------

def test_all_zero_tiles_block_fp8():
    w = torch.zeros(2, 256, 200, device=DEVICE)
    got = check(BlockFP8, w)
    assert int(codes(got).count_nonzero()) == 0
    s = torch.tensor(1e-4, dtype=torch.float32) / 448.0  # amax floor 1e-4, vLLM
    assert torch.equal(got["weight_scale_inv"].cpu(), torch.full((2, 2, 2), s.item()))
    check(BlockFP8, w, ue8m0=True)

@pytest.mark.parametrize("min_byte", [0, 1])
def test_all_zero_blocks_mxfp8(min_byte):
    w = torch.zeros(3, 2, 64, device=DEVICE)
    w[1, 1, 32:] = 1.0  # one non-zero block among zero ones
    got = check(MXFP8, w, min_scale_byte=min_byte)
    byte = got["weight_scale"].cpu()
    # amax 1.0: RCEIL byte 127 - 8 = 119 (s = 2^-8), 1.0 / s = 256 = code 0x78
    assert byte[1, 1, 1] == 119 and int(codes(got)[1, 1, 32:].unique().item()) == 0x78
    byte[1, 1, 1] = min_byte
    assert torch.equal(byte, torch.full((3, 2, 2), min_byte, dtype=torch.uint8))
    assert int(codes(got).count_nonzero()) == 32

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("cls", "opts"), CASES, ids=CASE_IDS)
def test_tiny_subnormal_range_blocks(cls, opts, dtype):
    g = testing.gen(4)
    mag = 10.0 ** torch.empty(2, 64, 128).uniform_(-40, -35, generator=g)
    sign = torch.where(torch.rand(2, 64, 128, generator=g) < 0.5, -1.0, 1.0)
    w = (mag * sign).to(dtype).to(DEVICE)
    got = check(cls, w, **opts)
    c = codes(got)
    assert not bool(((c & 0x7F) == 0x7F).any()), "NaN codes from tiny inputs"
    if cls is BlockFP8:  # s = 1e-4/448 floor: everything rounds to (signed) zero
        assert bool(((c & 0x7F) == 0).all())
    else:  # power-of-two scales follow the block down: values keep their precision
        assert int((c & 0x7F).max()) >= 0x70

def _rows_with_block_amax(amaxes, k=64, seed=5):
    """fp32 [len(amaxes), k]: row r is random in (-a, a) with |x| = amaxes[r] at column 3."""
    g = testing.gen(seed)
    a = torch.tensor(amaxes, dtype=torch.float32)[:, None]
    w = (torch.rand(len(amaxes), k, generator=g) * 2 - 1) * a * 0.9
    w[:, 3] = a[:, 0] * torch.where(torch.arange(len(amaxes)) % 2 == 0, 1.0, -1.0)
    return w

def test_amax_just_above_1_75_rceil_is_floor_plus_one():
    amaxes = [460.0, 0.90, 1.75 * 2.0**-20 * (1 + 2.0**-23), 1.75 * 2.0**30 * (1 + 2.0**-22)]
    w = _rows_with_block_amax(amaxes).to(DEVICE)
    rceil = check(MXFP8, w)["weight_scale"][:, 0].cpu()
    floor = check(MXFP8, w, scale_rounding="floor")["weight_scale"][:, 0].cpu()
    assert torch.equal(rceil.int(), floor.int() + 1)
    assert rceil[:2].tolist() == [128, 119]  # 460 = 1.797 * 2^8; 0.90 = 1.8 * 2^-1
    for opts in BLOCK_OPTS:
        check(BlockFP8, w, **opts)

def test_amax_exactly_448_times_pow2():
    ks = list(range(-8, 9))
    w = _rows_with_block_amax([448.0 * 2.0**k for k in ks], k=128).to(DEVICE)
    mx = check(MXFP8, w, scale_rounding="rceil")
    assert mx["weight_scale"][:, 0].cpu().tolist() == [127 + k for k in ks]
    assert [int(c) & 0x7F for c in codes(mx)[:, 3]] == [0x7E] * len(ks)
    for k in ks:  # block FP8: one tile per row block, scale exactly 2^k
        tile = w[ks.index(k) : ks.index(k) + 1].expand(128, 128)
        got = check(BlockFP8, tile)
        assert got["weight_scale_inv"].item() == 2.0**k
        assert int(codes(got)[0, 3]) & 0x7F == 0x7E


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_e4m3_ties_and_carries(cls):
    row = torch.zeros(32)
    row[0] = 448.0  # amax 448: block FP8 s = 1 and MXFP8 byte 127, so x/s == x
    row[1 : 1 + len(testing.E4M3_TIES)] = torch.tensor([v for v, _ in testing.E4M3_TIES])
    w = row.repeat(2, 1).to(DEVICE)
    got = check(cls, w)
    want = [0x7E] + [c for _, c in testing.E4M3_TIES]
    assert codes(got)[:, : len(want)].tolist() == [want, want]
    assert codes(got)[:, : len(want)].tolist()[0] == (
        row[: len(want)].to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    )

def test_saturation_to_448():
    # FLOOR scales leave x/s up to ~512: 464, 480, 500 saturate to +-448 (0x7E / 0xFE).
    w = torch.zeros(4, 32)
    w[:, 0] = torch.tensor([464.0, 480.0, -500.0, 511.9])
    got = check(MXFP8, w.to(DEVICE), scale_rounding="floor")
    assert got["weight_scale"][:, 0].cpu().tolist() == [127] * 4
    assert codes(got)[:, 0].tolist() == [0x7E, 0x7E, 0xFE, 0x7E]
    # +-inf (nonfinite="propagate"): RCEIL byte of inf is 254 (vLLM), inf * 2^-127 saturates.
    w = torch.randn(2, 64, generator=testing.gen(6))
    w[0, 5], w[1, 40] = float("inf"), -float("inf")
    got = check(MXFP8, w.to(DEVICE), nonfinite="propagate")
    assert [int(codes(got)[0, 5]), int(codes(got)[1, 40])] == [0x7E, 0xFE]
    assert [int(got["weight_scale"][0, 0]), int(got["weight_scale"][1, 1])] == [254, 254]
    floor = check(MXFP8, w.to(DEVICE), nonfinite="propagate", scale_rounding="floor")
    assert [int(floor["weight_scale"][0, 0]), int(floor["weight_scale"][1, 1])] == [254, 254]

@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN arithmetic (interpreter)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("cls", "opts"), CASES, ids=CASE_IDS)
def test_nonfinite_propagate(cls, opts, dtype):
    n = 130 if cls is BlockFP8 else 40  # two row tiles of block FP8; MXFP8 blocks are 1x32
    w = wide_randn((2, n, 160), torch.float32, seed=7).clamp(-1e4, 1e4)
    nan = float("nan")
    w[0, 0, 0], w[0, 5, 40], w[1, 1, 1] = nan, -nan, nan
    w[1, n - 1, 159], w[1, 0, 100] = float("inf"), -float("inf")
    w = w.to(dtype)
    got = check(cls, w, nonfinite="propagate", **opts)
    if cls is MXFP8:
        assert int(got["weight_scale"][0, 0, 0]) == 255  # E8M0 NaN
        assert int(got["weight_scale"][1, n - 1, 4]) == 254  # +inf block: RCEIL/FLOOR 254
    else:  # plain and ue8m0 (whose pow2 rounding once turned NaN into -0.0)
        assert bool(got["weight_scale_inv"][0, 0, 0].isnan())
        assert bool((codes(got)[0, :128, :128] == 0x7F).all())

# ---- every format's kernel path (NVFP4's too: one test where the check is one) ------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("cls", [*FORMATS, NVFP4], ids=lambda c: c.name)
def test_nonfinite_error_names_tensor(cls, bad):
    w = torch.ones(3, 8, 64, device=DEVICE)
    w[2, 5, 33] = bad
    with pytest.raises(NonFiniteError, match=r"layers\.3\.experts.*\[2, 5, 33\]"):
        cls(backend="triton").quantize(w, name="layers.3.experts.down_proj")

@pytest.mark.parametrize("cls,k,block", [(MXFP8, 48, 32), (NVFP4, 40, 16)], ids=["mxfp8", "nvfp4"])
def test_rejects_k_off_the_scale_block(cls, k, block):
    with pytest.raises(UnsupportedShapeError, match=f"divisible by {block}"):
        cls(backend="triton").quantize(torch.ones(4, k, device=DEVICE))

# ---- GPU only: offsets beyond 2^31 elements ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU with >= 16 GiB free")
@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_offsets_beyond_2_31_elements(cls):
    reason = testing.check_offsets_beyond_2_31(cls)
    if reason:
        pytest.skip(reason)
