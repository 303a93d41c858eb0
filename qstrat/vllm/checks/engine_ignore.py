"""Which modules an engine keeps unquantized: vLLM's ignore-list rule, per quantization method.

An engine's ``quantization_config`` lists the modules it leaves unquantized, and each vLLM
quantization method reads that list by its OWN rule (vLLM 0.32). qstrat must read it the same way:
a module qstrat thinks quantized but the engine keeps in BF16 gets quantized bytes it misreads,
and the reverse refuses a valid checkpoint. The rules, read from vLLM 0.32's source:

- ``fp8`` (``Fp8Config``: list ``ignored_layers``, else ``modules_to_not_convert``):
  ``quant_utils.is_layer_skipped(..., match_mode="exact")``. A module is skipped when its prefix
  IS an entry. A fused module (``qkv_proj``) is skipped when its fused prefix is an entry, else
  when every shard (``q_proj``, ``k_proj``, ``v_proj``) is one; some but not all shards is an
  error at engine start. A module whose prefix contains ``experts`` (routed AND shared experts) is
  skipped when its prefix is a SUBSTRING of an entry that contains ``experts`` (``...experts.0.
  gate_proj`` skips the whole ``...experts`` module).
- ModelOpt (``modelopt``, ``modelopt_fp4``, ``modelopt_mxfp8``, and MiniMax-style ``mxfp8``; list
  ``ignore`` in config.json, ``quantization.exclude_modules`` in the nested hf_quant_config.json form,
  ``ignored_layers`` for ``mxfp8`` without ``quant_algo``): ``ModelOptQuantConfigBase.
  is_layer_excluded``: the exact rule above, then ANY entry that is a substring of the prefix
  (``"lm_head"``, ``"mlp.gate"``, ``"model.layers.0."`` - the last one excludes all of layer 0; also
  after stripping a leading ``language_model.``), then ``fnmatch`` wildcards - all on the fused
  prefix; modules under ``vision_tower``, ``vision_model`` or ``vit_large_projector`` are never
  quantized (``get_quant_method``). Before that, a model class with a weights mapper rewrites an entry ``X*`` (``*`` not after
  ``.``) into ``X`` and ``X.*`` (``apply_vllm_mapper``); whether a class has one is vLLM's per-model
  data, so where the two readings disagree for a module qstrat refuses (:class:`IgnoreRuleError`)
  rather than guess. ModelOpt also quantizes ``lm_head`` (a ``ParallelLMHead``) unless excluded.
- ``compressed-tensors`` (list ``ignore``): ``compressed_tensors.utils.should_ignore_layer``: an entry
  equal to the prefix, or ``re:REGEX`` with ``re.match`` (anchored at the start) - on the fused prefix
  first, else per shard (all or none, else an error at engine start).

vLLM's fused names and shards: ``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up,
``fused_qkv_a_proj`` = DeepSeek's ``q_a_proj`` + ``kv_a_proj_with_mqa`` (:data:`ENGINE_FUSED_NAMES`,
the ``packed_modules_mapping`` of vLLM's model classes). Names are compared in checkpoint form (a
model's weights mapper renames entries and prefixes alike).

Which of the two names vLLM consults for a fused module depends on the model class and the vLLM
version, so :func:`engine_ignore_list` writes BOTH names for every fused module kept whole (why,
and what a shard-only list did: docs/vllm.md, "The ignore list is written in vLLM's terms").
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from qstrat.errors import EngineManifestError

#: vLLM's fused module name for each group of sibling modules it fuses (packed_modules_mapping).
ENGINE_FUSED_NAMES: Mapping[tuple[str, ...], str] = {
    ("q_proj", "k_proj", "v_proj"): "qkv_proj",
    ("gate_proj", "up_proj"): "gate_up_proj",
    ("q_a_proj", "kv_a_proj_with_mqa"): "fused_qkv_a_proj",
}
#: Substrings of module prefixes ModelOpt's ``get_quant_method`` never quantizes (vision towers).
MODELOPT_UNQUANTIZED = ("vision_tower", "vision_model", "vit_large_projector")
#: ModelOpt method names (vLLM's method_to_config entries served by a ModelOpt config).
MODELOPT_METHODS = frozenset({"modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_mixed", "mxfp8"})


class IgnoreRuleError(EngineManifestError):
    """The engine's ignore list cannot be read as vLLM reads it (a fused module it covers in part,
    an entry whose reading depends on vLLM's per-model data, a method qstrat does not know)."""


