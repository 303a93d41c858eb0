"""What the ``qstrat`` command and the demo print: a Console that renders the same in a terminal
and in a log, and vLLM's start-up chatter kept in a log file instead of the user's screen.

Not core: the trainer-facing API never prints.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

from rich.console import Console

#: Width used when the output is not a terminal (a pipe, a file, a CI log) and ``COLUMNS`` is unset.
PIPE_WIDTH = 200


def make_console(stderr: bool = False) -> Console:
    """The Console for command output (``stderr=True``: for errors).

    Soft wrap: rich never inserts line breaks into printed text, so a JSON line or a long tensor
    name stays one line (a terminal wraps it for display, a log keeps it whole). When the stream
    is not a terminal, tables are laid out for :data:`PIPE_WIDTH` columns instead of rich's
    default 80 (``COLUMNS`` still wins when set). No markup highlighting of numbers or paths.
    """
    probe = Console(stderr=stderr)
    width = None if probe.is_terminal or os.environ.get("COLUMNS") else PIPE_WIDTH
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


@contextmanager
def stderr_to(log_path: str | Path, tail_lines: int = 30) -> Iterator[Path]:
    """Send everything written to this process's stderr to ``log_path`` while the body runs.

    Catches what an in-process vLLM engine writes there whatever its origin - Python warnings
    (FutureWarning...), C++ warnings from torch (``[W... NUMA binding``, ``[rank0]:`` prefixes),
    tqdm progress bars, native prints - by redirecting file descriptor 2 and ``sys.stderr``. Standard output is untouched (vLLM logs there at ``VLLM_LOGGING_LEVEL``, ERROR
    in :func:`qstrat.vllm.engine.local.start_engine`). Nothing is dropped: the file keeps it all, and
    when the body raises, the exception gets a note naming the file with its last
    ``tail_lines`` lines, so a real error is never hidden behind the redirection.

    Yields: the log path (appended to; its directory must exist).
    """
    log_path = Path(log_path)
    sys.stderr.flush()
    saved = os.dup(2)
    _REDIRECTED.append(log_path)
    try:
        with open(log_path, "a", buffering=1, errors="replace") as log, redirect_stderr(log):
            os.dup2(log.fileno(), 2)  # sys.stderr may not be fd 2 (pytest, notebooks): both go there
            try:
                yield log_path
            except BaseException as exc:
                log.flush()
                exc.add_note(_tail_note(log_path, tail_lines))
                raise
            finally:
                log.flush()
                os.dup2(saved, 2)
    finally:
        _REDIRECTED.pop()
        os.close(saved)


#: The logs :func:`stderr_to` sends stderr to now, innermost last.
_REDIRECTED: list[Path] = []


def stderr_redirected() -> Path | None:
    """The log this process's stderr goes to (:func:`stderr_to`), or None: shown as is."""
    return _REDIRECTED[-1] if _REDIRECTED else None


def _tail_note(log_path: Path, lines: int) -> str:
    try:
        tail = log_path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return f"stderr log {log_path} could not be read: {exc}"
    body = "\n".join(f"  {line}" for line in tail) if tail else "  (empty)"
    return f"stderr (engine and library output) was written to {log_path}; its last lines:\n{body}"


#: Loggers that warn while torchao is imported (by transformers or vLLM, when torchao is
#: installed): torchao 0.18's optional C++ kernels built for other CPython/CUDA versions
#: ("Failed to load ..._C_mxfp8.cpython-310...so"), and torch's pytree deprecation notice for
#: the enums torchao registers. Harmless for qstrat's CPU engines and demo.
TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_torchao_import() -> None:
    """Raise :data:`TORCHAO_IMPORT_LOGGERS` to ERROR, each only if nobody configured it (level
    NOTSET); call before transformers or vLLM import torchao. Errors still show."""
    for name in TORCHAO_IMPORT_LOGGERS:
        log = logging.getLogger(name)
        if log.level == logging.NOTSET:
            log.setLevel(logging.ERROR)
