"""An FSDP2 trainer exporting its weights in the engine's format, streamed (CPU, gloo; or CUDA, nccl).

    torchrun --nproc-per-node 2 examples/trainers/fsdp2_refit.py [OUT.safetensors]

Every rank shards the tiny Qwen3-MoE with ``fully_shard``, plans from the parameters' global
shapes (no values read), then streams ``state_dict()``: each DTensor is gathered when its turn in
the wire order comes (a collective: every rank iterates the same plan), quantized, and yielded.
Rank 0 keeps the outputs (and saves them to OUT.safetensors); on a real deployment it would send each
tensor to the engine. Every rank must drain the iterator: the gathers are collectives.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from qstrat import RefitDriver, tensor_specs
from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank = dist.get_rank()
mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (dist.get_world_size(),))
model = build_tiny_qwen3_moe(seed=1)
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)

driver = RefitDriver("block-fp8", hf_config=hf_config(model))
state = model.state_dict()                       # DTensors: each rank holds a shard
plan = driver.plan(tensor_specs(state))          # names, global shapes, dtypes only
kept = {}
for name, tensor in driver.run(iter(state.items()), plan=plan):
    if rank == 0:                                # send `tensor` to the engine here
        kept[name] = tensor.contiguous().cpu().clone()
if rank == 0:
    mib = sum(t.numel() * t.element_size() for t in kept.values()) / 2**20
    print(f"rank 0: {len(kept)} tensors, {mib:.1f} MiB, wire order {plan.order}")
    if len(sys.argv) > 1:
        from safetensors.torch import save_file
        save_file(kept, sys.argv[1])
dist.destroy_process_group()
