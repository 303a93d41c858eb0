"""Fidelity probe: does the engine serve, numerically, what a refit sent?

qstrat checks names, shapes, dtypes and values before the first byte of a refit; this module
checks what the engine computes after it. It scores a few fixed probe sequences twice:

* the ENGINE: vLLM's prompt logprobs (``SamplingParams(prompt_logprobs=k)``: no sampling),
  the top-``k`` tokens and the actual next token at every position;
* the EXPECTATION, trainer-side: the trainer's own transformers model with every quantized
  weight replaced by ``dequantize(quantize(W))`` (the driver's serializer, the same group
  context, so the same bytes the refit sent; :func:`expected_weights`), run through
  ``torch.func.functional_call`` (the trainer's parameters are never modified), with the
  activations treated as the engine treats them where that matters (:func:`engine_activations`).

and reports max |dlogprob| over the actual next tokens and the mean KL(expected || engine) per
position (:class:`FidelityReport`); above its limit - derived from the arithmetic floor the probe
measures on the same model (:mod:`qstrat.vllm.fidelity.limits`; docs/fidelity.md) - or when the median
per-position KL against the float32 rerun exceeds its own limit (the per-token verdict, same
module) - it raises :class:`~qstrat.errors.FidelityError`. It also
reports KL(trainer BF16 || engine): the quantization's own rollout mismatch (what NeMo-RL logs as
``gen_kl_error``, there estimated on sampled tokens in the other direction).

KL over top-k: the engine returns ``k`` logprobs per position (vLLM's ``max_logprobs``, 20 by
default). The KL is computed over the partition {the tokens the engine returned} + {every other
token, as one bucket}: a lower bound of the full-vocabulary KL (data processing inequality),
exact when ``k`` covers the vocabulary. The floor behind the limits is measured as this same quantity.

Entry points: :func:`probe` (standalone, after any refit) and :class:`Verify`
(``qstrat.vllm.refit(..., verify=Verify(model))``). vLLM is imported in one place only,
:func:`engine_prompt_logprobs`, and only when it runs.
"""
from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from qstrat.errors import FidelityError
from qstrat.vllm.fidelity.limits import (FLOOR_FACTOR, MEDIAN_FACTOR, Floor, Threshold, arithmetic_floor, derived_limit, median_floor, median_limit, trimmed_mean)
from qstrat.vllm.online import served_plan
from qstrat.plan import PASSTHROUGH, RefitPlan
from qstrat.serializers.base import Serializer

__all__ = ["FidelityReport", "Floor", "Threshold", "Verify", "compare", "engine_activations",
           "engine_prompt_logprobs", "expected_logprobs", "expected_weights", "format_key", "nvfp4_qdq", "probe",
           "probe_sequences", "threshold_for"]


def format_key(plan: RefitPlan) -> str:
    """The plan's quantized format(s), sorted and joined by ``+`` (``bf16`` for none). A format on
    a non-expert weight is keyed ``<format>_linear`` (NVFP4 on linear layers: W4A4 rounding of
    dense activations; its floor differs from experts-only NVFP4)."""
    keys = {f"{e.serializer}_linear" if e.serializer == "nvfp4" and e.kind != "expert" else e.serializer
            for e in plan.entries if e.serializer not in (PASSTHROUGH, "bf16")}
    return "+".join(sorted(keys)) or "bf16"


def threshold_for(plan: RefitPlan, thresholds: Mapping[str, Threshold]) -> tuple[str, Threshold]:
    """Explicit limits (``thresholds=``) for ``plan``: its formats' (:func:`format_key`; a
    ``<format>_linear`` key falls back to ``<format>`` when the table has no such key), the
    loosest of each number when it mixes formats.

    Returns: (the keys joined by ``+``, the threshold). Raises: KeyError naming a format with
    no threshold in ``thresholds``."""
    formats = []
    for key in format_key(plan).split("+"):
        formats.append(key if key in thresholds or not key.endswith("_linear") else key[: -len("_linear")])
    formats = sorted(set(formats))
    missing = [f for f in formats if f not in thresholds]
    if missing:
        raise KeyError(f"no fidelity threshold for format(s) {missing}: add them to thresholds={{...}} or leave "
                       f"thresholds unset (limits derived from the measured floor) (given: {sorted(thresholds)})")
    chosen = [thresholds[f] for f in formats]
    return "+".join(formats), Threshold(max(t.max_dlogprob for t in chosen), max(t.mean_kl for t in chosen))


# ---- probe sequences ---------------------------------------------------------------------------
def text_vocab_size(model: Any) -> int | None:
    """The language model's vocabulary size of a transformers model: ``config.vocab_size``, or
    its text config's where the top-level config has none (multimodal configs such as Qwen3.5-MoE
    keep it in ``text_config``: :func:`qstrat.layouts.model_config.language_config`). None if neither has one."""
    from qstrat.layouts.model_config import language_config

    config = getattr(model, "config", None)
    for cfg in (config, language_config(config) if config is not None else None):
        vocab = getattr(cfg, "vocab_size", None)
        if vocab is not None:
            return int(vocab)
    return None


