"""The refit configuration's schema (pydantic v2): :class:`RefitConfig`, its :class:`Rule` s,
:class:`KeepBF16` and a preset's :class:`PresetConfig`.

See :mod:`qstrat.config.loader` for an example and the strictness rules.

Plugin names (serializers, selectors, preset, layout) and serializer options are checked against
the registry given in the validation context (``RefitConfig.from_mapping(data, registry)``);
this module never picks one itself, so the registry may validate its own presets with these
models. Users load a config with :func:`qstrat.config.loader.load_config`, which defaults to the
process-wide registry.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from qstrat.errors import ConfigError
from qstrat.config.patterns import NamePattern
from qstrat.config.validation import NESTED_ERRORS, format_validation_error


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class KeepBF16(_Model):
    """First/last N decoder layers left unquantized whatever the rules say (MTP layers excluded):
    their quantizable matrices are sent as ``bf16``, and a router or other special kind that a
    rule opts in (``routers`` selector, ``allow_special``) is sent unchanged, as without that rule
    (:mod:`qstrat.config.rules`). A kept layer never holds a quantized tensor."""

    first: int = Field(0, ge=0, description="number of leading decoder layers kept in BF16")
    last: int = Field(0, ge=0, description="number of trailing decoder layers kept in BF16")


class Rule(_Model):
    """One rule: which tensors (selectors AND include AND NOT exclude) get which serializer."""

    select: list[str] = Field(["linear"], description="selector names; a tensor matches if ANY matches")
    include: list[str] = Field([], description="globs or 're:' regexes; if set, the checkpoint name "
                               "(wrappers stripped, the layout's renames applied) must match one")
    exclude: list[str] = Field([], description="globs or 're:' regexes; the checkpoint name must match none")
    serializer: str = Field(description="registered serializer name")
    options: dict[str, Any] = Field({}, description="serializer options (validated by the serializer)")
    on_unsupported: Literal["error", "bf16"] = Field(
        "error", description="shape the format cannot represent: plan error, or visible BF16 fallback")
    allow_special: bool = Field(
        False, description="let include patterns match routers/embeddings/lm_head (explicit opt-in)")

    @field_validator("select", "include", "exclude", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        """A single name for a list of one; a tuple (Python callers) for a list."""
        return [v] if isinstance(v, str) else list(v) if isinstance(v, tuple) else v

    @field_validator("select")
    @classmethod
    def _known_selectors(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if not v:
            raise ValueError("select needs at least one selector")
        reg = _registry(info)
        for name in v if reg is not None else ():
            reg.lookup("selectors", name)
        return v

    @field_validator("include", "exclude")
    @classmethod
    def _valid_patterns(cls, v: list[str]) -> list[str]:
        for text in v:
            try:
                NamePattern(text)
            except Exception as exc:  # re.error
                raise ValueError(f"invalid pattern {text!r}: {exc}") from exc
        return v

    @field_validator("serializer")
    @classmethod
    def _known_serializer(cls, v: str, info: ValidationInfo) -> str:
        reg = _registry(info)
        if reg is not None:  # None: a preset being defined; names are checked when the registry loads
            reg.lookup("serializers", v)
        return v

    @field_validator("options")
    @classmethod
    def _valid_options(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Options are validated by the serializer's Options model (strict, every error at
        once, each reported as ``rules[i].options.<key>``); skipped when the serializer name
        itself is invalid (that error is reported instead)."""
        reg = _registry(info)
        name = info.data.get("serializer")
        if reg is None or name not in reg.serializers:
            return v
        try:
            reg.serializers[name].obj.Options(**v)
        except ValidationError as exc:
            raise PydanticCustomError(NESTED_ERRORS, "invalid options",
                                      {"errors": [(e["loc"], e["msg"]) for e in exc.errors()]}) from exc
        return v


