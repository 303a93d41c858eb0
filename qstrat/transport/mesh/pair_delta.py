"""Delta mode per (sender, engine rank) pair in a mesh round (docs/transport.md, "Mesh delta rounds").

Each pair keeps its own BASE: the pair stream (the pair wire manifest's tensors at their stream
offsets, :mod:`qstrat.transport.delta.encoding`) of the last mesh round both sides committed.
A delta mesh round is an atomic mesh round (:mod:`qstrat.transport.mesh.steps`; mode
:data:`MODE` in the round MAC) whose pairs carry, per bucket of the pair's wire manifest, the
patch against the pair's base with the digest of the rebuilt bytes - the single sender's delta
encoding, encoder and decoder (:class:`~qstrat.transport.delta.stream.PatchEncoder`,
:class:`~qstrat.transport.delta.receive.PatchDecoder`, :class:`~qstrat.transport.delta.rebuild.DeltaRebuild`),
each keyed by the pair MAC - while the whole mesh keeps ONE accept and ONE commit vote:

- step 3, the PAIR HEADER grows by the pair's base round id and new round id (16 bytes each,
  :data:`HEAD_WORDS`; no base: zeros); an engine rank that does not hold a pair's base votes
  STALE_BASE in the accept vote, before any data;
- step 5, per pair bucket ``k`` of ``n``: a PRELUDE (int64[4], :func:`~qstrat.transport.protocol.patch_prelude`,
  tag ``2n + 1 + k``) announcing the payload's bytes (at most the bucket's largest patch: a larger
  one closes the group before anything is allocated), the payload (digest + patch, tag ``2k + 1``)
  and the bucket header with the pair seal (tag ``2k + 2``); an ABORT prelude ends the pair's
  stream. A rebuilt bucket whose digest differs from the trainer's votes DELTA at the commit vote;
- when every refusal of a vote was delta-only (STALE_BASE, DELTA), every rank raises
  DeltaRefused and the SAME call runs the round once more, every pair whole (raw tiles, no base;
  from the pair streams already encoded when the refusal came at the commit vote, else from
  the source): :class:`DeltaMeshSender` and :class:`DeltaMeshReceiver` (``attempts`` 2 and the
  refusal in the report); any other failure is an atomic mesh round's (nothing loaded).

After a commit each pair's new stream is its base on both sides; a round that failed after this
sender rank sent data leaves its pairs without a base (their next round goes whole).
"""
from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from qstrat.errors import MixedWeightsError, TransportError, WireManifestMismatchError
from qstrat.transport import protocol as proto
from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.rebuild import DeltaRebuild
from qstrat.transport.delta.stream import PatchEncoder
from qstrat.transport.group import TransferGroup
from qstrat.transport.mesh import steps as mesh
from qstrat.transport.mesh.receiver import MeshReceiver, Unit, receive_mesh_round
from qstrat.transport.mesh.routing import MeshRoutes
from qstrat.transport.mesh.sender import MeshReport, MeshSender, PairOut
from qstrat.transport.security.auth import from_words
from qstrat.transport.security.seal import Sealer
from qstrat.transport.send.report import DeltaReport
from qstrat.transport.wire_manifest import WireManifest

#: The mode a delta mesh round binds into its MAC.
MODE = "mesh-delta"
#: int64 words of a delta pair header: the atomic one's, the base round id, the new round id.
HEAD_WORDS = mesh.PAIR_WORDS + 4


def id_words(round_id: str | None) -> list[int]:
    """A round id (32 hex digits: 16 bytes) as two int64 words; None (no base): zeros.
    Raises: ValueError for an id of another form."""
    return [0, 0] if round_id is None else list(struct.unpack("<2q", bytes.fromhex(round_id)))


def id_from(words: list[int]) -> str | None:
    """Inverse of :func:`id_words`."""
    return None if not any(words) else struct.pack("<2q", *words).hex()


def prelude_tag(n: int, k: int) -> int:
    """The point-to-point tag of bucket ``k``'s prelude in a pair stream of ``n`` buckets (after
    the bucket payload and header tags ``2k + 1``, ``2k + 2`` and the pair header's 0)."""
    return 2 * n + 1 + k


