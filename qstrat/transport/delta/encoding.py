"""Delta rounds: send only the quantized bytes that changed since the round the engine holds.

A delta round (``RefitSender(mode="delta")``, docs/transport.md "Delta rounds") is an atomic round
of the TARGET wire manifest (the full round's, which the engine checks exactly as in a full
round) whose buckets travel as PATCHES (transport protocol 3; :mod:`qstrat.transport.delta.stream`
sends them, :mod:`qstrat.transport.delta.receive` rebuilds them, one bucket at a time, so the
receiver rebuilds bucket k while the sender quantizes and encodes bucket k+1).

The round's STREAM is every target tensor at its stream offset (:class:`WireManifest` layout,
zero padding: the bytes a full round would send), padded to whole tiles of :data:`TILE` bytes;
the BASE is the stream of the last delta round both sides committed. Bucket k's patch covers the
whole tiles :func:`cuts` gives it, each tile in the smallest of three encodings (sizes:
:func:`tile_costs`):

- ``rle``: per changed byte the count of unchanged bytes before it in its tile (uint16: a tile
  is shorter than 65536 bytes), then the changed values; 3 bytes per change, 0 per unchanged tile;
- ``bitmap``: one bit per byte of the tile (``TILE / 8`` bytes), then the changed bytes' values;
- ``raw``: the tile's bytes (no base needed: a whole round is a patch of raw tiles).

Patch layout: four little-endian int64 (magic, bytes covered, tiles, tile bytes), one uint8 kind
per tile, one int32 change count per tile, then the rle tokens (uint16), the rle values, the
bitmaps, the bitmap values and the raw tiles, each in tile order. A bucket's payload is its
DIGEST (:data:`DIGEST_BYTES`: the keyed checksum's seal of the bytes its patch rebuilds,
:func:`region_digest`, keyed by the secret, the round MAC and the round's ids, :func:`digest_sealer`)
followed by its patch; the payload travels under the bucket MAC like any bucket.

Exactness: a receiver rebuilds each bucket's bytes from its base and the patch and compares the
digest before it takes the next bucket's; any mismatch refuses the round everywhere at the commit
vote (nothing loaded). The rebuilt tensors are views of the rebuilt stream, handed to the loader
exactly as a full round's staged tensors.
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qstrat.errors import MixedWeightsError, TransportError, WireManifestMismatchError
from qstrat.transport.security.keys import Secret, checksum_seed
from qstrat.transport.security.seal import Sealer
from qstrat.transport.wire_manifest import WireManifest
from qstrat.transport.delta.written import Mark, Pieces, WriteLog, copy_written, hold_base
from qstrat.transport.delta import patch_kernel, scan

#: Bytes per tile (a multiple of 8; under 65536 so that an rle token fits uint16).
TILE = 32768
#: Tile encodings, in the order ties are broken.
KINDS = ("rle", "bitmap", "raw")
RLE, BITMAP, RAW = range(3)
PATCH_MAGIC = 0x5153_4454_4150  # "QSDTAP"
_HEAD = 32
_DIGEST_DOMAIN = b"qstrat delta digest v4"
_DIGEST_COLUMNS = b"qstrat delta digest columns v4"


class DeltaError(TransportError):
    """A delta round a receiver refuses: ``vote_status`` is the vote status it casts
    (:data:`qstrat.transport.protocol.STALE_BASE` in the accept vote when its base is not the
    round's; :data:`qstrat.transport.protocol.DELTA` in the commit vote when the patch does not
    decode or a rebuilt bucket's digest differs from the trainer's)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.vote_status = status


class DeltaRefused(TransportError):
    """Raised on the sender when every refusing rank refused only the delta (a stale base or a
    digest mismatch): :class:`~qstrat.transport.send.sender.RefitSender` then sends the round whole."""


class DeltaMixed(MixedWeightsError):
    """Raised on the sender after a BOUNDED delta round left a MIX in which every refusing rank
    refused only the delta (a digest mismatch after units were loaded): every unit loaded was
    verified against the trainer's digests, so :class:`~qstrat.transport.send.sender.RefitSender`
    sends the same round again whole (``detail``: the ranks holding new weights)."""


