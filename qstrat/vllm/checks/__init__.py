"""What an engine accepts, checked before the first byte: a new engine check is a module here,
added to :func:`~qstrat.vllm.checks.sink_checks.engine_checks`, reading the engine only
through :mod:`qstrat.vllm.adapter.views`.

- :mod:`.sink_checks`: :func:`engine_checks` / :func:`sink_checks`: the checks a refit runs first
- :mod:`.engine_manifest`: the engine manifest: every checkpoint tensor an engine accepts, by reload
  unit
- :mod:`.live_manifest`: a live engine's manifest, cross-checked with vLLM's record of its model
- :mod:`.plan_fit`: a plan against the engine's format, both ways of its ignore list, CPU experts
- :mod:`.engine_ignore`: which modules an engine keeps unquantized: vLLM's rule per method
- :mod:`.quant_config`: the checkpoint ``quantization_config`` of an engine, read where vLLM reads
  it
- :mod:`.cpu_experts`: unquantized routed experts and a CPU engine: which, and why it refuses them
- :mod:`.online_built`: did vLLM build an online-quantizing engine as its ignore list says
"""
