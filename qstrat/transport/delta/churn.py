"""How a quantized checkpoint changes per RL step, and what a delta round of each step sends.

Per format (:data:`FORMATS`) and step of a trajectory of bf16 state dicts (e.g.
:func:`qstrat.cli.demo.trajectory.adam_trajectory`), the checkpoint of the step is compared with
the previous step's (both from ``RefitDriver.run``), by kind of checkpoint tensor
(:func:`kind_of`): the fraction of quantized CODES changed (an NVFP4 byte holds two e2m1 codes:
each nibble counts), of BLOCK SCALES changed, and of per-tensor GLOBAL scales changed (NVFP4's
``weight_scale_2``); and the bytes of the delta round of the step (``qstrat.transport.delta.stream.encode_round``
against the previous step's stream: the wire manifest's total, header and alignment included)
against the full round's (the target's stream) and against the same delta encoding of the bf16
state dicts (``bf16 delta``: what a BF16 delta sync with our encoding would send).
:func:`forced_churn` counts the same for one state against itself with every weight, or only
each matrix's largest, one bf16 ulp larger: what each format's scale rule forces.

Measured figures: docs/transport.md, "Delta: how quantized weights change per step"
(``scripts/delta_churn.py`` makes the table and the chart; ``qstrat bench --only delta`` prints
the table).
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.stream import encode_round
from qstrat.transport.wire_manifest import WireManifest, build_wire_manifest

#: The formats of the study: ``RefitDriver`` configs (NVFP4 on the MoE experts only, and on
#: every linear layer).
FORMATS: dict[str, Any] = {
    "block-fp8": "block-fp8",
    "mxfp8": "mxfp8",
    "nvfp4-experts": {"rules": [{"select": "experts", "serializer": "nvfp4"}]},
    "nvfp4-linear": {"rules": [{"select": "linear", "serializer": "nvfp4"}]},
}
#: The kinds of checkpoint tensor counted (:func:`kind_of`).
KINDS = ("codes", "scales", "global", "other")
_CODE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
#: Bucket size of the rounds measured (the sender's default is 64 MiB; one bucket per 4 MiB
#: gives a small model several buckets, as a large one has).
BUCKET_BYTES = 4 << 20


def kind_of(name: str, t: torch.Tensor) -> str:
    """The kind of checkpoint tensor ``name``: ``global`` (``*.weight_scale_2``, NVFP4's fp32
    per-tensor scale), ``scales`` (``*.weight_scale`` / ``*.weight_scale_inv``: block scales),
    ``codes`` (a ``*.weight`` in FP8 or uint8: FP8 codes or packed e2m1 pairs), else ``other``
    (bf16 tensors left unquantized, input scales)."""
    if name.endswith(".weight_scale_2"):
        return "global"
    if name.endswith((".weight_scale", ".weight_scale_inv")):
        return "scales"
    if name.endswith(".weight") and t.dtype in _CODE_DTYPES:
        return "codes"
    return "other"


def changed_elements(name: str, new: torch.Tensor, old: torch.Tensor) -> tuple[int, int]:
    """(elements, elements changed) of checkpoint tensor ``name`` between two steps: per element
    of its dtype, compared bitwise; a uint8 ``codes`` tensor holds two NVFP4 codes per byte, each
    nibble counted."""
    a = new.contiguous().reshape(-1).view(_INT_OF_SIZE[new.element_size()])
    b = old.contiguous().reshape(-1).view(_INT_OF_SIZE[old.element_size()])
    if new.dtype == torch.uint8 and kind_of(name, new) == "codes":
        x = a ^ b
        return 2 * a.numel(), int(((x & 0x0F) != 0).sum()) + int(((x >> 4) != 0).sum())
    return a.numel(), int((a != b).sum())


#: Integer dtypes by element size: elements compared bitwise (a NaN equals itself, -0 != +0).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _target(tensors: list[tuple[str, torch.Tensor]]) -> WireManifest:
    return build_wire_manifest(((n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors),
                               BUCKET_BYTES)


class RoundBytes:
    """Consecutive rounds of one layout: each :meth:`next` gives the wire bytes of the delta
    round against the previous one (:func:`qstrat.transport.delta.stream.encode_round`, every
    bucket's payload; the first: a whole round)."""

    def __init__(self) -> None:
        self.base: delta.Base | None = None

    def next(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """(the full round's bytes: the target's total, the delta round's wire bytes)."""
        target = _target(tensors)
        enc, _ = encode_round(target, iter(tensors), self.base)
        self.base = enc.new_base()
        return target.total_bytes, enc.wire_bytes


def trajectory_churn(drivers: Mapping[str, Any], states: Iterable[Mapping[str, torch.Tensor]],
                     on_step: Callable[[dict[str, list[dict[str, Any]]]], None] | None = None
                     ) -> dict[str, list[dict[str, Any]]]:
    """Per format (``drivers``: name -> ``RefitDriver``) and step after the first of ``states``
    (bf16 state dicts, consumed once: a trajectory is computed once for every format), the
    checkpoint's changes and round bytes (module docstring).

    Returns: per format name, one dict per step: ``step`` (1...), per kind ``<kind>`` and
        ``<kind>_changed`` (elements), ``full_bytes``, ``delta_bytes``, ``bf16_full_bytes``,
        ``bf16_delta_bytes``; ``on_step`` is called with them after each step (a long run's
        progress). Raises: as ``RefitDriver.run``.
    """
    rows: dict[str, list[dict[str, Any]]] = {f: [] for f in drivers}
    rounds = {f: RoundBytes() for f in drivers}
    bf16 = RoundBytes()
    prev: dict[str, dict[str, torch.Tensor]] = {}
    for step, state in enumerate(states):
        bf16_full, bf16_sent = bf16.next(list(state.items()))
        for fmt, driver in drivers.items():
            out = list(driver.run(state))
            full, sent = rounds[fmt].next(out)
            if step:
                row: dict[str, Any] = {"step": step, **{k: 0 for k in KINDS}, **{f"{k}_changed": 0 for k in KINDS}}
                for name, t in out:
                    kind = kind_of(name, t)
                    n, c = changed_elements(name, t, prev[fmt][name])
                    row[kind] += n
                    row[f"{kind}_changed"] += c
                row.update(full_bytes=full, delta_bytes=sent, bf16_full_bytes=bf16_full,
                           bf16_delta_bytes=bf16_sent)
                rows[fmt].append(row)
            prev[fmt] = dict(out)
        if step and on_step is not None:
            on_step(rows)
    return rows


def ulp_up(t: torch.Tensor) -> torch.Tensor:
    """``t`` (bf16) with every element's magnitude one bf16 ulp larger (its bit pattern + 1, sign
    kept: 0 becomes the smallest subnormal). Raises: ValueError for another dtype."""
    if t.dtype != torch.bfloat16:
        raise ValueError(f"ulp_up: a bf16 tensor is required, got {t.dtype}")
    return (t.view(torch.int16) + 1).view(torch.bfloat16)


def matrix_max_up(t: torch.Tensor) -> torch.Tensor:
    """``t`` (bf16, >= 2 dims: a matrix or a stack of them, e.g. a grouped expert slab) with the
    largest-magnitude element of every matrix (last two dims) one bf16 ulp larger; a tensor of
    fewer dims is returned as it is. Raises: ValueError for a matrix not in bf16."""
    if t.dim() < 2:
        return t
    m = t.reshape(-1, t.shape[-2] * t.shape[-1]).clone()
    at = m.float().abs().argmax(1, keepdim=True)
    m.scatter_(1, at, ulp_up(m.gather(1, at)))
    return m.reshape(t.shape)


#: What the formats force (:func:`forced_churn`): perturbations of one state dict, each bf16
#: tensor mapped. "every weight +1 ulp": every block's amax moves by one bf16 ulp (and every
#: tensor's); "matrix max +1 ulp": only each matrix's largest element moves (its tensor amax,
#: NVFP4's global scale, and the one block holding it).
PERTURBATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "every weight +1 ulp": ulp_up,
    "matrix max +1 ulp": matrix_max_up,
}


def forced_churn(drivers: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per perturbation (:data:`PERTURBATIONS`) of ``state`` (a bf16 state dict) and format
    (``drivers``: name -> ``RefitDriver``), what the checkpoint and the delta round change: the
    :func:`trajectory_churn` row of the two-step trajectory (``state``, perturbed ``state``).

    Returns: ``{perturbation: {format: row}}``. Raises: as ``RefitDriver.run``; ValueError for a
    tensor of ``state`` that is not bf16."""
    out = {}
    for name, f in PERTURBATIONS.items():
        moved = {n: f(t) if t.is_floating_point() else t for n, t in state.items()}
        rows = trajectory_churn(drivers, [state, moved])
        out[name] = {fmt: r[0] for fmt, r in rows.items()}
    return out


def summary(fmt: str, lr: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over ``rows`` (:func:`trajectory_churn`) of: % of codes, block scales and global
    scales changed (None where the format has none), delta bytes in % of the full round's, and
    the delta's bytes / the bf16 delta's; beside each median, ``<key>_range``: [min, max] over
    the steps (None where the median is)."""
    metrics = {
        "codes_pct": _pct("codes"), "scales_pct": _pct("scales"), "global_pct": _pct("global"),
        "delta_pct_of_full": lambda r: 100 * r["delta_bytes"] / r["full_bytes"],
        "delta_over_bf16_delta": lambda r: r["delta_bytes"] / r["bf16_delta_bytes"] if r["bf16_delta_bytes"] else None,
    }
    out: dict[str, Any] = {"format": fmt, "lr": lr, "steps": len(rows)}
    for key, f in metrics.items():
        values = [v for v in (f(r) for r in rows) if v is not None]
        out[key] = statistics.median(values) if values else None
        out[f"{key}_range"] = [min(values), max(values)] if values else None
    out["full_bytes"] = rows[0]["full_bytes"] if rows else None
    return out


def _pct(kind: str) -> Callable[[Mapping[str, Any]], float | None]:
    """% of a step's ``kind`` elements changed (None where the checkpoint has none)."""
    return lambda r: 100 * r[f"{kind}_changed"] / r[kind] if r[kind] else None


#: The table's columns: (summary key, header, format); a key with a ``<key>_range`` in the
#: summary prints ``median (min-max)``.
COLUMNS = (("format", "format", "{}"), ("lr", "lr", "{:.0e}"), ("steps", "steps", "{}"),
           ("codes_pct", "codes changed %", "{:.3g}"), ("scales_pct", "scales changed %", "{:.3g}"),
           ("global_pct", "global scales changed %", "{:.1f}"), ("delta_pct_of_full", "delta / full %", "{:.3f}"),
           ("delta_over_bf16_delta", "delta / bf16 delta", "{:.3f}"), ("full_bytes", "full bytes", "{:,}"))


def table_rows(summaries: Iterable[Mapping[str, Any]]) -> list[list[str]]:
    """:data:`COLUMNS` of each summary as strings (``-`` for None; ``median (min-max)`` where
    the summary has the key's range)."""

    def cell(s: Mapping[str, Any], key: str, f: str) -> str:
        if s[key] is None:
            return "-"
        span = s.get(f"{key}_range")
        return f.format(s[key]) + (f" ({f.format(span[0])}-{f.format(span[1])})" if span else "")

    return [[cell(s, k, f) for k, _, f in COLUMNS] for s in summaries]


def study_model(width: int, formats: Iterable[str]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The study's model: the tiny Qwen3-MoE (:func:`qstrat.cli.demo.tiny_model.build_tiny_qwen3_moe`,
    seed 1) with hidden, intermediate and head counts times ``width``, and a ``RefitDriver`` per
    format name of ``formats`` (:data:`FORMATS`). Raises: KeyError for an unknown format name;
    ImportError without transformers (``qstrat[demo]``)."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver

    model = build_tiny_qwen3_moe(seed=1, hidden_size=256 * width, intermediate_size=512 * width,
                                 moe_intermediate_size=128 * width, num_attention_heads=4 * width,
                                 num_key_value_heads=2 * width)
    return model, {f: RefitDriver(FORMATS[f], hf_config=hf_config(model)) for f in formats}


def measure_forced(width: int, formats: Iterable[str]) -> dict[str, Any]:
    """:func:`forced_churn` on the bf16 weights of the study's model (:func:`study_model`: the
    first state of every trajectory of :func:`measure`). Returns: ``{"width", "load",
    "perturbations": forced_churn's}``. Raises: as :func:`study_model`."""
    model, drivers = study_model(width, formats)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return {"width": width, "load": os.getloadavg()[0], "perturbations": forced_churn(drivers, state)}


def measure(width: int, steps: int, lrs: Iterable[float], formats: Iterable[str],
            on_lr: Callable[[dict[str, Any]], None] | None = None,
            text: str | None = None, text_name: str = "the Zen of Python") -> dict[str, Any]:
    """The study on :func:`study_model` (``width``): ``steps`` real Adam steps per lr in
    ``lrs`` (:func:`qstrat.cli.demo.trajectory.adam_trajectory`: next-token loss on the bytes of
    ``text``, called ``text_name``; None: the Zen of Python, :func:`~qstrat.cli.demo.trajectory.text_tokens`),
    each step quantized in every format of ``formats`` (:data:`FORMATS` names).

    Returns: ``{"width", "steps", "token_stream" (the text and its tokens, in words), "parameters"
        (the model's), "load": [load average at the start and after each lr],
        "runs": [{"lr", "format", "rows"}]}`` (rows: :func:`trajectory_churn`'s); ``on_lr`` is
        called with it after each lr, and after each step with the lr's rows so far (under
        ``"partial"``). Raises: as :func:`study_model`; ValueError for an empty text.
    """
    from qstrat.cli.demo.trajectory import adam_trajectory, text_tokens

    tokens = text_tokens(text)
    model, drivers = study_model(width, formats)
    doc: dict[str, Any] = {"width": width, "steps": steps,
                           "token_stream": f"bytes of {text_name} ({tokens.numel()} tokens)",
                           "parameters": sum(p.numel() for p in model.parameters()),
                           "load": [os.getloadavg()[0]], "runs": []}
    for lr in lrs:
        rows = trajectory_churn(drivers, adam_trajectory(model, lr, steps, tokens=tokens), None if on_lr is None else (
            lambda part: on_lr({**doc, "partial": [{"lr": lr, "format": f, "rows": r} for f, r in part.items()]})))
        doc["runs"] += [{"lr": lr, "format": f, "rows": r} for f, r in rows.items()]
        doc["load"].append(os.getloadavg()[0])
        if on_lr is not None:
            on_lr(doc)
    return doc


def summaries(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One :func:`summary` per run of a :func:`measure` document, by format then lr."""
    runs = sorted(doc["runs"], key=lambda r: (list(FORMATS).index(r["format"]), r["lr"]))
    return [summary(r["format"], r["lr"], r["rows"]) for r in runs]


__all__ = ["BUCKET_BYTES", "COLUMNS", "FORMATS", "KINDS", "PERTURBATIONS", "RoundBytes", "changed_elements",
           "forced_churn", "kind_of", "matrix_max_up", "measure", "measure_forced", "study_model", "summaries", "summary", "table_rows",
           "trajectory_churn", "ulp_up"]
