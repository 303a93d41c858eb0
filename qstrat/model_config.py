"""Validation of the model config.json values qstrat derives tensor shapes from.

The layouts' tensor generators (:mod:`qstrat.skeleton`, :mod:`qstrat.builtin.layouts`) read sizes
and counts from an HF config: a value that is not a positive integer (``num_attention_heads: 0``,
a negative ``hidden_size``, ``"4096"``, ``true``) would otherwise end in a ZeroDivisionError, a
negative tensor dimension or a plan of empty matrices, and a huge count (``num_hidden_layers:
10**12``) in a run that never ends. :func:`check_model_config` refuses such a config before any
tensor is generated, naming the key, the value and the range; :data:`MAX_TENSORS` bounds the
generation itself (a config may be valid key by key and still imply too many tensors).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

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
