"""Which bytes of a delta round's stream can differ from the base: the bytes the sender's
incremental quantizer wrote since the base's round copied them, instead of a compare of every byte.

A delta round's sender writes each tensor of the round into the stream and compares the stream
with the base to find the bytes that changed (:mod:`qstrat.transport.delta.stream`). Most of the
stream (all but passthrough tensors) is the :class:`~qstrat.transport.delta.requantize.Requantizer`'s
own parts, which it updates in place, re-encoding only what the step changed: it knows which of
their bytes it wrote. :class:`WriteLog` keeps that record per part, keyed by the part's storage
and checked against torch's version counter (every in-place write to a tensor or any view of
it bumps the counter the views share, ``Tensor._version``):

- the requantizer :meth:`WriteLog.add` s each part it creates and :meth:`WriteLog.record` s, after
  each incremental call, the storage bytes it wrote (sorted) with the version before and after;
- the stream's writer takes a :class:`Mark` of each slot it copies from a logged part (the
  part's log id, the byte window of its storage and the version then), kept with the base
  (:attr:`qstrat.transport.delta.encoding.Base.marks`);
- next round, with its stream buffer holding the base's bytes (the spare caught up from the
  base's patch, as a receiver does), the writer asks :meth:`WriteLog.since` for the bytes of
  that window written since the mark, copies only those and has only those compared with the
  base, comparing them there as it copies (:class:`Pieces`).

:meth:`WriteLog.since` answers only when the log's records chain from the mark's version to the
part's version now with no gap (a write the requantizer did not record - a caller changing a
returned part in place, a record dropped - breaks the chain), the log id is the mark's (a part
made again, whole, gets a new id), and the window is the mark's; else None, and the slot is
copied and compared whole, as before. So an unrecorded write costs speed, never bytes.
Measured (docs/transport.md, "The stream written from the requantizer's record"): on the 4x
wider tiny model (64 MiB of block FP8) the sender's compare of the stream with its base
(0.023-0.034 s a round) and its copy of the requantized tensors (about 0.01 s) became 0.008 s.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from qstrat.transport.wire_manifest import WireManifest

__all__ = ["Mark", "Pieces", "WriteLog", "copy_written", "hold_base", "reread_logged", "version_of"]

#: Spans copied whole at most this many bytes apart are compared as one (the gap's zeros with them).
MERGE_GAP = 1 << 16
#: Records kept per part (a base at most this many incremental calls old is still served).
MAX_RECORDS = 8


@dataclass(frozen=True)
class Mark:
    """Where a stream slot's bytes were copied from: the log id of the part, the byte window of
    its storage (``offset``, ``nbytes``) and its version counter at the copy."""

    uid: int
    offset: int
    nbytes: int
    version: int


@dataclass
class _Track:
    """One logged part: its id, the part itself (its storage stays alive, so no other tensor
    can take its address while logged) and its records ``(version before, version after,
    sorted unique int64 storage byte positions)``, consecutive."""

    uid: int
    part: torch.Tensor
    records: list[tuple[int, int, torch.Tensor]]


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (None: an inference tensor, which keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class WriteLog:
    """The storage bytes of logged parts written since a :class:`Mark` (module docstring)."""

    _uids = itertools.count(1)

    def __init__(self) -> None:
        self._tracks: dict[int, _Track] = {}
        self._keys: dict[int, int] = {}  # log id -> storage key

    def __len__(self) -> int:
        return len(self._tracks)

    def add(self, parts: list[torch.Tensor]) -> None:
        """Log ``parts`` (one quantized entry's) from now, each under a new id. Parts that
        share a storage with each other, lie off the CPU or keep no version counter are not
        logged (their slots are then compared whole)."""
        keys = [_key(p) for p in parts]
        if len(set(keys)) != len(keys):
            return
        for key, p in zip(keys, parts):
            if key and p.device.type == "cpu" and version_of(p) is not None:
                if key in self._tracks:
                    self._keys.pop(self._tracks[key].uid, None)
                self._tracks[key] = _Track(next(self._uids), p, [])
                self._keys[self._tracks[key].uid] = key

    def drop(self, parts: Iterable[torch.Tensor]) -> None:
        """Stop logging ``parts`` (an entry dropped or made again)."""
        for p in parts:
            track = self._tracks.get(_key(p))
            if track is not None and track.part is p:
                del self._tracks[_key(p)]
                self._keys.pop(track.uid, None)

    def clear(self) -> None:
        """Stop logging every part."""
        self._tracks.clear()
        self._keys.clear()

    def record(self, part: torch.Tensor, before: int | None, positions: torch.Tensor) -> None:
        """``part`` (logged) was written in place at ``positions`` (sorted unique int64 byte
        positions in the part's own bytes) by writes that took its version counter from
        ``before`` to its value now. A record that does not follow the last one (a write in
        between that was not recorded) starts the chain again."""
        track = self._tracks.get(_key(part))
        if track is None or track.part is not part:
            return
        after = version_of(part)
        if before is None or after is None:
            track.records.clear()
            return
        if track.records and track.records[-1][1] != before:
            track.records.clear()
        track.records.append((before, after, positions + part.storage_offset() * part.element_size()))
        del track.records[:-MAX_RECORDS]

    def mark(self, t: torch.Tensor) -> Mark | None:
        """The :class:`Mark` of copying ``t`` (a contiguous CPU view of a logged part) now;
        None when ``t`` is not one."""
        track = self._tracks.get(_key(t)) if t.is_contiguous() and t.device.type == "cpu" else None
        version = version_of(t) if track is not None else None
        if version is None:
            return None
        return Mark(track.uid, t.storage_offset() * t.element_size(), t.numel() * t.element_size(), version)

    def _track(self, uid: int) -> _Track | None:
        track = self._tracks.get(self._keys.get(uid, 0))
        return track if track is not None and track.uid == uid else None

    def storage(self, uid: int) -> torch.Tensor | None:
        """The whole storage of the part logged under ``uid`` as 1-D uint8 (None: not logged)."""
        track = self._track(uid)
        if track is None:
            return None
        return torch.empty(0, dtype=torch.uint8, device=track.part.device).set_(track.part.untyped_storage())

    def bytes_at(self, mark: Mark) -> torch.Tensor | None:
        """The bytes ``mark`` was taken of (1-D uint8 view of the logged part's storage window),
        while the part is logged under the mark's id and unchanged since (its version the
        mark's); None otherwise. A whole resend re-reads each logged slot from here rather than
        trusting the stream's copy of the bytes the log said had not changed."""
        track = self._track(mark.uid)
        if track is None or version_of(track.part) != mark.version:
            return None
        return self.storage(mark.uid)[mark.offset:mark.offset + mark.nbytes]

    def written(self, uid: int, since: int, now: int) -> torch.Tensor | None:
        """The storage byte positions (sorted unique int64) of the part logged under ``uid``
        written while its version counter went from ``since`` to ``now`` (its value now). None:
        not known (not logged, or its records do not chain gap-free from ``since`` to ``now``:
        an unrecorded write, records dropped)."""
        track = self._track(uid)
        if track is None or version_of(track.part) != now:
            return None
        if now == since:
            return torch.empty(0, dtype=torch.int64)
        used = [r for r in track.records if r[0] >= since]
        if not used or used[0][0] != since or used[-1][1] != now or any(a[1] != b[0] for a, b in zip(used, used[1:])):
            return None
        return used[0][2] if len(used) == 1 else torch.unique(torch.cat([r[2] for r in used]))

    def since(self, t: torch.Tensor, mark: Mark) -> torch.Tensor | None:
        """The byte positions of ``t`` (sorted unique int64, in ``t``'s own bytes) that may differ
        from its bytes at ``mark`` (the mark of the same slot in the base's round): every byte
        logged as written since, within ``t``'s window. None: not known (another part or
        window, an unrecorded write, records dropped): compare ``t`` whole."""
        now = self.mark(t)
        if now is None or (now.uid, now.offset, now.nbytes) != (mark.uid, mark.offset, mark.nbytes):
            return None
        pos = self.written(now.uid, mark.version, now.version)
        return None if pos is None else _window(pos, mark) - mark.offset


def _window(pos: torch.Tensor, mark: Mark) -> torch.Tensor:
    """The storage positions of ``pos`` (sorted int64) inside ``mark``'s byte window."""
    lo, hi = torch.searchsorted(pos, torch.tensor([mark.offset, mark.offset + mark.nbytes])).tolist()
    return pos[lo:hi]


def copy_written(log: WriteLog, run: list[tuple[Mark, Mark, int]], out: torch.Tensor) -> torch.Tensor | None:
    """Copy into ``out`` (1-D uint8, holding the base's bytes) the bytes of a run of slots of one
    logged part that changed since the base: ``run`` is ``(mark now, the base's mark, stream
    offset)`` per slot, one part (one id), the same windows as the base's. The part's written
    positions since the base's version, each mapped to its slot's place in the stream, are
    compared with ``out`` there and the ones that differ written: one gather, compare and
    scatter for the run, whatever its number of slots. Returns the sorted stream positions
    that changed, or None when the log cannot vouch for the run (nothing written: copy it whole).
    """
    first, old = run[0][0], run[0][1]
    if any(m.version != first.version or b.version != old.version for m, b, _ in run):
        return None
    pos = log.written(first.uid, old.version, first.version)
    if pos is not None and not pos.numel():  # nothing written since: every byte is the base's
        return pos
    storage = log.storage(first.uid) if pos is not None else None
    if storage is None:
        return None
    if len(run) == 1:
        pos = _window(pos, first)
        at = pos + (run[0][2] - first.offset)
    else:
        run = sorted(run, key=lambda r: r[0].offset)
        starts = torch.tensor([m.offset for m, _, _ in run])
        ends = torch.tensor([m.offset + m.nbytes for m, _, _ in run])
        if bool((ends[:-1] > starts[1:]).any()):  # slots sharing bytes of the part (the same view
            return None  # yielded twice): a position maps to one slot here, so copy each whole
        shift = torch.tensor([a - m.offset for m, _, a in run])
        w = torch.searchsorted(starts, pos, right=True) - 1
        keep = (w >= 0) & (pos < ends[w.clamp(min=0)])
        if not bool(keep.all()):
            pos, w = pos[keep], w[keep]
        at = pos + shift[w]
        if not bool((at[1:] > at[:-1]).all()):  # slots laid out in another order than the part
            at, order = torch.sort(at)
            pos = pos[order]
    new = storage.gather(0, pos)
    differ = new != out.gather(0, at)
    changed = at[differ]
    out.scatter_(0, changed, new[differ])  # gather/scatter_: 4x index_copy_'s speed here
    return changed


def hold_base(stream: torch.Tensor, base: torch.Tensor, changes: list | None, cuts: list[int]) -> None:
    """Make ``stream`` (1-D uint8, the spare) equal ``base`` (the base's stream) before a round
    writes only logged bytes into it: when ``changes`` (the base's per-bucket
    :class:`~qstrat.transport.delta.encoding.Changes`, one per region of ``cuts``) is given, the
    spare holds the round the base was patched from and only those bytes are copied; else the
    base is copied whole."""
    if changes is not None and len(changes) == len(cuts) - 1:
        for j, c in enumerate(changes):
            c.catch_up(stream[cuts[j]:cuts[j + 1]], base[cuts[j]:cuts[j + 1]])
    else:
        stream.copy_(base)


def reread_logged(stream: torch.Tensor, target: WireManifest, log: WriteLog, marks: list[Mark | None]) -> None:
    """Before a round's complete stream is sent again whole: every slot with a mark read again
    from its part (:meth:`WriteLog.bytes_at`; a part changed since is left as written). Only the
    bytes the log named were copied into those slots, the rest being the base's caught up; this
    makes what goes whole what the parts hold even if the stream's memory changed since it was
    sent as a patch."""
    for slot, mark in zip(target.slots, marks):
        src = log.bytes_at(mark) if mark is not None else None
        if src is not None:
            at = target.buckets[slot.bucket].stream_offset + slot.offset
            stream[at:at + slot.nbytes].copy_(src)


class Pieces:
    """What a round's writer wrote into the stream, in stream order: spans copied whole (to be
    compared with the base) and the positions it already found changed (bytes of logged parts
    written since the base, compared as they were copied). :meth:`changed` gives, per region,
    the sorted positions where the stream differs from the base: what
    :func:`~qstrat.transport.delta.encoding.changed_bytes` of the region gives, as every byte
    outside the pieces equals the base's.

    ``add_span(lo, hi)``: bytes ``[lo, hi)`` copied whole; ``add_changed(p)``: the sorted
    absolute stream positions that changed; each after every earlier piece."""

    def __init__(self) -> None:
        self._pieces: list[tuple[int, int, torch.Tensor | None]] = []
        self._first = 0  # pieces before this one end before the last region asked for
        #: Bytes copied whole; positions found changed as copied.
        self.span_bytes, self.changed_positions = 0, 0

    def add_span(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` were copied whole."""
        if hi > lo:
            self.span_bytes += hi - lo
            last = self._pieces[-1] if self._pieces else None
            # one compare for neighbours (the zero gap between them equals the base's too)
            if last is not None and last[2] is None and lo - last[1] <= MERGE_GAP:
                self._pieces[-1] = (last[0], hi, None)
            else:
                self._pieces.append((lo, hi, None))

    def add_changed(self, p: torch.Tensor) -> None:
        """The bytes at ``p`` (sorted absolute stream positions) changed; no other byte of the
        piece's slot did."""
        if p.numel():
            self.changed_positions += p.numel()
            self._pieces.append((int(p[0]), int(p[-1]) + 1, p))

    def changed(self, lo: int, hi: int, region: torch.Tensor, old: torch.Tensor,
                changed_bytes: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Sorted positions (int64, relative to ``lo``) in ``[lo, hi)`` where ``region`` (the
        stream's bytes there) differs from ``old`` (the base's): the spans compared with
        ``changed_bytes`` (:func:`~qstrat.transport.delta.encoding.changed_bytes`), the positions
        taken as found. Regions are asked for in stream order."""
        out: list[torch.Tensor] = []
        i = self._first
        while i < len(self._pieces) and self._pieces[i][0] < hi:
            # the count first: a piece that was not the last one then is final (add_span extends
            # only the last piece, on the writer's thread, maybe while this runs on another)
            last = i + 1 == len(self._pieces)
            a, b, p = self._pieces[i]
            if b <= lo:
                # never past the last piece: a span added within MERGE_GAP after it extends it,
                # and a later region must compare that extension
                if not last:
                    self._first = i + 1
            elif p is None:
                s, e = max(a, lo) - lo, min(b, hi) - lo
                out.append(changed_bytes(region[s:e], old[s:e]) + s)
            else:
                if a < lo or b > hi:
                    p = p[(p >= lo) & (p < hi)]
                out.append(p - lo)
            i += 1
        if not out:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(out) if len(out) > 1 else out[0]
