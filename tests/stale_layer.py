"""A corrupted TRL weight sync for the fidelity-probe tests of both TRL modes
(tests/test_integration_trl.py, tests/test_integration_trl_server.py): one decoder layer left from
the previous training step, and the check that TRL's logged step holds a probe's numbers."""
from __future__ import annotations

import functools

#: The start of a FidelityError's text (and of a FidelityWarning's) for the block FP8 strategy.
REASON = r"^the engine does not serve what was sent: fidelity block_fp8: mean KL "


class StaleLayer:
    """Replaces TRL's ``VLLMGeneration._iter_named_params``: from its ``from_call``-th call on,
    layer 1's tensors are those the call before yielded - a refit that left one decoder layer from
    the previous training step (the optimizer moved it: learning rate 1e-2). Call 1 writes the
    checkpoint the engine starts on, call 2 is the sync before step 1's generation, call 3 the
    one before step 2's."""

    def __init__(self, original, from_call=3):
        self.original, self.from_call, self.calls, self.previous = original, from_call, 0, {}

    def __get__(self, gen, owner=None):  # a method of the class: bound to each VLLMGeneration
        return self if gen is None else functools.partial(self, gen)

    def __call__(self, gen):
        items = [(n, t.detach().clone()) for n, t in self.original(gen)]
        self.calls += 1
        previous, self.previous = self.previous, dict(items)
        if self.calls >= self.from_call:
            items = [(n, previous[n] if n.startswith("model.layers.1.") else t) for n, t in items]
        yield from items


def assert_logged(h, f):
    """TRL's logged step ``h`` holds the probe report ``f``'s numbers, not just its keys."""
    from qstrat.vllm.fidelity.metrics import fidelity_metrics

    assert fidelity_metrics(f) == {k: h[k] for k in fidelity_metrics(f)}
    assert h["qstrat/fidelity/ok"] == float(f.passed) and h["qstrat/fidelity/ratio"] == f.ratio
