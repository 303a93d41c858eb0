"""Run as a script by test_engine_multiprocess.py (not a test module): refit a MULTIPROCESS engine.

``python engine_multiprocess_scenario.py A_DIR SPOOL_DIR CONFIG_JSON`` starts a plain
``vllm.LLM`` on qstrat's checkpoint A_DIR with ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (engine core
and worker in their own processes; qstrat registers nothing here - vLLM loads its plugin in
each), greedy-decodes, refits it from model B's trainer tensors (``weights_dir=SPOOL_DIR``),
decodes, refits back to A, decodes, and prints one line ``RESULT {json}`` with the three
generations (tokens and logprobs; JSON floats round-trip exactly).
"""
from __future__ import annotations

import json
import os
import sys


def main(a_dir: str, spool: str, config_json: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from vllm import LLM

    llm = LLM(model=a_dir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
              max_num_seqs=4, dtype="bfloat16")
    from qstrat import vllm as qvllm
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.driver import RefitDriver
    from qstrat.engine.local import greedy

    model_a, model_b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver(json.loads(config_json), hf_config=hf_config(model_b))
    result = {"a": greedy(llm)}
    qvllm.refit(llm, driver, model_b.state_dict(), weights_dir=spool)
    result["refit_b"] = greedy(llm)
    qvllm.refit(llm, driver, model_a.state_dict(), weights_dir=spool)
    result["refit_a"] = greedy(llm)
    print("RESULT " + json.dumps({k: [[g.tokens, g.logprobs] for g in v] for k, v in result.items()}),
          flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
