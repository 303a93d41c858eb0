"""What a failed fidelity verdict does in a training loop, one rule for every integration.

A probe above its limit (:class:`~qstrat.errors.FidelityError`) means the engine does not serve
what was sent: its rollouts are not those of the policy. Two answers, chosen with one option
(``on_failure``, :data:`ON_FAILURE`):

- ``"raise"`` (the default everywhere): the sync logs its metrics (``qstrat/fidelity/ok`` 0.0)
  and raises the ``FidelityError``, which stops the run before it trains on those rollouts;
- ``"warn"``: the sync logs the same metrics, warns :class:`FidelityWarning` with the error's
  text (the numbers, the limit, the ratio, the worst position) and goes on - for a run that
  wants the KL on its dashboard and an alert there, not a stop.

:class:`StepProbe` is the probe of a loop a user writes (verl's ``fit``, SkyRL's trainer, the
framework demos): every ``every``-th sync it probes the engine and returns the metrics to merge
into the step's metrics dict (:func:`qstrat.vllm.fidelity.metrics.fidelity_metrics`).
"""
from __future__ import annotations

import warnings
from typing import Any

from qstrat.errors import ConfigError, FidelityError
from qstrat.vllm.fidelity.metrics import fidelity_metrics

__all__ = ["ON_FAILURE", "FidelityWarning", "StepProbe", "check_every", "check_on_failure", "judged"]

#: What a failed verdict does: ``"raise"`` the FidelityError (after logging), or ``"warn"``
#: :class:`FidelityWarning` and go on (module docstring).
ON_FAILURE = ("raise", "warn")


class FidelityWarning(UserWarning):
    """A fidelity probe above its limit, under ``on_failure="warn"``: the text is the
    :class:`~qstrat.errors.FidelityError`'s (numbers, limit, ratio, worst position)."""


def check_on_failure(value: Any, key: str = "on_failure") -> str:
    """``value`` if it is one of :data:`ON_FAILURE`. Raises ConfigError naming ``key``."""
    if not isinstance(value, str) or value not in ON_FAILURE:
        raise ConfigError(f"{key}: what a failed fidelity verdict does, 'raise' (stop the run) or 'warn' "
                          f"(log qstrat/fidelity/ok 0 and go on), got {value!r}")
    return value


def check_every(value: Any, key: str = "every") -> int:
    """``value`` if it is an int >= 0 (0: never probe). Raises ConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}: a sync count >= 0 (0: never probe), got {value!r}")
    return value


def judged(verify: Any, llm: Any, driver: Any, on_failure: str = "raise") -> Any:
    """Run ``verify(llm, driver)`` (a :class:`~qstrat.vllm.fidelity.probe.Verify`) and apply
    ``on_failure`` to a failed verdict.

    Returns: the :class:`~qstrat.vllm.fidelity.probe.FidelityReport` (``passed`` False under
        ``"warn"`` when the verdict failed).
    Raises: ConfigError naming ``on_failure`` when it is not one of :data:`ON_FAILURE` (checked
        first: a misspelled "rasie" must not turn a failed verdict into a warning); FidelityError
        (``.report`` holds the report) when the verdict failed and ``on_failure == "raise"``;
        what ``verify`` raises otherwise.
    Warns: FidelityWarning with the FidelityError's text under ``"warn"``.
    """
    check_on_failure(on_failure)
    try:
        return verify(llm, driver)
    except FidelityError as exc:
        if on_failure == "raise":
            raise
        warnings.warn(FidelityWarning(str(exc)), stacklevel=2)
        return exc.report


class StepProbe:
    """The fidelity probe of a training loop: every ``every``-th sync (the first included), probe
    the engine against ``model`` and return :data:`~qstrat.vllm.fidelity.metrics.FIDELITY_METRICS`.

    One :class:`~qstrat.vllm.fidelity.probe.Verify` serves every call; each probe measures the
    floor behind its limits on its own weights (docs/fidelity.md, "Limits").

    Args:
        model: the trainer's transformers model holding the weights just sent (not modified).
        every: probe the 1st, (every+1)-th, ... sync; 0: never (every call returns ``{}``).
        on_failure: :data:`ON_FAILURE`.
        verify_args: more :class:`~qstrat.vllm.fidelity.probe.Verify` arguments (``sequences``,
            ``top_k``, ``thresholds``).
    Attributes: reports: the :class:`~qstrat.vllm.fidelity.probe.FidelityReport` of every probe, in order.
    Raises: ConfigError naming ``every`` or ``on_failure``; TypeError / ValueError from Verify.
    """

    def __init__(self, model: Any, every: int = 1, on_failure: str = "raise", **verify_args: Any) -> None:
        from qstrat.vllm.fidelity.probe import Verify

        self.every = check_every(every)
        self.on_failure = check_on_failure(on_failure)
        self.verify = Verify(model, **verify_args)
        self.reports: list[Any] = []
        self._syncs = 0

    def __call__(self, llm: Any, driver: Any) -> dict[str, float]:
        """Count one sync of ``llm`` (just refit by ``driver`` from the model's weights) and probe
        it when due. Returns the metrics to log for this sync (``{}`` when not probed).
        Raises / warns as :func:`judged` (the report is in :attr:`reports` either way)."""
        due = self.every and self._syncs % self.every == 0
        self._syncs += 1
        if not due:
            return {}
        try:
            report = judged(self.verify, llm, driver, self.on_failure)
        except FidelityError as exc:
            self.reports.append(exc.report)
            raise
        self.reports.append(report)
        return fidelity_metrics(report)

