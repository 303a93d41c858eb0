"""The plan's one engine ``quantization_config`` (:func:`engine_config`: every quantized format of
the plan must write the same) and the per-entry format lookups the whole-plan checks share."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from qstrat.errors import PluginError
from qstrat.plan.data import PASSTHROUGH, PlanEntry
from qstrat.serializers.base import EngineFormat, Serializer

#: ``(format name, options) -> Serializer`` (cached by the driver).
SerializerFactory = Callable[[str, Mapping[str, Any]], Serializer]


def format_lookup(serializer: SerializerFactory, entries: list[PlanEntry]) -> Callable[[PlanEntry], Serializer | None]:
    """``entry -> its Serializer`` (None: passthrough) for ``entries``: looked up once per format
    planned without options (nearly every entry; the factory gives them one instance), per entry
    otherwise."""
    plain = {name: serializer(name, {}) for name in {e.serializer for e in entries if not e.options}
             if name != PASSTHROUGH}

    def format_of(e: PlanEntry) -> Serializer | None:
        return serializer(e.serializer, e.options) if e.options else plain.get(e.serializer)

    return format_of

def engine_config(entries: list[PlanEntry], ignored: list[str], errors: list[str],
                  format_of: Callable[[PlanEntry], EngineFormat | None]) -> dict[str, Any] | None:
    """The one quantization_config all quantized formats of the plan agree on (or an error): the
    formats' engine contracts (:class:`~qstrat.serializers.engine_contract.EngineFormat`) only."""
    # each distinct format once (nearly every entry has no options: one lookup per format name)
    plain = {e.serializer: e for e in entries if not e.options}
    formats = map(format_of, [*plain.values(), *(e for e in entries if e.options)])
    used = {id(s): s for s in formats if s is not None and s.quantizes}
    configs: dict[str, dict[str, Any]] = {}
    for ser in used.values():
        cfg = ser.vllm_quantization_config(ignored)
        if cfg is not None and not isinstance(cfg, Mapping):
            raise PluginError(f"serializer {ser.name!r} ({type(ser).__module__}.{type(ser).__qualname__}): "
                              f"vllm_quantization_config must return a dict (the engine's quantization_config) "
                              f"or None, got {type(cfg).__name__} {cfg!r:.60}")
        configs.setdefault(repr(cfg), cfg)
    if len(configs) > 1:
        formats = sorted({s.name for s in used.values()})
        errors.append(f"the plan mixes quantized formats {formats} that one vLLM quantization_config "
                      f"cannot express; {_deciders(entries, formats)}: give every quantized rule one format "
                      "(or one set of options)")
    return next(iter(configs.values()), None)


def quantizes_lookup(format_of: Callable[[PlanEntry], EngineFormat | None]) -> Callable[[PlanEntry], bool]:
    """``entry -> whether its format quantizes`` (False for passthrough), asked once per format
    name for entries planned without options."""
    plain: dict[str, bool] = {}  # format name -> quantizes, for entries without options

    def quantizes(e: PlanEntry) -> bool:
        if not e.options and e.serializer in plain:
            return plain[e.serializer]
        q = (ser := format_of(e)) is not None and ser.quantizes
        if not e.options:
            plain[e.serializer] = q
        return q

    return quantizes


def _deciders(entries: list[PlanEntry], formats: list[str]) -> str:
    """``rules[0] gives block_fp8 (12 tensors, e.g. ...q_proj.weight); default gives mxfp8 (...)``:
    which config rule chose each of the mixed formats, so the message says what to change."""
    by: dict[tuple[str, str], list[str]] = {}
    for e in entries:
        if e.serializer in formats:
            by.setdefault((e.rule, e.serializer), []).append(e.name)
    return "; ".join(f"{rule} gives {fmt} ({len(names)} tensors, e.g. {names[0]})"
                     for (rule, fmt), names in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])))
