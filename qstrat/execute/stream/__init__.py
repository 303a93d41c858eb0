"""Plan execution: quantize inputs as they arrive, emit outputs in wire order, batch experts.

:func:`execute` is what :meth:`qstrat.RefitDriver.execute` / ``run`` do. Its inputs are either a
mapping (every tensor at hand) or an iterator of ``(name, tensor)`` pairs that is consumed ONCE,
in the producer's order: a tensor is buffered from its arrival until its entry is quantized, and
a quantized part from then until its last output is emitted. With a layer-by-layer producer and
the ``natural`` wire order (or any producer with the ``producer`` order) that window is about
one decoder layer of inputs and of outputs, whatever the model size.

The pieces, one module each:

- :mod:`qstrat.execute.stream.window`: the input window (:class:`~qstrat.execute.stream.window.InputWindow`)
  and the input-vs-plan checks;
- :mod:`qstrat.execute.stream.quantize`: one entry's (or one expert batch's) serializer call and its
  NaN/inf checks (:class:`~qstrat.execute.stream.quantize.EntryQuantizer`);
- :mod:`qstrat.execute.stream.batches`: which per-expert inputs are quantized together, and their
  stacked ``[B, N, K]`` tensor (:class:`~qstrat.execute.stream.batches.ExpertBatcher`);
- :mod:`qstrat.execute.stream.index`: the plan's lookup tables (wire order, entries by name, batches,
  groups; :class:`~qstrat.execute.stream.index.PlanIndex`), kept by a driver with its kept plan;
- :mod:`qstrat.execute.stream.groups`: the shared state of engine-fused groups (NVFP4's global scale,
  :class:`~qstrat.execute.stream.groups.GroupContexts`);
- here: wire-order emission (live parts, dropped after their last output) and the CUDA stream
  handoff.

GPU handoff: with ``consumer_stream`` (a ``torch.cuda.Stream``), each CUDA output is handed to
that stream before it is yielded: the consumer stream waits for the producer's current stream
(``Stream.wait_stream``: the quantization is complete when the consumer's work runs), and the
output's memory is marked as in use by it (``Tensor.record_stream``), so the caching allocator
does not hand it out again while the consumer (an NCCL broadcast, a copy) still reads it after
the driver drops its reference.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from qstrat.plan.data import OutputTensor, RefitPlan
from qstrat.execute.stream.index import PlanIndex
from qstrat.execute.stream.window import InputWindow, check_inputs, input_mismatch
from qstrat.execute.stream.quantize import EntryQuantizer, Quantize, SerializerSource, check_passthrough

__all__ = ["Quantize", "SerializerSource", "check_inputs", "check_passthrough", "cut_output", "execute", "hand_off",
           "input_mismatch"]


def execute(driver: SerializerSource, plan: RefitPlan, inputs: Mapping[str, Any] | Iterable[tuple[str, Any]],
            values_checked: bool, expert_batch: int,
            consumer_stream: Any = None, index: PlanIndex | None = None, quantize: Quantize | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint_name, tensor)`` for every output of ``plan`` in its wire order.

    Args:
        driver: the :class:`~qstrat.RefitDriver` that made ``plan`` (its serializer instances).
        plan: a validated plan (whole, or one rank's from :func:`qstrat.execute.sharding.split_plan`).
        inputs: name -> tensor (or lazy handle, DTensor), or an iterator of ``(name, tensor)``
            pairs consumed once in the producer's order. Names must be the plan's inputs (a
            per-rank plan also accepts, and drops, the inputs of :attr:`RefitPlan.elsewhere`).
        values_checked: NaN/inf already checked (:meth:`RefitDriver.check_values`).
        expert_batch: most experts per serializer call (the driver passes its config's
            ``expert_batch`` unless told otherwise).
        consumer_stream: CUDA stream the consumer reads outputs on (see module docstring).
        index: ``plan``'s :class:`~qstrat.execute.stream.index.PlanIndex` (None: built here; the driver
            passes the one kept with its kept plan).
        quantize: the serializer call (:class:`~qstrat.execute.stream.quantize.Quantize`; None:
            ``Serializer.quantize``, every entry whole).
    Yields: tensors on the input's device; per-expert outputs of a slab or batch are views of
        the quantized batch (call ``.contiguous()`` before serializing bytes).
    Raises: PlanError naming the tensor for a streamed input that is not in the plan, arrives
        twice, differs from the plan in shape or dtype, or never arrives; NonFiniteError. With
        a stream these surface when the tensor arrives, after earlier outputs were yielded.
    """
    window = InputWindow(plan, inputs, index)
    quantizer = EntryQuantizer(driver, plan, window, values_checked, expert_batch, quantize)
    try:
        live: dict[int, tuple[dict[str, torch.Tensor], int]] = {}  # entry -> (its parts, outputs left)
        for i, o in window.index.wire_order:
            if i not in live:
                for j, parts in quantizer.quantize(i).items():
                    live[j] = (parts, len(plan.entries[j].outputs))
            parts, left = live[i]
            t = cut_output(parts[o.suffix], o)
            if left == 1:
                del live[i]
            else:
                live[i] = (parts, left - 1)
            yield o.name, hand_off(t, consumer_stream)
            del t
        window.drain()
    finally:
        quantizer.close()
        window.close()


def hand_off(t: torch.Tensor, consumer_stream: Any) -> torch.Tensor:
    """``t``, handed to ``consumer_stream`` when it is a CUDA tensor and a stream is given (see the
    module docstring); unchanged otherwise."""
    if consumer_stream is not None and t.is_cuda:
        consumer_stream.wait_stream(torch.cuda.current_stream(t.device))
        t.record_stream(consumer_stream)
    return t


def cut_output(part: torch.Tensor, o: OutputTensor) -> torch.Tensor:
    """Slice one output out of a serializer part (per-expert emission of a grouped slab)."""
    if o.expert is None:
        return part
    part = part[o.expert]
    if o.row_part is not None and part.dim() >= 2:
        rows = part.shape[0] // o.row_parts
        return part[o.row_part * rows:(o.row_part + 1) * rows]
    # a per-matrix value (e.g. NVFP4 weight_scale_2) duplicated for each fused projection: a copy,
    # so outputs never alias one another (safetensors refuses shared memory)
    return part.clone() if o.row_parts > 1 else part
