"""Run as a script by test_engine_kv_multiprocess.py (not a test module): refit MULTIPROCESS
engines that cache keys and values in FP8.

``python engine_kv_multiprocess_scenario.py A_DIR SPOOL_DIR`` starts, with
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` and ``kv_cache_dtype="fp8"``, an engine on qstrat's block-FP8
checkpoint A_DIR (with calibrated k/v scales) WITHOUT a worker extension, refits it from model B
(refused before anything is sent: its scales cannot be read in the worker), greedy-decodes,
shuts it down; then one with ``worker_extension_cls=qstrat.vllm.sink.kv_scales.READER``: reads its scales,
refits it from model B, reads them again, greedy-decodes. Prints one line ``RESULT {json}``.
"""
from __future__ import annotations

import json
import os
import sys


def _refit(llm, driver, tensors, spool):
    from qstrat import vllm as qvllm

    try:
        qvllm.refit(llm, driver, tensors, weights_dir=spool)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def main(a_dir: str, spool: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import greedy, release, start_engine
    from qstrat.vllm.sink.kv_scales import READER, engine_kv_scales

    model_b = build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver("block-fp8", hf_config=hf_config(model_b))
    out = {}
    llm = start_engine(a_dir, kv_cache_dtype="fp8")
    out["plain_before"] = [[list(g.tokens), list(g.logprobs)] for g in greedy(llm)]
    out["plain_refit"] = _refit(llm, driver, model_b.state_dict(), spool)
    out["plain_after"] = [[list(g.tokens), list(g.logprobs)] for g in greedy(llm)]
    release(llm)
    del llm
    llm = start_engine(a_dir, kv_cache_dtype="fp8", worker_extension_cls=READER)
    out["scales_before"] = engine_kv_scales(llm)
    out["reader_refit"] = _refit(llm, driver, model_b.state_dict(), spool)
    out["scales_after"] = engine_kv_scales(llm)
    out["reader_after"] = [[list(g.tokens), list(g.logprobs)] for g in greedy(llm)]
    print("RESULT " + json.dumps(out), flush=True)
    release(llm)


if __name__ == "__main__":
    main(*sys.argv[1:])
