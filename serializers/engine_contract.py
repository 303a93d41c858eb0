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

The default rule compares configs as vLLM 0.32 READS them (:func:`vllm_reading`), not as they
are spelled: ``quant_algo`` upper-cased, ``group_size`` as an integer (``"16"`` is 16), the nested
``{"quantization": {...}}`` ModelOpt form and its producer-only hf_quant_config.json variant,
MiniMax-style ``quant_method: mxfp8`` (ModelOpt MXFP8); a config vLLM refuses is refused naming
the key (:class:`EngineConfigRefused`).

:class:`EngineFormat` is this contract as a format's methods (one of the three jobs
:class:`qstrat.serializers.Serializer` joins: the math, this contract, the emulation hooks).

Used by :func:`qstrat.vllm.checks.engine_manifest.engine_format` (which registered format an engine serves)
and :func:`qstrat.vllm.checks.engine_manifest.plan_format_mismatch` (is the plan's format the engine's).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

#: quantization_config keys the default rule compares (the keys vLLM's fp8 and ModelOpt
#: configs are told apart by: method, ModelOpt algorithm, FP8 tile, NVFP4 block).
MATCH_KEYS = ("quant_method", "quant_algo", "weight_block_size", "group_size")

#: ModelOpt algorithms vLLM 0.32 accepts (``modelopt.QUANT_ALGOS``), and which config class
#: (method) each selects (``override_quantization_method``).
MODELOPT_ALGOS = {"FP8": "modelopt", "FP8_PER_CHANNEL_PER_TOKEN": "modelopt", "FP8_PB_WO": "modelopt",
                  "NVFP4": "modelopt_fp4", "W4A16_NVFP4": "modelopt_fp4", "MXFP8": "modelopt_mxfp8",
                  "MIXED_PRECISION": "modelopt_mixed"}
#: Fields vLLM requires in the nested ModelOpt form, per config class (``_from_config``).
NESTED_REQUIRED = {"modelopt_fp4": ("group_size", "kv_cache_quant_algo", "exclude_modules"),
                   "modelopt_mxfp8": ("kv_cache_quant_algo", "exclude_modules")}

_MISSING = object()


class EngineConfigRefused(ValueError):
    """vLLM refuses this quantization_config when the engine starts (the message names the key)."""


