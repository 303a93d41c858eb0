"""Fidelity: does the engine serve, numerically, what a refit sent (docs/fidelity.md).

- :mod:`.probe`: :func:`probe`, :class:`Verify`: the engine against the trainer's expectation
- :mod:`.limits`: the probe's limits, derived per model from a floor it measures
- :mod:`.metrics`: the probe's numbers as the per-step metrics a trainer logs
- :mod:`.verdict`: what a failed verdict does in a training loop (raise or warn); the per-step probe of a loop
- :mod:`.served`: the probe's engine side over HTTP (a vLLM server in another process)
"""
