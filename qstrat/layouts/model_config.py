"""Validation of the model config.json values qstrat derives tensor shapes from.

The layouts' tensor generators (:mod:`qstrat.layouts.skeleton`, :mod:`qstrat.plugins.builtin.layouts`) read sizes
and counts from an HF config: a value that is not a positive integer (``num_attention_heads: 0``,
a negative ``hidden_size``, ``"4096"``, ``true``) would otherwise end in a ZeroDivisionError, a
negative tensor dimension or a plan of empty matrices, and a huge count (``num_hidden_layers:
10**12``) in a run that never ends. :func:`check_model_config` refuses such a config before any
tensor is generated, naming the key, the value and the range; :data:`MAX_TENSORS` bounds the
generation itself (a config may be valid key by key and still imply too many tensors).

:class:`ModelConfig` is the config parsed once, at the door (``RefitDriver``, ``write_checkpoint``,
the CLI, the integrations, an engine's vLLM config): every layer below reads its typed attributes
(``config.hidden_size``, ``config.vision.depth``), never a config dict; only this module names
config.json keys in code (tests/test_model_config.py checks it by AST).
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator, Mapping
from functools import cached_property
from types import MappingProxyType
from typing import Any, Generic, TypeVar, overload

from qstrat.errors import ConfigError

#: The largest dimension a config may give (2^31 - 1: larger than any model's; tensor sizes
#: beyond it break the int32 indexing of most kernels).
MAX_DIM = 2**31 - 1
#: Decoder layers (the deepest published models have under 200).
MAX_LAYERS = 4096
#: Routed experts per layer (the largest published MoE has under 1,000).
MAX_EXPERTS = 65536
#: Tensors one config may imply (DeepSeek-V3 per expert: about 47,000).
MAX_TENSORS = 1_000_000

#: Integer config keys the built-in layouts read -> (minimum, maximum). Absent or null keys are
#: not checked here (a missing key the model needs is a KeyError naming it, raised by the
#: generator); a present one must be an integer in range.
INT_KEYS: Mapping[str, tuple[int, int]] = {
    "hidden_size": (1, MAX_DIM), "vocab_size": (1, MAX_DIM), "intermediate_size": (1, MAX_DIM),
    "moe_intermediate_size": (1, MAX_DIM), "shared_expert_intermediate_size": (0, MAX_DIM),
    "num_attention_heads": (1, MAX_DIM), "num_key_value_heads": (1, MAX_DIM), "head_dim": (1, MAX_DIM),
    "num_hidden_layers": (1, MAX_LAYERS), "num_nextn_predict_layers": (0, MAX_LAYERS),
    "num_experts": (0, MAX_EXPERTS), "n_routed_experts": (0, MAX_EXPERTS), "num_local_experts": (0, MAX_EXPERTS),
    "n_shared_experts": (0, MAX_EXPERTS), "first_k_dense_replace": (0, MAX_LAYERS),
    "decoder_sparse_step": (1, MAX_LAYERS), "full_attention_interval": (1, MAX_LAYERS),
    "q_lora_rank": (1, MAX_DIM), "kv_lora_rank": (1, MAX_DIM), "qk_nope_head_dim": (0, MAX_DIM),
    "qk_rope_head_dim": (0, MAX_DIM), "v_head_dim": (1, MAX_DIM),
    "linear_num_key_heads": (1, MAX_DIM), "linear_num_value_heads": (1, MAX_DIM),
    "linear_key_head_dim": (1, MAX_DIM), "linear_value_head_dim": (1, MAX_DIM),
    "linear_conv_kernel_dim": (1, MAX_DIM),
}

#: Boolean config keys the built-in layouts and checks read (a string "false" is truthy in Python:
#: read as is, it would tie the head of an untied model).
BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "qkv_bias", "mlp_bias")

T = TypeVar("T")
_REQUIRED: Any = object()


def language_config(hf_config: Any) -> Any:
    """The language model's config: the ``text_config`` of a multimodal config (when set and not
    empty), else the config itself - the one place qstrat says where a multimodal model's text
    config lives (transformers' ``PretrainedConfig.get_text_config()`` and vLLM's
    ``get_quant_config`` look there too).

    Args: hf_config: config.json as a mapping, or an HF config object (``PretrainedConfig``:
        its ``text_config`` attribute), or None.
    Returns: a mapping for a mapping (``{}`` for None or an empty one), an object for an object.
    Raises: ConfigError if a mapping's ``text_config`` is set but not a mapping.
    """
    if hf_config is None:
        return {}
    if not isinstance(hf_config, Mapping):
        text = getattr(hf_config, "text_config", None)
        return text if text is not None else hf_config
    if not hf_config:
        return {}
    text = hf_config.get("text_config")
    if text is None:
        return hf_config
    if not isinstance(text, Mapping):
        raise ConfigError(f"model config: text_config must be a mapping (the language model's config), got "
                          f"{type(text).__name__} {text!r}")
    return text or hf_config


def with_language_config(hf_config: Mapping[str, Any], text: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``hf_config`` whose language config (:func:`language_config`) is ``text``: its
    ``text_config`` replaced where it has one, else ``text`` itself (the config is its own).

    Raises: ConfigError as :func:`language_config`.
    """
    if language_config(hf_config) is hf_config:
        return dict(text)
    return {**hf_config, "text_config": dict(text)}


