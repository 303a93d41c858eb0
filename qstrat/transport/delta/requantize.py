"""Incremental re-quantization on a delta round's sender: re-encode only what the step changed.

A delta round needs the round's quantized stream before it can compare it with its base, and
quantizing the whole model costs the sender more than everything else in the round
(docs/transport.md, "Incremental re-quantization"). :class:`Requantizer` keeps, per quantized
plan entry (a weight, a grouped slab or an expert batch), the previous input (a copy, in the
input's dtype and on its device), the parts it quantized to and the max|x| of each scale block,
and quantizes the next step's input from them, bit for bit what a full
:meth:`~qstrat.serializers.base.Serializer.quantize` gives:

1. the changed elements: the input's bits compared with the previous input's
   (:func:`changed_elements`);
2. each touched block's new amax: ``max(old amax, |changed values|)``, or the block's elements
   read again when an element that equalled the old amax shrank;
3. its scale from the format's own :meth:`~qstrat.serializers.format_math.FormatMath.block_scales`
   (with NVFP4's global scale from the tensor's, or its fused group's, amax: when that moves,
   the whole tensor is quantized again - the format re-rounds every block scale against it);
4. codes from the format's own :meth:`~qstrat.serializers.format_math.FormatMath.codes`: every
   element of a block whose scale bits changed, else only the changed elements (NVFP4: both
   nibbles of a touched byte).

A code depends only on its element and its block's scale(s), so what is not re-encoded is
already right. Whole quantizes (which refill the entry): the first call, another shape, dtype,
device or format, a format without :attr:`~qstrat.serializers.format_math.FormatMath.scale_block`
(a plugin's), more than :attr:`Requantizer.max_fraction` of the elements changed, a non-finite
changed value or group amax (the full quantize raises its error, or keeps its NaN/inf
semantics under ``nonfinite="propagate"``: a weight holding NaN/inf keeps no entry), block
maxima above the format's ``decode_check_above``, a moved global scale, or a re-encoded block
scale that is NaN/inf or E8M0's 0xFF under ``nonfinite="error"`` (a plugin's format: the full
quantize then refuses it with its own message). Any exception drops the entry.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch

from qstrat.serializers.base import Serializer
from qstrat.serializers.finite import scale_values_ok
from qstrat.transport.delta.encoding import bits_view, changed_elements, changed_values
from qstrat.transport.delta.written import WriteLog, version_of

__all__ = ["Requantizer", "block_maxima", "changed_elements"]

#: Elements whose block maxima are recomputed per pass (bounds the gathered scratch).
_GATHER = 1 << 20


@dataclass
class _Entry:
    """One entry's state: the serializer, the previous input [E, N, K] (contiguous, own copy),
    its parts ([E, ...], returned to the caller and updated in place), the float32 max|x| per
    scale block [E, NB, KB], and the group context's amax [E] (None: no group step)."""

    ser: Serializer
    prev: torch.Tensor
    parts: dict[str, torch.Tensor]
    amax: torch.Tensor
    group_amax: torch.Tensor | None


