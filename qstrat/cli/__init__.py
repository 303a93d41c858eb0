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

#: Public name -> the module defining it, imported on first use (so that importing a
#: submodule of this package imports nothing else).
_EXPORTS = {
    'main': 'qstrat.cli.commands',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
