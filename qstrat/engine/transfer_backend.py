"""qstrat's vLLM weight-transfer backend: ``LLM(weight_transfer_config={"backend": "qstrat"})``.

A ``vllm.distributed.weight_transfer.WeightTransferEngine`` (vLLM 0.32) that receives a refit
from :class:`qstrat.transport.RefitSender` over a torch.distributed group (gloo on CPU, NCCL on
GPU) and loads it only when the whole round arrived intact:

* ``init_weight_transfer_engine(init_info)``: join the group as rank ``rank_offset`` + this
  worker's rank (fields: ``master_address``, ``master_port``, ``rank_offset``, ``world_size``,
  ``backend``, ``timeout_s``).
* ``start_weight_update()``: forget any staged round; the model is NOT touched.
* ``update_weights({"wire_manifest": ...})``: check the wire manifest against what the engine accepts
  (:func:`engine_expectations`) and refuse a mismatch before any data; receive every bucket,
  verify every CRC-32, take part in the commit vote; stage the tensors (views of the received
  buffers). Any failure raises and drops the staging - the model is still untouched.
* ``finish_weight_update()``: VALIDATE-THEN-COMMIT: only now run vLLM's layerwise reload
  (``initialize_layerwise_reload``, ``model.load_weights`` with the staged tensors,
  ``finalize_layerwise_reload``), as vLLM's NCCL backend does inside its receive.

Memory: the staging holds one round's payload (every tensor sent, ~ the quantized checkpoint
size) on the worker's device until ``finish_weight_update``; see docs/transport.md.

Registration: :func:`register` (idempotent), also run by the ``vllm.general_plugins`` entry
point ``qstrat_transfer`` in every vLLM process. One round per update session.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from qstrat.errors import TransportError
from qstrat.transport.group import DEFAULT_TIMEOUT_S, TransferGroup, open_group
from qstrat.transport.receiver import receive_round
from qstrat.transport.wire_manifest import WireManifest, check_against, expected_from_checkpoint
from qstrat.vllm_adapter.resolver import available, resolve

# vLLM's base classes and registry (qstrat's vLLM version table; importing this module imports vLLM).
WeightTransferEngine = resolve("weight_transfer_engine")
WeightTransferInitInfo = resolve("weight_transfer_init_info")
WeightTransferUpdateInfo = resolve("weight_transfer_update_info")

#: The name to pass as ``weight_transfer_config={"backend": BACKEND}``.
BACKEND = "qstrat"


@dataclass
class QstratTransferInitInfo(WeightTransferInitInfo):
    """Where to join the transfer group (sent by ``RefitSender.init_infos()``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class QstratTransferUpdateInfo(WeightTransferUpdateInfo):
    """One round: the wire manifest as :meth:`qstrat.transport.WireManifest.to_dict`."""

    wire_manifest: dict[str, Any]


def engine_expectations(engine: WeightTransferEngine) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype name, shape) the engine must receive in a refit.

    Today: the headers of the checkpoint the engine was started on (``model_config.model``, a
    local directory) - what it loaded is what a refit must replace. The engine-manifest work
    re-points this one function.
    Raises: TransportError if the model is not a local safetensors directory.
    """
    model = engine.model_config.model
    try:
        return expected_from_checkpoint(model)
    except FileNotFoundError as exc:
        raise TransportError(f"cannot tell which tensors the engine expects: {exc} (the qstrat "
                             f"backend checks wire manifests against a local checkpoint directory)") from exc


class QstratWeightTransferEngine(WeightTransferEngine[QstratTransferInitInfo, QstratTransferUpdateInfo]):
    """The engine-side backend (see the module docstring)."""

    init_info_cls = QstratTransferInitInfo
    update_info_cls = QstratTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: TransferGroup | None = None
        self._staged: list[tuple[str, torch.Tensor]] | None = None

    def init_transfer_engine(self, init_info: QstratTransferInitInfo) -> None:
        """Join the transfer group (closing a previous one). Raises TransportError."""
        self.shutdown()
        worker = (self.parallel_config.data_parallel_index * self.parallel_config.world_size
                  + self.parallel_config.rank)
        self.group = open_group(init_info.master_address, init_info.master_port,
                                init_info.rank_offset + worker, init_info.world_size,
                                init_info.backend, init_info.timeout_s)

    def start_weight_update(self) -> None:
        """Begin a session: drop any staged round. The model is left as it is."""
        self._staged = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one round into staging (no ``torch.accelerator.synchronize``: CPU torch has
        no accelerator; CUDA work is synchronized here instead)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: QstratTransferUpdateInfo) -> None:
        """Check, receive, verify and stage one round. Raises WireManifestMismatchError (refused
        before data) or TransportError; the model is untouched either way."""
        if self.group is None or self.group.pg is None:
            raise TransportError("qstrat transfer: call init_weight_transfer_engine first "
                                 "(no open transfer group)")
        if self._staged is not None:
            raise TransportError("qstrat transfer: one update_weights round per session "
                                 "(call finish_weight_update first)")
        self._staged = receive_round(self.group, update_info.wire_manifest, self._check)

    def _check(self, wire_manifest: WireManifest) -> None:
        check_against(wire_manifest, engine_expectations(self))

    def finish_weight_update(self) -> None:
        """Commit the staged round through vLLM's layerwise reload; then free the staging.

        Raises: TransportError if no round was received in this session (the model untouched).
        """
        staged, self._staged = self._staged, None
        if staged is None:
            raise TransportError("qstrat transfer: finish_weight_update without a received round")
        resolve("initialize_layerwise_reload")(self.model)
        # vllm < 0.27.1 has no MTP completeness check, so nothing to skip (version table)
        skip_mtp_check = (resolve("disable_mtp_completeness_check")()
                          if available("disable_mtp_completeness_check") else nullcontext())
        with skip_mtp_check:
            self.model.load_weights(staged)
        resolve("finalize_layerwise_reload")(self.model, self.model_config)

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
        self._staged = None
        if self.group is not None:
            self.group.close()
            self.group = None


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
