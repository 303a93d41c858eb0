"""How a quantized checkpoint changes per RL step, and what a delta round of each step sends.

Per format (:data:`FORMATS`) and step of a trajectory of bf16 state dicts (e.g.
:func:`qstrat.demo.trajectory.adam_trajectory`), the checkpoint of the step is compared with
the previous step's (both from ``RefitDriver.run``), by kind of checkpoint tensor
(:func:`kind_of`): the fraction of quantized CODES changed (an NVFP4 byte holds two e2m1 codes:
each nibble counts), of BLOCK SCALES changed, and of per-tensor GLOBAL scales changed (NVFP4's
``weight_scale_2``); and the bytes of the delta round of the step (``delta_stream.encode_round``
against the previous step's stream: the wire manifest's total, header and alignment included)
against the full round's (the target's stream) and against the same delta encoding of the bf16
state dicts (``bf16 delta``: what a BF16 delta sync with our encoding would send).

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

from qstrat.transport import delta
from qstrat.transport.delta_stream import encode_round
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
    round against the previous one (:func:`qstrat.transport.delta_stream.encode_round`, every
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


def summary(fmt: str, lr: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over ``rows`` (:func:`trajectory_churn`) of: % of codes, block scales and global
    scales changed (None where the format has none), delta bytes in % of the full round's, and
    the delta's bytes / the bf16 delta's."""

    def med(f: Any) -> float | None:
        values = [v for v in (f(r) for r in rows) if v is not None]
        return statistics.median(values) if values else None

    def pct(kind: str) -> Any:
        return lambda r: 100 * r[f"{kind}_changed"] / r[kind] if r[kind] else None

    return {"format": fmt, "lr": lr, "steps": len(rows), "codes_pct": med(pct("codes")),
            "scales_pct": med(pct("scales")), "global_pct": med(pct("global")),
            "delta_pct_of_full": med(lambda r: 100 * r["delta_bytes"] / r["full_bytes"]),
            "delta_over_bf16_delta": med(lambda r: r["delta_bytes"] / r["bf16_delta_bytes"]),
            "full_bytes": rows[0]["full_bytes"] if rows else None}


#: The table's columns: (summary key, header, format).
COLUMNS = (("format", "format", "{}"), ("lr", "lr", "{:.0e}"), ("steps", "steps", "{}"),
           ("codes_pct", "codes changed %", "{:.4f}"), ("scales_pct", "scales changed %", "{:.4f}"),
           ("global_pct", "global scales changed %", "{:.1f}"), ("delta_pct_of_full", "delta / full %", "{:.3f}"),
           ("delta_over_bf16_delta", "delta / bf16 delta", "{:.3f}"), ("full_bytes", "full bytes", "{:,}"))


def table_rows(summaries: Iterable[Mapping[str, Any]]) -> list[list[str]]:
    """:data:`COLUMNS` of each summary as strings (``-`` for None)."""
    return [["-" if s[k] is None else f.format(s[k]) for k, _, f in COLUMNS] for s in summaries]


def measure(width: int, steps: int, lrs: Iterable[float], formats: Iterable[str],
            on_lr: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The study on the tiny Qwen3-MoE (:func:`qstrat.demo.tiny_model.build_tiny_qwen3_moe`, seed
    1; hidden, intermediate and head counts times ``width``): ``steps`` real Adam steps per lr in
    ``lrs`` (:func:`qstrat.demo.trajectory.adam_trajectory`), each step quantized in every format
    of ``formats`` (:data:`FORMATS` names).

    Returns: ``{"width", "steps", "load": [load average at the start and after each lr],
        "runs": [{"lr", "format", "rows"}]}`` (rows: :func:`trajectory_churn`'s); ``on_lr`` is
        called with it after each lr, and after each step with the lr's rows so far (under
        ``"partial"``). Raises: KeyError for an unknown format name; ImportError
        without transformers (``qstrat[demo]``).
    """
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.demo.trajectory import adam_trajectory
    from qstrat.driver import RefitDriver

    model = build_tiny_qwen3_moe(seed=1, hidden_size=256 * width, intermediate_size=512 * width,
                                 moe_intermediate_size=128 * width, num_attention_heads=4 * width,
                                 num_key_value_heads=2 * width)
    drivers = {f: RefitDriver(FORMATS[f], hf_config=hf_config(model)) for f in formats}
    doc: dict[str, Any] = {"width": width, "steps": steps, "load": [os.getloadavg()[0]], "runs": []}
    for lr in lrs:
        rows = trajectory_churn(drivers, adam_trajectory(model, lr, steps), None if on_lr is None else (
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


__all__ = ["BUCKET_BYTES", "COLUMNS", "FORMATS", "KINDS", "RoundBytes", "changed_elements", "kind_of", "measure", "summaries", "summary",
           "table_rows", "trajectory_churn"]
