"""Everything qstrat does with vLLM, in one package; only :mod:`.adapter` imports vLLM or reads
a vLLM object (through its views). Importing this package does not import vLLM.

``qstrat.vllm.refit(llm, driver, tensors)`` and the sink's other public names resolve lazily
from the subpackages below (``from qstrat.vllm import refit`` works as before).

- :mod:`.adapter` (package): the one door to vLLM: the version table, the resolver, views of vLLM
  objects
- :mod:`.checks` (package): what an engine accepts, checked before the first byte (a new engine
  check goes here)
- :mod:`.sink` (package): refit a running engine in-process (or from inside a worker): reload, MIX
  flag, KV scales
- :mod:`.online`: ``quantize_in: engine``: the plan as vLLM's online config and ignore list
- :mod:`.engine` (package): running engines: in-process, HTTP server, the transfer backend, weight
  digests
- :mod:`.emulation` (package): qstrat's CPU kernels for formats vLLM has none for (a vLLM plugin)
- :mod:`.fidelity` (package): does the engine serve, numerically, what a refit sent
"""

#: Public name -> the module defining it, imported on first use (so that importing a
#: submodule of this package imports nothing else).
_EXPORTS = {
    'RefitReport': 'qstrat.vllm.sink.in_process',
    'check_cpu_expert_reload': 'qstrat.vllm.checks.plan_fit',
    'check_engine_built': 'qstrat.vllm.checks.live_manifest',
    'check_engine_compatible': 'qstrat.vllm.checks.plan_fit',
    'check_engine_format': 'qstrat.vllm.checks.plan_fit',
    'check_model_built': 'qstrat.vllm.checks.live_manifest',
    'check_whole_while_flagged': 'qstrat.vllm.sink.engine_flag',
    'engine_checks': 'qstrat.vllm.checks.sink_checks',
    'engine_manifest': 'qstrat.vllm.checks.live_manifest',
    'engine_quantization_config': 'qstrat.vllm.checks.quant_config',
    'model_manifest': 'qstrat.vllm.checks.live_manifest',
    'quantization_config_of': 'qstrat.vllm.checks.quant_config',
    'refit': 'qstrat.vllm.sink.in_process',
    'sink_checks': 'qstrat.vllm.checks.sink_checks',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
