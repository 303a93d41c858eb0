"""Run as a script by test_engine_multiprocess.py (not a test module): refit a MULTIPROCESS engine.

``python engine_multiprocess_scenario.py A_DIR SPOOL_DIR CONFIG_JSON`` starts a ``vllm.LLM`` with
``qstrat.vllm.engine.local.start_engine`` (its default thread settings; qstrat registers no kernels
here - vLLM loads its plugin in each process) on qstrat's checkpoint A_DIR with
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (engine core and worker in their own processes),
greedy-decodes twice, refits it from model B's trainer tensors (``weights_dir=SPOOL_DIR``),
decodes, tries ``stream=True`` (refused before anything is sent), refits back to A WITHOUT
``weights_dir`` (qstrat takes a temporary folder itself), decodes, and prints one line
``RESULT {json}`` with the generations (tokens and logprobs; JSON floats round-trip exactly)
and the stream refusal's message.
"""
from __future__ import annotations

import json
import os
import sys


def main(a_dir: str, spool: str, config_json: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from qstrat import vllm as qvllm
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import greedy, start_engine

    llm = start_engine(a_dir)
    model_a, model_b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver(json.loads(config_json), hf_config=hf_config(model_b))
    result = {"a": greedy(llm), "a_again": greedy(llm)}
    qvllm.refit(llm, driver, model_b.state_dict(), weights_dir=spool)
    result["refit_b"] = greedy(llm)
    try:
        qvllm.refit(llm, driver, model_a.state_dict(), stream=True)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    result["after_refusal"] = greedy(llm)
    qvllm.refit(llm, driver, model_a.state_dict())  # no weights_dir: a temporary folder
    result["refit_a"] = greedy(llm)
    runs = {k: [[g.tokens, g.logprobs] for g in v] for k, v in result.items()}
    print("RESULT " + json.dumps({"runs": runs, "stream_refused": refused}), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
