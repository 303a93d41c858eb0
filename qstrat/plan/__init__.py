"""Planning a refit: the plan's data (:mod:`.data`), the planner (:mod:`.planner`) and the
whole-plan checks (:mod:`.checks`).

A :class:`RefitPlan` is made by :meth:`qstrat.RefitDriver.plan` before any value is read.
"""
from qstrat.plan.data import PASSTHROUGH, OutputTensor, PlanEntry, RefitPlan, natural_key

__all__ = ["PASSTHROUGH", "OutputTensor", "PlanEntry", "RefitPlan", "natural_key"]