def vllm_reading(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """:data:`MATCH_KEYS` of a ``quantization_config`` as vLLM 0.32 reads them.

    - ``quant_method``: lower-cased (``compressed_tensors`` -> ``compressed-tensors``); set from the
      nested ``quant_algo`` for a producer-only hf_quant_config.json (``producer.name: modelopt``:
      FP8 algorithms -> ``modelopt``, NVFP4 -> ``modelopt``; any other is refused, as
      ``ModelArchConfigConvertor._normalize_quantization_config`` does); every ModelOpt config class
      (``modelopt``, ``modelopt_fp4``, ``modelopt_mxfp8``, MiniMax-style ``mxfp8``) reads as
      ``modelopt`` - the algorithm tells them apart.
    - ``quant_algo`` (ModelOpt): from ``quantization.quant_algo`` in the nested form, else the flat
      key; ``MXFP8`` for MiniMax ``mxfp8`` without one; upper-cased; an NVFP4 config whose every
      config group has ``input_activations: null`` reads as ``W4A16_NVFP4`` (vLLM routes it so).
    - ``group_size`` (NVFP4 only; other classes do not read it): ``int()`` of the value, 16 when absent.
    - ``weight_block_size`` (``fp8`` only).

    Source: vLLM 0.32 ``ModelOptQuantConfigBase.from_config`` / ``_extract_modelopt_quant_algo``,
    ``ModelOptNvFp4Config._from_config``, ``ModelOptMxFp8Config.from_config``, ``Fp8Config.from_config``.

    Raises: EngineConfigRefused naming the key where vLLM refuses the config: a nested
        ``quantization`` that is not a mapping, a missing or unknown ``quant_algo``, a ``group_size``
        that is not an integer, a nested NVFP4/MXFP8 form without its required fields.
    """
    method = str(cfg.get("quant_method") or "").lower().replace("compressed_tensors", "compressed-tensors")
    nested = cfg.get("quantization", _MISSING)
    producer = cfg.get("producer")
    producer_name = producer.get("name") if isinstance(producer, Mapping) else None
    if producer_name == "modelopt" or (isinstance(nested, Mapping) and "modelopt_quant_config" in nested):
        algo = nested.get("quant_algo") if isinstance(nested, Mapping) else None
        if algo is not None:
            if str(algo).upper() not in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4"):
                raise EngineConfigRefused(f"quantization_config.quantization.quant_algo: vLLM refuses {algo!r} in "
                                          "an hf_quant_config.json with producer modelopt (Unknown ModelOpt quant algo)")
            method = "modelopt"
    if not (method.startswith("modelopt") or method == "mxfp8"):
        return {"quant_method": method or None, "quant_algo": cfg.get("quant_algo"),
                "weight_block_size": cfg.get("weight_block_size") if method == "fp8" else None,
                "group_size": None}
    where = "quantization_config.quantization."
    if nested is not _MISSING:
        if not isinstance(nested, Mapping):
            raise EngineConfigRefused(f"quantization_config.quantization: vLLM refuses {nested!r} (expected a "
                                      "mapping, the nested ModelOpt form)")
        source: Mapping[str, Any] = nested
    elif method == "mxfp8" and not cfg.get("quant_algo"):
        source, where = {"quant_algo": "MXFP8"}, "quantization_config."  # MiniMax-style
    else:
        source, where = cfg, "quantization_config."
    raw_algo = source.get("quant_algo")
    if not raw_algo:
        raise EngineConfigRefused(f"{where}quant_algo: missing; vLLM's ModelOpt config requires it")
    algo = str(raw_algo).upper()
    if algo not in MODELOPT_ALGOS:
        raise EngineConfigRefused(f"{where}quant_algo: vLLM refuses {raw_algo!r} (ModelOpt algorithms: "
                                  f"{', '.join(MODELOPT_ALGOS)})")
    klass = "modelopt_mxfp8" if method == "mxfp8" else MODELOPT_ALGOS[algo]
    if klass == "modelopt_mxfp8" and "MXFP8" not in algo:
        raise EngineConfigRefused(f"{where}quant_algo: vLLM's MXFP8 config (quant_method {method!r}) refuses "
                                  f"{raw_algo!r}")
    if nested is not _MISSING:
        missing = [k for k in NESTED_REQUIRED.get(klass, ()) if k not in source]
        if missing:
            raise EngineConfigRefused(f"{where}{missing[0]}: missing; vLLM requires {list(NESTED_REQUIRED[klass])} in "
                                      "the nested ModelOpt form")
    group_size = None
    if klass == "modelopt_fp4":
        raw = source.get("group_size")
        try:
            group_size = 16 if raw is None else int(raw)
        except (TypeError, ValueError):
            raise EngineConfigRefused(f"{where}group_size: vLLM refuses {raw!r} (must be an integer)") from None
        groups = cfg.get("config_groups")
        if algo == "NVFP4" and isinstance(groups, Mapping) and groups and all(
                isinstance(g, Mapping) and g.get("input_activations") is None for g in groups.values()):
            algo = "W4A16_NVFP4"
    return {"quant_method": "modelopt", "quant_algo": algo, "weight_block_size": None, "group_size": group_size}


def served_method(cfg: Mapping[str, Any]) -> str | None:
    """The quantization method a vLLM engine started on a checkpoint with ``quantization_config``
    ``cfg`` runs under (its ``ModelConfig.quantization``): the config class vLLM selects - ``fp8``,
    ``compressed-tensors``, ..., and for ModelOpt the class its algorithm selects
    (:data:`MODELOPT_ALGOS`: ``modelopt``, ``modelopt_fp4``, ``modelopt_mxfp8``,
    ``modelopt_mixed``; ``override_quantization_method``). None for a config without a method.

    Raises: EngineConfigRefused where vLLM refuses ``cfg`` (:func:`vllm_reading`)."""
    read = vllm_reading(cfg)
    method = read["quant_method"]
    return MODELOPT_ALGOS[read["quant_algo"]] if method == "modelopt" else method


def read_difference(mine: Mapping[str, Any], engine: Mapping[str, Any], fmt: str,
                    keys: Sequence[str] = MATCH_KEYS) -> str | None:
    """:func:`config_difference` of the two configs as vLLM reads them (:func:`vllm_reading`): the
    refusal names the key, the engine's value as written (and as vLLM reads it, where that
    differs) and the format's; or vLLM's own refusal of the engine's config.

    Returns: the reason, or None when vLLM reads both alike on ``keys``.
    """
    try:
        theirs = vllm_reading(engine)
    except EngineConfigRefused as exc:
        return str(exc)
    ours = vllm_reading(mine)
    for key in keys:
        a, b = ours.get(key), theirs.get(key)
        if _norm(a) != _norm(b):
            written = _get(engine, key)
            shown = _show(written) + ("" if _norm(written) == _norm(b) else f" (vLLM reads {_show(b)})")
            return f"quantization_config.{key}: engine has {shown}, {fmt} writes {_show(_get(mine, key))}"
    return None
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


class EngineFormat:
    """A format's engine contract: the ``quantization_config`` a checkpoint in it carries, which
    engine configs serve it, and the fused modules vLLM can load in it (vLLM's
    ``QuantizationConfig``: ``from_config`` / ``get_quant_method``). Reads no weight.

    Class attributes: ``name`` (registry name), ``quantizes`` (False for passthrough formats:
    modules using them go into the engine's ignore list).
    """

    name: ClassVar[str]
    quantizes: ClassVar[bool] = True

    def vllm_quantization_config(self, ignored: Sequence[str]) -> dict[str, Any] | None:
        """The engine's ``quantization_config`` for a checkpoint in this format.

        Args: ignored: vLLM module prefixes left unquantized (``model.layers.0.mlp.gate``).
        Returns: the config dict, or None for a passthrough format.
        """
        return None

    def engine_config_mismatch(self, quantization_config: Mapping[str, Any]) -> str | None:
        """Why an engine started with ``quantization_config`` does not serve this format's
        checkpoints (with these options), or None when it does. Override to tell apart configs
        the default rule cannot (compare more keys with
        :func:`~qstrat.serializers.engine_contract.config_difference`).

        Default: the format's own ``vllm_quantization_config([])`` and the engine's agree on
        :data:`~qstrat.serializers.engine_contract.MATCH_KEYS` as vLLM reads them
        (:func:`~qstrat.serializers.engine_contract.read_difference`: lower-case ``quant_algo``,
        ``group_size: "16"``, the nested ModelOpt form, MiniMax ``mxfp8`` are what vLLM accepts; a
        config vLLM refuses is refused naming the key); a passthrough format (no config) serves
        no quantized engine.

        Args: quantization_config: the engine's (its config.json ``quantization_config``).
        Returns: ``"quantization_config.KEY: engine has X, NAME writes Y"`` or None.
        """
        mine = self.vllm_quantization_config([])
        if mine is None:
            return f"{self.name} writes no quantization_config (a passthrough format)"
        return read_difference(mine, quantization_config, self.name)

    def engine_fusion_problem(self, rows: Sequence[int], experts: bool) -> str | None:
        """Why vLLM cannot load, in this format, one fused module made of members with these
        row counts, or None when it can. Checked at plan time for every engine-fused group
        (q/k/v, gate/up of a dense MLP: ``experts=False``; gate/up of routed experts, whose
        down_proj vLLM's fused-MoE layer builds with them: ``experts=True``), so that no
        checkpoint or refit reaches an engine that then fails on it (docs/formats.md).

        Default: None (formats whose scales are per row, e.g. MXFP8, NVFP4, load any split).

        Args: rows: each member's weight rows (N), in the engine's fused order (q, k, v;
            gate, up); experts: a routed experts module.
        Returns: the reason, naming the rule vLLM applies, or None.
        """
        return None

    @on_defaults
    def matches_engine_config(self, quantization_config: Mapping[str, Any]) -> bool:
        """Whether an engine started with ``quantization_config`` serves this format's
        checkpoints: :meth:`engine_config_mismatch` is None. On the class
        (``BlockFP8.matches_engine_config(cfg)``) it asks the format with default options.

        Raises: pydantic ValidationError (on the class) if the format's options have no defaults.
        """
        return self.engine_config_mismatch(quantization_config) is None

