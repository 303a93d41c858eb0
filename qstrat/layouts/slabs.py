"""Grouped expert slabs: how a slab splits into per-expert projections, and when it must stay whole.

A layout's :attr:`~qstrat.layouts.model_layout.ModelLayout.slabs` maps slab names to :class:`SlabSpec`;
:func:`whole_slab_reason` is the default of :meth:`ModelLayout.whole_slab_reason` (the slab
policy: a slab that cannot be cut into per-expert ``[rows, K]`` matrices is neither quantized nor
split over expert-parallel ranks).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Shape", "SlabSpec", "whole_slab_reason"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class SlabSpec:
    """A grouped expert slab ``[E, rows, K]`` and how it splits into per-expert projections.

    ``parts`` are the per-expert projection names stacked along dim 1 in order (``rows`` split:
    gate rows first, then up, as transformers v5 ``Qwen3MoeExperts.gate_up_proj`` holds them;
    see docs/concepts.md).

    ``transposed_interleaved``: the slab is ``[E, K, 2*N]`` with gate and up interleaved along
    the last dim (gpt-oss: transformers ``GptOssExperts.gate_up_proj`` [E, H, 2I], gate =
    ``[..., ::2]``, up = ``[..., 1::2]``). It cannot be cut into per-expert ``[N, K]`` rows, and
    vLLM's ``GptOssForCausalLM`` loads such experts only unquantized (slab name ``gate_up_proj``)
    or as its own MXFP4 ``*_blocks``/``*_scales``: qstrat sends it whole, unchanged, and refuses
    to quantize it (:class:`~qstrat.errors.PlanError`).

    ``biases``: the slab has a ``{slab}_bias`` [E, parts * rows] beside it (gpt-oss).
    """

    parts: tuple[str, ...]
    transposed_interleaved: bool = False
    biases: bool = False

    @property
    def splittable(self) -> bool:
        """Whether the slab can be cut into per-expert ``[rows, K]`` matrices (and quantized)."""
        return not self.transposed_interleaved

    def shape(self, experts: int, rows: int, k: int) -> Shape:
        """The slab's shape for ``experts`` experts whose parts are each ``[rows, k]`` matrices
        (out_features, in_features): ``[E, parts * rows, k]``, transposed ``[E, k, parts * rows]``."""
        n = len(self.parts) * rows
        return (experts, k, n) if self.transposed_interleaved else (experts, n, k)


def whole_slab_reason(layout_name: str, slabs: Mapping[str, SlabSpec], projection: str | None,
                      shape: Shape) -> str | None:
    """Why the grouped expert slab ``projection`` (of ``shape``) of layout ``layout_name`` cannot
    be cut into per-expert matrices; None when it can (:attr:`SlabSpec.splittable`) or
    ``projection`` is no slab in ``slabs``."""
    spec = slabs.get(projection) if projection is not None else None
    if spec is None or spec.splittable:
        return None
    interleaved = ", ".join(f"{slab}: {'/'.join(x.removesuffix('_proj') for x in s.parts)} interleaved "
                            "along the last dim" for slab, s in slabs.items() if len(s.parts) > 1)
    return (f"{layout_name} stores its experts as transposed {shape} slabs [E, in, out]"
            + (f" ({interleaved})" if interleaved else ""))
