"""Attacks on the patch's CPU kernels (qstrat/transport/delta/patch_kernel.py, compiled without
bounds checks) through encode_patch and decode_patch, with the torch path
(``patch_kernel.ENABLED = False``) as the oracle.

Attacked: arguments the kernels index without checking - a region that is not whole tiles, a
base shorter or longer than the region, int16 bytes, 2-D ``changed`` (encode), a 2-D ``out`` of
the region's bytes (decode: a segfault) - each run in a subprocess so that a kernel reading or
writing past an array cannot take the test process down; a peer's patch with a bitmap tile
whose count says 0 but whose bitmap marks bytes (refused by the kernel only when the patch also
has rle changes, never by the torch path); and the torch path (no numba) under a meta default
device, where the kernel path works.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from cpu_kernels import kernels
from qstrat.transport.delta import patch_kernel
from qstrat.transport.delta.encoding import _HEAD, TILE, DeltaError, decode_patch, encode_patch

pytestmark = kernels


def run_both(snippet: str) -> list[str]:
    """``snippet`` (defines ``case()``, returning a string) on the kernel path, then on the torch
    path, in a fresh interpreter: the two lines it printed (``ok <value>`` or ``<error type>:
    <message>``). A crash (a kernel writing past an array) fails here with its exit status."""
    code = textwrap.dedent("""
        import torch
        from qstrat.transport.delta import patch_kernel
        from qstrat.transport.delta.encoding import TILE, encode_patch, decode_patch
        g = torch.Generator().manual_seed(0)
    """) + textwrap.dedent(snippet) + textwrap.dedent("""
        assert patch_kernel.ENABLED
        for kernel in (True, False):
            patch_kernel.ENABLED = kernel
            try:
                print("ok", case())
            except Exception as exc:
                print(f"{type(exc).__name__}: {exc}")
    """)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, f"exit status {got.returncode}: {got.stderr[-2000:]}"
    return got.stdout.splitlines()


#: Regions the unchecked loops mis-indexed: (how ``base`` is made, the changed element, its
#: dtype and length as refused). A region of TILE + 100 bytes: the per-tile counts hold
#: n // TILE = 1 entry and a change at TILE + 50 was counted into entry 1 (a write past the
#: array), a 37-byte patch came back; 100 bytes: no tile at all; int16 (1.5 tiles of elements):
#: counted past the one-entry table and coded truncated to bytes. The torch path raised view
#: errors for each.
BAD_REGIONS = {
    "partial tile": ("torch.randint(0, 256, (TILE + 100,), dtype=torch.uint8, generator=g)", "TILE + 50",
                     "torch.uint8 [32868]"),
    "shorter than a tile": ("torch.randint(0, 256, (100,), dtype=torch.uint8, generator=g)", "5",
                            "torch.uint8 [100]"),
    "int16": ("torch.randint(0, 256, (3 * TILE,), dtype=torch.uint8, generator=g).view(torch.int16)", "TILE + 10",
              "torch.int16 [49152]"),
}


@pytest.mark.parametrize("case", list(BAD_REGIONS))
def test_a_region_not_of_whole_uint8_tiles_is_refused_before_the_kernel_counts(case):
    make, at, seen = BAD_REGIONS[case]
    lines = run_both(f"""
        base = {make}
        new = base.clone()
        new[{at}] += 1
        def case():
            return encode_patch(new, base)[1]
    """)
    want = ("ValueError: encode_patch: new and base must be 1-D uint8 of the same whole number of 32768-byte "
            f"tiles, not {seen} and {seen}")
    assert lines == [want, want]


@pytest.mark.parametrize("base_tiles", [1, 3])
def test_a_base_of_another_length_with_known_changes_is_refused(base_tiles):
    """With ``changed`` given nothing compared the lengths: the kernel read a one-tile base's
    bytes past its end to build tile 1's bitmap (or ignored a longer base's tail)."""
    lines = run_both(f"""
        new = torch.randint(0, 256, (2 * TILE,), dtype=torch.uint8, generator=g)
        base = torch.cat([new, new])[:{base_tiles} * TILE].clone()
        new[TILE:TILE + 8000:2] += 1
        changed = torch.arange(TILE, TILE + 8000, 2)
        def case():
            return encode_patch(new, base, changed)[1]
    """)
    want = ("ValueError: encode_patch: new and base must be 1-D uint8 of the same whole number of 32768-byte "
            f"tiles, not torch.uint8 [65536] and torch.uint8 [{base_tiles * TILE}]")
    assert lines == [want, want]


def test_changed_positions_of_two_dimensions_are_refused_as_one_error():
    """``torch.nonzero(new != base)`` without the reshape: numba's TypingError on the kernel
    path, torch's RuntimeError on the other."""
    lines = run_both("""
        base = torch.randint(0, 256, (TILE,), dtype=torch.uint8, generator=g)
        new = base.clone()
        new[[3, 9]] += 1
        def case():
            return encode_patch(new, base, torch.nonzero(new != base))[1]
    """)
    want = "ValueError: encode_patch: changed must be 1-D int64 or int32 positions, not torch.int64 [2, 1]"
    assert lines == [want, want]


