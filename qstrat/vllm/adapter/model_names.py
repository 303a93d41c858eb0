"""A vLLM model class's module names: how it renames checkpoint modules, and which it fuses.

vLLM matches a quantization config's module lists (an ignore list) against ITS module names.
For a checkpoint's ``quantization_config`` it first rewrites the list with the model class's
``hf_to_vllm_mapper`` (``configure_quant_config`` / ``SupportsQuant``: ``apply_vllm_mapper`` with
the mapper less its stacked renames - ``get_unstacked_mapper`` before vLLM 0.29,
``get_rename_mapper`` from 0.29); an ONLINE config's ``ignore`` list is not rewritten (vLLM
0.27-0.32: ``OnlineQuantizationConfig`` has no ``apply_vllm_mapper``), so qstrat writes it in
vLLM's names itself, with the same mapper (:meth:`ClassNames.vllm_module`). Examples: gpt-oss
``model.layers.0.self_attn.q_proj`` -> ``model.layers.0.attn.q_proj``; Qwen3.5's multimodal class
``model.language_model.layers.0...`` -> ``language_model.model.layers.0...``, ``model.visual...``
-> ``visual...``, ``lm_head`` -> ``language_model.lm_head``.

Every read goes through the version table (:mod:`.names`: ``model_registry``,
``model_registry_load_class``, ``hf_to_vllm_mapper``, ``weights_mapper_rename``,
``weights_mapper_apply_list``, ``packed_modules_mapping``). Importing this module does not import vLLM.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qstrat.vllm.adapter import names
from qstrat.vllm.adapter.resolver import resolve
from qstrat.vllm.adapter.views import call, installed_version, read


@dataclass(frozen=True)
class ClassNames:
    """One vLLM model class's names.

    Attributes:
        model_class: the class's qualified name (``vllm.model_executor.models.gpt_oss.GptOssForCausalLM``).
        mapper: its rename mapper (``hf_to_vllm_mapper`` less stacked renames), None: names unchanged.
        packed: its class-level ``packed_modules_mapping`` (fused module -> member modules).
    """

    model_class: str
    mapper: Any = None
    packed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def vllm_module(self, module: str) -> str | None:
        """Checkpoint module prefix ``module`` as vLLM names it: the mapper applied to
        ``module + "."`` (a module prefix: prefix and substring renames apply, as to every name
        under it - ``lm_head.`` -> ``language_model.lm_head.`` - while suffix renames of weight
        names, gpt-oss's ``.gate_up_proj`` -> ``.w13_weight``, do not), less the dot; None where
        the mapper drops it (e.g. Qwen3.5's ``mtp.``: modules vLLM does not build)."""
        if self.mapper is None:
            return module
        mapped = call(self.mapper, "weights_mapper_apply_list", [f"{module}."])
        return mapped[0][:-1] if mapped and mapped[0].endswith(".") else (mapped[0] if mapped else None)


def class_names(architectures: Sequence[str]) -> ClassNames | None:
    """The :class:`ClassNames` of the vLLM model class the first of ``architectures`` (a
    config.json's ``architectures``) that vLLM registers selects; None where vLLM is not
    installed. Cached per tuple of architectures.

    Raises: LookupError naming the architectures when vLLM has no class for any of them;
        ImportError when the class cannot be imported here (e.g. Qwen3.5's, whose module imports
        torchvision, where it is missing).
    """
    return _class_names(tuple(architectures))


@lru_cache(maxsize=32)
def _class_names(architectures: tuple[str, ...]) -> ClassNames | None:
    """:func:`class_names`, uncached."""
    if importlib.util.find_spec(names.PACKAGE) is None:
        return None
    registry = resolve("model_registry")
    known = set(call(registry, "model_registry_supported_archs"))
    for arch in architectures:
        if arch not in known:
            continue
        cls = call(registry, "model_registry_load_class", arch)
        if cls is None:  # vLLM logged the import error and returned None
            raise ImportError(f"vLLM {installed_version()}'s model class for {arch} cannot be imported here "
                              "(vLLM's log says why, e.g. a module it needs - torchvision - is missing)")
        return of_class(cls)
    raise LookupError(f"vLLM {installed_version()} has no model class for architectures {list(architectures)}")


def of_class(cls: Any) -> ClassNames:
    """The :class:`ClassNames` of vLLM model class (or model) ``cls``."""
    mapper = read(cls, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = call(mapper, "weights_mapper_rename")
    packed = read(cls, "packed_modules_mapping", None) or {}
    qualname = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', type(cls).__name__)}"
    return ClassNames(qualname, mapper, {k: tuple(v) for k, v in packed.items()})
