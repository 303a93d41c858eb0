"""Refit a running vLLM engine through its layerwise reload (``reload_weights``), which has no
rollback: every check runs first (:mod:`qstrat.vllm.checks`); a failure once the engine began
loading finalizes the reload and FLAGS the engine (:mod:`qstrat.execute.mix_rule`).

- :mod:`.in_process`: :func:`refit` and :class:`RefitReport`: the in-process sink
- :mod:`.in_worker`: :func:`refit_worker`: a refit from inside a vLLM worker (verl, NeMo-RL)
- :mod:`.reload`: vLLM's layerwise reload and what a failure once it began does
- :mod:`.engine_flag`: an in-process engine's MIX flag, on the rule of
  :mod:`qstrat.execute.mix_rule`
- :mod:`.spool`: a refit through a file, for engines that cannot take tensors through the RPC
- :mod:`.kv_scales`: FP8 KV-cache scales: read them, refuse a reload that reset them
"""
