"""Plan execution: quantize inputs as they arrive, emit outputs in wire order, batch experts.

:func:`execute` is what :meth:`qstrat.RefitDriver.execute` / ``run`` do. Its inputs are either a
mapping (every tensor at hand) or an iterator of ``(name, tensor)`` pairs that is consumed ONCE,
in the producer's order: a tensor is buffered from its arrival until its entry is quantized, and
a quantized part from then until its last output is emitted. With a layer-by-layer producer and
the ``natural`` wire order (or any producer with the ``producer`` order) that window is about
one decoder layer of inputs and of outputs, whatever the model size.

Per-expert inputs (``experts.{e}.{proj}.weight``) of one layer with the same shape, dtype and
format are quantized together: up to ``expert_batch`` consecutive experts are stacked into one
``[B, N, K]`` scratch tensor (reused from call to call, released when the run ends) - or read in
place when they are equally spaced views of one slab - and quantized in ONE serializer call (one
kernel launch on GPU). Every format quantizes each expert of a batch independently (block and
tile boundaries never cross experts; see :mod:`qstrat.serializers.base`), so the bytes equal one
call per expert; the wire order does not change.

GPU handoff: with ``consumer_stream`` (a ``torch.cuda.Stream``), each CUDA output is handed to
that stream before it is yielded: the consumer stream waits for the producer's current stream
(``Stream.wait_stream``: the quantization is complete when the consumer's work runs), and the
output's memory is marked as in use by it (``Tensor.record_stream``), so the caching allocator
does not hand it out again while the consumer (an NCCL broadcast, a copy) still reads it after
the driver drops its reference.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch

from qstrat.errors import NonFiniteError, PlanError
from qstrat.inputs import check_new_name, materialize
from qstrat.plan.data import PASSTHROUGH, OutputTensor, PlanEntry, RefitPlan
from qstrat.plan.planner import projection_shape, split_by_projection
from qstrat.serializers.base import Serializer, check_finite, dtype_name

__all__ = ["SerializerSource", "check_passthrough", "cut_output", "execute"]


class SerializerSource(Protocol):
    """What execution needs of the driver: the serializer instance for a planned format
    (:meth:`qstrat.RefitDriver.serializer`, cached per format and options)."""

    def serializer(self, name: str, options: Mapping[str, Any]) -> Serializer: ...


def execute(driver: SerializerSource, plan: RefitPlan, inputs: Mapping[str, Any] | Iterable[tuple[str, Any]],
            values_checked: bool, expert_batch: int,
            consumer_stream: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint_name, tensor)`` for every output of ``plan`` in its wire order.

    Args:
        driver: the :class:`~qstrat.RefitDriver` that made ``plan`` (its serializer instances).
        plan: a validated plan (whole, or one rank's from :func:`qstrat.sharding.split_plan`).
        inputs: name -> tensor (or lazy handle, DTensor), or an iterator of ``(name, tensor)``
            pairs consumed once in the producer's order. Names must be the plan's inputs (a
            per-rank plan also accepts, and drops, the inputs of :attr:`RefitPlan.elsewhere`).
        values_checked: NaN/inf already checked (:meth:`RefitDriver.check_values`).
        expert_batch: most experts per serializer call (the driver passes its config's
            ``expert_batch`` unless told otherwise).
        consumer_stream: CUDA stream the consumer reads outputs on (see module docstring).
    Yields: tensors on the input's device; per-expert outputs of a slab or batch are views of
        the quantized batch (call ``.contiguous()`` before serializing bytes).
    Raises: PlanError naming the tensor for a streamed input that is not in the plan, arrives
        twice, differs from the plan in shape or dtype, or never arrives; NonFiniteError. With
        a stream these surface when the tensor arrives, after earlier outputs were yielded.
    """
    run = _Run(driver, plan, inputs, values_checked, expert_batch, consumer_stream)
    try:
        yield from run.emit()
    finally:
        run.close()


