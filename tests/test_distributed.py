"""Sharded trainers on CPU with torch.distributed (gloo, 2 processes): FSDP2 ``fully_shard``
DTensors, tensor-parallel DTensors and expert-parallel ranks give the single-process bytes."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from test_driver_run import u8

from qstrat import RefitDriver, tensor_specs

WORLD = 2
PRESET = "block-fp8"  # 128x128 tiles: FSDP2 row shards of 64 rows cut through them
TIMEOUT_S = 240


def _save(path, pairs):
    save_file({n: t.contiguous().clone() for n, t in pairs}, str(path))
    path.with_suffix(".json").write_text(json.dumps([n for n, _ in pairs]))


def _worker(rank, init_file, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.sharding import ExpertParallel, gather_specs, split_plan

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        model = build_tiny_qwen3_moe(seed=1)
        driver = RefitDriver(PRESET, hf_config=hf_config(model))
        full = {n: t.clone() for n, t in model.state_dict().items()}

        # expert parallel: rank r holds experts [4r, 4r + 4) as a local slab under local names
        ep = ExpertParallel(size=WORLD, num_experts=8)
        mine = ep.experts(rank)
        local = {n: (t[mine.start:mine.stop] if ".experts." in n else t) for n, t in full.items()}
        held = list(ep.global_tensors(rank, local, driver.layout))
        plans = split_plan(driver.plan(gather_specs(held)), ep.owner, WORLD)
        _save(out_dir / f"ep{rank}.safetensors", list(driver.run(iter(held), plan=plans[rank])))
        # expert parallel with the dense weights FSDP2-sharded (DTensors, Shard(0)): rank 0 emits them,
        # rank 1 must still join each gather (a stream, then a mapping: read in its order)
        mixed = [(n, t if ".experts." in n else distribute_tensor(t, mesh, [Shard(0)])) for n, t in held]
        _save(out_dir / f"epfsdp{rank}.safetensors", list(driver.run(iter(mixed), plan=plans[rank])))
        _save(out_dir / f"epfsdpmap{rank}.safetensors", list(driver.run(dict(mixed), plan=plans[rank])))
        # the attacker's cases, each refused on BOTH ranks with the same reason (not wrong bytes, not a hang):
        # rank 1 passes two same-shape DTensors in swapped order; one dense DTensor arrives as float32
        a, b = (next(i for i, (n, _) in enumerate(mixed) if n == f"model.layers.{k}.self_attn.q_proj.weight")
                for k in (0, 1))
        swapped = list(mixed)
        if rank == 1:
            swapped[a], swapped[b] = swapped[b], swapped[a]
        retyped = [(n, distribute_tensor(full[n].float(), mesh, [Shard(0)]) if n.endswith("o_proj.weight") else t)
                   for n, t in mixed]
        for kind, inputs in (("order", swapped), ("dtype", retyped)):
            try:
                list(driver.run(iter(inputs), plan=plans[rank]))
                outcome = "no error"
            except Exception as exc:  # noqa: BLE001 - the test compares the two ranks' errors
                outcome = f"{type(exc).__name__}: {exc}"
            (out_dir / f"{kind}{rank}.txt").write_text(outcome)

        # tensor parallel DTensors: a row-parallel o_proj (Shard(1)), a slab sharded along K
        tp = {"model.layers.1.self_attn.o_proj.weight": [Shard(1)], "model.layers.1.mlp.experts.down_proj": [Shard(2)]}
        dts = {n: distribute_tensor(full[n], mesh, p) for n, p in tp.items()}
        _save(out_dir / f"tp{rank}.safetensors", list(driver.run(dts)))

        # FSDP2: every decoder layer and the root sharded along dim 0, streamed from a generator
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sd = model.state_dict()
        assert all(type(t).__name__ == "DTensor" for t in sd.values())
        plan = driver.plan(tensor_specs(sd))
        _save(out_dir / f"fsdp{rank}.safetensors", list(driver.run(iter(sd.items()), plan=plan)))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path):
    ctx = mp.start_processes(_worker, args=(str(tmp_path / "rendezvous"), tmp_path), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed workers did not finish within {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(10)


def _load(path):
    tensors = load_file(str(path))
    return [(n, tensors[n]) for n in json.loads(path.with_suffix(".json").read_text())]


def test_sharded_inputs_give_the_single_process_bytes(tiny_model, tiny_hf_config, tmp_path):
    _spawn(tmp_path)
    single = list(RefitDriver(PRESET, hf_config=tiny_hf_config).run(tiny_model.state_dict()))
    by_name = dict(single)
    order = [n for n, _ in single]

    def check(pairs):
        for n, t in pairs:
            assert t.dtype == by_name[n].dtype and torch.equal(u8(t), u8(by_name[n].contiguous())), n

    for rank in range(WORLD):  # FSDP2: every rank gathers and emits the whole model, in wire order
        fsdp = _load(tmp_path / f"fsdp{rank}.safetensors")
        assert [n for n, _ in fsdp] == order
        check(fsdp)
        tp = _load(tmp_path / f"tp{rank}.safetensors")
        # o_proj and each of the 8 experts' down_proj: FP8 weight + weight_scale_inv
        assert len(tp) == 2 + 8 * 2 and sum(n.endswith("weight_scale_inv") for n, _ in tp) == 9
        check(tp)
    swapped = [(tmp_path / f"order{rank}.txt").read_text() for rank in range(WORLD)]
    assert swapped[0].startswith("PlanError: model.layers.0.self_attn.q_proj.weight (bfloat16[") and swapped[1].startswith(
        "PlanError: model.layers.1.self_attn.q_proj.weight (bfloat16["), swapped
    assert all("gathers model.layers." in o and "same order" in o for o in swapped), swapped
    dtype = [(tmp_path / f"dtype{rank}.txt").read_text() for rank in range(WORLD)]
    assert dtype[0] == dtype[1] and dtype[0].startswith("InputMismatchError: model.layers.0.self_attn.o_proj.weight"), dtype
    assert "float32" in dtype[0], dtype
    ep = [_load(tmp_path / f"ep{rank}.safetensors") for rank in range(WORLD)]
    for rank in range(WORLD):  # FSDP2 dense weights + expert parallel: each rank's bytes as with plain tensors
        for kind in ("epfsdp", "epfsdpmap"):
            got = _load(tmp_path / f"{kind}{rank}.safetensors")
            assert [n for n, _ in got] == [n for n, _ in ep[rank]], (kind, rank)
            check(got)
    assert sorted(n for pairs in ep for n, _ in pairs) == sorted(order)  # union = single process
    for rank, pairs in enumerate(ep):
        names = [n for n, _ in pairs]
        assert names == [n for n in order if n in set(names)]  # the single wire order, filtered
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}
        assert experts == set(range(4 * rank, 4 * rank + 4))
        assert ("lm_head.weight" in names) == (rank == 0)  # replicated tensors: rank 0 emits
        check(pairs)
