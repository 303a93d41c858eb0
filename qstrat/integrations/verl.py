"""verl's vLLM rollout with qstrat's refit: a worker extension for verl 0.9.1's colocated rollout.

verl's trainer sends the actor's BF16 parameters with its own
``BucketedWeightSender`` (ZMQ, CUDA IPC or shared memory) while the engine runs the worker
extension's ``update_weights_from_ipc``, whose stock version (``vLLMColocateWorkerExtension``)
hands each bucket to ``model.load_weights`` - or, for an FP8 engine, to verl's own online FP8
cast - neither of which takes a qstrat checkpoint's formats. :class:`QstratWorkerExtension`
keeps verl's receiver (``BucketedWeightReceiver`` on verl's ZMQ handle), collects the buckets
(copies: verl reuses its bucket buffer) and, after the last one, refits the whole model with
:func:`qstrat.vllm.sink.in_worker.refit_worker` in the strategy of the checkpoint the engine started on.

Use: start the rollout on a qstrat checkpoint (``qstrat quantize``) and give vLLM
``worker_extension_cls="qstrat.integrations.verl.QstratWorkerExtension"`` (verl 0.9.1 names its
own class in ``vLLMHttpServer._get_worker_extension_cls``; docs/integrations.md). Importing this
module imports verl and vLLM.
"""
from __future__ import annotations

from typing import Any

import torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from qstrat.errors import ConfigError
from qstrat.vllm.sink.in_worker import refit_worker


class QstratWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension whose weight update is qstrat's refit.

    ``update_weights_from_ipc`` is called by verl's ``vLLMRollout.update_weights`` through
    ``collective_rpc`` on every worker while verl's sender streams the actor's parameters.
    Everything else (verl's LoRA hijack, logits patch, ZMQ handle) is verl's.
    """

    #: every :class:`~qstrat.vllm.RefitReport`, one per update (set on first use)
    qstrat_reports: list[Any]

    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> None:
        """Receive one update from verl's ``BucketedWeightSender`` and refit the engine.

        Args (verl's): ``peft_config`` with ``base_sync_done``: a LoRA adapter update (refused:
        a qstrat engine takes whole quantized weights, not adapters; sync merged weights instead,
        verl's ``actor_rollout_ref.rollout.layered_summon`` / merged LoRA); ``use_shm``: the
        buckets come through shared memory (any CPU), else CUDA IPC.
        Raises: ConfigError for an adapter update (before anything is received); what
            :func:`qstrat.vllm.sink.in_worker.refit_worker` raises (nothing handed to vLLM unless
            EngineStateError).
        """
        if peft_config and base_sync_done:
            raise ConfigError("qstrat.integrations.verl: verl sent a LoRA adapter update (peft_config with "
                              "base_sync_done); a qstrat engine is refit with whole quantized weights: sync the "
                              "merged model (nothing was received)")
        if self.device is None:
            from verl.utils.device import get_device_name

            self.device = torch.device(f"{get_device_name()}:{self.local_rank}")
        tensors: dict[str, torch.Tensor] = {}

        def on_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            # views into verl's reused bucket buffer: copy before the next bucket overwrites it
            tensors.update((name, t.clone()) for name, t in weights)

        BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device,
                               use_shm=use_shm).receive_weights(on_bucket_received=on_bucket)
        report = refit_worker(self, tensors)
        self.__dict__.setdefault("qstrat_reports", []).append(report)