class PairQueue:
    """The parts pushed to one pair and not yet written into its stream: the iterator a pair's
    :class:`~qstrat.transport.delta.stream.PatchEncoder` pulls (ends when empty)."""

    def __init__(self) -> None:
        self.items: deque[tuple[str, torch.Tensor]] = deque()

    def __iter__(self) -> PairQueue:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if not self.items:
            raise StopIteration
        return self.items.popleft()


class PairDeltaOut(PairOut):
    """This rank's delta stream to engine rank ``dst``: :class:`~qstrat.transport.mesh.sender.PairOut`'s
    pushing and flow control, each bucket ``encoder.payload(k)`` (digest + patch, encoded as soon
    as its tensors are pushed) after its prelude. Args as ``PairOut``; encoder: the pair's
    :class:`~qstrat.transport.delta.stream.PatchEncoder` (its digests keyed here by the pair MAC)."""

    def __init__(self, group: TransferGroup, dst: int, wm: WireManifest, sealer: Sealer, encoder: PatchEncoder) -> None:
        super().__init__(group, dst, wm, sealer)
        self.encoder = encoder
        encoder.start(sealer.secret, sealer.mac)
        self.firsts = [0] * len(wm.buckets)  # tensors each bucket's encoding pulls (its first chunks)
        if encoder.writer is not None:
            self.queue = encoder.writer.tensors.items
            for slot in wm.slots:
                self.firsts[slot.bucket] += 1

    def _needs(self, k: int) -> int:
        return self.firsts[k]

    def _post_next(self) -> None:
        """Encode bucket :attr:`k` and post its prelude, payload and header."""
        self._send(self.encoder.payload(self.k).to(self.group.device), 0)

    def _send(self, payload: torch.Tensor | None, flags: int) -> None:
        k, n, g = self.k, len(self.wm.buckets), self.group
        pre = proto.patch_prelude(k, 0 if payload is None else payload.numel(), flags, g.device)
        works, keep = [g.send(pre, self.dst, prelude_tag(n, k))], [pre]
        if payload is not None:
            hdr = proto.bucket_header(k, flags, self.sealer.seal(k, flags, payload), g.device)
            works += [g.send(payload, self.dst, 2 * k + 1), g.send(hdr, self.dst, 2 * k + 2)]
            keep += [payload, hdr]
            self.sent += payload.numel()
        self.works.append((works[0], works[-1], self.wm.buckets[k].stream_offset, time.perf_counter(), (works, keep),
                           None))
        self.k += 1

    def abort(self) -> None:
        """Tell the engine rank at once (an ABORT prelude, nothing after it), end the stream."""
        if self.k < len(self.wm.buckets):
            self._send(None, proto.ABORT)
        self.k = len(self.wm.buckets)

    def wait_oldest(self) -> None:
        """Wait for the oldest bucket's sends. Raises TransportError when one failed (the group is
        then closed)."""
        works, _ = self.works.popleft()[4]
        for w in works:
            mesh.wait(self.group, w, f"send to rank {self.dst} failed (an engine rank died?)")

    def finish(self) -> None:
        """Post every bucket left (a stream resent whole needs no more tensors) and wait for all.
        Raises TransportError when the source left buckets unsent."""
        while self.k < len(self.wm.buckets):
            self.pump()
            if self.k < len(self.wm.buckets):
                if not self.works:
                    break
                self.wait_oldest()
        super().finish()


