"""Reading refit config files strictly: YAML, TOML and JSON into a plain mapping.

What a lax parser would accept silently is an error here, naming the file and the line:

- a key given twice in one mapping (PyYAML and ``json`` keep the last value; ``tomllib`` already
  refuses it);
- YAML 1.1's implicit booleans ``yes``/``no``/``on``/``off``/``y``/``n``: only ``true``/``false``
  (YAML 1.2 core schema) are booleans; the others stay strings, which the strict config model
  then refuses where a boolean belongs (``ue8m0: yes`` -> "Input should be a valid boolean").
- YAML 1.2 floats without a dot (``1e-3``, which PyYAML's 1.1 resolver reads as a string) are
  floats.
- integers follow YAML 1.2 too: decimal, ``0o`` octal, ``0x`` hex; YAML 1.1's sexagesimal
  ``1:30`` (= 90), ``0b`` binary, ``1_000`` and leading-zero octal stay strings (refused where an
  integer belongs) or decimal (``010`` is 10).
- a UTF-8 byte-order mark at the start of a file is dropped (YAML, TOML and JSON alike).

The loader is a ``yaml.SafeLoader`` subclass (no arbitrary Python objects).
"""
from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from qstrat.errors import ConfigError

__all__ = ["NESTED_TOO_DEEPLY", "StrictYAMLLoader", "read_config_file", "read_text_file"]

#: Why a file whose lists/mappings nest deeper than the parsers' recursion allows is refused.
NESTED_TOO_DEEPLY = "lists or mappings nested too deeply for the parser (it reached Python's recursion limit)"


class StrictYAMLLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys and resolves booleans and floats by the
    YAML 1.2 core schema (see the module docstring)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """As SafeLoader's, but a key written twice in one mapping raises a
        ``yaml.constructor.ConstructorError`` naming the key and both lines (a key that overrides
        one merged in with ``<<: *anchor`` is YAML's override, not a duplicate)."""
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:  # the keys written here; merged (<<) keys may be overridden
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader reports it below
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first})",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml12_resolvers() -> None:
    """Replace the YAML 1.1 bool and float resolvers of :class:`StrictYAMLLoader` (its own copy
    of the table; ``yaml.SafeLoader`` is unchanged) with the YAML 1.2 core schema's."""
    table = {ch: [(tag, rx) for tag, rx in rs if tag not in ("tag:yaml.org,2002:bool",
                                                            "tag:yaml.org,2002:float",
                                                            "tag:yaml.org,2002:int")]
             for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    StrictYAMLLoader.yaml_implicit_resolvers = table
    StrictYAMLLoader.add_implicit_resolver(
        "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
        list("-+0123456789"))
    StrictYAMLLoader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
        list("tTfF"))
    StrictYAMLLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?"
                   r"|[-+]?[0-9]+[eE][-+]?[0-9]+"
                   r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+0123456789."))


_yaml12_resolvers()


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    return loader.construct_scalar(node).lower() == "true"


StrictYAMLLoader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """A YAML 1.2 core-schema integer: decimal (``010`` is 10, not YAML 1.1's octal 8), ``0o``
    octal or ``0x`` hexadecimal."""
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


StrictYAMLLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_text_file(path: Path, what: str, formats: str = "", text_what: str | None = None) -> str:
    """The UTF-8 text of the regular file ``path`` (a leading UTF-8 byte-order mark dropped, for
    every format alike: editors on Windows write one).

    A directory, a FIFO, a device or a socket - also behind a symlink (``config.json`` ->
    ``/dev/zero`` would read without bound, a FIFO would block forever) - is refused before
    anything is read. ``what``: what the file should be (``config file``), ``formats``: its
    formats in the message on a file that is not regular (`` (.yaml, .toml, .json)``);
    ``text_what``: the words for a file that is not UTF-8 (default ``text {what}``).

    Raises: ConfigError naming ``path``: not a regular file, unreadable (the OS's reason), not
        UTF-8 text.
    """
    try:
        mode = os.stat(path).st_mode  # follows symlinks: the file that would be read
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket"
                if stat.S_ISSOCK(mode) else "not a regular file")
        raise ConfigError(f"{path}: is {kind}, not a {what}{formats}; nothing was read")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a {text_what or 'text ' + what} ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def read_config_file(path: Path) -> Mapping[str, Any]:
    """The mapping a ``.yaml``/``.yml``, ``.toml`` or ``.json`` config file holds (any other
    suffix is read as YAML).

    Raises: ConfigError naming ``path``: not a regular file (:func:`read_text_file`), unreadable,
        not text, a parse error (with line), lists or
        mappings nested too deeply to parse (:data:`NESTED_TOO_DEEPLY`), a duplicate key (with
        both lines for YAML), or a top level that is not a mapping.
    """
    text = read_text_file(path, "config file", " (.yaml, .toml, .json)")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_json_object)
        else:
            data = yaml.load(text, Loader=StrictYAMLLoader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot parse: {exc}") from exc
    except RecursionError:  # the parsers recurse per level; the traceback would be ~1000 frames
        raise ConfigError(f"{path}: cannot parse: {NESTED_TOO_DEEPLY}; a refit config nests only a few "
                          "levels") from None
    if data is None:
        raise ConfigError(f"{path}: the file holds no settings (empty); a refit config needs at least "
                          "a preset or rules, e.g. `preset: block-fp8`")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
