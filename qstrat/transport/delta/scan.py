"""The delta compare's CPU kernel: one pass over two int64 word views that finds the changed
words, writes out their changed elements (flat index, new bits, old bits) and, with ``update``,
copies each changed word into the old side while both are in this core's cache.

The torch path (:func:`qstrat.transport.delta.encoding._changed_words`) needs about ten passes
for the same answer - the word compare (a bool per word), a scan of its flags eight at a time,
a gather of the hot groups, a scan of those, gathers of the changed words on both sides, an
element compare and a last scan - each over a tensor of up to a few hundred thousand entries
at 0.5-3 % of the words changed. This kernel reads each side once and writes only what changed:
on 120 MiB of bf16 per side at 0.7 % of the elements changed (a requantizer's round at lr 1e-6),
38 ms on one core against 66 ms for the torch path on one core (docs/performance.md, "Delta
rounds: the measurement history", eighth pass). It is compiled by numba (``nogil``: the two
threads of :func:`~qstrat.transport.delta.encoding._split` run it at once) on first use per
element width and cached on disk (numba's cache: the package's ``__pycache__`` or the user's
cache folder).

:data:`ENABLED` is False where numba does not import (the torch path then answers alone); tests
set it to compare the two paths on the same inputs. Compiled by :func:`qstrat.transport.jit.cpu_kernel`.
"""
from __future__ import annotations

import torch

from qstrat.transport.jit import cpu_kernel


def _scan_loop(a, b, al, bl, per, start, update, idx, new, old):  # pragma: no cover - compiled by numba
    """From word ``start`` on: for each word ``i`` where ``a[i] != b[i]``, every element
    ``e`` of it (``i * per <= e < (i + 1) * per``) with ``al[e] != bl[e]`` is written to
    ``idx``/``new``/``old`` in order, and with ``update`` ``b[i] = a[i]``. Stops before a
    changed word whose elements might not fit the outputs. Returns (the word it stopped at, or
    the word count when done; elements written)."""
    n, cap, k, i = a.shape[0], idx.shape[0], 0, start
    while i < n:
        if a[i] != b[i]:
            if k + per > cap:
                return i, k
            e = i * per
            for j in range(per):
                if al[e + j] != bl[e + j]:
                    idx[k] = e + j
                    new[k] = al[e + j]
                    old[k] = bl[e + j]
                    k += 1
            if update:
                b[i] = a[i]
        i += 1
    return n, k


_scan = cpu_kernel(_scan_loop)

#: Whether :func:`changed_words` is used (numba imported); tests switch it off to check the
#: torch path on the same inputs.
ENABLED = _scan is not None

#: First output size, in elements, as a fraction of the input's (grown by doubling when a
#: denser change fills it; a requantizer's round at lr 1e-6 changes 0.2-3 % of its elements).
FIRST_FRACTION = 1 / 32


def changed_words(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, per: int, update: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`qstrat.transport.delta.encoding.changed_values` of two int64 word views in one pass.

    Args:
        a, b: 1-D contiguous int64 CPU tensors of the same length (the new and old sides'
            words), not partly overlapping (the caller checks).
        dtype: the integer dtype of the elements (:func:`~qstrat.transport.delta.encoding.bits_view`:
            uint8, int16, int32 or int64), ``per`` of them in each word (8, 4, 2, 1).
        update: write each changed word of ``a`` into ``b`` (``b`` then equals ``a``; ``b``'s
            version counter bumped, as torch's in-place writes do, for autograd's checks).

    Returns: (sorted flat element indices, int64 [m]; ``a``'s and ``b``'s elements there, each
    [m] of ``dtype``; the values ``b`` held before ``update`` wrote it). The outputs are views of
    buffers sized for the change found (grown by doubling from :data:`FIRST_FRACTION` of the
    elements), on the CPU whatever torch's default device.

    Raises: ValueError for ``a`` and ``b`` of different lengths (the loop has no bounds checks).
    """
    if a.numel() != b.numel():
        raise ValueError(f"changed_words: a has {a.numel()} words, b {b.numel()} (the new and old sides' int64 "
                         f"views must have the same length)")
    n = a.numel() * per
    a_np, b_np = a.detach().numpy(), b.detach().numpy()
    al, bl = a.detach().view(dtype).numpy(), b.detach().view(dtype).numpy()
    cap, start, got = max(1024, int(n * FIRST_FRACTION)), 0, []
    while True:
        idx = torch.empty(cap, dtype=torch.int64, device="cpu")
        new, old = torch.empty(cap, dtype=dtype, device="cpu"), torch.empty(cap, dtype=dtype, device="cpu")
        start, k = _scan(a_np, b_np, al, bl, per, start, update, idx.numpy(), new.numpy(), old.numpy())
        got.append((idx[:k], new[:k], old[:k]))
        if start >= a.numel():
            break
        cap = min(2 * cap, n)
    if update:  # written through NumPy, unseen by torch: a graph that saved b must refuse backward
        torch.autograd.graph.increment_version(b)
    if len(got) == 1:
        return got[0]
    return tuple(torch.cat(parts) for parts in zip(*got))
