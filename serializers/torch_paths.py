"""A format's torch paths run over a weight: :meth:`~qstrat.serializers.base.Serializer.reference`
(the eager oracle) or :meth:`~qstrat.serializers.base.Serializer.encode_into` (the fast path, the
same bytes written in place) on cache-sized chunks ``[e, r, K]`` of ``[E, N, K]``
(:func:`qstrat.serializers.chunking.chunks`), each writing views of the preallocated parts. ``ser`` is the
:class:`~qstrat.serializers.base.Serializer` running."""
from __future__ import annotations

import math
import threading
from typing import Any

import torch

from qstrat.errors import NonFiniteError
from qstrat.serializers.chunking import Scratch, chunk_pool, chunk_workers, chunks
from qstrat.serializers.finite import check_finite, peak_abs
from qstrat.serializers.parts import Context, PartSpec, check_parts

#: One chunk: (label ``"[e0:e1, r0:r1]"``, x [e, r, K] view, context sliced to [e] or None,
#: part suffix -> destination view).
ChunkView = tuple[str, torch.Tensor, Context | None, dict[str, torch.Tensor]]


def chunk_views(ser: Any, w3: torch.Tensor, ctx: Context | None,
                specs: tuple[PartSpec, ...]) -> tuple[dict[str, torch.Tensor], list[ChunkView]]:
    """``(out, views)``: the parts of ``w3`` ([E, N, K]) allocated empty per ``specs`` on its
    device, and one :data:`ChunkView` per cache-sized chunk (``ser``'s chunk size and row tile)."""
    out = {p.suffix: torch.empty(p.shape, dtype=p.dtype, device=w3.device) for p in specs}
    views = []
    for e0, e1, r0, r1 in chunks(tuple(w3.shape), ser._chunk_elements(), ser.row_tile):
        sub_ctx = None if ctx is None else {k: v[e0:e1] for k, v in ctx.items()}
        dsts = {}
        for p in specs:
            dst = out[p.suffix][e0:e1]
            if p.rows_per_entry is not None:
                dst = dst[:, r0 // p.rows_per_entry : -(-r1 // p.rows_per_entry)]
            dsts[p.suffix] = dst
        views.append((f"[{e0}:{e1}, {r0}:{r1}]", w3[e0:e1, r0:r1], sub_ctx, dsts))
    return out, views


def run_reference(ser: Any, w3: torch.Tensor, ctx: Context | None,
                  specs: tuple[PartSpec, ...], name: str = "weight") -> dict[str, torch.Tensor]:
    """``ser.reference`` over cache-sized expert and row chunks of ``w3`` [E, N, K] (bounded fp32
    scratch). Returns the parts per ``specs``. ``name``: the tensor, for messages.

    Raises: PluginError naming the serializer, ``name`` and the chunk when a chunk's
        ``reference()`` emits other parts than declared or raises (anything but a qstrat error
        or running out of memory)."""
    from qstrat.errors import PluginError, QstratError

    out, views = chunk_views(ser, w3, ctx, specs)
    for label, x, sub_ctx, dsts in views:
        try:
            got = ser.reference(x.float(), sub_ctx)
        except (QstratError, MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # a plugin's math: say whose, on which tensor
            raise PluginError(f"serializer {ser.name!r} ({type(ser).__module__}.{type(ser).__qualname__}): "
                              f"reference() raised {type(exc).__name__}: {exc} on {name} chunk {label}") from exc
        check_parts(ser.name, f"reference() chunk {label} of {name}",
                    [PartSpec(k, tuple(d.shape), d.dtype) for k, d in dsts.items()], got)
        for suffix, dst in dsts.items():
            dst.copy_(got[suffix])
    return out


def run_fast(ser: Any, w3: torch.Tensor, ctx: Context | None, specs: tuple[PartSpec, ...],
             check: str | None, source: torch.Tensor) -> tuple[dict[str, torch.Tensor], float]:
    """``ser.encode_into`` over cache-sized chunks of ``w3`` [E, N, K], one scratch per worker
    thread (:func:`qstrat.serializers.chunking.chunk_pool`), each worker under the caller's
    inference mode (a per-thread torch setting).

    Args: check: the tensor's name when non-finite values must raise (found from the block
        maxima), else None; source: the weight as given (``w3`` is it as [E, N, K]), for the
        index in that error.
    Returns: ``(parts, peak)``, ``peak`` the largest block maximum (0.0 without ``check``).
    Raises: NonFiniteError (with ``check``) naming the first NaN/inf index of ``source``."""
    out, views = chunk_views(ser, w3, ctx, specs)
    workers = chunk_workers()
    if len(views) == 1 or workers == 1 or w3.device.type != "cpu":
        scratch = Scratch(w3.device)
        peak = max([encode_chunk(ser, v, scratch, check) for v in views])
    else:
        local = threading.local()
        # inference mode is per thread: a caller under torch.inference_mode() allocated ``out``
        # as inference tensors, which a worker outside it may not write in place
        inference = torch.is_inference_mode_enabled()

        def task(view: ChunkView) -> float:
            with torch.inference_mode(inference):
                if not hasattr(local, "scratch"):
                    local.scratch = Scratch(w3.device)
                return encode_chunk(ser, view, local.scratch, check)

        peak = max(list(chunk_pool(workers).map(task, views)))
    if peak == math.inf:
        check_finite(source, check, ser._expert_chunk(w3))  # names the index
        raise NonFiniteError(f"{check}: its values overflow float32 (non-finite block maxima)")
    return out, peak


def encode_chunk(ser: Any, view: ChunkView, scratch: Scratch, check: str | None) -> float:
    """``ser.encode_into`` on one chunk view; with ``check``, its largest block maximum
    (:func:`~qstrat.serializers.finite.peak_abs`: inf if it saw NaN/inf), else 0.0."""
    _, x, sub_ctx, dsts = view
    amax = ser.encode_into(x, sub_ctx, dsts, scratch)
    return 0.0 if check is None else peak_abs(amax)
