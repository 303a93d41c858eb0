"""Cache-sized chunks and reusable scratch for the torch paths of the formats.

The torch paths (the eager reference and the fast path) quantize a weight ``[E, N, K]`` in
chunks ``[e, r, K]``: whole experts when an expert is small (a grouped slab of small experts is
one chunk of several experts, not one call per expert), else bands of rows, a multiple of the
format's row tile. A chunk (default :data:`DEFAULT_CHUNK_ELEMENTS`, a measured size, not one
derived from the cache size the OS reports) keeps its fp32 scratch in cache, so each pass over
it (abs, scale, cast) reads cache, not DRAM, and no chunk allocates fresh pages: the fast path
reuses one :class:`Scratch` per worker.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from qstrat.errors import ConfigError

#: Default chunk size (weight elements), whatever the machine reports about its caches.
#: Chosen from measurement on both CPU kinds, not derived from the last-level cache size the OS
#: reports (a VM may report its host's): docs/performance.md, "Chunk size";
#: ``scripts/chunk_sweep.py`` reproduces the sweep.
DEFAULT_CHUNK_ELEMENTS = 1 << 20
#: Environment variable overriding :data:`DEFAULT_CHUNK_ELEMENTS` (an integer >= 1).
CHUNK_ENV = "QSTRAT_CHUNK_ELEMENTS"


@dataclass(frozen=True)
class ChunkSetting:
    """The chunk size in force and where it came from: ``"env"`` (:data:`CHUNK_ENV`) or
    ``"default"`` (:data:`DEFAULT_CHUNK_ELEMENTS`). A serializer's ``chunk_elements`` option,
    where set, overrides both for that serializer."""

    elements: int
    source: str


def chunk_setting() -> ChunkSetting:
    """The default chunk size of the torch paths: :data:`CHUNK_ENV` if set, else
    :data:`DEFAULT_CHUNK_ELEMENTS`. Read on every call (the variable may change at run time).

    Raises: qstrat.errors.ConfigError (a ValueError) naming :data:`CHUNK_ENV` when it is set
    but not an integer >= 1.
    """
    env = os.environ.get(CHUNK_ENV, "").strip()
    if not env:
        return ChunkSetting(DEFAULT_CHUNK_ELEMENTS, "default")
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{CHUNK_ENV}={env!r}: expected an integer >= 1 (weight elements per chunk)")
    return ChunkSetting(value, "env")


def cache_chunk_elements() -> int:
    """Default chunk size in weight elements (:func:`chunk_setting`'s ``elements``).

    Raises: qstrat.errors.ConfigError for a malformed :data:`CHUNK_ENV`.
    """
    return chunk_setting().elements


def chunk_workers() -> int:
    """Worker threads the fast paths spread a call's chunks over: ``torch.get_num_threads()``
    (torch sets it from ``OMP_NUM_THREADS`` or the CPUs this process may run on; change it with
    ``torch.set_num_threads``). One worker runs the chunks on the calling thread."""
    return torch.get_num_threads()


#: Where Linux reports cpu0's caches.
SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


@functools.cache
def reported_llc_bytes(root: Path = SYSFS_CACHE) -> int | None:
    """Size in bytes of the largest data/unified cache under ``root`` (Linux sysfs layout:
    ``index*/type`` and ``index*/size`` such as ``32768K``), None where none is reported. Reported
    only (``qstrat bench``): a VM may report its host's cache (300 MiB seen on a 2-core Intel VM),
    so nothing is sized from it."""
    best = 0
    try:
        for index in root.glob("index*"):
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            best = max(best, int(size.rstrip("KM")) * mult)
    except (OSError, ValueError):
        best = 0
    return best or None


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
    is slow for 16-element rows, where ``max_pool1d`` over whole rows is fastest; from 32-element
    blocks on ``amax(-1)`` is (docs/performance.md, "Why the code does it this way").

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
    busy machine stalls every op (docs/performance.md, "Why the code does it this way"). Here a descheduled worker
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