def test_an_out_of_two_dimensions_is_refused_before_the_kernel_writes_rows():
    """``out`` of the region's bytes as [tiles, TILE]: the kernel's ``out[position] = value``
    wrote whole rows at row indices up to n (the process died with SIGSEGV); the torch path
    raised IndexError."""
    lines = run_both("""
        base = torch.randint(0, 256, (3 * TILE,), dtype=torch.uint8, generator=g)
        new = base.clone()
        new[5] += 1
        new[TILE:TILE + 6000:2] += 1
        new[2 * TILE:] += 1
        patch, _ = encode_patch(new, base)
        def case():
            out = base.clone().view(3, TILE)
            decode_patch(patch, base, new.numel(), out, holds_base=True)
            return torch.equal(out.view(-1), base)
    """)
    want = "ValueError: decode_patch: out must be 1-D uint8 of the region's 98304 bytes, not torch.uint8 [3, 32768]"
    assert lines == [want, want]


def _bitmap_marks_with_zero_count(with_rle: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(patch, base, new): two tiles, tile 0 rle (one change, or none), tile 1 a bitmap tile
    whose count says 0 while its bitmap's last bit marks byte 2 * TILE - 1 (no value for it)."""
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, 256, (2 * TILE,), dtype=torch.uint8, generator=g)
    new = base.clone()
    if with_rle:
        new[5] += 1
    patch, kinds = encode_patch(new, base)
    assert kinds == {"rle": 2}
    patch[_HEAD + 1] = 1  # tile 1: bitmap, count 0
    bitmap = torch.zeros(TILE // 8, dtype=torch.uint8)
    bitmap[-1] = 0x80
    return torch.cat([patch, bitmap]), base, new


@pytest.mark.parametrize("with_rle", [True, False])
def test_a_bitmap_marking_bytes_its_count_of_0_does_not_hold_is_refused_on_both_paths(with_rle):
    """The kernel counted the bits only when the patch had rle changes or bitmap counts (so it
    refused this patch with an rle change and took it without); the torch path never looked at
    a bitmap whose counts were 0 and took both. Now both refuse both, nothing written."""
    patch, base, new = _bitmap_marks_with_zero_count(with_rle)
    errors, outs = [], []
    for kernel in (True, False):
        patch_kernel.ENABLED = kernel
        try:
            out, changes = base.clone(), []
            with pytest.raises(DeltaError) as err:
                decode_patch(patch, base, 2 * TILE, out, holds_base=True, changes=changes)
            errors.append(str(err.value))
            outs.append(out)
            assert changes == []
        finally:
            patch_kernel.ENABLED = True
    assert errors == ["the delta patch has bitmaps marking 1 bytes, its counts say 0"] * 2
    assert torch.equal(outs[0], base)


def test_a_bitmap_tile_of_count_0_and_no_bit_set_is_still_taken_on_both_paths():
    """The check above does not refuse a bitmap tile that marks nothing (a legal, if wasteful,
    encoding): the same rebuilt bytes and Changes on both paths."""
    patch, base, new = _bitmap_marks_with_zero_count(True)
    patch[-1] = 0
    got = []
    for kernel in (True, False):
        patch_kernel.ENABLED = kernel
        try:
            changes = []
            got.append((decode_patch(patch, base, 2 * TILE, changes=changes), changes[0]))
        finally:
            patch_kernel.ENABLED = True
    for out, changes in got:
        assert torch.equal(out, new)
        assert changes.positions.tolist() == [5] and changes.tiles.tolist() == [1]


def test_the_torch_path_codes_and_applies_under_a_meta_default_device():
    """Without numba (the torch path) a patch with bitmap tiles, and a whole round (no base),
    failed under ``torch.device("meta")`` (tensors made on the default device beside CPU ones)
    while the kernel path worked: both now give the same patch and bytes on the CPU."""
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (3 * TILE,), dtype=torch.uint8, generator=g)
    new = base.clone()
    new[5] += 1
    new[TILE:TILE + 6000:2] += 1
    new[2 * TILE:] += 1
    want, kinds = encode_patch(new, base)
    assert kinds == {"rle": 1, "bitmap": 1, "raw": 1}
    whole, _ = encode_patch(new, None)
    for kernel in (True, False):
        patch_kernel.ENABLED = kernel
        try:
            with torch.device("meta"):
                patch, _ = encode_patch(new, base)
                out = decode_patch(patch, base, new.numel(), changes=[])
                full, _ = encode_patch(new, None)
                rebuilt = decode_patch(full, None, new.numel())
        finally:
            patch_kernel.ENABLED = True
        assert patch.device.type == out.device.type == full.device.type == rebuilt.device.type == "cpu"
        assert torch.equal(patch, want) and torch.equal(out, new)
        assert torch.equal(full, whole) and torch.equal(rebuilt, new)


@pytest.mark.parametrize("raw_tile", [False, True])
@pytest.mark.parametrize("kernel", [True, False])
def test_an_inference_out_written_outside_inference_mode_is_refused_as_torch_refuses_it(kernel, raw_tile):
    """The kernel writes through NumPy, which torch's inference-tensor check does not see: such
    an ``out`` goes the torch path, so it is refused with torch's own error on both paths (not
    written by the kernel and accepted, rle only, or refused only at the raw tiles)."""
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, 256, (2 * TILE,), dtype=torch.uint8, generator=g)
    new = base.clone()
    new[[3, 40]] += 1
    if raw_tile:
        new[TILE:] += 1
    patch, _ = encode_patch(new, base)
    with torch.inference_mode():
        out = base.clone()
    patch_kernel.ENABLED = kernel
    try:
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            decode_patch(patch, base, new.numel(), out, holds_base=True)
        with torch.inference_mode():  # inside inference mode the same tensor is written, exactly
            out.copy_(base)
            assert torch.equal(decode_patch(patch, base, new.numel(), out, holds_base=True), new)
    finally:
        patch_kernel.ENABLED = True
