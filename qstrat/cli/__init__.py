"""The ``qstrat`` command (not core: the trainer-facing API never prints).

``from qstrat.cli import main`` keeps working (resolved lazily from :mod:`.commands`).

- :mod:`.commands`: ``qstrat demo | plan | quantize | bench | list | doctor``: :func:`main`
- :mod:`.__main__`: ``python -m qstrat.cli``
- :mod:`.console`: what the command prints; vLLM's start-up chatter kept in a log
- :mod:`.doctor`: ``qstrat doctor``: what this machine and environment give qstrat
- :mod:`.bench`: ``qstrat bench``: measured speed of the CPU paths next to their peers, as ratios
- :mod:`.bench_sections`: the bench's section names (read without importing the bench)
- :mod:`.demo` (package): ``qstrat demo``: its stages, the tiny model, its real Adam trajectory
"""

import lazy_loader

#: Public names resolved from the submodules below on first use (lazy_loader, PEP 562), so that
#: importing a submodule of this package imports nothing else.
__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    'commands': ['main'],
})
