"""Run as a script by test_engine_forced_emulation.py (not a test module).

``python engine_forced_scenario.py A_DIR B_DIR CONFIG_JSON`` (run with
``QSTRAT_VLLM_EMULATION=force``): a fresh in-process engine on B_DIR, greedy; released; an
engine on A_DIR refit from model B's trainer tensors, greedy. Prints one line ``RESULT {json}``:
both generations, the emulated kernels built in this process and the plugin's status.
"""
from __future__ import annotations

import json
import sys


def main(a_dir: str, b_dir: str, config_json: str) -> None:
    from qstrat import vllm as qvllm
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm import emulation
    from qstrat.vllm.engine.local import greedy, release, start_engine

    llm = start_engine(b_dir)
    fresh_b = greedy(llm)
    release(llm)
    del llm
    model_b = build_tiny_qwen3_moe(seed=1)
    llm = start_engine(a_dir)
    qvllm.refit(llm, RefitDriver(json.loads(config_json), hf_config=hf_config(model_b)), model_b.state_dict())
    refit_b = greedy(llm)
    status = emulation.status()
    print("RESULT " + json.dumps({
        "fresh_b": [[g.tokens, g.logprobs] for g in fresh_b], "refit_b": [[g.tokens, g.logprobs] for g in refit_b],
        "built": dict(emulation.built_kernels()), "active": list(status.active), "reason": status.reason}), flush=True)
    release(llm)


if __name__ == "__main__":
    main(*sys.argv[1:])
