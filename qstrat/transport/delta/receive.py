"""A receiver's half of a delta round's stream (transport protocol 3): per bucket its prelude,
its patch (sealed as any bucket), then the rebuild of the bytes the patch covers and the check
of their digest (:class:`PatchDecoder`), while the sender encodes the next bucket
(:mod:`qstrat.transport.delta.stream` is the sender's half); in a bounded delta round, then the
reload units the verified bucket completes, handed to the loader
(:class:`~qstrat.transport.receive.handoff.StreamUnits`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qstrat.transport.delta import encoding as delta
from qstrat.transport import protocol
from qstrat.transport.security.auth import from_words
from qstrat.transport.buckets import unpack
from qstrat.transport.receive.handoff import StreamUnits, cut_off
from qstrat.transport.group import TransferGroup
from qstrat.transport.security.keys import Secret, equal
from qstrat.transport.security.seal import Sealer, pieces
from qstrat.transport.timing import Phases
from qstrat.transport.wire_manifest import WireManifest

Unit = list[tuple[str, torch.Tensor]]


class PatchDecoder:
    """Rebuilds one delta round's stream bucket by bucket into a new buffer (``base`` is never
    written: the tensors an engine loaded from it stay intact, and it stays the base if the round
    is refused elsewhere).

    Args: info: ``update_info["delta"]`` (checked: :func:`~qstrat.transport.delta.encoding.check_info`);
        target: the round's wire manifest; base: the receiver's base (checked against ``info``
        in the accept vote); secret, mac: key the digests; on_error: called before a DeltaError
        is raised (the receiver drops its base: out of step with the trainer); spare: a buffer
        of the stream's size to rebuild into (its bytes are overwritten; None or another size:
        a new one); spare_round: the round id of the stream ``spare`` holds (None: unknown).

    Each bucket's region is first made equal to the base's: when ``spare`` holds the round the
    base was patched from (``base.parent``), by copying only the bytes that patch changed
    (``base.changes``), else by copying the base's region; then the patch is applied. The
    digest over the whole rebuilt region is checked either way, so a spare that is not what
    ``spare_round`` says (a memory fault, a loader that wrote into a view) is refused as a
    digest mismatch, never loaded.
    """

    def __init__(self, info: dict[str, Any], target: WireManifest, base: delta.Base | None, secret: Secret | None,
                 mac: bytes, on_error: Callable[[], None] = lambda: None, spare: torch.Tensor | None = None,
                 spare_round: str | None = None) -> None:
        self.info, self.target, self.on_error = info, target, on_error
        self.base = base if info.get("base") is not None else None
        size = delta.padded_size(target.total_bytes)
        reuse = spare is not None and spare.numel() == size
        self.stream = spare if reuse else torch.empty(size, dtype=torch.uint8)
        self.cuts = delta.cuts(target)
        self.sealer = delta.digest_sealer(secret, mac, info, target.digest)
        b = self.base
        #: Per bucket the bytes taking ``spare`` to the base (None: copy the base's regions).
        self.catch_up = (b.changes if reuse and b is not None and spare_round is not None and b.parent == spare_round
                         and b.changes is not None and len(b.changes) == len(self.cuts) - 1 else None)
        self._changes: list[delta.Changes] = []
        #: The new base once :meth:`staged` ran (None before).
        self.new_base: delta.Base | None = None

    def limit(self, k: int) -> int:
        """The most payload bytes bucket ``k`` may announce (:func:`~qstrat.transport.delta.encoding.patch_limit`)."""
        return delta.patch_limit((self.cuts[k + 1] - self.cuts[k]) // delta.TILE)

    def apply(self, k: int, payload: torch.Tensor) -> None:
        """Rebuild bucket ``k``'s bytes from ``payload`` (digest, then patch; 1-D uint8) and check
        the digest. Raises: DeltaError (status DELTA) for a patch that does not decode or a digest
        that differs from the trainer's (naming the bucket's tensors)."""
        lo, hi = self.cuts[k], self.cuts[k + 1]
        try:
            if payload.numel() < delta.DIGEST_BYTES:
                raise delta.DeltaError(f"the delta payload of bucket {k} is shorter than its digest", protocol.DELTA)
            old = None if self.base is None else self.base.stream[lo:hi]
            if self.catch_up is not None:
                self.catch_up[k].catch_up(self.stream[lo:hi], old)
            region = delta.decode_patch(payload[delta.DIGEST_BYTES:].cpu(), old, hi - lo, self.stream[lo:hi],
                                        holds_base=self.catch_up is not None, changes=self._changes)
            got = delta.region_digest(self.sealer, k, region)
            if not equal(got, bytes(payload[:delta.DIGEST_BYTES].cpu().numpy())):
                raise delta.DeltaError(
                    f"bucket {k} ({delta.region_names(self.target, lo, hi)}): the rebuilt bytes' digest differs "
                    f"from the trainer's (base and trainer out of step?)", protocol.DELTA)
        except delta.DeltaError:
            self.on_error()
            raise

    def staged(self) -> Unit:
        """After every bucket applied: the target tensors (views of the rebuilt stream, wire
        order); the new base is :attr:`new_base`."""
        views = [self.stream[b.stream_offset:b.stream_offset + b.nbytes] for b in self.target.buckets]
        parent = self.base.round_id if self.base is not None else None
        self.new_base = delta.Base(self.info["round"], self.target.digest, self.stream, parent,
                                   self._changes if parent is not None else None)
        return unpack(self.target, views)


def receive_patches(group: TransferGroup, target: WireManifest, seal: Sealer, decoder: PatchDecoder,
                    stats: dict[str, float], units: StreamUnits | None = None) -> tuple[Unit, tuple[int, str] | None]:
    """Step 3 of a delta round on a receiver: every bucket's prelude, payload and header; the
    next prelude is posted before this bucket is rebuilt. Keeps receiving after a failure so the
    collectives stay aligned. ``units`` (a bounded delta round): once bucket k's digest
    verified, the units it completes are handed (:meth:`StreamUnits.hand`); none after a failure.
    Returns (the staged tensors, or [] after a failure; the first failure ``(status, message)``
    or None); ``stats`` gets ``wait_s``, ``seal_s``, ``rebuild_s`` and ``load_s``. Raises:
    TransportError (the group closed) when the sender is lost, or announces a payload larger
    than any patch of its bucket (nothing is allocated for it); MixedWeightsError (the group
    closed) for either after ``units`` handed one."""
    n, rank = len(target.buckets), group.rank
    prof = Phases("wait_s", "seal_s", "rebuild_s", "load_s")
    failure: tuple[int, str] | None = None

    def prelude() -> tuple[torch.Tensor, Any]:
        pre = torch.empty(protocol.PRELUDE_WORDS, dtype=torch.int64, device=group.device)
        return pre, group.broadcast(pre)

    k, nxt, error = 0, (prelude() if n else None), None
    try:
        for k in range(n):
            pre, work = nxt
            prof.call("wait_s", group.wait, work)
            magic, index, nbytes, flags = (int(v) for v in pre.cpu())
            if flags & protocol.ABORT:
                failure = failure or (protocol.SENDER_ABORT, f"rank {rank}: the sender aborted the stream at "
                                                             f"bucket {k}/{n}")
                break
            if magic != protocol.PRELUDE_MAGIC or index != k or not 0 < nbytes <= decoder.limit(k):
                error = (f"bucket {k}/{n}: the sender announced a delta payload of {nbytes} bytes (prelude "
                         f"{magic:#x}, index {index}; at most {decoder.limit(k)}): nothing allocated")
                break
            payload = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
            cut = pieces(payload)
            works = [group.broadcast(p) for p in cut]
            hdr = torch.empty(protocol.BUCKET_WORDS, dtype=torch.int64, device=group.device)
            w_hdr = group.broadcast(hdr)
            state = seal.begin(k, nbytes) if failure is None else None
            for piece, w in zip(cut, works):
                prof.call("wait_s", group.wait, w)
                if state is not None:
                    prof.call("seal_s", state.update, piece)
            prof.call("wait_s", group.wait, w_hdr)
            works = w = w_hdr = work = None
            nxt = prelude() if k + 1 < n else None  # the sender's next prelude lands while this one rebuilds
            if failure is not None:
                continue
            words = [int(v) for v in hdr.cpu()]
            if words[0] != protocol.BUCKET_MAGIC or words[1] != k or words[2] or not prof.call(
                    "seal_s", state.verifies, words[2], from_words(words[3:7])):
                failure = (protocol.CHECKSUM, f"rank {rank}: delta bucket {k}/{n} failed its checksum (seal "
                                              f"mismatch; {delta.region_names(target, *decoder.cuts[k:k + 2])})")
                continue
            try:
                prof.call("rebuild_s", decoder.apply, k, payload)
            except delta.DeltaError as exc:
                failure = (exc.vote_status, f"rank {rank}: {exc}")
                continue
            if units is not None:
                failure = prof.call("load_s", units.hand, k, decoder.stream, rank)
    except RuntimeError as exc:  # c10d: the sender (or a peer) died or timed out
        error = f"stream truncated at delta bucket {k}/{n} (sender lost?): {exc}"
    nxt = work = works = w = w_hdr = None  # no Work may outlive this function when the group closes
    stats.update(prof)
    if error is not None and units is not None and units.handed:
        raise cut_off(group, "delta stream", error, units.handed, units.units) from None
    if error is not None:
        raise protocol.lost(group, "delta stream", error) from None
    return (decoder.staged() if failure is None else []), failure
