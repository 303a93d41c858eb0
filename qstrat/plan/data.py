"""The refit plan's data: every input tensor's decision and outputs, resolved before any quantization.

A :class:`RefitPlan` lists :class:`PlanEntry` items (inputs in natural name order). The WIRE
ORDER is every output checkpoint name in natural order (``layers.2`` before ``layers.10``;
digit runs compare as numbers): the same model gives the same wire order whether the trainer
hands over grouped slabs or per-expert tensors, in any input order.
"""
from __future__ import annotations

import contextlib
import gc
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from qstrat.rules import PASSTHROUGH
from qstrat.serializers.base import tensor_nbytes

__all__ = ["PASSTHROUGH", "OutputTensor", "PlanEntry", "RefitPlan", "natural_key"]


@dataclass(frozen=True)
class OutputTensor:
    """One checkpoint tensor the engine receives.

    Attributes:
        name: checkpoint name, e.g. ``model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv``.
        shape, dtype, nbytes: as emitted (dtype as a torch dtype name, bytes exact).
        suffix: serializer part it comes from; ``expert`` / ``row_part`` / ``row_parts``: how it
            is cut out of a grouped slab (None for whole tensors).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    suffix: str = "weight"
    expert: int | None = None
    row_part: int | None = None
    row_parts: int = 1


@dataclass(frozen=True)
class PlanEntry:
    """The decision for one input tensor.

    Attributes:
        name, shape, dtype: the trainer's tensor.
        kind, layer, expert: from the layout's name parser.
        rule: what decided (``rules[0]``, ``keep_bf16.first``, ``default``, ``never quantized: router``).
        serializer: registered format name, or ``passthrough`` (sent unchanged).
        options: serializer options.
        outputs: checkpoint tensors emitted, in wire order.
        group: fusion-group key when the engine fuses this tensor with siblings.
        note: e.g. the reason of a BF16 fallback.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    layer: int | None
    expert: int | None
    rule: str
    serializer: str
    options: dict[str, Any]
    outputs: tuple[OutputTensor, ...]
    group: str | None = None
    note: str = ""
    engine_module: str = ""

    @property
    def nbytes_out(self) -> int:
        """Bytes emitted for this input."""
        return sum(o.nbytes for o in self.outputs)


@dataclass
class RefitPlan:
    """A validated plan. Build it with :meth:`qstrat.RefitDriver.plan`.

    Attributes:
        entries: one per input, in wire order.
        layout: model layout name; num_layers: decoder depth used for keep_bf16.
        ignored_layers: vLLM module prefixes left unquantized (routers included).
        quantization_config: the engine's quantization_config, or None for a BF16 plan.
    """

    entries: list[PlanEntry]
    layout: str
    num_layers: int | None
    ignored_layers: list[str]
    quantization_config: dict[str, Any] | None
    config: dict[str, Any] = field(default_factory=dict)

    def vllm_quantization_config(self) -> dict[str, Any] | None:
        """The exact ``quantization_config`` for the engine's config.json (None: unquantized)."""
        return None if self.quantization_config is None else dict(self.quantization_config)

    def outputs(self) -> list[OutputTensor]:
        """Every emitted tensor, in wire order."""
        return [o for _, o in self.wire_order()]

    def wire_order(self) -> list[tuple[int, OutputTensor]]:
        """(entry index, output) pairs sorted by natural order of the output name."""
        with gc_paused():
            pairs = [(i, o) for i, e in enumerate(self.entries) for o in e.outputs]
            return sorted(pairs, key=lambda p: natural_key(p[1].name))

    def totals(self) -> dict[str, dict[str, int]]:
        """Per serializer: ``tensors`` (inputs), ``outputs``, ``bytes_in`` (as given), ``bytes_out``."""
        out: dict[str, dict[str, int]] = {}
        for e in self.entries:
            t = out.setdefault(e.serializer, {"tensors": 0, "outputs": 0, "bytes_in": 0, "bytes_out": 0})
            t["tensors"] += 1
            t["outputs"] += len(e.outputs)
            t["bytes_in"] += tensor_nbytes(e.shape, getattr(torch, e.dtype))
            t["bytes_out"] += e.nbytes_out
        return out

    def to_json(self, indent: int | None = None) -> str:
        """The whole plan as JSON: config, layout, quantization_config, totals, entries."""
        doc = {
            "layout": self.layout,
            "num_layers": self.num_layers,
            "config": self.config,
            "quantization_config": self.quantization_config,
            "ignored_layers": self.ignored_layers,
            "wire_order": "output checkpoint names in natural order (digit runs compare as numbers)",
            "totals": self.totals(),
            "entries": [asdict(e) for e in self.entries],
        }
        return json.dumps(doc, indent=indent)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (restored after, if it was on).

    Planning allocates ~5 long-lived objects per tensor (230k for DeepSeek-V3) and no cycles;
    the collector would rescan them again and again (~20-40% of planning and wire-order time).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> str:
    """Sort key comparing digit runs as integers: ``layers.2`` < ``layers.10``.

    The order is that of the tuple key ``(text, int, text, int, ...)`` from splitting ``name``
    at digit runs (where one name has a digit run and the other text, the digit run sorts
    first; leading zeros do not count), encoded as one string for speed (sorting 91k outputs
    of a DeepSeek-V3 plan): each digit run becomes ``"\0"``, a length character, the digits
    without leading zeros. Names must not contain ``"\0"``.
    """
    return _DIGITS.sub(_encode_digits, name)


def _encode_digits(m: re.Match[str]) -> str:
    digits = m.group().lstrip("0") or "0"
    return "\0" + chr(0x30 + len(digits)) + digits
