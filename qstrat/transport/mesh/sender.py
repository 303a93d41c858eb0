"""A trainer rank's side of a mesh round (:mod:`qstrat.transport.mesh.steps`): every trainer rank calls
:meth:`MeshSender.send` with the tensors it owns, and streams each engine rank's share of them
straight to that rank, every pair at once.

Pieces: :class:`PairOut` (one engine rank's bucket stream from this rank: today's
:class:`~qstrat.transport.send.outgoing.BucketSource` over the pair's wire manifest, sealed with the
pair's keys, sent point to point) and :class:`MeshSender` (the round's steps and outcome, with
today's :func:`~qstrat.transport.send.sender_protocol.raise_outcome`).
"""
from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from qstrat.errors import TransportError
from qstrat.transport.delta.encoding import DeltaRefused
from qstrat.transport.mesh import bounded
from qstrat.transport.mesh import steps as mesh
from qstrat.transport import protocol as proto
from qstrat.transport.security.auth import RoundContext, next_counter
from qstrat.transport.group import TransferGroup
from qstrat.transport.security.keys import ENV_SECRET, Secret
from qstrat.transport.send.outgoing import BucketSource, SourceFailure
from qstrat.transport.send.report import DeltaReport
from qstrat.transport.mesh.routing import MeshRoutes
from qstrat.transport.security.seal import Sealer
from qstrat.transport.send.sender_protocol import raise_outcome
from qstrat.transport.wire_manifest import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES, WireManifest

#: Buckets of one pair on the wire at once (the pair's next complete bucket waits for a free place).
IN_FLIGHT = 2
#: Default bound (bytes) on what the pairs hold before the sender pulls its next tensor: the
#: look-ahead that lets a rank send to every engine rank at once when its wire order goes to one
#: engine rank after another (experts placed round-robin: docs/transport.md, "Mesh round").
LOOKAHEAD_BYTES = 256 << 20


class PairOut:
    """This rank's bucket stream to engine rank ``dst`` (group rank) over the pair's wire manifest:
    :meth:`push` each of its tensors (the part the pair carries) in wire order; a bucket is
    packed, sealed and posted as soon as its tensors are in and fewer than :data:`IN_FLIGHT` of
    the pair's buckets are on the wire. Nothing here blocks but :meth:`wait_oldest`,
    :meth:`drain` and :meth:`finish`: the sender keeps every pair busy (:meth:`MeshSender._stream`)."""

    def __init__(self, group: TransferGroup, dst: int, wm: WireManifest, sealer: Sealer) -> None:
        self.group, self.dst, self.wm, self.sealer = group, dst, wm, sealer
        self.queue: deque[tuple[str, torch.Tensor]] = deque()
        # pulled only once the bucket's tensors are queued (:meth:`push`)
        self.source = BucketSource(wm, iter(self.queue.popleft, None), group.device)
        self.k, self.works, self.sent, self.pushed = 0, deque(), 0, 0
        self.ends = [wm.buckets[t.bucket].stream_offset + t.offset + t.nbytes for t in wm.slots]

    def _needs(self, k: int) -> int:
        slots = self.source.contents[k]
        return len(slots) if self.wm.buckets[k].tensor is None else int(slots[0].bucket == k)

    def push(self, name: str, t: torch.Tensor) -> None:
        """Queue the pair's part of one tensor; post the buckets that are now complete (:meth:`pump`)."""
        self.queue.append((name, t))
        self.pushed += 1
        self.pump()

    def pump(self) -> None:
        """Reap the sends that completed; post every complete bucket while fewer than
        :data:`IN_FLIGHT` are on the wire. Raises TransportError when a send failed."""
        while self.works and self._oldest_done():
            self.wait_oldest()
        while (len(self.works) < IN_FLIGHT and self.k < len(self.wm.buckets)
               and len(self.queue) >= self._needs(self.k)):
            self._post_next()

    def _post_next(self) -> None:
        """Pack, seal and post bucket :attr:`k` (its tensors are queued)."""
        b = self.wm.buckets[self.k]
        buffer = torch.empty(b.nbytes if b.tensor is None else 0, dtype=torch.uint8, device=self.group.device)
        payload, keep, fill = self.source.bucket(self.k, buffer)
        if fill is not None:
            fill(0, b.nbytes)
        self._post(payload, keep, 0, self.sealer.seal(self.k, 0, payload))

    def _oldest_done(self) -> bool:
        """Whether the oldest bucket on the wire was delivered (known without waiting)."""
        return all(w.is_completed() for w in self.works[0][:2])

    def close(self) -> None:
        """After the round (nothing to release here; :class:`BoundedPairOut` ends its waiter)."""

    def held(self) -> int:
        """Bytes of the pair's stream pushed and not yet on the wire for good: from the first
        byte of its oldest unfinished bucket to the end of the last tensor pushed."""
        if not self.pushed:
            return 0
        first = self.works[0][2] if self.works else (
            self.wm.buckets[self.k].stream_offset if self.k < len(self.wm.buckets) else self.wm.total_bytes)
        return max(0, self.ends[min(self.pushed, len(self.ends)) - 1] - first)

    def oldest(self) -> float | None:
        """When the pair's oldest unfinished bucket was posted (``perf_counter``), None: none is."""
        return self.works[0][3] if self.works else None

    def abort(self) -> None:
        """Tell the engine rank at once (its next bucket: garbage with ABORT), end the stream."""
        if self.k < len(self.wm.buckets):
            junk = torch.zeros(self.wm.buckets[self.k].nbytes, dtype=torch.uint8, device=self.group.device)
            self._post(junk, junk, proto.ABORT, self.sealer.seal(self.k, proto.ABORT, None))
        self.k = len(self.wm.buckets)

    def _post(self, payload: torch.Tensor, keep: torch.Tensor, flags: int, seal: bytes) -> None:
        hdr = proto.bucket_header(self.k, flags, seal, self.group.device)
        tag = 2 * self.k + 1
        self.works.append((self.group.send(payload, self.dst, tag), self.group.send(hdr, self.dst, tag + 1),
                           self.wm.buckets[self.k].stream_offset, time.perf_counter(), keep, hdr))
        self.sent += payload.numel()
        self.k += 1

    def wait_oldest(self) -> None:
        """Wait for the pair's oldest bucket on the wire. Raises TransportError when its send failed
        (the group is then closed)."""
        w_data, w_hdr = self.works[0][:2]
        self.works.popleft()
        mesh.wait(self.group, w_data, f"send to rank {self.dst} failed (an engine rank died?)")
        mesh.wait(self.group, w_hdr, f"send to rank {self.dst} failed (an engine rank died?)")

    def drain(self) -> None:
        """Wait for every send posted. Raises TransportError when a send failed (group closed)."""
        while self.works:
            self.wait_oldest()

    def finish(self) -> None:
        """Wait for every send. Raises TransportError when the source left buckets unsent."""
        self.drain()
        if self.k < len(self.wm.buckets):
            raise TransportError(f"the source ended before bucket {self.k}/{len(self.wm.buckets)} of the pair "
                                 f"to rank {self.dst} (truncated)")