def probe_sequences(vocab_size: int, count: int = 16, length: int = 8, seed: int = 0,
                    low: int = 0) -> list[list[int]]:
    """``count`` fixed token sequences of ``length`` ids, uniform in ``[low, vocab_size)`` from a
    seeded ``torch.Generator`` (the same ids on every machine and call).

    Many short sequences by default (16 x 8: 112 scored positions), not a few long ones: a
    rounding difference that flips one token's routing early in a sequence shifts every later
    position of that sequence through attention, and which sequences get such a cascade differs
    between two correct roundings. The per-token verdict's median over positions stays the
    typical token's only while fewer than half the positions cascade: with 16 sequences one
    cascade reaches at most 7 of 112 positions (with 4 x 32, up to 31 of 124; docs/fidelity.md).

    ``vocab_size``: the model's real vocabulary (``config.vocab_size``, not an engine's padded
    one); ``low``: first id to draw (e.g. past reserved ids). Uniform random ids route tokens
    over many experts (with ``count * length`` tokens and top-k routing each expert sees about
    ``count * length * k / E`` of them per layer). Raises ValueError for an empty range or
    ``length < 2`` (the first token of a sequence has no logprob)."""
    if not 0 <= low < vocab_size or count < 1 or length < 2:
        raise ValueError(f"probe_sequences: need 0 <= low < vocab_size, count >= 1, length >= 2; got "
                         f"vocab_size={vocab_size}, low={low}, count={count}, length={length}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab_size, (count, length), generator=g)
    return ids.tolist()


# ---- the expectation: the same quantized weights, trainer-side ---------------------------------
def expected_weights(driver: Any, plan: RefitPlan, tensors: Mapping[str, torch.Tensor],
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``dequantize(quantize(W))`` of every weight the plan quantizes, keyed by trainer name.

    Each entry goes through the plan's serializer exactly as the driver does (same options,
    same group context for members of a fused group - NVFP4's shared global scale), so the
    values are those of the bytes a correct refit sends. Entries sent unchanged (passthrough)
    and unquantized formats of bfloat16 inputs are left out (the trainer's tensor is already
    the expectation).

    Args:
        driver: the :class:`~qstrat.execute.driver.RefitDriver` of the refit.
        plan: its plan (``driver.plan(tensors)``).
        tensors: trainer name -> tensor ([N, K] or [E, N, K] weights), on any device.
        dtype: dtype of the returned tensors (default: each input's own dtype).
    Returns:
        name -> tensor of the input's shape, on its device. Memory: one copy of every quantized
        weight in ``dtype`` (for a BF16 trainer, the size of those weights in BF16); the
        quantized parts of one entry are transient.
    Raises: KeyError naming a planned input missing from ``tensors``.
    """
    members: dict[str, list[str]] = {}
    for e in plan.entries:
        if e.group:
            members.setdefault(e.group, []).append(e.name)
    contexts: dict[str, Any] = {}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for e in plan.entries:
            if e.serializer == PASSTHROUGH:
                continue
            ser = driver.serializer(e.serializer, e.options)
            w = tensors[e.name]
            if not ser.quantizes and w.dtype == torch.bfloat16:
                continue
            ctx = None
            if e.group and type(ser).group_context is not Serializer.group_context:
                if e.group not in contexts:
                    contexts[e.group] = ser.group_context([tensors[n] for n in members[e.group]])
                ctx = contexts[e.group]
            parts = ser.quantize(w, name=e.name, context=ctx, values_checked=True)
            out[e.name] = ser.dequantize(parts).to(dtype or w.dtype)
            del parts
    return out


def nvfp4_qdq(x: torch.Tensor, input_scale: float, block: int = 16) -> torch.Tensor:
    """NVFP4 fake quantization of activations, as vLLM's W4A4 emulation applies it
    (``nvfp4_emulation_utils.ref_nvfp4_quant_dequant`` with global encode scale
    ``1 / input_scale``; per 16 elements along the last dim: ``s = e4m3(min(enc * amax_b / 6,
    448))``, ``q = e2m1_rne(x / (s / enc))`` saturated at 6, result ``q * s / enc``).

    Args: x: [..., K] (K % 16 == 0), any float dtype; input_scale: the plan's NVFP4
        ``input_scale`` option (vLLM encodes with ``1 / max(input_scale)``).
    Returns: x's shape and dtype. Computed in fp32 with qstrat's E2M1 rounding
    (:func:`qstrat.serializers.nvfp4.e2m1_magnitude`, the same ties as vLLM's ``cast_to_fp4``).
    """
    from qstrat.serializers.nvfp4 import E2M1_VALUES, RCP_E2M1_MAX, e2m1_magnitude
    from qstrat.serializers.fp_bits import E4M3_MAX

    shape = x.shape
    enc = torch.tensor(1.0, dtype=torch.float32, device=x.device) / input_scale
    dec = enc.reciprocal()
    blocks = x.float().reshape(-1, shape[-1] // block, block)
    amax_b = blocks.abs().amax(dim=-1, keepdim=True)
    s = (enc * (amax_b * RCP_E2M1_MAX)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    os = torch.where(s == 0, torch.zeros_like(s), (s * dec).reciprocal())
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)[e2m1_magnitude((blocks * os).abs()).long()]
    return (torch.copysign(mag, blocks) * (s / enc)).reshape(shape).to(x.dtype)


@contextmanager
def engine_activations(model: torch.nn.Module, plan: RefitPlan, driver: Any) -> Iterator[dict[str, int]]:
    """While active, ``model``'s modules that hold NVFP4 weights fake-quantize their activations
    as vLLM's W4A4 NVFP4 emulation does: a linear layer's input; a grouped experts module's
    input (once, all tokens) and its gated intermediate ``act(gate) * up`` (transformers'
    ``_apply_gate``, before ``down_proj``) - :func:`nvfp4_qdq` with the plan's ``input_scale``.
    Block FP8 and MXFP8 engines here run W8A16 (BF16 activations; vLLM's CPU emulation and its
    AMX kernels), so they get nothing. Hooks and the instance attribute are removed on exit.

    Yields: counters ``{"inputs": ..., "intermediates": ...}`` of the QDQs applied (a grouped
        experts module whose implementation never calls ``_apply_gate`` would leave
        ``intermediates`` at 0: :func:`probe` refuses that, see there).
    """
    targets: dict[str, float] = {}
    for e in plan.entries:
        if e.serializer == "nvfp4":
            targets[e.name.rsplit(".", 1)[0]] = float(driver.serializer(e.serializer, e.options).options.input_scale)
    counts = {"inputs": 0, "intermediates": 0, "gated_modules": 0}
    handles: list[Any] = []
    patched: list[torch.nn.Module] = []
    modules = dict(model.named_modules())
    try:
        for name, scale in targets.items():
            module = modules.get(name)
            if module is None:
                continue

            def pre(mod: torch.nn.Module, args: tuple, kwargs: dict, scale: float = scale) -> Any:
                counts["inputs"] += 1
                return (nvfp4_qdq(args[0], scale), *args[1:]), kwargs

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            gate = getattr(module, "_apply_gate", None)
            if gate is not None and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):
                def gated(x: torch.Tensor, gate: Callable = gate, scale: float = scale) -> torch.Tensor:
                    counts["intermediates"] += 1
                    return nvfp4_qdq(gate(x), scale)

                module._apply_gate = gated
                patched.append(module)
                counts["gated_modules"] += 1
        yield counts
    finally:
        for h in handles:
            h.remove()
        for module in patched:
            del module._apply_gate  # the instance attribute; the class's method shows again


def expected_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                      params: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Log-softmax of ``model``'s next-token logits for ``sequences`` (equal lengths L).

    ``params``: parameters replacing the model's for this call only
    (``torch.func.functional_call``; the trainer's model is not modified). The model runs in
    eval mode (restored afterwards), without a KV cache, under ``torch.no_grad``.
    Returns: float32 [n, L - 1, V]: row ``i`` scores token ``i + 1``.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(s) for s in sequences], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if params:
                out = torch.func.functional_call(model, dict(params), (ids,), {"use_cache": False}, strict=False)
            else:
                out = model(ids, use_cache=False)
    finally:
        model.train(was_training)
    return torch.log_softmax(out.logits[:, :-1].float(), dim=-1)


def check_sequences(sequences: Any, vocab_size: int | None = None) -> None:
    """Raise ValueError unless ``sequences`` can be probed (:func:`token_id_lists`)."""
    token_id_lists(sequences, vocab_size)


def token_id_lists(sequences: Any, vocab_size: int | None = None) -> list[list[int]]:
    """``sequences`` as lists of Python ints, what the engine and the model are given.

    Accepted: a sequence of sequences of integers - Python ints or integer scalars such as
    ``numpy.int64`` or a 0-d integer tensor (``operator.index``) - or a 2-D integer
    ``torch.Tensor`` / ``numpy`` array ``[count, length]`` (a tokenizer's ``input_ids``).
    Raises ValueError unless they can be probed: at least one sequence, all of one length >= 2
    (the first token has no logprob), every id an integer (not a bool or a float) in
    ``[0, vocab_size)`` (the model's real vocabulary). Checked before the engine sees them: an
    id past the vocabulary fails inside a vLLM CPU engine and can leave it unusable."""
    if hasattr(sequences, "tolist") and hasattr(sequences, "ndim") and hasattr(sequences, "dtype"):
        if sequences.ndim != 2 or str(sequences.dtype).rpartition(".")[2] not in _INTEGER_DTYPES:
            raise ValueError(f"probe: sequences as a tensor or array must be 2-D [count, length] of an integer "
                             f"dtype, got {sequences.dtype} of shape {tuple(sequences.shape)}")
        sequences = sequences.tolist()
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence) or len(sequences) == 0:
        raise ValueError(f"probe: sequences must be a non-empty list of token id lists, got {sequences!r:.80}")
    if not all(isinstance(s, Sequence) and not isinstance(s, (str, bytes)) or hasattr(s, "tolist") for s in sequences):
        raise ValueError(f"probe: sequences must be a non-empty list of token id lists, got {sequences!r:.80}")
    lengths = {len(s) for s in sequences}
    if len(lengths) != 1:
        raise ValueError(f"probe: sequences must all have the same length, got lengths {sorted(lengths)}")
    if lengths.pop() < 2:
        raise ValueError("probe: each sequence needs at least 2 token ids (the first token has no logprob)")
    out = []
    for i, seq in enumerate(sequences):
        row = []
        for j, tok in enumerate(seq):
            value = _integer(tok)
            if value is None:
                raise ValueError(f"probe: sequences[{i}][{j}] = {tok!r} is not a token id: not an integer")
            if value < 0 or (vocab_size is not None and value >= vocab_size):
                raise ValueError(f"probe: sequences[{i}][{j}] = {value} is not a token id in [0, "
                                 f"{vocab_size if vocab_size is not None else 'vocab_size'})")
            row.append(value)
        out.append(row)
    return out


#: Integer dtype names (torch's and numpy's, without the ``torch.`` prefix) of token id tensors.
_INTEGER_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


def _integer(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer scalar (``operator.index``: int,
    ``numpy.int64``, a 0-d integer tensor), else None (a bool, a float, anything else)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


# ---- the engine --------------------------------------------------------------------------------
def engine_prompt_logprobs(llm: Any, sequences: Sequence[Sequence[int]],
                           top_k: int = 20) -> tuple[int, list[list[dict[int, float]]]]:
    """``(k, rows)``: the engine's prompt logprobs; per sequence, per position 1..L-1, ``{token id: logprob}``
    of its top ``k`` tokens and the actual next token (vLLM's public
    ``SamplingParams(prompt_logprobs=k)``; one generated token, greedy; prefix-cache reads are
    skipped by vLLM for such requests, so every position is computed by the refit weights).

    ``k`` = ``min(top_k, the engine's max_logprobs)`` (-1 there: the vocabulary).
    The ONE place this module reaches vLLM (through :mod:`qstrat.vllm.adapter`). ``llm`` may be a
    :class:`~qstrat.vllm.fidelity.served.ServedEngine` (a server in another process, over HTTP).
    """
    from qstrat.vllm.adapter.resolver import resolve
    from qstrat.vllm.adapter.views import EngineView
    from qstrat.vllm.fidelity.served import ServedEngine

    k = served_top_k(llm, top_k)
    if isinstance(llm, ServedEngine):  # qstrat's HTTP client, not a vLLM object
        server: ServedEngine = llm
        return k, server.read_prompt_logprobs(sequences, k)
    SamplingParams = resolve("sampling_params")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    outs = EngineView(llm).generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
    return k, [[{int(t): float(lp.logprob) for t, lp in pos.items()} for pos in o.prompt_logprobs[1:]] for o in outs]


def served_top_k(llm: Any, top_k: int) -> int:
    """The logprobs per position ``llm`` returns when asked for ``top_k``: ``min(top_k, its
    max_logprobs)`` (-1 there: the vocabulary, so ``top_k``). An engine whose model config does
    not say (a stand-in, a server without ``/server_info``) is taken to serve ``top_k``."""
    from qstrat.vllm.adapter.views import EngineView
    from qstrat.vllm.fidelity.served import ServedEngine

    server = llm if isinstance(llm, ServedEngine) else None  # qstrat's HTTP client, not a vLLM object
    limit = server.logprobs_cap if server is not None else EngineView(llm).max_logprobs
    return top_k if limit is None or limit == -1 else min(top_k, limit)


def check_served_top_k(llm: Any, top_k: int, thresholds: Mapping[str, Threshold] | None) -> None:
    """Raise ValueError when derived limits (:data:`~qstrat.vllm.fidelity.limits.FLOOR_FACTOR`,
    validated with top-20 logprobs) would be applied to fewer than 20 logprobs per position
    because ``llm``'s ``max_logprobs`` caps ``top_k`` (:func:`served_top_k`): the probe would measure a smaller KL, so a wrong refit
    could pass - the same weakening :func:`check_probe_args` refuses for ``top_k < 20``."""
    k = served_top_k(llm, top_k)
    if thresholds is None and k < 20:
        raise ValueError(f"fidelity: the engine's max_logprobs={k} caps top_k={top_k} at {k}, and the derived "
                         "limits are validated with top-20 logprobs (a smaller k measures a smaller KL, so "
                         "a wrong refit could pass): start the engine with max_logprobs >= 20 (vllm.LLM(..., "
                         "max_logprobs=20)) or pass top_k and thresholds calibrated for that k")


# ---- the comparison ----------------------------------------------------------------------------
def _partition_kl(p_logprobs: torch.Tensor, engine: Mapping[int, float]) -> float:
    """KL(P || engine) over {the engine's tokens} + {the rest}; ``p_logprobs`` [V] float32."""
    ids = torch.tensor(list(engine), dtype=torch.long)
    q = torch.tensor(list(engine.values()), dtype=torch.float64)
    p = p_logprobs.double().cpu()[ids]
    kl = float((p.exp() * (p - q)).sum())
    p_rest = 1.0 - float(p.exp().sum())
    q_rest = 1.0 - float(q.exp().sum())
    if p_rest > 1e-9:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-12)))
    return max(kl, 0.0)


def compare(expected: torch.Tensor, engine: Sequence[Sequence[Mapping[int, float]]],
            sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Compare trainer-side logprobs with the engine's prompt logprobs.

    Args: expected: [n, L-1, V] from :func:`expected_logprobs`; engine: the rows of
        :func:`engine_prompt_logprobs`; sequences: the token ids scored.
    Returns: ``max_dlogprob`` (max |engine - expected| logprob of the actual next token, nats),
        ``mean_kl`` / ``max_kl`` (KL(expected || engine) per position, top-k partition, nats),
        ``worst`` ((sequence, position) of the max |dlogprob|), ``tokens`` (positions scored),
        ``median_kl`` (the lower median of the per-position KLs, ``torch.median``), ``trimmed_kl``
        (their mean without the largest :data:`~qstrat.vllm.fidelity.limits.OUTLIER_SHARE`: the
        mean-KL verdict's statistic, :func:`~qstrat.vllm.fidelity.limits.trimmed_mean`).
    """
    dmax, worst, kls = 0.0, (0, 0), []
    exp_cpu = expected.cpu()
    for i, (seq, rows) in enumerate(zip(sequences, engine)):
        for j, row in enumerate(rows):
            tok = seq[j + 1]
            d = abs(row[tok] - float(exp_cpu[i, j, tok]))
            if d > dmax or math.isnan(d):
                dmax, worst = d, (i, j + 1)
            kls.append(_partition_kl(exp_cpu[i, j], row))
    per_position = torch.tensor(kls, dtype=torch.float64)
    return {"max_dlogprob": dmax, "mean_kl": sum(kls) / len(kls), "max_kl": max(kls),
            "worst": worst, "tokens": len(kls), "median_kl": float(per_position.median()),
            "trimmed_kl": trimmed_mean(per_position)}


@dataclass(frozen=True)
class FidelityReport:
    """What one probe measured (nats).

    Attributes:
        format: the plan's quantized format(s) (:func:`format_key`; ``bf16`` for none).
        tokens: positions scored (sequences x (length - 1)); top_k: engine logprobs per position.
        max_dlogprob, mean_kl, max_kl: engine vs the expectation from the same quantized
            weights (see :func:`compare`); ``mean_kl`` is the mean over positions without the
            largest :data:`~qstrat.vllm.fidelity.limits.OUTLIER_SHARE` (``trimmed_kl``: routing
            flips a correct engine may show; ``max_kl`` shows them); ``worst``: (sequence,
            position) of max_dlogprob.
        bf16_kl: mean KL(trainer BF16 || engine) over every position: the quantization's own
            rollout mismatch.
        threshold: the limits applied; passed: both numbers within them.
        seconds: wall time of the probe; expected_bytes: memory of the dequantized weight copies.
        floor: the arithmetic floor the limits were derived from
            (:func:`qstrat.vllm.fidelity.limits.arithmetic_floor`; None when ``thresholds`` were given).
        limit_from: where ``threshold`` came from, in words (the floor's value and the factor, or
            "given").
        median_kl: median over positions of KL(float32 rerun || engine) on this probe's weights
            (None with explicit ``thresholds``: not measured); median_floor: the same median for
            the model-dtype expectation instead of the engine; median_limit: ``MEDIAN_FACTOR x
            median_floor`` (:func:`qstrat.vllm.fidelity.limits.median_limit`; None: not applied).
    """

    format: str
    tokens: int
    top_k: int
    max_dlogprob: float
    mean_kl: float
    max_kl: float
    worst: tuple[int, int]
    bf16_kl: float
    threshold: Threshold
    seconds: float
    expected_bytes: int
    floor: Floor | None = None
    limit_from: str = "given"
    median_kl: float | None = None
    median_floor: float | None = None
    median_limit: float | None = None

    @property
    def passed(self) -> bool:
        return (self.max_dlogprob <= self.threshold.max_dlogprob and self.mean_kl <= self.threshold.mean_kl
                and (self.median_limit is None or self.median_kl <= self.median_limit))

    @property
    def ratio(self) -> float:
        """mean KL / its limit: above 1 fails."""
        return self.mean_kl / self.threshold.mean_kl

    @property
    def median_ratio(self) -> float | None:
        """median KL / its limit (above 1 fails); None when no median limit applies."""
        return None if self.median_limit is None else self.median_kl / self.median_limit

    def __str__(self) -> str:
        t = self.threshold
        return (f"fidelity {self.format}: mean KL {self.mean_kl:.3g} (limit {t.mean_kl:.3g}, {self.ratio:.2g}x), "
                f"max |dlogprob| {self.max_dlogprob:.3g} (limit {t.max_dlogprob:.3g}), max KL {self.max_kl:.3g}; "
                f"limits {self.limit_from}; {self._median_words()}KL(trainer BF16 || engine) {self.bf16_kl:.3g}; "
                f"{self.tokens} tokens, top-{self.top_k}, {self.seconds:.2f} s")

    def _median_words(self) -> str:
        if self.median_limit is None:
            return ""
        return (f"median KL vs the float32 rerun {self.median_kl:.3g} (limit {self.median_limit:.3g} = "
                f"{MEDIAN_FACTOR:g} x its median floor {self.median_floor:.3g}, {self.median_ratio:.2g}x); ")


def probe(llm: Any, model: torch.nn.Module, driver: Any, plan: RefitPlan | None = None,
          sequences: Sequence[Sequence[int]] | None = None, top_k: int = 20,
          thresholds: Mapping[str, Threshold] | None = None, check: bool = True,
          floors: dict[str, Floor] | None = None) -> FidelityReport:
    """Score the probe sequences on ``llm`` and on ``model`` with the refit's quantized weights,
    and compare (module docstring).
    Args:
        llm: a ``vllm.LLM`` just refit by ``driver`` from ``model``'s weights.
        model: the trainer's transformers model (``model(ids).logits``); not modified.
        driver: the refit's :class:`~qstrat.execute.driver.RefitDriver`.
        plan: the WHOLE model's plan (default ``driver.plan(model.state_dict())``; for a partial
            refit too: the engine must serve every layer of ``model``).
        sequences: token ids, equal lengths (default :func:`probe_sequences` of the model's
            ``config.vocab_size``: 16 x 8).
        top_k: engine logprobs per position (capped by the engine's ``max_logprobs``; with derived
            limits, a cap below 20 is refused: :func:`check_served_top_k`).
        thresholds: explicit limits per format (:func:`threshold_for`); default None: the limits
            are derived from the arithmetic floor measured on this model and plan
            (:mod:`qstrat.vllm.fidelity.limits`).
        check: raise FidelityError above the limits (else only report); with derived limits also
            the per-token verdict (:func:`per_token_verdict`: one more trainer forward, float32).
        floors: a record, format key -> the latest :class:`Floor` (:class:`Verify` keeps one); the
            floor is measured on every probe's own weights (its rerun runs for the median anyway).
    Returns: a :class:`FidelityReport`.
    Raises: FidelityError (``.report`` holds the report) when ``check`` and a number exceeds its
        limit; TypeError / ValueError naming an argument that cannot work
        (:func:`check_probe_args`), or an engine whose ``max_logprobs`` caps top-20 with derived
        limits (:func:`check_served_top_k`), before the engine is asked; KeyError for a format
        missing from explicit ``thresholds``; ValueError for a floor of 0
        (:func:`~qstrat.vllm.fidelity.limits.derived_limit`); RuntimeError if the model's grouped
        experts hold NVFP4 weights but never call ``_apply_gate`` (the engine's intermediate
        activation quantization could not be matched).
    """
    start = time.perf_counter()
    check_probe_args(model, sequences, top_k, thresholds, check)
    top_k = operator.index(top_k)
    if sequences is not None:
        sequences = token_id_lists(sequences)
    check_served_top_k(llm, top_k, thresholds)
    state = model.state_dict()
    plan = plan if plan is not None else driver.plan(state)
    plan = served_plan(driver, plan, state)  # quantize_in: engine - the formats the engine applies
    fmt = format_key(plan)
    if thresholds is not None:
        fmt, limit = threshold_for(plan, thresholds)
    if sequences is None:
        sequences = probe_sequences(text_vocab_size(model))
    k, engine = engine_prompt_logprobs(llm, sequences, top_k)
    weights = expected_weights(driver, plan, state)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    expected = expected_with_activations(model, plan, driver, sequences, weights)
    floor, medians = None, (None, None, None)
    if thresholds is None:
        rerun = rerun_logprobs(model, plan, driver, sequences, weights)
        floor = measure_floor(model, plan, driver, sequences, weights, expected, k, rerun)  # this probe's weights
        if floors is not None:
            floors[fmt] = floor
        limit = derived_limit(floor)
        medians = per_token_verdict(rerun[0], expected, engine, sequences, k, model_dtype(model) == "float32")
        del rerun
    del weights
    bf16 = expected_logprobs(model, sequences)
    got = compare(expected, engine, sequences)
    ref = compare(bf16, engine, sequences)
    limit_from = "given" if floor is None else (
        f"= {FLOOR_FACTOR:g} x floor {floor.mean_kl:.3g} (KL of this model's expectation, {model_dtype(model)} "
        f"vs {floor.other} activations, measured in {floor.seconds:.2f} s)")
    report = FidelityReport(fmt, got["tokens"], k, got["max_dlogprob"], got["trimmed_kl"], got["max_kl"],
                            got["worst"], ref["mean_kl"], limit, time.perf_counter() - start, nbytes, floor, limit_from,
                            *medians)
    if check and not report.passed:
        raise FidelityError(
            f"the engine does not serve what was sent: {report}. Its outputs differ from the trainer's "
            f"model with the same quantized weights (worst: sequence {report.worst[0]}, position "
            f"{report.worst[1]}); do not use its rollouts: refit again, and restart the engine if it persists",
            report)
    return report


def model_dtype(model: torch.nn.Module) -> str:
    """The dtype name of the model's first floating-point parameter (``bfloat16``)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return str(dtype).rpartition(".")[2]


def expected_with_activations(model: torch.nn.Module, plan: RefitPlan, driver: Any,
                              sequences: Sequence[Sequence[int]], params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """:func:`expected_logprobs` with ``params`` under :func:`engine_activations`. Raises
    RuntimeError if the model's NVFP4 grouped experts never call ``_apply_gate``."""
    with engine_activations(model, plan, driver) as counts:
        out = expected_logprobs(model, sequences, params)
    if counts["gated_modules"] and not counts["intermediates"]:
        raise RuntimeError("probe: the model's NVFP4 experts never called _apply_gate (an experts "
                           "implementation other than transformers' grouped/batched ones): the engine's "
                           "intermediate activation quantization cannot be matched")
    return out


def rerun_logprobs(model: torch.nn.Module, plan: RefitPlan, driver: Any, sequences: Sequence[Sequence[int]],
                   weights: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, str, float]:
    """The expectation rerun in the other activation precision: ``weights`` (and every other
    parameter) cast to float32 (to bfloat16 for a float32 model), under :func:`engine_activations`.

    Returns: (log-probabilities [n, L-1, V] float32, the other dtype's name, seconds). Memory: a
    copy of every parameter in that dtype (4 bytes per parameter for a BF16 trainer), freed on
    return. Time: one trainer forward over the probe sequences."""
    start = time.perf_counter()
    other = torch.bfloat16 if model_dtype(model) == "float32" else torch.float32
    params = {n: weights.get(n, p).to(other) for n, p in model.named_parameters() if p.is_floating_point()}
    rerun = expected_with_activations(model, plan, driver, sequences, params)
    del params
    return rerun, str(other).rpartition(".")[2], time.perf_counter() - start


def measure_floor(model: torch.nn.Module, plan: RefitPlan, driver: Any, sequences: Sequence[Sequence[int]],
                  weights: Mapping[str, torch.Tensor], expected: torch.Tensor, k: int,
                  rerun: tuple[torch.Tensor, str, float] | None = None) -> Floor:
    """The arithmetic floor of this model and plan (:func:`qstrat.vllm.fidelity.limits.arithmetic_floor`):
    the expectation (``expected``, run in the model's dtype) against the same weights and
    activation fake quantization run in float32 (in bfloat16 for a float32 model):
    :func:`rerun_logprobs`, or ``rerun`` when given (its result on the same arguments)."""
    logprobs, other, seconds = rerun or rerun_logprobs(model, plan, driver, sequences, weights)
    return arithmetic_floor(expected, logprobs, [list(s) for s in sequences], k, other, seconds)


def per_token_verdict(rerun: torch.Tensor, expected: torch.Tensor, engine: Sequence[Sequence[Mapping[int, float]]],
                      sequences: Sequence[Sequence[int]], k: int,
                      float32_model: bool) -> tuple[float, float, float | None]:
    """(median KL(precise || engine), median floor, its limit): the per-token verdict of
    :mod:`qstrat.vllm.fidelity.limits` (:func:`~qstrat.vllm.fidelity.limits.median_floor`,
    :func:`~qstrat.vllm.fidelity.limits.median_limit`). The precise run is the float32 one: ``rerun``
    for a BF16 model, ``expected`` for a float32 one (whose rerun is the bfloat16 one).
    All [n, L-1, V] float32 log-probabilities of the same weights; nats."""
    precise, rough = (expected, rerun) if float32_model else (rerun, expected)
    floor = median_floor(precise, rough, [list(s) for s in sequences], k)
    return compare(precise, engine, sequences)["median_kl"], floor, median_limit(floor)


@dataclass(frozen=True)
class Verify:
    """``qstrat.vllm.refit(llm, driver, tensors, verify=Verify(model))``: run :func:`probe`
    after a successful reload; the report lands on ``RefitReport.fidelity``. Arguments as
    :func:`probe`'s, every one checked when Verify is built (:func:`check_probe_args`) and the
    plan's formats against explicit ``thresholds`` before the reload (:meth:`check_plan`). With
    derived limits, the arithmetic floor is measured on every probe's weights; ``floors`` records
    the latest per format."""

    model: torch.nn.Module
    sequences: Sequence[Sequence[int]] | None = None
    top_k: int = 20
    thresholds: Mapping[str, Threshold] | None = field(default=None)
    check: bool = True
    floors: dict[str, Floor] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Every argument is checked when Verify is built, i.e. before a refit reloads anything
        (:func:`check_probe_args`). Raises TypeError / ValueError naming the argument."""
        check_probe_args(self.model, self.sequences, self.top_k, self.thresholds, self.check)
        object.__setattr__(self, "top_k", operator.index(self.top_k))  # what the engine is asked
        if self.sequences is not None:
            object.__setattr__(self, "sequences", token_id_lists(self.sequences))

    def check_plan(self, plan: RefitPlan) -> None:
        """Called by ``qstrat.vllm.refit`` before the reload: with explicit ``thresholds``, raise
        KeyError naming a planned format they lack (:func:`threshold_for`), so it fails before the
        engine changes. Derived limits exist for every format."""
        if self.thresholds is not None:
            threshold_for(plan, self.thresholds)

    def check_engine(self, llm: Any) -> None:
        """Called by ``qstrat.vllm.refit`` before the reload: raise ValueError when ``llm``'s
        ``max_logprobs`` caps ``top_k`` below what the limits are validated for
        (:func:`check_served_top_k`), so it fails before the engine changes."""
        check_served_top_k(llm, self.top_k, self.thresholds)

    def __call__(self, llm: Any, driver: Any) -> FidelityReport:
        return probe(llm, self.model, driver, sequences=self.sequences, top_k=self.top_k,
                     thresholds=self.thresholds, check=self.check, floors=self.floors)


def check_probe_args(model: Any, sequences: Any, top_k: Any, thresholds: Any, check: Any) -> None:
    """Raise TypeError or ValueError naming the argument of :func:`probe` / :class:`Verify` that
    cannot work: ``model`` not an ``nn.Module`` with a ``config.vocab_size`` (e.g. a state dict);
    ``top_k`` not an int >= 1, or below 20 with derived limits (their factor is validated with
    top-20 logprobs: a smaller ``k`` lowers the measured KL bound - a correct refit's top-1 KL is
    ~60x below its top-20 one - so the limits would no longer mean what they say; pass
    ``thresholds`` calibrated for that ``k``); ``thresholds`` not a mapping of format name ->
    :class:`Threshold`; ``check`` not a bool; ``sequences`` as :func:`check_sequences`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fidelity: model must be the trainer's transformers model (an nn.Module), got "
                        f"{type(model).__name__}" + (" (a state dict? pass the model itself)"
                                                    if isinstance(model, Mapping) else ""))
    vocab = text_vocab_size(model)
    if vocab is None:
        raise ValueError("fidelity: the model's config has no vocab_size (nor its text config's): "
                         "cannot check the probe's token ids")
    if _integer(top_k) is None or top_k < 1:
        raise TypeError(f"fidelity: top_k must be an int >= 1 (engine logprobs per position), got {top_k!r}")
    if thresholds is None and top_k < 20:
        raise ValueError(f"fidelity: top_k={top_k} with derived limits, whose factor is validated with "
                         "top-20 logprobs (a smaller k measures a smaller KL, so a wrong refit could pass): "
                         "use top_k >= 20 or pass thresholds calibrated for this k")
    if thresholds is not None:
        if not isinstance(thresholds, Mapping):
            raise TypeError(f"fidelity: thresholds must map format names to Threshold(max_dlogprob, mean_kl), "
                            f"got {type(thresholds).__name__}")
        for key, value in thresholds.items():
            if not isinstance(key, str) or not isinstance(value, Threshold):
                raise TypeError(f"fidelity: thresholds[{key!r}] must be a Threshold(max_dlogprob, mean_kl) "
                                f"under a format name, got {type(value).__name__} {value!r:.40}")
    if not isinstance(check, bool):
        raise TypeError(f"fidelity: check must be a bool, got {check!r}")
    if sequences is not None:
        check_sequences(sequences, vocab)
