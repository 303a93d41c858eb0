"""qstrat's vLLM weight-transfer backend: ``LLM(weight_transfer_config={"backend": "qstrat"})``.

A ``vllm.distributed.weight_transfer.WeightTransferEngine`` receiving a refit from
:class:`qstrat.transport.RefitSender` over torch.distributed (gloo on CPU, NCCL on GPU); the
receiver logic is :class:`qstrat.transport.receive.session.ReceiverSession`, this class its LOADER:

* ``init_weight_transfer_engine(init_info)``: refuse an address other than
  ``QSTRAT_TRANSFER_ADDRESS`` (when set), read the secret ``QSTRAT_TRANSFER_SECRET`` (when set,
  every round must carry a valid MAC), join the group as rank ``rank_offset`` + this worker's
  rank (fields: ``master_address``, ``master_port``, ``rank_offset``, ``world_size``,
  ``backend``, ``timeout_s``).
* ``start_weight_update()``: forget any staged round; the model is NOT touched.
* ``update_weights({"wire_manifest": ..., "mode": ...})``: check the wire manifest against what
  the engine accepts (:func:`engine_expectations`; a whole round only while the engine is flagged
  as holding a mix) and the round's MAC, and refuse before any data; then receive and verify
  every bucket's seal. ``atomic`` (default): stage the round (views of the received buffers; in
  host memory when ``QSTRAT_TRANSFER_STAGING=host``), touch nothing. ``bounded``: load each
  reload unit as soon as it verified; a fault after that flags the engine (MixedWeightsError).
* MESH rounds (``update_info["mesh"]``, ``senders`` in the init info; from
  :class:`qstrat.transport.mesh.refit.MeshRefitSender`): publish this worker's layout
  (:func:`receiver_layout`), receive, verify and stage exactly its share from every trainer rank
  (:mod:`qstrat.transport.mesh.engine`; bounded: loaded unit by unit, :mod:`qstrat.transport.mesh.bounded`).
* ``finish_weight_update()``: atomic: VALIDATE-THEN-COMMIT: only now run vLLM's layerwise reload
  (``initialize_layerwise_reload``, ``model.load_weights`` with the staged tensors,
  ``finalize_layerwise_reload``), as vLLM's NCCL backend does inside its receive.

Memory (atomic: the round's payload staged; bounded: ~two buckets and a layer): docs/transport.md.

Registration: :func:`register` (idempotent; also the ``vllm.general_plugins`` entry point
``qstrat_transfer`` in every vLLM process). One round per update session.
"""
from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.vllm.engine.weight_digests import WeightDigests
from qstrat.errors import TransportError
from qstrat.transport.group import DEFAULT_TIMEOUT_S
from qstrat.transport.receive.session import ReceiverSession
from qstrat.transport.engine_check import FORMAT_KEY, ONLINE_KEY, EngineExpectations
from qstrat.vllm.adapter.engine_state import EngineState
from qstrat.vllm.adapter.resolver import available, resolve
from qstrat.transport.mesh.steps import open_sessions
from qstrat.transport.mesh.engine import MESH_KEY
from qstrat.transport.mesh.routing import ReceiverLayout
from qstrat.vllm.adapter.views import (TransferBackendView, expert_maps, expert_parallel_of, model_config_of, parallel_rank_of, parsed_config_of, tensor_parallel_of)
from qstrat.vllm.checks.live_manifest import check_model_built

# vLLM's base classes and registry (qstrat's vLLM version table; importing this module imports vLLM).
WeightTransferEngine = resolve("weight_transfer_engine")
WeightTransferInitInfo = resolve("weight_transfer_init_info")
WeightTransferUpdateInfo = resolve("weight_transfer_update_info")

logger = logging.getLogger("qstrat.transport")
_UNNAMED = "<not named>"  # a JSON-able default: an update_info without the plan's format
#: The name to pass as ``weight_transfer_config={"backend": BACKEND}``.
BACKEND = "qstrat"
#: Environment variable choosing where an atomic round is staged: ``device`` (default) or
#: ``host`` (host memory, pinned with CUDA: fits rounds larger than the free device memory).
ENV_STAGING = "QSTRAT_TRANSFER_STAGING"


