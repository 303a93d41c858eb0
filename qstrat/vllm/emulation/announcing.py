"""What the emulated kernels say when vLLM builds them: one log line per process where asked
(``QSTRAT_EMULATION_NOTICE=1``; not on a user's terminal by default), and a count.

A leaf module (the kernel modules subclass :class:`Announcing`; the package's
:func:`~qstrat.vllm.emulation.register` tells it, through :func:`describe`, what was
registered and why), so that the emulation's modules form no import cycle.
"""
from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from typing import Any

from qstrat.vllm.adapter import names

# The package's logger (a child of vLLM's: vLLM's handler, format and VLLM_LOGGING_LEVEL apply).
logger = logging.getLogger(f"{names.LOGGER}.plugins.qstrat")
#: The logger of the "active" line: INFO, printed to stdout with vLLM's format whatever
#: VLLM_LOGGING_LEVEL says, but only where :data:`NOTICE_ENV` is ``1`` (in every process that
#: builds a kernel: vLLM's workers inherit the environment); otherwise its level is WARNING and the
#: line is not printed (``qstrat doctor`` says which formats run emulated; :func:`built_kernels`
#: counts them). ``logging.getLogger(ACTIVE_LOGGER).setLevel(logging.INFO)`` shows it in-process.
ACTIVE_LOGGER = f"{names.LOGGER}.plugins.qstrat.active"
#: The environment variable that prints the "active" line (``1``).
NOTICE_ENV = "QSTRAT_EMULATION_NOTICE"


class _Stdout(logging.StreamHandler):
    """A handler writing to the CURRENT ``sys.stdout`` (vLLM's worker processes decorate it with
    their ``(Worker pid=...)`` prefix; pytest swaps it)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def active_logger() -> logging.Logger:
    """:data:`ACTIVE_LOGGER`, given (once) its own stdout handler with vLLM's formatter, no
    propagation (the line is printed once), and unless someone set a level, INFO where
    :data:`NOTICE_ENV` is ``1`` and WARNING (the line hidden) otherwise."""
    log = logging.getLogger(ACTIVE_LOGGER)
    if not any(isinstance(h, _Stdout) for h in log.handlers):
        handler = _Stdout()
        vllm_handlers = logging.getLogger(names.LOGGER).handlers
        if vllm_handlers and vllm_handlers[0].formatter is not None:
            handler.setFormatter(vllm_handlers[0].formatter)
        log.addHandler(handler)
        log.propagate = False
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO if os.environ.get(NOTICE_ENV) == "1" else logging.WARNING)
    return log

_announced = False
_built: Counter[str] = Counter()
_registered: tuple[str | None, tuple[str, ...], str] = (None, (), "")


def describe(reason: str | None, active: tuple[str, ...], opt_out_env: str) -> None:
    """Record what :func:`~qstrat.vllm.emulation.register` installed (``active`` formats), why
    (``reason``) and the variable that switches it off, for :func:`announce`'s line."""
    global _registered
    _registered = (reason, tuple(active), opt_out_env)


def announce(kernel: str) -> None:
    """Count a built emulated kernel (class name ``kernel``) and log, once per process, that
    the emulation is in use: called by every emulated kernel when vLLM builds it. (Not at
    registration: in the caller's process vLLM loads plugins before it configures its
    logging, and that line would be lost.)"""
    global _announced
    _built[kernel] += 1
    if _announced:
        return
    _announced = True
    reason, active, opt_out_env = _registered
    active_logger().info("qstrat CPU emulation active (%s; first kernel built: %s): emulated %s kernels for "
                "linear layers and fused MoE; set %s=0 to disable", reason, kernel,
                ", ".join(active), opt_out_env)


class Announcing:
    """Mixin for the emulated kernel classes: :func:`announce` when vLLM builds one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        announce(type(self).__name__)


def built_kernels() -> Counter[str]:
    """How many emulated kernel objects vLLM has built in THIS process, by class name (one per
    quantized linear layer or MoE layer of every engine started here)."""
    return Counter(_built)
