"""What ``qstrat plan --trainer-layout ... --engine-layout ...`` and ``qstrat bench --only cluster``
print of the routing model (:mod:`qstrat.plan.cluster`): one row per model, and the field's
published refit times beside it (docs/transport.md "Refit at
cluster scale": sources there).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qstrat.layouts.model_config import ModelConfig
from qstrat.plan.cluster import route
from qstrat.plan.cluster_layout import EngineLayout, TrainerLayout
from qstrat.plan.data import RefitPlan

#: Public refit figures users compare with: (system, model and scale, refit).
FIELD = (
    ("Perplexity (RDMA, every trainer GPU writes its shard)", "Kimi-K2 1T, 256 -> 128 GPUs, FP8", "1.3 s"),
    ("Awex (inclusionAI)", "1T FP8", "6 s RDMA / 20 s NCCL"),
    ("Marin expert-block sync", "32 Megatron ranks -> 8 vLLM, 14.65 % each", "0.51 s vs 19.9 s broadcast"),
    ("miles (Mooncake P2P from all trainer ranks)", "Kimi-K2 1T", "43 s -> 7 s"),
    ("NeMo-RL NCCL reshard", "Qwen3-235B / DeepSeek-V3 -> TP8xDP16, BF16", "4.6-4.9 s / 7.7-9.9 s"),
    ("NeMo-RL MXFP8 prequantized", "Qwen3-235B, B200", "7.26 s transfer + update"),
    ("checkpoint-engine (Moonshot)", "Kimi-K2 1T, broadcast", "~20 s"),
)


def cluster_row(model: str, plan: RefitPlan, model_config: ModelConfig, trainer: TrainerLayout,
                engine: EngineLayout, rate_bps: float, efficiency: float = 1.0) -> dict[str, Any]:
    """One model's figures (bytes in GB = 1e9, seconds at ``rate_bps * efficiency``): the mesh
    round's busiest link and time, against today's broadcast pipelined, as a binomial tree (gloo)
    and flat (:meth:`qstrat.plan.cluster.ClusterRound.broadcast_bytes`)."""
    r = route(plan, trainer, engine, model_config)
    which, busiest = r.busiest()
    bps = rate_bps * efficiency
    mesh_s = busiest * 8 / bps
    return {"section": "cluster", "case": model, "impl": "mesh", "model": model, "trainer": str(trainer), "engine": str(engine),
            "payload_gb": r.payload / 1e9, "engine_rank_gb": max(r.received) / 1e9,
            "engine_rank_share": max(r.received) / r.payload, "sender_max_gb": max(r.sent) / 1e9,
            "sender_mean_gb": sum(r.sent) / len(r.sent) / 1e9, "busiest": which, "busiest_gb": busiest / 1e9,
            "link_gbit": rate_bps / 1e9, "efficiency": efficiency, "mesh_s": mesh_s,
            **{f"broadcast_{kind}_s": r.broadcast_bytes(kind) * 8 / bps for kind in ("pipelined", "tree", "flat")}}


def cluster_table(rows: Sequence[Mapping[str, Any]]) -> Any:
    """A rich Table of :func:`cluster_row` rows."""
    from rich.table import Table

    first = rows[0]
    table = Table(title=f"refit at cluster scale (projected, link-bound): {first['link_gbit']:g} Gbit/s per GPU "
                        f"x efficiency {first['efficiency']:g}; mesh = every trainer rank sends what it owns to "
                        "the engine ranks that load it; broadcast = today's one sender to every engine rank")
    cols = ("model", "trainer", "engine", "payload GB", "per engine rank GB", "per sender GB max/mean",
            "busiest link", "mesh s", "broadcast s pipelined / tree (gloo) / flat", "speedup vs tree / pipelined")
    for c in cols:
        table.add_column(c, justify="left" if c in ("model", "trainer", "engine", "busiest link") else "right")
    for r in rows:
        table.add_row(r["model"], r["trainer"], r["engine"], f"{r['payload_gb']:,.1f}",
                      f"{r['engine_rank_gb']:,.2f} ({r['engine_rank_share']:.1%})",
                      f"{r['sender_max_gb']:,.1f} / {r['sender_mean_gb']:,.1f}",
                      f"{r['busiest']}: {r['busiest_gb']:,.1f} GB", f"{r['mesh_s']:.2f}",
                      f"{r['broadcast_pipelined_s']:,.1f} / {r['broadcast_tree_s']:,.1f} / {r['broadcast_flat_s']:,.0f}",
                      f"{r['broadcast_tree_s'] / r['mesh_s']:.1f}x / {r['broadcast_pipelined_s'] / r['mesh_s']:.1f}x")
    return table


def field_table() -> Any:
    """A rich Table of :data:`FIELD` (published figures, not measured here)."""
    from rich.table import Table

    table = Table(title="the field's published refit times (not measured here)")
    for c in ("system", "model, scale", "refit"):
        table.add_column(c)
    for row in FIELD:
        table.add_row(*row)
    return table


#: ``qstrat bench --only cluster``: the example configs (examples/models), the issue's layouts.
CLUSTER_MODELS = ("qwen3-235b-a22b", "deepseek-v3", "kimi-k2-sized")
CLUSTER_LAYOUTS = (("ep8xfsdp8", "tp8xdp16"), ("ep8xfsdp8", "tp8xdp16xep"), ("ep8xfsdp32", "tp8xdp16"))
#: Quick runs: the same layouts on 2-layer, 8-expert configs (seconds, not a figure).
QUICK_OVERRIDES = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 8,
                   "num_nextn_predict_layers": 0, "num_experts": 8}


def bench_cluster(models_dir: Any, quick: bool = False, rate: str = "400gbit",
                  preset: str = "block-fp8") -> list[dict[str, Any]]:
    """The ``cluster`` bench section: :func:`cluster_row` for each of :data:`CLUSTER_MODELS`
    (config-only meta tensors under ``models_dir``) and :data:`CLUSTER_LAYOUTS` at ``rate``."""
    import json

    import torch

    from qstrat.execute.driver import RefitDriver
    from qstrat.plan.cluster_layout import parse_engine_layout, parse_link_rate, parse_trainer_layout
    from qstrat.layouts.skeleton import model_tensors

    rows = []
    for name in CLUSTER_MODELS:
        hf = json.loads((models_dir / name / "config.json").read_text())
        if quick:
            hf.update({k: v for k, v in QUICK_OVERRIDES.items() if k in hf})
        driver = RefitDriver({"preset": preset}, hf_config=hf)
        plan = driver.plan({n: torch.empty(s, dtype=torch.bfloat16, device="meta")
                            for n, s in model_tensors(driver.layout, driver.model_config)})
        for trainer, engine in CLUSTER_LAYOUTS:
            rows.append(cluster_row(name, plan, driver.model_config, parse_trainer_layout(trainer), parse_engine_layout(engine),
                                    parse_link_rate(rate)))
    return rows
