"""The sections of ``qstrat bench``, in the order they run and are printed.

Its own module so that the command line (``qstrat bench --help``, ``--only`` checks) names them
without importing the bench (torch, vLLM), and the bench reads them without importing the
command line.
"""
from __future__ import annotations

#: ``qstrat bench`` sections: format quantizers, grouped slabs, planning, the driver's overhead,
#: the GPU kernels' static facts (compiled for sm_90/sm_100 here, no GPU needed), the
#: routing model at cluster scale (bytes per link, projected round time: no measurement) and how
#: the quantized checkpoint changes per Adam step (the delta churn table, docs/transport.md).
SECTIONS = ("formats", "grouped", "plan", "driver", "kernels", "cluster", "delta")