class _Source:
    """The inputs: random access to a mapping, or arrival order of a stream (buffered)."""

    def __init__(self, plan: RefitPlan, inputs: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        self.plan = plan
        self.entries = {e.name: e for e in plan.entries}
        self.mapping = inputs if isinstance(inputs, Mapping) else None
        self.stream = None if self.mapping is not None else iter(inputs)
        self.buffered: dict[str, Any] = {}   # arrived, not yet read
        self.held: dict[str, torch.Tensor] = {}  # materialized, still needed
        self.seen: set[str] = set()

    def has(self, name: str) -> bool:
        """Whether ``name`` can be read without pulling the stream."""
        return self.mapping is not None or name in self.buffered or name in self.held

    def get(self, name: str) -> torch.Tensor:
        """The materialized value of input ``name`` (pulled from the stream if needed)."""
        if name in self.held:
            return self.held[name]
        if self.mapping is not None:
            raw = self.mapping[name]
        else:
            while name not in self.buffered:
                if self.pull() is None:
                    raise PlanError(f"{name}: planned, but the input stream ended before it arrived")
            raw = self.buffered.pop(name)
        with torch.no_grad():
            t = materialize(raw, name)
        self.held[name] = t
        return t

    def pull(self) -> str | None:
        """Read one pair from the stream and buffer it; its name, or None at the end."""
        assert self.stream is not None
        item = next(self.stream, None)
        if item is None:
            return None
        name, t = item
        check_new_name(name, self.seen)
        self.seen.add(name)
        if name in self.plan.elsewhere:
            return name  # emitted by another rank: dropped
        e = self.entries.get(name)
        if e is None:
            raise PlanError(f"{name}: not in the plan (plan from the same names, shapes and dtypes "
                            "the producer yields)")
        problem = input_mismatch(e, t)
        if problem:
            raise PlanError(problem)
        self.buffered[name] = t
        return name

    def release(self, name: str) -> None:
        self.held.pop(name, None)

    def drain(self) -> None:
        """Consume the rest of the stream (inputs of other ranks only)."""
        if self.stream is not None:
            while self.pull() is not None:
                pass
            if self.buffered:
                raise PlanError(f"inputs arrived but were never used: {sorted(self.buffered)[:5]}")


class _Run:
    """State of one execution: live parts, group contexts, batch scratch."""

    def __init__(self, driver: SerializerSource, plan: RefitPlan, inputs: Any, values_checked: bool,
                 expert_batch: int, consumer_stream: Any) -> None:
        self.driver, self.plan, self.values_checked = driver, plan, values_checked
        self.expert_batch, self.consumer_stream = max(1, expert_batch), consumer_stream
        self.src = _Source(plan, inputs)
        self.index = {e.name: i for i, e in enumerate(plan.entries)}
        self.members: dict[str, list[int]] = {}
        for i, e in enumerate(plan.entries):
            if e.group:
                self.members.setdefault(e.group, []).append(i)
        self.batchable: dict[tuple[Any, ...], dict[int, int]] = {}  # key -> expert -> entry index
        for i, e in enumerate(plan.entries):
            key = self._batch_key(e)
            if key is not None:
                self.batchable.setdefault(key, {})[e.expert] = i
        self.done: set[int] = set()            # entries quantized
        self.contexts: dict[str, Any] = {}     # group -> context (groups with a group step)
        self.stepped: set[str] = set()         # groups whose format has a group step
        self.checked: set[str] = set()         # inputs whose NaN/inf check ran with their group
        self.scratch: dict[tuple[Any, ...], torch.Tensor] = {}

    # ---- emission ---------------------------------------------------------------------------
    def emit(self) -> Iterator[tuple[str, torch.Tensor]]:
        live: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
        for i, o in self.plan.wire_order():
            if i not in live:
                for j, parts in self._quantize(i).items():
                    live[j] = (parts, len(self.plan.entries[j].outputs))
            parts, left = live[i]
            t = cut_output(parts[o.suffix], o)
            if left == 1:
                del live[i]
            else:
                live[i] = (parts, left - 1)
            yield o.name, self._handoff(t)
            del t
        self.src.drain()

    def close(self) -> None:
        """Release the batch scratch and every buffered input."""
        self.scratch.clear()
        self.src.held.clear()
        self.src.buffered.clear()

    def _handoff(self, t: torch.Tensor) -> torch.Tensor:
        s = self.consumer_stream
        if s is not None and t.is_cuda:
            s.wait_stream(torch.cuda.current_stream(t.device))
            t.record_stream(s)
        return t

    # ---- quantization -----------------------------------------------------------------------
    def _quantize(self, i: int) -> dict[int, dict[str, torch.Tensor]]:
        """Quantize entry ``i`` (with the experts batched with it). Returns entry -> parts."""
        e = self.plan.entries[i]
        if e.serializer == PASSTHROUGH:
            t = self.src.get(e.name)
            if not self.values_checked:
                check_passthrough(t, e.name)
            self._finish([i])
            return {i: {"weight": t}}
        ser = self.driver.serializer(e.serializer, e.options)
        batch = self._batch(i)
        with torch.no_grad():
            ws = [self.src.get(self.plan.entries[j].name) for j in batch]
            ctxs = [self._context(j, ser) for j in batch]
            checked = self.values_checked or all(self.plan.entries[j].name in self.checked for j in batch)
            if len(batch) == 1:  # quantize checks NaN/inf itself (the fast path: from its block maxima)
                k = _projection_split(e, ser)
                if k:  # a slab whose projections are tiled on their own (planner.split_by_projection)
                    w = ws[0]
                    parts = ser.quantize(w.reshape(projection_shape(tuple(w.shape), k)), name=e.name,
                                         context=ctxs[0], values_checked=checked)
                    parts = {n: v.reshape(w.shape[0], k * v.shape[1], *v.shape[2:]) for n, v in parts.items()}
                else:
                    parts = ser.quantize(ws[0], name=e.name, context=ctxs[0], values_checked=checked)
                result = {i: parts}
            else:
                stacked = self._stack(ws)
                ctx = None if ctxs[0] is None else {k: torch.stack([c[k] for c in ctxs]) for k in ctxs[0]}
                name = f"{e.name} (with {len(batch) - 1} more experts)"
                try:
                    parts = ser.quantize(stacked, name=name, context=ctx, values_checked=checked)
                except NonFiniteError:  # name the expert's own tensor, not the stacked batch
                    for j, w in zip(batch, ws):
                        ser.check_values(w, self.plan.entries[j].name)
                    raise
                parts = _unalias(parts, stacked)
                result = {j: {k: v[b] for k, v in parts.items()} for b, j in enumerate(batch)}
        self._finish(batch)
        return result

    def _finish(self, batch: list[int]) -> None:
        """Mark entries quantized; release inputs no pending group context still needs."""
        self.done.update(batch)
        for j in batch:
            g = self.plan.entries[j].group
            if g not in self.stepped:
                self.src.release(self.plan.entries[j].name)
            elif all(m in self.done for m in self.members[g]):
                for m in self.members[g]:
                    self.src.release(self.plan.entries[m].name)
                self.contexts.pop(g, None)

    def _context(self, i: int, ser: Serializer) -> Any:
        """The group context of entry ``i``: computed once per fused group, for formats with a
        group step (NVFP4's shared global scale); None otherwise (nothing waits for siblings)."""
        g = self.plan.entries[i].group
        if not g or type(ser).group_context is Serializer.group_context:
            return None
        if g not in self.contexts:
            self.stepped.add(g)
            names = [self.plan.entries[m].name for m in self.members[g]]
            members = [self.src.get(n) for n in names]
            if not self.values_checked:  # NaN/inf named by member tensor, not "fusion group member i"
                for n, w in zip(names, members):
                    ser.check_values(w, n)
                    self.checked.add(n)
            self.contexts[g] = ser.group_context(members)
        return self.contexts[g]

    # ---- expert batches ---------------------------------------------------------------------
    @staticmethod
    def _batch_key(e: PlanEntry) -> tuple[Any, ...] | None:
        if e.serializer == PASSTHROUGH or e.kind != "expert" or e.expert is None:
            return None
        proj = e.name.rsplit(f".{e.expert}.", 1)[-1]  # e.g. gate_proj.weight
        return (e.engine_module, proj, tuple(e.shape), e.dtype, e.serializer, repr(sorted(e.options.items())))

    def _batch(self, i: int) -> list[int]:
        """Entry ``i`` and the next consecutive experts of its layer it can be quantized with:
        same projection, shape, dtype and format, not yet quantized, at most ``expert_batch``.
        From a stream, the batch reads ahead only while the arriving inputs belong to the same
        layer's experts (the window stays within the layer)."""
        e = self.plan.entries[i]
        key = self._batch_key(e)
        if key is None or self.expert_batch == 1:
            return [i]
        by_expert = self.batchable[key]
        batch = [i]
        for x in range(e.expert + 1, e.expert + self.expert_batch):
            j = by_expert.get(x)
            if j is None or j in self.done:
                break
            name = self.plan.entries[j].name
            while not self.src.has(name):
                arrived = self.src.pull()
                if arrived is None or self._engine_module(arrived) != e.engine_module:
                    return batch
            batch.append(j)
        return batch

    def _engine_module(self, name: str) -> str | None:
        j = self.index.get(name)
        return None if j is None else self.plan.entries[j].engine_module

    def _stack(self, ws: list[torch.Tensor]) -> torch.Tensor:
        """``ws`` as one [B, N, K] tensor: a view when they are equally spaced views of one
        storage (per-expert views of a slab), else copied into reused scratch."""
        view = _as_strided_batch(ws)
        if view is not None:
            return view
        w = ws[0]
        key = (tuple(w.shape), w.dtype, w.device)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = torch.empty((self.expert_batch,) + tuple(w.shape), dtype=w.dtype,
                                                  device=w.device)
        out = buf[: len(ws)]
        torch.stack(ws, out=out)
        return out


def _projection_split(e: PlanEntry, ser: Serializer) -> int:
    """For a grouped slab the plan tiles per projection (:func:`~qstrat.plan.planner.split_by_projection`),
    the number of projections it stacks; else 0."""
    if e.expert is not None or len(e.shape) != 3 or not e.outputs or e.outputs[0].row_parts < 2:
        return 0
    k = e.outputs[0].row_parts
    return k if split_by_projection(ser.part_specs(e.shape), e.shape[1], k) else 0


def _as_strided_batch(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """A [B, ...] view over equally spaced same-shaped views of one storage, or None."""
    w0 = ws[0]
    base = w0.untyped_storage().data_ptr()
    step = ws[1].storage_offset() - w0.storage_offset()
    if step <= 0:
        return None
    for b, w in enumerate(ws):
        if (w.untyped_storage().data_ptr() != base or w.stride() != w0.stride()
                or w.storage_offset() != w0.storage_offset() + b * step):
            return None
    return w0.as_strided((len(ws),) + tuple(w0.shape), (step,) + tuple(w0.stride()), w0.storage_offset())


def _unalias(parts: dict[str, torch.Tensor], scratch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copy parts that share memory with the input batch (a format returning a view of its input
    would otherwise see its outputs overwritten when the scratch is reused)."""
    ptr = scratch.untyped_storage().data_ptr()
    return {k: (v.clone() if v.untyped_storage().data_ptr() == ptr else v) for k, v in parts.items()}


def input_mismatch(e: PlanEntry, t: Any) -> str | None:
    """Why input ``t`` cannot be the planned ``e`` (shape or dtype differ), or None. Metadata only."""
    shape, dtype = getattr(t, "shape", None), getattr(t, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        return f"{e.name}: given a {type(t).__name__}, planned as a {e.dtype}{list(e.shape)} tensor"
    if (tuple(shape), dtype_name(dtype)) != (tuple(e.shape), e.dtype):
        return f"{e.name}: arrived as {dtype_name(dtype)}{list(shape)}, planned as {e.dtype}{list(e.shape)}"
    return None


def check_inputs(plan: RefitPlan, tensors: Mapping[str, Any]) -> None:
    """Raise PlanError listing every planned input missing from ``tensors`` or whose shape or dtype
    differs from the plan - what a stream checks as each tensor arrives - before anything is
    emitted (a plan made beforehand, given with a mapping). Reads ``.shape``/``.dtype`` only.
    Inputs the plan does not name are ignored (a partial plan, e.g. ``only_layers``)."""
    errors = []
    for e in plan.entries:
        if e.name not in tensors:
            errors.append(f"{e.name}: planned, but not among the given tensors")
        else:
            problem = input_mismatch(e, tensors[e.name])
            if problem:
                errors.append(problem)
    if errors:
        more = f"\n  ... {len(errors) - 20} more" if len(errors) > 20 else ""
        raise PlanError("the given tensors do not match the given plan:\n  " + "\n  ".join(errors[:20]) + more)


def check_passthrough(t: torch.Tensor, name: str) -> None:
    """NaN/inf in a tensor sent unchanged (norms, routers, embeddings) is an error too.

    Raises: NonFiniteError naming ``name`` and the first bad index.
    """
    if t.is_floating_point() and t.numel():
        check_finite(t if t.dim() <= 3 else t.reshape(-1, *t.shape[-2:]), name, 1)


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
