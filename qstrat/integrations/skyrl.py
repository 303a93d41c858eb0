"""SkyRL's weight sync with qstrat's quantization: a ``WeightSource`` that emits qstrat's checkpoint tensors.

SkyRL 0.4.0's trainer workers build one ``WeightSource`` per sync (vLLM's trainer-side contract,
``vllm.distributed.weight_transfer.base.WeightSource``: ``metadata()`` and iteration, which must
agree element for element) in ``_build_weight_source(dtype, backend)`` - SkyRL's
``FsdpWeightSource`` / ``MegatronWeightSource`` - and hand it to vLLM's trainer weight-transfer
engine; its own FP8 path wraps the dense source in ``SerializedFp8WeightSource(source, config)``.
:class:`QstratWeightSource` takes that place: the inference engines start on a qstrat checkpoint
of the same strategy and receive checkpoint format (``is_checkpoint_format=True``, as SkyRL's FP8
path does). docs/integrations.md has the worker override and what ran where.

Importing this module imports vLLM's weight-transfer base through qstrat's vLLM version table
(vLLM >= 0.26 has it; an older one raises :class:`~qstrat.vllm.adapter.VllmNameError`), not SkyRL.
"""
from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import torch

from qstrat.execute.driver import RefitDriver
from qstrat.execute.named_tensors import tensor_specs
from qstrat.plan import RefitPlan
from qstrat.vllm.adapter.resolver import available, resolve
from qstrat.vllm.adapter.views import source_held_names, source_metadata, source_tensors

WeightSource = resolve("weight_source")
ParamMeta = resolve("weight_source_param_meta")


class QstratWeightSource(WeightSource):
    """A dense ``WeightSource`` quantized by a :class:`~qstrat.execute.driver.RefitDriver` as it streams.

    Args:
        source: the trainer's dense source (SkyRL's ``FsdpWeightSource`` /
            ``MegatronWeightSource``, vLLM's ``ModuleSource``): HF names, BF16 or FP32 tensors,
            the whole model on every rank (``held_names()`` None).
        driver: the strategy of the engines' checkpoint (``qstrat quantize``).
        values: ``"first"`` (default) - every pass gathers ``source`` ONCE, checking and
            quantizing the whole model (:meth:`RefitDriver.run`: NaN/inf, a pass that does not
            match the metadata - short, reordered, another shape) and holding its checkpoint
            tensors, and yields the first tensor only once that pass succeeded: vLLM's layerwise
            reload has no rollback, so an error mid-stream would leave the engines holding a mix
            of two syncs (nothing on the trainer side can flag them). Costs the quantized model's
            bytes held per sync (about half the BF16 model for FP8, a quarter for FP4), not a
            second gather (which could itself differ: a second, short pass half-applied).
            ``"inline"``: checked as it streams, about one layer held.
    Attributes: plan: the :class:`~qstrat.plan.RefitPlan`, made once from ``source.metadata()``
        (shapes and dtypes only: nothing is gathered).
    Raises: PlanError from the constructor when the source's names, shapes or dtypes cannot be
        planned (nothing was sent); ValueError when ``source`` holds only part of the model.
    """

    def __init__(self, source: WeightSource, driver: RefitDriver, values: str = "first") -> None:
        if values not in ("first", "inline"):
            raise ValueError(f"QstratWeightSource: values must be 'first' or 'inline', got {values!r}")
        if source_held_names(source) is not None:
            raise ValueError(f"QstratWeightSource: {type(source).__name__} holds only part of the model on this "
                             "rank (held_names() is not None, or owned by some ranks only on vLLM 0.33+: "
                             "pipeline/expert-parallel sharded sources); qstrat "
                             "quantizes whole layers: use a source whose iteration yields every parameter")
        self.source, self.driver, self.values = source, driver, values
        self.plan: RefitPlan = driver.plan(tensor_specs((m.name, tuple(m.shape), m.dtype)
                                                        for m in source_metadata(source)))

    def _outputs(self) -> list[ParamMeta]:
        """The checkpoint tensors iteration yields, in the same order: name, dtype (FP8 codes
        ``float8_e4m3fn``, packed FP4 ``uint8``, scales, BF16 passthrough) and shape."""
        return [ParamMeta(o.name, getattr(torch, o.dtype), tuple(o.shape)) for o in self.plan.outputs()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One pass (one gather) of ``source``, quantized by :meth:`RefitDriver.run` with
        :attr:`plan`, contiguous tensors: with ``values="first"`` the whole pass is quantized
        before the first tensor is yielded, with ``"inline"`` as it streams (about one layer
        held). Raises what :meth:`RefitDriver.run` raises (NonFiniteError naming a tensor,
        PlanError when the pass does not match its metadata) - before the first tensor with
        ``values="first"``."""
        stream = ((name, t.contiguous()) for name, t in self.driver.run(source_tensors(self.source), plan=self.plan))
        yield from (list(stream) if self.values == "first" else stream)

    # vLLM 0.33 made metadata a cached property (checked when the class is made) and iteration
    # iter_full(); before, metadata() was a method and iteration __iter__ (version table:
    # weight_source_iter_full). iter_local (a rank's piece) is not offered: qstrat quantizes whole layers.
    if available("weight_source_iter_full"):
        metadata = cached_property(_outputs)
        iter_full = __iter__
    else:
        metadata = _outputs
