"""Host-side launch helpers shared by the format kernels."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def device_guard(t: torch.Tensor) -> Iterator[None]:
    """Make ``t``'s CUDA device current while launching (Triton launches on the current device).

    A no-op for CPU tensors (the Triton interpreter). Args: t: any tensor.
    """
    if t.is_cuda:
        with torch.cuda.device(t.device):
            yield
    else:
        yield


def kernel_input(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The tensor a kernel reads for ``w``, and whether it holds raw bf16 bits.

    bf16 is passed as ``w.view(torch.int16)`` (a same-strides view: no copy) and upcast in the
    kernel by ``bits << 16`` (:func:`.fp_encode.load_f32`); other dtypes are passed as they are.
    Args: w: tensor of any float dtype and strides. Returns: (tensor, bf16_bits).
    """
    if w.dtype == torch.bfloat16:
        return w.view(torch.int16), True
    return w, False
