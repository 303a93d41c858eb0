"""qstrat.sharding: expert parallelism in one process (which rank holds and emits which expert,
global names from local ones, one plan per rank). Two real ranks: tests/test_distributed.py."""
from __future__ import annotations

import pytest
import torch
from test_driver_run import u8

from qstrat import PlanError, RefitDriver, tensor_specs
from qstrat.sharding import ExpertParallel, split_plan


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