class PairDeltaIn:
    """One trainer rank's delta stream into this rank, on a thread of its own (:meth:`run`):
    per bucket the prelude, the payload and its header (the next prelude posted before this
    bucket is rebuilt), the pair seal checked, then the rebuild and digest check by ``decoder``
    (:class:`~qstrat.transport.delta.receive.PatchDecoder`). ``failure``: the first
    ``(vote status, reason)``; ``bytes``: payload bytes received."""

    def __init__(self, group: TransferGroup, src: int, wm: WireManifest, sealer: Sealer, decoder: Any) -> None:
        self.group, self.src, self.wm, self.sealer, self.decoder = group, src, wm, sealer, decoder
        self.failure: tuple[int, str] | None = None
        self.bytes = 0

    def _prelude(self, k: int) -> tuple[torch.Tensor, Any]:
        pre = torch.empty(proto.PRELUDE_WORDS, dtype=torch.int64, device=self.group.device)
        return pre, self.group.recv(pre, self.src, prelude_tag(len(self.wm.buckets), k))

    def run(self) -> None:
        """Receive, verify and rebuild every bucket (after a failure the rest is received
        unchecked, so the sender's stream ends; after an ABORT nothing more comes).
        Raises: TransportError when the sender is lost, times out, or announces a payload larger
        than any patch of its bucket (nothing allocated); the group is then closed."""
        g, n = self.group, len(self.wm.buckets)
        nxt = self._prelude(0) if n else None
        for k in range(n):
            (pre, w_pre), nxt = nxt, None
            what = f"delta stream from rank {self.src} truncated at bucket {k}/{n} (sender lost?)"
            mesh.wait(g, w_pre, what)
            del w_pre
            magic, index, nbytes, flags = (int(v) for v in pre.cpu())
            where = f"rank {g.rank}: delta bucket {k}/{n} from trainer rank {self.src}"
            if flags & proto.ABORT:
                self.failure = self.failure or (proto.SENDER_ABORT, f"{where}: the sender aborted the stream")
                return
            if magic != proto.PRELUDE_MAGIC or index != k or not 0 < nbytes <= self.decoder.limit(k):
                raise proto.lost(g, f"delta stream from rank {self.src}",
                                 f"bucket {k}/{n}: the sender announced a delta payload of {nbytes} bytes (prelude "
                                 f"{magic:#x}, index {index}; at most {self.decoder.limit(k)}): nothing allocated")
            payload = torch.empty(nbytes, dtype=torch.uint8, device=g.device)
            hdr = torch.empty(proto.BUCKET_WORDS, dtype=torch.int64, device=g.device)
            w_data, w_hdr = g.recv(payload, self.src, 2 * k + 1), g.recv(hdr, self.src, 2 * k + 2)
            mesh.wait(g, w_data, what)
            mesh.wait(g, w_hdr, what)
            del w_data, w_hdr
            self.bytes += nbytes
            nxt = self._prelude(k + 1) if k + 1 < n else None  # lands while this bucket is rebuilt
            if self.failure is not None:
                continue
            words = [int(v) for v in hdr.cpu()]
            if words[0] != proto.BUCKET_MAGIC or words[1] != k or words[2]:
                self.failure = (proto.CHECKSUM, f"{where} arrived out of order (header {words[1]})")
            elif not self.sealer.verifies(k, 0, payload, from_words(words[3:7])):
                self.failure = (proto.CHECKSUM, f"{where} failed its checksum (seal mismatch)")
            else:
                try:
                    self.decoder.apply(k, payload.cpu())
                except delta.DeltaError as exc:
                    self.failure = (exc.vote_status, f"{where}: {exc}")

    def tensors(self) -> Unit:
        """The pair's rebuilt tensors (views of the rebuilt stream), after :meth:`run` rebuilt them all."""
        return self.decoder.staged()


