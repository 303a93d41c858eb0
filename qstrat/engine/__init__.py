"""Running vLLM engines beside qstrat (not imported by the core; importing it imports no vLLM).

- :mod:`.local`: start an in-process ``vllm.LLM`` with CPU-friendly limits, greedy-decode,
  release it (the demo and the end-to-end tests).
- :mod:`.emulation`: emulated kernels that let a CPU vLLM engine serve formats it has no native
  kernels for here.
- :mod:`.transfer_backend`: the vLLM weight-transfer backend ``"qstrat"`` (receives
  :mod:`qstrat.transport` rounds; imports vLLM).
"""
