"""Receiver side of a transfer round: check the wire manifest, authenticate, receive and verify
every bucket, then stage (all-or-nothing) or hand each reload unit on (bounded memory).

:func:`receive_round` runs the receiver's half of :mod:`qstrat.transport.protocol`; it never
touches an engine itself. The vLLM backend (:mod:`qstrat.vllm.engine.transfer_backend`) and
:class:`~qstrat.transport.receive.standalone.StandaloneReceiver` (no engine: benchmarks, tests, a
checkpoint writer) build on it, through :class:`~qstrat.transport.receive.session.ReceiverSession`.

Modes (docs/transport.md, "Which mode"):

* ``atomic`` (default): the round's tensors stay in the received buffers (tensors are views of
  them) until the commit vote; peak memory: the round's payload (:attr:`WireManifest.total_bytes`)
  in ``staging`` memory (the group's device, or host memory - pinned with CUDA - received through
  two device bucket buffers).
* ``bounded``: ``on_unit`` is called with each reload unit's tensors (a decoder layer, or a
  module outside the layers: :func:`~qstrat.transport.wire_manifest.reload_unit`) as soon as
  every bucket holding them has arrived and its seal verified; a bucket buffer is released
  once every unit in it was handed. Peak memory: about two buckets plus one unit. A failure after
  the first unit was handed leaves the receiver holding a MIX (:class:`MixedWeightsError`).
* ``delta``: an atomic round whose buckets travel as patches (``patches``,
  :mod:`qstrat.transport.delta.receive`); ``bounded-delta``: the same patches, each reload unit
  handed to ``on_unit`` as a view of the rebuilt stream once its last bucket's digest verified
  (:class:`~qstrat.transport.receive.handoff.StreamUnits`), with bounded mode's MIX rule.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from qstrat.errors import MixedWeightsError, QstratError, TransferAuthError, TransportError, WireManifestMismatchError
from qstrat.transport import protocol
from qstrat.transport.protocol import BOUNDED_MODES, DELTA_MODES, MODES
from qstrat.transport.security.auth import PROTOCOL_VERSION, ReceiverAuth, RoundContext, from_words
from qstrat.transport.buckets import receive_buffers, slot_tensor, unpack
from qstrat.transport.delta.receive import PatchDecoder, receive_patches
from qstrat.transport.group import TransferGroup
from qstrat.transport.receive.handoff import StreamUnits, cut_off, few
from qstrat.transport.security.seal import Sealer, pieces
from qstrat.transport.timing import Phases
from qstrat.transport.wire_manifest import WireManifest, reload_unit

Check = Callable[[WireManifest], None]
Unit = list[tuple[str, torch.Tensor]]


def receive_round(group: TransferGroup, wire_manifest_doc: dict[str, Any], check: Check | None = None,
                  auth: ReceiverAuth | None = None, mode: str = "atomic",
                  on_unit: Callable[[str, Unit], None] | None = None,
                  staging: torch.device | None = None, stats: dict[str, float] | None = None,
                  protocol_version: Any = PROTOCOL_VERSION,
                  patches: Callable[[bytes], PatchDecoder] | None = None) -> Unit:
    """Receive one round from rank 0.

    Args:
        group: the open transfer group (this rank > 0).
        wire_manifest_doc: the round's wire manifest as sent in ``update_info``
            (:meth:`WireManifest.to_dict`).
        check: raises WireManifestMismatchError if the wire manifest does not match the engine (run
            before any data is received).
        auth: the receiver's secret, group address and last accepted counter (None: no secret,
            address as joined is not bound); ``auth.last_counter`` advances when the round is accepted.
        mode: one of :data:`MODES` (bound into the round MAC: a sender must use the same).
        on_unit: bounded modes (required there): called ``on_unit(unit, tensors)`` as units verify.
        staging: where the round is staged (None: received in place on the group's device); a
            device given explicitly (host staging: ``cpu``, pinned when CUDA is available) is
            filled by copying each verified bucket from two group-device receive buffers.
        stats: if given, receives ``peak_bytes``: the most bytes of received buffers alive at
            once in this round (staging and in-flight buckets; not the group's own buffers), and
            wall seconds by phase: ``handshake_s`` (wire manifest check, challenge, round header,
            accept vote), ``alloc_s`` (receive buffers), ``wait_s`` (blocked on the wire),
            ``seal_s`` (checksum or NH + HMAC, and the comparison), ``load_s`` (bounded: handing
            units), ``commit_s`` (commit vote), and ``cpu_s``: this process's CPU seconds over
            the round (all threads, gloo's included).
        protocol_version: the transport protocol version the sender's ``update_info`` names.
        patches: ``delta`` and ``bounded-delta`` (required there): returns the round's
            :class:`~qstrat.transport.delta.receive.PatchDecoder` given the round MAC; each
            bucket arrives as a patch it rebuilds and checks against the trainer's digest
            BEFORE the commit vote (a DeltaError is this rank's refusal, its ``vote_status``, so
            no rank keeps the round; bounded-delta: a MIX once a unit was handed); ``stats``: ``rebuild_s``.
    Returns: atomic: ``(name, tensor)`` in wire order, views of the staged buffers, every bucket
        sealed and verified, every rank agreeing to commit; bounded, bounded-delta: ``[]``
        (handed to on_unit); delta: the rebuilt tensors (views of the decoder's stream).
    Raises: WireManifestMismatchError (malformed, digest mismatch, engine check failed);
        TransferAuthError (no/wrong MAC, a challenge vector without this receiver's words, replay);
        TransportError (another protocol version) - all at step 2, before any data; TransportError
        for a failed seal, a sender abort, another rank's refusal, or a lost peer/timeout (the
        group is then closed) when this receiver loaded nothing; MixedWeightsError when the
        round is not committed everywhere and this receiver (bounded modes) loaded a unit.
    """
    if mode not in MODES or (mode in BOUNDED_MODES) != (on_unit is not None) or (
            mode in DELTA_MODES) != (patches is not None):
        raise TransportError(f"round mode {mode!r}: use 'atomic', 'bounded' with on_unit, 'delta' with patches, "
                             f"or 'bounded-delta' with both")
    auth = auth or ReceiverAuth(None, "", 0)
    t_start, cpu = time.perf_counter(), time.process_time()
    rejection, wire_manifest = _check_update(group, wire_manifest_doc, check, protocol_version)
    header = torch.empty(protocol.ROUND_WORDS, dtype=torch.int64, device=group.device)
    try:
        drawn, challenges = protocol.challenges(group, auth.last_counter)
        group.wait(group.broadcast(header))
    except RuntimeError as exc:
        raise protocol.lost(group, "no round header from the sender", exc) from None
    words = [int(v) for v in header.cpu()]
    counter, mac = words[4], from_words(words[9:13])
    status = protocol.PROTOCOL if isinstance(rejection, _ProtocolMismatch) else getattr(
        rejection, "vote_status", protocol.REJECTED)
    if rejection is None and words[:2] != [protocol.ROUND_MAGIC, PROTOCOL_VERSION]:
        rejection, status = _ProtocolMismatch(
            f"rank {group.rank}: the round header is not protocol {PROTOCOL_VERSION}'s (magic/version "
            f"{words[:2]}): trainer and engine run different qstrat transport versions"), protocol.PROTOCOL
    if rejection is None:
        want = protocol.round_header(len(wire_manifest.buckets), wire_manifest.total_bytes, counter,
                              wire_manifest.digest, mac, torch.device("cpu")).tolist()
        if want != words:
            rejection = WireManifestMismatchError(
                f"rank {group.rank}: the sender streams another wire manifest than the one in "
                f"update_info (digest {wire_manifest.digest[:12]}...)")
    if rejection is None:
        ctx = RoundContext(wire_manifest.digest, mode, counter, challenges, auth.address, auth.port,
                           group.world_size)
        reason = auth.verify(ctx, mac, group.rank, drawn)
        if reason is not None:
            rejection, status = TransferAuthError(f"rank {group.rank}: round refused: {reason}"), protocol.UNAUTHENTICATED
    votes = _vote(group, protocol.ACCEPT, status if rejection else protocol.OK, False, auth.secret, mac, "accept vote")
    if rejection is not None:
        raise rejection
    if votes.failed():
        raise TransportError(f"rank {group.rank}: round refused before any data: {protocol.describe(votes.statuses)}")
    auth.last_counter = counter
    stats = stats if stats is not None else {}
    stats["handshake_s"] = time.perf_counter() - t_start
    seal = Sealer(auth.secret, mac, group.device)
    staged: Unit = []
    if patches is not None:
        decoder = patches(mac)
        hand = StreamUnits(wire_manifest, decoder.cuts, on_unit) if on_unit is not None else None
        staged, failure = receive_patches(group, wire_manifest, seal, decoder, stats, hand)
        received, handed, units = [], hand.handed if hand else [], hand.units if hand else 0
    else:
        received, failure, handed, units = _receive_buckets(group, wire_manifest, seal, on_unit, staging, stats)
    t0 = time.perf_counter()
    # a MIX votes MIXED, unless only the delta failed (every handed unit verified): its own status
    own = (protocol.MIXED if handed and failure[0] != protocol.DELTA else failure[0]) if failure else protocol.OK
    votes = _vote(group, protocol.COMMIT, own, bool(handed), auth.secret, mac, "commit vote")
    stats["commit_s"], stats["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu
    if protocol.outcome(votes) == "committed":
        return [] if on_unit is not None else staged if patches is not None else unpack(wire_manifest, received)
    reason = failure[1] if failure else f"rank {group.rank}: round not committed: {protocol.describe(votes.statuses)}"
    holders = ", ".join(map(str, votes.holders())) or "none"
    if handed:
        exc = MixedWeightsError(
            f"{reason}; loading had begun: {len(handed)} of {units} reload units are new "
            f"({few(handed)}), the rest old - this receiver holds a MIX (ranks holding new weights: "
            f"{holders}); the next refit must be whole")
        exc.detail = (f"{len(handed)} of {units} reload units new ({few(handed)}), the rest old, "
                      f"after: {reason}; ranks holding new weights: {holders}")
        raise exc
    across = f" (ranks {holders} hold new weights: a MIX across ranks)" if votes.holders() else ""
    raise TransportError(f"{reason}; nothing loaded{across}")


class _ProtocolMismatch(TransportError):
    """Another transport protocol version (refused in the accept vote with status PROTOCOL)."""


def _check_update(group: TransferGroup, wire_manifest_doc: Any, check: Check | None, version: Any
                  ) -> tuple[Exception | None, WireManifest | None]:
    """The update_info's checks before the handshake: (why the round is refused or None, the
    wire manifest). Never raises: a refusal is voted, so no rank waits for the timeout."""
    if version != PROTOCOL_VERSION:
        return _ProtocolMismatch(f"rank {group.rank}: update_info names transport protocol {version!r}, "
                                 f"this engine speaks {PROTOCOL_VERSION}: trainer and engine run "
                                 f"different qstrat transport versions"), None
    try:
        wire_manifest = WireManifest.received(wire_manifest_doc)
        if check is not None:
            check(wire_manifest)
    except TransportError as exc:
        return exc, None
    except QstratError as exc:  # e.g. the engine's manifest cannot be built: its reason
        return WireManifestMismatchError(f"rank {group.rank}: {type(exc).__name__}: {exc}"), None
    except Exception as exc:  # noqa: BLE001 - refused in the accept vote like any other
        return WireManifestMismatchError(f"rank {group.rank}: malformed wire manifest: {exc!r}"), None
    return None, wire_manifest


def _unit_plan(wire_manifest: WireManifest) -> tuple[dict[int, list[str]], dict[str, list[Any]], dict[int, int]]:
    """Bounded mode bookkeeping: units completed by each bucket, each unit's slots, and the
    bucket after which each bucket's buffer can be released."""
    slots: dict[str, list[Any]] = {}
    last: dict[str, int] = {}
    for s in wire_manifest.slots:
        u = reload_unit(s.name)
        slots.setdefault(u, []).append(s)
        last[u] = max(last.get(u, -1), s.bucket + s.chunks - 1)
    completes: dict[int, list[str]] = {}
    for u in slots:  # dict order: wire order of each unit's first tensor
        completes.setdefault(last[u], []).append(u)
    release: dict[int, int] = {}
    for u, ss in slots.items():
        for s in ss:
            for c in range(s.chunks):
                release[s.bucket + c] = max(release.get(s.bucket + c, -1), last[u])
    return completes, slots, release


def _receive_buckets(group: TransferGroup, wire_manifest: WireManifest, seal: Sealer,
                     on_unit: Callable[[str, Unit], None] | None, staging: torch.device | None,
                     stats: dict[str, float]) -> tuple[list[torch.Tensor], tuple[int, str] | None, list[str], int]:
    """Step 3: receive every bucket (next one posted while this one is verified); keep
    receiving after a failure so the collectives stay aligned. Returns the staged buffers
    (atomic), the first failure ``(status, message)`` or None, the units handed (bounded) and
    the round's unit count."""
    bounce = staging is not None
    staging = staging or group.device
    pin = bounce and staging.type == "cpu" and torch.cuda.is_available()
    source = receive_buffers(wire_manifest, staging, pin)
    n = len(wire_manifest.buckets)
    kept: dict[int, torch.Tensor] = {}
    wires = ([torch.empty(wire_manifest.bucket_bytes, dtype=torch.uint8, device=group.device)
              for _ in range(2)] if bounce else [])
    completes, unit_slots, release = _unit_plan(wire_manifest)
    handed: list[str] = []
    failure: tuple[int, str] | None = None
    live: dict[Any, int] = {}  # allocation -> bytes (a chunked tensor: one allocation)
    prof = Phases("alloc_s", "wait_s", "seal_s", "load_s")
    peak = sum(w.numel() for w in wires)

    def alloc_key(k: int) -> Any:
        b = wire_manifest.buckets[k]
        return k if b.tensor is None else b.tensor

    def post(k: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor, list[Any], Any]:
        nonlocal peak
        b, dst = prof.call("alloc_s", next, source)
        if alloc_key(k) not in live:
            live[alloc_key(k)] = b.nbytes if b.tensor is None else next(
                s.nbytes for s in wire_manifest.slots if s.name == b.tensor)
            peak = max(peak, sum(live.values()) + sum(w.numel() for w in wires))
        landing = wires[k % 2][:dst.numel()] if bounce else dst  # where the bucket is received
        cut = pieces(landing)
        works = [group.broadcast(piece) for piece in cut]  # the payload in pieces, then the header
        hdr = torch.empty(protocol.BUCKET_WORDS, dtype=torch.int64, device=group.device)
        return dst, landing, cut, hdr, works, group.broadcast(hdr)

    def done() -> tuple[list[torch.Tensor], tuple[int, str] | None, list[str], int]:
        stats["peak_bytes"] = peak
        stats.update(prof)
        return [kept[k] for k in sorted(kept)], failure, handed, len(unit_slots)

    pending = post(0) if n else None
    for k in range(n):
        dst, landing, cut, hdr, w_data, w_hdr = pending
        state = seal.begin(k, landing.numel()) if failure is None else None
        try:
            for i, work in enumerate(w_data):
                with prof.timed("wait_s"):
                    group.wait(work)
                    if i == len(w_data) - 1:  # the header follows the payload: flags and seal
                        group.wait(w_hdr)
                        words = [int(v) for v in hdr.cpu()]
                        if words[2] & protocol.ABORT:
                            failure = failure or (protocol.SENDER_ABORT, f"rank {group.rank}: the sender aborted "
                                                                  f"the stream at bucket {k}/{n}")
                            return done()
                        pending = post(k + 1) if k + 1 < n else None  # before sealing the last piece
                if state is not None:  # piece i is sealed while piece i+1 arrives
                    prof.call("seal_s", state.update, cut[i])
        except RuntimeError as exc:  # c10d: the sender (or a peer) died or timed out
            error = str(exc)
            pending = hdr = w_hdr = w_data = work = None
            what = f"stream truncated at bucket {k}/{n} (sender lost?)"
            if handed:
                raise cut_off(group, what, error, handed, len(unit_slots)) from None
            raise protocol.lost(group, what, error) from None
        w_data = w_hdr = work = None
        if failure is not None:
            continue
        if words[0] != protocol.BUCKET_MAGIC or words[1] != k:
            failure = (protocol.CHECKSUM, f"rank {group.rank}: bucket {k}/{n} arrived out of order (header {words[1]})")
        elif not prof.call("seal_s", state.verifies, words[2], from_words(words[3:7])):
            failure = (protocol.CHECKSUM, f"rank {group.rank}: bucket {k}/{n} failed its checksum "
                                   f"(seal mismatch; tensors {_names(wire_manifest, k)})")
        if failure is not None:
            continue
        if bounce:
            dst.copy_(landing, non_blocking=pin)
            if group.device.type == "cuda":
                torch.cuda.current_stream(group.device).synchronize()
        kept[k] = dst
        if on_unit is None:
            continue
        for u in completes.get(k, []):
            handed.append(u)  # a load that raises may have changed the unit already
            try:
                prof.call("load_s", on_unit, u, [(s.name, slot_tensor(s, kept[s.bucket])) for s in unit_slots[u]])
            except Exception as exc:  # noqa: BLE001 - the engine's load failed: a mix
                failure = (protocol.ERROR, f"rank {group.rank}: loading {u} failed: {type(exc).__name__}: {exc}")
                break
        for j in [j for j in kept if release.get(j, -1) <= k]:
            del kept[j]
            live.pop(alloc_key(j), None)
    return done()


def _names(wire_manifest: WireManifest, k: int) -> list[str]:
    names = [s.name for s in wire_manifest.slots if s.bucket <= k < s.bucket + s.chunks]
    return names[:3] + (["..."] if len(names) > 3 else [])


def _vote(group: TransferGroup, step: int, status: int, holds_new: bool, secret: Any, mac: bytes,
          what: str) -> protocol.Votes:
    try:
        return protocol.vote(group, step, status, holds_new, secret, mac)
    except RuntimeError as exc:
        raise protocol.lost(group, f"{what} failed (a peer died?)", exc) from None
