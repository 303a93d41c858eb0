"""Delta rounds: send only the quantized bytes that changed since the round the engine holds.

A delta round (``RefitSender(mode="delta")``, docs/transport.md "Delta rounds") is an atomic round
whose wire manifest carries two ``uint8`` blobs instead of the checkpoint tensors of the TARGET
wire manifest (the full round's, which the engine checks exactly as in a full round):

* :data:`HEADER_NAME`: JSON naming the target wire manifest's digest, the base round id, the new
  round id, and per target BUCKET the trainer's digest of its full bytes;
* :data:`PATCH_NAME`: the PATCH of the round's STREAM (every target tensor at its stream offset,
  :meth:`WireManifest` layout, zero padding: the bytes a full round would send) against the BASE
  (the stream of the last delta round both sides committed), cut in tiles of :data:`TILE` bytes,
  each tile in the smallest of three encodings (sizes: :func:`tile_costs`):

  - ``rle`` (run lengths): per changed byte the count of unchanged bytes before it in its tile
    (uint16: a tile is shorter than 65536 bytes), then the changed bytes' new values; 3 bytes
    per change, nothing for an unchanged tile;
  - ``bitmap``: one bit per byte of the tile (``TILE / 8`` bytes), then the changed bytes' values;
  - ``raw``: the tile's bytes (no base needed: a full round is a patch of raw tiles).

Patch layout: four little-endian int64 (magic, stream bytes, tiles, tile bytes), one uint8 kind
per tile, one int32 change count per tile, then the rle tokens (uint16), the rle values, the
bitmaps, the bitmap values and the raw tiles, each in tile order.

Exactness: a receiver rebuilds the stream from its base and the patch and compares, per target
bucket, its digest with the trainer's before the commit vote; any mismatch refuses the round
everywhere (nothing loaded). The digest is the round's bucket seal (:class:`~qstrat.transport.
seal.Sealer`: NH + HMAC under the secret, the keyed checksum without one) keyed by the new round
id in place of the round MAC. The rebuilt tensors are views of the rebuilt stream, handed to the
loader exactly as a full round's staged tensors.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.errors import TransportError, WireManifestMismatchError
from qstrat.transport.buckets import unpack
from qstrat.transport.keys import Secret, equal
from qstrat.transport.seal import Sealer
from qstrat.transport.wire_manifest import WireManifest, build_wire_manifest

#: The slot names of a delta round's two blobs, in wire order.
HEADER_NAME, PATCH_NAME = "qstrat.delta", "qstrat.delta.patch"
#: Bytes per tile (a multiple of 8; under 65536 so that an rle token fits uint16).
TILE = 32768
#: Tile encodings, in the order ties are broken.
KINDS = ("rle", "bitmap", "raw")
RLE, BITMAP, RAW = range(3)
PATCH_MAGIC = 0x5153_4454_4150  # "QSDTAP"
_HEAD = 32
#: In-bucket alignment of a delta round's blobs (the wire manifest's minimum).
BLOB_ALIGNMENT = 16
_DIGEST_DOMAIN = b"qstrat delta digest v1"


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
    digest mismatch): :class:`~qstrat.transport.sender.RefitSender` then sends the round whole."""


