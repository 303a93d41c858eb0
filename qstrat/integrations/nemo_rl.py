"""NeMo-RL's vLLM refit with qstrat's: a worker extension for NeMo-RL v0.7.0's generation workers.

NeMo-RL's trainer sends the policy's BF16 weights to each vLLM worker through its worker
extension ``nemo_rl.models.generation.vllm.vllm_backend.VllmInternalWorkerExtension``: after
``prepare_refit_info({name: (shape, dtype)})`` names every tensor of a step, its receivers
(``update_weights_via_ipc_zmq``: CUDA IPC buffers over ZMQ; ``update_weights_from_collective``:
``packed_broadcast_consumer`` on an NCCL group) unpack each bucket and hand it to
``_load_weights``, whose stock version calls ``model.load_weights`` (or NeMo-RL's own FP8 cast) -
neither takes a qstrat checkpoint's formats. :class:`QstratWorkerExtension` replaces only
``_load_weights``: it collects the buckets (copies: NeMo-RL reuses its buffers) and, when every
tensor ``prepare_refit_info`` named has arrived, refits the whole model with
:func:`qstrat.vllm.sink.in_worker.refit_worker` in the strategy of the checkpoint the engine started on.

Use: start NeMo-RL's vLLM generation on a qstrat checkpoint (``qstrat quantize``) with
``worker_extension_cls="qstrat.integrations.nemo_rl.QstratWorkerExtension"`` (NeMo-RL names its
class in ``nemo_rl/models/generation/vllm/vllm_worker.py``; docs/integrations.md). Importing this
module imports NeMo-RL and vLLM.
"""
from __future__ import annotations

from typing import Any

from nemo_rl.models.generation.vllm.vllm_backend import VllmInternalWorkerExtension

from qstrat.errors import ConfigError, PlanError
from qstrat.vllm.sink.in_worker import refit_worker


class QstratWorkerExtension(VllmInternalWorkerExtension):
    """NeMo-RL's vLLM worker extension whose weight loading is qstrat's refit.

    Everything but ``_load_weights`` is NeMo-RL's (ZMQ/IPC and collective receivers, refit info,
    FP8 KV-cache scales); its two receivers only drop an interrupted step's buckets first. What NeMo-RL's stock ``_load_weights`` also does and this one does not:
    Gemma3 vision-tower renames and loading MTP draft weights into a speculative drafter.
    """

    #: every :class:`~qstrat.vllm.RefitReport`, one per step (set on first use)
    qstrat_reports: list[Any]

    def update_weights_from_collective(self, *args: Any, **kwargs: Any) -> Any:
        """NeMo-RL's collective receiver (one call per step), after dropping what an interrupted
        step left (:meth:`_qstrat_new_step`); a step it ends short is refused (:meth:`_qstrat_end_step`)."""
        self._qstrat_new_step()
        return self._qstrat_end_step(super().update_weights_from_collective(*args, **kwargs))

    def update_weights_via_ipc_zmq(self, *args: Any, **kwargs: Any) -> Any:
        """NeMo-RL's IPC/ZMQ receiver (one call per step), as :meth:`update_weights_from_collective`."""
        self._qstrat_new_step()
        return self._qstrat_end_step(super().update_weights_via_ipc_zmq(*args, **kwargs))

    def _qstrat_end_step(self, result: Any) -> Any:
        """After a receiver returned: ``result``, unless the step it ended left announced tensors
        missing (a short step: its receiver returned True, but nothing was reloaded).

        Raises: PlanError naming how many of the announced tensors arrived (the step's buckets are
            dropped, the engine keeps what it served)."""
        pending = self.__dict__.pop("_qstrat_pending", None)
        if pending:
            info = getattr(self, "state_dict_info", None) or {}
            missing = sorted(set(info) - set(pending))
            raise PlanError(f"qstrat.integrations.nemo_rl: the step ended with {len(pending)} of the {len(info)} "
                            f"tensors prepare_refit_info announced (missing: {missing[:3]}"
                            f"{', ...' if len(missing) > 3 else ''}); qstrat refits whole steps only, so nothing "
                            "was reloaded and the step's buckets were dropped")
        return result

    def _qstrat_new_step(self) -> None:
        """A step begins: drop the buckets an interrupted step left (its receiver raised or
        returned before the last bucket), so they never complete a later step's set - a later
        step whose buckets come in another order would otherwise load a mix of two steps."""
        self.__dict__.pop("_qstrat_pending", None)

    def _load_weights(self, weights: list[tuple[str, Any]]) -> None:
        """Receive one bucket of ``(name, tensor)`` (NeMo-RL's unpacked views, BF16); refit the
        engine once the step's last tensor has arrived.

        A bucket naming a tensor already received starts a new step (the earlier step's buckets
        are dropped); NeMo-RL's receivers start each step with none (:meth:`_qstrat_new_step`).

        Raises: ConfigError if ``prepare_refit_info`` was not called (nothing received);
            PlanError for a name it did not announce (the step's tensors are dropped); what
            :func:`qstrat.vllm.sink.in_worker.refit_worker` raises. NeMo-RL's receivers catch it,
            print it and return False.
        """
        info = getattr(self, "state_dict_info", None)
        if not info:
            raise ConfigError("qstrat.integrations.nemo_rl: no refit info; NeMo-RL calls prepare_refit_info "
                              "({name: (shape, dtype)}) before the first refit, and qstrat refits once every tensor "
                              "it names has arrived (nothing was received)")
        pending: dict[str, Any] = self.__dict__.setdefault("_qstrat_pending", {})
        unknown = [name for name, _ in weights if name not in info]
        if unknown:
            pending.clear()
            raise PlanError(f"qstrat.integrations.nemo_rl: NeMo-RL sent {unknown[:3]} not in prepare_refit_info's "
                            f"{len(info)} tensors; this step's tensors were dropped, nothing was reloaded")
        again = [name for name, _ in weights if name in pending]
        if again:  # a step began without NeMo-RL's receivers (a direct _load_weights): the rest is stale
            pending.clear()
        pending.update((name, t.clone()) for name, t in weights)  # views into NeMo-RL's reused buffer
        if len(pending) < len(info):
            return
        try:
            report = refit_worker(self, dict(pending))
        finally:
            pending.clear()
        self.__dict__.setdefault("qstrat_reports", []).append(report)
