"""The demo and its tiny model: what ``qstrat demo`` runs (not imported by the core).

- :mod:`.run`: the stages of the demo (:func:`run_demo`)
- :mod:`.tiny_model`: the seeded tiny Qwen3-MoE built with transformers
- :mod:`.trajectory`: a real Adam trajectory for the tiny model (the delta churn study's steps)
"""
from qstrat.cli.demo.run import DemoReport, run_demo

__all__ = ["DemoReport", "run_demo"]
