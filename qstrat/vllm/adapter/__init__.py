"""qstrat's one door to vLLM: the only product code that imports it or reads a vLLM object.

Importing this package does not import vLLM. How to add a vLLM version: docs/vllm.md, "Where
vLLM-version code lives".

- :mod:`.names`: the version table: every vLLM name qstrat uses, where each version has it
- :mod:`.resolver`: :func:`resolve`: a table key -> the installed vLLM's object, or one clear error
- :mod:`.views`: typed views of vLLM objects (``EngineView``, ``WorkerView``, ...): every attribute
  read
- :mod:`.engine_state`: qstrat's own per-engine state, keyed by the engine (not its ``__dict__``)
- :mod:`.platform_facts`: vLLM's platform (device, CPU or not), AMX, in-process engines
- :mod:`.model_record`: vLLM's record of a live engine's model, for the manifest's cross-check
- :mod:`.model_names`: a model class's names: ``hf_to_vllm_mapper`` and fused modules
"""
from __future__ import annotations

from qstrat.vllm.adapter.names import SUPPORTED, TABLE, VERSIONS, VllmName
from qstrat.vllm.adapter.platform_facts import device_name, device_type, has_amx, in_process, is_cpu, vllm_installed
from qstrat.vllm.adapter.resolver import (VllmNameError, VllmVersionError, available, check_supported_version, is_supported, is_known_version, known_versions, location, resolve, vllm_version)

__all__ = ["SUPPORTED", "TABLE", "VERSIONS", "VllmName", "VllmNameError", "VllmVersionError", "available",
           "check_supported_version", "is_supported", "device_name", "device_type", "has_amx",
           "in_process", "is_cpu", "is_known_version", "known_versions", "location", "resolve",
           "vllm_installed", "vllm_version"]
