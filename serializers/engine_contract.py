"""A format's engine contract: which engine ``quantization_config`` it serves, and why not.

vLLM decides per quantization method whether a checkpoint's config is its own
(``Fp8Config.from_config``, ``ModelOptQuantConfigBase.from_config``,
``CompressedTensorsConfig.from_config``); qstrat does the same per format:
:meth:`qstrat.serializers.Serializer.engine_config_mismatch` says why a format does NOT serve a
config (None: it does), and ``matches_engine_config`` is its yes/no. The default rule, kept from
before formats owned it, compares :data:`MATCH_KEYS` of the format's own
``vllm_quantization_config`` with the engine's; a format whose method has more to tell apart (a
compressed-tensors scheme) overrides ``engine_config_mismatch`` and compares more keys with
:func:`config_difference`.

Used by :func:`qstrat.engine_manifest.engine_format` (which registered format an engine serves)
and :func:`qstrat.engine_manifest.plan_format_mismatch` (is the plan's format the engine's).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

#: quantization_config keys the default rule compares (the keys vLLM's fp8 and ModelOpt
#: configs are told apart by: method, ModelOpt algorithm, FP8 tile, NVFP4 block).
MATCH_KEYS = ("quant_method", "quant_algo", "weight_block_size", "group_size")

_MISSING = object()
R = TypeVar("R")


def config_difference(mine: Mapping[str, Any] | None, engine: Mapping[str, Any], keys: Sequence[str],
                      fmt: str, prefix: str = "quantization_config.") -> str | None:
    """The first of ``keys`` on which the format's config and the engine's differ, as a refusal
    reason, or None when they agree on all of them.

    Args:
        mine: the format's ``vllm_quantization_config``; engine: the engine's.
        keys: key paths, dotted for nested dicts (``"weights.num_bits"``); a key absent from a
            config reads as None (so absent on both sides agrees). Lists and tuples compare equal.
        fmt: the format's name (for the message); prefix: where ``mine``/``engine`` sit in the
            engine's config.json (nested callers pass ``quantization_config.config_groups.g.``).
    Returns: ``"quantization_config.KEY: engine has ENGINE_VALUE, FMT writes MY_VALUE"`` or None.
    """
    for key in keys:
        a, b = _get(mine or {}, key), _get(engine, key)
        if _norm(a) != _norm(b):
            return f"{prefix}{key}: engine has {_show(b)}, {fmt} writes {_show(a)}"
    return None


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(cfg, Mapping):
            return None
        cfg = cfg.get(part, _MISSING)
        if cfg is _MISSING:
            return None
    return cfg


def _norm(v: Any) -> Any:
    return [_norm(x) for x in v] if isinstance(v, (list, tuple)) else v


def _show(v: Any) -> str:
    return "none" if v is None else repr(_norm(v))


class on_defaults(Generic[R]):  # noqa: N801 - used as a decorator, like classmethod
    """Method decorator: on an instance it is the plain method; on the class it runs on an
    instance with default options (``Fp8Config.from_config`` style: ``BlockFP8.matches_engine_config(cfg)``).

    Called on the class of a format whose options have no defaults it raises what the
    constructor raises (pydantic ``ValidationError``).
    """

    def __init__(self, fn: Callable[..., R]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __get__(self, obj: Any, cls: type | None = None) -> Callable[..., R]:
        if obj is None:
            return lambda *args, **kwargs: self.fn(cls(), *args, **kwargs)  # type: ignore[misc]
        return functools.partial(self.fn, obj)
