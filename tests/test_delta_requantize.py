"""The delta sender's incremental quantizer (qstrat.transport.delta.requantize): every step's
parts byte for byte a full ``Serializer.quantize`` of that step's input, over a real Adam
trajectory of the tiny model and over generated edits (amax elements raised and lowered, zeroed
blocks, ragged tiles, fp32 near float32's max, -0.0, each format option, NVFP4 fused groups and
3-D expert slabs); and each reason to quantize whole."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from properties import CASES, PROPS, weights
from qstrat.errors import NonFiniteError
from qstrat.serializers.bf16 import BF16
from qstrat.serializers.nvfp4 import NVFP4
from qstrat.transport.delta.encoding import bits_view, changed_values
from qstrat.transport.delta.requantize import Requantizer, block_maxima, changed_elements

QUANTIZED = [c for c in CASES if c[1] is not BF16]


def same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        g, w = got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)
        assert torch.equal(g, w), f"{k}: {int((g != w).sum())} bytes differ"


def edit(w: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    """One step's change of ``w`` (a copy), per ``kind``."""
    g = torch.Generator().manual_seed(seed)
    x = w.clone()
    flat = x.view(-1)
    n = flat.numel()
    at = torch.randint(0, n, (max(1, n // 200),), generator=g)
    top = int(flat.float().abs().argmax())
    if kind == "few":  # the next representable value up or down: what an RL step does
        v = flat[at].float()
        flat[at] = torch.nextafter(v.to(w.dtype), torch.where(torch.rand(v.shape, generator=g) < 0.5,
                                                              torch.tensor(float("inf")),
                                                              torch.tensor(float("-inf"))).to(w.dtype))
    elif kind == "raise_max":  # a block's (and the tensor's) largest element grows
        flat[top] = flat[top] * 1.5
    elif kind == "lower_max":  # it shrinks: the block's amax must be read again
        flat[top] = flat[top] * 0.25
    elif kind == "zero_rows":
        x.view(-1, x.shape[-1])[: max(1, x.shape[-2] // 3)] = 0
    elif kind == "negative_zero":
        flat[at] = -0.0
    elif kind == "sign":
        flat[at] = -flat[at]
    elif kind == "near_max":  # decodes near float32's max: the full path checks decoded values
        if w.dtype == torch.float32:
            flat[at[:1]] = torch.finfo(torch.float32).max / 2
    return x


EDITS = ["few", "raise_max", "lower_max", "zero_rows", "negative_zero", "sign", "near_max"]


@pytest.mark.parametrize("case", QUANTIZED, ids=[c[0] for c in QUANTIZED])
@PROPS
@given(data=st.data())
def test_every_step_of_generated_edits_equals_a_full_quantize(case, data):
    _, cls, options, k_multiple = case
    ser = cls(**options)
    w = data.draw(weights(k_multiple))
    rq = Requantizer()
    kinds = data.draw(st.lists(st.sampled_from(EDITS), min_size=1, max_size=4))
    for step, kind in enumerate(["start", *kinds]):
        if step:
            w = edit(w, kind, step)
        try:
            want = ser.quantize(w, name="w")
        except NonFiniteError:  # fp32 near max in formats whose decode overflows: the same error
            with pytest.raises(NonFiniteError):
                rq.quantize(ser, "w", w, name="w")
            return
        same_bytes(rq.quantize(ser, "w", w, name="w"), want)


@pytest.mark.parametrize("ragged", [(300, 200), (2, 129, 257), (1, 128, 384)])
def test_block_fp8_ragged_edge_tiles_rescaled_whole_equal_a_full_quantize(ragged):
    from qstrat.serializers.block_fp8 import BlockFP8

    ser, rq = BlockFP8(), Requantizer()
    w = (torch.randn(ragged, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    rq.quantize(ser, "w", w)
    x = w.clone()
    x[..., -1, -1] = 1.0  # the last (ragged) tile's amax moves: its scale and every code
    x[..., 0, 0] = -2.0
    same_bytes(rq.quantize(ser, "w", x), ser.quantize(x))
    assert rq.stats["blocks_rescaled"] >= 2


def test_nvfp4_fused_gate_up_expert_slabs_follow_their_group_context():
    ser = NVFP4()
    g = torch.Generator().manual_seed(5)
    gate = (torch.randn(4, 48, 64, generator=g) * 0.02).bfloat16()
    up = (torch.randn(4, 32, 64, generator=g) * 0.02).bfloat16()
    rq = Requantizer()
    for step in range(4):
        if step == 1:  # small moves inside one member: incremental
            gate = edit(gate, "few", 11)
        if step == 2:  # up's expert 2 grows past the group's amax: that global scale moves
            up = up.clone()
            up[2, 0, 0] = 1.0
        if step == 3:
            up = edit(up, "few", 13)
        ctx = ser.group_context([gate, up])
        for name, m in (("gate", gate), ("up", up)):
            same_bytes(rq.quantize(ser, name, m, name=name, context=ctx), ser.quantize(m, name=name, context=ctx))
    stats = rq.take_stats()
    assert stats["whole:global scale moved"] == 2 and stats["incremental"] == 4, stats


@pytest.mark.parametrize("fmt", ["block-fp8", "mxfp8", "nvfp4-experts", "nvfp4-linear"])
def test_a_real_adam_trajectory_quantized_incrementally_gives_the_drivers_bytes(tiny_model, fmt):
    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.cli.demo.trajectory import adam_trajectory, text_tokens
    from qstrat.execute.driver import RefitDriver
    from qstrat.transport.delta.churn import FORMATS

    driver = RefitDriver(FORMATS[fmt], hf_config=hf_config(tiny_model))
    rq = Requantizer()
    for lr in (1e-6, 1e-5):
        for step, state in enumerate(adam_trajectory(tiny_model, lr, 3, tokens=text_tokens())):
            plan = driver.plan(state)
            want = {n: t.contiguous() for n, t in driver.run(state)}
            got = {n: t.contiguous() for n, t in driver.execute(plan, state, quantize=rq.quantize)}
            assert got.keys() == want.keys()
            for n in want:
                assert torch.equal(got[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8)), \
                    (fmt, lr, step, n)
            stats = rq.take_stats()
            if step:
                assert stats["incremental"] > 0 and stats["changed"] > 0, stats


def test_reasons_to_quantize_whole_each_still_give_the_full_bytes():
    from qstrat.serializers.mxfp8 import MXFP8

    ser, rq = MXFP8(), Requantizer(max_fraction=0.1)
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    rq.quantize(ser, "w", w)
    dense = w * 2  # every element moves: above max_fraction
    same_bytes(rq.quantize(ser, "w", dense), ser.quantize(dense))
    same_bytes(rq.quantize(ser, "w", dense.float()), ser.quantize(dense.float()))  # another dtype
    plain = BF16()  # a format without scale blocks (as a plugin's): whole every time
    same_bytes(rq.quantize(plain, "b", w), plain.quantize(w))
    assert rq.take_stats() == {"elements": 4 * w.numel(), "whole:first round": 1, "changed": int((w != 0).sum()),
                               "whole:dense change": 1, "whole:another shape or dtype": 1,
                               "whole:format without scale blocks": 1}


def test_a_non_finite_changed_value_raises_as_a_full_quantize_and_drops_the_entry():
    from qstrat.serializers.block_fp8 import BlockFP8

    ser, rq = BlockFP8(), Requantizer()
    w = (torch.randn(130, 140, generator=torch.Generator().manual_seed(4)) * 0.02).bfloat16()
    rq.quantize(ser, "w", w, name="layer.w")
    bad = w.clone()
    bad[129, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"layer\.w.*\[129, 7\]"):
        rq.quantize(ser, "w", bad, name="layer.w")
    same_bytes(rq.quantize(ser, "w", w, name="layer.w"), ser.quantize(w))
    assert rq.take_stats()["whole:first round"] == 2  # the entry was dropped with the error


def test_changed_elements_and_block_maxima_against_their_oracles():
    g = torch.Generator().manual_seed(9)
    for dtype, n in ((torch.bfloat16, 4096), (torch.float32, 4096), (torch.bfloat16, 4099)):
        a = torch.randn(n, generator=g).to(dtype)
        b = a.clone()
        at = torch.randperm(n, generator=g)[:37]
        b[at] = b[at] + 1
        b[5] = -0.0 if a[5] == 0 else b[5]
        want = torch.nonzero(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                             != b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)).reshape(-1)
        assert torch.equal(changed_elements(b, a), want)
        idx, new_bits, old_bits = changed_values(b, a)  # the values, read from the compared words
        assert torch.equal(idx, want)
        assert torch.equal(new_bits, bits_view(b)[want]) and torch.equal(old_bits, bits_view(a)[want])
        assert new_bits.dtype == bits_view(b).dtype
    from qstrat.serializers.block_fp8 import BlockFP8

    w = torch.randn(2, 200, 130, generator=g)
    got = block_maxima(BlockFP8(), w)
    assert got.shape == (2, 2, 2)
    assert got[1, 1, 1] == w[1, 128:, 128:].abs().max() and got[0, 0, 0] == w[0, :128, :128].abs().max()


@pytest.mark.parametrize("cls", ["mxfp8", "nvfp4"])
def test_nan_under_propagate_keeps_the_full_paths_bytes_and_no_entry(cls):
    from qstrat.serializers.mxfp8 import MXFP8

    ser = {"mxfp8": MXFP8, "nvfp4": NVFP4}[cls](nonfinite="propagate")
    rq = Requantizer()
    w = (torch.randn(40, 64, generator=torch.Generator().manual_seed(6)) * 0.02).bfloat16()
    nan = w.clone()
    nan[3, 5] = float("nan")
    for x in (w, nan, nan, w, edit(w, "few", 1)):
        same_bytes(rq.quantize(ser, "w", x), ser.quantize(x))
    stats = rq.take_stats()
    # w whole (first), nan whole (non-finite), nan whole (no entry kept), w whole, then incremental
    assert stats["whole:non-finite"] == 1 and stats["whole:first round"] == 3 and stats["incremental"] == 1, stats


# ---- the attacker's findings (each failed before its fix) ---------------------------------------

def test_a_callers_context_buffer_updated_in_place_is_not_aliased():
    """The group amax is kept as a copy: a caller reusing its context buffer (only k of q/k grew)
    made the 'global scale moved' check compare the tensor with itself (wrong NVFP4 bytes)."""
    ser, rq = NVFP4(), Requantizer()
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(32, 64, generator=g) * 0.02).bfloat16()
    k = (torch.randn(16, 64, generator=g) * 0.02).bfloat16()
    ctx = ser.group_context([q, k])
    rq.quantize(ser, "q", q, context=ctx)
    k2 = k.clone()
    k2[0, 0] = 1.0
    ctx["amax"].copy_(ser.group_context([q, k2])["amax"])
    same_bytes(rq.quantize(ser, "q", q, context=ctx), ser.quantize(q, context=ctx))


@pytest.mark.parametrize("fmt,flat,shape", [("block_fp8", torch.bfloat16, (32, 129)), ("mxfp8", torch.float32, (16, 64))])
def test_a_view_at_an_unaligned_storage_offset_is_compared_and_exact(fmt, flat, shape):
    """A contiguous view whose storage offset is not a multiple of 8 bytes (a row of a fused slab,
    a flat parameter buffer) cannot be read as int64 words: compared element by element (it raised)."""
    from qstrat.plugins.registry import get_serializer

    ser, rq = get_serializer(fmt), Requantizer()
    off = shape[1] if flat == torch.bfloat16 else 1
    buf = torch.randn(off + shape[0] * shape[1], generator=torch.Generator().manual_seed(1)).to(flat)
    w = buf[off:].view(shape)
    assert w.storage_offset() * w.element_size() % 8
    rq.quantize(ser, "w", w)
    buf[off + 5] += 0.01
    same_bytes(rq.quantize(ser, "w", w), ser.quantize(w))
    assert rq.stats["incremental"] == 1


def test_an_incremental_round_refuses_a_non_finite_scale_as_a_full_quantize_does():
    """A plugin-like format without a floor on its block maxima: zeroing one tile gives an infinite
    scale; the full quantize refuses it (check_emitted_scales), so must the incremental round."""
    from qstrat.serializers.block_fp8 import BlockFP8

    class NoFloor(BlockFP8):
        def block_scales(self, amax, context=None):
            s = amax / 448.0
            return 1.0 / s, s

    ser, rq = NoFloor(), Requantizer()
    w = torch.randn(128, 128 * 9, generator=torch.Generator().manual_seed(2)).bfloat16()
    rq.quantize(ser, "w", w)
    y = w.clone()
    y[:128, :128] = 0  # one tile of nine: under max_fraction, so incremental
    for run in (lambda: ser.quantize(y, name="w"), lambda: rq.quantize(ser, "w", y, name="w")):
        with pytest.raises(NonFiniteError, match=r"^w: serializer 'block_fp8' emitted a non-finite scale in "
                                                 r"'weight_scale_inv' at index \[0, 0\]"):
            run()


@pytest.mark.parametrize("bad", [-1, 1.5, float("nan"), True, "0.1", None])
def test_a_max_fraction_outside_zero_to_one_is_refused_naming_it(bad):
    with pytest.raises(ValueError) as exc:
        Requantizer(max_fraction=bad)
    assert str(exc.value) == ("Requantizer: max_fraction must be a number in [0, 1] (a fraction of each entry's "
                              f"elements), got {bad!r}")


def test_max_fraction_zero_quantizes_whole_whenever_anything_changed():
    from qstrat.plugins.registry import get_serializer

    ser, rq = get_serializer("mxfp8"), Requantizer(max_fraction=0)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    rq.quantize(ser, "w", w)
    same_bytes(rq.quantize(ser, "w", w), ser.quantize(w))  # nothing changed: incremental
    w[3, 7] += 0.5
    same_bytes(rq.quantize(ser, "w", w), ser.quantize(w))
    assert rq.stats["incremental"] == 1 and rq.stats["whole:dense change"] == 1


def test_an_incremental_round_refuses_an_e8m0_nan_byte_as_a_full_quantize_does():
    """Only the re-encoded blocks' scales are read for NaN/inf in an incremental round; a plugin's
    E8M0 NaN byte (0xFF) there is refused with the full quantize's message, and the next round
    quantizes whole."""
    from qstrat.errors import NonFiniteError
    from qstrat.serializers.mxfp8 import MXFP8

    class NaNByte(MXFP8):
        def block_scales(self, amax, context=None):
            byte, mult = super().block_scales(amax, context)
            return torch.where(amax == 0, torch.full_like(byte, 255), byte), mult

    ser, rq = NaNByte(), Requantizer()
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    rq.quantize(ser, "w", w)
    y = w.clone()
    y[5, 32:64] = 0
    for run in (lambda: ser.quantize(y, name="w"), lambda: rq.quantize(ser, "w", y, name="w")):
        with pytest.raises(NonFiniteError, match=r"^w: serializer 'mxfp8' emitted the E8M0 NaN byte 0xFF in "
                                                 r"'weight_scale' at index \[5, 1\]"):
            run()
    assert rq.stats["incremental"] == 0
    y[5, 32:64] = 1.0
    same_bytes(rq.quantize(ser, "w", y), MXFP8().quantize(y))
    assert rq.stats["whole:first round"] == 2  # the entry was dropped: quantized whole again


# ---- the compare split over two threads (one torch intra-op thread, inputs of 8 MiB or more) ----

def _brute(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(bits_view(new).reshape(-1) != bits_view(old).reshape(-1)).reshape(-1)


@pytest.mark.parametrize("words", [16, 24, 1 << 10])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_the_split_compare_equals_the_oracle_on_both_halves_and_their_seam(monkeypatch, words, dtype):
    from qstrat.transport.delta import encoding

    monkeypatch.setattr(encoding, "SPLIT_WORDS", 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    n = words * 8 // torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(words)
    old = torch.randint(0, 255, (n * torch.tensor([], dtype=dtype).element_size(),), generator=g,
                        dtype=torch.uint8).view(dtype)
    for at in ([0], [n - 1], [n // 2 - 1, n // 2], list(range(n))[::7], []):  # ends, the seam, many, none
        new = old.clone()
        bits_view(new)[at] = bits_view(new)[at] ^ 1
        idx, nb, ob = changed_values(new, old)
        want = _brute(new, old)
        assert torch.equal(idx, want) and torch.equal(nb, bits_view(new)[want]) and torch.equal(ob, bits_view(old)[want])


def test_the_split_compare_runs_under_inference_mode_and_raises_the_helpers_error(monkeypatch):
    """The helper thread runs outside the caller's inference mode (torch's default on a new
    thread): it only reads the two tensors, so a caller under inference_mode gets the same
    result; what the helper raises is raised on the caller's thread."""
    from qstrat.transport.delta import encoding

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    n = encoding.SPLIT_WORDS * 4 + 64  # bf16: just over the threshold
    with torch.inference_mode():
        old = torch.randn(n).bfloat16()
        new = old.clone()
        new[::1001] += 1
        idx, nb, ob = changed_values(new, old)
    assert torch.equal(idx, _brute(new, old)) and idx.numel() == len(range(0, n, 1001))
    real = encoding._changed_words

    def fail_later_half(a, *args):
        if a.storage_offset():  # the helper's half
            raise MemoryError("helper out of memory")
        return real(a, *args)

    monkeypatch.setattr(encoding, "_changed_words", fail_later_half)
    with pytest.raises(MemoryError, match="helper out of memory"):
        changed_values(new, old)
