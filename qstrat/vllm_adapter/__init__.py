"""qstrat's one door to vLLM: the only product code that imports it.

* :mod:`.names`: the version table - every vLLM name qstrat uses, what it is, what qstrat uses it
  for, public or private, where each vLLM version has it, the public alternative;
* :mod:`.resolver`: :func:`resolve` (a table key -> the installed vLLM's object, or one clear
  :class:`VllmNameError`), :func:`vllm_version`;
* :mod:`.platform_facts`: vLLM's platform (device type, CPU or not), AMX, in-process engines;
* :mod:`.model_record`: vLLM's record of a live engine's model, for the engine manifest's
  cross-check.

Importing this package does not import vLLM. How to add a vLLM version: docs/vllm.md, "Where
vLLM-version code lives".
"""
from __future__ import annotations

from qstrat.vllm_adapter.names import SUPPORTED, TABLE, VERSIONS, VllmName
from qstrat.vllm_adapter.platform_facts import device_name, device_type, has_amx, in_process, is_cpu, vllm_installed
from qstrat.vllm_adapter.resolver import (VllmNameError, VllmVersionError, available, check_supported_version,
                                          is_supported, is_known_version, known_versions, location, resolve,
                                          vllm_version)

__all__ = ["SUPPORTED", "TABLE", "VERSIONS", "VllmName", "VllmNameError", "VllmVersionError", "available",
           "check_supported_version", "is_supported", "device_name", "device_type", "has_amx",
           "in_process", "is_cpu", "is_known_version", "known_versions", "location", "resolve",
           "vllm_installed", "vllm_version"]