@dataclass
class Base:
    """One side's base: the round id of the last delta round committed, its target wire
    manifest's digest (the layout) and its stream (1-D uint8 in host memory, padded with zeros
    to whole tiles)."""

    round_id: str
    target: str
    stream: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held (the base's host memory)."""
        return self.stream.numel()


def padded_size(n: int) -> int:
    """``n`` stream bytes rounded up to whole tiles."""
    return -(-n // TILE) * TILE


def fill_stream(target: WireManifest, tensors: Iterable[tuple[str, torch.Tensor]],
                out: torch.Tensor | None = None,
                on_bucket: Callable[[torch.Tensor, int], None] | None = None) -> torch.Tensor:
    """The round's stream: each tensor's bytes at its stream offset (bucket offset + slot offset;
    a chunked tensor's chunks are consecutive), zeros elsewhere, padded to whole tiles.

    Args:
        target: the full round's wire manifest.
        tensors: ``(name, tensor)`` in its slot order, consumed one at a time (any device;
            copied to host memory), so a lazy source (quantization) runs interleaved with
            ``on_bucket``.
        out: the buffer to fill (1-D uint8 CPU of :func:`padded_size` bytes; every byte is
            written, gaps and padding included, so its old contents do not matter); None: a
            new one.
        on_bucket: called as ``on_bucket(stream, k)`` as soon as target bucket ``k``'s bytes
            are final (in bucket order, each once), while they are still in the cache; the
            tail padding past the last bucket is final when this returns.
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
    buckets, k, end = target.buckets, 0, 0  # k: the next bucket to finish; end: bytes final so far
    it = iter(tensors)
    for slot in target.slots:
        name, t = next(it, (None, None))
        try:
            slot.check(name, t)
        except TransportError as exc:
            raise TransportError(f"delta: {exc}") from None
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        at = buckets[slot.bucket].stream_offset + slot.offset
        out[end:at].zero_()
        out[at:at + slot.nbytes] = raw
        end = at + slot.nbytes
        while on_bucket is not None and k < len(buckets) and buckets[k].stream_offset + buckets[k].nbytes <= end:
            on_bucket(out, k)
            k += 1
    if next(it, None) is not None:
        raise TransportError("delta: the source yields more tensors than the wire manifest holds")
    out[end:].zero_()
    while on_bucket is not None and k < len(buckets):
        on_bucket(out, k)
        k += 1
    return out


def stream_of(target: WireManifest, tensors: Iterable[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The round's stream in a new buffer (:func:`fill_stream`): 1-D uint8 CPU tensor of
    :func:`padded_size` (``target.total_bytes``) bytes."""
    return fill_stream(target, tensors)


def changed_bytes(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Sorted positions (int64) of the bytes where ``new`` and ``base`` differ (1-D uint8 of the
    same length, a multiple of 8): compared as int64 words, then only the differing words
    split into bytes (a nonzero over an eighth of the elements)."""
    a, b = new.view(torch.int64), base.view(torch.int64)
    words = torch.nonzero(a != b).reshape(-1)
    hit = (a[words] ^ b[words]).view(torch.uint8).view(-1, 8) != 0
    return ((words * 8).unsqueeze(1) + torch.arange(8))[hit]


def tile_costs(counts: torch.Tensor) -> torch.Tensor:
    """Body bytes of each tile in each encoding, int64 [tiles, 3] in :data:`KINDS` order, for
    ``counts`` (int64 [tiles]) changed bytes per tile: rle ``3 k``, bitmap ``TILE / 8 + k``, raw
    ``TILE``."""
    return torch.stack([3 * counts, TILE // 8 + counts, torch.full_like(counts, TILE)], 1)


def encode_patch(new: torch.Tensor, base: torch.Tensor | None, changed: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, int]]:
    """The patch taking ``base`` to ``new`` (module docstring).

    Args: new, base: 1-D uint8 CPU tensors of the same whole-tile length; ``base`` None: every
        tile raw. changed: :func:`changed_bytes` of the two when already known (None: computed).
    Returns: (the patch, 1-D uint8; tiles per encoding name).
    """
    n = new.numel()
    tiles = n // TILE
    if base is None:
        kinds = torch.full((tiles,), RAW, dtype=torch.uint8)
        counts = torch.zeros(tiles, dtype=torch.int64)
        pos = None
    else:
        pos = changed_bytes(new, base) if changed is None else changed
        counts = torch.bincount(pos // TILE, minlength=tiles)
        kinds = tile_costs(counts).argmin(1).to(torch.uint8)  # first minimum: rle, bitmap, raw
    parts = [torch.tensor([PATCH_MAGIC, n, tiles, TILE], dtype=torch.int64).view(torch.uint8), kinds,
             counts.to(torch.int32).view(torch.uint8)]
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
        packed = (bits << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
        parts += [gaps.view(torch.uint8), new[rle], packed, new[pos[kind_of == BITMAP]]]
    parts.append(grid[torch.nonzero(kinds == RAW).reshape(-1)].reshape(-1))
    used = torch.bincount(kinds.to(torch.int64), minlength=3).tolist()
    return torch.cat(parts), {k: c for k, c in zip(KINDS, used) if c}


def decode_patch(patch: torch.Tensor, base: torch.Tensor | None, n: int) -> torch.Tensor:
    """The stream (1-D uint8 [n], a new tensor; ``base`` is not changed) from ``base`` and
    ``patch`` (:func:`encode_patch`).

    Raises: DeltaError (status DELTA) for a patch that does not fit a stream of ``n`` bytes
        (header, kinds, counts, length, positions), or one with rle or bitmap tiles when there
        is no base of ``n`` bytes.
    """
    from qstrat.transport.protocol import DELTA

    def bad(why: str) -> DeltaError:
        return DeltaError(f"the delta patch {why}", DELTA)

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
    k_rle, k_bm = int(counts[kinds == RLE].sum()), int(counts[kinds == BITMAP].sum())
    n_bm, n_raw = int((kinds == BITMAP).sum()), int((kinds == RAW).sum())
    sizes = [2 * k_rle, k_rle, n_bm * TILE // 8, k_bm, n_raw * TILE]
    if patch.numel() != at + sum(sizes):
        raise bad(f"has {patch.numel()} bytes, its tile table says {at + sum(sizes)}")
    if n_raw < tiles and (base is None or base.numel() != n):
        raise bad("patches tiles, and this receiver holds no base stream of that size")
    cut = []
    for s in sizes:
        cut.append(patch[at:at + s])
        at += s
    tokens, rle_values, bitmaps, bm_values, raw = cut
    out = base.clone() if n_raw < tiles else torch.empty(n, dtype=torch.uint8)
    grid = out.view(tiles, TILE)
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
        out[tile_of * TILE + offset] = rle_values
    if k_bm:
        bm_tiles = torch.nonzero(kinds == BITMAP).reshape(-1)
        bits = ((bitmaps.view(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(n_bm, TILE).bool()
        pos = torch.nonzero(bits)
        if pos.shape[0] != k_bm:
            raise bad(f"has bitmaps marking {pos.shape[0]} bytes, its counts say {k_bm}")
        out[bm_tiles[pos[:, 0]] * TILE + pos[:, 1]] = bm_values
    return out


def digest_sealer(secret: Secret | None, round_id: str) -> Sealer:
    """The sealer of a delta round's digests: the bucket seal keyed by ``round_id`` in place of
    the round MAC (SHA-256 of a domain string and the id)."""
    return Sealer(secret, hashlib.sha256(_DIGEST_DOMAIN + round_id.encode()).digest(), torch.device("cpu"))


def bucket_digests(target: WireManifest, stream: torch.Tensor, sealer: Sealer) -> list[str]:
    """Hex digest of each target bucket's bytes in ``stream`` (what a full round's bucket k
    carries), under ``sealer``."""
    return [sealer.seal(b.index, 0, stream[b.stream_offset:b.stream_offset + b.nbytes]).hex()
            for b in target.buckets]


@dataclass
class DeltaRound:
    """A round encoded by :func:`encode_round`: its wire manifest, its two blobs in wire order,
    the ``update_info["delta"]`` document, the new base, and what it cost."""

    wire_manifest: WireManifest
    blobs: list[tuple[str, torch.Tensor]]
    info: dict[str, Any]
    new_base: Base
    tiles: dict[str, int]
    encode_s: float

    @property
    def kind(self) -> str:
        """``full`` when every tile went raw, else ``delta``."""
        return "full" if set(self.tiles) <= {"raw"} else "delta"


def encode_round(target: WireManifest, stream: torch.Tensor, base: Base | None, secret: Secret | None,
                 target_doc: dict[str, Any] | None = None) -> DeltaRound:
    """Encode the round whose stream (:func:`stream_of`) is ``stream`` against ``base``.

    Args:
        target: the full round's wire manifest (what the engines check).
        stream: the round's stream, 1-D uint8 of :func:`padded_size` bytes.
        base: the base both sides hold (None, or a base of another layout: every tile raw).
        secret: keys the digests (None: the keyed checksum, accidents only).
        target_doc: ``target.to_dict()`` when the caller keeps it (a warm sender sends the same
            target every round: DeepSeek-V3's is 90k slots); None: built here.
    """
    t0 = time.perf_counter()
    round_id = secrets.token_hex(16)
    if base is not None and base.target != target.digest:
        base = None
    return _round(target, stream, base, round_id, bucket_digests(target, stream, digest_sealer(secret, round_id)),
                  None if base is None else changed_bytes(stream, base.stream), t0, target_doc)


def encode_tensors(target: WireManifest, tensors: Iterable[tuple[str, torch.Tensor]], base: Base | None,
                   secret: Secret | None, target_doc: dict[str, Any] | None = None) -> DeltaRound:
    """Encode the round of ``tensors`` against ``base`` in ONE pass over its stream: each target
    bucket is compared with the base and digested as soon as :func:`fill_stream` has written it
    (while it is in the cache), between the tensors ``tensors`` (e.g. quantization) produces,
    instead of a compare and a digest of the whole stream afterwards. The round (and its new
    base's stream) is the one :func:`encode_round` makes of :func:`stream_of` ``(target, tensors)``.

    Args: target, base, secret, target_doc: as :func:`encode_round`; tensors: as :func:`fill_stream`.
    Raises: as :func:`fill_stream`.
    """
    round_id = secrets.token_hex(16)
    if base is not None and base.target != target.digest:
        base = None
    sealer, digests, found, spent = digest_sealer(secret, round_id), [], [], 0.0
    ends = [0] + [(b.stream_offset + b.nbytes) // 8 * 8 for b in target.buckets]  # whole int64 words

    def on_bucket(stream: torch.Tensor, k: int) -> None:
        """Bucket k's digest, and the changed positions from the previous bucket's end to its
        own (whole words)."""
        nonlocal spent
        t = time.perf_counter()
        b = target.buckets[k]
        digests.append(sealer.seal(b.index, 0, stream[b.stream_offset:b.stream_offset + b.nbytes]).hex())
        lo, hi = ends[k], ends[k + 1]
        if base is not None and hi > lo:
            found.append(changed_bytes(stream[lo:hi], base.stream[lo:hi]) + lo)
        spent += time.perf_counter() - t

    stream = fill_stream(target, tensors, on_bucket=on_bucket)
    t1 = time.perf_counter()
    if base is not None and ends[-1] < stream.numel():  # the tail padding past the last bucket
        found.append(changed_bytes(stream[ends[-1]:], base.stream[ends[-1]:]) + ends[-1])
    changed = None if base is None else torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)
    # encode_s: the compare and digest seconds, and the patch
    return _round(target, stream, base, round_id, digests, changed, t1 - spent, target_doc)


def _round(target: WireManifest, stream: torch.Tensor, base: Base | None, round_id: str, digests: list[str],
           changed: torch.Tensor | None, t0: float, target_doc: dict[str, Any] | None) -> DeltaRound:
    """The round from its stream, digests and changed positions against ``base`` (of the
    target's layout, or None); its ``encode_s`` is the seconds since ``t0``."""
    patch, tiles = encode_patch(stream, base.stream if base is not None else None, changed)
    head = {"base": base.round_id if base is not None else None, "round": round_id, "target": target.digest,
            "digests": digests}
    header = torch.frombuffer(bytearray(json.dumps(head, sort_keys=True).encode()), dtype=torch.uint8)
    blobs = [(HEADER_NAME, header), (PATCH_NAME, patch)]
    wm = build_wire_manifest(((n, "uint8", (b.numel(),)) for n, b in blobs), target.bucket_bytes, BLOB_ALIGNMENT)
    info = {"base": head["base"], "round": round_id,
            "target": target_doc if target_doc is not None else target.to_dict()}
    return DeltaRound(wm, blobs, info, Base(round_id, target.digest, stream), tiles, time.perf_counter() - t0)


def target_of(wire_manifest: WireManifest, info: Any) -> WireManifest:
    """Receiver, before the accept vote: the round's target wire manifest (what the engine checks)
    from ``update_info["delta"]``, checked against the delta wire manifest.

    Raises: WireManifestMismatchError for a malformed document, a wire manifest that is not
        the two uint8 blobs, or blobs larger than any patch of the target could be
        (:func:`blob_limits`: what the receiver would allocate is bounded by the target, which the
        engine checks) or in other buckets than the target's.
    """
    if not isinstance(info, dict) or not isinstance(info.get("round"), str):
        raise WireManifestMismatchError("a delta round needs update_info['delta'] with its round ids and target")
    target = WireManifest.received(info.get("target"))
    if [s.name for s in wire_manifest.slots] != [HEADER_NAME, PATCH_NAME] or any(
            s.dtype != "uint8" or len(s.shape) != 1 for s in wire_manifest.slots):
        raise WireManifestMismatchError(f"a delta round's wire manifest holds the uint8 blobs {HEADER_NAME!r} "
                                        f"and {PATCH_NAME!r}, this one other slots")
    if wire_manifest.bucket_bytes != target.bucket_bytes:
        raise WireManifestMismatchError(f"a delta round's blobs go in the target's buckets ({target.bucket_bytes} "
                                        f"bytes), this one in buckets of {wire_manifest.bucket_bytes}")
    limits = blob_limits(target)
    for slot in wire_manifest.slots:
        if slot.shape[0] > limits[slot.name]:
            raise WireManifestMismatchError(f"a delta round's {slot.name} of {slot.shape[0]} bytes is larger than "
                                            f"any for its target ({limits[slot.name]} bytes at most)")
    return target


#: A delta header's JSON: bytes besides the bucket digests, and per bucket digest (a hex string).
_HEADER_FIXED, _HEADER_PER_BUCKET = 1024, 160


def blob_limits(target: WireManifest) -> dict[str, int]:
    """The largest header and patch a delta round of ``target`` can carry, bytes: the header's
    JSON (ids, the target digest, one digest per target bucket), and a patch whose every tile is
    in its largest encoding the decoder accepts (rle with every byte changed: 3 bytes per byte)
    plus its tables (:data:`_HEAD` bytes, 1 kind byte and 4 count bytes per tile)."""
    n = padded_size(target.total_bytes)
    return {HEADER_NAME: _HEADER_FIXED + _HEADER_PER_BUCKET * len(target.buckets),
            PATCH_NAME: _HEAD + 5 * (n // TILE) + 3 * n}


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


def decode_round(blobs: list[tuple[str, torch.Tensor]], info: dict[str, Any], target: WireManifest,
                 base: Base | None, secret: Secret | None) -> tuple[list[tuple[str, torch.Tensor]], Base]:
    """Receiver, after every bucket verified and before the commit vote: the target tensors
    (checkpoint dtypes and shapes, in wire order: views of the rebuilt stream) and the new base.
    The stream is rebuilt in a COPY of ``base.stream``: ``base`` stays intact whatever happens
    (the tensors an engine loaded from it last round are never written, even if a loader kept
    views of them), and stays the base if this round is refused elsewhere.

    Raises: DeltaError (status DELTA) for a header that does not name this round (ids, target
        digest, digest count), a patch that does not decode, or a rebuilt bucket whose digest
        differs from the trainer's (naming its tensors).
    """
    from qstrat.transport.protocol import DELTA

    (_, header), (_, patch) = blobs
    try:
        head = json.loads(bytes(header.cpu().numpy()).decode())
    except (ValueError, RecursionError) as exc:  # RecursionError: a hostile, deeply nested document
        raise DeltaError(f"the delta header is not readable: {type(exc).__name__}: {exc}", DELTA) from None
    digests = head.get("digests") if isinstance(head, dict) else None
    if (not isinstance(digests, list) or head.get("round") != info["round"] or head.get("base") != info.get("base")
            or head.get("target") != target.digest or len(digests) != len(target.buckets)):
        raise DeltaError("the delta header does not name this round (ids, target digest or digest count)", DELTA)
    n = padded_size(target.total_bytes)
    stream = decode_patch(patch.cpu(), base.stream if base is not None and head["base"] is not None else None, n)
    for k, (got, want) in enumerate(zip(bucket_digests(target, stream, digest_sealer(secret, info["round"])), digests)):
        if not (isinstance(want, str) and len(want) == len(got) and equal(got.encode(), want.encode())):
            names = [s.name for s in target.slots if s.bucket <= k < s.bucket + s.chunks]
            raise DeltaError(f"bucket {k} ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}): the rebuilt "
                             f"bytes' digest differs from the trainer's (base and trainer out of step?); nothing "
                             f"loaded", DELTA)
    views = [stream[b.stream_offset:b.stream_offset + b.nbytes] for b in target.buckets]
    return unpack(target, views), Base(info["round"], target.digest, stream)


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


__all__ = ["Base", "DeltaError", "DeltaRefused", "DeltaRound", "HEADER_NAME", "KINDS", "PATCH_NAME", "TILE",
           "check_base", "decode_patch", "decode_round", "encode_patch", "encode_round", "encode_tensors",
           "fill_stream", "patch_sizes", "stream_of", "target_of"]
