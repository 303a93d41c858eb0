"""qstrat.engine.weight_digests without an engine: a weight packed into a CPU kernel (vLLM's
``cpu_linear``, the ``weight`` parameter left empty) is read back exactly, and digests tell
dtype, shape and bytes apart. The live check: tests/test_engine_http.py."""
from __future__ import annotations

import torch

from qstrat.engine.weight_digests import packed_weight, tensor_digest, tensor_digests


class PackedLinear(torch.nn.Module):
    """What vLLM's CPU dispatch leaves: an empty ``weight``, the real one inside ``cpu_linear``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.input_size = weight.shape[1]
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        self.cpu_linear = lambda x, _w, bias: torch.nn.functional.linear(x, weight, bias)


def test_a_packed_weight_is_read_back_exactly_and_counted_in_the_digests(monkeypatch):
    import qstrat.engine.weight_digests as wd

    monkeypatch.setattr(wd, "_PROBE_ROWS", 3)  # several identity blocks (K = 7)
    weight = torch.randn(5, 7, dtype=torch.float32).to(torch.bfloat16)
    gate = PackedLinear(weight)
    assert torch.equal(packed_weight(gate), weight) and packed_weight(gate).dtype == torch.bfloat16
    assert packed_weight(torch.nn.Linear(7, 5)) is None  # an ordinary parameter: digested as itself
    model = torch.nn.ModuleDict({"gate": gate, "proj": torch.nn.Linear(7, 5)})
    model.register_buffer("scale", torch.ones(3))
    digests = tensor_digests(model)
    assert digests.keys() == {"gate.weight", "proj.weight", "proj.bias", "scale"}
    assert digests["gate.weight"] == tensor_digest(weight) != tensor_digest(torch.empty(0, dtype=torch.bfloat16))
    other = weight.clone()
    other[4, 6] += 1
    assert tensor_digests(torch.nn.ModuleDict({"gate": PackedLinear(other)}))["gate.weight"] != digests["gate.weight"]


def test_digests_tell_dtype_shape_and_bytes_apart():
    t = torch.arange(6, dtype=torch.int16)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert len({tensor_digest(t), tensor_digest(t.view(2, 3)), tensor_digest(t.view(torch.bfloat16)),
                tensor_digest(t.flip(0))}) == 4
    assert tensor_digest(t.view(2, 3).t()) == tensor_digest(t.view(2, 3).t().contiguous())
