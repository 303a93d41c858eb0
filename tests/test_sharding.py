"""qstrat.execute.sharding: expert parallelism in one process (which rank holds and emits which expert,
global names from local ones, one plan per rank). Two real ranks: tests/test_distributed.py."""
from __future__ import annotations

import pytest
import torch
from test_driver_run import u8

from qstrat import PlanError, RefitDriver, tensor_specs
from qstrat.execute.sharding import ExpertParallel, split_plan


def test_expert_parallel_ranks_union_is_the_single_process_run(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    driver = RefitDriver("mxfp8-experts", hf_config=tiny_hf_config)
    single = list(driver.run(state))
    ep = ExpertParallel(size=4, num_experts=8)
    ranks = []
    for r in range(4):  # what rank r holds: its local experts [2r, 2r + 2) under local names
        local = {n: (t[ep.experts(r).start:ep.experts(r).stop] if ".experts." in n else t) for n, t in state.items()}
        ranks.append(list(ep.global_tensors(r, local, driver.layout)))
    specs = {}
    for held in ranks:
        specs.update(tensor_specs(held))
    plans = split_plan(driver.plan(specs), ep.owner, 4)
    assert sorted(o.name for p in plans for o in p.outputs()) == sorted(n for n, _ in single)
    assert {o.name.split(".experts.")[1].split(".")[0] for o in plans[3].outputs()} == {"6", "7"}
    emitted = [list(driver.run(iter(held), plan=p)) for held, p in zip(ranks, plans)]
    by_name = dict(single)
    order = [n for n, _ in single]
    for r, out in enumerate(emitted):
        names = [n for n, _ in out]
        assert names == [n for n in order if n in set(names)]  # the single wire order, filtered
        for n, t in out:
            assert torch.equal(u8(t), u8(by_name[n])), n
    assert sum(len(o) for o in emitted) == len(single)
    with pytest.raises(PlanError, match="grouped slab holds every expert"):
        split_plan(driver.plan(state), ep.owner, 4)
    with pytest.raises(PlanError, match="do not split evenly"):
        ExpertParallel(size=3, num_experts=8)


def test_each_rank_holds_a_contiguous_range_of_experts():
    ep = ExpertParallel(size=4, num_experts=8)
    assert ep.local_experts == 2
    assert [ep.experts(r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    for size, experts in ((0, 8), (-1, 8), (2, 0), (16, 8)):
        with pytest.raises(PlanError, match=f"{experts} experts do not split evenly over {size} ranks"):
            ExpertParallel(size=size, num_experts=experts)


def test_owner_is_the_experts_holder_and_rank_0_for_the_rest():
    from qstrat.plugins.builtin.layouts import QWEN3_MOE

    driver = RefitDriver("block-fp8", hf_config={"model_type": "qwen3_moe", "num_hidden_layers": 1})
    ep = ExpertParallel(size=4, num_experts=8)

    def entry(name, shape=(128, 128)):
        return driver.planner.entry(name, shape, torch.bfloat16, 1)

    assert [ep.owner(entry(f"model.layers.0.mlp.experts.{e}.up_proj.weight")) for e in (0, 1, 2, 5, 7)] == \
        [0, 0, 1, 2, 3]
    assert ep.owner(entry("model.layers.0.self_attn.q_proj.weight")) == 0
    assert ep.owner(entry("model.layers.0.mlp.gate.weight", (8, 128))) == 0
    with pytest.raises(PlanError, match=r"experts\.8\.up_proj\.weight: expert 8 is outside 0\.\.7"):
        ep.owner(entry("model.layers.0.mlp.experts.8.up_proj.weight"))
    with pytest.raises(PlanError, match=r"experts\.gate_up_proj: a grouped slab holds every expert and cannot "
                                        r"be split over 4 expert-parallel ranks"):
        ep.owner(entry("model.layers.0.mlp.experts.gate_up_proj", (8, 256, 128)))
    assert QWEN3_MOE.parse("model.layers.0.mlp.experts.gate_up_proj").slab


def test_global_tensors_renames_local_experts_and_cuts_local_slabs():
    from qstrat.plugins.builtin.layouts import QWEN3_MOE

    ep = ExpertParallel(size=2, num_experts=4)
    slab = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # 2 local experts, gate rows then up rows
    down = torch.zeros(3, 2)
    got = list(ep.global_tensors(1, [("model.layers.0.mlp.experts.gate_up_proj", slab),
                                     ("model.layers.0.mlp.experts.1.down_proj.weight", down),
                                     ("model.norm.weight", down)], QWEN3_MOE))
    assert [n for n, _ in got] == [
        "model.layers.0.mlp.experts.2.gate_proj.weight", "model.layers.0.mlp.experts.2.up_proj.weight",
        "model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight", "model.norm.weight"]
    assert torch.equal(got[1][1], slab[0, 2:]) and torch.equal(got[2][1], slab[1, :2])
    assert got[1][1].untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()  # views, no copy
    assert got[4][1] is down
    with pytest.raises(PlanError, match=r"experts\.2\.up_proj\.weight: local expert 2, but rank 0 holds 2 experts"):
        list(ep.global_tensors(0, {"model.layers.0.mlp.experts.2.up_proj.weight": down}, QWEN3_MOE))
    with pytest.raises(PlanError, match=r"experts\.gate_up_proj: local slab holds 3 experts, rank 1 holds 2"):
        list(ep.global_tensors(1, {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(3, 4, 3)}, QWEN3_MOE))


def test_split_plan_keeps_wire_order_and_refuses_a_rank_outside_the_group(tiny_model, tiny_hf_config):
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan = driver.plan(tensor_specs(tiny_model.state_dict()))
    even = split_plan(plan, lambda e: (e.layer or 0) % 2, 2)
    for r, part in enumerate(even):
        names = {o.name for o in part.outputs()}
        assert [o.name for o in part.outputs()] == [o.name for o in plan.outputs() if o.name in names]
        assert all((e.layer or 0) % 2 == r for e in part.entries)
        assert part.vllm_quantization_config() == plan.vllm_quantization_config()
    assert sorted(o.name for p in even for o in p.outputs()) == sorted(o.name for o in plan.outputs())
    with pytest.raises(PlanError, match=r"^model\.embed_tokens\.weight: assigned to rank 2, outside 0\.\.1$"):
        split_plan(plan, lambda e: 2, 2)
