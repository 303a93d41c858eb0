"""A refit through a file: the payload written as one safetensors file into a fresh temporary
folder, for engines that cannot receive tensors through the RPC (multiprocess engines), and the
once-per-process warning of what that costs."""
from __future__ import annotations

import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

#: Whether this process has warned about the temporary-checkpoint path (:func:`warn_cost`).
_WARNED = False


@contextmanager
def spooled(tensors: Iterable[tuple[str, torch.Tensor]], folder: str | Path) -> Iterator[str]:
    """Write ``tensors`` (name, tensor) as ``model.safetensors`` into a fresh temporary folder
    under ``folder``; yield that folder's path; delete it on exit."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="qstrat-refit-", dir=folder) as spool:
        save_file(dict(tensors), str(Path(spool) / "model.safetensors"))
        yield spool


def warn_cost(nbytes: int, folder: Path) -> None:
    """Once per process: what :func:`refit` through a file costs (``nbytes`` held in memory,
    written under ``folder`` and read back, every refit) and where it stops (this host's free
    memory, ``folder``'s free space), and the path that scales."""
    global _WARNED
    if _WARNED:
        return
    _WARNED = True
    free = shutil.disk_usage(folder).free
    warnings.warn(f"qstrat.vllm.refit: this refit wrote the whole quantized payload, {nbytes:,} bytes, to a "
                  f"temporary checkpoint under {folder} ({free:,} bytes free there), after holding it in this "
                  "process's memory, and the engine read it back; every refit through a file does the same, "
                  "so its size is limited by this host's free memory and that folder's free space (a "
                  "multiprocess engine cannot receive tensors through the RPC). The path that scales is "
                  "the transport: qstrat.transport.RefitSender to the engine's 'qstrat' weight-transfer "
                  "backend, which streams buckets into the workers without a file (docs/transport.md). "
                  "This warning is shown once per process.", RuntimeWarning, stacklevel=3)