class PairBases:
    """An engine rank's pair bases across delta mesh rounds (one
    :class:`~qstrat.transport.delta.rebuild.DeltaRebuild` per trainer rank), and the hooks
    :func:`~qstrat.transport.mesh.receiver.receive_mesh_round` takes for a delta round
    (``pairs=``): :attr:`mode`, :attr:`head_words`, :meth:`check`, :meth:`pair_in`."""

    mode, head_words = MODE, HEAD_WORDS

    def __init__(self) -> None:
        self.rebuilds: dict[int, DeltaRebuild] = {}
        self._infos: dict[int, dict[str, Any]] = {}

    def base(self, sender: int) -> delta.Base | None:
        """The base of the pair from trainer rank ``sender`` (None: none)."""
        rebuild = self.rebuilds.get(sender)
        return rebuild.base if rebuild is not None else None

    def check(self, heads: list[list[int]], routes: MeshRoutes, me: int, rank: int) -> Exception | None:
        """Before the accept vote: each pair header's ids against the pair's base; the refusal
        (a DeltaError with status STALE_BASE naming the pair, or WireManifestMismatchError for a
        header without a round id) or None."""
        self._infos = {}
        for s, words in enumerate(heads):
            info = {"base": id_from(words[mesh.PAIR_WORDS:mesh.PAIR_WORDS + 2]), "round": id_from(words[-2:])}
            if info["round"] is None:
                return WireManifestMismatchError(f"rank {rank}: trainer rank {s}'s delta pair header has no round id")
            try:
                delta.check_base(info, routes.pair_manifest(s, me), self.base(s))
            except delta.DeltaError as exc:
                return delta.DeltaError(f"rank {rank}: the pair from trainer rank {s}: {exc}", exc.vote_status)
            self._infos[s] = info
        return None

    def pair_in(self, group: TransferGroup, src: int, wm: WireManifest, sealer: Sealer) -> PairDeltaIn:
        """The stream from trainer rank ``src``, rebuilt against its pair's base (a DeltaError
        drops that base: out of step with the trainer), digests keyed by the pair MAC."""
        rebuild = self.rebuilds.setdefault(src, DeltaRebuild())
        return PairDeltaIn(group, src, wm, sealer, rebuild.decoder(self._infos[src], wm, sealer.secret, sealer.mac))

    def commit(self) -> None:
        """After the round's tensors were loaded: each pair's rebuilt stream is its base."""
        for rebuild in self.rebuilds.values():
            rebuild.commit(rebuild.take_next())

    def drop(self) -> None:
        """After a load that failed part-way: no pair has a base (the next round goes whole)."""
        for rebuild in self.rebuilds.values():
            rebuild.take_next()
            rebuild.base = None


def receive_delta_round(receive: Any, stats: dict[str, Any]) -> Unit:
    """Run ``receive()`` (one delta mesh round on this engine rank), and once more when every
    refusal was delta-only (the trainer ranks then send it whole); ``stats`` gets ``attempts``
    and, after a refused delta, ``refused`` (the reason) and ``refused_bytes`` (what the refused
    attempt received). Returns / Raises: as ``receive``."""
    try:
        staged = receive()
        stats["attempts"] = 1
        return staged
    except delta.DeltaRefused as exc:
        refused, spent = str(exc), stats.get("bytes", 0)
    staged = receive()
    stats.update(attempts=2, refused=refused, refused_bytes=spent)
    return staged


