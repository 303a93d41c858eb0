"""The patch's CPU kernels: a bucket's patch coded and applied in one pass over its changes.

:func:`~qstrat.transport.delta.encoding.encode_patch` and
:func:`~qstrat.transport.delta.encoding.decode_patch` in torch ops cost about 0.55 ms to code
and 0.29 ms to apply a 4 MiB bucket at lr 1e-6 (0.2 % of the bytes changed; applied into a
buffer that holds the base, as a receiver does), nearly all of it the fixed cost of some
thirty small tensor ops (counts, kinds, gaps, bit unpacking, gathers, scatters). A round
pays it once per bucket on the sender and once per bucket on every receiver. These loops do
the same work, byte for byte the same patch and the same rebuilt bytes, in one pass over the
changed positions (and each bitmap tile's bytes): 0.10-0.11 and 0.12-0.14 ms (docs/performance.md,
"Delta rounds: the measurement history", ninth pass): :func:`encode_tiles` after the tile table is
chosen, :func:`apply_tiles` after the patch's header and sizes are checked. The torch path stays
the oracle and the path for processes without numba (:data:`ENABLED`), and tests compare them.

:func:`apply_tiles` reads a peer's patch: every rle run length and the bitmaps' bit count are
checked before the first byte is written (the loop itself has no bounds checks; the sizes it
reads are checked by the caller, :func:`~qstrat.transport.delta.encoding.decode_patch`).
Compiled by :func:`qstrat.transport.jit.cpu_kernel`.
"""
from __future__ import annotations

import numpy as np
import torch

from qstrat.transport.jit import cpu_kernel