class Requantizer:
    """The sender's incremental quantizer (module docstring): :meth:`quantize` has the contract
    of :meth:`Serializer.quantize`, plus a key naming the entry across rounds.

    Args:
        max_fraction: above this fraction of changed elements an entry is quantized whole (the
            gathers cost more than the full pass there); 0: whole whenever anything changed.

    Raises: ValueError for a ``max_fraction`` outside [0, 1] (or not a number).

    Memory: per incrementally quantized parameter its previous input (2 bytes for bf16), its
    quantized parts (about a byte) and a float32 amax per block (block FP8 negligible, MXFP8
    1/8 byte, NVFP4 1/4 byte), on the input's device, for as long as the sender keeps it.
    """

    def __init__(self, max_fraction: float = 0.125) -> None:
        self.max_fraction = _fraction(max_fraction)
        self._entries: dict[Any, _Entry] = {}
        #: The bytes of the entries' parts written by each incremental call
        #: (:mod:`qstrat.transport.delta.written`: a delta round's stream copies and compares only those).
        self.written = WriteLog()
        #: Counts since :meth:`take_stats`: ``elements``, ``changed``, ``blocks_touched``,
        #: ``blocks_rescaled``, ``encoded`` (codes re-encoded), ``incremental`` (calls), and
        #: ``whole:<why>`` per whole quantize.
        self.stats: Counter[str] = Counter()

    def clear(self) -> None:
        """Forget every entry (the next call of each quantizes whole)."""
        self._entries.clear()
        self.written.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold (previous inputs, parts, block maxima)."""
        return sum(t.numel() * t.element_size() for e in self._entries.values()
                   for t in (e.prev, e.amax, *e.parts.values()))

    def take_stats(self) -> dict[str, int]:
        """The counts since the last call (then reset)."""
        out, self.stats = dict(self.stats), Counter()
        return out

    def quantize(self, ser: Serializer, key: Any, w: torch.Tensor, *, name: str = "weight",
                 context: Mapping[str, torch.Tensor] | None = None, values_checked: bool = False
                 ) -> dict[str, torch.Tensor]:
        """``ser.quantize(w, name=..., context=..., values_checked=...)``'s parts (the same bytes),
        re-encoding only what changed since this ``key``'s last call. The returned parts are the
        entry's own tensors: read them before the next call with ``key`` (which updates them in
        place). Raises: as :meth:`Serializer.quantize` (the entry is then dropped)."""
        entry = self._entries.pop(key, None)
        w3 = w.detach() if w.dim() == 3 else w.detach().unsqueeze(0)
        self.stats["elements"] += w3.numel()
        why = _unusable(entry, ser, w3, context)
        if why is None:
            try:
                parts = self._step(entry, w3, name, context, values_checked)
            except BaseException:
                self.written.drop(entry.parts.values())
                raise
            if isinstance(parts, str):
                why = parts
            else:
                out = parts if w.dim() == 3 else {k: v.squeeze(0) for k, v in parts.items()}
                self._entries[key] = entry
                self.stats["incremental"] += 1
                return out
        self.stats[f"whole:{why}"] += 1
        self.written.drop(entry.parts.values() if entry is not None else ())
        parts = ser.quantize(w, name=name, context=context, values_checked=values_checked)
        if ser.scale_block is not None and w3.dtype in _BITS:
            parts3 = parts if w.dim() == 3 else {k: v.unsqueeze(0) for k, v in parts.items()}
            entry = _fill(ser, w3, parts3, context)
            if _finite(entry):  # NaN/inf kept (nonfinite="propagate"): whole every time
                self._entries[key] = entry
                self.written.add(list(entry.parts.values()))
        return parts

    def _step(self, entry: _Entry, w3: torch.Tensor, name: str, context: Mapping[str, torch.Tensor] | None,
              values_checked: bool) -> dict[str, torch.Tensor] | str:
        """Update ``entry`` to ``w3``; returns its parts, or why it must be quantized whole
        (``entry`` is then stale: the caller drops it)."""
        ser, prev, amax = entry.ser, entry.prev, entry.amax
        new = w3 if w3.is_contiguous() else w3.contiguous()
        idx, new_bits, old_bits = changed_values(new, prev, update=True)  # prev is new from here on
        m = idx.numel()
        self.stats["changed"] += m
        if m > self.max_fraction * new.numel():
            return "dense change"
        if m == 0:
            group = _group_amax(ser, amax, context)
            return entry.parts if _same(group, entry.group_amax) else "global scale moved"
        flat_new = new.view(-1)
        values = new_bits.view(new.dtype).float()
        if not bool(torch.isfinite(values).all()):  # the full path's error, or its NaN/inf semantics
            return "non-finite"
        grid = _Grid(ser, new.shape)
        blk = grid.block_of(idx)
        if grid.br == 1:  # blocks along rows: sorted elements give sorted blocks
            touched, where = torch.unique_consecutive(blk, return_inverse=True)
        else:  # few large blocks (128 x 128): count per block, no sort
            hit = torch.bincount(blk, minlength=grid.e * grid.per_matrix) > 0
            touched = torch.nonzero(hit).reshape(-1)
            where = (torch.cumsum(hit, 0) - 1).index_select(0, blk)
        old_amax = amax.view(-1).index_select(0, touched)
        mag = values.abs()
        new_amax = torch.zeros_like(old_amax).scatter_reduce_(0, where, mag, "amax")
        torch.maximum(new_amax, old_amax, out=new_amax)
        old_mag = old_bits.view(new.dtype).float().abs_()
        lost = (old_mag == old_amax.index_select(0, where)) & (mag < old_mag)
        if bool(lost.any()):
            again = torch.unique(where[lost])
            new_amax[again] = grid.maxima(new, touched[again])
        amax.view(-1).index_copy_(0, touched, new_amax)
        if bool(new_amax.max() > ser.decode_check_above):
            return "near float32's max"
        group = _group_amax(ser, amax, context)
        if not _same(group, entry.group_amax):
            return "global scale moved" if bool(torch.isfinite(group).all()) else "non-finite"
        ctx = None if group is None else {"amax": group[touched // grid.per_matrix]}
        scale, multiplier = ser.block_scales(new_amax, ctx)
        scales = bits_view(entry.parts[ser.scale_part].view(-1))
        scale = scale.to(entry.parts[ser.scale_part].dtype)
        # only these scales are new (the others passed a check when emitted): a plugin's NaN/inf
        # scale goes the whole way, whose quantize refuses it with its own message
        if ser.options.nonfinite == "error" and not scale_values_ok(ser, ser.scale_part, scale):
            return "non-finite scale"
        scale = bits_view(scale)
        rescaled = scale != scales.index_select(0, touched)
        n_rescaled = int(rescaled.sum())
        if n_rescaled:
            _write_scales(self.written, entry.parts[ser.scale_part], scales, touched, scale)
        if n_rescaled:  # every element of those blocks, and the other blocks' changed ones
            keep = ~rescaled[where]
            elements = torch.cat([idx[keep], grid.elements(touched[rescaled])])
            if ser.codes_per_byte == 2:
                first = torch.unique(elements // 2) * 2
                elements = torch.stack([first, first + 1], 1).reshape(-1)
            mult = multiplier[torch.searchsorted(touched, grid.block_of(elements))]
            x = flat_new.index_select(0, elements).float()
        elif ser.codes_per_byte == 2:  # both codes of each touched byte (one block: 16 | K)
            first = torch.bitwise_and(idx, -2)
            lead = torch.ones_like(first, dtype=torch.bool)
            lead[1:] = first[1:] != first[:-1]
            leads = torch.nonzero(lead).reshape(-1)  # no boolean-mask indexing (slower)
            first, pair_where = first.index_select(0, leads), where.index_select(0, leads)
            elements = torch.stack([first, first + 1], 1).reshape(-1)
            mult = multiplier.index_select(0, pair_where).repeat_interleave(2)
            x = flat_new.index_select(0, elements).float()
        else:
            elements, mult, x = idx, multiplier.index_select(0, where), values
        _write_codes(self.written, ser, entry.parts["weight"], elements, ser.codes(x, mult), sort=bool(n_rescaled))
        self.stats["blocks_touched"] += touched.numel()
        self.stats["blocks_rescaled"] += n_rescaled
        self.stats["encoded"] += elements.numel()
        return entry.parts


def _write_scales(log: WriteLog, part: torch.Tensor, scales: torch.Tensor, touched: torch.Tensor,
                  scale: torch.Tensor) -> None:
    """Write the touched blocks' scales (``scale``, bits) into ``scales`` (a flat bits view of
    ``part``) and log every touched scale's bytes (the unchanged ones are written equal)."""
    before = version_of(scales)
    scales[touched] = scale
    size = scales.element_size()
    log.record(part, before, (touched.unsqueeze(1) * size + torch.arange(size)).reshape(-1) if size > 1 else touched)