def keep_busy(outs: Iterable[PairOut], limit: int, wait: Callable[[list[PairOut]], None] | None = None) -> None:
    """Post what every pair can; while the pairs hold more than ``limit`` bytes (:meth:`PairOut.held`)
    wait for the oldest bucket on the wire of any pair (``wait(busy pairs)`` instead, given) and
    post again. Returns once at most ``limit`` bytes are held, or nothing is on the wire (what is
    held then waits for more tensors). Raises TransportError when a send failed."""
    outs = list(outs)
    while True:
        for out in outs:
            out.pump()
        busy = [out for out in outs if out.works]
        if not busy or sum(out.held() for out in outs) <= limit:
            return
        if wait is not None:
            wait(busy)
        else:
            min(busy, key=lambda out: out.oldest()).wait_oldest()


class BoundedPairOut(bounded.WaitedSends, PairOut):
    """A bounded round's pair: its sends waited for on a thread of its own (:class:`~qstrat.
    transport.mesh.bounded.WaitedSends`), so the sender waits for any pair (:meth:`MeshSender._keep_busy`)."""


@dataclass(frozen=True)
class MeshReport:
    """One committed mesh round on a trainer rank: payload bytes it sent to each engine rank
    (group rank -> bytes), and wall seconds (round, and the bucket stream alone)."""

    sent: dict[int, int]
    seconds: float
    stream_seconds: float
    #: A delta round (:mod:`qstrat.transport.mesh.pair_delta`): this rank's pairs together, as a
    #: :class:`~qstrat.transport.send.report.DeltaReport` (None: an atomic round).
    delta: DeltaReport | None = None