def engine_ignore_list(entries: Sequence[str], fused: Sequence[Sequence[str]],
                       packed: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """``entries`` (unfused module prefixes, ``model.layers.0.mlp.gate_proj``) as an engine's ignore
    list must say them: each entry, plus vLLM's fused name (``model.layers.0.mlp.gate_up_proj``)
    for every fused group (``fused``: the layout's groups that :data:`ENGINE_FUSED_NAMES` knows, and
    every group of ``packed``, a model class's ``packed_modules_mapping``: fused name -> members,
    e.g. Qwen3.5's ``in_proj_ba`` <- ``in_proj_b``, ``in_proj_a``) whose members are ALL listed
    under one parent; in natural order, no duplicates.

    Why both names: see the module docstring (vLLM matches the fused name or the shards depending
    on the model class and the vLLM version; with both listed every reading keeps the module).
    A group listed in part gets no fused name (vLLM refuses such a list at start, and the plan
    refuses it first: a module with quantized and unquantized tensors).
    """
    from qstrat.plan.data import natural_key

    listed = set(entries)
    out = dict.fromkeys(entries)
    names = {**ENGINE_FUSED_NAMES, **{tuple(m): f for f, m in (packed or {}).items() if len(m) > 1}}
    for group in [*fused, *(packed or {}).values()]:
        name = names.get(tuple(group))
        if name is None:
            continue
        for e in entries:
            parent, _, proj = e.rpartition(".")
            if parent and proj == group[0] and all(f"{parent}.{s}" in listed for s in group):
                out.setdefault(f"{parent}.{name}")
    return sorted(out, key=natural_key)


def with_engine_ignore_list(quantization_config: Mapping[str, Any] | None,
                            fused: Sequence[Sequence[str]]) -> dict[str, Any] | None:
    """A copy of ``quantization_config`` whose ignore list (under the key its method reads,
    :func:`ignore_entries`) is :func:`engine_ignore_list` of it; None stays None.

    Raises: IgnoreRuleError if the list is not a list of strings.
    """
    if quantization_config is None:
        return None
    cfg = dict(quantization_config)
    entries = ignore_entries(cfg)
    if not entries:
        return cfg
    written = engine_ignore_list(entries, fused)
    key = _ignore_key(cfg)
    if key == "quantization.exclude_modules":
        cfg["quantization"] = {**cfg["quantization"], "exclude_modules": written}
    else:
        cfg[key] = written
    return cfg


def method_of(quantization_config: Mapping[str, Any]) -> str:
    """The config's ``quant_method`` as vLLM names it: lower-cased, ``compressed_tensors`` ->
    ``compressed-tensors``, ``modelopt`` for a producer-only ModelOpt hf_quant_config.json."""
    cfg = quantization_config
    producer = cfg.get("producer")
    nested = cfg.get("quantization")
    if (isinstance(producer, Mapping) and producer.get("name") == "modelopt") or (
            isinstance(nested, Mapping) and "modelopt_quant_config" in nested):
        return "modelopt"
    return str(cfg.get("quant_method") or "").lower().replace("compressed_tensors", "compressed-tensors")


def ignore_entries(quantization_config: Mapping[str, Any] | None) -> list[str]:
    """The engine's ignore list as vLLM's method reads it (module docstring: which key, per method).

    Raises: IgnoreRuleError if the list is not a list of strings (vLLM refuses it too).
    """
    cfg = quantization_config or {}
    key = _ignore_key(cfg)
    entries = (cfg.get("quantization") or {}).get("exclude_modules") if key == "quantization.exclude_modules" \
        else cfg.get(key)
    if entries is None:
        return []
    if not isinstance(entries, (list, tuple)) or not all(isinstance(e, str) for e in entries):
        raise IgnoreRuleError(f"quantization_config.{key} must be a list of module names (strings), "
                              f"got {entries!r}")
    return list(entries)


def _ignore_key(cfg: Mapping[str, Any]) -> str:
    """Where the config's method reads its ignore list (module docstring)."""
    method = method_of(cfg)
    if method == "fp8":
        return "ignored_layers" if cfg.get("ignored_layers") or not cfg.get("modules_to_not_convert") \
            else "modules_to_not_convert"
    if method in MODELOPT_METHODS and isinstance(cfg.get("quantization"), Mapping):
        return "quantization.exclude_modules"
    if method == "mxfp8" and not cfg.get("quant_algo"):
        return "ignored_layers"
    return "ignore"


def quantizes_lm_head(quantization_config: Mapping[str, Any] | None) -> bool:
    """Whether the engine's method quantizes ``lm_head`` unless its ignore list excludes it
    (ModelOpt: ``ParallelLMHead`` gets the linear method; ``fp8`` and compressed-tensors' ``Linear``
    targets leave it unquantized)."""
    return bool(quantization_config) and method_of(quantization_config) in MODELOPT_METHODS


def engine_keeps_unquantized(quantization_config: Mapping[str, Any] | None, module: str,
                             shards: Sequence[str] = ()) -> bool:
    """Whether the engine keeps vLLM module ``module`` unquantized, by its method's rule.

    Args:
        quantization_config: the engine's (None or empty: nothing is quantized -> True).
        module: vLLM's prefix of the module (for a fused module its fused name,
            ``model.layers.0.self_attn.qkv_proj``; routed experts ``model.layers.0.mlp.experts``).
        shards: a fused module's member prefixes (``...q_proj``, ``...k_proj``, ``...v_proj``).
    Raises: IgnoreRuleError naming the module and the entries: a fused module the list covers in
        part (vLLM refuses such a config at start), an ``X*`` entry read two ways, an unknown method.
    """
    if not quantization_config:
        return True
    method = method_of(quantization_config)
    entries = ignore_entries(quantization_config)
    if method == "fp8":
        return _exact(module, shards, entries)
    if method == "compressed-tensors":
        return _compressed_tensors(module, shards, entries)
    if method in MODELOPT_METHODS:
        plain = _modelopt(module, shards, entries)
        mapped_entries = _split_trailing_star(entries)
        if mapped_entries != entries and _modelopt(module, shards, mapped_entries) != plain:
            starred = [e for e in entries if e not in mapped_entries]
            raise IgnoreRuleError(
                f"{module}: the engine's ignore entries {starred} exclude it or not depending on vLLM's model "
                "class (one with a weights mapper rewrites 'X*' into 'X' and 'X.*', read as a substring: "
                "ModelOptQuantConfigBase.apply_vllm_mapper); qstrat cannot tell which the engine did - "
                "write 'X.*' or the module names")
        # get_quant_method keeps these unquantized whatever the list says (older ModelOpt exports)
        return plain or any(tower in module for tower in MODELOPT_UNQUANTIZED)
    raise IgnoreRuleError(f"quantization_config.quant_method {method!r}: qstrat does not know how vLLM's "
                          f"method reads its ignore list (known: fp8, compressed-tensors, "
                          f"{', '.join(sorted(MODELOPT_METHODS))})")


def unquantized_modules(quantization_config: Mapping[str, Any] | None, modules: Iterable[str],
                        fused: Sequence[Sequence[str]]) -> dict[str, bool]:
    """For each module (qstrat's unfused ``vllm_module`` names), whether the engine keeps it
    unquantized: members of a fused group (the layout's ``fused``, known to
    :data:`ENGINE_FUSED_NAMES`) are judged together under vLLM's fused name.

    Raises: IgnoreRuleError (:func:`engine_keeps_unquantized`).
    """
    out: dict[str, bool] = {}
    for m in modules:
        if m in out:
            continue
        parent, _, proj = m.rpartition(".")
        group = next((tuple(g) for g in fused if proj in g and tuple(g) in ENGINE_FUSED_NAMES), None)
        if group is None or not parent:
            out[m] = engine_keeps_unquantized(quantization_config, m)
            continue
        shards = [f"{parent}.{s}" for s in group]
        try:
            kept = engine_keeps_unquantized(quantization_config, f"{parent}.{ENGINE_FUSED_NAMES[group]}", shards)
        except _PartialFused as exc:
            raise IgnoreRuleError(f"{parent}.{{{','.join(group)}}}: the engine's ignore list covers some of this "
                                  f"fused module's members but not all ({exc}; vLLM refuses such a checkpoint)") \
                from None
        out.update(dict.fromkeys(shards, kept))
    return out


class _PartialFused(IgnoreRuleError):
    pass


def _fused(prefix: str, shards: Sequence[str], match: Callable[[str], bool]) -> bool:
    """vLLM's fused-module step: the fused prefix itself, else all shards or none."""
    if not shards or match(prefix):
        return match(prefix)
    hits = [match(s) for s in shards]
    if any(hits) and not all(hits):
        raise _PartialFused(f"covered: {[s for s, h in zip(shards, hits) if h]}")
    return all(hits)


def _exact(prefix: str, shards: Sequence[str], entries: Sequence[str]) -> bool:
    """``is_layer_skipped(match_mode="exact")``."""
    if shards:
        return _fused(prefix, shards, lambda p: p in entries)
    if "experts" in prefix:
        return any(prefix in e for e in entries if "experts" in e)
    return prefix in entries


def _modelopt(prefix: str, shards: Sequence[str], entries: Sequence[str]) -> bool:
    """``ModelOptQuantConfigBase.is_layer_excluded``."""
    if not entries:
        return False
    if _exact(prefix, shards, entries):
        return True
    stripped = prefix.removeprefix("language_model.") if prefix.startswith("language_model.") else None
    if any(e != prefix and (e in prefix or (stripped is not None and e in stripped)) for e in entries):
        return True
    return any(fnmatch.fnmatch(prefix, e) for e in entries)


def _split_trailing_star(entries: Sequence[str]) -> list[str]:
    """``ModelOptQuantConfigBase.apply_vllm_mapper``'s rewrite (before its renames)."""
    out: list[str] = []
    for e in entries:
        if len(e) >= 2 and e[-1] == "*" and e[-2] != ".":
            out += [e[:-1], e[:-1] + ".*"]
        else:
            out.append(e)
    return out


def _ct_match(value: str, entry: str) -> bool:
    """``config_utils.is_equal_or_regex_match`` (no substring, no fnmatch)."""
    return bool(re.match(entry[3:], value)) if entry.startswith("re:") else entry == value


def _compressed_tensors(prefix: str, shards: Sequence[str], entries: Sequence[str]) -> bool:
    """``should_ignore_layer`` (via ``find_matching_patterns``)."""
    def match(p: str) -> bool:
        return any(_ct_match(p, e) for e in entries)
    try:
        return _fused(prefix, shards, match)
    except re.error as exc:
        raise IgnoreRuleError(f"quantization_config.ignore: an 're:' entry is not a regular expression ({exc})") \
            from None