def _write_codes(log: WriteLog, ser: Serializer, weight: torch.Tensor, elements: torch.Tensor, codes: torch.Tensor,
                 sort: bool) -> None:
    """Write the codes of flat ``elements`` into the ``weight`` part (NVFP4: two per byte, each
    pair of elements one byte's) and log the bytes written: only those whose code changed - most
    re-encoded codes come out as they were (a step moves few values across a code boundary),
    and the stream copies and compares each logged byte (:mod:`qstrat.transport.delta.written`).
    ``sort``: ``elements`` may be unsorted or repeat (rescaled blocks' elements added, ragged
    edges); the log wants sorted unique bytes. ``scatter_``, not index assignment (3x faster
    here); an index repeated by a ragged edge block is the same element with the same code."""
    flat = weight.view(-1)
    if ser.codes_per_byte == 2:
        at, new, dst = elements[0::2] >> 1, (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8), flat
    else:
        at, new, dst = elements, codes.view(torch.uint8), flat.view(torch.uint8)
    differ = new != dst.gather(0, at)
    at, new = at[differ], new[differ]
    before = version_of(dst)
    dst.scatter_(0, at, new)
    log.record(weight, before, torch.unique(at) if sort else at)


def _fraction(value: Any) -> float:
    """``Requantizer(max_fraction=value)`` checked: a number in [0, 1]. Raises: ValueError."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value <= 1:
        raise ValueError(f"Requantizer: max_fraction must be a number in [0, 1] (a fraction of each entry's "
                         f"elements), got {value!r}")
    return float(value)


#: Input dtypes the comparison reads as integers of the same width.
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


class _Grid:
    """Flat element index <-> scale block of an [E, N, K] weight under ``ser.scale_block``."""

    def __init__(self, ser: Serializer, shape: torch.Size) -> None:
        self.e, self.n, self.k = shape
        self.br, self.bc = ser.scale_block
        self.nb, self.kb = -(-self.n // self.br), -(-self.k // self.bc)
        self.per_matrix = self.nb * self.kb

    def block_of(self, idx: torch.Tensor) -> torch.Tensor:
        """Flat block index ([E, NB, KB] order) of each flat element index."""
        if self.br == 1 and self.k % self.bc == 0:  # 1 x bc blocks tile each row: flat order
            return _div(idx, self.bc)
        rows = _div(idx, self.k)
        col = idx - rows * self.k
        e = _div(rows, self.n)
        return e * self.per_matrix + _div(rows - e * self.n, self.br) * self.kb + _div(col, self.bc)

    def elements(self, blocks: torch.Tensor) -> torch.Tensor:
        """Flat element indices of every element of ``blocks`` ([len, br * bc] flattened; a
        ragged edge block repeats its last row/column: the same element twice)."""
        e, rest = blocks // self.per_matrix, blocks % self.per_matrix
        rows = ((rest // self.kb) * self.br).unsqueeze(1) + torch.arange(self.br, device=blocks.device)
        cols = ((rest % self.kb) * self.bc).unsqueeze(1) + torch.arange(self.bc, device=blocks.device)
        rows, cols = rows.clamp(max=self.n - 1), cols.clamp(max=self.k - 1)
        flat = (e * self.n).view(-1, 1, 1) + rows.unsqueeze(2)
        return (flat * self.k + cols.unsqueeze(1)).reshape(-1)

    def maxima(self, w: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """float32 max|x| of each of ``blocks`` of ``w`` (read again, a bounded number at once)."""
        step = max(1, _GATHER // (self.br * self.bc))
        flat = w.view(-1)
        return torch.cat([flat[self.elements(blocks[i:i + step])].float().abs().view(-1, self.br * self.bc).amax(1)
                          for i in range(0, blocks.numel(), step)])


def _div(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t // d`` for non-negative int64 ``t``: a shift when ``d`` is a power of two (int64
    division is the slow step of :meth:`_Grid.block_of`; block sizes and most sizes are)."""
    shift = d.bit_length() - 1
    return t >> shift if 1 << shift == d else t // d


