"""Delta rounds: send only the quantized words that changed since the round the engine holds.

A delta round (``RefitSender(mode="delta")``, docs/transport.md "Delta rounds") is an atomic round
whose wire manifest carries, instead of the checkpoint tensors of the TARGET wire manifest (the
full round's, which the engine checks exactly as in a full round), one ``uint8`` BLOB per target
tensor plus one round header blob :data:`HEADER_NAME`. Each blob encodes its tensor against the
BASE (the bytes of that tensor in the last delta round both sides committed), in whichever of
these encodings is smallest for it (sizes: :func:`encoded_sizes`):

* ``raw``: the tensor's bytes (no base needed: a full round is a delta round of raw blobs);
* ``bitmap``: one bit per word (``ceil(n / 8)`` bytes), then the changed words' new values;
* ``index``: the changed words' positions (int32, int64 past 2**31 words), then their values;
* ``rle``: run lengths - per changed word the count of unchanged words before it as uint16
  (a run of 65535 or more is written as 65535-tokens, each skipping 65535 words), then values.

A WORD is one element of the tensor's dtype (FP8 codes: 1 byte; NVFP4's packed uint8: 2 codes;
float32 scales: 4 bytes; bf16: 2 bytes). Blob layout: four little-endian int64 (encoding, changed
words k, words n, rle tokens), then the body as listed.

Exactness: the header blob (JSON) names the target wire manifest digest, the base round id, the
new round id and, per target tensor, the trainer's DIGEST of its full bytes: the round's bucket
seal (:class:`qstrat.transport.seal.Sealer`: NH + HMAC under the secret, the keyed checksum without
one) keyed by the new round id, over the tensor's bytes with the tensor's index as the bucket
index. A receiver reconstructs every tensor and compares its digest before the commit vote;
any mismatch refuses the round everywhere (nothing loaded).
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from qstrat.errors import TransportError, WireManifestMismatchError
from qstrat.transport.keys import Secret, equal
from qstrat.transport.seal import Sealer
from qstrat.transport.wire_manifest import WireManifest, build_wire_manifest

#: The header blob's slot name (first in a delta round's wire manifest).
HEADER_NAME = "qstrat.delta"
ENCODINGS = ("raw", "bitmap", "index", "rle")
RAW, BITMAP, INDEX, RLE = range(4)
#: The largest run-length token; a token of this value skips that many words and marks none.
RLE_ESCAPE = 65535
_BLOB_HEADER = 32
#: In-bucket alignment of a delta round's blobs (the wire manifest's minimum).
BLOB_ALIGNMENT = 16
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST_DOMAIN = b"qstrat delta digest v1"


class DeltaError(TransportError):
    """A delta round a receiver refuses: ``status`` is the vote status it casts
    (:data:`qstrat.transport.protocol.STALE_BASE` in the accept vote when its base is not the
    round's; :data:`qstrat.transport.protocol.DELTA` in the commit vote when a tensor did not
    reconstruct to the trainer's digest)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.vote_status = status


class DeltaRefused(TransportError):
    """Raised on the sender when every refusing rank refused only the delta (a stale base or a
    digest mismatch): :class:`~qstrat.transport.sender.RefitSender` then sends the round whole."""


@dataclass
class Base:
    """One side's base: the round id of the last delta round committed and every tensor's bytes
    as of that round (1-D uint8 tensors in host memory, name -> bytes)."""

    round_id: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held (the base's host memory)."""
        return sum(t.numel() for t in self.tensors.values())


def words(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """``raw`` (1-D uint8, ``n * itemsize`` bytes) viewed as ``n`` integer words of ``itemsize``
    bytes (1, 2, 4 or 8). Raises TransportError for another itemsize."""
    if itemsize not in _WORD:
        raise TransportError(f"delta: no word type for an element of {itemsize} bytes")
    if raw.storage_offset() % itemsize:
        raw = raw.clone()
    return raw.view(_WORD[itemsize])


def rle_tokens(positions: torch.Tensor) -> torch.Tensor:
    """The ``rle`` tokens (int64) of sorted changed word ``positions`` (int64 [k]): per position,
    ``gap // 65535`` escape tokens then ``gap % 65535``, ``gap`` being the unchanged words since
    the previous change."""
    if positions.numel() == 0:
        return positions.new_empty(0)
    gaps = torch.diff(positions, prepend=positions.new_tensor([-1])) - 1
    escapes = gaps // RLE_ESCAPE
    tokens = torch.full((int(escapes.sum()) + gaps.numel(),), RLE_ESCAPE, dtype=torch.int64)
    last = torch.cumsum(escapes + 1, 0) - 1  # where each change's own token goes
    tokens[last] = gaps % RLE_ESCAPE
    return tokens


def rle_positions(tokens: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rle_tokens`: the changed word positions (int64 [k])."""
    tokens = tokens.to(torch.int64)
    change = tokens != RLE_ESCAPE
    ends = torch.cumsum(tokens + change.to(torch.int64), 0)
    return ends[change] - 1


def encoded_sizes(n: int, k: int, tokens: int, itemsize: int) -> dict[str, int]:
    """Body bytes of each encoding for a tensor of ``n`` words of ``itemsize`` bytes with ``k``
    changed words (``tokens``: its rle token count, :func:`rle_tokens`). The blob adds 32 bytes."""
    index_bytes = 4 if n < 2**31 else 8
    return {"raw": n * itemsize, "bitmap": -(-n // 8) + k * itemsize,
            "index": k * (index_bytes + itemsize), "rle": 2 * tokens + k * itemsize}


def encode(new: torch.Tensor, base: torch.Tensor | None, itemsize: int) -> tuple[str, torch.Tensor]:
    """The smallest blob of ``new`` against ``base``.

    Args: new, base: 1-D uint8 CPU tensors of the same length (a multiple of ``itemsize``);
        ``base`` None (or of another length): ``raw``.
    Returns: (encoding name, blob: 1-D uint8).
    """
    n = new.numel() // itemsize
    if base is None or base.numel() != new.numel():
        return "raw", _blob(RAW, 0, n, 0, [new])
    w_new, w_base = words(new, itemsize), words(base, itemsize)
    changed = w_new != w_base
    positions = torch.nonzero(changed).reshape(-1)
    k = positions.numel()
    tokens = rle_tokens(positions)
    sizes = encoded_sizes(n, k, tokens.numel(), itemsize)
    best = min(ENCODINGS, key=lambda e: (sizes[e], ENCODINGS.index(e)))
    values = w_new[positions].view(torch.uint8)
    if best == "raw":
        return best, _blob(RAW, 0, n, 0, [new])
    if best == "bitmap":
        return best, _blob(BITMAP, k, n, 0, [_pack_bits(changed), values])
    if best == "index":
        idx = positions.to(torch.int32 if n < 2**31 else torch.int64).view(torch.uint8)
        return best, _blob(INDEX, k, n, 0, [idx, values])
    as_u16 = torch.where(tokens > 32767, tokens - 65536, tokens).to(torch.int16)  # the uint16 bit pattern
    return best, _blob(RLE, k, n, tokens.numel(), [as_u16.view(torch.uint8), values])


def decode(blob: torch.Tensor, base: torch.Tensor | None, nbytes: int, itemsize: int, name: str) -> torch.Tensor:
    """The tensor's bytes (1-D uint8 [nbytes], a new tensor or a view of ``blob``) from its blob.

    Raises: DeltaError (status DELTA) for a blob whose header or length does not fit the tensor,
        or a sparse blob without a base of ``nbytes`` bytes.
    """
    from qstrat.transport.protocol import DELTA

    def bad(why: str) -> DeltaError:
        return DeltaError(f"delta blob of {name}: {why}", DELTA)

    if blob.numel() < _BLOB_HEADER:
        raise bad(f"{blob.numel()} bytes, shorter than its header")
    enc, k, n, t = (int(v) for v in blob[:_BLOB_HEADER].clone().view(torch.int64))
    body = blob[_BLOB_HEADER:]
    if n * itemsize != nbytes or enc not in range(4) or not 0 <= k <= n or t < 0:
        raise bad(f"header (encoding {enc}, {k} of {n} words, {t} tokens) does not fit a tensor of {nbytes} bytes")
    size = encoded_sizes(n, k, t, itemsize)[ENCODINGS[enc]]
    if body.numel() != size:
        raise bad(f"body of {body.numel()} bytes, its header says {size}")
    if enc == RAW:
        return body
    if base is None or base.numel() != nbytes:
        raise bad("a sparse blob, and this receiver holds no base bytes of that size")
    values = words(body[size - k * itemsize:], itemsize)
    if enc == BITMAP:
        positions = torch.nonzero(_unpack_bits(body[:-(-n // 8)], n)).reshape(-1)
    elif enc == INDEX:
        positions = words(body[:size - k * itemsize], 4 if n < 2**31 else 8).to(torch.int64)
    else:
        positions = rle_positions(body[:2 * t].clone().view(torch.int16).to(torch.int64) & 0xFFFF)
    if positions.numel() != k or (k and (int(positions.min()) < 0 or int(positions.max()) >= n)):
        raise bad(f"positions do not fit: {positions.numel()} positions for {k} changes of {n} words")
    out = base.clone()
    words(out, itemsize)[positions] = values
    return out


def _blob(enc: int, k: int, n: int, tokens: int, parts: Iterable[torch.Tensor]) -> torch.Tensor:
    head = torch.tensor([enc, k, n, tokens], dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, *(p.reshape(-1) for p in parts)])


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    n = mask.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
    padded[:n] = mask
    return (padded.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8)


def _unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    return ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)[:n].bool()


def digest_sealer(secret: Secret | None, round_id: str) -> Sealer:
    """The sealer of a delta round's tensor digests: the bucket seal keyed by ``round_id`` in
    place of the round MAC (SHA-256 of a domain string and the id)."""
    return Sealer(secret, hashlib.sha256(_DIGEST_DOMAIN + round_id.encode()).digest(), torch.device("cpu"))


def tensor_digest(sealer: Sealer, index: int, raw: torch.Tensor) -> str:
    """Hex digest of tensor ``index``'s bytes ``raw`` (1-D uint8, CPU) under ``sealer``."""
    return sealer.seal(index, 0, raw if raw.numel() else torch.zeros(0, dtype=torch.uint8)).hex()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's bytes, 1-D uint8 (a copy only when not contiguous or not on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class DeltaRound:
    """A round encoded by :func:`encode_round`: its wire manifest, blobs in wire order, the
    ``update_info["delta"]`` document, the new base, and what it cost."""

    wire_manifest: WireManifest
    blobs: list[tuple[str, torch.Tensor]]
    info: dict[str, Any]
    new_base: Base
    encodings: dict[str, int]
    encode_s: float

    @property
    def kind(self) -> str:
        """``full`` when every tensor went raw, else ``delta``."""
        return "full" if set(self.encodings) <= {"raw"} else "delta"


def encode_round(target: WireManifest, tensors: list[tuple[str, torch.Tensor]], base: Base | None,
                 secret: Secret | None) -> DeltaRound:
    """Encode a round of ``tensors`` (the target wire manifest's, in its order) against ``base``.

    Args:
        target: the full round's wire manifest (what the engines check).
        tensors: ``(name, tensor)`` in ``target``'s slot order (CPU or device tensors).
        base: the base both sides hold (None: a full round: every blob raw).
        secret: the round's secret (keys the digests; None: the keyed checksum, accidents only).
    Raises: TransportError when ``tensors`` do not follow ``target``'s slots.
    """
    t0 = time.perf_counter()
    round_id = secrets.token_hex(16)
    sealer = digest_sealer(secret, round_id)
    blobs, digests, counts, new = [], [], {}, {}
    if [n for n, _ in tensors] != [s.name for s in target.slots]:
        raise TransportError("delta: the tensors do not follow the wire manifest's slots")
    for i, ((name, t), slot) in enumerate(zip(tensors, target.slots)):
        raw = byte_view(t).clone()
        if raw.numel() != slot.nbytes:
            raise TransportError(f"delta: {name} has {raw.numel()} bytes, the wire manifest says {slot.nbytes}")
        old = base.tensors.get(name) if base is not None else None
        enc, blob = encode(raw, old, getattr(torch, slot.dtype).itemsize)
        counts[enc] = counts.get(enc, 0) + 1
        blobs.append((name, blob))
        digests.append(tensor_digest(sealer, i, raw))
        new[name] = raw
    info = {"base": base.round_id if base is not None else None, "round": round_id, "target": target.to_dict()}
    head = {"base": info["base"], "round": round_id, "target": target.digest, "digests": digests}
    header = torch.frombuffer(bytearray(json.dumps(head, sort_keys=True).encode()), dtype=torch.uint8)
    blobs.insert(0, (HEADER_NAME, header))
    # blobs are bytes (decoding copies what it views as wider words): the smallest alignment
    wm = build_wire_manifest(((n, "uint8", (b.numel(),)) for n, b in blobs), target.bucket_bytes, BLOB_ALIGNMENT)
    tensors_new = dict(base.tensors) if base is not None else {}
    tensors_new.update(new)
    return DeltaRound(wm, blobs, info, Base(round_id, tensors_new), counts, time.perf_counter() - t0)


def target_of(wire_manifest: WireManifest, info: Any) -> WireManifest:
    """Receiver, before the accept vote: the round's target wire manifest (what the engine checks)
    from ``update_info["delta"]``, checked against the delta wire manifest's blobs.

    Raises: WireManifestMismatchError for a malformed document or blobs that are not one uint8
        blob per target tensor after the header.
    """
    if not isinstance(info, dict) or not isinstance(info.get("round"), str):
        raise WireManifestMismatchError("a delta round needs update_info['delta'] with its round ids and target")
    target = WireManifest.from_dict(info.get("target"))
    names = [s.name for s in wire_manifest.slots]
    if names != [HEADER_NAME, *(s.name for s in target.slots)] or any(
            s.dtype != "uint8" or len(s.shape) != 1 for s in wire_manifest.slots):
        raise WireManifestMismatchError("the delta round's blobs are not one uint8 blob per target tensor "
                                        f"after {HEADER_NAME!r}")
    return target


def check_base(info: dict[str, Any], base: Base | None) -> None:
    """Receiver, before the accept vote: raise DeltaError (status STALE_BASE) when the round is
    encoded against a base this receiver does not hold (a restarted engine, a missed round, a
    round in another mode since); a round without a base (``info["base"]`` None) always fits."""
    from qstrat.transport.protocol import STALE_BASE

    want = info.get("base")
    held = base.round_id if base is not None else None
    if want is not None and want != held:
        why = "holds no base (a restarted engine, or a round in another mode since)" if held is None else \
            f"holds base round {held[:12]}, another than the round's"
        raise DeltaError(f"the delta round is encoded against base round {want[:12]}; this receiver {why}",
                         STALE_BASE)


def decode_round(tensors: list[tuple[str, torch.Tensor]], info: dict[str, Any], target: WireManifest,
                 base: Base | None, secret: Secret | None) -> tuple[list[tuple[str, torch.Tensor]], Base]:
    """Receiver, after every bucket verified and before the commit vote: the target tensors
    (checkpoint dtypes and shapes, in wire order) reconstructed from ``base`` and the blobs, each
    checked against the trainer's digest; and the new base.

    Raises: DeltaError (status DELTA) for a header that does not name this round (ids, target
        digest, digest count), a blob that does not decode, or a tensor whose digest differs
        (naming it).
    """
    from qstrat.transport.protocol import DELTA

    (hname, header), blobs = tensors[0], tensors[1:]
    try:
        head = json.loads(bytes(header.cpu().numpy()).decode())
    except ValueError as exc:
        raise DeltaError(f"the delta header is not readable: {exc}", DELTA) from None
    if (hname != HEADER_NAME or not isinstance(head, dict) or head.get("round") != info["round"]
            or head.get("base") != info.get("base") or head.get("target") != target.digest
            or len(head.get("digests") or ()) != len(target.slots)):
        raise DeltaError("the delta header does not name this round (ids, target digest or digest count)", DELTA)
    sealer = digest_sealer(secret, info["round"])
    out, new = [], dict(base.tensors) if base is not None else {}
    for i, ((name, blob), slot) in enumerate(zip(blobs, target.slots)):
        old = base.tensors.get(name) if base is not None else None
        raw = decode(byte_view(blob), old, slot.nbytes, getattr(torch, slot.dtype).itemsize, name)
        if not equal(bytes.fromhex(tensor_digest(sealer, i, raw)), bytes.fromhex(head["digests"][i])):
            raise DeltaError(f"{name}: the reconstructed tensor's digest differs from the trainer's "
                             f"(base and trainer out of step?); nothing loaded", DELTA)
        new[name] = raw
        out.append((name, raw.view(getattr(torch, slot.dtype)).reshape(slot.shape)))
    return out, Base(info["round"], new)


def density_table(new: torch.Tensor, base: torch.Tensor) -> dict[str, Any]:
    """Measurement helper (scripts/delta_encodings.py): changed words and each encoding's blob
    size for one tensor pair (same dtype and shape)."""
    itemsize = new.element_size()
    a, b = byte_view(new), byte_view(base)
    pos = torch.nonzero(words(a, itemsize) != words(b, itemsize)).reshape(-1)
    n = a.numel() // itemsize
    sizes = encoded_sizes(n, pos.numel(), rle_tokens(pos).numel(), itemsize)
    return {"words": n, "changed": pos.numel(), "density": pos.numel() / max(n, 1),
            **{e: s + _BLOB_HEADER for e, s in sizes.items()}, "best": min(sizes, key=sizes.get)}


__all__ = ["Base", "DeltaError", "DeltaRefused", "DeltaRound", "ENCODINGS", "HEADER_NAME", "decode",
           "check_base", "decode_round", "density_table", "encode", "encode_round", "encoded_sizes",
           "target_of"]
