"""Bucket packing (sender) and zero-copy unpacking (receiver).

A shared bucket is one ``uint8`` buffer holding several tensors at their wire manifest offsets
(mixed dtypes); a chunk bucket is a slice of one large tensor's own bytes and is sent and
received in place (no copy on either side). The per-bucket checksum is
:mod:`qstrat.transport.security.checksum` (device tensor ops, no host copy).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from qstrat.transport.wire_manifest import Bucket, TensorSlot, WireManifest


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a flat ``uint8`` view (no copy; 0-dim and bool work)."""
    return t.reshape(-1).view(torch.uint8)


def bucket_contents(wire_manifest: WireManifest) -> list[list[TensorSlot]]:
    """For each bucket, the slots that lie in it (a chunked slot in each of its buckets)."""
    contents: list[list[TensorSlot]] = [[] for _ in wire_manifest.buckets]
    for s in wire_manifest.slots:
        for c in range(s.chunks):
            contents[s.bucket + c].append(s)
    return contents


def pack(buffer: torch.Tensor, bucket: Bucket, slots: list[TensorSlot],
         tensors: list[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` into ``buffer`` (uint8, >= bucket size) at their slots' offsets.

    Padding bytes are zeroed, so the checksum is a function of the tensors alone.
    Returns: the payload view ``buffer[:bucket.nbytes]``.
    """
    pack_range(buffer, slots, [t.contiguous() for t in tensors], 0, bucket.nbytes)
    return buffer[:bucket.nbytes]


def pack_range(buffer: torch.Tensor, slots: list[TensorSlot], tensors: list[torch.Tensor],
               lo: int, hi: int) -> None:
    """Fill bytes ``[lo, hi)`` of a shared bucket's ``buffer``: the parts of ``tensors``
    (contiguous, in slot order) that fall there, zeros elsewhere (padding). Filling consecutive
    ranges that cover the bucket gives the bytes of :func:`pack` (the sender packs each piece
    just before sealing and sending it)."""
    pos = lo
    for s, t in zip(slots, tensors):
        a, e = max(lo, s.offset), min(hi, s.offset + s.nbytes)
        if e <= a:
            continue
        if a > pos:
            buffer[pos:a].zero_()
        buffer[a:e].copy_(byte_view(t)[a - s.offset:e - s.offset])
        pos = e
    if hi > pos:
        buffer[pos:hi].zero_()


def chunk_view(t: torch.Tensor, wire_manifest: WireManifest, slot: TensorSlot,
               bucket: Bucket) -> torch.Tensor:
    """The bytes of ``t`` (contiguous, the slot's tensor) that make up chunk ``bucket`` (no copy)."""
    start = bucket.stream_offset - wire_manifest.buckets[slot.bucket].stream_offset
    return byte_view(t)[start:start + bucket.nbytes]


def receive_buffers(wire_manifest: WireManifest, device: torch.device, pin: bool = False
                    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """Allocate, bucket by bucket (lazily), the uint8 tensor each bucket is received into.

    A shared bucket gets its own buffer (its tensors become views of it: :func:`unpack`); the
    chunks of a large tensor are slices of one buffer of that tensor's size (held here only until
    its last chunk was yielded). ``pin``: page-locked host memory (``device`` must be the CPU).
    """
    contents = bucket_contents(wire_manifest)
    whole: dict[str, torch.Tensor] = {}
    for b, slots in zip(wire_manifest.buckets, contents):
        if b.tensor is None:
            yield b, torch.empty(b.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
            continue
        slot = slots[0]
        if slot.name not in whole:
            whole[slot.name] = torch.empty(slot.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        start = b.stream_offset - wire_manifest.buckets[slot.bucket].stream_offset
        view = whole[slot.name][start:start + b.nbytes]
        if b.index == slot.bucket + slot.chunks - 1:
            del whole[slot.name]
        yield b, view


def slot_tensor(slot: TensorSlot, first: torch.Tensor) -> torch.Tensor:
    """The tensor of ``slot`` as a view of the received bytes (no copy).

    Args: first: the buffer its (first) bucket was received into (:func:`receive_buffers`); the
        chunks of a chunked slot are consecutive slices of one storage.
    """
    if slot.chunks > 1:
        raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), (slot.nbytes,))
    else:
        raw = first[slot.offset:slot.offset + slot.nbytes]
    return raw.view(getattr(torch, slot.dtype)).reshape(slot.shape)


def unpack(wire_manifest: WireManifest, received: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` in wire order, each a view of the received bytes (no copy).

    Args: received: per bucket, the buffer :func:`receive_buffers` gave for it, filled.
    Views are valid because every offset is a multiple of the alignment (>= element size).
    """
    return [(s.name, slot_tensor(s, received[s.bucket])) for s in wire_manifest.slots]
