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

import lazy_loader

#: Public names resolved from the submodules below on first use (lazy_loader, PEP 562), so that
#: importing a submodule of this package imports nothing else.
__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    'checks.live_manifest': ['check_engine_built', 'check_model_built', 'engine_manifest', 'model_manifest'],
    'checks.plan_fit': ['check_cpu_expert_reload', 'check_engine_compatible', 'check_engine_format'],
    'checks.quant_config': ['engine_quantization_config', 'quantization_config_of'],
    'checks.sink_checks': ['engine_checks', 'sink_checks'],
    'sink.engine_flag': ['check_whole_while_flagged'],
    'sink.in_process': ['RefitReport', 'refit'],
})
