"""An engine rank's side of a mesh round (:mod:`qstrat.transport.mesh.steps`): it computes its own share
from its own layout, refuses a round whose pairs would bring anything else, receives every
sender's bucket stream at once (point to point), verifies each bucket with the pair's keys and
hands the round on only after every rank voted to commit (atomic).

Pieces: :class:`PairIn` (one sender's bucket stream into this rank: today's
:func:`~qstrat.transport.buckets.receive_buffers` and seal checks), :func:`receive_mesh_round`
(the round's steps) and :class:`MeshReceiver` (a receiver without an engine, loading into a dict).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import Any

import torch

from qstrat.errors import MixedWeightsError, TransferAuthError, TransportError, WireManifestMismatchError
from qstrat.transport.delta.encoding import DeltaRefused
from qstrat.transport.mesh import bounded
from qstrat.transport.mesh import steps as mesh
from qstrat.transport import protocol as proto
from qstrat.transport.security.auth import ReceiverAuth, RoundContext, from_words
from qstrat.transport.buckets import receive_buffers, unpack
from qstrat.transport.group import TransferGroup
from qstrat.transport.mesh.routing import MeshRoutes, ReceiverLayout
from qstrat.transport.security.seal import Sealer
from qstrat.transport.wire_manifest import WireManifest, build_wire_manifest, check_against

Unit = list[tuple[str, torch.Tensor]]


class PairIn:
    """One sender's bucket stream into this rank, received on a thread of its own
    (:meth:`run`; c10d point-to-point receives are waited for, not polled), one bucket ahead."""

    def __init__(self, group: TransferGroup, src: int, wm: WireManifest, sealer: Sealer) -> None:
        self.group, self.src, self.wm, self.sealer = group, src, wm, sealer
        self.buffers = receive_buffers(wm, group.device)
        self.received: list[torch.Tensor] = []
        self.failure: tuple[int, str] | None = None
        self.bytes = 0

    def _post(self, k: int) -> tuple[Any, ...] | None:
        if k >= len(self.wm.buckets):
            return None
        _, dst = next(self.buffers)
        hdr = torch.empty(proto.BUCKET_WORDS, dtype=torch.int64, device=self.group.device)
        return dst, hdr, self.group.recv(dst, self.src, 2 * k + 1), self.group.recv(hdr, self.src, 2 * k + 2)

    def run(self) -> None:
        """Receive and verify every bucket (after a failed seal the rest is received unchecked,
        so the sender's stream ends; after an ABORT nothing more comes).
        Raises: TransportError when the sender is lost or times out (the group is then closed)."""
        n = len(self.wm.buckets)
        nxt = self._post(0)
        for k in range(n):
            dst, hdr, w_data, w_hdr = nxt
            nxt = None
            what = f"stream from rank {self.src} truncated at bucket {k}/{n} (sender lost?)"
            mesh.wait(self.group, w_data, what)
            mesh.wait(self.group, w_hdr, what)
            del w_data, w_hdr
            words = [int(v) for v in hdr.cpu()]
            self.bytes += dst.numel()
            where = f"rank {self.group.rank}: bucket {k}/{n} from rank {self.src}"
            if words[2] & proto.ABORT:
                self.failure = self.failure or (proto.SENDER_ABORT, f"{where}: the sender aborted the stream")
                return
            nxt = self._post(k + 1)  # received while this one is verified
            if self.failure is not None:
                continue
            if words[0] != proto.BUCKET_MAGIC or words[1] != k:
                self.failure = (proto.CHECKSUM, f"{where} arrived out of order (header {words[1]})")
            elif not self.sealer.verifies(k, words[2], dst, from_words(words[3:7])):
                self.failure = (proto.CHECKSUM, f"{where} failed its checksum (seal mismatch)")
            else:
                self.received.append(dst)

    def tensors(self) -> Unit:
        """The pair's tensors (views of the received buckets), after :meth:`run` verified them all."""
        return unpack(self.wm, self.received)


def _own_routes(group: TransferGroup, doc: Any, senders: int, layouts: list[ReceiverLayout],
                layout: ReceiverLayout, expected: Any) -> tuple[MeshRoutes | None, Exception | None]:
    """This rank's routes from the round's document and every layout, checked against its own
    layout and what its engine loads; (routes or None, why the round is refused or None)."""
    me = group.rank - senders
    try:
        if layouts[me] != layout:
            raise WireManifestMismatchError(f"rank {group.rank}: its published layout was rewritten")
        routes = bounded.routes_from_doc(doc, layouts)
        if isinstance(routes, bounded.BoundedRoutes) and routes.refusal([me]) is not None:
            raise routes.refusal([me])
        if routes.senders != senders:
            raise WireManifestMismatchError(f"rank {group.rank}: the round names {routes.senders} senders, "
                                            f"the group has {senders}")
        if callable(expected):
            expected(routes, me)
        elif expected is not None:
            share = routes.share(me)
            check_against(build_wire_manifest(((s.name, s.dtype, s.sent) for s in share),
                                              routes.bucket_bytes, routes.alignment), expected)
        return routes, None
    except TransportError as exc:
        return None, exc
    except Exception as exc:  # noqa: BLE001 - refused in the accept vote like any other
        return None, WireManifestMismatchError(f"rank {group.rank}: malformed mesh round: {exc!r}")


def receive_mesh_round(group: TransferGroup, doc: dict[str, Any], senders: int, layout: ReceiverLayout,
                       auth: ReceiverAuth | None = None, expected: Any = None,
                       stats: dict[str, float] | None = None, whole: bool = False, pairs: Any = None,
                       on_unit: Callable[[str, Unit], None] | None = None) -> Unit:
    """Receive one mesh round on engine rank ``group.rank`` (>= ``senders``).

    Args:
        doc: the round's routes document (:meth:`MeshRoutes.to_dict`, as the trainer sends it).
        senders: the trainer ranks of the group (``0..senders-1``), known from the join.
        layout: what THIS rank loads, read from its engine (:class:`ReceiverLayout`).
        auth: secret, group address and last accepted counter (advanced on accept).
        expected: name -> (dtype name, shape) this rank's engine loads (its narrowed shapes), or
            ``expected(routes, engine index)`` raising TransportError to refuse it in the accept
            vote (an engine's own check); None: not checked.
        stats: gets ``bytes`` (received, counted here), ``share_bytes`` (from the routes),
            ``tensor_bytes`` (padding excluded; after a commit), ``seconds``, ``stream_s``.
        whole: hand on each part embedded in its whole tensor (:meth:`~qstrat.transport.mesh.routing.
            ShareSlice.embed`: zeros outside the rank's slice, what vLLM's weight loaders take).
        pairs: a delta round's pair bases (:class:`~qstrat.transport.mesh.pair_delta.PairBases`: a
            stale base votes STALE_BASE, a rebuilt digest mismatch DELTA); None: atomic.
        on_unit: a BOUNDED round's (``doc["mode"]``; :mod:`qstrat.transport.mesh.bounded`), required
            there: ``on_unit(unit, [(name, tensor)])`` for each reload unit once all its pieces
            verified; ``stats`` then gets ``staged_peak`` (bytes of receive buffers alive at
            once, counted here), ``staged_bytes`` (the bound) and ``units_loaded``.
    Returns: ``(name, tensor)`` of this rank's share in wire order (views of the received buffers;
        copies with ``whole``), every bucket verified and every rank agreeing to commit; ``[]`` in
        a bounded round (handed to ``on_unit``).
    Raises: WireManifestMismatchError (a share other than this rank's, malformed round, an engine
        that loads something else), TransferAuthError, TransportError - before any data; then
        TransportError (a seal failed, a sender aborted, another rank refused, a peer was lost:
        the group is then closed), with nothing handed on (bounded: MixedWeightsError if it was);
        DeltaRefused (a TransportError) on every rank when every refusal of a delta round, in either
        vote, was delta-only (its sender sends the round again, whole).
    """
    t0, g = time.perf_counter(), group
    mode, words = (mesh.MODE, mesh.PAIR_WORDS) if pairs is None else (pairs.mode, pairs.head_words)
    auth = auth or ReceiverAuth(None, "", 0)
    stats = stats if stats is not None else {}
    layouts, drawn, ch = mesh.collective(g, "layout exchange failed", mesh.opening, g, senders, layout,
                                         auth.last_counter)
    routes, rejection = _own_routes(g, doc, senders, layouts, layout, expected)
    share_mode = isinstance(routes, bounded.BoundedRoutes)
    if rejection is None and share_mode != (on_unit is not None):
        rejection = WireManifestMismatchError(f"rank {g.rank}: a {'bounded' if share_mode else 'atomic'} mesh "
                                              f"round {'needs' if share_mode else 'takes no'} a unit loader here")
    header = torch.zeros(proto.ROUND_WORDS, dtype=torch.int64, device=g.device)
    mesh.wait(g, g.broadcast(header), "no round header from rank 0")
    counter, mac, digest = mesh.header_fields([int(v) for v in header.cpu()])
    heads = [torch.zeros(words, dtype=torch.int64, device=g.device) for _ in range(senders)]
    for w in [g.recv(h, s, 0) for s, h in enumerate(heads)]:
        mesh.wait(g, w, "no pair header (a trainer rank died?)")
    me = g.rank - senders
    if rejection is None and digest != routes.digest:
        rejection = WireManifestMismatchError(f"rank {g.rank}: rank 0 streams other routes than this rank computed")
    if rejection is None:
        reason = auth.verify(RoundContext(digest, mode if pairs is not None else bounded.mac_mode(routes), counter,
                                          ch, auth.address, auth.port, g.world_size),
                             mac, g.rank, drawn)
        if reason is not None:
            rejection = TransferAuthError(f"rank {g.rank}: mesh round refused: {reason}")
    if rejection is None:
        for s, h in enumerate(heads):
            if h.tolist()[:mesh.PAIR_WORDS] != mesh.pair_header(routes.pair_manifest(s, me), g.device).tolist():
                rejection = WireManifestMismatchError(
                    f"rank {g.rank}: trainer rank {s} would send another share than this rank loads "
                    f"(pair wire manifest {routes.pair_manifest(s, me).digest[:12]}...)")
                break
    if rejection is None and pairs is not None:
        rejection = pairs.check([h.tolist() for h in heads], routes, me, g.rank)
    status = (proto.OK if rejection is None else proto.UNAUTHENTICATED if isinstance(rejection, TransferAuthError)
              else getattr(rejection, "vote_status", proto.REJECTED))
    votes = mesh.collective(g, "accept vote failed", proto.vote, g, proto.ACCEPT, status, False, auth.secret, mac)
    if votes.delta_refused():
        raise DeltaRefused(f"rank {g.rank}: mesh delta refused before any data: {proto.describe(votes.statuses)}"
                           + (f" ({rejection})" if rejection is not None else ""))
    if rejection is not None:
        raise rejection
    if votes.failed():
        raise TransportError(f"rank {g.rank}: mesh round refused before any data: {proto.describe(votes.statuses)}")
    auth.last_counter = counter
    t1 = time.perf_counter()
    if share_mode:
        _bounded_share(g, routes, me, auth, mac, on_unit, whole, stats, t0, t1)
        return []
    pair_in = PairIn if pairs is None else pairs.pair_in
    ins = [pair_in(g, s, routes.pair_manifest(s, me), mesh.pair_sealer(auth.secret, mac, s, g.rank, g.device))
           for s in range(senders)]
    _drain(ins)
    failure = next((p.failure for p in ins if p.failure), None)
    stats.update(bytes=sum(p.bytes for p in ins), share_bytes=routes.bytes_per_receiver()[me],
                 stream_s=time.perf_counter() - t1)
    votes = mesh.collective(g, "commit vote failed (a peer died?)", proto.vote, g, proto.COMMIT,
                            failure[0] if failure else proto.OK, False, auth.secret, mac)
    stats["seconds"] = time.perf_counter() - t0
    if proto.outcome(votes) == "committed":
        by = {n: t for p in ins for n, t in p.tensors()}
        staged = [(s.name, by[s.name]) for s in routes.share(me)]
        stats["tensor_bytes"] = sum(t.nbytes for _, t in staged)
        if whole:
            staged = [(s.name, s.embed(by[s.name])) for s in routes.share(me)]
        return staged
    reason = failure[1] if failure else f"rank {g.rank}: mesh round not committed: {proto.describe(votes.statuses)}"
    if votes.delta_refused():
        raise DeltaRefused(f"{reason}; mesh delta refused, nothing loaded: {proto.describe(votes.statuses)}")
    raise TransportError(f"{reason}; nothing loaded")


def _bounded_share(g: TransferGroup, routes: bounded.BoundedRoutes, me: int, auth: ReceiverAuth, mac: bytes,
                   on_unit: Callable[[str, Unit], None], whole: bool, stats: dict[str, float], t0: float,
                   t1: float) -> None:
    """Steps 5 and 6 of a bounded round (:class:`~qstrat.transport.mesh.bounded.BoundedShare`)."""
    share = bounded.BoundedShare(g, routes, me, [mesh.pair_sealer(auth.secret, mac, s, g.rank, g.device)
                                                 for s in range(routes.senders)], on_unit, whole)
    try:
        share.run()
    finally:
        stats.update(bytes=share.bytes, share_bytes=routes.bytes_per_receiver()[me], staged_peak=share.peak,
                     staged_bytes=share.bound, units_loaded=len(share.handed), stream_s=time.perf_counter() - t1)
    failure = share.failure
    own = (proto.MIXED if share.handed else failure[0]) if failure else proto.OK
    try:
        votes = mesh.collective(g, "commit vote failed (a peer died?)", proto.vote, g, proto.COMMIT, own,
                                bool(share.handed), auth.secret, mac)
    except TransportError as exc:  # the group is closed: no rank learns the others' state
        if not share.handed:
            raise TransportError(f"{exc}; nothing loaded on this rank") from None
        raise bounded.mixed_error(str(exc), share.handed, share.sched.units, "unknown: the group is closed") from None
    stats["seconds"] = time.perf_counter() - t0
    bounded.finish(g, share, votes)
    stats["tensor_bytes"] = share.tensor_bytes


def _drain(pairs: list[PairIn]) -> None:
    """Every pair's buckets at once, one thread per sender. Raises the first pair's
    TransportError (a lost sender: the group is closed, so the others end too)."""
    with ThreadPoolExecutor(max(1, len(pairs)), thread_name_prefix="qstrat-mesh-recv") as pool:
        futures = [pool.submit(p.run) for p in pairs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


class MeshReceiver:
    """An engine rank without an engine (tests, benchmarks): receives mesh rounds into
    :attr:`tensors` (name -> this rank's part), loading only after the commit vote (atomic) or
    unit by unit (bounded).

    Args: group: the open transfer group (this rank >= ``senders``); layout: what this rank loads;
        expected: name -> (dtype name, shape) its loader takes (None: anything in its share);
        secret, address, port: as :class:`~qstrat.transport.security.auth.ReceiverAuth`.
    """

    def __init__(self, group: TransferGroup, senders: int, layout: ReceiverLayout, expected: Any = None,
                 secret: Any = None, address: str = "", port: int = 0) -> None:
        from qstrat.transport.security.keys import Secret

        self.group, self.senders, self.layout, self.expected = group, senders, layout, expected
        self.auth = ReceiverAuth(Secret.coerce(secret), address, port)
        self.tensors: dict[str, torch.Tensor] = {}
        #: The last round's :func:`receive_mesh_round` stats (``bytes`` received, ``share_bytes``).
        self.stats: dict[str, float] = {}
        #: Why this rank holds a mix (a load that failed part-way), None: it does not.
        self.mixed: str | None = None
        #: The reload units the last bounded round loaded, in order.
        self.units: list[str] = []

    def round(self, doc: dict[str, Any]) -> None:
        """Receive one round and load it (copies into :attr:`tensors`): after the commit vote, or in
        a bounded round (``doc["mode"] == "bounded"``) unit by unit as the pieces verify. Raises as
        :func:`receive_mesh_round`; MixedWeightsError when the load itself failed part-way, or a
        bounded round failed after this rank loaded a unit (:attr:`mixed` says why)."""
        self.stats = {}
        if doc.get("mode") == "bounded":
            self.units = []

            def load(unit: str, tensors: Unit) -> None:
                self.tensors.update((n, t.clone()) for n, t in tensors)
                self.units.append(unit)

            try:
                receive_mesh_round(self.group, doc, self.senders, self.layout, self.auth, self.expected,
                                   self.stats, on_unit=load)
            except MixedWeightsError as exc:
                self.mixed = getattr(exc, "detail", str(exc))
                raise
            self.mixed = None
            return
        staged = self._receive(doc)
        done = 0
        try:
            for name, t in staged:
                self.tensors[name] = t.clone()
                done += 1
        except Exception as exc:
            self.mixed = f"{done} of {len(staged)} tensors new after: {exc}"
            raise MixedWeightsError(f"rank {self.group.rank}: load failed part-way: {self.mixed}") from exc
        self.mixed = None

    def _receive(self, doc: dict[str, Any]) -> Unit:
        """The round's staged tensors (:func:`receive_mesh_round`)."""
        return receive_mesh_round(self.group, doc, self.senders, self.layout, self.auth, self.expected, self.stats)
