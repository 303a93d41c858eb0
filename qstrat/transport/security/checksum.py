"""The per-bucket checksum, computed with tensor ops where the bytes are (no host copy).

Formula (int64 arithmetic, modulo 2**64: exact, the same value in any order and on any device):

* the payload's ``n`` bytes, zero-padded to a multiple of ``8 * ROW_WORDS``, viewed as int64
  words ``W[r, j]`` (little-endian, rows of ``ROW_WORDS`` words; the < 32 KiB tail copied);
* column keys ``c1, c2`` (``ROW_WORDS`` odd int64 each) and row keys ``r1, r2`` (one odd int64
  per row) from a CPU ``torch.Generator`` seeded with the seed (the same keys on every device);
* ``h1 = sum_r r1[r] * sum_j c1[j] * W[r, j]`` and ``h2 = sum_j c2[j] * sum_r r2[r] * W[r, j]``
  (two keyed bilinear forms), and the checksum is ``(h1, h2, n)``.

Why this form: matrix-vector products over a zero-copy int64 view, the fastest exact reduction
torch has on CPU (``torch.mv`` on int64), a multiply + sum on CUDA (no integer ``mv`` there: the
same value); both forms along rows (sums modulo 2**64 commute), a block of :data:`_CACHE_ROWS`
rows (1 MiB) at a time, each block read from memory once (figures: docs/performance.md, "Delta rounds: the measurement history", fifth pass);
on CPU, where numba imports, one compiled loop instead (:data:`_row_sums_kernel`: 2x faster, the
same values).
Detection: every word has an odd weight in both forms, so a change confined to one word changes
both; a change whose lowest differing bit is ``t`` goes unnoticed by one form with probability
about ``2**-(64 - t)`` for random keys (high-bit-only changes are the weak case). Accident
detection in rounds WITHOUT a secret; not a MAC: adding 2**63 to two words changes each form by
``2**64 = 0`` whatever the keys. Rounds with a secret seal buckets with the bucket MAC
(:mod:`qstrat.transport.security.nh`, :mod:`qstrat.transport.security.seal`).

Keys from two seeds (``column_seed``: a delta round's digest,
:func:`qstrat.transport.delta.encoding.digest_sealer`): ``c1, c2`` from one, ``r1, r2`` from the
other. With row sums ``s[r] = sum_j c[j] * W[r, j]`` (:func:`row_sums`), ``h = sum_r r[r] * s[r]``
(:func:`from_row_sums`); sums kept for the bytes sent last are brought up to date from the
changed words alone, ``s[r] += c[j] * (new - old)`` (:func:`patch_row_sums`): the same value
as a read of the new bytes.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from qstrat.transport.jit import cpu_kernel

#: Words per row of the int64 view (32 KiB rows).
ROW_WORDS = 4096
_ROW_BYTES = 8 * ROW_WORDS
#: Rows reduced per step on a device without integer ``mv`` (bounds the temporary to 32 MiB).
_ROWS_PER_STEP = 128
#: Rows per block on CPU (1 MiB: the second product of a block reads it from this core's cache).
_CACHE_ROWS = 32


@functools.lru_cache(maxsize=64)
def _keys(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU keys ``(c1, r1, c2, r2)`` for ``seed`` (int64 odd values); c: ROW_WORDS, r: rows."""
    g = torch.Generator().manual_seed(seed & (2**63 - 1))
    low, high = -(2**63), 2**63 - 1

    def draw(n: int) -> torch.Tensor:
        return torch.randint(low, high, (n,), dtype=torch.int64, generator=g) | 1

    c1, c2 = draw(ROW_WORDS), draw(ROW_WORDS)
    return c1, draw(rows), c2, draw(rows)


