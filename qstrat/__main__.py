"""``python -m qstrat``: the ``qstrat`` command, the same as ``python -m qstrat.cli``."""
import runpy

runpy.run_module("qstrat.cli", run_name="__main__", alter_sys=True)
