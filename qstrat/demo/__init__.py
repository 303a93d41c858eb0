"""The demo and its tiny model: what ``qstrat demo`` runs (not imported by the core).

:mod:`.run` holds the stages of the demo (:func:`run_demo`), :mod:`.tiny_model` the seeded tiny
Qwen3-MoE built with transformers.
"""
from qstrat.demo.run import DemoReport, run_demo

__all__ = ["DemoReport", "run_demo"]
