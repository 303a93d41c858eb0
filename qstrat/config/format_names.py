"""What the field calls qstrat's formats: the names users and vLLM give them, and how a message
spells one.

- :data:`FORMAT_ALIASES`: a name a user may type for a format (vLLM's ``quant_method`` /
  quantization method names, the field's shorthand) -> qstrat's serializer name. ``fp8`` is
  block FP8 here: the only FP8 weight format qstrat writes is DeepSeek-V3's 128x128 block
  scales, which vLLM loads as ``quant_method: fp8`` with ``weight_block_size``.
- :func:`alias_of`: the choice (a serializer or a preset name) an alias stands for.
- :func:`method_title`: vLLM's quantization method name (``model_config.quantization``) with
  qstrat's format beside it: ``'modelopt_fp4' (NVFP4)``.
- :func:`format_title`: ``block_fp8`` -> ``block FP8``, ``nvfp4`` -> ``NVFP4``, for messages.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

#: field name (lower case, ``-`` read as ``_``) -> (qstrat serializer, what the name means)
FORMAT_ALIASES: dict[str, tuple[str, str]] = {
    "fp8": ("block_fp8", "block FP8 with DeepSeek-style 128x128 scales, vLLM's quant_method 'fp8'"),
    "fp8_block": ("block_fp8", "block FP8, 128x128 scales"),
    "blockfp8": ("block_fp8", "block FP8, 128x128 scales"),
    "deepseek_fp8": ("block_fp8", "block FP8, DeepSeek-V3's 128x128 scales"),
    "fp4": ("nvfp4", "NVFP4, E2M1 with E4M3 scales per 16"),
    "modelopt_fp4": ("nvfp4", "vLLM's method name for ModelOpt NVFP4"),
    "modelopt_nvfp4": ("nvfp4", "ModelOpt NVFP4"),
    "modelopt_mxfp8": ("mxfp8", "vLLM's method name for ModelOpt MXFP8"),
    "mx_fp8": ("mxfp8", "MXFP8, E8M0 scales per 32"),
    "bfloat16": ("bf16", "unquantized BF16"),
}


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def alias_of(name: str, choices: Iterable[str]) -> tuple[str, str] | None:
    """``(choice, meaning)`` for a ``name`` that is an alias of one of ``choices`` (a serializer
    name, or a preset spelled with ``-``: ``fp8`` -> ``block_fp8`` / ``block-fp8``), else None."""
    alias = FORMAT_ALIASES.get(_norm(name))
    if alias is None:
        return None
    return next(((c, alias[1]) for c in choices if _norm(c) == alias[0]), None)


_FORMAT_WORD = re.compile(r"(?:[a-z]*fp\d+|bf16)")


def format_title(name: str) -> str:
    """A serializer name as messages spell it: ``block_fp8`` -> ``block FP8``, ``mxfp8`` ->
    ``MXFP8``; a name without a format word (a plugin's ``toy_sign``) is returned as it is."""
    words = name.split("_")
    if not any(_FORMAT_WORD.fullmatch(w) for w in words):
        return name
    return " ".join(w.upper() if _FORMAT_WORD.fullmatch(w) else w for w in words)


def method_title(method: str | None) -> str:
    """``"'modelopt_fp4' (NVFP4)"``: vLLM's quantization method name, with the format qstrat
    writes for it where :data:`FORMAT_ALIASES` names one (``fp8``: block FP8), else as given."""
    alias = FORMAT_ALIASES.get(_norm(method)) if isinstance(method, str) else None
    return f"{method!r} ({format_title(alias[0])})" if alias else repr(method)