def block_maxima(ser: Serializer, w3: torch.Tensor) -> torch.Tensor:
    """float32 max|x| per scale block of ``w3`` ([E, N, K]) -> [E, NB, KB] (zero padding at
    ragged edges: |x| >= 0, so the same maxima), one matrix at a time."""
    br, bc = ser.scale_block
    _, n, k = w3.shape
    pad = (0, -k % bc, 0, -n % br)
    return torch.stack([torch.nn.functional.pad(m.float().abs(), pad).view(-(-n // br), br, -(-k // bc), bc)
                        .amax(dim=(1, 3)) for m in w3.unbind(0)])


def _group_amax(ser: Serializer, amax: torch.Tensor, context: Mapping[str, torch.Tensor] | None
                ) -> torch.Tensor | None:
    """The group context's amax per matrix (float32 [E]): ``context``'s, or the weight's own from
    its block maxima (a format with a group step quantizing a lone weight); None: no group step."""
    if context is None:
        context = ser.context_of_block_maxima(amax)
    if context is None:
        return None
    # a copy: a caller's context buffer updated in place must not rewrite the kept amax
    return context["amax"].detach().to(torch.float32).reshape(-1).clone()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two group amaxes (float32 [E] or None) are the same bits."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _unusable(entry: _Entry | None, ser: Serializer, w3: torch.Tensor, context: Mapping[str, torch.Tensor] | None
              ) -> str | None:
    """Why ``w3`` cannot be quantized from ``entry`` (None: it can)."""
    if ser.scale_block is None:
        return "format without scale blocks"
    if w3.dtype not in _BITS:
        return "input dtype"
    if entry is None:
        return "first round"
    if (entry.ser is not ser and repr(entry.ser) != repr(ser)) or type(entry.ser) is not type(ser):
        return "another format"
    if entry.prev.shape != w3.shape or entry.prev.dtype != w3.dtype or entry.prev.device != w3.device:
        return "another shape or dtype"
    return None


def _finite(entry: _Entry) -> bool:
    """Whether every block maximum and the group amax of ``entry`` are finite."""
    group = entry.group_amax
    return bool(torch.isfinite(entry.amax).all()) and (group is None or bool(torch.isfinite(group).all()))


def _fill(ser: Serializer, w3: torch.Tensor, parts: dict[str, torch.Tensor],
          context: Mapping[str, torch.Tensor] | None) -> _Entry:
    """A new entry from a whole quantize of ``w3`` (a copy of it, and of its block maxima)."""
    prev = w3.clone(memory_format=torch.contiguous_format)
    amax = block_maxima(ser, prev)
    group = _group_amax(ser, amax, context)
    return _Entry(ser, prev, {k: v if v.is_contiguous() else v.contiguous() for k, v in parts.items()}, amax, group)