@dataclass
class Base:
    """One side's base: the round id of the last delta round committed, its target wire
    manifest's digest (the layout) and its stream (1-D uint8 in host memory, padded with zeros
    to whole tiles)."""

    round_id: str
    target: str
    stream: torch.Tensor
    #: A receiver's base rebuilt from a patch: the round id of the base it was patched from,
    #: and per bucket the bytes the patch may have changed (:class:`Changes`): the stream of
    #: round ``parent`` differs from this one only there. None: unknown (a whole round).
    parent: str | None = None
    changes: list[Changes] | None = None
    #: A sender's base: the column seed and per bucket the row sums its digests were made from
    #: (:class:`qstrat.transport.delta.digest.RegionDigests`); None: not kept.
    row_sums: tuple[int, list[Any]] | None = None
    #: A sender's base: per slot, the :class:`~qstrat.transport.delta.written.Mark` of the part
    #: its bytes were copied from (None: not a logged part); None: not kept. With the sender's
    #: spare caught up to this base (:attr:`parent`, :attr:`changes`), the next round copies and
    #: compares only the bytes written since (:mod:`qstrat.transport.delta.written`).
    marks: list[Mark | None] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (the base's host memory)."""
        return self.stream.numel()


def padded_size(n: int) -> int:
    """``n`` stream bytes rounded up to whole tiles."""
    return -(-n // TILE) * TILE


def fill_stream(target: WireManifest, tensors: Iterable[tuple[str, torch.Tensor]],
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The round's stream: each tensor's bytes at its stream offset (bucket offset + slot offset;
    a chunked tensor's chunks are consecutive), zeros elsewhere, padded to whole tiles.

    Args:
        target: the full round's wire manifest.
        tensors: ``(name, tensor)`` in its slot order (any device; copied to host memory).
        out: the buffer to fill (1-D uint8 CPU of :func:`padded_size` bytes; every byte is
            written, gaps and padding included, so its old contents do not matter); None: a
            new one.
    Returns: ``out`` (or the new buffer).
    Raises: TransportError when the tensors do not follow the slots (name, dtype, shape), or
        ``out`` has another size.
    """
    n = padded_size(target.total_bytes)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.shape != (n,):
        raise TransportError(f"delta: a stream buffer of {n} bytes is needed, this one is {tuple(out.shape)} "
                             f"{out.dtype}")
    writer = StreamWriter(target, iter(tensors), out)
    writer.upto(len(target.buckets) - 1)
    writer.finish()
    return out


class StreamWriter:
    """Writes a round's stream bucket by bucket (:func:`fill_stream`'s layout) from ``tensors``
    (``(name, tensor)`` in slot order, pulled lazily: a quantizing source runs as buckets are
    asked for) into ``out``.

    With a write log (``log``, the sender's requantizer's :class:`~qstrat.transport.delta.written.WriteLog`)
    it also keeps a :class:`~qstrat.transport.delta.written.Mark` per slot (:attr:`marks`, for
    the base this round becomes), and with a ``base`` that kept its marks it first makes ``out``
    equal to the base (:func:`~qstrat.transport.delta.written.hold_base`: only the base's
    changes when ``out`` holds the round the base was patched from, ``out_round``, else the
    base whole), then copies of each slot only the bytes the log says were written since the
    base's mark (comparing them with the base's there), recording in :attr:`pieces` what it
    found changed and the spans it copied whole, for the encoder's compare with the base.
    """

    def __init__(self, target: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]], out: torch.Tensor,
                 log: WriteLog | None = None, base: Base | None = None, out_round: str | None = None) -> None:
        self.target, self.tensors, self.out = target, tensors, out
        self.cuts = cuts(target)
        self._slot, self._end = 0, 0  # the next slot to write; bytes final so far
        self.log = log
        marks = base.marks if base is not None and log is not None and base.stream is not out else None
        self._base_marks = marks if marks is not None and len(marks) == len(target.slots) else None
        # made equal to the base before the first write (on the source's thread)
        self._hold = (base, base.changes if out_round is not None and out_round == base.parent else None) \
            if self._base_marks is not None else None
        #: Per slot written, its mark (None: not a logged part's view); None without a log.
        self.marks: list[Mark | None] | None = [] if log is not None else None
        #: What was written, for the compare (None: not recorded: compare the whole stream).
        self.pieces: Pieces | None = Pieces() if self._base_marks is not None else None
        #: Slots of logged parts pending their copy (:meth:`_flush`), per part id.
        self._runs: dict[int, list[tuple[Mark, Mark, int, torch.Tensor]]] = {}

    def upto(self, k: int) -> None:
        """Write every tensor of buckets ``0..k`` and zero the gaps, so that the stream's bytes
        up to ``cuts[k + 1]`` are final (for the last bucket: the padded end).
        Raises: TransportError when a tensor does not follow its slot; what the source raises."""
        slots, starts = self.target.slots, self.target.buckets
        if self._hold is not None:
            (base, changes), self._hold = self._hold, None
            hold_base(self.out, base.stream, changes, self.cuts)
        while self._slot < len(slots) and slots[self._slot].bucket <= k:
            slot = slots[self._slot]
            name, t = next(self.tensors, (None, None))
            try:
                slot.check(name, t)
            except TransportError as exc:
                raise TransportError(f"delta: {exc}") from None
            at = starts[slot.bucket].stream_offset + slot.offset
            if at > self._end:
                self.out[self._end:at].zero_()
            self._copy(t.detach(), at, slot.nbytes)
            self._end = at + slot.nbytes
            self._slot += 1
        self._flush()
        hi = self.cuts[k + 1] if k + 1 < len(self.cuts) else self.out.numel()
        if self._end < hi:
            self.out[self._end:hi].zero_()
            self._end = hi

    def _copy(self, t: torch.Tensor, at: int, n: int) -> None:
        """Slot ``self._slot``'s tensor ``t`` into ``out[at:at + n]``: whole, or - a view of a
        logged part in the same window as in the base's round, ``out`` holding the base's bytes -
        joined to the run of such slots of that part, copied by :meth:`_flush`."""
        mark = self.log.mark(t) if self.log is not None else None
        old = self._base_marks[self._slot] if self._base_marks is not None else None
        if self.marks is not None:
            self.marks.append(mark)
        if mark is not None and old is not None and (mark.uid, mark.offset, mark.nbytes) == (
                old.uid, old.offset, old.nbytes):
            self._runs.setdefault(mark.uid, []).append((mark, old, at, t))
            return
        self._flush()
        self._whole(t, at, n)

    def _whole(self, t: torch.Tensor, at: int, n: int) -> None:
        self.out[at:at + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        if self.pieces is not None:
            self.pieces.add_span(at, at + n)

    def _flush(self) -> None:
        """Copy the pending slots of logged parts, per part in one call
        (:func:`~qstrat.transport.delta.written.copy_written`: only the bytes written since the
        base, compared with it), or each whole when the log cannot vouch for them. Pending
        slots lie between the last piece and the next (a slot copied whole flushes first): their
        changed positions, merged, and the slots copied whole go to :attr:`pieces` in stream order."""
        runs, self._runs = self._runs, {}
        found, whole = [], []
        for run in runs.values():
            changed = copy_written(self.log, [(m, b, a) for m, b, a, _ in run], self.out)
            if changed is None:
                whole += [(a, t) for _, _, a, t in run]
            elif changed.numel():
                found.append(changed)
        merged = (torch.sort(torch.cat(found)).values if len(found) > 1 else found[0]) if found else None
        i = 0
        for a, t in sorted(whole, key=lambda w: w[0]):  # pieces stay in stream order
            j = int(torch.searchsorted(merged, a)) if merged is not None else 0
            if j > i:
                self.pieces.add_changed(merged[i:j])
                i = j
            self._whole(t, a, t.numel() * t.element_size())
        if merged is not None and i < merged.numel():
            self.pieces.add_changed(merged[i:])

    @property
    def copied_whole(self) -> int:
        """Bytes of the tensors copied whole so far (all of them without the base's marks)."""
        return self.pieces.span_bytes if self.pieces is not None else self.target.total_bytes

    def finish(self) -> None:
        """After the last bucket: raise TransportError if the source yields more tensors."""
        if next(self.tensors, None) is not None:
            raise TransportError("delta: the source yields more tensors than the wire manifest holds")


def stream_of(target: WireManifest, tensors: Iterable[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The round's stream in a new buffer (:func:`fill_stream`): 1-D uint8 CPU tensor of
    :func:`padded_size` (``target.total_bytes``) bytes."""
    return fill_stream(target, tensors)


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as an integer of its width (bitwise comparison: -0.0 != 0.0, NaN == NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def changed_elements(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Sorted flat indices (int64) of the elements whose bits differ between ``new`` and ``old``
    (contiguous, same shape and dtype; uint8 streams: byte positions): :func:`changed_values`
    without the values."""
    return changed_values(new, old)[0]


def changed_values(new: torch.Tensor, old: torch.Tensor, update: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The elements whose bits differ between ``new`` and ``old`` (contiguous, same shape and
    dtype), with their bits on each side. ``update``: also write ``new``'s changed words into
    ``old`` (``old`` then equals ``new``), each piece while it is still in this core's cache
    from the compare (a requantizer's kept input; a separate scatter afterwards misses the cache
    once per changed element).

    Returns: (sorted flat indices, int64 [m]; ``new``'s and ``old``'s elements there, each [m]
    in :func:`bits_view`'s integer dtype of the elements' width). Compared as int64 words; the
    word flags are scanned eight at a time (viewed as int64), then only the hot groups' words,
    then only the changed words' elements, each step a scan of a short tensor (``nonzero``, then
    NumPy's ``flatnonzero``: :func:`_flat_nonzero`; no boolean-mask indexing: 1.3-1.7x faster on
    a 16 MiB stream at 0.05-5 % of its bytes changed, docs/performance.md, "Delta rounds: the
    measurement history", fourth pass). The values come from the changed words already read, so
    a caller needs no second gather from the two tensors (random reads, one cache miss per
    element).

    Raises: ValueError for ``new`` and ``old`` of different element counts (the compare
    kernel reads and writes ``old`` at each of ``new``'s words without bounds checks; a split
    compare would see only ``old``'s first words); with ``update`` for ``new`` and ``old``
    sharing some but not all of their bytes (writing ``old`` would change ``new``, and the split
    compare's pieces would read bytes the other thread already wrote); the same tensor twice is
    fine (nothing changes).
    """
    if new.numel() != old.numel():
        raise ValueError(f"changed_values: new has {new.numel()} elements, old {old.numel()} ({new.dtype} "
                         f"{list(new.shape)}, {old.dtype} {list(old.shape)}): they must have the same shape")
    if update and _partly_shared(new, old):
        raise ValueError(f"changed_values(update=True): new and old share memory ({new.dtype} "
                         f"{list(new.shape)} at {new.data_ptr():#x}, old at {old.data_ptr():#x}): old "
                         f"cannot end equal to new; pass a copy")
    nb, ob = bits_view(new).view(-1), bits_view(old).view(-1)
    per = 8 // new.element_size()
    # int64 words need 8-byte-aligned storage: a view at another offset (a row slice of a fused
    # slab, a view into a flat parameter buffer) is compared element by element instead
    aligned = all(t.storage_offset() * t.element_size() % 8 == 0 for t in (new, old))
    if new.numel() % (8 * per) or not aligned:
        idx = torch.nonzero(nb != ob).reshape(-1)
        got = idx, nb.index_select(0, idx), ob.index_select(0, idx)
        if update:
            ob.scatter_(0, idx, got[1])
        return got
    a, b = nb.view(torch.int64), ob.view(torch.int64)
    if a.numel() >= SPLIT_WORDS and a.device.type == "cpu" and torch.get_num_threads() == 1:
        return _split(a, b, nb.dtype, per, update)
    return _changed_words(a, b, nb.dtype, per, update)


def _partly_shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether contiguous ``a`` and ``b`` overlap in memory without being the same bytes."""
    na, nb = a.numel() * a.element_size(), b.numel() * b.element_size()
    if not na or not nb or a.device != b.device:
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + nb and pb < pa + na and (pa, na) != (pb, nb)


#: int64 words per side from which :func:`changed_values` compares on two threads at once, the
#: caller's and a helper (CPU tensors, one torch intra-op thread: the transport's setting on a
#: shared host, where torch's own parallel ops are off). The compare reads both tensors once and
#: is bound by one core's memory bandwidth; a requantizer's input of 8 MiB or more is worth a
#: thread (docs/performance.md, "Delta rounds: the measurement history", fifth pass).
SPLIT_WORDS = 1 << 20


def _split(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, per: int, update: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_changed_words` of ``a``/``b`` in pieces of ``SPLIT_WORDS // 4`` words, which this
    thread and a new helper thread take in turn until none is left (under load one of the two
    gets less of a core: neither waits long for the other). The helper only reads the two
    tensors (and with ``update`` writes its pieces of ``b``), under the caller's inference mode
    (thread-local: an inference tensor ``b`` is written in place only inside it); what it
    raises is raised here, after it stopped. A helper that cannot start (RuntimeError from
    ``Thread.start``): the whole compare on this thread."""
    size = max(8, SPLIT_WORDS // 4 // 8 * 8)  # whole groups of 8 words
    inference = torch.is_inference_mode_enabled()
    starts = range(0, a.numel(), size)
    done: list[Any] = [None] * len(starts)
    order = iter(range(len(starts)))  # next() on a range iterator is atomic under the GIL
    failed: list[BaseException] = []

    def work() -> None:
        for i in order:
            if failed:
                return
            lo = starts[i]
            try:
                done[i] = _changed_words(a[lo:lo + size], b[lo:lo + size], dtype, per, update)
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread below
                failed.append(exc)
                return

    def helper_work() -> None:
        with torch.inference_mode(inference):
            work()

    helper = threading.Thread(target=helper_work, name="qstrat-compare", daemon=True)
    try:
        helper.start()
    except RuntimeError:  # no thread to be had (a process at its thread limit): the helper is only a speed-up
        return _changed_words(a, b, dtype, per, update)
    try:
        work()
    finally:
        helper.join()
    if failed:
        raise failed[0]
    return (torch.cat([idx + lo * per for (idx, _, _), lo in zip(done, starts)]),
            torch.cat([d[1] for d in done]), torch.cat([d[2] for d in done]))


def _changed_words(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, per: int, update: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`changed_values` of two int64 word views (a multiple of 8 words) whose elements
    are ``per`` per word, of ``dtype`` (``update``: ``b``'s changed words set to ``a``'s). On CPU
    the one-pass kernel :func:`qstrat.transport.delta.scan.changed_words` answers where numba
    imported and both views are contiguous; the torch ops below elsewhere (the same values; an
    ``expand``-ed ``b``, every element one word, is refused by their in-place write)."""
    if scan.ENABLED and a.device.type == "cpu" and a.is_contiguous() and b.is_contiguous():
        return scan.changed_words(a, b, dtype, per, update)
    ne = a != b
    hot = torch.nonzero(ne.view(torch.int64)).reshape(-1)
    flat = _flat_nonzero(ne.view(-1, 8).index_select(0, hot).view(-1))  # hot group's word k: 8 * row + col
    words = (hot.index_select(0, flat >> 3) << 3) | (flat & 7)
    ga = a.gather(0, words)
    wa, wb = ga.view(dtype), b.gather(0, words).view(dtype)
    if update:  # a dense change (an eighth of the words or more): one sequential copy costs less
        b.copy_(a) if 8 * words.numel() >= a.numel() else b.scatter_(0, words, ga)
    at = _flat_nonzero(wa != wb)  # the changed elements among the changed words' elements
    return words.index_select(0, at // per) * per + at % per, wa.index_select(0, at), wb.index_select(0, at)


def _flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Sorted flat indices (int64) of the true elements of a 1-D contiguous bool tensor: NumPy's
    ``flatnonzero`` on CPU (3x ``torch.nonzero``'s 2-D scan of the same mask here: docs/performance.md,
    "Delta rounds: the measurement history", seventh pass),
    ``torch.nonzero`` elsewhere."""
    if mask.device.type != "cpu":
        return torch.nonzero(mask).reshape(-1)
    return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))


def changed_bytes(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Sorted positions (int64) of the bytes where ``new`` and ``base`` differ (1-D uint8 of the
    same length): :func:`changed_elements` of two byte streams."""
    return changed_elements(new, base)


def tile_costs(counts: torch.Tensor) -> torch.Tensor:
    """Body bytes of each tile in each encoding, int64 [tiles, 3] in :data:`KINDS` order, for
    ``counts`` (int64 [tiles]) changed bytes per tile: rle ``3 k``, bitmap ``TILE / 8 + k``, raw
    ``TILE``."""
    return torch.stack([3 * counts, TILE // 8 + counts, torch.full_like(counts, TILE)], 1)


def encode_patch(new: torch.Tensor, base: torch.Tensor | None, changed: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, int]]:
    """The patch taking ``base`` to ``new`` (module docstring).

    Args: new, base: 1-D uint8 CPU tensors of the same whole-tile length; ``base`` None: every
        tile raw. changed: :func:`changed_bytes` of the two when already known (None: computed;
        1-D int64 or int32).
    Returns: (the patch, 1-D uint8; tiles per encoding name).
    Raises: ValueError for ``new``, ``base`` or ``changed`` not of those shapes and dtypes (the
        CPU kernels index them without bounds checks: a region of a partial tile, or a shorter
        base, would be read and counted past its end), or (kernels) ``changed`` not strictly
        increasing inside the region.
    """
    n = new.numel()
    tiles = n // TILE
    if new.dtype != torch.uint8 or new.dim() != 1 or n % TILE or base is not None and (
            base.dtype != torch.uint8 or base.shape != new.shape):
        raise ValueError(f"encode_patch: new and base must be 1-D uint8 of the same whole number of {TILE}-byte "
                         f"tiles, not {new.dtype} {list(new.shape)} and "
                         f"{'None' if base is None else f'{base.dtype} {list(base.shape)}'}")
    if changed is not None and (changed.dim() != 1 or changed.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"encode_patch: changed must be 1-D int64 or int32 positions, not {changed.dtype} "
                         f"{list(changed.shape)}")
    if base is not None and patch_kernel.ENABLED and new.device.type == "cpu" and base.device.type == "cpu":
        return _encode_patch_kernel(new, base, changed_bytes(new, base) if changed is None else changed)
    if base is None:
        kinds = torch.full((tiles,), RAW, dtype=torch.uint8, device=new.device)
        counts = torch.zeros(tiles, dtype=torch.int64, device=new.device)
        pos = None
    else:
        pos = changed_bytes(new, base) if changed is None else changed
        counts = torch.bincount(pos // TILE, minlength=tiles)
        kinds = tile_costs(counts).argmin(1).to(torch.uint8)  # first minimum: rle, bitmap, raw
    head = torch.tensor([PATCH_MAGIC, n, tiles, TILE], dtype=torch.int64, device=new.device)
    parts = [head.view(torch.uint8), kinds, counts.to(torch.int32).view(torch.uint8)]
    grid = new.view(tiles, TILE)
    if pos is not None:
        tile_of = pos // TILE
        kind_of = kinds.to(torch.int64)[tile_of]
        rle = pos[kind_of == RLE]
        prev = torch.cat([rle.new_tensor([-1]), rle[:-1]])
        first = torch.cat([rle.new_tensor([True], dtype=torch.bool), (rle[1:] // TILE) != (rle[:-1] // TILE)])
        prev = torch.where(first, (rle // TILE) * TILE - 1, prev)
        gaps = (rle - prev - 1).to(torch.int32)
        gaps = torch.where(gaps > 32767, gaps - 65536, gaps).to(torch.int16)  # uint16 bit pattern
        bm_tiles = torch.nonzero(kinds == BITMAP).reshape(-1)
        bits = (grid[bm_tiles] != base.view(tiles, TILE)[bm_tiles]).view(-1, 8).to(torch.uint8)
        packed = (bits << torch.arange(8, dtype=torch.uint8, device=new.device)).sum(1, dtype=torch.uint8)
        parts += [gaps.view(torch.uint8), new[rle], packed, new[pos[kind_of == BITMAP]]]
    parts.append(grid[torch.nonzero(kinds == RAW).reshape(-1)].reshape(-1))
    used = torch.bincount(kinds.to(torch.int64), minlength=3).tolist()
    return torch.cat(parts), {k: c for k, c in zip(KINDS, used) if c}


def _encode_patch_kernel(new: torch.Tensor, base: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """:func:`encode_patch` against a base with the CPU kernels (:mod:`~qstrat.transport.delta.patch_kernel`):
    the same bytes. Raises: ValueError for ``pos`` not strictly increasing inside the region."""
    n = new.numel()
    tiles = n // TILE
    pos = pos if pos.dtype == torch.int64 and pos.is_contiguous() else pos.to(torch.int64).contiguous()
    counts = patch_kernel.tile_counts(pos, n, TILE)
    if counts is None:
        raise ValueError(f"encode_patch: the changed positions must be strictly increasing inside the "
                         f"{n} bytes of the region")
    kinds = tile_costs(torch.from_numpy(counts)).argmin(1).to(torch.uint8).numpy()  # first minimum, as above
    at = _HEAD + 5 * tiles
    starts = np.cumsum([at, *_section_sizes(kinds, counts)]).tolist()
    out = torch.empty(starts[-1], dtype=torch.uint8, device="cpu")
    o = out.numpy()
    o[:_HEAD] = np.array([PATCH_MAGIC, n, tiles, TILE], dtype=np.int64).view(np.uint8)
    o[_HEAD:_HEAD + tiles] = kinds
    o[_HEAD + tiles:at] = counts.astype(np.int32).view(np.uint8)
    patch_kernel.encode_tiles(new, base, pos, kinds, counts, TILE, o, starts[:-1])
    used = np.bincount(kinds, minlength=3).tolist()
    return out, {k: c for k, c in zip(KINDS, used) if c}


def _section_sizes(kinds: Any, counts: Any) -> list[int]:
    """Bytes of a patch's body sections (module docstring: rle tokens, rle values, bitmaps,
    bitmap values, raw tiles) for its tile table: ``kinds`` and ``counts`` per tile (torch
    tensors or NumPy arrays)."""
    k_rle, k_bm = int(counts[kinds == RLE].sum()), int(counts[kinds == BITMAP].sum())
    n_bm, n_raw = int((kinds == BITMAP).sum()), int((kinds == RAW).sum())
    return [2 * k_rle, k_rle, n_bm * TILE // 8, k_bm, n_raw * TILE]


def decode_patch(patch: torch.Tensor, base: torch.Tensor | None, n: int, out: torch.Tensor | None = None,
                 holds_base: bool = False, changes: list[Changes] | None = None) -> torch.Tensor:
    """The stream (1-D uint8 [n]; ``base`` is not changed) from ``base`` and ``patch``
    (:func:`encode_patch`), written into ``out`` (1-D uint8 CPU [n], its old bytes do not matter;
    None: a new tensor).

    ``holds_base``: ``out`` already holds ``base``'s bytes (:meth:`Changes.catch_up` made it so), so
    only the patched bytes are written (no copy of the base). ``changes``: if given, the bytes
    this patch may have changed are appended to it (:class:`Changes`).

    Raises: DeltaError (status DELTA) for a patch that does not fit a stream of ``n`` bytes
        (header, kinds, counts, length, positions, bitmap bits set past the bitmap tiles' counts,
        zero counts included), or one with rle or bitmap tiles when there is no base of ``n``
        bytes; ValueError for an ``out`` that is not 1-D uint8 [n] (the CPU kernel writes it
        without bounds checks), before anything is written.
    """
    from qstrat.transport.protocol import DELTA

    def bad(why: str) -> DeltaError:
        return DeltaError(f"the delta patch {why}", DELTA)

    if out is not None and (out.dtype != torch.uint8 or out.shape != (n,)):
        raise ValueError(f"decode_patch: out must be 1-D uint8 of the region's {n} bytes, not {out.dtype} "
                         f"{list(out.shape)}")
    if patch.numel() < _HEAD:
        raise bad(f"has {patch.numel()} bytes, shorter than its header")
    magic, size, tiles, tile = (int(v) for v in patch[:_HEAD].clone().view(torch.int64))
    if magic != PATCH_MAGIC or size != n or tile != TILE or tiles * TILE != n:
        raise bad(f"header (magic {magic:#x}, {size} bytes, {tiles} tiles of {tile}) does not fit a stream "
                  f"of {n} bytes in tiles of {TILE}")
    at = _HEAD + 5 * tiles
    if patch.numel() < at:
        raise bad(f"has {patch.numel()} bytes, shorter than its tile table")
    kinds = patch[_HEAD:_HEAD + tiles].to(torch.int64)
    counts = patch[_HEAD + tiles:at].clone().view(torch.int32).to(torch.int64)
    if tiles and (int(kinds.max()) > RAW or int(counts.min()) < 0 or int(counts.max()) > TILE):
        raise bad("has a tile kind or change count out of range")
    sizes = _section_sizes(kinds, counts)
    k_rle, k_bm, n_bm, n_raw = sizes[1], sizes[3], sizes[2] // (TILE // 8), sizes[4] // TILE
    if patch.numel() != at + sum(sizes):
        raise bad(f"has {patch.numel()} bytes, its tile table says {at + sum(sizes)}")
    if n_raw < tiles and (base is None or base.numel() != n):
        raise bad("patches tiles, and this receiver holds no base stream of that size")
    cut = []
    for s in sizes:
        cut.append(patch[at:at + s])
        at += s
    tokens, rle_values, bitmaps, bm_values, raw = cut
    if out is None:
        out = base.clone() if n_raw < tiles else torch.empty(n, dtype=torch.uint8, device="cpu")
    elif n_raw < tiles and not holds_base:
        out.copy_(base)
    grid = out.view(tiles, TILE)
    # an inference tensor written outside inference mode: the torch path, which refuses it as torch does
    # (the kernel writes through NumPy, unseen by that check)
    writable = not out.is_inference() or torch.is_inference_mode_enabled()
    if patch_kernel.ENABLED and out.device.type == "cpu" and writable and (k_rle or n_bm):
        status, moved = patch_kernel.apply_tiles(kinds, counts, tokens, rle_values, bitmaps, bm_values, TILE, out)
        if status == 1:
            raise bad("has run lengths past the end of their tile")
        if status == 2:
            raise bad(f"has bitmaps marking {moved} bytes, its counts say {k_bm}")
        k_rle = n_bm = 0  # applied
    else:
        moved = kinds.new_empty(0)
    if n_raw:
        grid[torch.nonzero(kinds == RAW).reshape(-1)] = raw.view(n_raw, TILE)
    if k_rle:
        rle_tiles = torch.nonzero(kinds == RLE).reshape(-1)
        tile_of = torch.repeat_interleave(rle_tiles, counts[rle_tiles])
        steps = (tokens.clone().view(torch.int16).to(torch.int64) & 0xFFFF) + 1
        ends = torch.cumsum(steps, 0)
        starts = torch.cumsum(counts[rle_tiles], 0) - counts[rle_tiles]  # first change of each tile
        live = counts[rle_tiles] > 0
        before = (ends - steps)[starts[live]]
        offset = ends - 1 - torch.repeat_interleave(before, counts[rle_tiles][live])
        if int(offset.max()) >= TILE:
            raise bad("has run lengths past the end of their tile")
        moved = tile_of * TILE + offset
        out[moved] = rle_values
    if n_bm:  # checked even when the counts say 0: a bit set there marks a byte the patch does not hold
        bm_tiles = torch.nonzero(kinds == BITMAP).reshape(-1)
        shifts = torch.arange(8, dtype=torch.uint8, device=bitmaps.device)
        bits = ((bitmaps.view(-1, 1) >> shifts) & 1).view(n_bm, TILE).bool()
        pos = torch.nonzero(bits)
        if pos.shape[0] != k_bm:
            raise bad(f"has bitmaps marking {pos.shape[0]} bytes, its counts say {k_bm}")
        out[bm_tiles[pos[:, 0]] * TILE + pos[:, 1]] = bm_values
    if changes is not None:  # bitmap tiles kept whole: at least T/16 changes each, 8 bytes per position
        whole = torch.nonzero(kinds != RLE).reshape(-1)
        changes.append(Changes(moved.to(torch.int32) if n < 2**31 else moved, whole))
    return out


@dataclass
class Changes:
    """The bytes of a region (one bucket's tiles) a patch may have changed: the byte positions
    it wrote in rle tiles (int32 in a region under 2 GiB, else int64; 4 bytes per change, at most
    2048 changes per 32 KiB tile, so at most a quarter of the region) and the tiles it wrote
    whole or by bitmap (int64 tile indices in the region), copied whole. Every other byte of the
    new region equals the base's."""

    positions: torch.Tensor
    tiles: torch.Tensor

    def catch_up(self, older: torch.Tensor, newer: torch.Tensor) -> None:
        """Make ``older`` (the region before this patch) equal ``newer`` (after it) by copying
        only the bytes this patch may have changed: 1-D uint8 CPU of the same whole-tile length."""
        older[self.positions] = newer[self.positions]
        if self.tiles.numel():
            older.view(-1, TILE)[self.tiles] = newer.view(-1, TILE)[self.tiles]


#: Bytes of a bucket's digest at the head of its payload (the bucket seal's length).
DIGEST_BYTES = 32


def cuts(target: WireManifest) -> list[int]:
    """Where each target bucket's patch begins and ends in the stream: patch ``k`` covers the
    whole tiles ``[cuts[k], cuts[k + 1])`` - up to the last tile boundary at or before bucket
    ``k``'s end (the stream's padded end for the last bucket), so a tile that straddles two
    buckets goes with the later one. ``len(target.buckets) + 1`` offsets (bytes)."""
    if not target.buckets:
        return [0]
    ends = [(b.stream_offset + b.nbytes) // TILE * TILE for b in target.buckets[:-1]]
    return [0, *ends, padded_size(target.total_bytes)]


def patch_limit(tiles: int) -> int:
    """The largest payload a bucket whose patch covers ``tiles`` tiles may announce (bytes): its
    digest, the patch header and tile table, and every tile in the largest encoding the decoder
    accepts (rle with every byte changed: 3 bytes per byte). A receiver allocates no more."""
    return DIGEST_BYTES + _HEAD + 5 * tiles + 3 * tiles * TILE


def digest_sealer(secret: Secret | None, mac: bytes, info: dict[str, Any], layout: str) -> Sealer:
    """The sealer of a delta round's per-bucket digests: the keyed device checksum
    (:mod:`qstrat.transport.security.checksum`), sealed as a bucket. Its row keys are drawn from
    ``secret`` and a key made of SHA-256 of a domain string, the round MAC and the round's two
    ids (``info``: ``{"base", "round"}``), so a digest binds the round, its base and the new
    base's id; its column keys from ``secret`` and the layout (``layout``: the wire manifest's
    digest), the same every round of that layout, so the sender can bring its row sums up to
    date from the changed words alone (:mod:`qstrat.transport.delta.digest`).

    The checksum, not the bucket MAC, with or without a secret: the digest checks that the
    receiver's REBUILT bytes are the trainer's (a base out of step, a fault in memory: accidents),
    while every byte on the wire - the patch and the digest itself - is under the round's bucket
    MAC as in a full round; the checksum is 4-5x faster than NH here (docs/transport.md)."""
    ids = f"{info.get('round')}\0{info.get('base') or ''}".encode()
    key = hashlib.sha256(_DIGEST_DOMAIN + mac + ids).digest()
    sealer = Sealer(None, key, torch.device("cpu"))
    sealer.seed = checksum_seed(secret, key)
    sealer.column_seed = checksum_seed(secret, hashlib.sha256(_DIGEST_COLUMNS + layout.encode()).digest())
    return sealer


def region_digest(sealer: Sealer, k: int, region: torch.Tensor) -> bytes:
    """Bucket ``k``'s digest: the seal of its patch's rebuilt bytes ``region`` (the seal of the
    index alone for a patch of no tile)."""
    return sealer.seal(k, 0, region if region.numel() else None)


def check_info(info: Any) -> dict[str, Any]:
    """Receiver, before the accept vote: ``update_info["delta"]`` (``{"base": id or None,
    "round": id}``). Raises: WireManifestMismatchError for a malformed document."""
    if (not isinstance(info, dict) or not isinstance(info.get("round"), str) or not 0 < len(info["round"]) <= 64
            or not (info.get("base") is None or isinstance(info["base"], str) and len(info["base"]) <= 64)):
        raise WireManifestMismatchError("a delta round needs update_info['delta'] = {'base': id or None, "
                                        "'round': id} (ids: text of at most 64 characters)")
    return info


def check_base(info: dict[str, Any], target: WireManifest, base: Base | None) -> None:
    """Receiver, before the accept vote: raise DeltaError (status STALE_BASE) when the round is
    encoded against a base this receiver does not hold (a restarted engine, a missed round, a
    round in another mode since, another layout); a round without a base always fits."""
    from qstrat.transport.protocol import STALE_BASE

    want = info.get("base")
    if want is None:
        return
    if base is None:
        why = "holds no base (a restarted engine, or a round in another mode since)"
    elif base.round_id != want:
        why = f"holds base round {base.round_id[:12]}, another than the round's"
    elif base.target != target.digest:
        why = "holds a base of another layout (wire manifest)"
    else:
        return
    raise DeltaError(f"the delta round is encoded against base round {str(want)[:12]}; this receiver {why}",
                     STALE_BASE)


def region_names(target: WireManifest, lo: int, hi: int) -> str:
    """The tensors whose bytes lie in stream bytes ``[lo, hi)``, for an error message (a few)."""
    starts = [b.stream_offset for b in target.buckets]
    names = [s.name for s in target.slots
             if starts[s.bucket] + s.offset < hi and starts[s.bucket] + s.offset + s.nbytes > lo]
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def patch_sizes(new: torch.Tensor, base: torch.Tensor) -> dict[str, int]:
    """Measurement helper (scripts/delta_encodings.py): for two streams of whole tiles, the
    changed bytes and the patch body's bytes with every tile ``rle``, every tile ``bitmap``,
    as an int32 ``index`` list (5 bytes per change), and with the per-tile smallest (``tiled``,
    what :func:`encode_patch` sends, tile table and header included)."""
    pos = changed_bytes(new, base)
    counts = torch.bincount(pos // TILE, minlength=new.numel() // TILE)
    costs = tile_costs(counts)
    k = pos.numel()
    return {"bytes": new.numel(), "changed": k, "rle": 3 * k, "bitmap": new.numel() // 8 + k, "index": 5 * k,
            "tiled": int(costs.min(1).values.sum()) + _HEAD + 5 * counts.numel()}


__all__ = ["Base", "Changes", "DIGEST_BYTES", "DeltaError", "DeltaRefused", "KINDS", "TILE", "bits_view", "changed_bytes", "changed_elements", "changed_values", "check_base", "check_info", "cuts",
           "decode_patch", "digest_sealer", "encode_patch", "fill_stream", "patch_limit", "patch_sizes",
           "region_digest", "stream_of"]
