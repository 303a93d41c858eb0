"""Trainer side: drive a refit of remote engines from a :class:`~qstrat.RefitDriver` plan.

:class:`RefitSender` talks to each engine through a weight-sync client (vLLM's
``VLLMWeightSyncClient`` protocol: ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``; e.g. ``vllm.distributed.weight_transfer.
HTTPVLLMWeightSyncClient`` for a ``vllm serve`` endpoint) whose engines run
``weight_transfer_config={"backend": "qstrat"}`` (:mod:`qstrat.engine.transfer_backend`), and
streams the tensors itself on a torch.distributed group (rank 0 = this process).

A round: ``RefitDriver.prepare`` with the wire manifest as this sink's check (nothing sent on
error) -> ``start_weight_update``
-> ``update_weights({"wire_manifest": ..., "mode": ...})`` on every engine, concurrently with the
stream (:mod:`qstrat.transport.protocol`; authenticated with the shared secret,
:mod:`qstrat.transport.auth`) -> ``finish_weight_update`` (atomic mode: the engines load) only if
every rank voted to commit.

Double buffering: at most two buckets are in flight; bucket k+1 is packed while bucket k is
being broadcast. A bucket's payload goes out in pieces of at most ``PIECE_BYTES``
(:mod:`qstrat.transport.seal`), each packed and sealed just before it is posted, so the packing
and sealing of piece i+1 overlap the transfer of piece i and the header (with the seal) follows
the payload. Chunks of
a tensor larger than a bucket are broadcast from the tensor's own memory (no packing copy).
"""
from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.errors import (MixedWeightsError, TransferAuthError, TransportError,
                           WireManifestMismatchError)
from qstrat.driver import RefitDriver
from qstrat.errors import PlanError
from qstrat.inputs import NamedTensors
from qstrat.plan import RefitPlan
from qstrat.engine_manifest import model_tensors_check
from qstrat.prepare import SinkCheck
from qstrat.transport import protocol as p
from qstrat.transport.auth import ENV_SECRET, RoundContext, Secret, round_mac
from qstrat.transport.buckets import bucket_contents, chunk_view, pack_range
from qstrat.transport.group import DEFAULT_TIMEOUT_S, TransferGroup, open_group
from qstrat.transport.rpc_errors import describe as describe_rpc_error
from qstrat.transport.seal import PIECE_BYTES, Sealer, pieces
from qstrat.transport.wire_manifest import (DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES, TensorSlot,
                                            WireManifest, wire_manifest_for_plan)


@dataclass(frozen=True, repr=False)
class TransferReport:
    """One round: its wire manifest, payload bytes, buckets, wall seconds of the stream (steps 1-4)
    and of the whole round (RPCs and engine load included). Printed as one line (the wire manifest
    as its tensor count and digest; every slot: ``report.wire_manifest.to_dict()``)."""

    wire_manifest: WireManifest
    bytes: int
    buckets: int
    stream_seconds: float
    seconds: float

    def __repr__(self) -> str:
        return (f"TransferReport(tensors={len(self.wire_manifest.slots)}, bytes={self.bytes} "
                f"({self.bytes / 2**20:.2f} MiB), buckets={self.buckets}, "
                f"stream_seconds={self.stream_seconds:.3f}, seconds={self.seconds:.3f}, "
                f"wire manifest digest {self.wire_manifest.digest[:12]})")


