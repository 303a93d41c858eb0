"""Bounded mesh rounds: every engine rank loads its share unit by unit as the pieces arrive, under
a bound of staged bytes (docs/transport.md, "Bounded mesh rounds").

A reload unit (:func:`~qstrat.transport.wire_manifest.reload_unit`: a decoder layer, or a module
outside the layers) reaches an engine rank in pieces from several trainer ranks (attention from
the rank that owns the replicated tensors, each expert from its expert-parallel owner); the rank
loads a unit only once every piece of it, from every pair, arrived and verified.

Backpressure without deadlock (the argument in docs/transport.md):

* each pair's buckets are UNIT-ALIGNED (:class:`BoundedRoutes`: a shared bucket never holds two
  units' tensors), so a bucket is released with its unit;
* an engine rank posts its receives - and so lets a trainer rank's send complete: a gloo or NCCL
  send waits for the matching receive - in ONE order over all its pairs, the :class:`Schedule`'s
  (the wire position of each bucket's last tensor: the moment its sender can post it), never more
  than ``staged_bytes`` of buffers alive (posted or holding pieces of units not yet loaded), and
  waits for them in that order;
* a trainer rank never blocks on one pair: it posts every pair's complete buckets and waits for
  ANY send to complete (:func:`wait_any`).

Then the bucket with the smallest key not yet delivered, over the whole mesh, is always posted by
its sender and received by its engine rank, provided ``staged_bytes`` is at least each rank's
:attr:`Schedule.need` (the largest unit it loads, padding included); a smaller bound is refused
before any data (:meth:`BoundedRoutes.refusal`).

Outcomes as in single-sender bounded mode (:mod:`qstrat.transport.protocol`): COMMITTED, REFUSED
(nobody loaded anything) or MIXED: each engine rank that loaded a unit of a round that was not
committed everywhere raises :class:`~qstrat.errors.MixedWeightsError` (its session flags itself);
the trainer ranks raise it naming the ranks holding new weights.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch

from qstrat.errors import MixedWeightsError, TransportError, WireManifestMismatchError
from qstrat.transport import protocol as proto
from qstrat.transport.buckets import bucket_contents, receive_buffers, slot_tensor
from qstrat.transport.group import GroupError, TransferGroup
from qstrat.transport.mesh import steps as mesh
from qstrat.transport.mesh.routing import MeshRoutes, ReceiverLayout
from qstrat.transport.security.auth import from_words
from qstrat.transport.wire_manifest import WireManifest, build_wire_manifest, reload_unit

#: The mode a bounded mesh round binds into its MAC (an atomic round's is :data:`steps.MODE`).
MODE = "mesh-bounded"
#: The option that bounds an engine rank's staged bytes (``MeshSender``/``MeshRefitSender``).
OPTION = "staged_bytes"

Unit = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Step:
    """One bucket in an engine rank's receive order: pair ``sender``'s bucket ``bucket``; ``alloc``:
    bytes allocated when it is posted (a chunked tensor's storage at its first chunk, 0 at the
    others); ``key``: (the memory it lives in, for releasing)."""

    sender: int
    bucket: int
    alloc: int
    key: tuple[int, Any]


class Schedule:
    """Engine rank ``receiver``'s receive order over all its pairs and what each step completes.

    Attributes: steps (key order: wire position of the bucket's last tensor, sender, bucket);
        completes[i]: units whose last piece is step ``i`` (loaded after it verified);
        free_at[key]: the step after whose loads that memory is released; need: the most bytes
        alive at once when every step is posted in order only after the units before it loaded
        (the smallest deadlock-free ``staged_bytes``); largest: the unit loaded at that peak.
    """

    def __init__(self, routes: MeshRoutes, receiver: int) -> None:
        where = {n: i for i, (n, *_) in enumerate(routes.outputs)}
        rows = []
        self.manifests = [routes.pair_manifest(s, receiver) for s in range(routes.senders)]
        units_of: dict[tuple[int, Any], set[str]] = {}
        for s, wm in enumerate(self.manifests):
            for k, (b, slots) in enumerate(zip(wm.buckets, bucket_contents(wm))):
                key = (s, k) if b.tensor is None else (s, b.tensor)
                alloc = b.nbytes if b.tensor is None else slots[0].nbytes if slots[0].bucket == k else 0
                units_of.setdefault(key, set()).update(reload_unit(t.name) for t in slots)
                rows.append((max(where[t.name] for t in slots), s, k, alloc, key))
        rows.sort(key=lambda r: r[:3])
        self.steps = [Step(s, k, alloc, key) for _, s, k, alloc, key in rows]
        last: dict[str, int] = {}
        for i, st in enumerate(self.steps):
            for u in units_of[st.key]:
                last[u] = i
        self.completes: list[list[str]] = [[] for _ in self.steps]
        for u, i in sorted(last.items(), key=lambda kv: kv[1]):
            self.completes[i].append(u)
        self.free_at = {key: max(last[u] for u in us) for key, us in units_of.items()}
        self.last_use = {st.key: i for i, st in enumerate(self.steps)}
        frees: list[int] = [0] * len(self.steps)
        for st in self.steps:
            frees[self.free_at[st.key]] += st.alloc
        alive, self.need, self.largest = 0, 0, "nothing"
        for i, st in enumerate(self.steps):
            alive += st.alloc
            if alive > self.need:
                self.need, self.largest = alive, next(iter(self.completes[self.free_at[st.key]]), "?")
            alive -= frees[i]
        self.units = len(last)

    def memory(self, sender: int, bucket: int) -> tuple[int, Any]:
        """The key of the memory pair ``sender``'s bucket ``bucket`` lives in (a chunk: its tensor's)."""
        b = self.manifests[sender].buckets[bucket]
        return (sender, bucket) if b.tensor is None else (sender, b.tensor)


class BoundedRoutes(MeshRoutes):
    """The routes of a bounded mesh round: :class:`MeshRoutes` with unit-aligned pair wire
    manifests and ``staged_bytes`` (bytes of receive buffers an engine rank holds at most; None:
    each rank's :attr:`Schedule.need` plus two buckets, single-sender bounded mode's "two buckets
    and one unit"). Both travel in the routes document and its digest (the round MAC binds them).

    Raises: TransportError as :class:`MeshRoutes`, and for a ``staged_bytes`` that is not a
        positive integer (a Python or numpy int; bool is refused).
    """

    def __init__(self, outputs: Iterable[Sequence[Any]], senders: int, layouts: Sequence[ReceiverLayout],
                 bucket_bytes: int, alignment: int, staged_bytes: int | None = None) -> None:
        if staged_bytes is not None and (isinstance(staged_bytes, bool) or not isinstance(staged_bytes, Integral)
                                         or staged_bytes <= 0):
            raise TransportError(f"mesh bounded round: {OPTION} must be a positive int (bytes) or None, "
                                 f"got {staged_bytes!r}")
        staged_bytes = None if staged_bytes is None else int(staged_bytes)  # numpy's ints too (JSON document)
        super().__init__(outputs, senders, layouts, bucket_bytes, alignment)
        self.staged_bytes = staged_bytes
        self._schedules: dict[int, Schedule] = {}

    def to_dict(self) -> dict[str, Any]:
        """:meth:`MeshRoutes.to_dict` with ``mode`` ``bounded`` and ``staged_bytes``."""
        return {**super().to_dict(), "mode": "bounded", OPTION: self.staged_bytes}

    def pair_manifest(self, sender: int, receiver: int) -> WireManifest:
        """The pair's wire manifest, unit-aligned (``build_wire_manifest(..., unit_of=reload_unit)``)."""
        key = (sender, receiver)
        if key not in self._manifests:
            self._manifests[key] = build_wire_manifest(((s.name, s.dtype, s.sent) for s in self.pair(*key)),
                                                       self.bucket_bytes, self.alignment, reload_unit)
        return self._manifests[key]

    def schedule(self, receiver: int) -> Schedule:
        """Engine rank ``receiver``'s :class:`Schedule` (0-based among the engine ranks)."""
        if receiver not in self._schedules:
            self._schedules[receiver] = Schedule(self, receiver)
        return self._schedules[receiver]

    def bound(self, receiver: int) -> int:
        """The staged bytes engine rank ``receiver`` may hold."""
        if self.staged_bytes is not None:
            return self.staged_bytes
        return self.schedule(receiver).need + 2 * self.bucket_bytes

    def refusal(self, receivers: Iterable[int] | None = None) -> WireManifestMismatchError | None:
        """Why the round cannot run under its ``staged_bytes`` (None: it can): an engine rank whose
        largest unit needs more (its pieces from every sender, padding included)."""
        for r in range(len(self.layouts)) if receivers is None else receivers:
            sched = self.schedule(r)
            if self.bound(r) < sched.need:
                return WireManifestMismatchError(
                    f"mesh bounded round: {OPTION}={self.bound(r)} is below what engine rank {self.senders + r} "
                    f"needs to load its largest reload unit ({sched.largest}: {sched.need} bytes from "
                    f"every sender, alignment padding included): raise {OPTION} to at least {sched.need} "
                    f"or use mode='atomic'")
        return None


def routes_for(outputs: Iterable[Sequence[Any]], senders: int, layouts: Sequence[ReceiverLayout],
               bucket_bytes: int, alignment: int, mode: str = "atomic", staged_bytes: int | None = None
               ) -> MeshRoutes:
    """The routes of a round in ``mode`` (``atomic``: :class:`MeshRoutes`; ``bounded``:
    :class:`BoundedRoutes`). Raises: TransportError for another mode, as the routes raise."""
    if mode == "bounded":
        return BoundedRoutes(outputs, senders, layouts, bucket_bytes, alignment, staged_bytes)
    if mode != "atomic" or staged_bytes is not None:
        raise TransportError(f"mesh round mode {mode!r}{' with ' + OPTION if staged_bytes is not None else ''}: "
                             f"use 'atomic', or 'bounded' ({OPTION} bounds it)")
    return MeshRoutes(outputs, senders, layouts, bucket_bytes, alignment)


def routes_from_doc(doc: dict[str, Any], layouts: Sequence[ReceiverLayout]) -> MeshRoutes:
    """The routes of a received routes document (its ``mode``: absent is atomic)."""
    return routes_for(doc["outputs"], int(doc["senders"]), layouts, int(doc["bucket_bytes"]),
                      int(doc["alignment"]), doc.get("mode", "atomic"), doc.get(OPTION))


def mac_mode(routes: MeshRoutes) -> str:
    """The mode string the round MAC binds (:class:`~qstrat.transport.security.auth.RoundContext`)."""
    return MODE if isinstance(routes, BoundedRoutes) else mesh.MODE


class WaitedSends:
    """A mixin for :class:`~qstrat.transport.mesh.sender.PairOut`: a thread of the pair's own waits
    for its sends in the order posted and counts them done (a gloo point-to-point Work reports
    completion only once waited for: ``is_completed`` stays False), so that :func:`wait_any`
    can wait for ANY pair. :meth:`close` ends the thread."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.posted_n = self.completed = 0
        self.error: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._waiter, name="qstrat-mesh-send", daemon=True).start()

    def _waiter(self) -> None:
        while True:
            works = self._queue.get()
            if works is None:
                return
            error = None
            try:
                for w in works:
                    self.group.wait(w)
            except GroupError as exc:
                error = str(exc)
            works = w = None  # noqa: F841 - no Work kept: gloo closes a lost group once every one is gone
            with SENT:
                if error is None:
                    self.completed += 1
                else:
                    self.error = error
                SENT.notify_all()
            if error is not None:
                return

    def _post(self, *args: Any) -> None:
        super()._post(*args)
        self.posted_n += 1
        self._queue.put(self.works[-1][:2])

    def _oldest_done(self) -> bool:
        return bool(self.works) and self.completed > self.posted_n - len(self.works)

    def wait_oldest(self) -> None:
        """Wait (at most the group's timeout) until the waiter saw the oldest bucket delivered.
        Raises TransportError when its send failed or timed out (the group is then closed)."""
        with SENT:
            done = SENT.wait_for(lambda: self._oldest_done() or self.error is not None, self.group.timeout_s)
        if self.error is not None or not done:
            self.works.clear()
            raise proto.lost(self.group, f"send to rank {self.dst} failed (an engine rank died?)",
                             self.error or f"not delivered within {self.group.timeout_s:g} s")
        self.works.popleft()

    def close(self) -> None:
        """End the waiter thread (after the round; sends still posted are waited for first)."""
        self._queue.put(None)


#: Signalled whenever a bounded pair's send completes or fails (:class:`WaitedSends`).
SENT = threading.Condition()


def wait_any(busy: list[Any], group: TransferGroup) -> None:
    """A bounded round's wait in :func:`~qstrat.transport.mesh.sender.keep_busy` over
    :class:`WaitedSends` pairs ``busy`` (each with a send on the wire): until ANY of them was
    delivered, never for one pair (an engine rank may hold that pair's bucket back until another
    trainer rank's piece arrived); the caller then reaps and posts again. Raises TransportError
    when a send failed, or none completed within the group's timeout (the group is then closed)."""
    with SENT:
        SENT.wait_for(lambda: any(o._oldest_done() or o.error is not None for o in busy), group.timeout_s)
    if not any(o._oldest_done() for o in busy):
        next((o for o in busy if o.error is not None), busy[0]).wait_oldest()  # raises: failed or timed out


class BoundedShare:
    """Engine rank ``group.rank``'s share of a bounded round, received and loaded unit by unit.

    Args: routes: the round's :class:`BoundedRoutes`; me: this rank's index among the engine
        ranks; sealers: one per sender (:func:`qstrat.transport.mesh.steps.pair_sealer`);
        on_unit: called ``on_unit(unit, [(name, tensor)])`` with each whole unit, in the
        schedule's order (tensors in wire order; views of the receive buffers, or with ``whole``
        the whole-shaped tensors :meth:`ShareSlice.embed` makes).
    """

    def __init__(self, group: TransferGroup, routes: BoundedRoutes, me: int, sealers: Sequence[Any],
                 on_unit: Callable[[str, Unit], None], whole: bool = False) -> None:
        self.group, self.routes, self.me, self.sealers = group, routes, me, sealers
        self.on_unit, self.whole = on_unit, whole
        self.sched = routes.schedule(me)
        self.bound = routes.bound(me)
        self.buffers = [receive_buffers(wm, group.device) for wm in self.sched.manifests]
        self.slots = {u: [] for step in self.sched.completes for u in step}
        for s, wm in enumerate(self.sched.manifests):
            for t in wm.slots:
                self.slots[reload_unit(t.name)].append((s, t))
        order = {s.name: i for i, s in enumerate(routes.share(me))}
        for ss in self.slots.values():
            ss.sort(key=lambda st: order[st[1].name])
        self.parts = {s.name: s for s in routes.share(me)}
        self.posted: dict[int, tuple[torch.Tensor, torch.Tensor, Any, Any]] = {}
        self.last_posted: dict[int, int] = {}  # sender -> its last posted step
        self.ended: set[int] = set()  # senders that aborted: nothing more comes from them
        self.live: dict[tuple[int, Any], int] = {}
        self.kept: dict[tuple[int, int], torch.Tensor] = {}
        self.next = 0
        #: Units loaded (in order), the first failure ``(status, message)``, payload bytes
        #: received, the most staged bytes alive at once, the loaded parts' bytes (no padding).
        self.handed: list[str] = []
        self.failure: tuple[int, str] | None = None
        self.bytes = self.peak = self.tensor_bytes = 0

    def _may_post(self, i: int) -> bool | None:
        """Whether step ``i`` may be posted now (None: never: its sender aborted)."""
        st = self.sched.steps[i]
        if st.sender in self.ended:
            return None
        if self.last_posted.get(st.sender) in self.posted:  # one receive per pair: it may be an ABORT
            return False
        return sum(self.live.values()) + st.alloc <= self.bound

    def _post(self, i: int) -> None:
        st, g = self.sched.steps[i], self.group
        _, dst = next(self.buffers[st.sender])
        if st.alloc:
            self.live[st.key] = st.alloc
            self.peak = max(self.peak, sum(self.live.values()))
        hdr = torch.empty(proto.BUCKET_WORDS, dtype=torch.int64, device=g.device)
        self.posted[i] = (dst, hdr, g.recv(dst, st.sender, 2 * st.bucket + 1), g.recv(hdr, st.sender, 2 * st.bucket + 2))
        self.last_posted[st.sender] = i

    def _pump(self, i: int | None) -> None:
        """Post, in key order from :attr:`next`, every step that may be (step ``i``, the one awaited
        next, always: every step before it is done)."""
        while self.next < len(self.sched.steps):
            ok = self._may_post(self.next)
            if ok is None:
                self.next += 1
                continue
            if not ok and self.next != i:
                return
            self._post(self.next)
            self.next += 1

    def run(self) -> None:
        """Receive every step in order, verify it, load the units it completes, release memory.
        After a failure the rest is received and dropped (the senders' streams end); after a
        sender's ABORT nothing more is awaited from it.
        Raises: TransportError when a peer is lost (the group is closed; MixedWeightsError when
            units were loaded)."""
        steps, n = self.sched.steps, len(self.sched.steps)
        for i in range(n):
            st = steps[i]
            self._pump(i)
            if i not in self.posted:  # its sender aborted
                continue
            dst, hdr, w_data, w_hdr = self.posted.pop(i)
            what = f"stream from rank {st.sender} truncated at its bucket {st.bucket} (sender lost?)"
            error = None
            try:
                self.group.wait(w_data)
                self.group.wait(w_hdr)
            except GroupError as exc:
                error = str(exc)
            del w_data, w_hdr
            if error is not None:  # holding no Work: gloo closes the connections once every one is gone
                self.posted.clear()
                raise lost(self.group, what, error, self.handed, self.sched.units)
            if not int(hdr[2]) & proto.ABORT:
                self._pump(None)  # the pair's next bucket arrives while this one is verified and loaded
            self.bytes += dst.numel()
            self._check(i, st, dst, [int(v) for v in hdr])
            if self.failure is None:
                self.kept[(st.sender, st.bucket)] = dst
                self._load(i)
            self._release(i)

    def _check(self, i: int, st: Step, dst: torch.Tensor, words: list[int]) -> None:
        where = f"rank {self.group.rank}: bucket {st.bucket} from rank {st.sender}"
        if words[2] & proto.ABORT:
            self.ended.add(st.sender)
            self.failure = self.failure or (proto.SENDER_ABORT, f"{where}: the sender aborted the stream")
        elif self.failure is not None:
            return
        elif words[0] != proto.BUCKET_MAGIC or words[1] != st.bucket:
            self.failure = (proto.CHECKSUM, f"{where} arrived out of order (header {words[1]})")
        elif not self.sealers[st.sender].verifies(st.bucket, words[2], dst, from_words(words[3:7])):
            self.failure = (proto.CHECKSUM, f"{where} failed its checksum (seal mismatch)")

    def _load(self, i: int) -> None:
        for u in self.sched.completes[i]:
            tensors = []
            for s, t in self.slots[u]:
                part = slot_tensor(t, self.kept[(s, t.bucket)])
                self.tensor_bytes += part.nbytes
                tensors.append((t.name, self.parts[t.name].embed(part) if self.whole else part))
            self.handed.append(u)  # a load that raises may have changed the unit already
            try:
                self.on_unit(u, tensors)
            except Exception as exc:  # noqa: BLE001 - the loader failed: a mix
                self.failure = (proto.ERROR, f"rank {self.group.rank}: loading {u} failed: "
                                             f"{type(exc).__name__}: {exc}")
                return

    def _release(self, i: int) -> None:
        """Release the memory whose units are loaded (after a failure: all received, none kept)."""
        done = [key for key in self.live
                if (self.sched.free_at[key] <= i if self.failure is None else
                    self.sched.last_use[key] <= i or key[0] in self.ended)]
        for key in done:
            del self.live[key]
        if self.failure is not None:
            self.kept.clear()
        else:
            for key in [k for k in self.kept if self.sched.free_at[self.sched.memory(*k)] <= i]:
                del self.kept[key]


def lost(group: TransferGroup, what: str, error: str, handed: list[str], units: int) -> TransportError:
    """An engine rank's error for a peer lost mid-stream (the group is closed: no vote follows):
    MixedWeightsError when it loaded ``handed`` (of ``units``), else TransportError."""
    if not handed:
        return TransportError(f"{proto.lost(group, what, error)}; nothing loaded on this rank")
    group.close()
    return mixed_error(f"rank {group.rank}: {what}: {error} (the transfer group is closed)", handed, units,
                       "unknown: the group is closed")


def mixed_error(reason: str, handed: list[str], units: int, holders: str) -> MixedWeightsError:
    """The MixedWeightsError of an engine rank that loaded ``handed`` of its ``units`` units before
    a round failed (``detail``: how many units are new, why, and which ranks hold new weights)."""
    few = ", ".join(handed[:3]) + (f", ... +{len(handed) - 3}" if len(handed) > 3 else "")
    exc = MixedWeightsError(f"{reason}; loading had begun: {len(handed)} of {units} reload units are new "
                            f"({few}), the rest old - this receiver holds a MIX (ranks holding new weights: "
                            f"{holders}); the next refit must be whole")
    exc.detail = (f"{len(handed)} of {units} reload units new ({few}), the rest old, after: {reason}; "
                  f"ranks holding new weights: {holders}")
    return exc


def cut_off(exc: TransportError) -> TransportError:
    """A trainer rank's error for a bounded round whose group was lost mid-round (no commit vote
    can say which engine ranks loaded): ``exc``'s message, and that the ranks that loaded a unit
    hold a MIX (each engine rank's own error names it, and its session is flagged)."""
    return TransportError(f"{exc}; bounded mesh round cut off: engine ranks that loaded a unit hold a MIX "
                          f"and are flagged (each one's own error says so), the others are unchanged; the "
                          f"next refit must be whole")


def finish(group: TransferGroup, share: BoundedShare, votes: proto.Votes) -> None:
    """Raise the round's outcome on an engine rank after the commit vote (nothing when committed):
    MixedWeightsError when this rank loaded a unit, else TransportError (nothing loaded here;
    the message names the ranks that hold new weights, if any)."""
    if proto.outcome(votes) == "committed":
        return
    reason = share.failure[1] if share.failure else (f"rank {group.rank}: mesh round not committed: "
                                                     f"{proto.describe(votes.statuses)}")
    holders = ", ".join(map(str, votes.holders())) or "none"
    if share.handed:
        raise mixed_error(reason, share.handed, share.sched.units, holders)
    across = f" (ranks {holders} hold new weights: a MIX across ranks)" if votes.holders() else ""
    raise TransportError(f"{reason}; nothing loaded on this rank{across}")
