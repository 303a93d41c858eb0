"""Running vLLM engines beside qstrat (not imported by the core; importing it imports no vLLM).

- :mod:`.local`: start a ``vllm.LLM`` with CPU-friendly limits, greedy-decode, release it (the
  demo and the end-to-end tests), and :func:`.local.engine_support` (can a format run here?).
- :mod:`.emulation`: the ``vllm.general_plugins`` plugin that lets a CPU vLLM engine serve every
  qstrat format it has no native kernels for (block FP8 without AMX, MXFP8, NVFP4).
- :mod:`.transfer_backend`: the vLLM weight-transfer backend ``"qstrat"`` (receives
  :mod:`qstrat.transport` rounds; imports vLLM).
- :mod:`.weight_digests`: a worker extension that reads an engine's weights back as digests
  (routers packed into vLLM's CPU kernel included).

Every vLLM name they use comes through :mod:`qstrat.vllm_adapter` (its version table).
"""