class DeltaMeshReceiver(MeshReceiver):
    """A :class:`~qstrat.transport.mesh.receiver.MeshReceiver` of delta mesh rounds: each pair
    rebuilt against its base (:class:`PairBases`, :attr:`pairs`), a refused delta received again
    whole in the same :meth:`round`; ``stats`` as ``MeshReceiver``'s plus ``attempts`` (and
    ``refused``, ``refused_bytes``). Args as ``MeshReceiver``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pairs = PairBases()

    def round(self, doc: dict[str, Any]) -> None:
        """Receive one round (twice when the delta was refused) and load it; then each pair's
        new stream is its base. Raises as ``MeshReceiver.round`` (a load that failed part-way
        drops every base)."""
        try:
            super().round(doc)
        except MixedWeightsError:
            self.pairs.drop()
            raise
        self.pairs.commit()

    def _receive(self, doc: dict[str, Any]) -> Unit:
        return receive_delta_round(lambda: receive_mesh_round(
            self.group, doc, self.senders, self.layout, self.auth, self.expected, self.stats, pairs=self.pairs),
            self.stats)


class DeltaMeshSender(MeshSender):
    """A trainer rank of delta mesh rounds: :class:`~qstrat.transport.mesh.sender.MeshSender`
    (same arguments) whose pairs each send the patch against the pair's base
    (:attr:`bases`: engine index -> the pair's :class:`~qstrat.transport.delta.encoding.Base`, in
    host memory), and send the round again whole when the engine ranks refused only the delta."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.mode != "atomic":
            raise TransportError(f"a delta mesh round is atomic in its load (a base per pair, loaded after the "
                                 f"commit vote): mode={self.mode!r} is not combined with delta")
        #: Per engine rank (0-based among engine ranks) the pair's base; empty: every pair whole.
        self.bases: dict[int, delta.Base] = {}
        self._encoders: dict[int, PatchEncoder] = {}
        self._resend: dict[int, PatchEncoder] | None = None

    def _mac_mode(self, routes: MeshRoutes) -> str:
        """A delta mesh round binds its own mode (:data:`MODE`) into the round MAC."""
        return MODE

    def _pair_head(self, routes: MeshRoutes, r: int) -> torch.Tensor:
        """The atomic pair header and the pair's ids; the pair's encoder is made here (against
        its base, or whole when the round is sent again)."""
        target = routes.pair_manifest(self.group.rank, r)
        enc = self._resend.get(r) if self._resend is not None else None
        if enc is None or enc.target.digest != target.digest:  # (a layout that changed: its source is spent)
            base = None if self._resend is not None else self.bases.get(r)
            enc = PatchEncoder(target, PairQueue(), base)
        self._encoders[r] = enc
        words = id_words(enc.info["base"]) + id_words(enc.info["round"])
        return torch.cat([super()._pair_head(routes, r), torch.tensor(words, dtype=torch.int64, device=self.group.device)])

    def _pair_out(self, routes: MeshRoutes, r: int, sealer: Sealer) -> PairDeltaOut:
        return PairDeltaOut(self.group, self.senders + r, routes.pair_manifest(self.group.rank, r), sealer,
                            self._encoders[r])

    def send(self, outputs: Iterable[tuple[str, str, tuple[int, ...], int]],
             tensors: Iterator[tuple[str, torch.Tensor]]) -> MeshReport:
        """One delta mesh round (args as ``MeshSender.send``); when the engine ranks refuse only
        the delta (a stale pair base in the accept vote, a rebuilt digest that differs in the
        commit vote) the round is sent again at once, every pair whole.

        Returns: the ``MeshReport`` of the round committed (``sent``: the patches' bytes per engine
        rank) with ``delta``: this rank's pairs together (a
        :class:`~qstrat.transport.send.report.DeltaReport`: kind, why whole, wire and full bytes,
        tiles, ``attempts``); ``seconds`` and the DeltaReport's ``wire_bytes`` cover both attempts
        (``sent``: the round committed). Raises: as ``MeshSender.send``.
        """
        t0, outputs = time.perf_counter(), list(outputs)
        self._encoders, self._resend = {}, None
        attempts, reason, spent = 1, None, (0.0, 0.0, 0)
        try:
            try:
                report = super().send(outputs, tensors)
            except delta.DeltaRefused as exc:
                first = self._encoders
                reason, attempts = f"the engine ranks refused the delta: {exc}", 2
                spent = (sum(e.source_s for e in first.values()), sum(e.encode_s for e in first.values()),
                         sum(e.wire_bytes for e in first.values()))  # the delta's payloads sent before the refusal
                self._resend = {r: e.whole() for r, e in first.items()}
                rest = iter(()) if all(e.complete for e in first.values()) else tensors
                self._encoders = {}
                report = super().send(outputs, rest)
        except BaseException as exc:
            if isinstance(exc, MixedWeightsError) or any(e.done for e in self._encoders.values()):
                self.bases = {}  # data went out: the engine ranks' bases may have moved; the next round whole
            raise
        finally:
            self._resend = None
        encs = self._encoders
        if reason is None:
            whole = [self.senders + r for r, e in encs.items() if e.base is None and e.target.buckets]
            reason = f"no base for the pairs to engine ranks {whole}" if whole else None
        self.bases = {r: e.new_base() for r, e in encs.items()}
        tiles: dict[str, int] = {}
        for e in encs.values():
            for kind, count in e.tiles.items():
                tiles[kind] = tiles.get(kind, 0) + count
        info = DeltaReport("full" if set(tiles) <= {"raw"} else "delta", reason,
                           sum(e.target.total_bytes for e in encs.values()),
                           spent[2] + sum(e.wire_bytes for e in encs.values()),
                           tiles, spent[0] + sum(e.source_s for e in encs.values()),
                           spent[1] + sum(e.encode_s for e in encs.values()),
                           sum(b.nbytes for b in self.bases.values()), attempts,
                           copied_whole=sum(e.copied_whole for e in encs.values()))
        return replace(report, seconds=time.perf_counter() - t0, delta=info)


__all__ = ["DeltaMeshReceiver", "DeltaMeshSender", "HEAD_WORDS", "MODE", "PairBases", "PairDeltaIn", "PairDeltaOut",
           "PairQueue", "id_from", "id_words", "receive_delta_round"]
