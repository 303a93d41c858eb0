"""The sender's half of a delta round's stream (transport protocol 3): bucket by bucket, quantize
into the round's stream, compare with the base, code the patch and digest the rebuilt bytes
(:class:`PatchEncoder`), and post it (:func:`send_patches`) while the receivers rebuild the
bucket before.

Per bucket k on the wire (:mod:`qstrat.transport.protocol`, step 3 of a delta round): a PRELUDE
(int64[4]: magic, k, payload bytes, flags) so that each receiver allocates the payload, then the
payload (:data:`~qstrat.transport.delta.encoding.DIGEST_BYTES` of digest, then the patch) in pieces, then
the bucket header with its seal, exactly as a full round's bucket. ``flags = ABORT`` in a prelude
(payload 0 bytes, nothing follows): the sender's own side failed at bucket k; every rank goes to
the commit vote.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from qstrat.errors import TransportError
from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.ahead import LookAhead
from qstrat.transport.delta.digest import RegionDigests
from qstrat.transport.delta.written import WriteLog, reread_logged
from qstrat.transport import protocol
from qstrat.transport.group import TransferGroup
from qstrat.transport.security.keys import Secret
from qstrat.transport.send.outgoing import SourceFailure, post_bucket
from qstrat.transport.security.seal import Sealer
from qstrat.transport.timing import Phases
from qstrat.transport.wire_manifest import WireManifest

#: Buckets a sender keeps in flight (their payloads alive) before it waits for the oldest.
WINDOW = 3


class PatchEncoder:
    """One delta round's buckets as payloads, encoded one at a time against ``base``.

    Args:
        target: the full round's wire manifest.
        tensors: ``(name, tensor)`` in its slot order, pulled as buckets are asked for; or None
            with ``stream`` already filled (a round sent again whole).
        base: the base both sides hold (None: every tile raw; one of another layout is not used).
        stream: the buffer of the round's stream (1-D uint8 CPU, :func:`~qstrat.transport.delta.encoding.
            padded_size` bytes; None: a new one).
        look_ahead: pull the tensors of the buckets after k on a second thread, each bucket
            encoded there right after it is written once :meth:`start` keyed the digests, while
            bucket k is posted (:class:`~qstrat.transport.delta.ahead.LookAhead`; ``tensors``
            must not wait on the caller: a mesh pair's queue, filled as the round goes, cannot);
            :meth:`close` ends it.
        log: the write log of the parts ``tensors`` are views of (the sender's requantizer's,
            :mod:`qstrat.transport.delta.written`; None: none). With it and a base that kept its
            marks, ``stream`` is first made equal to the base - by copying only the bytes the
            base's round changed when ``stream`` holds that round's parent (``stream_round``),
            else the base's bytes whole - and then only the bytes the log says were written
            since the base are copied and compared.
        stream_round: the round id of the stream ``stream`` holds (None: unknown).
    """

    def __init__(self, target: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]] | None,
                 base: delta.Base | None, stream: torch.Tensor | None = None, look_ahead: bool = False,
                 log: WriteLog | None = None, stream_round: str | None = None) -> None:
        self.target = target
        self.base = base if base is not None and base.target == target.digest else None
        #: ``update_info["delta"]``: the base's round id (None: a whole round) and this round's.
        self.info: dict[str, Any] = {"base": self.base.round_id if self.base else None,
                                     "round": secrets.token_hex(16)}
        if stream is None:  # a normal tensor even under the caller's inference mode: the look-ahead
            with torch.inference_mode(False):  # thread (outside it) writes it, later rounds reuse it
                stream = torch.empty(delta.padded_size(target.total_bytes), dtype=torch.uint8)
        self.stream = stream
        self.writer = (delta.StreamWriter(target, tensors, self.stream, log, self.base, stream_round)
                       if tensors is not None else None)
        self._ahead = (LookAhead(self._step, len(target.buckets) - 1)
                       if look_ahead and self.writer is not None and target.buckets else None)
        self.cuts = delta.cuts(target)
        self.tiles: dict[str, int] = {}
        #: Payload bytes encoded; seconds in the source (quantizing, on whichever thread) and
        #: encoding (compare, patch, digest).
        self.wire_bytes, self.source_s, self.encode_s = 0, 0.0, 0.0
        #: Buckets encoded so far; what the source raised (the round was then aborted).
        self.done, self.source_error = 0, None
        self._digests: RegionDigests | None = None
        # buckets encoded but not yet taken, the next to encode, and who encodes it (the look-ahead
        # right after writing it, while its bytes are in cache, or the caller of payload())
        self._encoded: dict[int, torch.Tensor] = {}
        self._next, self._encoding = 0, threading.Lock()
        #: Per bucket encoded against the base, the bytes its patch changed (the new base's
        #: :attr:`~qstrat.transport.delta.encoding.Base.changes`).
        self._changes: list[delta.Changes] = []

    def begin(self) -> None:
        """Start the look-ahead's source now (a round's sender calls this before the engines'
        accept vote, so the first buckets are quantized while they answer; without a look-ahead:
        nothing). A refusal before any data then finds the source running: :meth:`whole` waits
        for it to write the whole stream and :meth:`close` stops it. No thread to be had (a
        process at its thread limit): the source runs on the caller's thread in :meth:`payload`
        instead (the look-ahead is only a speed-up; the round, and its base, go on)."""
        if self._ahead is not None:
            try:
                self._ahead.start()
            except RuntimeError:
                self._ahead = None

    def start(self, secret: Secret | None, mac: bytes) -> None:
        """Key the digests for the round whose MAC is ``mac`` (before the first :meth:`payload`)."""
        sealer = delta.digest_sealer(secret, mac, self.info, self.target.digest)
        self._digests = RegionDigests(sealer, self.base.row_sums if self.base is not None else None)

    def payload(self, k: int) -> torch.Tensor:
        """Bucket ``k``'s payload (1-D uint8 CPU: digest, then patch), buckets in order.
        Raises: what the source raises; TransportError for a tensor off its slot or a source
        that yields more tensors than the target holds."""
        if self._ahead is not None:
            self._ahead.take(k)
        elif self.writer is not None:
            self.source_s += self._timed_write(k)
        self._encode_upto(k)
        self.done = k + 1
        return self._encoded.pop(k)

    def _step(self, k: int) -> None:
        """The look-ahead's step: bucket ``k`` into the stream, then, once the digests are keyed
        (:meth:`start`), encoded at once on this thread while its bytes are in this core's cache."""
        self.source_s += self._timed_write(k)
        if self._digests is not None:
            self._encode_upto(k)

    def _encode_upto(self, k: int) -> None:
        """Encode every bucket up to ``k`` not encoded yet, in order (digests are in bucket order)."""
        with self._encoding:
            while self._next <= k:
                self._encoded[self._next] = self._encode(self._next)
                self._next += 1

    def _encode(self, k: int) -> torch.Tensor:
        """Bucket ``k``'s payload from its region of the stream (written) and the base's."""
        t1 = time.perf_counter()
        lo, hi = self.cuts[k], self.cuts[k + 1]
        region = self.stream[lo:hi]
        old = self.base.stream[lo:hi] if self.base is not None else None
        changed = None
        if old is not None:
            pieces = self.writer.pieces if self.writer is not None else None
            changed = (pieces.changed(lo, hi, region, old, delta.changed_bytes) if pieces is not None
                       else delta.changed_bytes(region, old))
            self._changes.append(delta.Changes(changed.to(torch.int32) if hi - lo < 2**31 else changed,
                                               changed.new_empty(0)))
        patch, tiles = delta.encode_patch(region, old, changed)
        digest = self._digests.digest(k, region, old, changed)
        for kind, n in tiles.items():
            self.tiles[kind] = self.tiles.get(kind, 0) + n
        out = torch.cat([torch.frombuffer(bytearray(digest), dtype=torch.uint8), patch])
        self.wire_bytes += out.numel()
        self.encode_s += time.perf_counter() - t1
        return out

    def _write(self, k: int) -> None:
        """Bucket ``k``'s tensors into the stream (after the last bucket: check the source is spent)."""
        self.writer.upto(k)
        if k == len(self.target.buckets) - 1:
            self.writer.finish()

    def _timed_write(self, k: int) -> float:
        """:meth:`_write`, timed (seconds), outside inference mode on either thread (the
        look-ahead's is outside it anyway): what the source writes in place (a requantizer's
        entries) stays a normal tensor that a later round's source thread may update
        (:mod:`qstrat.transport.delta.ahead`)."""
        t0 = time.perf_counter()
        with torch.inference_mode(False):
            self._write(k)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Wait for a bucket pulled ahead and stop the look-ahead thread (a round that failed
        part-way: its source must not run on beside the sender's cleanup). Idempotent."""
        if self._ahead is not None:
            self._ahead.close()

    @property
    def copied_whole(self) -> int:
        """Bytes of the stream's tensors copied whole (and compared whole with the base); the
        others came from the write log (:class:`~qstrat.transport.delta.written.Pieces`)."""
        return self.writer.copied_whole if self.writer is not None else self.target.total_bytes

    @property
    def kind(self) -> str:
        """``full`` when every tile went raw, else ``delta``."""
        return "full" if set(self.tiles) <= {"raw"} else "delta"

    @property
    def complete(self) -> bool:
        """Whether every bucket was encoded (the stream is the round's)."""
        return self.done == len(self.target.buckets)

    def new_base(self) -> delta.Base:
        """The base once every engine committed this round: its id, layout and stream."""
        kept = self._digests.kept() if self._digests is not None and self.complete else None
        marks = self.writer.marks if self.writer is not None and self.complete else None
        changes = self._changes if self.base is not None and len(self._changes) == len(self.target.buckets) else None
        return delta.Base(self.info["round"], self.target.digest, self.stream,
                          self.base.round_id if changes is not None else None, changes, kept, marks)

    def _reread(self) -> None:
        """Before this round's complete stream is sent again whole: the slots written from the
        write log read again from their parts (:func:`~qstrat.transport.delta.written.reread_logged`)."""
        if self.writer is not None and self.writer.pieces is not None and self.writer.marks:
            reread_logged(self.stream, self.target, self.writer.log, self.writer.marks)

    def whole(self) -> PatchEncoder:
        """The same round for a whole resend (every tile raw): from this round's stream once
        complete, else from its source when no bucket was encoded yet (refused before any data).
        Raises: TransportError when the round stopped part-way (its source is spent); what the
            source raised, when it ran ahead (:meth:`begin`) and failed (:attr:`source_error`)."""
        if not self.done and self._ahead is not None and self._ahead.started:
            try:  # the source ran ahead of the refusal: let it write the rest of the stream
                self._ahead.take(len(self.target.buckets) - 1)
            except BaseException as exc:
                self.source_error = exc
                raise
            self._reread()
            again = PatchEncoder(self.target, None, None, self.stream)
            again.source_s = self.source_s  # the source's seconds belong to the round it wrote
            return again
        self.close()
        if self.complete:
            self._reread()
            return PatchEncoder(self.target, None, None, self.stream)
        if self.done or self.writer is None:
            raise TransportError(f"delta stream: a round stopped at bucket {self.done} cannot be sent again whole")
        return PatchEncoder(self.target, self.writer.tensors, None, self.stream, self._ahead is not None)


def encode_round(target: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]], base: delta.Base | None,
                 secret: Secret | None = None, mac: bytes = bytes(32)) -> tuple[PatchEncoder, list[torch.Tensor]]:
    """Every bucket's payload of the round of ``tensors`` against ``base``, in process (no wire:
    measurement and tests), digests keyed by ``mac``. Returns (the encoder: stream, tiles, new
    base; the payloads in bucket order). Raises: as :meth:`PatchEncoder.payload`."""
    enc = PatchEncoder(target, tensors, base)
    enc.start(secret, mac)
    payloads = [enc.payload(k) for k in range(len(target.buckets))]
    if not target.buckets:
        enc.writer.finish()
    return enc, payloads


def send_patches(group: TransferGroup, target: WireManifest, encoder: PatchEncoder, sealer: Sealer,
                 prof: Phases) -> SourceFailure | None:
    """Step 3 of a delta round on the sender: per bucket its prelude, payload and header, at most
    :data:`WINDOW` buckets in flight. Returns None, or the :class:`SourceFailure` after which the
    stream was aborted (an ABORT prelude: the receivers go to the commit vote).
    Raises: TransportError when a collective fails (a receiver died, a timeout): the group is
        then closed."""
    encoder.start(sealer.secret, sealer.mac)
    pending: deque[tuple[list[Any], list[torch.Tensor]]] = deque()
    failure, k, n = None, 0, len(target.buckets)
    try:
        for k in range(n):
            if len(pending) == WINDOW:
                prof.call("wait_s", _wait_all, group, pending.popleft())
            try:
                with prof.timed("source_s"):
                    payload = encoder.payload(k).to(group.device)
            except BaseException as exc:  # noqa: BLE001 - the sender's own fault: ABORT, reported after
                encoder.source_error = exc
                failure = SourceFailure(k, exc)
                pre = protocol.patch_prelude(k, 0, protocol.ABORT, group.device)
                pending.append(([group.broadcast(pre)], [pre]))
                break
            pre = protocol.patch_prelude(k, payload.numel(), 0, group.device)
            first = group.broadcast(pre)
            works, hdr, _ = post_bucket(group, sealer, k, payload, None, None, prof)
            pending.append(([first, *works], [pre, payload, hdr]))
        while pending:
            prof.call("wait_s", _wait_all, group, pending.popleft())
        return failure
    except RuntimeError as exc:  # c10d: a peer died or timed out
        pending.clear()  # no Work may outlive this block: gloo closes the group with the last one
        message = str(exc)
    raise protocol.lost(group, f"broadcast of delta bucket {k}/{n} failed (a receiver died?)", message) from None


def _wait_all(group: TransferGroup, item: tuple[list[Any], list[torch.Tensor]]) -> None:
    """Wait for one bucket's broadcasts."""
    for work in item[0]:
        group.wait(work)
