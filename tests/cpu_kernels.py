"""The marker of the tests of the delta transport's CPU kernels (qstrat.transport.jit): they
check the kernels themselves against their torch paths, so under ``QSTRAT_NUMBA=0`` (numba
switched off on purpose: docs/transport.md, "The compare's CPU kernel") they are skipped, naming
why. numba merely missing is NOT a skip: it is a dependency, and their first test fails saying
the kernels did not load. The torch paths are under test in the rest of the suite either way."""
from __future__ import annotations

import pytest

from qstrat.transport import jit

#: ``pytestmark = kernels`` in a module of kernel tests.
kernels = pytest.mark.skipif(jit.SWITCHED_OFF,
                             reason="QSTRAT_NUMBA=0 switched numba off: the CPU kernels are not under test "
                                    "(their torch paths are)")