def _count_loop(pos, n, tile, counts):  # pragma: no cover - compiled by numba
    """``counts[t]`` += the positions in tile ``t``; False (counts partly filled) when ``pos``
    is not strictly increasing inside ``[0, n)``."""
    prev = -1
    for i in range(pos.shape[0]):
        p = pos[i]
        if p <= prev or p >= n:
            return False
        counts[p // tile] += 1
        prev = p
    return True


def _encode_loop(new, base, pos, kinds, counts, tile, out, at_tokens, at_rle, at_bitmaps, at_bm_values,
                 at_raw):  # pragma: no cover - compiled by numba
    """Write the tiles' bodies into ``out`` at the section offsets given (layout: the module
    docstring of :mod:`qstrat.transport.delta.encoding`)."""
    tok, val, bm, bmv, raw = at_tokens, at_rle, at_bitmaps, at_bm_values, at_raw
    i = 0
    for t in range(kinds.shape[0]):
        c, lo = counts[t], t * tile
        if kinds[t] == 0:  # rle: per change the unchanged bytes before it in the tile (uint16 LE)
            prev = lo - 1
            for j in range(i, i + c):
                p = pos[j]
                gap = p - prev - 1
                out[tok] = gap & 0xFF
                out[tok + 1] = (gap >> 8) & 0xFF
                tok += 2
                out[val] = new[p]
                val += 1
                prev = p
        elif kinds[t] == 1:  # bitmap: bit s of byte q for tile byte 8 q + s, then the changed values
            for q in range(tile // 8):
                byte, at = 0, lo + 8 * q
                for s in range(8):
                    if new[at + s] != base[at + s]:
                        byte |= 1 << s
                out[bm] = byte
                bm += 1
            for j in range(i, i + c):
                out[bmv] = new[pos[j]]
                bmv += 1
        else:  # raw
            for q in range(tile):
                out[raw + q] = new[lo + q]
            raw += tile
        i += c


def _apply_loop(kinds, counts, tokens, rle_values, bitmaps, bm_values, tile, out, moved
                ):  # pragma: no cover - compiled by numba
    """Rebuild the rle and bitmap tiles into ``out``; ``moved`` gets the rle positions. Returns
    (0, bits set), (1, 0) for a run past its tile's end, or (2, bits set) when the bitmaps mark
    another number of bytes than ``bm_values`` holds: on 1 or 2 nothing was written."""
    j = 0
    for t in range(kinds.shape[0]):
        if kinds[t] == 0:
            prev = -1
            for _ in range(counts[t]):
                prev += (tokens[2 * j] | (np.int64(tokens[2 * j + 1]) << 8)) + 1
                if prev >= tile:
                    return 1, 0
                moved[j] = t * tile + prev
                j += 1
    marked = 0
    for b in range(bitmaps.shape[0]):
        v = bitmaps[b]
        while v:
            v &= v - 1
            marked += 1
    if marked != bm_values.shape[0]:
        return 2, marked
    for q in range(j):
        out[moved[q]] = rle_values[q]
    bm, v = 0, 0
    for t in range(kinds.shape[0]):
        if kinds[t] == 1:
            lo = t * tile
            for q in range(tile // 8):
                byte = bitmaps[bm]
                bm += 1
                s = 0
                while byte:
                    if byte & 1:
                        out[lo + 8 * q + s] = bm_values[v]
                        v += 1
                    byte >>= 1
                    s += 1
    return 0, marked


_count = cpu_kernel(_count_loop)
_encode = cpu_kernel(_encode_loop)
_apply = cpu_kernel(_apply_loop)

#: Whether :func:`encode_tiles` and :func:`apply_tiles` run (numba imported); tests switch it off
#: to check the torch path on the same inputs.
ENABLED = _apply is not None


def tile_counts(pos: torch.Tensor, n: int, tile: int) -> np.ndarray | None:
    """Changed positions per tile (int64 [n // tile]) of ``pos`` (sorted int64 CPU positions in
    a region of ``n`` bytes, whole tiles); None when ``pos`` is not strictly increasing inside
    ``[0, n)``."""
    counts = np.zeros(n // tile, dtype=np.int64)
    return counts if _count(pos.numpy(), n, tile, counts) else None


def encode_tiles(new: torch.Tensor, base: torch.Tensor, pos: torch.Tensor, kinds: np.ndarray, counts: np.ndarray,
                 tile: int, out: np.ndarray, starts: list[int]) -> None:
    """Write the patch's bodies - rle tokens and values, bitmaps and their values, raw tiles,
    each section in tile order - into ``out`` (uint8), each section from its offset in ``starts``.

    Args: new, base: the region's bytes now and in the base (1-D uint8 CPU, whole tiles);
        pos: the sorted positions where they differ (int64, all of them, checked by
        :func:`tile_counts`); kinds: uint8 per tile (rle 0, bitmap 1, raw 2); counts: int64
        per tile (:func:`tile_counts`); out: room for every section; starts: the five sections'
        offsets in ``out`` (from the sizes :func:`~qstrat.transport.delta.encoding.decode_patch`
        checks, ``encoding._section_sizes``).
    """
    _encode(new.numpy(), base.numpy(), pos.numpy(), kinds, counts, tile, out, *starts)


def apply_tiles(kinds: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor, rle_values: torch.Tensor,
                bitmaps: torch.Tensor, bm_values: torch.Tensor, tile: int, out: torch.Tensor
                ) -> tuple[int, torch.Tensor | int]:
    """Rebuild a patch's rle and bitmap tiles into ``out`` (1-D uint8 CPU, the region: the base's
    bytes there already).

    Args: kinds, counts: the tile table (int64 [tiles] each; kinds in 0..2, counts in 0..tile,
        checked by the caller); tokens: uint8 [2 * the rle tiles' changes] (uint16 LE run
        lengths); rle_values: uint8 [those changes]; bitmaps: uint8 [bitmap tiles * tile / 8];
        bm_values: uint8, one per bit set (checked here).

    Returns: (0, the rle positions written: int64, in order); (1, 0) when a run ends past its
    tile; (2, the bytes the bitmaps mark) when that is not the number ``bm_values`` holds (on
    1 and 2 nothing was written).
    """
    moved = torch.empty(rle_values.numel(), dtype=torch.int64, device="cpu")
    status, marked = _apply(kinds.numpy(), counts.numpy(), tokens.numpy(), rle_values.numpy(), bitmaps.numpy(),
                            bm_values.numpy(), tile, out.numpy(), moved.numpy())
    return (0, moved) if status == 0 else (int(status), int(marked))
