"""Drop-in integrations with RL frameworks (docs/integrations.md).

:mod:`qstrat.integrations.trl` turns Hugging Face TRL's colocated vLLM rollouts into any qstrat
strategy (``pip install 'qstrat[trl]'``). Importing this package imports no framework.
"""