class PresetConfig(_Model):
    """A strategy preset's content: a partial :class:`RefitConfig` (every key optional).

    Define one with :meth:`define`, which validates its structure at once (keys, types,
    patterns, rule fields); the plugin names it uses (serializers, selectors, layout) are
    checked against the whole registry when the registry loads, so a preset may use any
    plugin's formats. A user's config extends it: user rules first, then the preset's;
    ``keep_bf16`` keys merged; other keys override. A preset may itself extend another
    (``preset: block-fp8``), merged the same way.
    """

    preset: str | None = None
    rules: list[Rule] = []
    keep_bf16: KeepBF16 | None = None
    default: str | None = None
    expert_emission: Literal["per_expert", "fused"] | None = None
    layout: str | None = None
    quantize_in: Literal["trainer", "engine"] | None = None

    @classmethod
    def define(cls, **fields: Any) -> PresetConfig:
        """Validate a preset's fields now. Raises ConfigError naming the key path."""
        try:
            return cls.model_validate(fields, context={"structural": True})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, model=cls)) from exc

    def to_mapping(self) -> dict[str, Any]:
        """The keys this preset sets, as a plain mapping (what :class:`RefitConfig` merges)."""
        return self.model_dump(mode="json", exclude_unset=True)


#: Which registry table each name-valued RefitConfig field is looked up in.
_REGISTRY_KIND = {"preset": "strategies", "default": "serializers", "layout": "layouts"}


class RefitConfig(_Model):
    """The whole strategy of a refit. Build it with :func:`load_config`.

    Attributes:
        preset: name of a registered strategy whose rules follow this config's own rules.
        rules: ordered rules; the first matching rule decides a tensor.
        keep_bf16: first/last decoder layers kept in BF16 (applies before any rule).
        default: serializer for matrices no rule matched (``bf16``).
        expert_emission: ``per_expert`` names (``experts.7.gate_proj.weight``, default, every vLLM)
            or ``fused`` slab names (``experts.gate_up_proj``, vLLM >= 0.32).
        layout: registered model layout; None detects it from the HF config.
        unplaced_weights: ``error`` (default) refuses weight matrices the layout cannot place;
            ``bf16`` sends them unchanged (see docs/models.md).
        wire_order: ``natural`` (model order, natural names; default) or ``producer`` (the
            order the trainer yields its tensors); see docs/concepts.md "Wire order".
        expert_batch: per-expert inputs of one layer with the same shape and format quantized
            together, at most this many experts per serializer call (1: one call per expert).
        quantize_in: where the plan's formats are applied: ``trainer`` (default: qstrat quantizes
            and sends the formats' tensors) or ``engine`` (qstrat sends BF16 and the engine
            quantizes it with vLLM's online quantization, whose config and ignore list qstrat
            writes from the same plan: :mod:`qstrat.vllm.online`, docs/modes.md).
    """

    preset: str | None = None
    rules: list[Rule] = []
    keep_bf16: KeepBF16 = KeepBF16()
    default: str = "bf16"
    expert_emission: Literal["per_expert", "fused"] = "per_expert"
    layout: str | None = None
    unplaced_weights: Literal["error", "bf16"] = Field(
        "error", description="weight matrices the layout cannot place: plan error, or sent unchanged "
        "(BF16) and listed in the engine's ignore list")
    wire_order: Literal["natural", "producer"] = "natural"
    expert_batch: int = Field(16, ge=1)
    quantize_in: Literal["trainer", "engine"] = Field(
        "trainer", description="trainer: qstrat sends the formats' quantized tensors; engine: qstrat sends "
        "BF16 and vLLM quantizes it online with the config and ignore list qstrat writes from the plan")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any, info: ValidationInfo) -> Any:
        """Merge a known preset into the config: its rules after the config's own, its keep_bf16
        under the config's (:func:`_merge_preset`); a preset that itself names a ``preset`` is
        expanded first, the same way (a cycle is an error naming it). Only well-typed parts are
        merged: a preset that is not a known strategy name, or a ``rules`` / ``keep_bf16`` of the
        wrong type, is left as given for field validation to report with its key path
        (``rules: Input should be a valid list``)."""
        if not isinstance(data, Mapping):
            return data
        name = data.get("preset")
        strategies = _registry(info).strategies
        if not isinstance(name, str) or name not in strategies:
            return data  # None, a wrong type or an unknown name: reported by _known_preset
        return _merge_preset(_expanded_preset(name, strategies, ()), data)

    @field_validator("preset", "default", "layout")
    @classmethod
    def _registered(cls, v: str | None, info: ValidationInfo) -> str | None:
        """preset, default and layout must name registered plugins (errors list the choices)."""
        if v is not None:
            _registry(info).lookup(_REGISTRY_KIND[info.field_name], v)
        return v

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], registry: Any) -> RefitConfig:
        """Validate a mapping against ``registry`` (a :class:`~qstrat.plugins.registry.Registry`: the names
        it registers, their options; :func:`qstrat.config.loader.load_config` passes the process-wide one).

        Raises: ConfigError with one line per problem and its key path.
        """
        try:
            return cls.model_validate(dict(data), context={"registry": registry})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, model=cls)) from exc

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the expanded config (preset rules included)."""
        return json.loads(self.model_dump_json())


def _keep_mapping(value: Any) -> Any:
    """A ``keep_bf16`` value as the keys it sets: a :class:`KeepBF16` object's set fields (so
    that ``KeepBF16(first=1)`` merges over a preset exactly as ``{"first": 1}`` does)."""
    return value.model_dump(exclude_unset=True) if isinstance(value, KeepBF16) else value


def _merge_preset(preset: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` over ``preset``: ``data``'s rules first, then the preset's; ``keep_bf16`` keys
    merged (``data``'s win); every other key of ``data`` overrides the preset's."""
    merged = {**preset, **data}
    if "rules" not in data:
        merged["rules"] = list(preset.get("rules", []))
    elif isinstance(data["rules"], (list, tuple)):
        merged["rules"] = list(data["rules"]) + list(preset.get("rules", []))
    mine, theirs = _keep_mapping(data.get("keep_bf16")), _keep_mapping(preset.get("keep_bf16"))
    if isinstance(theirs, Mapping) and isinstance(mine, Mapping):
        merged["keep_bf16"] = {**theirs, **mine}
    elif "keep_bf16" in data:
        merged["keep_bf16"] = mine
    return merged