@functools.lru_cache(maxsize=8)
def _column_keys(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU column keys ``(c1, c2)`` (ROW_WORDS odd int64 each) of a column seed."""
    g = torch.Generator().manual_seed(seed & (2**63 - 1))
    return tuple(torch.randint(-(2**63), 2**63 - 1, (ROW_WORDS,), dtype=torch.int64, generator=g) | 1
                 for _ in range(2))


@functools.lru_cache(maxsize=64)
def _row_keys(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU row keys ``(r1, r2)`` (``rows`` odd int64 each) of a row seed, when the column keys
    have a seed of their own."""
    g = torch.Generator().manual_seed((seed & (2**63 - 1)) ^ 0x5157_5357)  # not c1's draws for an equal seed
    return tuple(torch.randint(-(2**63), 2**63 - 1, (rows,), dtype=torch.int64, generator=g) | 1
                 for _ in range(2))


def _split_keys(seed: int, column_seed: int | None, rows: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(c1, r1, c2, r2)``: all from ``seed`` (``column_seed`` None), else columns from
    ``column_seed`` and rows from ``seed``."""
    if column_seed is None:
        return _keys(seed, rows)
    (c1, c2), (r1, r2) = _column_keys(column_seed), _row_keys(seed, rows)
    return c1, r1, c2, r2


def row_sums(payload: torch.Tensor, column_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row sums ``(s1, s2)`` of ``payload`` under the column keys of ``column_seed``
    (module docstring): int64 [rows] each, ``s[r] = sum_j c[j] * W[r, j]`` modulo 2**64.

    Args: payload: 1-D contiguous uint8 CPU tensor of whole rows (a multiple of
        ``8 * ROW_WORDS`` bytes; a delta stream's regions are whole tiles of that size), its
        storage offset a multiple of 8 bytes.
    Raises: ValueError for another tensor.
    """
    if (payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous()
            or payload.numel() % _ROW_BYTES or payload.storage_offset() % 8):
        raise ValueError(f"row_sums: needs a 1-D contiguous uint8 tensor of whole {_ROW_BYTES}-byte rows at an "
                         f"8-byte offset, got {payload.dtype} {list(payload.shape)}")
    c1, c2 = (k.to(payload.device) for k in _column_keys(column_seed))
    s1, s2 = _row_sums(payload.view(torch.int64).view(-1, ROW_WORDS), c1, c2)
    return s1, s2


def patch_row_sums(sums: tuple[torch.Tensor, torch.Tensor], words: torch.Tensor, change: torch.Tensor,
                   column_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """New row sums after the int64 words at flat indices ``words`` (int64 [m], distinct) changed
    by ``change`` (int64 [m]: new word minus old word, modulo 2**64): ``s[r] + c[j] * change``
    for word ``r * ROW_WORDS + j``. ``sums`` is not changed. Exact: the same values as
    :func:`row_sums` of the new bytes (sums and products modulo 2**64 commute)."""
    c1, c2 = _column_keys(column_seed)
    rows, cols = words // ROW_WORDS, words % ROW_WORDS
    return tuple(s.index_add(0, rows, c.to(s.device).index_select(0, cols) * change) for s, c in zip(sums, (c1, c2)))


def from_row_sums(sums: tuple[torch.Tensor, torch.Tensor], seed: int, n: int) -> tuple[int, int, int]:
    """The checksum ``(h1, h2, n)`` of ``n`` bytes (whole rows) whose row sums under the column
    keys of some ``column_seed`` are ``sums``, with the row keys of ``seed``: what
    :class:`Checksum` ``(seed, n, device, column_seed)`` gives over those bytes."""
    s1, s2 = sums
    r1, r2 = (k.to(s1.device) for k in _row_keys(seed, _rows_for(n)))
    a, b = torch.stack([_dot(s1, r1), _dot(s2, r2)]).tolist()
    return int(a), int(b), n


def _rows_for(n: int) -> int:
    return max(1, -(-n // _ROW_BYTES))


def checksum(payload: torch.Tensor, seed: int = 0) -> tuple[int, int, int]:
    """The keyed checksum ``(h1, h2, n)`` of a contiguous ``uint8`` tensor (module docstring).

    Args:
        payload: 1-D contiguous uint8 tensor on any device; its storage offset a multiple of 8
            bytes (bucket buffers and tensor storages are), else the aligned part is copied.
        seed: selects the keys (0: the public keys of an unauthenticated round).
    Returns: ``(h1, h2, n)``: two signed int64 values and the byte count.
    Raises: ValueError for a tensor that is not 1-D contiguous uint8.
    """
    state = Checksum(seed, payload.numel(), payload.device)
    state.update(payload)
    return state.value()


class Checksum:
    """The checksum of ``n`` bytes fed in consecutive pieces (:meth:`update`), e.g. as they arrive:
    the same value as :func:`checksum` over the whole. Every piece but the last must be a multiple
    of ``8 * ROW_WORDS`` bytes (whole rows). ``column_seed``: the column keys from that seed and
    the row keys from ``seed`` (module docstring; None: all keys from ``seed``).

    Raises: ValueError (from :meth:`update`) for a piece that is not 1-D contiguous uint8, a
        piece after a partial row, or more than ``n`` bytes in all.
    """

    def __init__(self, seed: int, n: int, device: torch.device, column_seed: int | None = None) -> None:
        self.n, self.done, self.device = n, 0, device
        self.c1, self.r1, self.c2, self.r2 = (k.to(device) for k in _split_keys(seed, column_seed, _rows_for(n)))
        self.h1 = torch.zeros((), dtype=torch.int64, device=device)
        self.h2 = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, piece: torch.Tensor) -> None:
        """Add the next ``piece`` of the payload (1-D contiguous uint8 on the device)."""
        if piece.dtype != torch.uint8 or piece.dim() != 1 or not piece.is_contiguous():
            raise ValueError(f"checksum: needs a 1-D contiguous uint8 tensor, got {piece.dtype} "
                             f"{list(piece.shape)}")
        m = piece.numel()
        if self.done % _ROW_BYTES or self.done + m > self.n:
            raise ValueError(f"checksum: piece of {m} bytes at {self.done} of {self.n} (pieces before "
                             f"the last must be whole rows of {_ROW_BYTES} bytes)")
        row0, full = self.done // _ROW_BYTES, m // _ROW_BYTES
        body = piece[:full * _ROW_BYTES]
        if body.storage_offset() % 8:
            body = body.clone()
        if full:
            self._rows(body.view(torch.int64).view(full, ROW_WORDS), row0)
        if m > full * _ROW_BYTES:
            tail = torch.zeros(_ROW_BYTES, dtype=torch.uint8, device=self.device)
            tail[:m - full * _ROW_BYTES] = piece[full * _ROW_BYTES:]
            self._rows(tail.view(torch.int64).view(1, ROW_WORDS), row0 + full)
        self.done += m

    def _rows(self, words: torch.Tensor, row0: int) -> None:
        rows = words.shape[0]
        s1, s2 = _row_sums(words, self.c1, self.c2)
        self.h1 = self.h1 + _dot(s1, self.r1[row0:row0 + rows])
        self.h2 = self.h2 + _dot(s2, self.r2[row0:row0 + rows])

    def value(self) -> tuple[int, int, int]:
        """``(h1, h2, n)`` (module docstring). Raises ValueError before all ``n`` bytes were fed."""
        if self.done != self.n:
            raise ValueError(f"checksum: {self.done} of {self.n} bytes fed")
        a, b = torch.stack([self.h1, self.h2]).tolist()
        return int(a), int(b), self.n


def _integer_mv(device: torch.device) -> bool:
    return device.type == "cpu"


def _row_sums_loop(words, k1, k2, s1, s2):  # pragma: no cover - compiled by numba
    """``s1[r] = sum_j k1[j] * words[r, j]`` and the same with ``k2`` (uint64: sums and
    products wrap modulo 2**64, as int64 in torch), one row of both forms at a time."""
    for r in range(words.shape[0]):
        a, b = np.uint64(0), np.uint64(0)
        for j in range(words.shape[1]):
            w = words[r, j]
            a += k1[j] * w
            b += k2[j] * w
        s1[r], s2[r] = a, b


#: :func:`_row_sums` on CPU in one pass (numba: 8.7 ms for 64 MiB, ``torch.mv`` 18.6 ms;
#: docs/performance.md, "Delta rounds: the measurement history", eighth pass); None without numba.
_row_sums_kernel = cpu_kernel(_row_sums_loop)

#: Whether :func:`_row_sums` uses :data:`_row_sums_kernel` on CPU (tests switch it off to check
#: the torch path on the same bytes).
ROW_KERNEL = _row_sums_kernel is not None


def _row_sums(words: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words @ k1, words @ k2)`` modulo 2**64 (int64[rows] each), reading ``words`` once."""
    if ROW_KERNEL and words.device.type == "cpu" and words.is_contiguous():
        sums = torch.empty(2, words.shape[0], dtype=torch.int64, device=words.device)  # not the default device
        u64 = [t.detach().numpy().view(np.uint64) for t in (words, k1, k2, sums[0], sums[1])]
        _row_sums_kernel(*u64)
        return sums[0], sums[1]
    rows, mv = words.shape[0], _integer_mv(words.device)
    step = _CACHE_ROWS if mv else _ROWS_PER_STEP
    sums = torch.empty(2, rows, dtype=torch.int64, device=words.device)
    for i in range(0, rows, step):
        block = words[i:i + step]
        for keys, out in zip((k1, k2), sums[:, i:i + step]):
            if mv:
                torch.mv(block, keys, out=out)
            else:
                out.copy_((block * keys).sum(1))
    return sums[0], sums[1]


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum()
