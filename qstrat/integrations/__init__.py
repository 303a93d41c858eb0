"""Drop-in integrations with RL frameworks (docs/integrations.md).

:mod:`qstrat.integrations.trl` turns Hugging Face TRL's colocated vLLM rollouts into any qstrat
strategy (``pip install 'qstrat[trl]'``); :mod:`~qstrat.integrations.verl` and
:mod:`~qstrat.integrations.nemo_rl` are vLLM worker extensions for verl 0.9.1 and NeMo-RL 0.7.0;
:mod:`~qstrat.integrations.skyrl` is a vLLM ``WeightSource`` for SkyRL 0.4.0's trainer workers.
Importing this package imports no framework.
"""
