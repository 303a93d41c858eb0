"""Drop-in integrations with RL frameworks (docs/integrations.md). Importing this package imports
no framework.

- :mod:`.trl`: Hugging Face TRL's colocated vLLM rollouts with any qstrat strategy (``qstrat[trl]``)
- :mod:`.trl_server`: TRL's server mode with the ``qstrat`` weight-transfer backend
- :mod:`.trl_sync`: what both TRL modes share: the sync, its metrics
- :mod:`.verl`: a vLLM worker extension for verl 0.9.1
- :mod:`.nemo_rl`: a vLLM worker extension for NeMo-RL 0.7.0
- :mod:`.skyrl`: a vLLM ``WeightSource`` for SkyRL 0.4.0's trainer workers
- :mod:`.skyrl_fidelity`: a SkyRL callback logging the fidelity probe after each weight sync
- :mod:`.demo_check`: the check every framework demo runs
- :mod:`.trl_demo`: ``python -m qstrat.integrations.trl_demo``
- :mod:`.trl_server_demo`: ``python -m qstrat.integrations.trl_server_demo``
- :mod:`.verl_demo`: ``python -m qstrat.integrations.verl_demo``
- :mod:`.nemo_rl_demo`: ``python -m qstrat.integrations.nemo_rl_demo``
"""
