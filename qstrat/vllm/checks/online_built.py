"""Did vLLM build an online-quantizing engine (``quantize_in: engine``) as its ignore list says?

An online engine's ``quantization_config`` is qstrat's plan in vLLM's words: ``linear`` / ``moe``
quantize every linear and routed-experts module, except those its ``ignore`` list names (the
plan's BF16 modules, :func:`qstrat.vllm.online.online_config`). vLLM matches that list against its OWN
module names, unmapped; an entry in another name space (a checkpoint name a model class renames:
gpt-oss ``self_attn`` vs vLLM's ``attn``, Qwen3.5's ``model.language_model.`` vs
``language_model.model.``) matches nothing, and the module it meant is quantized without any
error from vLLM. The engine's config then still equals the plan's, so only vLLM's built modules
tell. :func:`online_build_errors` compares them with the list, right after the engine is built
(:func:`qstrat.vllm.check_engine_built`, :func:`qstrat.vllm.check_model_built`):

- every ignore entry must name a module vLLM built (a linear / fused-MoE module, a member of a
  fused one - ``q_proj`` of ``qkv_proj`` by the class's ``packed_modules_mapping`` or
  :data:`qstrat.vllm.checks.engine_ignore.ENGINE_FUSED_NAMES` -, or any other module, e.g. ``lm_head``), or
  lie under a tower vLLM did not build (``unbuilt``);
- every linear / fused-MoE module vLLM built must be unquantized exactly when the list covers it
  (its name, all its fused members, or a module above it: ``mlp.experts`` covers its
  ``routed_experts``), quantized otherwise.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence

from qstrat.vllm.checks.engine_ignore import ENGINE_FUSED_NAMES

_FUSED = {fused: group for group, fused in ENGINE_FUSED_NAMES.items()}


def online_build_errors(ignore: Sequence[str], quantized: Mapping[str, tuple[str, bool]], modules: frozenset[str],
                        packed: Mapping[str, Sequence[str]], kinds: Sequence[str] = ("linear", "moe"),
                        unbuilt: Sequence[str] = ()) -> list[str]:
    """One line per disagreement between an online config's ``ignore`` list and what vLLM built.

    Args:
        ignore: the engine's online ``ignore`` entries, read as vLLM's online configs read them
            (compressed-tensors' ``should_ignore_layer``): an exact module name (vLLM's), a
            ``re:REGEX`` (``re.match``), or a shell glob (``use_fnmatch``, vLLM 0.30+; on an
            older engine a glob matches nothing, and the module it meant shows built quantized).
        quantized: vLLM module -> (``"linear"`` / ``"moe"``, built quantized), for its linear /
            fused-MoE modules (:attr:`qstrat.vllm.adapter.model_record.EngineModel.quantized`).
        modules: every module name of the built model.
        packed: the model's ``packed_modules_mapping`` (fused name -> member names).
        kinds: the kinds the config quantizes (its ``linear`` / ``moe`` keys): a module of
            another kind must be built unquantized whatever the list says.
        unbuilt: vLLM prefixes of towers the engine did not build (entries under them are unused).
    Returns: lines naming the module or entry, what the list says and what vLLM built; empty: agreed.
    """
    entries = set(ignore)
    groups = {**_FUSED, **{k: tuple(v) for k, v in packed.items()}}
    errors = []
    for module, (kind, built_q) in sorted(quantized.items()):
        if kind not in kinds:
            if built_q:
                errors.append(f"{module}: the online config quantizes no {kind} layers, vLLM built it quantized")
            continue
        kept = _covered(module, entries, groups)
        if kept and built_q:
            errors.append(f"{module}: the online ignore list keeps it BF16, vLLM built it quantized")
        elif not kept and not built_q:
            errors.append(f"{module}: the online ignore list does not name it (the plan quantizes it), vLLM built "
                          "it unquantized")
    members = {f"{m.rpartition('.')[0]}.{s}".lstrip(".") for m in quantized
               for s in groups.get(m.rpartition(".")[2], ())}
    names = modules | members | set(quantized)
    for entry in sorted(entries):
        if entry in modules or entry in members or entry.startswith(tuple(unbuilt)):
            continue
        if _is_pattern(entry) and any(_matches(entry, n) for n in names):
            continue
        near = _nearest(entry, modules)
        errors.append(f"{entry}: an online ignore entry that names no module vLLM built (vLLM matches it against its "
                      f"own names{f'; under {near!r} it has ' + _children(near, modules) if near else ''}): the module "
                      "it means is quantized")
    return errors


def _covered(module: str, entries: set[str], groups: Mapping[str, Sequence[str]]) -> bool:
    """Whether ``entries`` keep ``module`` unquantized: its name, all of its fused members, or an
    entry naming a module above it."""
    parent, _, leaf = module.rpartition(".")
    shards = [f"{parent}.{s}" if parent else s for s in groups.get(leaf, ())]

    def named(name: str) -> bool:
        return any(_matches(e, name) for e in entries)
    if named(module) or (shards and all(named(s) for s in shards)):
        return True
    return any(module.startswith(e + ".") for e in entries if not _is_pattern(e))


def _is_pattern(entry: str) -> bool:
    """A ``re:`` entry or a shell glob (``*``, ``?``, ``[``), not a module name."""
    return entry.startswith("re:") or any(c in entry for c in "*?[")


def _matches(entry: str, name: str) -> bool:
    """compressed-tensors' ``is_equal_or_regex_match`` with vLLM's ``use_fnmatch``."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    if any(c in entry for c in "*?["):
        return fnmatch.fnmatchcase(name, entry)
    return entry == name


def _nearest(entry: str, modules: frozenset[str]) -> str:
    """The longest prefix of ``entry`` that is a module ('' for none)."""
    parts = entry.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return ""


def _children(parent: str, modules: frozenset[str]) -> str:
    """The direct children of module ``parent``, comma-separated (at most 6)."""
    kids = sorted({m[len(parent) + 1:].partition(".")[0] for m in modules if m.startswith(parent + ".")})
    return ", ".join(kids[:6]) + (", ..." if len(kids) > 6 else "")
