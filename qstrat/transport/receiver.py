"""Receiver side of a transfer round: check the wire manifest, receive and verify every bucket, stage.

:func:`receive_round` runs the receiver's half of :mod:`qstrat.transport.protocol` and returns
the round's tensors only when every rank voted to commit; it never touches an engine. The vLLM
backend (:mod:`qstrat.engine.transfer_backend`) and :class:`StandaloneReceiver` (no engine:
benchmarks, tests, a checkpoint writer) both build on it.

Staging: a round's tensors stay in the received bucket buffers (tensors are views of them) until
the commit vote; peak memory is the round's payload bytes (:attr:`WireManifest.total_bytes`) on the
group's device, plus two bucket headers.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qstrat.errors import TransportError, WireManifestMismatchError
from qstrat.transport import protocol as p
from qstrat.transport.buckets import checksum, receive_buffers, unpack
from qstrat.transport.group import TransferGroup, open_group
from qstrat.transport.wire_manifest import WireManifest

Check = Callable[[WireManifest], None]


def receive_round(group: TransferGroup, wire_manifest_doc: dict[str, Any], check: Check | None = None
                  ) -> list[tuple[str, torch.Tensor]]:
    """Receive one round from rank 0.

    Args:
        group: the open transfer group (this rank > 0).
        wire_manifest_doc: the round's wire manifest as sent in ``update_info``
            (:meth:`WireManifest.to_dict`).
        check: raises WireManifestMismatchError if the wire manifest does not match the engine (run
            before any data is received).
    Returns: ``(name, tensor)`` in wire order, views of the received buffers on
        ``group.device``, every bucket checksum-verified, every rank agreeing to commit.
    Raises: WireManifestMismatchError (wire manifest malformed, digest mismatch, engine check failed:
        the round is refused at step 2, no data flows); TransportError for a failed checksum,
        a sender abort, another rank's refusal, or a lost peer/timeout (the group is closed).
    """
    rejection: Exception | None = None
    wire_manifest = None
    try:
        wire_manifest = WireManifest.from_dict(wire_manifest_doc)
        if check is not None:
            check(wire_manifest)
    except TransportError as exc:
        rejection = exc
    header = torch.empty(8, dtype=torch.int64, device=group.device)
    try:
        group.wait(group.broadcast(header))
    except RuntimeError as exc:
        raise p.lost(group, "no round header from the sender", exc) from None
    if rejection is None and not torch.equal(header.cpu(), p.round_header(
            len(wire_manifest.buckets), wire_manifest.total_bytes, wire_manifest.digest,
            torch.device("cpu"))):
        rejection = WireManifestMismatchError(
            f"rank {group.rank}: the sender streams another wire manifest than the one in update_info "
            f"(digest {wire_manifest.digest[:12]}...)")
    statuses = _vote(group, p.REJECTED if rejection else p.OK, "accept vote")
    if rejection is not None:
        raise rejection
    if any(statuses):
        raise TransportError(f"rank {group.rank}: round refused before any data: {p.describe(statuses)}")
    received, failure = _receive_buckets(group, wire_manifest)
    statuses = _vote(group, failure[0] if failure else p.OK, "commit vote")
    if failure:
        raise TransportError(failure[1])
    if any(statuses):
        raise TransportError(f"rank {group.rank}: round not committed: {p.describe(statuses)}")
    return unpack(wire_manifest, received)


def _receive_buckets(group: TransferGroup, wire_manifest: WireManifest
                     ) -> tuple[list[torch.Tensor], tuple[int, str] | None]:
    """Step 3: receive every bucket (next one posted while this one is verified); keep
    receiving after a bad checksum so the collectives stay aligned. Returns the buffers and the
    first failure ``(status, message)`` or None."""
    buffers = list(receive_buffers(wire_manifest, group.device))
    n = len(buffers)
    failure: tuple[int, str] | None = None

    def post(k: int) -> tuple[torch.Tensor, Any, Any]:
        hdr = torch.empty(4, dtype=torch.int64, device=group.device)
        return hdr, group.broadcast(hdr), group.broadcast(buffers[k][1])

    pending = post(0) if n else None
    for k in range(n):
        hdr, w_hdr, w_data = pending
        try:
            group.wait(w_hdr)
            magic, index, crc, flags = (int(v) for v in hdr.cpu())
            if flags & p.ABORT:
                group.wait(w_data)
                return [b for _, b in buffers], (p.SENDER_ABORT, f"rank {group.rank}: the sender "
                                                 f"aborted the stream at bucket {k}/{n}; nothing loaded")
            pending = post(k + 1) if k + 1 < n else None
            group.wait(w_data)
        except RuntimeError as exc:  # c10d: the sender (or a peer) died or timed out
            error = str(exc)
            pending = hdr = w_hdr = w_data = None
            raise p.lost(group, f"stream truncated at bucket {k}/{n} (sender lost?)", error) from None
        if failure is None and (magic != p.BUCKET_MAGIC or index != k):
            failure = (p.CHECKSUM, f"rank {group.rank}: bucket {k}/{n} arrived out of order (header {index})")
        elif failure is None and checksum(buffers[k][1]) != crc:
            failure = (p.CHECKSUM, f"rank {group.rank}: bucket {k}/{n} failed its CRC-32 checksum "
                                   f"(tensors {_names(wire_manifest, k)}); nothing loaded")
    return [b for _, b in buffers], failure


def _names(wire_manifest: WireManifest, k: int) -> list[str]:
    names = [s.name for s in wire_manifest.slots if s.bucket <= k < s.bucket + s.chunks]
    return names[:3] + (["..."] if len(names) > 3 else [])


def _vote(group: TransferGroup, status: int, what: str) -> list[int]:
    try:
        return p.vote(group, status)
    except RuntimeError as exc:
        raise p.lost(group, f"{what} failed (a peer died?)", exc) from None


class StandaloneReceiver:
    """A receiver without an engine, speaking the same four weight-sync calls as a vLLM engine
    with ``weight_transfer_config={"backend": "qstrat"}`` (``init_weight_transfer_engine``,
    ``start_weight_update``, ``update_weights``, ``finish_weight_update``).

    Committed tensors land in :attr:`tensors` (name -> tensor). ``expected``: name ->
    (dtype name, shape) the wire manifest is checked against (None: accept any wire manifest).
    """

    def __init__(self, expected: dict[str, tuple[str, tuple[int, ...]]] | None = None) -> None:
        self.expected = expected
        self.group: TransferGroup | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self._staged: list[tuple[str, torch.Tensor]] | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the group: ``init_info`` as :class:`qstrat.transport.sender.RefitSender` sends it."""
        self.shutdown()
        self.group = open_group(init_info["master_address"], init_info["master_port"],
                                init_info["rank_offset"], init_info["world_size"],
                                init_info.get("backend", "gloo"), init_info.get("timeout_s", 60.0))

    def start_weight_update(self) -> None:
        """Begin a session: drop any staged round (:attr:`tensors` keeps the last commit)."""
        self._staged = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one round (``{"wire_manifest": WireManifest.to_dict()}``) into staging; raises like
        :func:`receive_round`."""
        from qstrat.transport.wire_manifest import check_against

        if self.group is None or self.group.pg is None:
            raise TransportError("init_weight_transfer_engine first (no open transfer group)")
        check = None if self.expected is None else (lambda m: check_against(m, self.expected))
        self._staged = receive_round(self.group, update_info["wire_manifest"], check)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Commit the staged round to :attr:`tensors`. Raises TransportError without one."""
        if self._staged is None:
            raise TransportError("finish_weight_update without a received round")
        self.tensors = dict(self._staged)
        self._staged = None

    def shutdown(self) -> None:
        """Close the transfer group."""
        if self.group is not None:
            self.group.close()
            self.group = None
