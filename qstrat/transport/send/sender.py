"""Trainer side: drive a refit of remote engines from a :class:`~qstrat.RefitDriver` plan.

:class:`RefitSender` talks to each engine through a weight-sync client (vLLM's
``VLLMWeightSyncClient`` protocol: ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``; e.g. ``vllm.distributed.weight_transfer.
HTTPVLLMWeightSyncClient`` for a ``vllm serve`` endpoint) whose engines run
``weight_transfer_config={"backend": "qstrat"}`` (:mod:`qstrat.vllm.engine.transfer_backend`), and
streams the tensors itself on a torch.distributed group (rank 0 = this process).

A round: ``RefitDriver.prepare`` with the wire manifest as this sink's check (nothing sent on
error) -> ``start_weight_update`` -> ``update_weights({"wire_manifest": ..., "mode": ...,
"protocol": ...})`` on every engine, concurrently with the stream (:mod:`qstrat.transport.protocol`;
the buckets: :mod:`qstrat.transport.send.outgoing`; authenticated with the shared secret,
:mod:`qstrat.transport.security.auth`) -> ``finish_weight_update`` (atomic mode: the engines load) only if
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
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from qstrat.execute.driver import RefitDriver
from qstrat.vllm.checks.engine_manifest import model_tensors_check
from qstrat.errors import (InputMismatchError, MixedWeightsError, PlanError, TransferAuthError, TransportConfigError,
                           TransportError, WireManifestMismatchError)
from qstrat.execute.named_tensors import NamedTensors, as_tensor_dict
from qstrat.plan import RefitPlan
from qstrat.execute.prepare import PreparedRefit, SinkCheck
from qstrat.transport.delta import encoding as delta
from qstrat.transport.security.auth import PROTOCOL_VERSION, sign_init
from qstrat.transport.delta.rounds import DELTA_MIN_BUCKET_BYTES, BucketFloor, DeltaRounds
from qstrat.transport.delta.stream import PatchEncoder
from qstrat.transport.engine_check import FORMAT_KEY, ONLINE_KEY
from qstrat.transport.protocol import BOUNDED_MODES, DELTA_MODES, MODES
from qstrat.transport.send.fanout import EngineClients, OfEngines, listed
from qstrat.transport.group import DEFAULT_TIMEOUT_S, TransferGroup, open_group
from qstrat.transport.security.keys import ENV_SECRET, Secret
from qstrat.transport.send.report import DeltaReport, TransferReport
from qstrat.transport.send.sender_protocol import SenderProtocol
from qstrat.transport.timing import Phases
from qstrat.transport.wire_manifest import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES, WireManifest, wire_manifest_for_plan

__all__ = ["DeltaReport", "RefitSender", "TransferReport", "check_every_layer", "round_info", "sender_checks",
           "update_info"]

logger = logging.getLogger("qstrat.transport")
_UNNAMED = object()
#: The name of the wire-manifest check (its result: the round's wire manifest).
WIRE_MANIFEST = "wire manifest"


class RefitSender(BucketFloor):
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
            MIX, MixedWeightsError, after which engines accept only whole refits), ``delta``
            (atomic rounds sending per bucket only the bytes changed since the last round every
            engine committed, :mod:`qstrat.transport.delta`: whole when no base is shared or an
            engine refuses the delta; the last round's bytes kept in host memory; :meth:`refit`
            only) or ``bounded-delta`` (delta rounds loaded as in ``bounded``; a MIX left by a
            digest mismatch alone is repaired at once by sending the round again whole).
        incremental: delta modes: quantize each round incrementally from the last one
            (:mod:`qstrat.transport.delta.requantize`: the same bytes; this sender then also keeps
            the last round's inputs, ~3 bytes per quantized parameter on their device); False:
            every round quantizes the whole model.
        delta_min_bucket_bytes: delta modes: ``bucket_bytes`` raised to it (default 16 MiB; 0: as
            given; not an int >= 0: TransportConfigError; :class:`~qstrat.transport.delta.rounds.BucketFloor`).
    """

    #: The clients, the ranks each engine brings and the RPC/group timeout: :attr:`engines`' (read
    #: and assigned there, e.g. ``sender.clients = [...]`` after an engine restart).
    clients, workers, timeout_s = OfEngines(), OfEngines(), OfEngines()

    def __init__(self, clients: Sequence[Any], master_address: str, master_port: int, backend: str = "gloo",
                 timeout_s: float = DEFAULT_TIMEOUT_S, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 alignment: int = DEFAULT_ALIGNMENT, workers_per_client: Sequence[int] | None = None,
                 secret: Secret | bytes | str | None = None, mode: str = "atomic", incremental: bool = True,
                 delta_min_bucket_bytes: int = DELTA_MIN_BUCKET_BYTES) -> None:
        if mode not in MODES:
            raise TransportConfigError(f"RefitSender mode {mode!r}: use 'atomic', 'bounded', 'delta' or 'bounded-delta'")
        self.mode, self.delta_min_bucket_bytes = mode, delta_min_bucket_bytes  # the floor checked: BucketFloor
        self._secret = Secret.coerce(secret if secret is not None else (os.environ.get(ENV_SECRET) or None))
        self._warned = False
        #: After a round that left a MIX: which ranks/engines hold new weights (None: no mix known).
        self.mixed: str | None = None
        #: The weight-sync calls, fanned out to every engine.
        self.engines = EngineClients(clients, workers_per_client, timeout_s)
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.timeout_s, self.bucket_bytes, self.alignment = timeout_s, bucket_bytes, alignment
        self.group: TransferGroup | None = None
        #: Rank 0's round protocol (and the round counter).
        self.protocol = SenderProtocol()
        #: Delta modes: the base shared with the engines, and the rounds against it.
        self.delta_rounds = DeltaRounds(incremental)
        #: The last round's seconds by phase (wall): ``start_s`` (start_weight_update RPCs),
        #: ``handshake_s`` (challenge, round header, accept vote), the bucket loop by activity
        #: (``source_s``: the driver producing tensors; ``pack_s``; ``seal_s``: checksum or NH +
        #: HMAC; ``wait_s``: blocked on broadcasts), ``commit_s`` (commit vote), ``update_s``
        #: (waiting for the update_weights RPCs after the stream), ``finish_s``
        #: (finish_weight_update: the engines' load), and ``cpu_s``: this process's CPU seconds
        #: over the round (all threads). See docs/performance.md.
        self.profile: dict[str, float] = {}

    @property
    def base(self) -> delta.Base | None:
        """Delta modes: the base shared with the engines (None: the next round is whole)."""
        return self.delta_rounds.base

    # ---- setup ----------------------------------------------------------------------------
    def init_infos(self) -> list[dict[str, Any]]:
        """The ``init_weight_transfer_engine`` payload for each client (rank offsets differ;
        with a secret each carries its ``auth`` tag, :func:`qstrat.transport.security.auth.sign_init`)."""
        return [sign_init(self._secret, {
            "master_address": self.master_address, "master_port": self.master_port, "rank_offset": offset,
            "world_size": 1 + sum(self.workers), "backend": self.backend, "timeout_s": self.timeout_s})
            for offset in self.engines.offsets()]

    def connect(self) -> None:
        """Open the group with every engine (their ``init_weight_transfer_engine`` runs
        concurrently with this rank's rendezvous). Raises TransportError on failure/timeout
        (TransferAuthError when an engine refused the init)."""
        self.close()
        self.group = self.engines.join(self.init_infos(), lambda: open_group(
            self.master_address, self.master_port, 0, 1 + sum(self.workers), self.backend, self.timeout_s))

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

        A warm refit (the rule, :class:`qstrat.execute.driver.PlanCache`): without ``plan``, the driver's
        kept plan is reused when the inputs' names, in order, and its ``hf_config`` are those it
        was planned from; the checks that read the plan alone (every layer, model tensors, the
        wire manifest) are kept with it. In ``atomic`` and ``delta`` mode - all or none until the
        commit vote - each input's shape and dtype is then compared with its plan entry where the
        stream reads it (its device and values as it is quantized): on a mismatch
        (:class:`~qstrat.errors.InputMismatchError`) the round is aborted with nothing loaded
        anywhere, the kept plan is dropped and the inputs are planned and sent again, once, with
        every check up front; the report's ``replanned`` gives the reason. In ``bounded`` and
        ``bounded-delta`` mode (engines load as buckets arrive) every check runs up front, as for
        in-process sinks.

        Raises: before anything is sent (:meth:`RefitDriver.prepare`: plan, every layer, model
            tensors, the wire manifest, backends, values): PlanError (also for a refit without
            ``plan`` that leaves out a decoder layer of the driver's ``hf_config``: the engines
            would keep its old weights; and for a plan that does not match the tensors that
            ``hf_config`` implies: :func:`qstrat.vllm.checks.engine_manifest.check_model_tensors`),
            WireManifestMismatchError (a ``bucket_bytes`` or ``alignment`` the wire manifest
            cannot use), BackendUnavailableError, NonFiniteError; then as :meth:`send` (a
            warm round's BackendUnavailableError / NonFiniteError: raised by the source
            mid-stream, nothing loaded).
        """
        if plan is None and not isinstance(named_tensors, dict):
            named_tensors = as_tensor_dict(named_tensors)  # kept for a second attempt
        checks = sender_checks(driver, self.layout_bucket_bytes, self.alignment)
        prepared = driver.prepare(named_tensors, plan, checks, all_or_none=self.mode not in BOUNDED_MODES)
        if not prepared.checked_in_stream:
            return self._round(prepared)
        base = self.delta_rounds.base
        try:
            return self._round(prepared)
        except InputMismatchError as exc:  # aborted before the commit vote: the engines hold what they held
            driver.plan_cache.clear()
            self.delta_rounds.base = base  # the stream was aborted before the commit vote: nothing loaded
            logger.info("qstrat transport: the kept plan does not fit the inputs (%s): planning again", exc)
            try:
                report = self._round(driver.prepare(named_tensors, None, checks))
            except BaseException as again:
                again.add_note(f"qstrat transport: first attempt (the kept plan): {exc}; that round was aborted, "
                               "nothing loaded")
                raise
            return replace(report, replanned=f"{exc} (the round reusing the kept plan was aborted, nothing "
                                             f"loaded; planned again and sent)")

    def _round(self, prepared: PreparedRefit) -> TransferReport:
        """Send one prepared round (through the delta base in the delta modes)."""
        wm = prepared.results[WIRE_MANIFEST]
        if self.mode not in DELTA_MODES:
            return self._send(wm, prepared.execute(), round_info(prepared, self.mode))
        qc = prepared.plan.vllm_quantization_config()
        online = {ONLINE_KEY: prepared.plan.engine_quantization}  # who quantizes: checked by the engine first
        doc = manifest_doc(prepared)
        return self.delta_rounds.refit(wm, prepared.execute(quantize=self.delta_rounds.quantize),
                                       lambda encoder, extra: self._send(
            wm, encoder, update_info(wm, self.mode, qc, {**online, **extra}, doc)), self.mode in BOUNDED_MODES)

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
        if self.mode in DELTA_MODES:
            raise TransportError("RefitSender.send: a delta-mode sender sends through refit() (it encodes "
                                 "the round against its base)")
        return self._send(wire_manifest, tensors, update_info(wire_manifest, self.mode, quantization_config, {}))

    def _send(self, wire_manifest: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]] | PatchEncoder,
              info: dict[str, Any]) -> TransferReport:
        if self.group is None or self.group.pg is None:
            raise TransportError("connect() first (no open transfer group)")
        if self._secret is None and not self._warned:
            self._warned = True
            logger.warning("qstrat transport: rounds without a secret (QSTRAT_TRANSFER_SECRET): anyone who "
                           "reaches the engines or the group can refit them; for trusted networks and tests only")
        start, cpu = time.perf_counter(), time.process_time()
        self.profile = prof = Phases("start_s", "handshake_s", "source_s", "pack_s", "seal_s", "wait_s",
                                     "commit_s", "update_s", "finish_s", "cpu_s")
        self.engines.call_all("start_weight_update")
        futures = self.engines.start("update_weights", info)
        stream_start = time.perf_counter()
        prof["start_s"] = stream_start - start
        try:
            self.protocol.run(self.group, wire_manifest, tensors, prof, self.close, self._secret, self.mode,
                              (self.master_address, self.master_port))
        except TransportError as exc:
            if isinstance(exc, MixedWeightsError):
                self.mixed = getattr(exc, "detail", str(exc))
            errors = listed(self.engines.results(futures)) or "no error reported"
            kind = next(k for k in (delta.DeltaRefused, delta.DeltaMixed, WireManifestMismatchError,
                                    TransferAuthError, MixedWeightsError, TransportError) if isinstance(exc, k))
            raise kind(f"{exc}; engines: {errors}") from (exc.__cause__ or exc)  # the source's error, if any
        except BaseException as exc:  # e.g. the source's own error, after the ABORT: itself
            exc.add_note(f"qstrat transport, the engines' update_weights: "
                         f"{listed(self.engines.results(futures)) or 'no error reported'}")
            raise
        t0 = time.perf_counter()
        stream_seconds = t0 - stream_start
        errors = self.engines.results(futures)
        if errors:
            raise TransportError(f"update_weights failed after the stream: {listed(errors)}")
        prof["update_s"] = time.perf_counter() - t0
        with prof.timed("finish_s"):
            try:
                self.engines.finish_all()
            except MixedWeightsError as exc:
                self.mixed = exc.detail
                raise
        prof["cpu_s"] = time.process_time() - cpu
        self.mixed = None
        return TransferReport(wire_manifest, wire_manifest.total_bytes, len(wire_manifest.buckets),
                              stream_seconds, time.perf_counter() - start)


def sender_checks(driver: RefitDriver, bucket_bytes: int, alignment: int) -> tuple[SinkCheck, ...]:
    """:meth:`RefitSender.refit`'s checks: every layer, model tensors, the wire manifest (its
    result: the round's :class:`WireManifest`, laid out with ``bucket_bytes`` and ``alignment``).
    Each reads the plan alone (``plan_only``: kept with the driver's kept plan)."""
    model = model_tensors_check(driver)
    return (SinkCheck("every layer", lambda p: check_every_layer(p.plan, driver, p.plan_given), plan_only=True),
            SinkCheck(model.name, model.run, plan_only=True),
            SinkCheck(WIRE_MANIFEST, lambda p: wire_manifest_for_plan(p.plan, bucket_bytes, alignment),
                      plan_only=True, key=(bucket_bytes, alignment)))


def round_info(prepared: PreparedRefit, mode: str) -> dict[str, Any]:
    """The ``update_info`` of a prepared whole round (not a delta one) in ``mode``: the wire
    manifest's document (:func:`manifest_doc`), the mode, the protocol version, the plan's
    ``quantization_config`` and who quantizes."""
    plan, wm = prepared.plan, prepared.results[WIRE_MANIFEST]
    return update_info(wm, mode, plan.vllm_quantization_config(), {ONLINE_KEY: plan.engine_quantization},
                       manifest_doc(prepared))


def manifest_doc(prepared: PreparedRefit) -> dict[str, Any]:
    """The round's wire manifest's document (``to_dict``), kept with the driver's kept plan: the
    same object each warm round, whole (``update_info["wire_manifest"]``) or delta (its target);
    weight-sync clients serialize it and must not change it."""
    wm = prepared.results[WIRE_MANIFEST]
    return prepared.driver.plan_cache.keep(prepared.plan, (WIRE_MANIFEST, "doc", wm.digest), wm.to_dict)


def update_info(wire_manifest: WireManifest, mode: str, quantization_config: Any, extra: dict[str, Any],
                manifest_doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A round's ``update_info``: the wire manifest's document (``manifest_doc``, else built),
    the mode, the protocol version, ``extra``, and the ``quantization_config`` when named."""
    doc = {"wire_manifest": manifest_doc if manifest_doc is not None else wire_manifest.to_dict(),
           "mode": mode, "protocol": PROTOCOL_VERSION, **extra}
    if quantization_config is not _UNNAMED:
        doc[FORMAT_KEY] = quantization_config
    return doc


def check_every_layer(plan: RefitPlan, driver: RefitDriver, plan_given: bool) -> None:
    """Raise PlanError when a refit without an explicit (partial) ``plan`` leaves out a decoder
    layer of the model: vLLM's layerwise reload keeps the old weights of a layer that gets none,
    so the engines would serve a mix silently. The depth is the driver's model config's
    (``num_hidden_layers``, :attr:`~qstrat.RefitDriver.model_config`); without one there is nothing to compare with and nothing is checked.
    A partial refit is explicit: ``plan=driver.plan(specs).only_layers(changed)``."""
    if plan_given:
        return
    depth = driver.layout.num_layers(driver.model_config) if driver.model_config else None
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