def check_model_config(hf_config: Mapping[str, Any], num_layers_key: str = "num_hidden_layers",
                       extra: Mapping[str, tuple[int, int]] | None = None) -> None:
    """Refuse a model config whose shape keys are not integers in range.

    Checks :data:`INT_KEYS` (plus ``extra``, and ``num_layers_key`` as a layer count) in the language
    config (:func:`language_config`): each present, non-null value an integer (not a bool, not a
    float or string) within its range.

    Also :data:`BOOL_KEYS`: each present, non-null value a bool (in the language config and at
    the top level).

    Raises: ConfigError naming the first bad key, its value and the range
        (``model config: num_attention_heads must be an integer in 1..2147483647, got 0``).
    """
    c = language_config(hf_config)
    keys = {**INT_KEYS, num_layers_key: (1, MAX_LAYERS), **(extra or {})}
    for key, (lo, hi) in keys.items():
        value = c.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            limit = (f" (qstrat's limit: a larger {key} is no real model)" if isinstance(value, int)
                     and not isinstance(value, bool) and value > hi else "")
            raise ConfigError(f"model config: {key} must be an integer in {lo}..{hi}, got {value!r}{limit}")
    for config in {id(c): c, id(hf_config): hf_config}.values():  # tie_word_embeddings may sit at the top
        for key in BOOL_KEYS:
            value = config.get(key)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"model config: {key} must be true or false (a JSON boolean), got {value!r}")


def bounded(items: Iterable[T], what: str, limit: int = MAX_TENSORS) -> Iterator[T]:
    """``items``, refusing past ``limit`` of them.

    Raises: ConfigError (``model config: it implies more than 1000000 tensors ...``) at item
        ``limit + 1``.
    """
    for i, item in enumerate(items):
        if i == limit:
            raise ConfigError(f"model config: it implies more than {limit} tensors ({what}); qstrat's limit "
                              "is far above any real model's count - check the config's layer and expert counts")
        yield item


def string_keys(*sections: Mapping[Any, Any]) -> None:
    """Raises: ConfigError for a key that is not a string (config.json's are; a Python dict's may
    not be, and would break :attr:`ModelConfig.key`'s sorted JSON)."""
    for section in sections:
        bad = next((k for k in section if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(f"model config: keys must be strings (config.json's), got {bad!r}")


def mapping(value: Any, key: str, what: str) -> bool:
    """Whether config section ``value`` is set (truthy). Raises: ConfigError naming ``key`` and
    ``what`` it holds when it is set but not a mapping."""
    if value and not isinstance(value, Mapping):
        raise ConfigError(f"model config: {key} must be a mapping ({what}), got {type(value).__name__} {value!r}")
    return bool(value)


class ConfigKey(Generic[T]):
    """One config.json key of a :class:`ConfigSection`, read as ``kind`` (``int``, ``bool``,
    ``str``, ``tuple``): the attribute's name is the key. An absent or null key gives ``default``,
    or KeyError naming the key when it has none (a key the model needs)."""

    def __init__(self, kind: Any = int, default: Any = _REQUIRED) -> None:
        self.kind, self.default, self.key = kind, default, ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = name

    @overload
    def __get__(self, section: None, owner: type) -> ConfigKey[T]: ...
    @overload
    def __get__(self, section: ConfigSection, owner: type) -> Any: ...

    def __get__(self, section: ConfigSection | None, owner: type) -> Any:
        if section is None:
            return self
        value = section.value(self.key)
        if value is None:
            if self.default is _REQUIRED:
                raise KeyError(self.key)
            return self.default
        if self.kind is bool and not isinstance(value, bool):  # bool("false") is True
            raise ConfigError(f"model config: {self.key} must be true or false (a JSON boolean), got {value!r}")
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, int)):  # int(2.5) is 2
            raise ConfigError(f"model config: {self.key} must be an integer, got {value!r}")
        if self.kind is tuple and not isinstance(value, (list, tuple)):  # tuple("full") is ('f', 'u', 'l', 'l')
            raise ConfigError(f"model config: {self.key} must be a list, got {value!r}")
        if self.kind is str and not isinstance(value, str):
            raise ConfigError(f"model config: {self.key} must be a string, got {value!r}")
        return self.kind(value)