class MeshSender:
    """Trainer rank ``group.rank`` (< ``senders``) of a mesh round; every trainer rank holds one
    and calls :meth:`send` for each round with the same outputs (FSDP-style: every rank calls it).

    Args:
        group: the open transfer group (:func:`qstrat.transport.group.open_group`): trainer ranks
            ``0..senders-1``, engine ranks after them.
        senders: how many trainer ranks send.
        secret: the shared secret (default: :data:`~qstrat.transport.security.keys.ENV_SECRET`; None:
            unauthenticated rounds).
        address, port: the group's address, bound into the round MAC (the engines' view of it).
        bucket_bytes, alignment: each pair's bucket layout (bytes).
        lookahead_bytes: the most bytes of its tensors' parts the pairs hold - queued or on the
            wire, not yet delivered - before the next tensor is pulled from the source (the
            source's tensors stay alive that long; at least :data:`IN_FLIGHT` buckets per pair
            are always let through).
        mode: ``atomic`` (engine ranks load only after the commit vote) or ``bounded`` (each engine
            rank loads unit by unit as the pieces arrive, at most ``staged_bytes`` of buffers alive:
            :mod:`qstrat.transport.mesh.bounded`; a fault after a rank loaded leaves a flagged MIX).
        staged_bytes: bounded mode: the bytes of receive buffers an engine rank holds at most (None:
            its largest unit plus two buckets); a bound below an engine rank's largest unit is
            refused before any data.
    Raises: TransportError for another mode, or ``staged_bytes`` in atomic mode.
    """

    def __init__(self, group: TransferGroup, senders: int, secret: Secret | bytes | str | None = None,
                 address: str = "", port: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 alignment: int = DEFAULT_ALIGNMENT, lookahead_bytes: int = LOOKAHEAD_BYTES,
                 mode: str = "atomic", staged_bytes: int | None = None) -> None:
        if not 0 <= group.rank < senders < group.world_size:
            raise TransportError(f"mesh sender: rank {group.rank} is not one of {senders} senders in a group "
                                 f"of {group.world_size}")
        self.group, self.senders, self.address, self.port = group, senders, address, port
        self.secret = Secret.coerce(secret if secret is not None else (os.environ.get(ENV_SECRET) or None))
        self.bucket_bytes, self.alignment, self.lookahead_bytes = bucket_bytes, alignment, lookahead_bytes
        bounded.routes_for([], senders, [], bucket_bytes, alignment, mode, staged_bytes)  # the mode, checked
        self.mode, self.staged_bytes = mode, staged_bytes
        self.counter = -1
        #: The last round's routes (bytes per engine rank: ``routes.bytes_per_receiver()``).
        self.routes: MeshRoutes | None = None

    def send(self, outputs: Iterable[tuple[str, str, tuple[int, ...], int]],
             tensors: Iterator[tuple[str, torch.Tensor]]) -> MeshReport:
        """Run one mesh round.

        Args:
            outputs: the WHOLE model's outputs in wire order with their owners, the same on every
                rank (:func:`qstrat.transport.mesh.routing.mesh_outputs`).
            tensors: THIS rank's outputs (owner == this rank) in wire order, whole, e.g.
                ``driver.run(iter(held), plan=split_plan(plan, ep.owner, S)[rank])``.
        Returns: a :class:`MeshReport`, only when every rank committed.
        Raises: WireManifestMismatchError / TransferAuthError / TransportError when a rank refused
            before any data (another routes digest, a MAC that does not verify, a pair header
            another than the engine rank's own share; DeltaRefused when every refusal was a delta
            round's stale base); the source's own error after every pair was
            told (ABORT) and nothing loaded; TransportError for a failed seal, another rank's
            abort or a lost peer (the group is then closed).
        """
        t0, g = time.perf_counter(), self.group
        layouts, _, ch = mesh.collective(g, "layout exchange failed", mesh.opening, g, self.senders, None)
        routes = self.routes = bounded.routes_for(outputs, self.senders, layouts, self.bucket_bytes, self.alignment,
                                                  self.mode, self.staged_bytes)
        mac = self._accept(routes, ch)
        outs = {r: self._pair_out(routes, r, mesh.pair_sealer(self.secret, mac, g.rank, self.senders + r, g.device))
                for r in range(len(layouts))}
        t1 = time.perf_counter()
        try:
            try:
                failure = self._stream(routes, outs, tensors)
            finally:
                for out in outs.values():
                    out.close()
            votes = mesh.collective(g, "commit vote failed (a peer died?)", proto.vote, g, proto.COMMIT,
                                    proto.SENDER_ABORT if failure else proto.OK, False, self.secret, mac)
        except TransportError as exc:
            if self.mode == "bounded" and g.pg is None:  # lost: no vote says who loaded
                raise bounded.cut_off(exc) from None
            raise
        raise_outcome(votes, failure, lambda: None)
        return MeshReport({self.senders + r: o.sent for r, o in outs.items()}, time.perf_counter() - t0,
                          time.perf_counter() - t1)

    def _pair_out(self, routes: MeshRoutes, r: int, sealer: Sealer) -> PairOut:
        """The stream to engine rank ``r`` (0-based among the engine ranks) under ``sealer``
        (bounded mode: a :class:`BoundedPairOut`)."""
        pair = BoundedPairOut if self.mode == "bounded" else PairOut
        return pair(self.group, self.senders + r, routes.pair_manifest(self.group.rank, r), sealer)

    def _pair_head(self, routes: MeshRoutes, r: int) -> torch.Tensor:
        """Step 3's header of the pair to engine rank ``r``."""
        return mesh.pair_header(routes.pair_manifest(self.group.rank, r), self.group.device)

    def _mac_mode(self, routes: MeshRoutes) -> str:
        """The mode string the round MAC binds (a delta mesh sender binds its own)."""
        return bounded.mac_mode(routes)

    def _keep_busy(self, outs: Iterable[PairOut], limit: int) -> None:
        """:func:`keep_busy`; bounded mode waits for any pair (:func:`~qstrat.transport.mesh.bounded.wait_any`)."""
        keep_busy(outs, limit, partial(bounded.wait_any, group=self.group) if self.mode == "bounded" else None)

    def _accept(self, routes: MeshRoutes, ch: tuple[int, ...]) -> bytes:
        """Steps 2-4 after the challenge ``ch``: round header, pair headers, accept vote; the round MAC."""
        g, mode = self.group, self._mac_mode(routes)
        header = torch.zeros(proto.ROUND_WORDS, dtype=torch.int64, device=g.device)
        refusal = routes.refusal() if isinstance(routes, bounded.BoundedRoutes) else None
        status = proto.OK if refusal is None else proto.REJECTED
        if g.rank == 0:
            self.counter = next_counter(self.counter, ch)
            mac = RoundContext(routes.digest, mode, self.counter, ch, self.address, self.port,
                               g.world_size).mac(self.secret)
            header = proto.round_header(len(routes.outputs), sum(routes.bytes_per_receiver()), self.counter,
                                        routes.digest, mac, g.device)
        mesh.wait(g, g.broadcast(header), "no round header from rank 0")
        counter, mac, digest = mesh.header_fields([int(v) for v in header.cpu()])
        if digest != routes.digest:
            status = proto.REJECTED
        elif mac != RoundContext(digest, mode, counter, ch, self.address, self.port, g.world_size).mac(self.secret):
            status = proto.UNAUTHENTICATED
        self.counter = counter
        works = [g.send(self._pair_head(routes, r), self.senders + r, 0)
                 for r in range(len(routes.layouts))]
        for w in works:
            mesh.wait(g, w, "pair header not delivered (an engine rank died?)")
        votes = mesh.collective(g, "accept vote failed", proto.vote, g, proto.ACCEPT, status, False, self.secret, mac)
        if refusal is not None:
            raise refusal
        if votes.delta_refused():  # a delta round: sent again whole
            raise DeltaRefused(f"mesh delta refused before any data: {proto.describe(votes.statuses)}")
        if votes.failed():
            raise votes.refusal("mesh round")
        return mac

    def _stream(self, routes: MeshRoutes, outs: dict[int, PairOut],
                tensors: Iterator[tuple[str, torch.Tensor]]) -> SourceFailure | None:
        """Step 5: each tensor's part to each engine rank that loads it; the source's own error
        (any class) aborts every pair and is returned."""
        shares = {r: {s.name: s for s in routes.pair(self.group.rank, r)} for r in outs}
        mine = [(n, d, tuple(sh)) for n, d, sh, o in routes.outputs if o == self.group.rank]
        done = 0
        try:
            for name, t in tensors:
                if done >= len(mine) or name != mine[done][0]:
                    want = mine[done][0] if done < len(mine) else "nothing more"
                    raise TransportError(f"rank {self.group.rank}: the source yielded {name!r} where its wire "
                                         f"order has {want!r}")
                _, dtype, shape = mine[done]
                if tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
                    # a narrowed share cannot tell a wrong whole tensor from the right one: check it here
                    raise TransportError(f"rank {self.group.rank}: {name!r} is {str(t.dtype).removeprefix('torch.')} "
                                         f"{list(t.shape)}, its planned output is {dtype} {list(shape)}")
                done += 1
                for r, out in outs.items():
                    part = shares[r].get(name)
                    if part is not None:
                        out.push(name, part.cut(t))
                self._keep_busy(outs.values(), self.lookahead_bytes)
            self._keep_busy(outs.values(), 0)
            for out in outs.values():
                out.finish()
            return None
        except BaseException as exc:  # noqa: BLE001 - any class: every pair hears ABORT, raised after the vote
            if isinstance(exc, TransportError) and self.group.pg is None:
                raise  # the group is lost: no vote can follow
            for out in outs.values():
                out.abort()
            for out in outs.values():
                out.drain()
            return SourceFailure(done, exc)
