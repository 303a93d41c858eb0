"""Look vLLM names up through the version table (:mod:`.names`): the one resolver qstrat has.

:func:`resolve` finds where the INSTALLED vLLM has a name (the table entry's location for that
version) and imports it; a name the table does not place for this version, one it records as
absent, and one that is not where the table says all raise :class:`VllmNameError` with one
message naming the key, the installed version, the versions the table was checked against and
what to do - before anything is changed in vLLM. Importing this module does not import vLLM.
"""
from __future__ import annotations

import importlib
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from qstrat.vllm.adapter import names

#: The section of docs/vllm.md that says how to add a vLLM version.
HOW_TO_ADD = 'docs/vllm.md, "Where vLLM-version code lives"'


class VllmNameError(RuntimeError):
    """A vLLM name qstrat needs is not available in the installed vLLM (see :func:`resolve`)."""


def vllm_version() -> str:
    """The installed vLLM's ``__version__`` (``"?"`` if it has none).

    Imports vLLM (on a machine without CUDA, its "Triton is installed, but doesn't include CPU
    backend" notice hidden first: :func:`quiet_cpu_triton_notice`). Raises: ImportError
    (ModuleNotFoundError) if vLLM is not installed.
    """
    quiet_cpu_triton_notice()
    vllm = importlib.import_module(names.PACKAGE)
    return str(getattr(vllm, "__version__", "?"))


def quiet_cpu_triton_notice() -> None:
    """Without CUDA, raise vLLM's ``triton_utils.importing`` logger to ERROR unless someone set
    its level: its import-time "Triton is installed, but doesn't include CPU backend. Disabling
    Triton." is logged before vLLM's logging configuration applies (so ``VLLM_LOGGING_LEVEL``
    cannot hide it) and says nothing a CPU user acts on (``qstrat doctor``'s triton line says
    where qstrat's kernels run). With CUDA the logger is left alone (its Triton messages matter
    there)."""
    import logging

    import torch

    notice = logging.getLogger(f"{names.LOGGER}.triton_utils.importing")
    if notice.level == logging.NOTSET and not torch.cuda.is_available():
        notice.setLevel(logging.ERROR)


def known_versions() -> str:
    """The vLLM versions the table was checked against, for messages: ``"0.32.0"``, ``"0.31.0, 0.32.0"``."""
    return ", ".join(names.VERSIONS)


def is_known_version(version: str) -> bool:
    """Whether ``version`` is one the table was checked against (a local label such as
    ``+cpu`` ignored, as PEP 440 ``==`` does)."""
    return any(_contains(f"=={v}", version, as_release=False) for v in names.VERSIONS)


def _contains(spec: str, version: str, as_release: bool = True) -> bool:
    """Whether ``version`` is in ``spec``, read as its release (PEP 440 ``base_version``): a
    pre-release, dev build or post-release of X.Y.Z (``0.30.0rc1``, ``0.30.1.dev5+g1a2b``, a
    source build) is taken as X.Y.Z - PEP 440 would put ``0.30.0rc1`` in neither ``<0.30.0`` nor
    ``>=0.30.0``, so no table location would hold it. ``as_release=False``: PEP 440 as is."""
    try:
        v = Version(version)
        return SpecifierSet(spec).contains(Version(v.base_version) if as_release else v, prereleases=True)
    except InvalidVersion:
        return False


def _what_to_do(entry: names.VllmName) -> str:
    alternative = f" Public alternative: {entry.alternative}." if entry.alternative else ""
    return (f"{alternative} Install a supported vLLM ({names.INSTALL}), or record where this version has it in "
            f"qstrat/vllm/adapter/names.py ({HOW_TO_ADD}).")


def entry(key: str) -> names.VllmName:
    """The table entry ``key``. Raises: KeyError naming the key (a qstrat bug: every name qstrat
    uses must be in the table)."""
    try:
        return names.TABLE[key]
    except KeyError:
        raise KeyError(f"{key!r} is not in qstrat's vLLM version table (qstrat/vllm/adapter/names.py)") from None