def _expanded_preset(name: str, strategies: Mapping[str, Any], seen: tuple[str, ...]) -> dict[str, Any]:
    """Preset ``name``'s mapping with the presets it extends (its own ``preset`` key, in turn)
    merged in by :func:`_merge_preset`. Raises ValueError (reported on ``preset``) for a cycle."""
    if name in seen:
        raise ValueError(f"preset {name!r} extends itself: {' -> '.join((*seen, name))}")
    mapping = strategies[name].obj.mapping()
    base = mapping.get("preset")
    if isinstance(base, str) and base in strategies:
        mapping = _merge_preset(_expanded_preset(base, strategies, (*seen, name)), mapping)
    return mapping


def preset_rules(name: str | None, strategies: Mapping[str, Any]) -> list[Any]:
    """The rules preset ``name`` adds after a config's own (the presets it extends included;
    empty for None or an unknown name): the last ``len(...)`` rules of a config naming it."""
    if not name or name not in strategies:
        return []
    return list(_expanded_preset(name, strategies, ()).get("rules", []))


def _registry(info: ValidationInfo) -> Any:
    """The registry names are checked against (the validation context's ``registry``); None while
    a preset is being defined (``structural``: names are checked when the registry loads).

    Raises: ValueError (reported by pydantic) when there is neither: a RefitConfig or Rule built
    directly, without :func:`qstrat.config.loader.load_config` or :meth:`RefitConfig.from_mapping`.
    """
    context = info.context or {}
    if context.get("structural"):
        return None
    reg = context.get("registry")
    if reg is None:
        raise ValueError("plugin names are checked against a registry: build a config with "
                         "qstrat.load_config(mapping) or RefitConfig.from_mapping(mapping, registry)")
    return reg
