"""Running vLLM engines beside qstrat (not imported by the core; importing it imports no vLLM).

- :mod:`.local`: start an in-process ``vllm.LLM`` (CPU-friendly limits), greedy-decode, release it
- :mod:`.http_server`: a vLLM HTTP server in its own process group for a ``with`` block
- :mod:`.transfer_backend`: the vLLM weight-transfer backend ``"qstrat"`` (receives transport
  rounds)
- :mod:`.weight_digests`: a worker extension that reads an engine's weights back as digests
"""
