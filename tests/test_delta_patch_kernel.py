"""The patch's CPU kernels (qstrat/transport/delta/patch_kernel.py): encode_patch and decode_patch
give byte for byte the torch path's patch, rebuilt bytes and recorded changes on every tile kind
and change density; a hostile patch is refused with the torch path's message and nothing
written; bad changed positions are refused before any byte is read past the region."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cpu_kernels import kernels
from qstrat.transport.delta import encoding as delta, patch_kernel
from qstrat.transport.delta.encoding import TILE, DeltaError, decode_patch, encode_patch

pytestmark = kernels

DENSITIES = [0.0, 1e-5, 1e-3, 0.02, 0.1, 0.3, 1.0]


def region(tiles: int, density: float, seed: int, whole_tile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, base): ``tiles`` tiles of random bytes, ``density`` of new's bytes changed (by a
    nonzero amount), and with ``whole_tile`` every byte of the first tile changed (raw)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (tiles * TILE,), dtype=torch.uint8, generator=g)
    new = base.clone()
    m = int(new.numel() * density)
    if m:
        at = torch.randperm(new.numel(), generator=g)[:m]
        new[at] += torch.randint(1, 256, (m,), dtype=torch.uint8, generator=g)
    if whole_tile:
        new[:TILE] += 1
    return new, base


def both(fn):
    """``fn()`` on the kernel path, then on the torch path."""
    out = []
    for kernel in (True, False):
        patch_kernel.ENABLED = kernel
        try:
            out.append(fn())
        finally:
            patch_kernel.ENABLED = True
    return out


def test_the_kernels_answer_on_cpu_where_numba_is_installed(monkeypatch):
    """numba is a dependency: the kernels, not the torch path, code and apply a CPU patch."""
    assert patch_kernel.ENABLED, "numba did not import: patches are coded on the torch path"
    calls = []
    for name in ("_encode", "_apply"):
        real = getattr(patch_kernel, name)
        monkeypatch.setattr(patch_kernel, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    new, base = region(2, 1e-3, 0, False)
    patch, _ = encode_patch(new, base)
    assert torch.equal(decode_patch(patch, base, new.numel()), new)
    assert calls == ["_encode", "_apply"]


@settings(max_examples=50, deadline=None)
@given(tiles=st.integers(1, 5), density=st.sampled_from(DENSITIES), whole_tile=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_kernels_equal_the_torch_path_byte_for_byte(tiles, density, whole_tile, seed):
    new, base = region(tiles, density, seed, whole_tile)
    (pk, kinds_k), (pt, kinds_t) = both(lambda: encode_patch(new, base))
    assert kinds_k == kinds_t and torch.equal(pk, pt)
    for holds_base in (False, True):
        def rebuild():
            out, changes = base.clone() if holds_base else torch.empty_like(base), []
            return decode_patch(pt, base, new.numel(), out, holds_base=holds_base, changes=changes), changes[0]
        (ok, ck), (ot, ct) = both(rebuild)
        assert torch.equal(ok, new) and torch.equal(ot, new)
        assert torch.equal(ck.positions, ct.positions) and torch.equal(ck.tiles, ct.tiles)


def test_every_tile_kind_in_one_patch_and_the_known_positions_are_used():
    """rle, bitmap and raw tiles side by side; the positions passed in (``changed``) give the
    patch the compare gives."""
    new, base = region(3, 0.0, 1, False)
    new[5] += 1  # rle
    new[TILE:TILE + 6000:2] += 1  # bitmap (3000 changes: 4096 + 3000 bytes, under 3 bytes each)
    new[2 * TILE:] += 1  # raw
    changed = torch.nonzero(new != base).reshape(-1)
    (pk, kinds), (pt, _) = both(lambda: encode_patch(new, base, changed))
    assert kinds == {"rle": 1, "bitmap": 1, "raw": 1} and torch.equal(pk, pt)
    assert torch.equal(decode_patch(pk, base, new.numel()), new)


@pytest.mark.parametrize("bad", ["unsorted", "repeated", "past_end", "negative"])
def test_changed_positions_out_of_order_or_range_are_refused(bad):
    new, base = region(2, 1e-3, 2, False)
    changed = torch.nonzero(new != base).reshape(-1)
    changed = {"unsorted": changed.flip(0), "repeated": torch.cat([changed[:1], changed]),
               "past_end": torch.cat([changed, torch.tensor([new.numel()])]),
               "negative": torch.cat([torch.tensor([-1]), changed])}[bad]
    with pytest.raises(ValueError, match="strictly increasing inside the 65536 bytes"):
        encode_patch(new, base, changed)


def _rle_patch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """A one-tile rle patch of two changes, and where its first run-length token sits."""
    new, base = region(1, 0.0, 3, False)
    new[[10, 20]] += 1
    patch, kinds = encode_patch(new, base)
    assert kinds == {"rle": 1}
    return patch, base, 32 + 5  # header, then one kind byte and one int32 count


def refused(patch: torch.Tensor, base: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
    """Each path's DeltaError message for ``patch`` applied to a one-tile ``base``, and the
    buffer it was applied into (kernel path first)."""
    errors, outs = [], []
    for kernel in (True, False):
        patch_kernel.ENABLED = kernel
        try:
            out = base.clone()
            with pytest.raises(DeltaError) as err:
                decode_patch(patch, base, TILE, out, holds_base=True)
            errors.append(str(err.value))
            outs.append(out)
        finally:
            patch_kernel.ENABLED = True
    return errors, outs


def test_a_run_past_its_tile_is_refused_as_on_the_torch_path_and_nothing_written():
    patch, base, at = _rle_patch()
    patch[at + 2:at + 4] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)  # second run: 32767 more
    errors, outs = refused(patch, base)
    assert errors[0] == errors[1] and "run lengths past the end of their tile" in errors[0]
    assert torch.equal(outs[0], base)  # the kernel checks every run before it writes


def test_bitmaps_marking_another_count_are_refused_as_on_the_torch_path():
    new, base = region(1, 0.0, 4, False)
    new[:6000:2] += 1
    patch, kinds = encode_patch(new, base)
    assert kinds == {"bitmap": 1}
    bitmaps = 32 + 5  # the bitmap follows the tile table (no rle tokens or values)
    patch[bitmaps + 6000 // 8 + 3] = 0x01  # one more bit marked, past the changes
    errors, outs = refused(patch, base)
    assert errors[0] == errors[1] and "has bitmaps marking 3001 bytes, its counts say 3000" in errors[0]
    assert torch.equal(outs[0], base)


def test_the_kernels_allocate_on_the_cpu_whatever_the_default_device():
    new, base = region(1, 1e-3, 5, False)
    with torch.device("meta"):
        patch, _ = encode_patch(new, base)
        out = decode_patch(patch, base, new.numel(), base.clone(), holds_base=True, changes=[])
    assert torch.equal(out, new)