@dataclass
class QstratTransferInitInfo(WeightTransferInitInfo):
    """Where to join the transfer group (sent by ``RefitSender.init_infos()``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: The sender's tag over the fields above (required by an engine holding a secret).
    auth: str | None = None
    #: A mesh group's trainer ranks (group ranks ``0..senders-1``, :class:`qstrat.transport.
    #: mesh_refit.MeshRefitSender`); None: a single-sender group (rank 0).
    senders: int | None = None


@dataclass
class QstratTransferUpdateInfo(WeightTransferUpdateInfo):
    """One round: the wire manifest as :meth:`qstrat.transport.WireManifest.to_dict`, the mode
    and the transport protocol version the sender speaks."""

    #: A single-sender round's wire manifest (None in a mesh round).
    wire_manifest: dict[str, Any] | None = None
    mode: str = "atomic"
    protocol: int | None = None
    #: The plan's ``vllm_quantization_config()`` (checked before the tensors); absent: not named.
    quantization_config: Any = _UNNAMED
    #: The plan's ``engine_quantization`` (the online config of a ``quantize_in: engine`` plan;
    #: None: the trainer quantized), checked first; absent: not named.
    engine_quantization: Any = _UNNAMED
    #: ``mode="delta"``: the round ids and target wire manifest (:mod:`qstrat.transport.delta.encoding`).
    delta: dict[str, Any] | None = None
    #: A mesh round's routes document (:meth:`qstrat.transport.mesh.routing.MeshRoutes.to_dict`);
    #: None: a single-sender round.
    mesh: dict[str, Any] | None = None


#: Per backend: what it accepts (built once).
EXPECTATIONS: EngineState[EngineExpectations] = EngineState("engine expectations")


def engine_expectations(engine: WeightTransferEngine) -> EngineExpectations:
    """What the engine accepts in a refit: its engine manifest and quantization_config, built
    from its own model config as :func:`qstrat.vllm.refit` builds them
    (:func:`qstrat.vllm.model_manifest`; the engine may have started from a hub id).
    Built once per backend.
    Raises: EngineManifestError if the manifest cannot be built (every round is then refused
        with that reason in its accept vote).
    """
    cached = EXPECTATIONS.get(engine)
    if cached is None:
        from qstrat.vllm.online import engine_online_args
        from qstrat.vllm.checks.live_manifest import model_manifest

        mc = TransferBackendView(engine).model_config
        cached = EXPECTATIONS.set(engine, EngineExpectations(model_manifest(mc), parsed_config_of(mc).quantization_config,
                                                            online=engine_online_args(mc)))
    return cached


def receiver_layout(vllm_config: Any, model: Any) -> ReceiverLayout:
    """What this worker loads in a mesh round, read from its own ``VllmConfig`` and model: its TP
    rank and size (:func:`~qstrat.vllm.adapter.views.tensor_parallel_of`), the model's KV heads
    (``num_key_value_heads`` of its Hugging Face config: vLLM replicates a KV head on
    ``tp_size / kv_heads`` ranks when TP exceeds them), and its routed experts: every expert,
    narrowed by TP (FusedMoE under TP), or under expert parallelism (``enable_expert_parallel``)
    the experts its layers' expert maps hold, whole (:func:`~qstrat.vllm.adapter.views.expert_maps`).

    Raises: TransportError when the MoE layers of an expert-parallel engine hold different experts
        or none has an expert map (the round is then refused in the accept vote).
    """
    tp_rank, tp_size = tensor_parallel_of(vllm_config)
    kv_heads = parsed_config_of(model_config_of(vllm_config)).num_key_value_heads or None
    if not expert_parallel_of(vllm_config):
        return ReceiverLayout(tp_rank, tp_size, kv_heads=kv_heads)
    held = {tuple(int(e) for e in torch.nonzero(m.cpu() >= 0).flatten()) for m in expert_maps(model)}
    if len(held) != 1:
        raise TransportError(f"qstrat transfer: an expert-parallel engine whose MoE layers hold {len(held)} "
                             "different expert sets (or none has an expert map): a mesh layout needs one")
    return ReceiverLayout(tp_rank, tp_size, held.pop(), moe_tp=False, kv_heads=kv_heads)


class QstratWeightTransferEngine(WeightTransferEngine[QstratTransferInitInfo, QstratTransferUpdateInfo]):
    """The engine-side backend (see the module docstring)."""

    init_info_cls = QstratTransferInitInfo
    update_info_cls = QstratTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        check_model_built(vllm_config, model)  # EngineBuildError: a module vLLM built in another format
        staging = os.environ.get(ENV_STAGING, "device")
        if staging not in ("device", "host"):
            raise TransportError(f"{ENV_STAGING}={staging!r}: use 'device' or 'host'")
        worker = parallel_rank_of(vllm_config)
        #: Why the last mesh round was not staged (None: it was, or none came).
        self.mesh_refusal: str | None = None
        #: Whether vLLM's weight-update session is open on this worker (``Worker.
        #: _weight_update_active``, mirrored: set by ``start_weight_update``, cleared by a
        #: ``finish_weight_update`` that returned or an ``update_weights`` that raised).
        self.update_open = False
        _IN_THIS_WORKER[:] = [self]
        self.session = ReceiverSession(lambda: engine_expectations(self), self, rank_in_client=worker,
                                       staging=torch.device("cpu") if staging == "host" else None,
                                       layout=lambda: receiver_layout(vllm_config, TransferBackendView(self).model))

    @property
    def group(self) -> Any:
        """The open transfer group (None before ``init_weight_transfer_engine``)."""
        return self.session.group

    @property
    def mixed(self) -> str | None:
        """Why this engine holds a mix of two rounds (None: it does not); see docs/transport.md."""
        return self.session.mixed

    def init_transfer_engine(self, init_info: QstratTransferInitInfo) -> None:
        """Join the transfer group (closing a previous one). A MESH group's first step
        (:func:`qstrat.transport.mesh.steps.open_sessions`) tells its rank 0 whether this worker's update
        session is still open; if it is (the trainer rank 0 that opened it died before
        ``finish_weight_update``), its round is dropped and the ``finish_weight_update`` rank 0
        then calls loads nothing. Raises TransferAuthError for another address than
        ``QSTRAT_TRANSFER_ADDRESS``, TransportError if the rendezvous or that step fails."""
        self.session.join(init_info)
        if self.session.senders is None:
            return
        open_sessions(self.session.group, int(self.session.senders), self.update_open)
        if self.update_open:
            self.session.start()  # nothing staged stays; the model is untouched
            self.mesh_refusal = ("the update session of a trainer rank 0 that left before finish_weight_update "
                                 "(a new mesh group joined): nothing loaded")
            logger.error("qstrat mesh: %s", self.mesh_refusal)

    def start_weight_update(self) -> None:
        """Begin a session: drop any staged round. The model is left as it is."""
        self.session.start()
        self.mesh_refusal, self.update_open = None, True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one round (no ``torch.accelerator.synchronize``: CPU torch has no
        accelerator; CUDA work is synchronized here instead). A MESH round that is refused or
        fails does not raise here (:attr:`mesh_refusal` says why; the trainer ranks raise it):
        vLLM's multiprocess executor cannot take a failure of some of its workers' RPCs."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.update_open = False  # vLLM's worker ends the session when update_weights raises
            raise
        device = TransferBackendView(self).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def receive_weights(self, update_info: QstratTransferUpdateInfo) -> None:
        """Check, authenticate, receive, verify; stage (atomic) or load unit by unit (bounded).
        Raises WireManifestMismatchError / TransferAuthError (refused before data),
        TransportError, MixedWeightsError (bounded, after loading began)."""
        info = {"wire_manifest": update_info.wire_manifest, "mode": update_info.mode,
                "protocol": update_info.protocol}
        if update_info.quantization_config is not _UNNAMED:
            info[FORMAT_KEY] = update_info.quantization_config
        if update_info.engine_quantization is not _UNNAMED:
            info[ONLINE_KEY] = update_info.engine_quantization
        if update_info.delta is not None:
            info["delta"] = update_info.delta
        if update_info.mesh is None:
            if update_info.wire_manifest is None:
                raise TransportError("qstrat transfer: update_info has neither a wire_manifest nor a mesh round")
            self.session.update(info)
            return
        info[MESH_KEY] = update_info.mesh
        self.mesh_refusal = None
        try:
            self.session.update(info)
        except TransportError as exc:
            # Not raised: vLLM's MultiprocExecutor.collective_rpc (v1/executor/multiproc_executor.py,
            # get_response) raises at the first failed worker and leaves the other workers' answers
            # queued, so every later RPC of a multi-worker engine would read the previous call's.
            # The trainer ranks raise the round's outcome (every rank's vote); nothing was staged.
            self.mesh_refusal = f"{type(exc).__name__}: {exc}"
            logger.error("qstrat mesh round not loaded: %s", self.mesh_refusal)

    def finish_weight_update(self) -> None:
        """Atomic: commit the staged round through vLLM's layerwise reload; then free the staging.

        After a mesh round that was not staged (:attr:`mesh_refusal`), or in a session a dead
        trainer rank 0 left open: ends the session, nothing loaded (vLLM keeps a weight update
        active until this call when update_weights returned).

        Raises: TransportError if no round was received in this session (the model untouched).
        """
        if self.mesh_refusal is not None:
            self.session.start()  # drop the refused round; the model is untouched
            self.update_open = False
            return
        self.session.finish()
        self.update_open = False

    # ---- the session's loader: vLLM's layerwise reload ------------------------------------
    def begin_load(self) -> None:
        """``initialize_layerwise_reload`` (every layer to meta until its weights arrive)."""
        resolve("initialize_layerwise_reload")(TransferBackendView(self).model)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """``model.load_weights`` (a layer is processed once all its weights arrived)."""
        # vllm < 0.27.1 has no MTP completeness check, so nothing to skip (version table)
        skip_mtp_check = (resolve("disable_mtp_completeness_check")()
                          if available("disable_mtp_completeness_check") else nullcontext())
        with skip_mtp_check:
            TransferBackendView(self).model.load_weights(tensors)

    def end_load(self) -> None:
        """``finalize_layerwise_reload`` (layers that received nothing keep their weights)."""
        view = TransferBackendView(self)
        resolve("finalize_layerwise_reload")(view.model, view.model_config)

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Not qstrat's sending side: vllm < 0.28 declares this abstract on every backend (0.28
        moved trainer sending to ``TrainerWeightTransferEngine``), so it is defined to let the
        class be built there. Raises: TransportError naming :class:`qstrat.transport.RefitSender`,
        which is what sends a qstrat round."""
        raise TransportError("the qstrat backend's trainer side is qstrat.transport.RefitSender "
                             "(RefitSender.send), not vLLM's trainer_send_weights")

    def shutdown(self) -> None:
        """Close the transfer group; staged data is dropped."""
        self.session.shutdown()


