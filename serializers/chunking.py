"""Cache-sized chunks and reusable scratch for the torch paths of the formats.

The torch paths (the eager reference and the fast path) quantize a weight ``[E, N, K]`` in
chunks ``[e, r, K]``: whole experts when an expert is small (a grouped slab of small experts is
one chunk of several experts, not one call per expert), else bands of rows, a multiple of the
format's row tile. A chunk's fp32 scratch is sized to stay in the CPU's last-level cache, so
each pass over it (abs, scale, cast) reads cache, not DRAM, and no chunk allocates fresh pages:
the fast path reuses one :class:`Scratch` per call.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

#: Last-level cache size assumed when the OS does not report one (bytes).
DEFAULT_LLC_BYTES = 32 << 20
#: Bytes of fp32 scratch per element of a chunk in the fast paths (the fp32 copy and |x|).
SCRATCH_BYTES_PER_ELEMENT = 8
#: Share of the last-level cache a chunk's scratch may use: the rest holds the chunk's input,
#: its outputs and other processes' data. Measured best on a 2-core EPYC (32 MiB L3, see
#: docs/performance.md): chunks of 0.5-1 M elements; smaller ones pay per-op overhead
#: (~2-5 us per torch call), larger ones spill to DRAM.
LLC_SHARE = 4
#: Smallest chunk (elements).
MIN_CHUNK_ELEMENTS = 1 << 16


@functools.cache
def llc_bytes() -> int:
    """Size of the largest CPU cache level of cpu0 (Linux sysfs), else :data:`DEFAULT_LLC_BYTES`."""
    best = 0
    try:
        for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            best = max(best, int(size.rstrip("KM")) * mult)
    except (OSError, ValueError):
        best = 0
    return best or DEFAULT_LLC_BYTES


def cache_chunk_elements() -> int:
    """Default chunk size (weight elements): the fp32 scratch of one chunk is 1/:data:`LLC_SHARE`
    of the last-level cache (32 MiB L3: 1,048,576 elements, 8 MiB of scratch).

    Environment override: ``QSTRAT_CHUNK_ELEMENTS`` (an integer > 0).
    """
    env = os.environ.get("QSTRAT_CHUNK_ELEMENTS")
    if env:
        return max(1, int(env))
    return max(MIN_CHUNK_ELEMENTS, llc_bytes() // LLC_SHARE // SCRATCH_BYTES_PER_ELEMENT)


def chunks(shape: tuple[int, int, int], chunk_elements: int,
           row_tile: int) -> Iterator[tuple[int, int, int, int]]:
    """Split ``[E, N, K]`` into ``(e0, e1, r0, r1)`` chunks of about ``chunk_elements`` elements.

    Whole experts when one expert fits (``e1 - e0 = chunk_elements // (N * K)``), else one
    expert at a time in bands of rows, a multiple of ``row_tile`` (at least one tile, so a band
    may exceed ``chunk_elements`` for very wide matrices); the last band may be ragged.
    """
    e, n, k = shape
    per_expert = n * k
    if per_expert <= chunk_elements:
        step = chunk_elements // per_expert
        for e0 in range(0, e, step):
            yield e0, min(e0 + step, e), 0, n
        return
    rows = max(row_tile, chunk_elements // k // row_tile * row_tile)
    for e0 in range(e):
        for r0 in range(0, n, rows):
            yield e0, e0 + 1, r0, min(r0 + rows, n)


class Scratch:
    """Named reusable buffers for one quantize call: a chunk's temporaries land in memory the
    previous chunk already touched (no page faults, no allocator traffic, cache-warm)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialized contiguous tensor of ``shape`` and ``dtype``, reusing buffer ``name``."""
        n = math.prod(shape)
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=self.device)
            self._buffers[(name, dtype)] = buf
        return buf[:n].view(shape)


def block_max(a: torch.Tensor) -> torch.Tensor:
    """Max over the last dim (a block of B = 16, 32, ... elements) with the fastest torch CPU op.

    Same values as ``a.amax(-1)`` (max is exact in any order; NaN propagates through
    ``max_pool1d`` and ``amax`` alike, tests/test_fast_path.py), but torch's inner-dim reduction
    is slow for 16-element rows: measured on one EPYC core, 1 M fp32 elements, ``amax(-1)`` over
    16-blocks 0.9 ms, pairwise ``torch.maximum`` halving 0.42 ms, ``max_pool1d`` over whole rows
    0.27 ms; over 32-blocks ``amax(-1)`` is fastest (0.15 ms vs 0.27 ms), over 128-blocks 0.07 ms.

    Args: a: float tensor [..., m, B], contiguous in its last two dims (a chunk of rows cut into
        blocks). Returns: tensor [..., m] of a's dtype.
    """
    width = a.shape[-1]
    if width >= 32 or a.dim() < 2 or not a.is_contiguous():
        return a.amax(-1)
    lead, m = a.shape[:-2], a.shape[-2]
    rows = a.reshape(1, -1, m * width)
    return F.max_pool1d(rows, width, width).reshape(*lead, m)


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def chunk_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads whose torch ops run single-threaded.

    The fast paths spread chunks over these threads (torch releases the GIL inside ops) instead
    of letting every op fork and join torch's OpenMP team: on 2 cores a quantize call is ~100-600
    small ops, and each fork/join waits for the slowest thread, so one descheduled thread on a
    busy machine stalls every op (measured: 10-30x slower at load 10). Here a descheduled worker
    delays only its chunk, and the other takes the next one.

    Each worker initializes torch's per-thread settings, then sets its own intra-op threads to
    1 (``torch.set_num_threads`` also sets the process default and the shared thread pool's size
    in passing; both are restored from the calling thread before this returns).
    """
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL[0] == workers:
            return _POOL[1]
        restore = torch.get_num_threads()
        started = threading.Barrier(workers + 1)

        def init() -> None:
            torch.get_num_threads()  # torch's lazy per-thread init first, or it would undo the next line
            torch.set_num_threads(1)
            started.wait()

        pool = ThreadPoolExecutor(workers, thread_name_prefix="qstrat-chunks", initializer=init)
        for _ in range(workers):
            pool.submit(lambda: None)  # starts one worker per submit while all wait in init
        started.wait()
        torch.set_num_threads(restore)
        if _POOL is not None:
            _POOL[1].shutdown(wait=False)
        _POOL = (workers, pool)
        return pool