def location(key: str, version: str | None = None) -> tuple[str, str]:
    """Where vLLM ``version`` (default: the installed one) has name ``key``, without importing it.

    Returns: ``(specifier, location)``: the table's specifier that covers ``version`` and its
        ``"module"`` / ``"module:attr.attr"``.
    Raises: VllmNameError if no specifier of the entry covers ``version`` or the table records
        the name as absent there; KeyError for a key not in the table; ImportError if
        ``version`` is None and vLLM is not installed.
    """
    e = entry(key)
    version = vllm_version() if version is None else version
    found = [(spec, where) for spec, where in e.locations.items() if _contains(spec, version)]
    if not found:
        raise VllmNameError(
            f"qstrat needs vLLM's {key} ({e.what}), but its vLLM version table does not know where "
            f"vllm {version} has it (the entry covers {', '.join(e.locations) or 'no version'}; the table "
            f"was checked against vllm {known_versions()}).{_what_to_do(e)}")
    spec, where = found[0]
    if where is None:
        raise VllmNameError(
            f"qstrat needs vLLM's {key} ({e.what}), which vllm {version} does not have (qstrat's vLLM "
            f"version table: absent in {spec}; checked against vllm {known_versions()}).{_what_to_do(e)}")
    return spec, where


def available(key: str, version: str | None = None) -> bool:
    """Whether vLLM ``version`` (default: the installed one) has name ``key``, by the table:
    True where it places it, False where it records it as absent. Imports nothing of vLLM but
    its version.

    Raises: VllmNameError if the table does not know the version for this name (neither
        placed nor recorded absent); KeyError for a key not in the table.
    """
    e = entry(key)
    version = vllm_version() if version is None else version
    found = [where for spec, where in e.locations.items() if _contains(spec, version)]
    if not found:
        location(key, version)  # raises the table's "does not know" error
    return found[0] is not None


class VllmVersionError(RuntimeError):
    """The installed vLLM is outside the range qstrat supports (:data:`names.SUPPORTED`)."""


def is_supported(version: str) -> bool:
    """Whether vLLM ``version`` is in :data:`names.SUPPORTED` (a local label such as ``+cpu``
    ignored)."""
    return _contains(names.SUPPORTED, version)


def check_supported_version(what: str = "a vLLM engine") -> str:
    """The installed vLLM's version if it is in :data:`names.SUPPORTED`.

    Args: what: what is starting, for the message (``"a vLLM engine"``, ``"qstrat's CPU emulation"``).
    Raises: VllmVersionError, one line naming the installed version, the supported range and
        the install command (``qstrat doctor`` says how qstrat checked the installed version);
        ImportError without vLLM.
    """
    version = vllm_version()
    if is_supported(version):
        return version
    raise VllmVersionError(
        f"{what} needs vLLM {names.SUPPORTED}; installed: vllm {version}. Install one: {names.INSTALL} "
        "(docs/compat.md: each release, as run)")


def resolve(key: str) -> Any:
    """The installed vLLM's object for table entry ``key`` (a module, class, function, enum
    member or other object, as the entry's ``kind`` says); for an ``attribute`` entry, the
    attribute's name, once its owner (the class or function that sets it) is found. Imports vLLM.

    Raises: VllmNameError naming the key, the installed vLLM version, the versions the table
        knows and what to do, when the table has no location for this version, records the name
        as absent, or the name is not where the table says; KeyError for a key not in the
        table; ImportError if vLLM is not installed.
    """
    version = vllm_version()
    spec, where = location(key, version)
    module, _, attrs = where.partition(":")
    path = attrs.split(".") if attrs else []
    is_attribute = names.TABLE[key].kind == "attribute"
    try:
        value = importlib.import_module(module)
        for attr in path[:-1] if is_attribute else path:
            value = getattr(value, attr)
    except (ImportError, AttributeError) as exc:
        e = names.TABLE[key]
        dotted = f"{module}.{attrs}" if attrs else module
        raise VllmNameError(
            f"qstrat needs vLLM's {key} ({e.what}) at {dotted}, missing in vllm {version} ({exc}); "
            f"qstrat's vLLM version table places it there for {spec}, checked against vllm "
            f"{known_versions()}.{_what_to_do(e)}") from exc
    return path[-1] if is_attribute else value
