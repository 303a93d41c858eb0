"""The fidelity probe's numbers as the per-step metrics a trainer logs (names and values).

One place for the metric names every integration logs after a probe
(:class:`qstrat.vllm.fidelity.probe.FidelityReport`), so TRL's sync and a hand-written loop (verl, SkyRL,
NeMo-RL users who probe themselves) log the same keys: ``metrics.update(fidelity_metrics(report))``.
No heavy imports: integrations import it at module level.
"""
from __future__ import annotations

from typing import Any

__all__ = ["FIDELITY_METRICS", "fidelity_metrics"]

#: Metric names (nats; ratios unitless): engine vs the trainer's model on the same quantized
#: weights (mean KL, max |dlogprob|), the rollout mismatch KL(trainer BF16 || engine) (NeMo-RL's
#: ``gen_kl_error``), the mean-KL limit the verdict used (derived from the floor the probe measured
#: on the model) and mean KL / limit, the verdict (``ok``: 1.0 passed, 0.0 failed) and the probe's
#: own cost (``seconds``, wall clock, trainer side plus the engine's prefill), then the per-token
#: verdict: the median KL against the float32 rerun and its ratio to its limit (logged only when
#: that limit applies). Any ratio above 1: ``ok`` 0.0 (docs/fidelity.md; what it does then:
#: :mod:`qstrat.vllm.fidelity.verdict`).
FIDELITY_METRICS = ("qstrat/fidelity/mean_kl", "qstrat/fidelity/max_dlogprob", "qstrat/fidelity/bf16_kl",
                    "qstrat/fidelity/limit", "qstrat/fidelity/ratio", "qstrat/fidelity/ok",
                    "qstrat/fidelity/seconds", "qstrat/fidelity/median_kl", "qstrat/fidelity/median_ratio")


def fidelity_metrics(report: Any) -> dict[str, float]:
    """``{name: value}`` of :data:`FIDELITY_METRICS` for one probe's ``report`` (a
    :class:`~qstrat.vllm.fidelity.probe.FidelityReport`, or what a ``FidelityError`` carries as ``.report``).
    Every value a float (``ok``: ``float(report.passed)``). The two median entries are left out when
    the report has no median limit (explicit ``thresholds=``)."""
    values = dict(zip(FIDELITY_METRICS, (report.mean_kl, report.max_dlogprob, report.bf16_kl,
                                         report.threshold.mean_kl, report.ratio, float(report.passed),
                                         report.seconds)))
    if getattr(report, "median_limit", None) is not None:
        values.update(zip(FIDELITY_METRICS[7:], (report.median_kl, report.median_ratio)))
    return values