class ConfigSection:
    """A read-only section of a model config (the language model's, the vision tower's): typed
    attributes (:class:`ConfigKey`) over config.json values kept as given."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values: Mapping[str, Any] = MappingProxyType(dict(values))

    def value(self, key: str) -> Any:
        """Key ``key`` as config.json gives it (None when absent): for keys a layout names in its
        data (``num_layers_key``, ``num_experts_keys``), which no typed attribute covers."""
        return self._values.get(key)

    def known(self, attribute: str) -> Any:
        """Typed attribute ``attribute`` (a :class:`ConfigKey`), or None where the config lacks a key
        the attribute requires (``config.known("num_attention_heads")``: a check that has nothing
        to check without it). Raises: AttributeError for a name that is no ConfigKey."""
        if not isinstance(getattr(type(self), attribute, None), ConfigKey):
            raise AttributeError(f"{type(self).__name__} has no config key attribute {attribute!r}")
        try:
            return getattr(self, attribute)
        except KeyError:
            return None

    def required(self, key: str) -> Any:
        """Key ``key`` as given. Raises: KeyError naming it when absent or null."""
        value = self._values.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def values(self) -> Mapping[str, Any]:
        """The section's keys and values, read-only (what a checkpoint's config.json is written from)."""
        return self._values


class VisionConfig(ConfigSection):
    """A vision tower's config (``vision_config``; Qwen3.5's ``Qwen3_5MoeVisionModel`` keys,
    each required where the tower is generated: KeyError naming it)."""

    hidden_size = ConfigKey(int)
    intermediate_size = ConfigKey(int)
    patch_size = ConfigKey(int)
    spatial_merge_size = ConfigKey(int)
    in_channels = ConfigKey(int)
    temporal_patch_size = ConfigKey(int)
    num_position_embeddings = ConfigKey(int)
    depth = ConfigKey(int)
    out_hidden_size = ConfigKey(int)


class ModelConfig(ConfigSection):
    """A model's HF config parsed once (config.json as a mapping, or a transformers config):
    the language model's keys as typed attributes (the ``text_config`` of a multimodal config,
    :func:`language_config`), and the top-level facts (:attr:`architectures`, :attr:`model_type`,
    :attr:`vision`, :attr:`quantization_config`, :attr:`raw`). Read-only; built with :meth:`of`.

    Attributes read as HF's modeling code reads them: absent or null gives the default
    (``attention_bias`` False, ``head_dim`` None: ``hidden_size // num_attention_heads``), and a
    key without one raises KeyError naming it (``hidden_size``). :func:`check_model_config`
    (:meth:`check`) refuses values that are not integers in range; the attributes convert
    (``int(...)``) as the generators always did.
    """

    hidden_size = ConfigKey()
    vocab_size = ConfigKey()
    intermediate_size = ConfigKey()
    moe_intermediate_size = ConfigKey(int, None)
    shared_expert_intermediate_size = ConfigKey(int, 0)
    n_shared_experts = ConfigKey(int, 0)
    num_attention_heads = ConfigKey()
    num_key_value_heads = ConfigKey(int, None)
    head_dim = ConfigKey(int, None)
    attention_bias = ConfigKey(bool, False)
    qkv_bias = ConfigKey(bool, None)
    tie_word_embeddings = ConfigKey(bool, False)
    layer_types = ConfigKey(tuple, ())
    full_attention_interval = ConfigKey(int, None)
    mlp_only_layers = ConfigKey(tuple, ())
    decoder_sparse_step = ConfigKey(int, None)
    first_k_dense_replace = ConfigKey(int, 0)
    topk_method = ConfigKey(str, None)
    n_group = ConfigKey(int, None)
    q_lora_rank = ConfigKey(int, None)
    kv_lora_rank = ConfigKey(int, None)
    qk_nope_head_dim = ConfigKey()
    qk_rope_head_dim = ConfigKey()
    v_head_dim = ConfigKey()
    linear_num_key_heads = ConfigKey()
    linear_num_value_heads = ConfigKey()
    linear_key_head_dim = ConfigKey()
    linear_value_head_dim = ConfigKey()
    linear_conv_kernel_dim = ConfigKey()
    language_model_type = property(lambda self: self.value("model_type"),
                                   doc="The language model's ``model_type`` (``qwen3_moe``; None if unset).")

    def __init__(self, raw: Mapping[str, Any]) -> None:
        raw = copy.deepcopy(dict(raw))
        text = language_config(raw)
        string_keys(raw, text)
        super().__init__(text)
        self.raw: Mapping[str, Any] = MappingProxyType(raw)
        #: whether the language model's config is a ``text_config`` (a multimodal model)
        self.multimodal = text is not raw and bool(raw)

    @classmethod
    def of(cls, config: Any) -> ModelConfig:
        """The door: ``config`` parsed (itself when already a ModelConfig). ``config``: config.json
        content (a mapping), a transformers ``PretrainedConfig`` (``to_dict()``), or None (an
        empty config: the facts it would give are unknown).
        Raises: ConfigError for anything else, or a ``text_config`` that is not a mapping."""
        if isinstance(config, ModelConfig):
            return config
        if config is None:
            return cls({})
        if isinstance(config, Mapping):
            return cls(config)
        if callable(getattr(config, "to_dict", None)):
            name = type(config).__name__
            try:
                values = config.to_dict()
            except Exception as exc:  # a foreign object's to_dict: say whose call failed
                raise ConfigError(f"hf_config: {name}.to_dict() failed: {type(exc).__name__}: {exc}") from exc
            if not isinstance(values, Mapping):
                raise ConfigError(f"hf_config: {name}.to_dict() must return the config as a mapping, got "
                                  f"{type(values).__name__}")
            return cls(values)
        raise ConfigError(f"hf_config must be the model's config.json content (a mapping) or a transformers "
                          f"config (model.config), got {type(config).__name__}")

    def __bool__(self) -> bool:
        return bool(self.raw)

    def __repr__(self) -> str:
        return f"ModelConfig({dict(self.raw)!r})"

    def to_dict(self) -> dict[str, Any]:
        """config.json as given, a fresh copy (what a checkpoint's config.json starts from)."""
        return copy.deepcopy(dict(self.raw))

    @cached_property
    def key(self) -> str:
        """The config's identity for caches: its JSON, keys sorted (``repr`` for non-JSON values)."""
        return json.dumps(dict(self.raw), sort_keys=True, default=repr)

    @cached_property
    def architectures(self) -> tuple[str, ...]:
        """``architectures`` (model class names); ``()`` when absent or null.
        Raises: ConfigError for anything but a list of strings."""
        archs = self.raw.get("architectures")
        if archs is not None and (not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs)):
            raise ConfigError(f"model config: architectures must be a list of class names (strings), got {archs!r}")
        return tuple(archs or ())

    @cached_property
    def model_type(self) -> str | None:
        """``model_type`` at the top, else the language model's; None when neither says.
        Raises: ConfigError for a value that is not a string."""
        model_type = self.raw.get("model_type") or self.language_model_type
        if model_type is not None and not isinstance(model_type, str):
            raise ConfigError(f"model config: model_type must be a string, got {model_type!r}")
        return model_type

    @property
    def top_model_type(self) -> Any:
        """The top-level ``model_type`` alone (a multimodal wrapper's: ``qwen3_5_moe``)."""
        return self.raw.get("model_type")

    @cached_property
    def vision(self) -> VisionConfig | None:
        """The vision tower's config (``vision_config``), or None when the model has none."""
        vision = self.raw.get("vision_config")
        return VisionConfig(vision) if mapping(vision, "vision_config", "the vision tower's config") else None

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        """The checkpoint ``quantization_config`` where vLLM reads it (``get_quant_config``): the
        config's own, else its language model's, else ``compression_config``; None when unquantized."""
        cfg = self.raw.get("quantization_config")
        if cfg is None and self.multimodal:
            cfg = self.value("quantization_config")
        key = "quantization_config"
        if cfg is None:
            cfg, key = self.raw.get("compression_config"), "compression_config"
        return dict(cfg) if mapping(cfg, key, "a checkpoint's quantization config") else None

    def with_quantization(self, quantization_config: Mapping[str, Any] | None) -> ModelConfig:
        """A copy whose every quantization config vLLM reads is ``quantization_config``: the
        top-level key set to it (removed for None), ``compression_config`` and a ``text_config``'s
        ``quantization_config`` removed (a checkpoint's config.json holds one, its own)."""
        cfg = self.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("compression_config", None)
        if self.multimodal and "quantization_config" in self.values():
            cfg = with_language_config(cfg, {k: v for k, v in self.values().items() if k != "quantization_config"})
        if quantization_config is not None:
            cfg["quantization_config"] = dict(quantization_config)
        return ModelConfig(cfg)

    def with_architectures(self, architectures: Iterable[str]) -> ModelConfig:
        """A copy whose ``architectures`` is ``architectures`` (an output config.json's, filled in)."""
        cfg = self.to_dict()
        cfg["architectures"] = list(architectures)
        return ModelConfig(cfg)

    def with_language(self, **values: Any) -> ModelConfig:
        """A copy whose language model's config has ``values`` (a family's default filled in)."""
        return ModelConfig(with_language_config(self.raw, {**self.values(), **values}))

    def check(self, num_layers_key: str = "num_hidden_layers") -> None:
        """:func:`check_model_config` on this config, and the sections read as mappings
        (``vision_config``, ``quantization_config``). Raises: ConfigError as they do."""
        check_model_config(self.raw, num_layers_key)
        _ = self.vision, self.quantization_config
