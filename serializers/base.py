"""The serializer contract: one quantization format, from a BF16 weight to checkpoint tensors.

A serializer turns a weight ``[N, K]`` (out_features x in_features) or a grouped expert slab
``[E, N, K]`` into named parts keyed by checkpoint suffix (``"weight"``, ``"weight_scale_inv"``, ...).
It declares those parts (:meth:`Serializer.part_specs`) from the shape alone, so a refit can be
planned - names, shapes, dtypes, bytes - before a single weight is read.

A format is three jobs, each in its own module and class, joined here for a plugin's format:

- the math (:class:`~qstrat.serializers.format_math.FormatMath`, :mod:`qstrat.serializers.format_math`):
  part shapes, quantize, dequantize, the torch paths and a Triton kernel - the trainer's side;
- the engine contract (:class:`~qstrat.serializers.engine_contract.EngineFormat`,
  :mod:`qstrat.serializers.engine_contract`): the ``quantization_config`` a checkpoint carries,
  which engine configs serve the format, which fused modules vLLM can load in it;
- the emulation hooks (:class:`~qstrat.serializers.emulation_hooks.EmulationHooks`,
  :mod:`qstrat.serializers.emulation_hooks`): the CPU emulation of vLLM's kernels and the bench peers.

Subclasses provide ``matrix_parts`` (shapes for one [N, K] matrix), ``reference`` (torch math for a
chunk of experts/rows: the CPU path and the test oracle), ``dequantize`` and, optionally, a Triton
``kernel`` (see :mod:`qstrat.serializers.kernels`) and a ``group_context`` step.

qstrat's lists of formats are read from the registry (plugins' ``qstrat_serializers`` hook
returns :class:`Serializer` subclasses), never written out.
"""
from __future__ import annotations

from typing import ClassVar

from qstrat.serializers.emulation_hooks import EmulationHooks
from qstrat.serializers.engine_contract import EngineFormat, config_difference
from qstrat.serializers.finite import all_finite, check_finite, options_text, peak_abs
from qstrat.serializers.format_math import FormatMath, SerializerOptions
from qstrat.serializers.parts import WEIGHT_DTYPES, Context, PartSpec, check_parts, dtype_name, tensor_nbytes

# re-exported: formats and qstrat import these names from here
__all__ = ["Context", "EmulationHooks", "EngineFormat", "FormatMath", "PartSpec", "Serializer", "SerializerOptions",
           "WEIGHT_DTYPES", "all_finite", "check_finite", "check_parts", "config_difference", "dtype_name",
           "options_text", "peak_abs", "tensor_nbytes"]


class Serializer(FormatMath, EngineFormat, EmulationHooks):
    """A quantization format, as a plugin registers it: its math
    (:class:`~qstrat.serializers.format_math.FormatMath`), its engine contract
    (:class:`~qstrat.serializers.engine_contract.EngineFormat`) and its emulation hooks
    (:class:`~qstrat.serializers.emulation_hooks.EmulationHooks`). Instances are immutable and
    cheap; options are validated by pydantic.

    Class attributes: ``name`` (registry name), ``summary`` (one line for ``qstrat list``),
    ``Options``, ``row_tile``, ``kernel`` (the math's), ``quantizes`` (the engine contract's),
    ``emulation``, ``bench_peers`` (the hooks').
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""
