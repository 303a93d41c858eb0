"""Fidelity: does the engine serve, numerically, what a refit sent (docs/fidelity.md).

- :mod:`.probe`: :func:`probe`, :class:`Verify`: the engine against the trainer's expectation
- :mod:`.limits`: the probe's limits, derived per model from a floor it measures
- :mod:`.metrics`: the probe's numbers as the per-step metrics a trainer logs
"""
