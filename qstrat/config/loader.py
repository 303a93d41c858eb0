"""Declarative refit configuration (pydantic v2), loaded from YAML, TOML, JSON, a mapping or a
preset name by :func:`load_config`.

Example (YAML)::

    preset: mxfp8-experts          # a named strategy; the keys below extend it
    keep_bf16: {first: 1, last: 2} # first/last decoder layers stay BF16
    rules:                         # ordered, first match wins; evaluated before the preset's rules
      - select: [attention]
        exclude: ['re:layers\\.(0|1)\\.']  # single quotes: YAML keeps the backslashes
        serializer: mxfp8          # one quantized format per plan: vLLM's quantization_config names one
        options: {scale_rounding: rceil}
    default: bf16                  # for matrices no rule matched

Unknown keys, plugin names or options are errors naming the key path (``rules[0].serializer``)
and the valid choices. Types are strict (pydantic strict mode): ``true`` is not 1, ``"yes"`` is
not a boolean, ``"1"`` is not a number (an int is accepted where a float belongs). Every problem
of a config is reported at once, one line each.

Files are read by :mod:`qstrat.config.files` (duplicate keys are errors). The schema
(:class:`RefitConfig`, :class:`Rule`, :class:`KeepBF16`, :class:`PresetConfig`) lives in
:mod:`qstrat.config.schema` and is re-exported here; names are checked against a plugin
registry: the one passed to :func:`load_config`, else the process-wide one
(:func:`qstrat.plugins.registry.get_registry`).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qstrat.config.files import read_config_file
from qstrat.config.schema import KeepBF16, PresetConfig, RefitConfig, Rule
from qstrat.errors import ConfigError
from qstrat.plugins.registry import get_registry
from qstrat.config.validation import close_matches

__all__ = ["KeepBF16", "PresetConfig", "RefitConfig", "Rule", "load_config"]


def load_config(source: str | Path | Mapping[str, Any] | RefitConfig, registry: Any = None) -> RefitConfig:
    """Load and validate a refit config.

    Args:
        source: a mapping, a ``.yaml``/``.yml``/``.toml``/``.json`` path, a preset name, or a
            RefitConfig (returned as is). A str equal to a registered preset's name is that
            preset, whatever the current directory holds (``mkdir block-fp8`` does not shadow
            it); a file of that name is read when given as a ``pathlib.Path`` or written as a
            path (``./block-fp8``).
        registry: the plugin registry names are checked against (default: the process-wide one).
    Returns: the validated :class:`RefitConfig`.
    Raises: ConfigError (invalid content, naming key paths; unreadable file; a ``source`` of
        another type, e.g. None, a number or bytes, naming its type and what is accepted).
    """
    if isinstance(source, RefitConfig):
        return source
    if isinstance(source, Mapping):
        return RefitConfig.from_mapping(source, registry=registry or get_registry())
    if not isinstance(source, (str, os.PathLike)) or not isinstance(os.fspath(source), str) or source == "":
        raise ConfigError(_bad_source(source))
    registry = registry or get_registry()
    strategies = registry.strategies
    if isinstance(source, str) and source in strategies:  # a preset name is never a path (docs/config.md)
        return RefitConfig.from_mapping({"preset": source}, registry=registry)
    path = Path(source)
    if not path.exists() and str(source) in strategies:  # a pathlib.Path: always a file
        raise ConfigError(f"config file {str(source)!r} does not exist; {str(source)!r} is a preset name: "
                          "pass it as a str (qstrat --preset NAME), not as a path")
    if not path.exists():
        raise ConfigError(f"config file {str(source)!r} does not exist, nor is it a preset name "
                          f"({close_matches(str(source), strategies)}valid presets: "
                          f"{', '.join(sorted(strategies))})")
    data = read_config_file(path)
    try:
        return RefitConfig.from_mapping(data, registry=registry)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _bad_source(source: Any) -> str:
    """The message for a :func:`load_config` source of a type it does not read."""
    shown = repr(source) if len(repr(source)) <= 60 else repr(source)[:57] + "..."
    got = "None" if source is None else f"{type(source).__name__} {shown}"
    hint = (" (for a file's content, pass the file's path, or the mapping yaml.safe_load returns)"
            if isinstance(source, (bytes, bytearray, memoryview)) else "")
    return (f"refit config: got {got}{hint}; expected a config file path (str or pathlib.Path: .yaml, "
            ".yml, .toml, .json), a preset name, a mapping or a RefitConfig")
