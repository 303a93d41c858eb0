"""SkyRL's fidelity probe per step: a SkyRL ``TrainingCallback`` that probes the engine after each
weight sync and adds the probe's numbers to the metrics SkyRL commits to its tracker.

SkyRL 0.4.0's ``RayPPOTrainer`` fires ``on_step_end`` after a training step, then syncs the
engines (``dispatch.save_weights_for_sampler()``), then fires ``on_log`` with the payload it is
about to commit (``skyrl.train.utils.callbacks``: callbacks may add fields to ``logs``), then
``self.tracker.log(payload, step=...)``. :class:`FidelityCallback` probes on the first ``on_log``
after each ``on_step_end`` (an evaluation's ``on_log`` has no sync before it: skipped). Pass it
in the trainer's ``callbacks=[...]``. Importing this module imports SkyRL.
"""
from __future__ import annotations

from typing import Any

from skyrl.train.utils.callbacks import TrainingCallback

from qstrat.errors import FidelityError
from qstrat.vllm.fidelity.metrics import fidelity_metrics
from qstrat.vllm.fidelity.verdict import StepProbe


class FidelityCallback(TrainingCallback):
    """Probe the engine after each of SkyRL's weight syncs and log ``qstrat/fidelity/*``.

    Args:
        model: a transformers model holding the weights just synced (the whole policy, on the
            process the trainer runs in; SkyRL's own policy is sharded in its workers).
        driver: the :class:`~qstrat.execute.driver.RefitDriver` of the engines' strategy.
        engine: what the probe reads logprobs from: a
            :class:`~qstrat.vllm.fidelity.served.ServedEngine` (SkyRL's inference server) or a ``vllm.LLM``.
        every, on_failure, verify_args: :class:`~qstrat.vllm.fidelity.verdict.StepProbe`'s.
    Attributes: probe: the StepProbe (``.reports``).
    Raises (from ``on_log``): FidelityError under ``on_failure="raise"`` after committing the step's
        payload, the failed probe's metrics in it, with ``trainer.tracker.log`` (SkyRL's tracker).
    """

    def __init__(self, model: Any, driver: Any, engine: Any, every: int = 1, on_failure: str = "raise",
                 **verify_args: Any) -> None:
        self.probe = StepProbe(model, every=every, on_failure=on_failure, **verify_args)
        self.driver, self.engine = driver, engine
        self._synced = False

    def on_step_end(self, trainer: Any, callback_input: Any, control: Any) -> None:
        """A training step ended: SkyRL syncs the engines before its next ``on_log``."""
        self._synced = True

    def on_log(self, trainer: Any, callback_input: Any, control: Any) -> None:
        """Probe (when a sync came before and the probe is due) and add its metrics to ``logs``."""
        logs = callback_input.logs
        if not self._synced or logs is None:
            return
        self._synced = False
        try:
            logs.update(self.probe(self.engine, self.driver))
        except FidelityError as exc:
            logs.update(fidelity_metrics(exc.report))
            trainer.tracker.log(logs, step=callback_input.global_step, commit=True)
            raise
