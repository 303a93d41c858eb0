"""The fidelity probe's limits, derived per model from a floor the probe measures itself.

A correct refit still differs from the trainer's expectation by arithmetic: the engine and
transformers round BF16 activations at different points (fused kernels, residual adds, attention).
How much that moves the next-token distribution depends on the model (depth, width, vocabulary,
routing) and on the format (NVFP4's W4A4 activation rounding amplifies it). So the probe does not
use limits calibrated on one model: it measures, on the SAME probe sequences, weights and
activation fake quantization as the expectation, how far one change of activation precision moves
the output - the expectation run in the model's dtype against the same run in float32
(:func:`arithmetic_floor`) - and sets each limit at :data:`FLOOR_FACTOR` times that floor
(:func:`derived_limit`). The measured values behind the factor are in docs/fidelity.md ("Limits").

A second, per-token verdict (:func:`median_limit`): the median over positions of KL(float32 rerun
|| engine) must stay within :data:`MEDIAN_FACTOR` times the median of KL(float32 rerun || the
model-dtype expectation), both measured on the probe's current weights. A mean over positions is
set by its heaviest positions (a routing flip), and its limit must leave room for them; a
corruption that moves EVERY token a little (one layer's experts zeroed in a deeper model) shifts
the median as much as the mean, while the median of a correct engine follows its floor closely.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FLOOR_FACTOR", "DLOGPROB_FACTOR", "MEDIAN_FACTOR", "OUTLIER_SHARE", "Floor", "Threshold",
           "arithmetic_floor", "derived_limit", "median_floor", "median_limit", "partition_kl_rows", "trimmed_mean"]

#: mean-KL limit / floor. A correct engine and transformers each deviate from exact arithmetic by
#: about one BF16 forward's rounding (the floor); independent deviations add (KL is quadratic in a
#: small logit difference: 2x), and correct engines measured 0.2-3.7x the floor on one mean over
#: the probe's positions (docs/fidelity.md): 2 x 4 = 8.
FLOOR_FACTOR = 8.0
#: max-|dlogprob| limit / the floor's max |dlogprob|: a maximum over positions is heavier-tailed
#: than a mean (one routing flip sets it), so twice the mean KL's factor. The mean KL decides.
DLOGPROB_FACTOR = 16.0
#: median-KL limit / the median floor. Both are measured against the float32 rerun, which carries
#: (almost) no BF16 rounding of its own: a correct engine is one BF16 forward's rounding away from
#: it, as the model-dtype expectation is, so FLOOR_FACTOR's 2 for two independent roundings drops
#: and its spread margin of 4 stays (correct engines measured 0.7-3.3x the median floor on the same
#: weights; docs/fidelity.md).
MEDIAN_FACTOR = FLOOR_FACTOR / 2
#: share of the positions, the largest, that the mean-KL verdict and its floor leave out
#: (:func:`trimmed_mean`). A correct engine can flip a near-tied routing decision at a token where
#: the floor's rounding did not, which moves that token (and, in deeper models, the rest of its
#: sequence) far more than rounding does; such flips are discrete events the floor's one realization
#: cannot predict. 1/16 is one default probe sequence's positions (16 x 8): one cascade, or up
#: to 7 isolated flips in 112 positions, are allowed for; a corruption must move more to count.
OUTLIER_SHARE = 1 / 16


@dataclass(frozen=True)
class Threshold:
    """Largest values a correct refit may show (nats): ``max_dlogprob`` = max |logprob(engine)
    - logprob(expected)| over the probe's actual next tokens; ``mean_kl`` = mean KL(expected ||
    engine) per position (top-k partition, :mod:`qstrat.vllm.fidelity.probe`)."""

    max_dlogprob: float
    mean_kl: float


@dataclass(frozen=True)
class Floor:
    """The arithmetic floor of one model and plan, as the probe measured it (nats).

    Attributes: mean_kl / max_dlogprob: KL(expectation in the model's dtype || the same in
        ``other``) per position (top-k partition of the ``other`` run plus the actual token),
        mean without the largest :data:`OUTLIER_SHARE` (:func:`trimmed_mean`), and the max
        |dlogprob| of the actual next token; other: the dtype the expectation
        was rerun in ("float32", or "bfloat16" for a float32 trainer); seconds: its cost."""

    mean_kl: float
    max_dlogprob: float
    other: str
    seconds: float


def derived_limit(floor: Floor, factor: float = FLOOR_FACTOR, dlogprob_factor: float = DLOGPROB_FACTOR) -> Threshold:
    """The limits a correct refit must stay within: ``factor * floor.mean_kl`` and
    ``dlogprob_factor * floor.max_dlogprob`` (the factors' sources: :data:`FLOOR_FACTOR`,
    :data:`DLOGPROB_FACTOR`). Raises ValueError for a floor of 0 (a model whose output no
    activation rounding moves cannot tell noise from a fault: pass explicit thresholds)."""
    if not floor.mean_kl > 0 or not floor.max_dlogprob > 0:
        raise ValueError(f"fidelity: the measured arithmetic floor is {floor.mean_kl!r} (max |dlogprob| "
                         f"{floor.max_dlogprob!r}): no limit can be derived from it; pass thresholds={{...}}")
    return Threshold(max_dlogprob=dlogprob_factor * floor.max_dlogprob, mean_kl=factor * floor.mean_kl)


def trimmed_mean(kl: torch.Tensor, share: float = OUTLIER_SHARE) -> float:
    """Mean of per-position KLs (any shape, nats) without the largest ``floor(n * share)`` of the
    n values (:data:`OUTLIER_SHARE`); the plain mean when that is 0."""
    values = kl.flatten().double().sort().values
    keep = values.numel() - int(values.numel() * share)
    return float(values[:keep].mean())


def partition_kl_rows(p: torch.Tensor, q: torch.Tensor, actual: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, KL(P || Q) over {Q's top ``k`` tokens and the actual next token} + {the
    rest as one bucket}: the quantity the probe measures against an engine that returns its top-k
    logprobs (a lower bound of the full-vocabulary KL), and |dlogprob| of the actual token.

    Args: p, q: float32 log-probabilities [n, L-1, V]; actual: int64 [n, L-1] next-token ids;
        k: logprobs per position (>= 1; capped at V).
    Returns: (kl [n, L-1] float64, dlogprob [n, L-1] float64), nats."""
    p, q = p.double(), q.double()
    mask = torch.zeros_like(q, dtype=torch.bool)
    mask.scatter_(-1, q.topk(min(k, q.shape[-1]), dim=-1).indices, True)
    mask.scatter_(-1, actual.unsqueeze(-1), True)
    pe = p.exp()
    kl = torch.where(mask, pe * (p - q), torch.zeros_like(p)).sum(-1)
    p_rest = (1.0 - torch.where(mask, pe, torch.zeros_like(p)).sum(-1)).clamp(min=0.0)
    q_rest = (1.0 - torch.where(mask, q.exp(), torch.zeros_like(q)).sum(-1)).clamp(min=1e-12)
    rest = torch.where(p_rest > 1e-9, p_rest * (p_rest.clamp(min=1e-300).log() - q_rest.log()), torch.zeros_like(p_rest))
    dlog = (p.gather(-1, actual.unsqueeze(-1)) - q.gather(-1, actual.unsqueeze(-1))).squeeze(-1).abs()
    return (kl + rest).clamp(min=0.0), dlog


