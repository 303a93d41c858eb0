"""Built-in strategy presets (installed as ``qstrat.strategies``)."""
