"""Planning a refit: every decision, made from names, shapes and dtypes before any value is read.

A :class:`RefitPlan` is made by :meth:`qstrat.RefitDriver.plan`.

- :mod:`.data`: :class:`RefitPlan`, :class:`PlanEntry`, :class:`OutputTensor`, wire order
- :mod:`.planner`: each input's entry, then the whole-plan checks in order
- :mod:`.outputs`: the checkpoint tensors each input emits, fused-group keys
- :mod:`.fallbacks`: whole modules kept BF16 (``on_unsupported: bf16``, fusions vLLM cannot load)
- :mod:`.engine_config`: the plan's one engine ``quantization_config``
- :mod:`.families`: entries of a family of names (one tensor in every layer) derived from one
- :mod:`.checks`: whole-plan checks: fused groups, experts, ranks, the ignore list
- :mod:`.structure`: weights the layout cannot place, configs that quantize nothing
- :mod:`.fixes`: what a plan error tells the user to write, one line per cause
- :mod:`.trainer_decisions`: ``qstrat.select``: the plan's decisions per module, for the trainer
- :mod:`.cluster`: a refit at cluster scale, projected: the mesh routing rule and the broadcast
- :mod:`.cluster_layout`: the two sides at cluster scale as the command line writes them
- :mod:`.cluster_report`: what ``qstrat plan --engine-layout`` and ``qstrat bench --only cluster``
  print
- :mod:`.engine_shards`: the part of each tensor a vLLM engine rank loads
"""
from qstrat.plan.data import PASSTHROUGH, OutputTensor, PlanEntry, RefitPlan, natural_key

__all__ = ["PASSTHROUGH", "OutputTensor", "PlanEntry", "RefitPlan", "natural_key"]
