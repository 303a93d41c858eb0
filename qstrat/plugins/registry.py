"""The plugin registry: a pluggy PluginManager over the ``qstrat`` entry-point group.

:class:`Registry` loads every plugin (the built-ins included, via the same entry point),
collects serializers, selectors, strategy presets and layouts, validates each, and refuses
duplicate names. :func:`get_registry` returns the process-wide instance.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pluggy

from qstrat import hookspecs
from qstrat.config.schema import PresetConfig, RefitConfig
from qstrat.errors import ConfigError, PluginError
from qstrat.layouts.model_layout import ModelLayout
from qstrat.plugins.selector import Selector
from qstrat.serializers.base import Serializer
from qstrat.strategies import Strategy
from qstrat.config.validation import close_matches, format_validation_error

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """A registered plugin object and where it came from (``plugin name (distribution version)``)."""

    name: str
    obj: T
    origin: str


class Registry:
    """All plugins of one process.

    Args:
        plugins: extra plugin objects/modules to register (tests, in-process plugins).
        entry_points: load the ``qstrat`` entry-point group (built-ins and installed plugins).
    Raises:
        PluginError: a hook returned a malformed object or a name registered twice.
    """

    KINDS = ("serializers", "selectors", "strategies", "layouts")

    def __init__(self, plugins: Iterable[object] = (), entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        if entry_points:
            try:
                self.pm.load_setuptools_entrypoints(hookspecs.PROJECT)
            except Exception as exc:  # a plugin module that does not import: name its entry point
                raise PluginError(_entry_point_failure(exc)) from exc
        if self.pm.get_plugin("builtin") is None:  # running from a source tree, not installed
            from qstrat.plugins import builtin

            self.pm.register(builtin, name="builtin")
        for plugin in plugins:
            self._register(plugin)
        try:
            self.pm.check_pending()  # a misspelled hook would otherwise be ignored silently
        except pluggy.PluginValidationError as exc:
            hooks = ", ".join(n for n in dir(hookspecs) if n.startswith("qstrat_"))
            raise PluginError(f"{exc}; qstrat hooks are: {hooks}") from exc
        origins = {id(p): f"{dist.project_name} {dist.version}" for p, dist in self.pm.list_plugin_distinfo()}
        self._origins = {self.pm.get_name(p): origins.get(id(p), "in-process") for p in self.pm.get_plugins()}
        self.serializers: dict[str, Entry[type[Serializer]]] = self._collect("qstrat_serializers", _check_serializer)
        self.selectors: dict[str, Entry[Selector]] = self._collect("qstrat_selectors", _check_selector)
        self.strategies: dict[str, Entry[Strategy]] = self._collect("qstrat_strategies", _check_instance(Strategy))
        self.layouts: dict[str, Entry[ModelLayout]] = self._collect("qstrat_layouts", _check_layout)
        self._check_layout_claims()
        self._check_strategies()

    def _register(self, plugin: object) -> None:
        """Register an in-process plugin under a readable name (module or class name, not an id).
        A plugin already registered (the same module installed under the ``qstrat`` entry point
        and also passed in ``plugins=``) is registered once: its hooks are already active."""
        if any(p is plugin for p in self.pm.get_plugins()):  # identity: pluggy's is_registered uses ==
            return
        base = getattr(plugin, "__name__", None) or type(plugin).__name__
        name, i = base, 1
        while self.pm.get_plugin(name) is not None:
            i += 1
            name = f"{base}#{i}"
        try:
            hash(plugin)
        except TypeError as exc:  # pluggy keys its plugins by the object
            raise PluginError(f"plugin {name}: a plugin must be hashable (a module, a class, or an object "
                              f"without __hash__ = None; {type(plugin).__name__} defines __eq__ without "
                              f"__hash__?): {exc}") from exc
        try:
            self.pm.register(plugin, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:  # ValueError: pluggy's name clashes
            raise PluginError(f"plugin {name}: {exc}") from exc

    def _collect(self, hook: str, check: Callable[[Any, str], str]) -> dict[str, Entry[Any]]:
        found: dict[str, Entry[Any]] = {}
        for impl in reversed(getattr(self.pm.hook, hook).get_hookimpls()):
            origin = f"{impl.plugin_name} ({self._origins.get(impl.plugin_name, 'in-process')})"
            try:
                result = impl.function()
            except Exception as exc:
                raise PluginError(f"{origin}: hook {hook} raised {type(exc).__name__}: {exc}") from exc
            if not isinstance(result, (list, tuple)):
                raise PluginError(f"{origin}: hook {hook} must return a list, got {_short(result)}")
            for obj in result:
                name = check(obj, f"{origin}: {hook}")
                if name in found:
                    raise PluginError(
                        f"{hook}: name {name!r} is registered by both {found[name].origin} and {origin}"
                    )
                found[name] = Entry(name, obj, origin)
        return found

    def _check_layout_claims(self) -> None:
        """Two layouts claiming one HF ``architectures`` entry or ``model_type``: detection
        (:func:`qstrat.layouts.model_layout.detect_layout`) would pick one by registration order, silently -
        a plugin layout claiming ``LlamaForCausalLM`` would replace the built-in for every Llama.
        Raise PluginError naming the value, both layouts and their plugins."""
        claims: dict[tuple[str, str], Entry[ModelLayout]] = {}
        problems = []
        for entry in self.layouts.values():
            layout = entry.obj
            for what, values in (("architecture", layout.architectures), ("model_type", layout.model_types)):
                for value in values:
                    other = claims.setdefault((what, value), entry)
                    if other is not entry:
                        problems.append(f"{what} {value!r} is claimed by layout {other.name!r} from {other.origin} "
                                        f"and layout {entry.name!r} from {entry.origin}")
        if problems:
            raise PluginError("qstrat_layouts: " + "; ".join(problems) + ": detection would pick one of them "
                              "silently; claim each architecture and model_type in one layout (a config picks "
                              "any layout by name: `layout: NAME`)")

    def _check_strategies(self) -> None:
        for entry in self.strategies.values():
            if not isinstance(entry.obj.config, (Mapping, PresetConfig)):
                raise PluginError(f"strategy {entry.name!r} from {entry.origin}: config must be a mapping "
                                  f"(a partial RefitConfig), got {type(entry.obj.config).__name__}")
            try:
                RefitConfig.from_mapping(entry.obj.mapping(), registry=self)
            except ConfigError as exc:
                raise PluginError(f"strategy {entry.name!r} from {entry.origin} is invalid: {exc}") from exc

    def serializer(self, name: str, **options: Any) -> Serializer:
        """Instantiate a registered serializer.

        Raises: ConfigError for an unknown name (listing the valid ones); pydantic
        ValidationError for invalid options.
        """
        return self.lookup("serializers", name).obj(**options)

    def lookup(self, kind: str, name: str) -> Entry[Any]:
        """Entry ``name`` of ``kind`` (one of :attr:`KINDS`). Raises ConfigError listing choices."""
        table: Mapping[str, Entry[Any]] = getattr(self, kind)
        if name not in table:
            raise ConfigError(f"unknown {_SINGULAR[kind]} {name!r}; {close_matches(str(name), table)}"
                              f"valid: {', '.join(sorted(table))}")
        return table[name]


_SINGULAR = {"serializers": "serializer", "selectors": "selector", "strategies": "strategy",
             "layouts": "layout"}


def _check_serializer(obj: Any, where: str) -> str:
    if not (inspect.isclass(obj) and issubclass(obj, Serializer)):
        raise PluginError(f"{where}: expected a Serializer subclass, got {obj!r}")
    name = obj.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise PluginError(f"{where}: serializer {obj.__qualname__} has no 'name' class attribute of its own (a non-empty str)")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise PluginError(f"{where}: serializer {name!r} does not implement: {missing}")
    return name


def _check_instance(cls: type) -> Callable[[Any, str], str]:
    def check(obj: Any, where: str) -> str:
        if not isinstance(obj, cls):
            raise PluginError(f"{where}: expected {cls.__name__}, got {obj!r}")
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name.strip():
            raise PluginError(f"{where}: {cls.__name__} needs a non-empty str name, got {name!r} in {_short(obj)}")
        return name

    return check


def _check_selector(obj: Any, where: str) -> str:
    """A :class:`Selector` whose ``predicate`` is callable and ``special`` a bool."""
    name = _check_instance(Selector)(obj, where)
    if not callable(obj.predicate):
        raise PluginError(f"{where}: selector {name!r}: predicate must be a callable ParsedName -> bool, "
                          f"got {_short(obj.predicate)}")
    if not isinstance(obj.special, bool):
        raise PluginError(f"{where}: selector {name!r}: special must be a bool, got {obj.special!r}")
    return name


def _entry_point_failure(exc: Exception) -> str:
    """The message for a ``qstrat`` entry point that failed to load: the first one that fails
    again when loaded alone, with its distribution, else ``exc`` as pluggy raised it."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=hookspecs.PROJECT):
        try:
            ep.load()
        except Exception as again:
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown distribution"
            return (f"plugin entry point {ep.name!r} = {ep.value!r} (distribution {dist}) failed to load: "
                    f"{type(again).__name__}: {again}; fix or uninstall that distribution "
                    f"(pip uninstall {ep.dist.name if ep.dist is not None else '...'})")
    return f"loading the {hookspecs.PROJECT!r} plugin entry points failed: {type(exc).__name__}: {exc}"


def _check_layout(obj: Any, where: str) -> str:
    """A :class:`ModelLayout` whose fields have their annotated types (:mod:`qstrat.plugins.layout_checks`)."""
    from qstrat.plugins.layout_checks import check_layout

    name = _check_instance(ModelLayout)(obj, where)
    check_layout(obj, where)
    return name


def _short(obj: Any, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
    return _REGISTRY


def get_serializer(name: str, *, registry: Registry | None = None, **options: Any) -> Serializer:
    """A serializer by registry name, e.g. ``get_serializer("mxfp8", scale_rounding="floor")``.

    ``registry``: where ``name`` is looked up (None: this process's, :func:`get_registry`; a
    ``Registry(plugins=[...])``: a plugin's format without installing it, as
    ``RefitDriver(..., registry=)`` takes it).

    Raises: ConfigError (unknown name or invalid options, naming the option).
    """
    from pydantic import ValidationError

    try:
        return (registry if registry is not None else get_registry()).serializer(name, **options)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, prefix=f"serializer {name!r} options")) from exc
