"""How formats bind their Triton kernels, and where the kernel test modules run.

The kernel tests are one module per kernel (``tests/test_kernel_*.py``: fp8 = block FP8 and
MXFP8, nvfp4, fp_encode = the shared device helpers, properties = hypothesis kernel == reference).
They run where kernels run (tests/kernel_harness.py):
- CUDA machine: on CUDA tensors, collected as usual.
- CPU machine: under Triton's interpreter, which needs ``TRITON_INTERPRET=1`` set BEFORE triton
  is imported (triton builds its own ``tl.max`` etc. at import). tests/conftest.py leaves those
  modules out of this process, and ONE test below runs all of them in a child pytest with the
  variable set from the start. To run one directly: ``TRITON_INTERPRET=1 pytest tests/test_kernel_fp8.py``.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'qstrat[triton]')")

from qstrat.serializers.block_fp8 import BlockFP8  # noqa: E402
import kernel_harness as testing  # noqa: E402
from qstrat.serializers.mxfp8 import MXFP8  # noqa: E402

DEVICE = testing.kernel_device()

# ---- binding --------------------------------------------------------------------------


def test_kernels_registered_when_triton_importable():
    from qstrat.serializers.kernels.block_fp8 import quantize_block_fp8
    from qstrat.serializers.kernels.mxfp8 import quantize_mxfp8

    assert BlockFP8.resolve_kernel() is quantize_block_fp8
    assert MXFP8.resolve_kernel() is quantize_mxfp8


def test_formats_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from qstrat.serializers.block_fp8 import BlockFP8\n"
        "from qstrat.serializers.mxfp8 import MXFP8\n"
        "assert BlockFP8.resolve_kernel() is None and MXFP8.resolve_kernel() is None\n"
        "w = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)\n"
        "p = BlockFP8().quantize(w)\n"
        "print(p['weight_scale_inv'].item(), MXFP8().quantize(w)['weight_scale'][0, 0].item())\n"
        "try:\n"
        "    BlockFP8(backend='triton').quantize(w)\n"
        "except RuntimeError as e:\n"
        "    print('raised', 'no Triton kernel' in str(e))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    # amax 4095 -> s = fp32(4095 / 448); first 32-block amax 31 -> RCEIL byte 127 + 4 - 8 + 1.
    assert float(out[0]) == torch.tensor(4095.0 / 448.0, dtype=torch.float32).item()
    assert out[1:] == ["124", "raised", "True"]


def test_auto_backend_uses_reference_on_cpu(monkeypatch):
    def boom(*args):
        raise AssertionError("kernel called for a CPU tensor with backend='auto'")

    monkeypatch.setattr(BlockFP8, "kernel", boom)
    monkeypatch.setattr(MXFP8, "kernel", boom)
    w = torch.randn(64, 64)
    BlockFP8().quantize(w)
    MXFP8().quantize(w)


if DEVICE is None:  # CPU, compiled mode: the kernel modules are not collected in this process

    @pytest.mark.interpreter
    def test_kernel_modules_under_interpreter():
        """Every tests/test_kernel_*.py in one child pytest under TRITON_INTERPRET=1."""
        testing.run_under_interpreter(testing.kernel_test_modules(), min_passed=testing.MIN_KERNEL_TESTS)
