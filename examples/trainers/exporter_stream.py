"""An exporter that yields ``(hf_name, tensor)`` pairs one by one, refit in the producer's order.

    python examples/trainers/exporter_stream.py

The shape of a Megatron-style exporter (or NeMo-RL's collective sender, which sends no names: the
order IS the wire order). The plan is made first from ``(name, shape, dtype)`` triples, so both
sides of a nameless transfer can derive the same order from metadata; the stream is consumed
once, holding about one layer.
"""
import torch

from qstrat import RefitDriver, tensor_specs
from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config

model = build_tiny_qwen3_moe(seed=1)


def export():
    """Per-expert HF names, one tensor at a time (a real exporter converts Megatron shards here)."""
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield name.replace("gate_up_proj", f"{e}.gate_proj.weight"), t[e, :half].clone()
                yield name.replace("gate_up_proj", f"{e}.up_proj.weight"), t[e, half:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                yield name.replace("down_proj", f"{e}.down_proj.weight"), t[e].clone()
        else:
            yield name, t


specs = [(n, tuple(t.shape), t.dtype) for n, t in export()]   # or from the model config alone
driver = RefitDriver({"preset": "mxfp8-experts", "wire_order": "producer"}, hf_config=hf_config(model))
plan = driver.plan(tensor_specs(specs))
sent = [(name, tuple(t.shape), str(t.dtype)) for name, t in driver.run(export(), plan=plan)]
assert [n for n, _, _ in sent] == [o.name for o in plan.outputs()]   # what the receiver derives
print(f"{len(sent)} tensors in producer order; first: {sent[0]}, last: {sent[-1]}")
