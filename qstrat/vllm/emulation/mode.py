"""Which of qstrat's CPU kernels an engine process gets: the ``QSTRAT_VLLM_EMULATION`` setting and
the CPU kind (a leaf module: the format modules and the package read it without an import cycle).

``QSTRAT_VLLM_EMULATION``:

=========  ================================================================================
value      effect on a vLLM CPU engine
=========  ================================================================================
unset,     ``auto``: emulate what vLLM's own CPU kernels cannot run - every format without
``auto``,  AMX; with AMX, MXFP8 and NVFP4, and block FP8 only for linear layers with a bias
``1``      (vLLM 0.32's AMX op ``fp8_scaled_mm_cpu`` fails on a bfloat16 bias: "expected
           scalar type Float but found BFloat16", seen with gpt-oss)
``force``  every format emulated, and qstrat's kernels placed FIRST in vLLM's CPU candidate
           lists, so they serve even where vLLM's AMX kernels could: the emulated block-FP8
           path tested on an AMX CPU
``0``,     off: vLLM runs only its own kernels
``off``
=========  ================================================================================

The CPU kind comes from :func:`qstrat.vllm.adapter.platform_facts.has_amx`, read at call time
(tests fake an AMX CPU by patching that one function).
"""
from __future__ import annotations

import os

from qstrat.vllm.adapter import platform_facts

#: The environment variable read by :func:`mode`.
ENV = "QSTRAT_VLLM_EMULATION"
_VALUES = {"": "auto", "1": "auto", "auto": "auto", "force": "force", "0": "off", "off": "off"}

#: Where the block-FP8 emulation goes (:func:`block_fp8_placement`).
ONLY, BIASED, FIRST = "only", "biased", "first"


def mode() -> str:
    """``"auto"``, ``"force"`` or ``"off"`` from ``QSTRAT_VLLM_EMULATION`` (case and blanks ignored).

    Raises: ValueError naming the variable, its value and the accepted values.
    """
    raw = os.environ.get(ENV, "")
    value = _VALUES.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"{ENV}={raw!r} is not a setting: use auto (the default: emulate what vLLM's "
                         "CPU kernels cannot run), force (qstrat's kernels first, also on an AMX CPU) "
                         "or 0 (off)")
    return value


def block_fp8_placement() -> str:
    """How block FP8 is emulated in this process (a vLLM CPU platform is assumed):

    * ``"only"`` (no AMX, ``auto``): the emulated linear kernel and MoE experts go LAST in
      vLLM's candidate lists - vLLM's AMX kernels cannot run here, so they are the only ones;
    * ``"biased"`` (AMX, ``auto``): vLLM's AMX kernels serve every layer except linear layers
      with a bias, which qstrat's kernel (placed just before vLLM's W8A16 AMX kernel) emulates;
    * ``"first"`` (``force``): the emulated kernels go FIRST and serve every layer.

    Raises: ValueError for a bad ``QSTRAT_VLLM_EMULATION`` (see :func:`mode`).
    """
    if mode() == "force":
        return FIRST
    return BIASED if platform_facts.has_amx() else ONLY