def arithmetic_floor(expected: torch.Tensor, rerun: torch.Tensor, sequences: list[list[int]], k: int,
                     other: str, seconds: float) -> Floor:
    """The :class:`Floor` from the expectation's logprobs and the same forward rerun in another
    activation precision (both [n, L-1, V] float32, from ``qstrat.vllm.fidelity.probe.expected_logprobs``),
    compared as the probe compares an engine (:func:`partition_kl_rows`, the rerun in the engine's
    role). ``other``/``seconds``: recorded as given."""
    actual = torch.tensor([list(s[1:]) for s in sequences], dtype=torch.long)
    kl, dlog = partition_kl_rows(expected.cpu(), rerun.cpu(), actual, k)
    return Floor(mean_kl=trimmed_mean(kl), max_dlogprob=float(dlog.max()), other=other, seconds=seconds)


def median_floor(precise: torch.Tensor, rough: torch.Tensor, sequences: list[list[int]], k: int) -> float:
    """Median over positions of KL(``precise`` || ``rough``) (:func:`partition_kl_rows`, ``rough``
    in the engine's role): how far one BF16 forward's rounding moves a typical token's distribution.

    Args: precise: the float32 run's log-probabilities, rough: the bfloat16 run's (both [n, L-1, V]
        float32, the same weights and sequences); k: the engine's logprobs per position.
    Returns: nats (the lower median of the n * (L-1) positions: ``torch.median``)."""
    actual = torch.tensor([list(s[1:]) for s in sequences], dtype=torch.long)
    kl, _ = partition_kl_rows(precise.cpu(), rough.cpu(), actual, k)
    return float(kl.flatten().median())


def median_limit(floor_median: float, factor: float = MEDIAN_FACTOR) -> float | None:
    """The largest median KL(float32 rerun || engine) a correct refit may show: ``factor *
    floor_median`` (:data:`MEDIAN_FACTOR`). None for a median floor of 0 (more than half the
    positions untouched by the rounding: no per-token limit can be derived; the mean-KL limit
    still applies)."""
    return factor * floor_median if floor_median > 0 else None