#: The backend of this worker process (vLLM builds one per worker), for :class:`TransferProbe`.
_IN_THIS_WORKER: list[QstratWeightTransferEngine] = []


class TransferProbe(WeightDigests):
    """vLLM worker extension (``worker_extension_cls="qstrat.vllm.engine.transfer_backend.TransferProbe"``):
    :meth:`qstrat_weight_digests`, :meth:`qstrat_transfer_stats` and :meth:`qstrat_mesh_refusal`,
    callable by name through
    ``collective_rpc`` (a multiprocess engine cannot be sent a function)."""

    def qstrat_transfer_stats(self) -> dict[str, float]:
        """This worker's last round's receive-side counts and seconds (the backend session's
        ``stats``: a mesh round's ``bytes`` received, ``share_bytes``, ``tensor_bytes``,
        ``seconds``, ``stream_s``, ``finish_s``); empty before a backend was built."""
        return dict(_IN_THIS_WORKER[0].session.stats) if _IN_THIS_WORKER else {}

    def qstrat_mesh_refusal(self) -> str | None:
        """Why this worker did not stage the last mesh round (the backend's ``mesh_refusal``:
        the error's class and text; None: it staged it, or none came)."""
        return _IN_THIS_WORKER[0].mesh_refusal if _IN_THIS_WORKER else None


def register() -> None:
    """Register :class:`QstratWeightTransferEngine` as vLLM weight-transfer backend ``"qstrat"``.

    Idempotent (vLLM's factory raises on a second registration of a name); called by the
    ``vllm.general_plugins`` entry point ``qstrat_transfer`` and safe to call from another
    plugin function.
    """
    try:
        resolve("weight_transfer_engine_factory").register_engine(BACKEND, QstratWeightTransferEngine)
    except ValueError as exc:  # "... already registered": by an earlier call of this function
        if "already registered" not in str(exc):
            raise