class RefitSender:
    """Rank 0 of the transfer group; fans each weight-sync call out to every engine.

    Args:
        clients: one weight-sync client per engine (``VLLMWeightSyncClient`` protocol).
        master_address, master_port: where this process hosts the group's TCPStore.
        backend: ``gloo`` (CPU) or ``nccl`` (GPU).
        timeout_s: rendezvous, per-collective and per-RPC timeout (seconds).
        bucket_bytes, alignment: bucket bound and in-bucket alignment (bytes).
        workers_per_client: ranks each engine brings (its TP x PP x DP worker count).
        secret: the secret shared with the engines (bytes or text, >= 16 bytes; default: the
            environment variable ``QSTRAT_TRANSFER_SECRET``; None there too: unauthenticated
            rounds, which an engine holding a secret refuses). Never logged or sent.
        mode: ``atomic`` (default: engines stage the whole round and load it only when every
            rank verified every bucket) or ``bounded`` (engines load each reload unit as soon as
            its buckets verified: memory ~ two buckets + one layer; a fault mid-round leaves a
            MIX, reported as MixedWeightsError, after which engines accept only whole refits).
    """

    def __init__(self, clients: Sequence[Any], master_address: str, master_port: int,
                 backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, alignment: int = DEFAULT_ALIGNMENT,
                 workers_per_client: Sequence[int] | None = None,
                 secret: Secret | bytes | str | None = None, mode: str = "atomic") -> None:
        if mode not in ("atomic", "bounded"):
            raise TransportError(f"RefitSender mode {mode!r}: use 'atomic' or 'bounded'")
        self.mode = mode
        self._secret = Secret.coerce(secret if secret is not None else (os.environ.get(ENV_SECRET) or None))
        self._counter = 0
        #: After a failed bounded round: which ranks reported holding a mix (None: no mix known).
        self.mixed: str | None = None
        self.clients = list(clients)
        self.workers = list(workers_per_client or [1] * len(self.clients))
        if len(self.workers) != len(self.clients):
            raise TransportError("workers_per_client needs one count per client")
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.timeout_s, self.bucket_bytes, self.alignment = timeout_s, bucket_bytes, alignment
        self.group: TransferGroup | None = None
        #: The last round's seconds by phase (wall): ``start_s`` (start_weight_update RPCs),
        #: ``handshake_s`` (challenge, round header, accept vote), the bucket loop by activity
        #: (``source_s``: the driver producing tensors; ``pack_s``; ``seal_s``: checksum or NH +
        #: HMAC; ``wait_s``: blocked on broadcasts), ``commit_s`` (commit vote), ``update_s``
        #: (waiting for the update_weights RPCs after the stream), ``finish_s``
        #: (finish_weight_update: the engines' load), and ``cpu_s``: this process's CPU seconds
        #: over the round (all threads). See docs/performance.md.
        self.profile: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)),
                                        thread_name_prefix="qstrat-rpc")

    # ---- setup ----------------------------------------------------------------------------
    def init_infos(self) -> list[dict[str, Any]]:
        """The ``init_weight_transfer_engine`` payload for each client (rank offsets differ)."""
        world = 1 + sum(self.workers)
        infos, offset = [], 1
        for n in self.workers:
            infos.append({"master_address": self.master_address, "master_port": self.master_port,
                          "rank_offset": offset, "world_size": world, "backend": self.backend,
                          "timeout_s": self.timeout_s})
            offset += n
        return infos

    def connect(self) -> None:
        """Open the group with every engine (their ``init_weight_transfer_engine`` runs
        concurrently with this rank's rendezvous). Raises TransportError on failure/timeout."""
        self.close()
        futures = [self._pool.submit(c.init_weight_transfer_engine, info)
                   for c, info in zip(self.clients, self.init_infos())]
        try:
            self.group = open_group(self.master_address, self.master_port, 0, 1 + sum(self.workers),
                                    self.backend, self.timeout_s)
        except TransportError as exc:  # say why the engines did not join (e.g. an address refusal)
            errors = self._results(futures)
            kind = TransferAuthError if any("TransferAuthError" in e for e in errors) else TransportError
            raise kind(f"{exc}; init_weight_transfer_engine: {errors or 'no error reported'}") from None
        errors = self._results(futures)
        if errors:
            self.close()
            raise TransportError(f"init_weight_transfer_engine failed: {errors}")

    def close(self) -> None:
        """Close the group (engines keep their weights)."""
        if self.group is not None:
            self.group.close()
            self.group = None

    # ---- a round --------------------------------------------------------------------------
    def refit(self, driver: RefitDriver, named_tensors: NamedTensors, plan: RefitPlan | None = None
              ) -> TransferReport:
        """Quantize ``named_tensors`` with ``driver`` and refit every engine (all or none).

        Args:
            driver: the ``RefitDriver``; named_tensors: the trainer's (HF name, tensor) pairs.
            plan: a plan made beforehand, e.g. ``driver.plan(specs).only_layers(changed)`` to
                refit only the layers that changed (whole layers: engines refuse a partly sent
                layer; the others keep their weights).
        Raises: before anything is sent (:meth:`RefitDriver.prepare`: plan, every layer, model
            tensors, the wire manifest, backends, values): PlanError (also for a refit without
            ``plan`` that leaves out a decoder layer of the driver's ``hf_config``: the engines
            would keep its old weights; and for a plan that does not match the tensors that
            ``hf_config`` implies: :func:`qstrat.engine_manifest.check_model_tensors`), WireManifestMismatchError (a ``bucket_bytes`` or
            ``alignment`` the wire manifest cannot use), BackendUnavailableError, NonFiniteError;
            WireManifestMismatchError if an engine refused the wire manifest (no data sent);
            TransportError for a failed checksum, an aborted or truncated stream, a lost peer or
            a timeout - in every case no engine loaded anything.
        """
        check = SinkCheck("wire manifest", lambda p: wire_manifest_for_plan(p.plan, self.bucket_bytes,
                                                                               self.alignment))
        whole = SinkCheck("every layer", lambda p: check_every_layer(p.plan, driver, p.plan_given))
        prepared = driver.prepare(named_tensors, plan, (whole, model_tensors_check(driver), check))
        return self.send(prepared.results[check.name], prepared.execute())

    def send(self, wire_manifest: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]]
             ) -> TransferReport:
        """Run one round for ``wire_manifest`` with ``tensors`` yielded in its wire order."""
        if self.group is None or self.group.pg is None:
            raise TransportError("connect() first (no open transfer group)")
        start, cpu = time.perf_counter(), time.process_time()
        self.profile = prof = dict.fromkeys(("start_s", "handshake_s", "source_s", "pack_s", "seal_s",
                                             "wait_s", "commit_s", "update_s", "finish_s", "cpu_s"), 0.0)
        self._call_all("start_weight_update")
        doc = {"wire_manifest": wire_manifest.to_dict(), "mode": self.mode}
        futures = [self._pool.submit(c.update_weights, doc) for c in self.clients]
        stream_start = time.perf_counter()
        prof["start_s"] = stream_start - start
        try:
            self._stream(wire_manifest, tensors)
        except TransportError as exc:
            errors = self._results(futures)
            kind = next(k for k in (WireManifestMismatchError, TransferAuthError, MixedWeightsError,
                                    TransportError) if isinstance(exc, k))
            raise kind(f"{exc}; engines: {errors or 'no error reported'}") from exc
        t0 = time.perf_counter()
        stream_seconds = t0 - stream_start
        errors = self._results(futures)
        if errors:
            raise TransportError(f"update_weights failed after the stream: {errors}")
        t1 = time.perf_counter()
        self._call_all("finish_weight_update")
        prof["update_s"], prof["finish_s"] = t1 - t0, time.perf_counter() - t1
        prof["cpu_s"] = time.process_time() - cpu
        self.mixed = None
        return TransferReport(wire_manifest, wire_manifest.total_bytes, len(wire_manifest.buckets),
                              stream_seconds, time.perf_counter() - start)

    def _stream(self, wire_manifest: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        group = self.group
        assert group is not None
        self._counter = max(self._counter + 1, time.time_ns())
        prof, t0 = self.profile, time.perf_counter()
        try:
            challenges = p.challenges(group)
            ctx = RoundContext(wire_manifest.digest, self.mode, self._counter, challenges,
                               self.master_address, self.master_port, group.world_size)
            mac = round_mac(self._secret, ctx)
            group.wait(group.broadcast(self.round_header(wire_manifest, ctx, mac)))
            statuses = p.vote(group, p.OK)
        except RuntimeError as exc:
            raise p.lost(group, "round header / accept vote failed (an engine died?)", exc) from None
        if any(statuses):
            cls = (WireManifestMismatchError if p.REJECTED in statuses else
                   TransferAuthError if p.UNAUTHENTICATED in statuses else TransportError)
            raise cls(f"round refused before any data: {p.describe(statuses)}")
        prof["handshake_s"] = time.perf_counter() - t0
        try:
            failure = self._send_buckets(group, wire_manifest, iter(tensors), mac)
        except TransportError as exc:
            if self.mode == "bounded":
                self.mixed = f"a bounded round was cut off ({exc})"
                raise MixedWeightsError(f"{exc}; bounded mode: engines may hold a MIX of two "
                                        f"rounds, the next refit must be whole") from None
            raise
        t0 = time.perf_counter()
        try:
            statuses = p.vote(group, p.SENDER_ABORT if failure else p.OK)
        except RuntimeError as exc:
            raise p.lost(group, "commit vote failed (a receiver died?)", exc) from None
        prof["commit_s"] = time.perf_counter() - t0
        if p.MIXED in statuses:
            self.mixed = p.describe([s if s == p.MIXED else 0 for s in statuses])
            raise MixedWeightsError(f"round not committed: {p.describe(statuses)}; bounded mode: "
                                    f"{self.mixed}; the next refit must be whole")
        loaded = "" if self.mode == "atomic" else " (bounded mode: no unit was loaded)"
        if failure:
            raise TransportError(f"sender aborted the stream: {failure}; nothing loaded{loaded}")
        if any(statuses):
            raise TransportError(f"round not committed: {p.describe(statuses)}; nothing loaded{loaded}")

    def round_header(self, wire_manifest: WireManifest, ctx: RoundContext, mac: bytes) -> torch.Tensor:
        """The round header for ``ctx`` (a hook: the replay tests override it)."""
        return p.round_header(len(wire_manifest.buckets), wire_manifest.total_bytes, ctx.counter,
                              wire_manifest.digest, mac, self.group.device)

    def _send_buckets(self, group: TransferGroup, wire_manifest: WireManifest,
                      tensors: Iterator[tuple[str, torch.Tensor]], mac: bytes) -> str | None:
        """Step 3. Returns None, or why the sender aborted (its source fell short/disagreed)."""
        contents = bucket_contents(wire_manifest)
        sealer = Sealer(self._secret, mac, group.device)
        prof = self.profile
        clock = time.perf_counter
        buffers: list[torch.Tensor] = []
        pending: deque[tuple[Any, ...]] = deque()
        big: torch.Tensor | None = None
        reason, k = None, 0
        works: list[Any] | None = None
        try:
            for k, b in enumerate(wire_manifest.buckets):
                if len(pending) == 2:  # double buffering: bucket k-2's buffer is free after this
                    t0 = clock()
                    _finish(group, pending.popleft())
                    prof["wait_s"] += clock() - t0
                busy = {id(item[-1]) for item in pending}
                flags, parts = 0, None
                try:
                    t0 = clock()
                    if b.tensor is None:
                        owner = _free_buffer(buffers, busy, wire_manifest.bucket_bytes, group.device)
                        parts = [self._next(tensors, s, group).contiguous() for s in contents[k]]
                        payload = owner[:b.nbytes]  # packed piece by piece below
                        prof["source_s"] += clock() - t0
                    else:
                        slot = contents[k][0]
                        if slot.bucket == k:
                            big = self._next(tensors, slot, group).contiguous()
                        payload, owner = chunk_view(big, wire_manifest, slot, b), big
                        prof["source_s"] += clock() - t0
                except TransportError as exc:
                    flags, reason = p.ABORT, str(exc)
                    owner = _free_buffer(buffers, busy, wire_manifest.bucket_bytes, group.device)
                    payload = owner[:b.nbytes]
                # a shared bucket is packed piece by piece, each piece just before it is sealed
                # and posted; a transmit_payload override sees the whole packed bucket first
                lazy = parts is not None and not flags and _default_hook(self)
                if parts is not None and not flags and not lazy:
                    t0 = clock()
                    pack_range(owner, contents[k], parts, 0, b.nbytes)
                    prof["pack_s"] += clock() - t0
                wire = self.transmit_payload(k, payload)
                works = []  # the payload in pieces, each sealed just before it is posted
                state = None if flags else sealer.begin(k, payload.numel())
                for i, (piece, out) in enumerate(zip(pieces(payload), pieces(wire))):
                    if lazy:
                        t0 = clock()
                        pack_range(owner, contents[k], parts, i * PIECE_BYTES, i * PIECE_BYTES + piece.numel())
                        prof["pack_s"] += clock() - t0
                    if state is not None:
                        t0 = clock()
                        state.update(piece)
                        prof["seal_s"] += clock() - t0
                    works.append(group.broadcast(out))
                t0 = clock()
                seal = state.seal(flags) if state is not None else sealer.seal(k, flags, None)
                prof["seal_s"] += clock() - t0
                hdr = p.bucket_header(k, flags, seal, group.device)
                works.append(group.broadcast(hdr))
                pending.append((works, hdr, wire, owner))
                if flags:
                    break
            t0 = clock()
            while pending:
                _finish(group, pending.popleft())
            prof["wait_s"] += clock() - t0
            return reason
        except RuntimeError as exc:  # c10d: a peer died or timed out
            pending.clear()
            works = None  # no Work may outlive this block: gloo closes the group with the last one
            error = str(exc)
        raise p.lost(group, f"broadcast of bucket {k}/{len(wire_manifest.buckets)} failed "
                            f"(a receiver died?)", error) from None

    def transmit_payload(self, index: int, payload: torch.Tensor) -> torch.Tensor:
        """The bytes put on the wire for bucket ``index`` (a hook: identity here; the fault tests
        override it to corrupt or cut the stream). The seal is always computed from ``payload``;
        a hook must return a new tensor of the same size, not change ``payload``."""
        return payload

    @staticmethod
    def _next(tensors: Iterator[tuple[str, torch.Tensor]], slot: TensorSlot,
              group: TransferGroup) -> torch.Tensor:
        try:
            name, t = next(tensors)
        except StopIteration:
            raise TransportError(f"the source ended before {slot.name!r} (truncated)") from None
        if (name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) != (slot.name, slot.dtype, slot.shape):
            raise TransportError(f"the source yielded {name!r} {t.dtype} {list(t.shape)} where the "
                                 f"wire manifest has {slot.name!r} {slot.dtype} {list(slot.shape)}")
        return t.to(group.device)

    # ---- RPC fan-out ----------------------------------------------------------------------
    def _call_all(self, method: str) -> None:
        errors = self._results([self._pool.submit(getattr(c, method)) for c in self.clients])
        if errors:
            raise TransportError(f"{method} failed: {errors}")

    def _results(self, futures: list[Future]) -> list[str]:
        """Wait (bounded) for every RPC; the errors as ``"engine i: message"``."""
        done, _ = wait_futures(futures, timeout=self.timeout_s)
        errors = []
        for i, f in enumerate(futures):
            if f not in done:
                errors.append(f"engine {i}: no answer within {self.timeout_s:g} s")
            elif f.exception() is not None:
                errors.append(f"engine {i}: {describe_rpc_error(f.exception())}")
        return errors


def _default_hook(sender: RefitSender) -> bool:
    """Whether ``sender`` keeps the identity :meth:`RefitSender.transmit_payload`."""
    return type(sender).transmit_payload is RefitSender.transmit_payload


def _finish(group: TransferGroup, item: tuple[Any, ...]) -> None:
    """Wait for a bucket's payload and header broadcasts."""
    for work in item[0]:
        group.wait(work)


def _free_buffer(buffers: list[torch.Tensor], busy: set[int], size: int,
                 device: torch.device) -> torch.Tensor:
    """A pack buffer not in flight (at most two are ever allocated)."""
    for buf in buffers:
        if id(buf) not in busy:
            return buf
    buffers.append(torch.empty(size, dtype=torch.uint8, device=device))
    return buffers[-1]


def check_every_layer(plan: RefitPlan, driver: RefitDriver, plan_given: bool) -> None:
    """Raise PlanError when a refit without an explicit (partial) ``plan`` leaves out a decoder
    layer of the model: vLLM's layerwise reload keeps the old weights of a layer that gets none,
    so the engines would serve a mix silently. The depth is the driver's ``hf_config``
    (``num_hidden_layers``); without one there is nothing to compare with and nothing is checked.
    A partial refit is explicit: ``plan=driver.plan(specs).only_layers(changed)``."""
    if plan_given:
        return
    depth = driver.layout.num_layers(driver.hf_config) if driver.hf_config else None
    if not depth:
        return
    have = {e.layer for e in plan.entries if e.layer is not None and e.kind != "mtp"}
    missing = [i for i in range(depth) if i not in have]
    if missing:
        few = ", ".join(map(str, missing[:6])) + (" ..." if len(missing) > 6 else "")
        raise PlanError(f"the refit leaves out decoder layer(s) {few} of the model's {depth} (hf_config."
                        "num_hidden_layers): the engines would keep their old weights there. Send every "
                        "layer, or pass plan=driver.plan(specs).only_layers(changed) for an explicit partial "
                        "refit (nothing was sent)")
