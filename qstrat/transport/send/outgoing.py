"""The sender's half of protocol step 3: every bucket produced, packed, sealed and posted.

Pieces, one job each:

* :class:`PackBuffers`: the two reusable pack buffers (double buffering: bucket k+1 is packed
  while bucket k is on the wire);
* :class:`BucketSource`: pulls the source's tensors in wire order, checks each against its
  slot, and lays out a bucket (a shared bucket's parts, or a chunk of a large tensor's own
  bytes - sent from its memory, no copy);
* :func:`post_bucket`: the payload in pieces of at most ``PIECE_BYTES``, each packed and
  sealed just before it is posted, then the header with the seal;
* :func:`send_buckets`: the loop and its error protocol. Anything the sender's own side raises
  while producing, packing or sealing a bucket - the quantizing source (a Triton compile error,
  a ``ValueError``, out of memory), a short or disagreeing source - turns into an ABORT bucket
  (garbage of the right size, ``flags = ABORT``), so every receiver hears it at once and goes
  to the commit vote; the error is returned as a :class:`SourceFailure`. A failed collective
  (a peer died, a timeout) is a TransportError and closes the group.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch

from qstrat.errors import TransportError
from qstrat.transport import protocol
from qstrat.transport.buckets import bucket_contents, chunk_view, pack_range
from qstrat.transport.group import TransferGroup
from qstrat.transport.security.seal import PIECE_BYTES, Sealer, pieces
from qstrat.transport.timing import Phases
from qstrat.transport.wire_manifest import TensorSlot, WireManifest


@dataclass(frozen=True)
class SourceFailure:
    """Why the sender aborted the stream: the bucket and what its own side raised there."""

    bucket: int
    error: BaseException

    def __str__(self) -> str:
        return f"bucket {self.bucket}: {type(self.error).__name__}: {self.error}"


class PackBuffers:
    """Pack buffers of ``size`` bytes on ``device``, at most two ever allocated."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device, self.buffers = size, device, []

    def free(self, busy: set[int]) -> torch.Tensor:
        """A buffer whose ``id`` is not in ``busy`` (the ones still in flight)."""
        for buf in self.buffers:
            if id(buf) not in busy:
                return buf
        self.buffers.append(torch.empty(self.size, dtype=torch.uint8, device=self.device))
        return self.buffers[-1]


class BucketSource:
    """The source's tensors, bucket by bucket, in the wire manifest's order.

    Args: tensors: ``(name, tensor)`` in wire order; device: the group's device.
    """

    def __init__(self, wire_manifest: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]],
                 device: torch.device) -> None:
        self.wire_manifest, self.tensors, self.device = wire_manifest, tensors, device
        self.contents = bucket_contents(wire_manifest)
        self._large: torch.Tensor | None = None

    def bucket(self, k: int, buffer: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, Callable[[int, int], None] | None]:
        """Bucket ``k``: (its payload view, the memory that must outlive its broadcasts, and for
        a shared bucket ``fill(lo, hi)`` packing bytes ``[lo, hi)`` into ``buffer``; None for a
        chunk, which is the large tensor's own bytes).

        Raises: TransportError when the source ends early or yields another tensor than the
            wire manifest's; whatever the source itself raises.
        """
        b = self.wire_manifest.buckets[k]
        slots = self.contents[k]
        if b.tensor is None:
            parts = [self._next(s).contiguous() for s in slots]
            return buffer[:b.nbytes], buffer, lambda lo, hi: pack_range(buffer, slots, parts, lo, hi)
        if slots[0].bucket == k:
            self._large = self._next(slots[0]).contiguous()
        return chunk_view(self._large, self.wire_manifest, slots[0], b), self._large, None

    def _next(self, slot: TensorSlot) -> torch.Tensor:
        try:
            name, t = next(self.tensors)
        except StopIteration:
            raise TransportError(f"the source ended before {slot.name!r} (truncated)") from None
        slot.check(name, t)
        return t.to(self.device)


def post_bucket(group: TransferGroup, sealer: Sealer, k: int, payload: torch.Tensor,
                fill: Callable[[int, int], None] | None, error: BaseException | None,
                prof: Phases) -> tuple[list[Any], torch.Tensor, BaseException | None]:
    """Post bucket ``k``: its pieces (each packed by ``fill`` and sealed just before it is
    posted), then its header. With ``error`` given, or once packing/sealing raises, the rest is
    posted unsealed and the header says ABORT. Returns (the Works, the header, the error)."""
    state = None if error is not None else sealer.begin(k, payload.numel())
    works = []
    for i, piece in enumerate(pieces(payload)):
        if error is None:
            try:
                if fill is not None:
                    prof.call("pack_s", fill, i * PIECE_BYTES, i * PIECE_BYTES + piece.numel())
                prof.call("seal_s", state.update, piece)
            except BaseException as exc:  # noqa: BLE001 - the sender's own fault: ABORT, reported after
                error = exc
        works.append(group.broadcast(piece))
    flags = protocol.ABORT if error is not None else 0
    seal = prof.call("seal_s", state.seal, flags) if error is None else sealer.seal(k, flags, None)
    hdr = protocol.bucket_header(k, flags, seal, group.device)
    works.append(group.broadcast(hdr))
    return works, hdr, error


def send_buckets(group: TransferGroup, wire_manifest: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]],
                 sealer: Sealer, prof: Phases) -> SourceFailure | None:
    """Step 3 on the sender: every bucket, at most two in flight. Returns None, or the
    :class:`SourceFailure` after which the stream was aborted (the receivers saw ABORT).

    Raises: TransportError when a collective fails (a receiver died, a timeout): the group is
        then closed.
    """
    source = BucketSource(wire_manifest, tensors, group.device)
    buffers = PackBuffers(wire_manifest.bucket_bytes, group.device)
    pending: deque[tuple[list[Any], torch.Tensor, torch.Tensor]] = deque()
    failure, k, works = None, 0, None
    try:
        for k, b in enumerate(wire_manifest.buckets):
            if len(pending) == 2:  # double buffering: bucket k-2's buffer is free after this
                prof.call("wait_s", _wait_all, group, pending.popleft())
            buffer = buffers.free({id(item[-1]) for item in pending})
            error, fill = None, None
            try:
                with prof.timed("source_s"):
                    payload, keep_alive, fill = source.bucket(k, buffer)
            except BaseException as exc:  # noqa: BLE001 - any class: ABORT now, reported after
                error, payload, keep_alive = exc, buffer[:b.nbytes], buffer
            works, hdr, error = post_bucket(group, sealer, k, payload, fill, error, prof)
            pending.append((works, hdr, keep_alive))
            if error is not None:
                failure = SourceFailure(k, error)
                break
        while pending:
            prof.call("wait_s", _wait_all, group, pending.popleft())
        return failure
    except RuntimeError as exc:  # c10d: a peer died or timed out
        pending.clear()  # no Work may outlive this block: gloo closes the group with the last one
        works = None
        message = str(exc)
    raise protocol.lost(group, f"broadcast of bucket {k}/{len(wire_manifest.buckets)} failed "
                               f"(a receiver died?)", message) from None


def _wait_all(group: TransferGroup, item: tuple[list[Any], torch.Tensor, torch.Tensor]) -> None:
    """Wait for a bucket's payload and header broadcasts."""
    for work in item[0]:
        group.wait(work)
