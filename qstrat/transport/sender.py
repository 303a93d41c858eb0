"""Trainer side: drive a refit of remote engines from a :class:`~qstrat.RefitDriver` plan.

:class:`RefitSender` talks to each engine through a weight-sync client (vLLM's
``VLLMWeightSyncClient`` protocol: ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``; e.g. ``vllm.distributed.weight_transfer.
HTTPVLLMWeightSyncClient`` for a ``vllm serve`` endpoint) whose engines run
``weight_transfer_config={"backend": "qstrat"}`` (:mod:`qstrat.engine.transfer_backend`), and
streams the tensors itself on a torch.distributed group (rank 0 = this process).

A round: ``RefitDriver.prepare`` with the wire manifest as this sink's check (nothing sent on
error) -> ``start_weight_update`` -> ``update_weights({"wire_manifest": ..., "mode": ...,
"protocol": ...})`` on every engine, concurrently with the stream (:mod:`qstrat.transport.protocol`;
the buckets: :mod:`qstrat.transport.outgoing`; authenticated with the shared secret,
:mod:`qstrat.transport.auth`) -> ``finish_weight_update`` (atomic mode: the engines load) only if
every rank voted to commit.

Outcomes (the same definition as the receivers', :func:`qstrat.transport.protocol.outcome`): a
round returns a :class:`TransferReport` only when every engine committed (atomic: and loaded);
it raises MixedWeightsError, naming the ranks or engines that hold new weights, when some do and
the round was not committed everywhere; any other failure raises with nothing loaded anywhere.
Each weight-sync call runs on a daemon thread of its own and is waited for at most ``timeout_s``:
a hung call neither blocks the next round's calls nor the interpreter's exit.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.driver import RefitDriver
from qstrat.engine_manifest import model_tensors_check
from qstrat.errors import (MixedWeightsError, PlanError, TransferAuthError, TransportError,
                           WireManifestMismatchError)
from qstrat.inputs import NamedTensors
from qstrat.plan import RefitPlan
from qstrat.prepare import SinkCheck
from qstrat.transport import delta
from qstrat.transport import protocol as proto
from qstrat.transport.auth import INIT_REFUSED, PROTOCOL_VERSION, RoundContext, next_counter, sign_init
from qstrat.transport.engine_check import FORMAT_KEY, ONLINE_KEY
from qstrat.transport.group import DEFAULT_TIMEOUT_S, TransferGroup, open_group
from qstrat.transport.keys import ENV_SECRET, Secret
from qstrat.transport.outgoing import SourceFailure, send_buckets
from qstrat.transport.rpc_errors import describe as describe_rpc_error
from qstrat.transport.seal import Sealer
from qstrat.transport.timing import Phases
from qstrat.transport.wire_manifest import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES, WireManifest, wire_manifest_for_plan

logger = logging.getLogger("qstrat.transport")
_UNNAMED = object()


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
    #: ``mode="delta"``: what the round sent and why (None in the other modes).
    delta: DeltaReport | None = None

    def __repr__(self) -> str:
        more = f", {self.delta}" if self.delta is not None else ""
        return (f"TransferReport(tensors={len(self.wire_manifest.slots)}, bytes={self.bytes} "
                f"({self.bytes / 2**20:.2f} MiB), buckets={self.buckets}, "
                f"stream_seconds={self.stream_seconds:.3f}, seconds={self.seconds:.3f}, "
                f"wire manifest digest {self.wire_manifest.digest[:12]}{more})")


@dataclass(frozen=True)
class DeltaReport:
    """A ``mode="delta"`` round: ``kind`` ``delta`` (some tile went as a patch) or ``full``
    (every tile raw); ``reason``: why it went full (None: it did not, or every tile was simply
    smaller raw), e.g. ``no base ...`` or ``the engines refused the delta: ...`` (a stale base or
    a digest mismatch: the round was then sent again, whole); ``full_bytes``: the full round's
    payload (the target wire manifest's); ``wire_bytes``: the payload sent (the delta wire
    manifest's: header, tile table and patch); ``tiles``: tiles per encoding (``rle``,
    ``bitmap``, ``raw``; :mod:`qstrat.transport.delta`); ``source_s``: wall seconds quantizing
    the round into its stream; ``encode_s``: wall seconds encoding and digesting the round sent;
    ``base_bytes``: the host memory the sender's base holds after the round; ``attempts``: 2 when
    a refused delta was followed by the whole round. The report's ``seconds`` then cover the
    whole ``refit`` call after the checks (quantization, encoding, the round or rounds)."""

    kind: str
    reason: str | None
    full_bytes: int
    wire_bytes: int
    tiles: dict[str, int]
    source_s: float
    encode_s: float
    base_bytes: int
    attempts: int

    def __str__(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return (f"delta kind={self.kind}{why}, wire {self.wire_bytes} of {self.full_bytes} bytes "
                f"({100 * self.wire_bytes / max(self.full_bytes, 1):.2f} %), tiles {self.tiles}")


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
            rounds, which an engine holding a secret refuses, and one warning per sender on the
            ``qstrat.transport`` logger). Never logged or sent.
        mode: ``atomic`` (default: engines stage the whole round and load it only when every
            rank verified every bucket), ``bounded`` (engines load each reload unit as soon as
            its buckets verified: memory ~ two buckets + one layer; a fault mid-round leaves a
            MIX, reported as MixedWeightsError, after which engines accept only whole refits) or
            ``delta`` (atomic rounds that send, per tensor, only the words that changed since the
            last round every engine committed: :mod:`qstrat.transport.delta`; a round goes whole
            when no base is shared or an engine refuses the delta; this sender keeps the last
            round's quantized bytes in host memory; :meth:`refit` only, not :meth:`send`).
    """

    def __init__(self, clients: Sequence[Any], master_address: str, master_port: int,
                 backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, alignment: int = DEFAULT_ALIGNMENT,
                 workers_per_client: Sequence[int] | None = None,
                 secret: Secret | bytes | str | None = None, mode: str = "atomic") -> None:
        if mode not in ("atomic", "bounded", "delta"):
            raise TransportError(f"RefitSender mode {mode!r}: use 'atomic', 'bounded' or 'delta'")
        self.mode = mode
        #: ``mode="delta"``: the base shared with the engines (None: the next round is whole).
        self.base: delta.Base | None = None
        self._secret = Secret.coerce(secret if secret is not None else (os.environ.get(ENV_SECRET) or None))
        self._counter = -1
        self._warned = False
        #: After a round that left a MIX: which ranks/engines hold new weights (None: no mix known).
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

    # ---- setup ----------------------------------------------------------------------------
    def init_infos(self) -> list[dict[str, Any]]:
        """The ``init_weight_transfer_engine`` payload for each client (rank offsets differ;
        with a secret each carries its ``auth`` tag, :func:`qstrat.transport.auth.sign_init`)."""
        world = 1 + sum(self.workers)
        infos, offset = [], 1
        for n in self.workers:
            infos.append(sign_init(self._secret, {
                "master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": offset, "world_size": world, "backend": self.backend,
                "timeout_s": self.timeout_s}))
            offset += n
        return infos

    def connect(self) -> None:
        """Open the group with every engine (their ``init_weight_transfer_engine`` runs
        concurrently with this rank's rendezvous). Raises TransportError on failure/timeout
        (TransferAuthError when an engine refused the init)."""
        self.close()
        futures = [_call(c.init_weight_transfer_engine, info) for c, info in zip(self.clients, self.init_infos())]
        try:
            self.group = open_group(self.master_address, self.master_port, 0, 1 + sum(self.workers),
                                    self.backend, self.timeout_s)
        except TransportError as exc:  # say why the engines did not join (e.g. an address refusal)
            errors = self._results(futures)
            refused = any("TransferAuthError" in e or INIT_REFUSED in e for e in errors.values())
            kind = TransferAuthError if refused else TransportError
            raise kind(f"{exc}; init_weight_transfer_engine: {_listed(errors) or 'no error reported'}") from None
        errors = self._results(futures)
        if errors:
            self.close()
            raise TransportError(f"init_weight_transfer_engine failed: {_listed(errors)}")

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
            ``hf_config`` implies: :func:`qstrat.engine_manifest.check_model_tensors`),
            WireManifestMismatchError (a ``bucket_bytes`` or ``alignment`` the wire manifest
            cannot use), BackendUnavailableError, NonFiniteError; then as :meth:`send`.
        """
        check = SinkCheck("wire manifest", lambda p: wire_manifest_for_plan(p.plan, self.bucket_bytes,
                                                                               self.alignment))
        whole = SinkCheck("every layer", lambda p: check_every_layer(p.plan, driver, p.plan_given))
        prepared = driver.prepare(named_tensors, plan, (whole, model_tensors_check(driver), check))
        qc = prepared.plan.vllm_quantization_config()
        online = {ONLINE_KEY: prepared.plan.engine_quantization}  # who quantizes: checked by the engine first
        if self.mode == "delta":
            return self._refit_delta(prepared.results[check.name], prepared.execute(), qc, online)
        return self._send(prepared.results[check.name], prepared.execute(), qc, online)

    def _refit_delta(self, target: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]], qc: Any,
                     extra: dict[str, Any]) -> TransferReport:
        """One ``mode="delta"`` round of ``tensors`` (the target wire manifest's, in order): the
        delta against :attr:`base`, or the whole round when there is none (or it has another
        layout), or when the engines refuse the delta (then sent again, whole)."""
        base, self.base = self.base, None  # a round that raises leaves no base: the next is whole
        t0 = time.perf_counter()
        stream = delta.stream_of(target, tensors)
        source_s = time.perf_counter() - t0
        reason = ("no base (this sender's first round, or its last one failed)" if base is None else
                  "the base has another layout (wire manifest)" if base.target != target.digest else None)
        rnd = delta.encode_round(target, stream, base, self._secret)
        attempts = 1
        try:
            report = self._send_round(rnd, qc, extra)
        except delta.DeltaRefused as exc:
            reason, attempts = f"the engines refused the delta: {exc}", 2
            rnd = delta.encode_round(target, stream, None, self._secret)
            report = self._send_round(rnd, qc, extra)
        self.base = rnd.new_base
        info = DeltaReport(rnd.kind, reason, target.total_bytes, rnd.wire_manifest.total_bytes, rnd.tiles,
                           source_s, rnd.encode_s, self.base.nbytes, attempts)
        return TransferReport(report.wire_manifest, report.bytes, report.buckets, report.stream_seconds,
                              time.perf_counter() - t0, info)

    def _send_round(self, rnd: delta.DeltaRound, qc: Any, extra: dict[str, Any]) -> TransferReport:
        return self._send(rnd.wire_manifest, iter(rnd.blobs), qc, {**extra, "delta": rnd.info})

    def send(self, wire_manifest: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]],
             quantization_config: Any = _UNNAMED) -> TransferReport:
        """Run one round for ``wire_manifest`` with ``tensors`` yielded in its wire order.

        ``quantization_config``: the plan's ``vllm_quantization_config()`` (None: unquantized),
        named in ``update_info`` so that an engine checks the round's format before its tensors
        (:mod:`qstrat.transport.engine_check`); not given: the tensors only.

        Raises: WireManifestMismatchError / TransferAuthError / TransportError (another protocol
            version) when an engine refused the round before any data; TransportError for a
            failed seal, an aborted or truncated stream, a lost peer or a timeout, with nothing
            loaded anywhere; MixedWeightsError when some rank holds new weights and the round was
            not committed everywhere (bounded mode), or an engine's load failed part-way in
            ``finish_weight_update`` (atomic mode) - :attr:`mixed` says which; an exception the
            SOURCE raised mid-stream (any class) is raised as itself after every receiver was
            told (ABORT) and the group was closed (unless the round left a mix: then
            MixedWeightsError, caused by it).
        """
        if self.mode == "delta":
            raise TransportError("RefitSender.send: a delta-mode sender sends through refit() (it encodes "
                                 "the round against its base)")
        return self._send(wire_manifest, tensors, quantization_config, {})

    def _send(self, wire_manifest: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]],
              quantization_config: Any, extra: dict[str, Any]) -> TransferReport:
        if self.group is None or self.group.pg is None:
            raise TransportError("connect() first (no open transfer group)")
        if self._secret is None and not self._warned:
            self._warned = True
            logger.warning("qstrat transport: rounds without a secret (QSTRAT_TRANSFER_SECRET): anyone who "
                           "reaches the engines or the group can refit them; for trusted networks and tests only")
        start, cpu = time.perf_counter(), time.process_time()
        self.profile = prof = Phases("start_s", "handshake_s", "source_s", "pack_s", "seal_s", "wait_s",
                                     "commit_s", "update_s", "finish_s", "cpu_s")
        self._call_all("start_weight_update")
        doc = {"wire_manifest": wire_manifest.to_dict(), "mode": self.mode, "protocol": PROTOCOL_VERSION, **extra}
        if quantization_config is not _UNNAMED:
            doc[FORMAT_KEY] = quantization_config
        futures = [_call(c.update_weights, doc) for c in self.clients]
        stream_start = time.perf_counter()
        prof["start_s"] = stream_start - start
        try:
            self._stream(wire_manifest, tensors)
        except TransportError as exc:
            errors = _listed(self._results(futures)) or "no error reported"
            kind = next(k for k in (delta.DeltaRefused, WireManifestMismatchError, TransferAuthError,
                                    MixedWeightsError, TransportError) if isinstance(exc, k))
            raise kind(f"{exc}; engines: {errors}") from (exc.__cause__ or exc)  # the source's error, if any
        except BaseException as exc:  # e.g. the source's own error, after the ABORT: itself
            exc.add_note(f"qstrat transport, the engines' update_weights: "
                         f"{_listed(self._results(futures)) or 'no error reported'}")
            raise
        t0 = time.perf_counter()
        stream_seconds = t0 - stream_start
        errors = self._results(futures)
        if errors:
            raise TransportError(f"update_weights failed after the stream: {_listed(errors)}")
        prof["update_s"] = time.perf_counter() - t0
        with prof.timed("finish_s"):
            self._finish_all()
        prof["cpu_s"] = time.process_time() - cpu
        self.mixed = None
        return TransferReport(wire_manifest, wire_manifest.total_bytes, len(wire_manifest.buckets),
                              stream_seconds, time.perf_counter() - start)

    def _stream(self, wire_manifest: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Steps 0-4 on this rank, and the round's outcome (see :meth:`send`'s errors)."""
        group = self.group
        assert group is not None
        prof = self.profile
        try:
            with prof.timed("handshake_s"):
                _, challenges = proto.challenges(group)
                self._counter = next_counter(self._counter, challenges)
                ctx = RoundContext(wire_manifest.digest, self.mode, self._counter, challenges,
                                   self.master_address, self.master_port, group.world_size)
                mac = ctx.mac(self._secret)
                group.wait(group.broadcast(proto.round_header(
                    len(wire_manifest.buckets), wire_manifest.total_bytes, ctx.counter, wire_manifest.digest,
                    mac, group.device)))
                votes = proto.vote(group, proto.ACCEPT, proto.OK, False, self._secret, mac)
        except RuntimeError as exc:
            raise proto.lost(group, "round header / accept vote failed (an engine died?)", exc) from None
        if votes.failed():
            st = votes.statuses
            if all(s == proto.OK or s in proto.DELTA_ONLY for s in st):
                raise delta.DeltaRefused(f"delta refused before any data: {proto.describe(st)}")
            cls = (WireManifestMismatchError if proto.REJECTED in st else
                   TransferAuthError if proto.UNAUTHENTICATED in st or proto.FORGED in st else TransportError)
            raise cls(f"round refused before any data: {proto.describe(st)}")
        try:
            failure = send_buckets(group, wire_manifest, iter(tensors), Sealer(self._secret, mac, group.device), prof)
        except TransportError as exc:
            if self.mode == "bounded":
                self.mixed = f"a bounded round was cut off ({exc})"
                raise MixedWeightsError(f"{exc}; bounded mode: engines may hold a MIX of two "
                                        f"rounds, the next refit must be whole") from None
            raise
        try:
            with prof.timed("commit_s"):
                votes = proto.vote(group, proto.COMMIT, proto.SENDER_ABORT if failure else proto.OK, False,
                                   self._secret, mac)
        except RuntimeError as exc:
            raise proto.lost(group, "commit vote failed (a receiver died?)", exc) from None
        self._outcome(votes, failure)

    def _outcome(self, votes: proto.Votes, failure: SourceFailure | None) -> None:
        """Raise unless every rank committed (see :meth:`send`)."""
        outcome = proto.outcome(votes)
        if outcome == "committed":
            return
        own = failure is not None and not isinstance(failure.error, TransportError)
        if own:  # the source's fault (OOM, a compile error...): its device state is suspect
            self.close()
        described = proto.describe(votes.statuses)
        if outcome == "mixed":
            holders = ", ".join(map(str, votes.holders()))
            self.mixed = f"ranks {holders} hold new weights after: {described}"
            why = f"the sender aborted the stream ({failure}); " if failure else ""
            raise MixedWeightsError(f"round not committed: {why}{described}; the engines hold a MIX: ranks "
                                    f"{holders} hold new weights, the others not (each flagged rank now "
                                    f"accepts only a whole refit)") from (failure.error if failure else None)
        if own:
            raise failure.error
        if failure is None and all(s == proto.OK or s in proto.DELTA_ONLY for s in votes.statuses):
            raise delta.DeltaRefused(f"delta refused, nothing loaded: {described}")
        if failure is not None:
            raise TransportError(f"sender aborted the stream: {failure}; nothing loaded")
        raise TransportError(f"round not committed: {described}; nothing loaded")

    def _finish_all(self) -> None:
        """``finish_weight_update`` on every engine. Raises MixedWeightsError when any failed
        (atomic mode: the round was committed, so every other engine loaded it)."""
        errors = self._results([_call(c.finish_weight_update) for c in self.clients])
        if not errors:
            return
        offsets = [1 + sum(self.workers[:i]) for i in range(len(self.workers))]
        ranks = {i: list(range(offsets[i], offsets[i] + self.workers[i])) for i in errors}
        loaded = [i for i in range(len(self.clients)) if i not in errors]
        self.mixed = (f"finish_weight_update failed on engine(s) {sorted(errors)} (ranks "
                      f"{sorted(r for rs in ranks.values() for r in rs)}); engine(s) {loaded} loaded the round")
        raise MixedWeightsError(f"the round was committed but its load failed: {_listed(errors)}; {self.mixed}: "
                                f"the engines hold a MIX, each failed engine is flagged and accepts only a "
                                f"whole refit")

    # ---- RPC fan-out ----------------------------------------------------------------------
    def _call_all(self, method: str) -> None:
        errors = self._results([_call(getattr(c, method)) for c in self.clients])
        if errors:
            raise TransportError(f"{method} failed: {_listed(errors)}")

    def _results(self, futures: list[Future]) -> dict[int, str]:
        """Wait (at most ``timeout_s`` in all) for every RPC; engine index -> its error."""
        done, _ = wait_futures(futures, timeout=self.timeout_s)
        errors = {}
        for i, f in enumerate(futures):
            if f not in done:
                errors[i] = f"no answer within {self.timeout_s:g} s"
            elif f.exception() is not None:
                errors[i] = describe_rpc_error(f.exception())
        return errors


def _call(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on a daemon thread of its own (a hung call holds only that thread)."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    threading.Thread(target=run, name="qstrat-rpc", daemon=True).start()
    return future


def _listed(errors: dict[int, str]) -> str:
    return "; ".join(f"engine {i}: {e}" for i, e in sorted(errors.items()))


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
